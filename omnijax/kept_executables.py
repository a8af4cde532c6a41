"""Programs kept whole as serialised executables beside the compilation cache (`CachedJit`, `cached_jit`), so a
later process loads one without tracing or lowering the Python function again.

They live under `<compilation cache dir>/executables/<process key>/` (`executables_dir`, `process_key`): on a small
model, tracing and lowering were most of a warm start with every program already in XLA's cache (the SmolLM2 demo
spent 44 % of its time tracing and 17 % lowering). `OMNIJAX_EXECUTABLE_CACHE=off` turns them off; the persistent
cache itself is `omnijax.compilation_cache`, which re-exports the names here.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import pickle
import shutil
import tempfile
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src import compilation_cache as xla_cache_entries  # private: reads the entry of a cache hit (see below)
from jax._src.lib import _jax, xla_client
from jax.experimental import serialize_executable

from omnijax.source_keys import SourceGraph, node_modules, strings_in_pickle

OFF = ("off", "0", "false", "none", "no")  # values of OMNIJAX_COMPILATION_CACHE / OMNIJAX_EXECUTABLE_CACHE: off

EXECUTABLE_ENV = "OMNIJAX_EXECUTABLE_CACHE"
EXECUTABLE_FORMAT = 4  # bumped when what a file holds changes (3: keyed by the sources the function can reach;
# 4: none written from jax's in-memory cache, which wrote copies without kernels under 3)
KEEP_VERSIONS = 6  # folders of executables kept: those of the most recently used jax versions and settings (the
# test suite alone uses three or four: LLVM optimisation on and off, subprocesses with production flags)
KEEP_BYTES = 2 << 30  # a folder's executables past this size: the least recently used removed (`_version_dir`)
# jax settings that only say where caches and logs go: they do not change a program, so they are not in its key
_UNKEYED_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                     "jax_persistent_cache_min_entry_size_bytes", "jax_explain_cache_misses", "jax_log_compiles",
                     "jax_logging_level", "jax_debug_log_modules", "jax_compilation_cache_max_size",
                     "jax_raise_persistent_cache_errors", "jax_pprint_use_color", "jax_traceback_filtering")
_PACKAGE = Path(__file__).resolve().parent



def executables_dir() -> Path | None:
    """Where serialised executables go: `<cache dir>/executables`; None when the compilation cache is off or
    `OMNIJAX_EXECUTABLE_CACHE=off` (or `0`, `false`, `none`, `no`).

    Every executable held in memory keeps memory mappings of its code. `CachedJit` once held every program it loaded
    or compiled for the life of the process, past `jax.clear_caches()`, and a test-suite worker neared the kernel's
    limit on mappings (`vm.max_map_count`, 65,530) until XLA aborted mapping the next program's code while
    serialising it. A function now holds at most `CachedJit.MAX_PROGRAMS` programs, and `clear_in_memory()` drops
    them with jax's caches."""
    if os.environ.get(EXECUTABLE_ENV, "").strip().lower() in OFF:
        return None
    base = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a flag jax's stubs omit
    return None if not base else Path(base) / "executables"


_instances: weakref.WeakSet = weakref.WeakSet()  # every CachedJit of the process, for clear_in_memory


def clear_in_memory() -> None:
    """Drops every compiled program held in memory: jax's caches (`jax.clear_caches()`) and the executables each
    `CachedJit` loaded or compiled. A later call loads its program again (from `<cache dir>/executables`, or XLA's
    cache). A long-running process that has run many shapes calls it to give back the programs' memory mappings."""
    jax.clear_caches()
    for cached in list(_instances):
        cached.clear()


_process_parts: list = []  # (format, versions, backend, devices): fixed for the life of the process
_process_keys: dict = {}  # (the settings' values, XLA_FLAGS) -> the process key under them
_process_key_lock = threading.Lock()


def _settings_now() -> tuple:
    """Every jax setting's current value, in the table's order (hashable; ~25 us): what a program compiled now was
    compiled under."""
    values = tuple(jax.config.values.values())
    try:
        hash(values)
    except TypeError:  # a setting holding an unhashable value
        values = tuple(repr(v) for v in values)
    return values


