"""A snapshot location in an object store: tensorstore's kvstore API under one URL prefix (`KvLocation`), with the
operations the snapshot store and the cross-replica leases need: whole-object reads and writes, conditional writes
(create-only, compare-and-swap on the object's storage generation), deletes, listing, each bounded by a timeout.

Drivers (`omnijax.serve.engine.snapshot_paths.KV_SCHEMES`): `gs://` (gcs), `s3://` (s3), `file://` (a local
directory through tensorstore's file driver, which implements the same conditional writes with lock files, across
processes) and `memory://` (one process's memory). Every location of a process opens through one tensorstore
`Context`, so all `memory://` URLs of a process are one store (as one bucket is for every client); another process
never sees it.

`open_location` refuses, by name and before a session starts: an unknown scheme (`snapshot_paths.location`), a
driver this tensorstore was built without, and a location that cannot be written: it writes and deletes a probe
object, for `gs://` / `s3://` with few retries, so an unreachable bucket (no network, no such bucket, no
credentials) is refused within seconds with the driver's reason instead of retrying for minutes.
"""

from __future__ import annotations

import functools
import secrets
import threading
from typing import Any

import tensorstore as ts

from omnijax.serve.engine.snapshot_paths import KvUrl, location

TIMEOUT_S = 120.0  # the longest one kvstore operation may take before it fails (TimeoutError)
PROBE_TIMEOUT_S = 30.0
PROBE_PREFIX = ".write-probe."
_PROBE_RETRIES = {"max_retries": 2, "initial_delay": "0.2s", "max_delay": "1s"}
_lock = threading.Lock()
_context: ts.Context | None = None


class KvStoreError(OSError):
    """A kvstore operation failed (the driver's reason, the location's URL and the key named)."""


def _process_context() -> ts.Context:
    global _context
    with _lock:
        if _context is None:
            _context = ts.Context()
        return _context


@functools.cache
def no_value() -> bytes:
    """The storage generation of a missing key: a write conditioned on it creates the key or fails."""
    store = ts.KvStore.open("memory://", context=ts.Context()).result()
    return store.read("missing").result().stamp.generation


def _brief(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:300] if text else type(error).__name__


class KvLocation:
    """One URL prefix of a kvstore (module docstring); keys are relative to it (`"<token>/000000000003..."`).

    Args:
        url: the location (`snapshot_paths.KvUrl`).
        timeout_s: the bound on each operation.
        context: the tensorstore context (default: the process's, shared by every location).
    """

    def __init__(self, url: KvUrl, *, timeout_s: float = TIMEOUT_S, context: ts.Context | None = None):
        self.url, self.timeout_s = url, float(timeout_s)
        try:
            self.store = ts.KvStore.open(url.url, context=context or _process_context()).result()
        except ValueError as e:
            if "unsupported URL scheme" in str(e) or "not registered" in str(e):
                raise ValueError(f"{url.url}: this tensorstore was built without its {url.driver!r} kvstore driver "
                                 f"({_brief(e)}); use a build that has it, or another location") from e
            raise ValueError(f"{url.url}: not a usable kvstore location ({_brief(e)})") from e

    def __repr__(self) -> str:
        return f"KvLocation({self.url.url!r})"

    def _wait(self, future: Any, what: str, key: str) -> Any:
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError as e:
            future.cancel()
            raise KvStoreError(f"{what} {self.url.url}{key}: no answer within {self.timeout_s:g} s") from e
        except Exception as e:  # tensorstore raises ValueError (and others) carrying the driver's status
            raise KvStoreError(f"{what} {self.url.url}{key} failed: {_brief(e)}") from e

    # ----------------------------------------------------------------------------------------------- operations
    def read(self, key: str) -> tuple[bytes | None, bytes]:
        """`(value, generation)` of `key`; `(None, no_value())` when it is missing."""
        got = self._wait(self.store.read(key), "reading", key)
        if got.state == "missing":
            return None, no_value()
        return bytes(got.value), bytes(got.stamp.generation)

    def write(self, key: str, value: bytes | None, if_equal: bytes | None = None) -> bytes | None:
        """Writes (`value`) or deletes (None) `key`, only if its generation is `if_equal` when given; the new
        generation, or None when the condition did not hold (nothing changed). Durable when it returns, as far as
        the driver guarantees."""
        got = self._wait(self.store.write(key, value, if_equal=if_equal), "writing" if value is not None else
                         "deleting", key)
        generation = bytes(got.generation)
        return None if if_equal is not None and not generation else generation

    def create(self, key: str, value: bytes) -> bytes | None:
        """Writes `key` only if it does not exist: its generation, or None when it did."""
        return self.write(key, value, if_equal=no_value())

    def delete(self, key: str, if_equal: bytes | None = None) -> bool:
        """Deletes `key` (only if its generation is `if_equal`, when given); whether the condition held."""
        return self.write(key, None, if_equal=if_equal) is not None

    def list(self, prefix: str = "") -> list[str]:
        """The keys under `prefix` (relative to the location), sorted."""
        key_range = ts.KvStore.KeyRange(prefix, _after(prefix)) if prefix else ts.KvStore.KeyRange()
        got = self._wait(self.store.list(key_range), "listing", prefix)
        return sorted(k.decode("utf-8") if isinstance(k, bytes) else str(k) for k in got)

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under `prefix` (not empty)."""
        if not prefix:
            raise ValueError("delete_prefix needs a prefix (it would delete the whole location)")
        self._wait(self.store.delete_range(ts.KvStore.KeyRange(prefix, _after(prefix))), "deleting", prefix)


def _after(prefix: str) -> str:
    """The smallest key above every key that starts with `prefix` (the exclusive end of its range)."""
    head = prefix.encode("utf-8").rstrip(b"\xff")
    return (head[:-1] + bytes([head[-1] + 1])).decode("utf-8", "surrogateescape") if head else ""


def open_location(path: str | KvUrl, what: str = "the snapshot location", *,
                  probe_timeout_s: float = PROBE_TIMEOUT_S) -> KvLocation:
    """Opens a kvstore URL location and checks that it can be written (module docstring).

    Raises:
        ValueError: an unknown scheme, a driver this tensorstore lacks, or a location that cannot be written
            (unreachable, no such bucket, no credentials, read-only): the URL, the cause and what to do, named.
    """
    url = path if isinstance(path, KvUrl) else location(path, what)
    if not isinstance(url, KvUrl):
        raise ValueError(f"{what} {path!r} is a directory path, not a kvstore URL")
    try:
        found = KvLocation(url)
    except ValueError as e:
        raise ValueError(f"{what} {e}") from e
    remote = url.scheme in ("gs", "s3")
    probe_context = ts.Context({f"{'gcs' if url.scheme == 'gs' else 's3'}_request_retries": _PROBE_RETRIES}) \
        if remote else None
    probe = KvLocation(url, timeout_s=probe_timeout_s, context=probe_context) if remote else found
    key = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        probe.write(key, b"omnijax write probe")
        probe.delete(key)
    except KvStoreError as e:
        raise ValueError(f"{what} {url.url} cannot be written by this server ({e}): sessions could not be "
                         f"snapshotted or resumed there; check the bucket's name, this host's network and "
                         f"credentials ({'GOOGLE_APPLICATION_CREDENTIALS' if url.scheme == 'gs' else 'AWS_*'} or "
                         f"the instance's service account), or give a directory path") from e
    return found
