"""Where a compile's program came from, and the bytes to keep it by (`watch_compile`, `serialize`).

`omnijax.kept_executables` writes a program as a serialised executable only when the bytes hold its kernels. A
compile can be answered three ways, and only jax's events and its cache read tell which:

    compiled     XLA compiled it in this call: serialised as it is;
    xla_cache    XLA's persistent cache answered: kept from the cache entry's bytes (see below);
    memory       jax's in-memory compilation cache answered (`lower()` hands back the module jax lowered before):
                 not written, since the program held may be one read back from XLA's cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import compilation_cache as xla_cache_entries  # private: reads the entry of a cache hit (see below)
from jax._src.lib import _jax, xla_client
from jax.experimental import serialize_executable

_lock = threading.Lock()


# XLA:CPU serialises an executable that it read back from XLA's persistent cache without its kernels (loading such a
# copy fails with "Function ... not found"). Such a program is kept from the cache entry itself instead: the bytes
# XLA wrote when it compiled the program anew, kernels included. Whether a compile in this thread was answered by
# that cache is told by jax's monitoring event; the entry's bytes by a wrapper around jax's cache read, which keeps
# them only while this thread compiles for a CachedJit.
#
# A compile can also be answered by neither: `lower()` hands back the module jax lowered before, and jax's in-memory
# compilation cache then returns the program it already holds, perhaps one read back from XLA's cache by another
# call (the plain jit, another CachedJit of the same function, another thread). No event tells which, so a program
# is kept only on positive evidence: this thread's compile ran jax's backend compile (its duration event) and, when
# XLA's cache answered, the entry was read. A program from the in-memory cache runs and is not written.
XLA_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's dispatch.BACKEND_COMPILE_EVENT
_xla_hits = threading.local()
_backend_compiles = threading.local()
_listening: list = []
_entries = threading.local()  # .wanted: this thread compiles for a CachedJit; .last: the entry that answered
_reading: list = []  # [True] once jax's cache read is wrapped, [False] when this jax offers no such read


def _count_xla_hit(event: str, **_: Any) -> None:
    if event == XLA_CACHE_HIT_EVENT:
        _xla_hits.count = getattr(_xla_hits, "count", 0) + 1


def _count_backend_compile(event: str, duration: float, **_: Any) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _backend_compiles.count = getattr(_backend_compiles, "count", 0) + 1


def _compiles_in_this_thread() -> tuple[int, int]:
    """(XLA cache hits, backend compiles) counted in this thread so far."""
    if not _listening:
        with _lock:
            if not _listening:
                jax.monitoring.register_event_listener(_count_xla_hit)
                jax.monitoring.register_event_duration_secs_listener(_count_backend_compile)
                _listening.append(True)
    return getattr(_xla_hits, "count", 0), getattr(_backend_compiles, "count", 0)


def _read_entries() -> bool:
    """Wraps jax's persistent-cache read so that a hit while this thread compiles for a CachedJit leaves the entry's
    serialised executable in `_entries.last`. False when this jax has no such read (its hits are then not kept)."""
    if not _reading:
        with _lock:
            if not _reading:
                names = ("get_executable_and_time", "_get_cache", "decompress_executable",
                         "extract_executable_and_time")
                if not all(hasattr(xla_cache_entries, name) for name in names):
                    _reading.append(False)
                else:
                    read = xla_cache_entries.get_executable_and_time

                    def read_keeping_the_entry(cache_key: str, compile_options: Any, backend: Any,
                                               executable_devices: Any) -> Any:
                        found = read(cache_key, compile_options, backend, executable_devices)
                        if found[0] is not None and getattr(_entries, "wanted", False):
                            raw = xla_cache_entries._get_cache(backend).get(cache_key)  # noqa: SLF001
                            if raw is not None:
                                entry, _ = xla_cache_entries.extract_executable_and_time(
                                    xla_cache_entries.decompress_executable(raw))
                                _entries.last = entry
                        return found

                    xla_cache_entries.get_executable_and_time = read_keeping_the_entry
                    _reading.append(True)
    return _reading[0]


class _EntryPickler(serialize_executable._JaxPjrtPickler):  # noqa: SLF001 - jax's own pickler for executables
    """jax's executable pickler, writing given bytes (a cache entry's serialised executable) for the executable."""

    def __init__(self, file: Any, entry: bytes):
        super().__init__(file)
        self.entry = entry

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (xla_client.LoadedExecutable, _jax.Executable)):
            return ("exec", self.entry)
        return super().persistent_id(obj)


def serialize(compiled: Any, entry: bytes | None) -> tuple[bytes, Any, Any]:
    """`serialize_executable.serialize(compiled)`, or with `entry` (the XLA cache entry that answered the compile)
    written for the executable, in the same format, so that `deserialize_and_load` reads either."""
    if entry is None:
        return serialize_executable.serialize(compiled)
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)  # noqa: SLF001
    if unloaded is None or compiled._params.const_args:  # noqa: SLF001 - what serialize() refuses, refused alike
        raise ValueError("this executable does not serialise")
    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as file:
        _EntryPickler(file, entry).dump((unloaded, args_info_flat, compiled._no_kwargs))  # noqa: SLF001
        return file.getvalue(), in_tree, compiled.out_tree


@dataclasses.dataclass
class CompileOrigin:
    """What answered the compiles inside `watch_compile` (read after the block): `source` is "compiled",
    "xla_cache" or "memory" (module docstring); `entry` the XLA cache entry's serialised executable when XLA's
    cache answered and this jax let its read be wrapped (None otherwise)."""

    source: str = "memory"
    entry: bytes | None = None


@contextlib.contextmanager
def watch_compile() -> Iterator[CompileOrigin]:
    """Watches the compiles this thread runs inside the block (one program's `lowered.compile()`)."""
    _read_entries()
    hits, compiles = _compiles_in_this_thread()
    origin = CompileOrigin()
    _entries.wanted, _entries.last = True, None
    try:
        yield origin
    finally:
        entry, _entries.wanted, _entries.last = _entries.last, False, None
    hits_now, compiles_now = _compiles_in_this_thread()
    if compiles_now != compiles:
        origin.source = "xla_cache" if hits_now != hits else "compiled"
        origin.entry = entry if origin.source == "xla_cache" else None