def process_key() -> bytes:
    """What every program compiled under the current settings shares in its key: jax and jaxlib's versions, the
    backend and its devices, XLA's flags, and every jax setting that can change a traced or compiled program, as
    they are now (a process may change a setting between calls: the test suite turns LLVM optimisation off and on
    module by module with `jax_disable_most_optimizations`; a key taken once per process gave the later modules the
    first module's executables, and other keys in the next run). omnijax's sources are not in it: each function's
    key holds the sources it can reach (`SourceGraph`)."""
    now = (_settings_now(), os.environ.get("XLA_FLAGS", ""))
    key = _process_keys.get(now)
    if key is not None:
        return key
    with _process_key_lock:
        if not _process_parts:
            devices = jax.devices()
            _process_parts.append((EXECUTABLE_FORMAT, jax.__version__, jaxlib.__version__, jax.default_backend(),
                                   [(d.platform, d.device_kind, d.id) for d in devices]))
        settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if k not in _UNKEYED_SETTINGS)
        key = hashlib.sha256(repr((*_process_parts[0], now[1], settings)).encode()).digest()
        _process_keys[now] = key
        return key


_graph: list = []


def source_graph() -> SourceGraph:
    """omnijax's `SourceGraph`, read once per process."""
    if not _graph:
        with _process_key_lock:
            if not _graph:
                _graph.append(SourceGraph(_PACKAGE, "omnijax"))
    return _graph[0]


_array_type: list = []


def _signature(leaves: list, device: Any) -> tuple | None:
    """The avals (shape, dtype, weak type) of the argument leaves, when the executable can take every leaf as it is;
    None when it cannot (a tracer, a Python scalar, an array placed on another device or sharded over several)."""
    if not _array_type:
        with jax.ensure_compile_time_eval():  # a first call inside a trace must not record the tracer's class
            _array_type.append(type(jax.device_put(np.zeros((), np.int32), device)))  # jax's concrete array class
    array_type = _array_type[0]
    signature = []
    for leaf in leaves:
        if type(leaf) is array_type:  # exactly: a tracer is a jax.Array too
            sharding = leaf.sharding
            if type(sharding) is not jax.sharding.SingleDeviceSharding or sharding._device is not device:  # noqa: SLF001
                return None
            signature.append(leaf.aval)
        elif isinstance(leaf, (np.ndarray, np.generic)):
            signature.append((leaf.shape, leaf.dtype))
        else:
            return None
    return tuple(signature)


def _aval(item: Any) -> Any:
    """A signature entry as an object with shape, dtype (and weak_type)."""
    return item if not isinstance(item, tuple) else jax.ShapeDtypeStruct(*item)


_device: list = []


def _default_device() -> Any:
    """The device an executable kept here runs on: jax's first."""
    if not _device:
        _device.append(jax.devices()[0])
    return _device[0]


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
        with _process_key_lock:
            if not _listening:
                jax.monitoring.register_event_listener(_count_xla_hit)
                jax.monitoring.register_event_duration_secs_listener(_count_backend_compile)
                _listening.append(True)
    return getattr(_xla_hits, "count", 0), getattr(_backend_compiles, "count", 0)


def _read_entries() -> bool:
    """Wraps jax's persistent-cache read so that a hit while this thread compiles for a CachedJit leaves the entry's
    serialised executable in `_entries.last`. False when this jax has no such read (its hits are then not kept)."""
    if not _reading:
        with _process_key_lock:
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


def _serialize(compiled: Any, entry: bytes | None) -> tuple[bytes, Any, Any]:
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


_pruned: set = set()
_prune_lock = threading.Lock()


