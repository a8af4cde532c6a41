"""The on-disk store of resumable Realtime sessions (`omnijax serve --snapshot-dir`): leases, atomic replacement,
clean-up, a size cap and an expiry. No model is needed; `omnijax.serve.realtime.session` drives it.

Layout: the directory (mode 0700) holds one folder per resume token, and in it one generation per write:

    <dir>/<token>/000000000007/   a `save_snapshot` directory (session.json + arrays/), the newest generation
    <dir>/<token>/000000000006/   the previous one, deleted only once its successor is on disk and synced

A generation appears whole (written beside it as `.<name>.*.tmp`, synced, renamed), so a reader sees the newest
complete one, never a partial write; a SIGKILL at any moment leaves at worst a temp folder, removed (and logged) when
the next server opens the directory. A folder of the older layout (`<dir>/<token>/session.json`) is moved into a
generation when the store opens. (`DirStorage` reads and writes this layout.)

Object stores: `--snapshot-dir gs://bucket/prefix` (or `s3://`, `file:///`, `memory://`) keeps the same generations,
each one object written through tensorstore's kvstore API (`omnijax.serve.realtime.snapshot_store_kv.KvStorage`);
the leases, caps and expiry below are the same.

Leases: a token is held by at most one connection at a time (`acquire`). A second connection with a token whose
holder is still connected is refused (`TokenInUse`) after a short grace (`live_grace_s`, in case the holder's
disconnect is still on its way); a holder that is closing (writing its last snapshot) is waited for, up to
`write_wait_s`, so a quick reconnect resumes the state the closing connection writes.

Caps: `max_bytes` bounds the directory's total size: before a write the oldest snapshots of tokens nobody holds are
evicted to make room; when there is no room even so, the write is refused (`StoreFull`) and the session's previous
snapshot stays. `max_age_s` expires snapshots not written for that long (at open, and at every write and lease).
Every eviction is logged. Errors meant for clients (`SnapshotStoreError` and `public_message`) never carry the
server's paths.

Intervals (`parse_every`, the `--snapshot-every` syntax): `30s`, `2m`, `1h` (seconds of activity between periodic
snapshots, also `1.5s`), or `5turns` / `1turn` (every n-th response that ends); `0` turns periodic snapshots off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from omnijax.serve.engine.snapshot import MANIFEST, SessionSnapshot, load_snapshot, save_snapshot
from omnijax.serve.engine.snapshot_paths import location
from omnijax.serve.realtime.snapshot_store_kv import KvStorage

log = logging.getLogger("omnijax.serve")
TOKEN_RE = re.compile(r"[0-9a-f]{32}")
GENERATION_RE = re.compile(r"[0-9]{12}")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class SnapshotStoreError(ValueError):
    """A store failure whose message may go to a client (it names no server path)."""


class TokenInUse(SnapshotStoreError):
    """The resume token is held by another connection."""


class StoreFull(SnapshotStoreError):
    """The write would take the directory over its size cap, and nothing can be evicted to make room."""


def parse_duration(text: str, what: str = "a duration") -> float:
    """Seconds of `"90"`, `"90s"`, `"30m"`, `"24h"` or `"7d"` (ValueError naming `what` otherwise); >= 0."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise ValueError(f"{what} is a number of seconds, optionally with a unit: '90', '90s', '30m', '24h' or "
                         f"'7d'; got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_every(text: str) -> tuple[float, int]:
    """`(seconds, turns)` of a `--snapshot-every` value (module docstring); one of them is 0, both when off.

    Raises:
        ValueError: naming the accepted forms.
    """
    m = re.fullmatch(r"\s*([0-9]+)\s*turns?\s*", str(text))
    if m:
        return 0.0, int(m.group(1))
    try:
        return parse_duration(text, "--snapshot-every"), 0
    except ValueError:
        raise ValueError(f"--snapshot-every takes seconds of activity ('30s', '2m', '1h') or responses ('5turns', "
                         f"'1turn'), or 0 for none; got {text!r}") from None


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclasses.dataclass(eq=False)
class Lease:
    """One connection's hold on a token. `closing` is set once the connection ends (its last write follows)."""

    token: str
    closing: bool = False


@dataclasses.dataclass
class _Entry:
    bytes: int
    written: float  # wall-clock time of the newest generation