def _version_dir(base: Path) -> Path:
    """`base/<process key>`: the executables of this process's jax version and settings. The first call of a process
    marks the folder used and removes all but the `KEEP_VERSIONS` most recently used folders beside it, and in its
    own folder the least recently used executables past `KEEP_BYTES` (an edit to omnijax's sources makes new keys for
    the programs that reach it, so without this a developer's or CI's cache would only grow)."""
    folder = base / process_key().hex()[:16]
    if folder in _pruned:
        return folder
    with _prune_lock:
        if folder not in _pruned:
            _pruned.add(folder)
            try:
                folder.mkdir(parents=True, exist_ok=True)
                os.utime(folder)
                used = []
                for entry in base.iterdir():
                    try:
                        if entry.is_dir():
                            used.append((entry.stat().st_mtime, entry))
                        elif entry.suffix == ".exe":  # a flat file of the first format
                            entry.unlink()
                    except OSError:  # removed meanwhile by another process
                        continue
                for _, old in sorted(used, reverse=True)[KEEP_VERSIONS:]:
                    if old != folder:
                        shutil.rmtree(old, ignore_errors=True)
                _bound_size(folder, KEEP_BYTES)
            except OSError:  # an unwritable cache: programs are compiled and not kept
                pass
    return folder


def _bound_size(folder: Path, limit: int) -> None:
    """Removes the least recently used executables of `folder` (by modification time, which a load renews) until
    the rest hold at most `limit` bytes."""
    files = []
    for entry in folder.glob("*.exe"):
        try:
            stat = entry.stat()
        except OSError:  # removed meanwhile by another process
            continue
        files.append((stat.st_mtime, stat.st_size, entry))
    total = sum(size for _, size, _ in files)
    for _, size, entry in sorted(files, key=lambda item: item[0]):
        if total <= limit:
            break
        entry.unlink(missing_ok=True)
        total -= size


class CachedJit:
    """`jax.jit(fun, static_argnames=..., donate_argnames=...)` whose compiled programs are also kept on disk as
    serialised executables and loaded from there by later processes, without tracing `fun` again.

    A call goes to the loaded executable when every array argument sits whole on the default device and the static
    arguments pickle; otherwise (arguments sharded over a mesh, placed on another device, Python scalars; a program
    with host callbacks, which does not serialise) it is the plain `jax.jit` call, computing the same thing. The key
    of a program is `process_key()` (jax's version and settings, the devices, `XLA_FLAGS`), the omnijax sources its
    tracing can reach (`SourceGraph`: its module's imports, its static arguments' classes, its pytree nodes), the
    function's name, the pickled static arguments and the arguments' tree, shapes and dtypes, so an executable is
    never used for a program it was not compiled from. A program XLA compiles anew is serialised as it is; one XLA's
    own cache answers (after an edit to omnijax's sources, say) is kept from that cache entry, since XLA:CPU
    serialises a program it read back without its kernels; one jax's in-memory cache answers is run and not written
    (it may be such a copy). Files are written atomically; one that cannot be read is removed, compiled again and
    replaced.

    Stats (`stats`): `loaded` from disk, `compiled` here (of which `xla_cached` answered by XLA's cache and
    `reused` by jax's in-memory cache, not written), `plain` calls that went to the plain jit.

    In memory a function holds at most `MAX_PROGRAMS` programs, the least recently used dropped first (every program
    held keeps memory mappings of its code); `clear()` drops them all, `clear_in_memory()` those of every function.
    """

    MAX_PROGRAMS = 256

    def __init__(self, fun: Callable, *, static_argnames: str | Iterable[str] = (),
                 donate_argnames: str | Iterable[str] = ()):
        self.fun = fun
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.donate_argnames = (donate_argnames,) if isinstance(donate_argnames, str) else tuple(donate_argnames)
        self.jitted = jax.jit(fun, static_argnames=self.static_argnames, donate_argnames=self.donate_argnames)
        self.signature = inspect.signature(fun)
        self.name = f"{fun.__module__}.{fun.__qualname__}"
        self.loaded: OrderedDict[Any, Any] = OrderedDict()  # key -> executable (or None: the plain jit), LRU order
        self.lock = threading.Lock()
        self.stats = {"loaded": 0, "compiled": 0, "plain": 0, "xla_cached": 0, "reused": 0}
        self.__doc__ = fun.__doc__
        self.__wrapped__ = fun
        _instances.add(self)

    def clear(self) -> None:
        """Drops the programs this function holds in memory (not those on disk, nor the plain jit's: see
        `clear_in_memory`)."""
        with self.lock:
            self.loaded.clear()

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """`jax.jit(...).lower`, for callers that inspect the program."""
        return self.jitted.lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs this function holds in the process: those of the plain jit and those kept here (what
        `jax.jit(...)._cache_size()` counts for a plain jit)."""
        plain = self.jitted._cache_size()  # type: ignore[attr-defined]  # noqa: SLF001 - jax's stubs omit it
        return plain + sum(executable is not None for executable in self.loaded.values())

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple, dict] | None:
        """(static values by name, dynamic positional args, dynamic keyword args) as `jax.jit` sees them."""
        static = []
        params = list(self.signature.parameters)
        dyn_args = []
        for index, value in enumerate(args):
            name = params[index] if index < len(params) else None
            if name in self.static_argnames:
                static.append((name, value))
            else:
                dyn_args.append(value)
        dyn_kwargs = {}
        for name, value in kwargs.items():
            if name in self.static_argnames:
                static.append((name, value))
            else:
                dyn_kwargs[name] = value
        return tuple(sorted(static, key=lambda item: item[0])), tuple(dyn_args), dyn_kwargs

    def _kept(self, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        """(the kept executable for these arguments or None for the plain jit, dynamic positional args, dynamic
        keyword args)."""
        directory = executables_dir()
        if directory is None or jax.config.jax_disable_jit:  # type: ignore[attr-defined]  # a flag jax's stubs omit
            return None, (), {}
        static, dyn_args, dyn_kwargs = self._split(args, kwargs)
        if any(isinstance(value, jax.sharding.Mesh) for _, value in static):  # a program over several devices
            self.stats["plain"] += 1
            return None, (), {}
        leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
        signature = _signature(leaves, _default_device())
        try:
            memory_key = (static, treedef, signature, _settings_now())  # a program per settings, as jax.jit
            hash(memory_key)
        except TypeError:
            signature = None
        if signature is None:
            self.stats["plain"] += 1
            return None, (), {}
        executable = self.loaded.get(memory_key, False)
        if executable is not False:  # held: no lock, so a call never waits behind another shape's compile
            try:
                self.loaded.move_to_end(memory_key)
            except KeyError:  # dropped meanwhile by a compile of another shape; the executable in hand still runs
                pass
        else:
            with self.lock:
                executable = self.loaded.get(memory_key, False)
                if executable is False:
                    executable = self._load_or_compile(directory, static, treedef, signature, args, kwargs)
                    self.loaded[memory_key] = executable
                    while len(self.loaded) > self.MAX_PROGRAMS:
                        self.loaded.popitem(last=False)  # the least recently used
        if executable is None:
            self.stats["plain"] += 1
        return executable, dyn_args, dyn_kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        executable, dyn_args, dyn_kwargs = self._kept(args, kwargs)
        if executable is None:
            return self.jitted(*args, **kwargs)
        return executable(*dyn_args, **dyn_kwargs)

    def executable(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled program for these arguments, as `jax.jit(...).lower(...).compile()` returns one: the kept
        executable (loaded or compiled and kept) where there is one. Call it with the dynamic arguments only."""
        executable, _, _ = self._kept(args, kwargs)
        return executable if executable is not None else self.jitted.lower(*args, **kwargs).compile()

    def _sources(self, static_bytes: bytes, treedef: Any) -> bytes:
        """The digest of the sources this program's tracing can run: the function's module, the modules of the
        classes and functions its static arguments hold, and those of the pytree nodes of its arguments, each with
        every module it imports (`SourceGraph`); a function defined outside omnijax adds its own file's bytes."""
        graph = source_graph()
        strings = strings_in_pickle(static_bytes)
        if strings is None:  # the static arguments' classes are not known: every module of the package
            strings = set(graph.files)
        names = {self.fun.__module__, *strings, *node_modules(treedef)}
        roots = graph.modules_of(name for name in names if name.startswith("omnijax"))
        digest = graph.digest(roots)
        if not self.fun.__module__.startswith("omnijax"):
            try:
                own = Path(inspect.getsourcefile(self.fun) or "").read_bytes()
            except (OSError, TypeError):
                own = b""
            digest = hashlib.sha256(digest + own).digest()
        return digest

    def _disk_key(self, static: tuple, treedef: Any, signature: tuple) -> str | None:
        try:
            static_bytes = pickle.dumps(static, protocol=5)
        except Exception:  # noqa: BLE001 - an unpicklable static argument: this program is not kept on disk
            return None
        if b" at 0x" in static_bytes:  # an object identified by its address in this process only
            return None
        digest = hashlib.sha256()
        for part in (process_key(), self._sources(static_bytes, treedef), self.name.encode(),
                     repr(self.donate_argnames).encode(), static_bytes, str(treedef).encode(),
                     repr([(a.shape, str(a.dtype), getattr(a, "weak_type", False))
                           for a in map(_aval, signature)]).encode()):
            digest.update(hashlib.sha256(part).digest())
        return digest.hexdigest()

    def _load_or_compile(self, directory: Path, static: tuple, treedef: Any, signature: tuple, args: tuple,
                         kwargs: dict) -> Any:
        """The executable for these arguments, read from disk or compiled (and written); None when it must run
        through the plain jit (no disk key, or an executable that does not serialise)."""
        key = self._disk_key(static, treedef, signature)
        if key is None:
            return None
        directory = _version_dir(directory)
        path = directory / f"{key}.exe"
        if path.exists():
            try:
                payload, in_tree, out_tree = pickle.loads(zlib.decompress(path.read_bytes()))
                # on the one device it was compiled for: by default the load would span every device of the
                # process, and a process with several then expects a shard per device
                executable = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                       execution_devices=[_default_device()])
                self.stats["loaded"] += 1
                try:
                    os.utime(path)  # used: the size bound removes the least recently used first
                except OSError:
                    pass
                return executable
            except FileNotFoundError:  # removed meanwhile (another process pruned its folder): compile it
                pass
            except Exception as error:  # noqa: BLE001 - a damaged or foreign file: removed, compiled again
                warnings.warn(f"{path}: unreadable serialised executable ({type(error).__name__}: {error}); "
                              "compiling the program again", RuntimeWarning, stacklevel=3)
                path.unlink(missing_ok=True)  # replaced below unless jax's in-memory cache answers the compile
        lowered = self.jitted.lower(*args, **kwargs)
        _read_entries()
        hits, compiles = _compiles_in_this_thread()
        _entries.wanted, _entries.last = True, None
        try:
            executable = lowered.compile()
        finally:
            entry, _entries.wanted, _entries.last = _entries.last, False, None
        self.stats["compiled"] += 1
        hits_now, compiles_now = _compiles_in_this_thread()
        if compiles_now == compiles:  # jax's in-memory cache answered: perhaps a copy without kernels (see above)
            self.stats["reused"] += 1
            return executable
        if hits_now != hits:  # read back from XLA's cache: kept from its entry, if read
            self.stats["xla_cached"] += 1
            if entry is None:  # the entry was not read (a jax without the read this module wraps)
                return executable
        else:
            entry = None
        try:
            payload, in_tree, out_tree = _serialize(executable, entry)
            data = zlib.compress(pickle.dumps((payload, in_tree, out_tree), protocol=5), 1)
        except Exception:  # noqa: BLE001 - host callbacks and the like do not serialise: keep it in memory only
            return executable
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".partial-")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError:
            Path(temporary).unlink(missing_ok=True)
        return executable


def cached_jit(fun: Callable | None = None, *, static_argnames: str | Iterable[str] = (),
               donate_argnames: str | Iterable[str] = ()) -> Any:
    """`CachedJit` as a function or a decorator: `cached_jit(f, static_argnames=...)` or
    `@cached_jit(static_argnames=...)`."""
    if fun is None:
        return lambda f: CachedJit(f, static_argnames=static_argnames, donate_argnames=donate_argnames)
    return CachedJit(fun, static_argnames=static_argnames, donate_argnames=donate_argnames)