class DirStorage:
    """Snapshots in a local or mounted POSIX directory (the module docstring's layout): each generation a
    `save_snapshot` directory. `SnapshotStore` keeps the leases, caps and expiry; this class only reads and writes.
    `omnijax.serve.realtime.snapshot_store_kv.KvStorage` is the same interface over an object store.

    Args:
        root: the directory.
    """

    def __init__(self, root: Path):
        self.root = root

    def open(self) -> None:
        """Creates the directory (0700), tightens a readable one, and refuses one this process cannot write."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            mode = stat.S_IMODE(self.root.stat().st_mode)
            if not self.root.is_dir():
                raise NotADirectoryError("not a directory")
        except OSError as e:
            raise ValueError(f"--snapshot-dir {self.root}: cannot use it as the snapshot directory: "
                             f"{e.strerror or e}") from e
        self._probe_write()
        if mode & 0o077:
            try:
                os.chmod(self.root, 0o700)
            except OSError as e:
                raise ValueError(f"--snapshot-dir {self.root} is readable by other users (mode {mode:o}) and cannot "
                                 f"be tightened to 0700 ({e.strerror}); fix its mode or pick another directory") from e
            log.warning("snapshot dir %s was mode %o (other users could list or read sessions): tightened to 700",
                        self.root, mode)

    def _probe_write(self) -> None:
        """Creates and removes a file in the directory, so one this process cannot write to (a read-only mount,
        another user's folder, a full disk) is refused when the server starts, not at the first snapshot. The file is
        named like a temp folder of a killed write (`.*.tmp`), so a kill in between leaves what `clean` removes."""
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe.", suffix=".tmp", dir=self.root)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"--snapshot-dir {self.root} is not writable by this server ({e.strerror or e}): "
                             f"sessions could not be snapshotted or resumed there; give a directory this server's "
                             f"user can create files in (with --replicas, one every replica can write), or fix its "
                             f"permissions or mount") from e

    def clean(self) -> int:
        """Removes the temp folders a killed write left, and moves old-layout snapshots into a generation."""
        removed = 0
        for p in list(self.root.iterdir()):  # the older layout: <token>/session.json, moved via .<token>.migrating
            if p.is_dir() and TOKEN_RE.fullmatch(p.name) and (p / MANIFEST).is_file():
                os.rename(p, self.root / f".{p.name}.migrating")
        for p in list(self.root.iterdir()):
            m = re.fullmatch(r"\.([0-9a-f]{32})\.migrating", p.name)
            if m:
                folder = self.root / m.group(1)
                folder.mkdir(mode=0o700, exist_ok=True)
                if not self.generations(m.group(1)):
                    os.rename(p, folder / f"{0:012d}")
                    log.info("snapshot dir: moved the snapshot of %s... into the generation layout", m.group(1)[:8])
        for folder in [self.root] + [p for p in self.root.iterdir() if p.is_dir() and TOKEN_RE.fullmatch(p.name)]:
            for p in list(folder.iterdir()):
                if p.name.startswith(".") and p.name.endswith((".tmp", ".old", ".migrating")):
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                    removed += 1
                    log.warning("snapshot dir: removed %s, left by an interrupted write", p)
        if removed:
            log.warning("snapshot dir: cleaned %d temp folder(s) of interrupted writes", removed)
        return removed

    def scan(self) -> dict[str, tuple[int, float]]:
        """Every token with a snapshot: its bytes and the time of its newest generation."""
        found = {}
        for p in self.root.iterdir():
            if p.is_dir() and TOKEN_RE.fullmatch(p.name):
                gens = self.generations(p.name)
                if gens:
                    found[p.name] = (_tree_bytes(p), gens[-1].stat().st_mtime)
        return found

    def generations(self, token: str) -> list[Path]:
        """The token's generations, oldest first."""
        try:
            return sorted(p for p in (self.root / token).iterdir() if GENERATION_RE.fullmatch(p.name) and p.is_dir())
        except OSError:
            return []

    @staticmethod
    def number(generation: Path) -> int:
        """A generation's number."""
        return int(generation.name)

    def write(self, token: str, number: int, snapshot: SessionSnapshot, now: float) -> Path:
        """Writes generation `number` of `token` (synced to disk, folder included, before it returns)."""
        folder = self.root / token
        folder.mkdir(mode=0o700, exist_ok=True)
        return save_snapshot(folder / f"{number:012d}", snapshot)

    @staticmethod
    def read(generation: Path) -> SessionSnapshot:
        """The snapshot of a generation (OSError, ValueError)."""
        return load_snapshot(generation)

    @staticmethod
    def drop(generation: Path) -> None:
        """Deletes one generation."""
        shutil.rmtree(generation, ignore_errors=True)

    def remove(self, token: str) -> None:
        """Deletes every generation of a token."""
        shutil.rmtree(self.root / token, ignore_errors=True)

    def token_bytes(self, token: str) -> int:
        """The bytes a token's snapshots take."""
        return _tree_bytes(self.root / token)


def open_storage(root: str | os.PathLike, *, probe_timeout_s: float | None = None) -> DirStorage | KvStorage:
    """The storage of a snapshot location: `DirStorage` for a directory path, `KvStorage` for a kvstore URL
    (`omnijax.serve.engine.snapshot_paths.location`); opened (created, checked writable), not yet cleaned.

    Raises:
        ValueError: the location cannot be used (named: an unknown URL scheme, an unwritable directory, an
            unreachable bucket).
    """
    where = location(root, "--snapshot-dir")
    if isinstance(where, Path):
        storage = DirStorage(where)
        storage.open()
        return storage
    return KvStorage.open(where, probe_timeout_s=probe_timeout_s)


class SnapshotStore:
    """The snapshot store of a server: a directory, or an object store (module docstring).

    Args:
        root: the directory; created with mode 0700 when missing, tightened to 0700 (logged) when group or others
            may read it, refused (ValueError) when that is not possible or when this process cannot create files in
            it. Or a kvstore URL (`gs://bucket/prefix`, `s3://...`, `file:///...`, `memory://...`:
            `omnijax.serve.realtime.snapshot_store_kv`), refused (ValueError) when it cannot be written.
        max_bytes: the cap on the directory's total size (None: none).
        max_age_s: snapshots not written for this long are deleted (None or 0: never).
        write_wait_s: how long `acquire` waits for a closing holder's last write.
        live_grace_s: how long `acquire` waits for a connected holder to start closing before `TokenInUse`.
        clock: wall-clock seconds (tests).
        probe_timeout_s: how long opening an object-store location may take to write its probe (default
            `omnijax.serve.engine.snapshot_kv.PROBE_TIMEOUT_S`).
    """

    def __init__(self, root: str | os.PathLike, *, max_bytes: int | None = None, max_age_s: float | None = None,
                 write_wait_s: float = 30.0, live_grace_s: float = 1.0,
                 clock: Callable[[], float] = time.time, probe_timeout_s: float | None = None):
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 (or None for no cap), got {max_bytes}")
        if max_age_s is not None and not max_age_s >= 0:
            raise ValueError(f"max_age_s must be >= 0 (or None), got {max_age_s}")
        self.max_bytes, self.max_age_s = max_bytes, (max_age_s or None)
        self.write_wait_s, self.live_grace_s, self.clock = write_wait_s, live_grace_s, clock
        self._lock = threading.RLock()
        self._leases: dict[str, Lease] = {}
        self._entries: dict[str, _Entry] = {}
        self.storage = open_storage(root, probe_timeout_s=probe_timeout_s)
        self.root = self.storage.root  # a Path, or the URL (a str)
        self.cleaned = self._clean()
        self._scan()
        self.expire()

    # ------------------------------------------------------------------------------------------------ opening
    def _clean(self) -> int:
        """Removes what killed writes left (`DirStorage.clean`); the number removed."""
        return self.storage.clean()

    def _scan(self) -> None:
        with self._lock:
            self._entries.clear()
            self._entries.update({token: _Entry(*found) for token, found in self.storage.scan().items()})

    # ------------------------------------------------------------------------------------------------ queries
    def _generations(self, token: str) -> list:
        return self.storage.generations(token)

    def latest(self, token: str) -> Path | str | None:
        """The newest generation of a token (a directory, or an object's URL), or None."""
        gens = self._generations(self._check(token))
        return gens[-1] if gens else None

    def total_bytes(self) -> int:
        """The bytes of every snapshot the store knows of."""
        with self._lock:
            return sum(e.bytes for e in self._entries.values())

    def held(self, token: str) -> bool:
        """Whether a connection holds the token."""
        return token in self._leases

    @staticmethod
    def _check(token: str) -> str:
        if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
            raise SnapshotStoreError("a resume token is the 32 hex digits session.created gave")
        return token

    def public_message(self, error: BaseException) -> str:
        """`error`'s text for a client: the store's path and any other absolute path replaced."""
        text = str(error) or type(error).__name__
        text = text.replace(str(self.root), "<snapshot dir>")
        text = re.sub(r"\b(?:gs|s3|file|memory)://\S*", "<snapshot store>", text)
        return re.sub(r"(?<![\w.<>])/(?:[\w.@+-]+/)*[\w.@+-]+", "<path>", text)

    # ------------------------------------------------------------------------------------------------- leases
    async def acquire(self, token: str) -> Lease:
        """Leases `token` to the calling connection (module docstring: waits for a closing holder).

        Raises:
            TokenInUse: another connection holds it (and did not let go in time).
            SnapshotStoreError: the token is malformed.
        """
        self._check(token)
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            with self._lock:
                holder = self._leases.get(token)
                if holder is None:
                    lease = self._leases[token] = Lease(token)
                    return lease
            waited = loop.time() - start
            if not holder.closing and waited >= self.live_grace_s:
                raise TokenInUse("this resume token is in use by another open connection; a token resumes one "
                                 "connection at a time (close the other one first)")
            if waited >= self.write_wait_s:
                raise TokenInUse(f"the previous connection of this resume token is still writing its snapshot after "
                                 f"{self.write_wait_s:g} s; try again later")
            await asyncio.sleep(0.02)

    def lease_new(self, token: str) -> Lease:
        """Leases a fresh token (a new session's); ValueError if it is taken (never, for a random one)."""
        with self._lock:
            if self._check(token) in self._leases or token in self._entries:
                raise SnapshotStoreError("resume token already exists")
            lease = self._leases[token] = Lease(token)
            return lease

    def release(self, lease: Lease) -> None:
        """Ends a lease (idempotent)."""
        with self._lock:
            if self._leases.get(lease.token) is lease:
                del self._leases[lease.token]

    # ------------------------------------------------------------------------------------------- read / write
    def load(self, lease: Lease) -> SessionSnapshot:
        """The newest snapshot of the leased token.

        Raises:
            SnapshotStoreError: there is none (never written, expired or evicted), or it cannot be read (named,
                without server paths).
        """
        self.expire()
        path = self.latest(lease.token)
        if path is None:
            raise SnapshotStoreError("no snapshot for this resume token (never written, or expired or evicted)")
        try:
            return self.storage.read(path)
        except (OSError, ValueError) as e:
            raise SnapshotStoreError(f"the snapshot cannot be read: {self.public_message(e)}") from e

    def save(self, lease: Lease, snapshot: SessionSnapshot) -> Path | str:
        """Writes a new generation of the leased token, then deletes the older ones (module docstring).

        Raises:
            StoreFull: there is no room under `max_bytes` (the previous snapshot stays).
            SnapshotStoreError: the write failed (full disk, ...): named, without server paths; the previous
                snapshot stays.
        """
        token = lease.token
        with self._lock:
            if self._leases.get(token) is not lease:
                raise SnapshotStoreError("this connection no longer holds its resume token")
            self.expire()
            if self.max_bytes is not None:
                estimate = self.estimate(snapshot)
                if not self._make_room(self.max_bytes - estimate, keep=token):
                    raise StoreFull(f"the snapshot directory is full: this session's snapshot (about "
                                    f"{estimate / 2**20:.1f} MiB) does not fit under the server's cap of "
                                    f"{self.max_bytes / 2**20:.1f} MiB; the session's previous snapshot, if any, "
                                    f"stays")
        gens = self._generations(token)
        number = self.storage.number(gens[-1]) + 1 if gens else 0
        try:
            path = self.storage.write(token, number, snapshot, self.clock())  # durable before it returns
        except (OSError, ValueError) as e:
            log.warning("snapshot write of %s... failed: %s", token[:8], e)
            raise SnapshotStoreError(f"the session snapshot could not be written: {self.public_message(e)}") from e
        for old in gens:  # the new generation is durable: the older ones go
            self.storage.drop(old)
        with self._lock:
            self._entries[token] = _Entry(self.storage.token_bytes(token), self.clock())
            if self.max_bytes is not None and not self._make_room(self.max_bytes, keep=token):
                log.warning("snapshot dir holds %.1f MiB, over its cap of %.1f MiB: only held sessions are left",
                            self.total_bytes() / 2**20, self.max_bytes / 2**20)
        return path

    @staticmethod
    def estimate(snapshot: SessionSnapshot) -> int:
        """The bytes a write of `snapshot` is counted for before it is made: its arrays and 64 KiB of files."""
        return sum(a.nbytes for a in snapshot.arrays().values()) + 64 * 1024

    # ------------------------------------------------------------------------------------------------ eviction
    def _evict(self, token: str, why: str) -> None:
        entry = self._entries.pop(token, None)
        self.storage.remove(token)
        log.warning("snapshot dir: evicted the session %s... (%s; %d KiB)", token[:8], why,
                    (entry.bytes if entry else 0) // 1024)

    def _make_room(self, budget: int, keep: str) -> bool:
        """Evicts the oldest snapshots nobody holds until the others fit in `budget` bytes; whether they do."""
        with self._lock:
            others = sorted((e.written, t) for t, e in self._entries.items() if t != keep)
            used = sum(self._entries[t].bytes for _, t in others)
            for _, t in others:
                if used <= budget:
                    break
                if not self.held(t):
                    used -= self._entries[t].bytes
                    self._evict(t, f"to stay under the size cap of {self.max_bytes / 2**20:.1f} MiB"
                                if self.max_bytes else "size cap")
            return used <= budget

    def expire(self) -> list[str]:
        """Deletes the snapshots nobody holds that were not written for `max_age_s`; returns their tokens."""
        if self.max_age_s is None:
            return []
        now = self.clock()
        with self._lock:
            old = [t for t, e in self._entries.items() if now - e.written > self.max_age_s and not self.held(t)]
            for t in old:
                self._evict(t, f"expired: not written for over {self.max_age_s:g} s")
        return old
