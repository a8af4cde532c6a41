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
import os
import pickle
import tempfile
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from omnijax import kept_folders
from omnijax.compile_origin import XLA_CACHE_HIT_EVENT, serialize, watch_compile  # noqa: F401 - the event, re-exported
from omnijax.kept_folders import KEEP_BYTES, KEEP_VERSIONS, PROGRAMS_DIR  # noqa: F401 - re-exported
from omnijax.source_keys import SourceGraph, node_modules, strings_in_pickle, traced_program_digest

OFF = ("off", "0", "false", "none", "no")  # values of OMNIJAX_COMPILATION_CACHE / OMNIJAX_EXECUTABLE_CACHE: off

EXECUTABLE_ENV = "OMNIJAX_EXECUTABLE_CACHE"
EXECUTABLE_FORMAT = 4  # bumped when what a file holds changes (3: keyed by the sources the function can reach;
# 4: none written from jax's in-memory cache, which wrote copies without kernels under 3)
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
# the keeping machinery: no traced code runs in these modules, and nearly every module imports them (`SourceGraph`)
_MACHINERY = ("omnijax.compilation_cache", "omnijax.kept_executables", "omnijax.kept_folders", "omnijax.source_keys")


def source_graph() -> SourceGraph:
    """omnijax's `SourceGraph`, read once per process."""
    if not _graph:
        with _process_key_lock:
            if not _graph:
                _graph.append(SourceGraph(_PACKAGE, "omnijax", unkeyed=_MACHINERY))
    return _graph[0]


_array_type: list = []


def _signature(leaves: list, device: Any, abstract: bool = False) -> tuple | None:
    """The avals (shape, dtype, weak type) of the argument leaves, when the executable can take every leaf as it is;
    None when it cannot (a tracer, a Python scalar, an array placed on another device or sharded over several).
    `abstract`: a `jax.ShapeDtypeStruct` on `device` (or with no sharding) stands for an array of its shape (for
    `CachedJit.precompile` and `CachedJit.ready`, which run nothing)."""
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
        elif abstract and isinstance(leaf, jax.ShapeDtypeStruct):
            sharding = leaf.sharding
            if sharding is not None and (type(sharding) is not jax.sharding.SingleDeviceSharding
                                         or sharding._device is not device):  # noqa: SLF001
                return None
            signature.append(jax.core.ShapedArray(leaf.shape, leaf.dtype, weak_type=leaf.weak_type))
        else:
            return None
    return tuple(signature)


def abstract_arguments(tree: Any) -> Any:
    """`tree` with every array leaf replaced by a `jax.ShapeDtypeStruct` of its shape, dtype, weak type and device:
    what `CachedJit.precompile` takes from another thread while the arrays themselves are donated to a call."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding,
                                                          weak_type=leaf.aval.weak_type)
                        if isinstance(leaf, jax.Array) else leaf, tree)


def _aval(item: Any) -> Any:
    """A signature entry as an object with shape, dtype (and weak_type)."""
    return item if not isinstance(item, tuple) else jax.ShapeDtypeStruct(*item)


_device: list = []


def _default_device() -> Any:
    """The device an executable kept here runs on: jax's first."""
    if not _device:
        _device.append(jax.devices()[0])
    return _device[0]


def _version_dir(base: Path) -> Path:
    """`base/<process key>`: the executables of this process's jax version and settings (`kept_folders.version_dir`
    prunes the older folders beside it and bounds its size on a process's first use)."""
    return kept_folders.version_dir(base, process_key().hex()[:16])


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

    `compiler_options` (by platform, e.g. `{"cpu": {"xla_backend_optimization_level": 0}}`): XLA options every
    program of this function compiles with on that platform (`jax.stages.Lowered.compile`'s); they are in its key.
    A call the plain jit serves (above) compiles without them: the same computation, XLA's default code.

    `fun` must be a plain named function (a bound method, a `functools.partial`, a callable object or a lambda is
    refused: its key would not hold their state, and a module's lambdas share one name). Values a closure captures
    are not in the key either: capture only what does not change the program.

    A program whose source key misses (an edit to a module it reaches) is traced, and found by the traced program's
    digest where an earlier process kept the same program (`source_keys.traced_program_digest`): loaded without
    lowering or compiling it, and linked under the new source key. After an edit, most programs trace as before.

    Stats (`stats`): `loaded` from disk (of which `retraced` found by the traced program after its source key
    missed), `compiled` here (of which `xla_cached` answered by XLA's cache and `reused` by jax's in-memory cache,
    not written), `plain` calls that went to the plain jit.

    In memory a function holds at most `MAX_PROGRAMS` programs, the least recently used dropped first (every program
    held keeps memory mappings of its code); `clear()` drops them all, `clear_in_memory()` those of every function.
    """

    MAX_PROGRAMS = 256

    def __init__(self, fun: Callable, *, static_argnames: str | Iterable[str] = (),
                 donate_argnames: str | Iterable[str] = (),
                 compiler_options: Mapping[str, Mapping[str, Any]] | None = None):
        if not inspect.isfunction(fun) or fun.__name__ == "<lambda>":  # (a bound method or a partial is no function)
            # the key names the function and hashes its sources, not the state a bound method, a partial or a
            # callable object carries (two such objects of different state would share each other's programs), and
            # every lambda of a module has the same name
            raise TypeError(f"cached_jit takes a plain named function, not {type(fun).__name__} {fun!r}: its key "
                            "names the function and holds no bound object's or partial's state; define a function "
                            "taking that state as an argument (static if hashable), or use jax.jit")
        self.fun = fun
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.donate_argnames = (donate_argnames,) if isinstance(donate_argnames, str) else tuple(donate_argnames)
        self.jitted = jax.jit(fun, static_argnames=self.static_argnames, donate_argnames=self.donate_argnames)
        self.signature = inspect.signature(fun)
        self.compiler_options = {platform: dict(options) for platform, options in (compiler_options or {}).items()}
        self.name = f"{fun.__module__}.{fun.__qualname__}"
        self.loaded: OrderedDict[Any, Any] = OrderedDict()  # key -> executable (or None: the plain jit), LRU order
        self.lock = threading.Lock()
        self.stats = {"loaded": 0, "compiled": 0, "plain": 0, "xla_cached": 0, "reused": 0, "retraced": 0}
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

    def programs(self) -> int:
        """Programs this function holds in the process: those of the plain jit and those kept here (grows when a
        call compiles or loads one)."""
        plain = self.jitted._cache_size()  # type: ignore[attr-defined]  # noqa: SLF001 - jax's stubs omit it
        return plain + sum(executable is not None for executable in self.loaded.values())

    def _cache_size(self) -> int:
        """`programs()` under the name `jax.jit(...)._cache_size()` has (tests count either kind alike)."""
        return self.programs()

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

    def _keys(self, args: tuple, kwargs: dict, abstract: bool = False) -> tuple | None:
        """(memory key, static values, tree, signature, dynamic positional args, dynamic keyword args) of a call, or
        None when the call goes to the plain jit (no cache directory, jit off, a mesh, arguments an executable
        cannot take as they are). A call (not `abstract`) that the plain jit serves for its mesh or its arguments
        counts in `stats["plain"]`."""
        directory = executables_dir()
        if directory is None or jax.config.jax_disable_jit:  # type: ignore[attr-defined]  # a flag jax's stubs omit
            return None
        static, dyn_args, dyn_kwargs = self._split(args, kwargs)
        if any(isinstance(value, jax.sharding.Mesh) for _, value in static):  # a program over several devices
            self.stats["plain"] += not abstract
            return None
        leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
        signature = _signature(leaves, _default_device(), abstract)
        try:
            memory_key = (static, treedef, signature, _settings_now())  # a program per settings, as jax.jit
            hash(memory_key)
        except TypeError:
            signature = None
        if signature is None:
            self.stats["plain"] += not abstract
            return None
        return memory_key, static, treedef, signature, dyn_args, dyn_kwargs

    def ready(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a call with these arguments (arrays, or `jax.ShapeDtypeStruct`s standing for them) would run
        without compiling or tracing: its program is held in memory or kept on disk. Runs nothing."""
        keys = self._keys(args, kwargs, abstract=True)
        if keys is None:
            return False
        memory_key, static, treedef, signature = keys[:4]
        if self.loaded.get(memory_key) is not None:
            return True
        key = self._disk_key(static, treedef, signature)
        directory = executables_dir()
        return key is not None and directory is not None and (_version_dir(directory) / f"{key}.exe").exists()

    def precompile(self, *args: Any, **kwargs: Any) -> bool:
        """Loads or compiles the program for these arguments and holds it, without running it: a later call with
        arrays of these shapes starts at once. Leaves may be `jax.ShapeDtypeStruct`s (`abstract_arguments`), so
        another thread can compile while the arrays themselves are donated to calls. Returns False when such a
        call would go to the plain jit (nothing is kept for it)."""
        keys = self._keys(args, kwargs, abstract=True)
        if keys is None:
            return False
        memory_key, static, treedef, signature = keys[:4]
        directory = executables_dir()
        if directory is None:
            return False
        with self.lock:
            if self.loaded.get(memory_key, False) is False:
                executable = self._load_or_compile(directory, static, treedef, signature, args, kwargs)
                self._hold(memory_key, executable)
        return self.loaded.get(memory_key) is not None

    def _hold(self, memory_key: Any, executable: Any) -> None:
        self.loaded[memory_key] = executable
        while len(self.loaded) > self.MAX_PROGRAMS:
            self.loaded.popitem(last=False)  # the least recently used

    def _kept(self, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        """(the kept executable for these arguments or None for the plain jit, dynamic positional args, dynamic
        keyword args)."""
        keys = self._keys(args, kwargs)
        if keys is None:
            return None, (), {}
        memory_key, static, treedef, signature, dyn_args, dyn_kwargs = keys
        directory = executables_dir()
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
                    self._hold(memory_key, executable)
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
        every module it imports (`SourceGraph`). A function defined outside omnijax (a test's, a script's) may call
        any of omnijax's modules, which its own imports do not tell: every module of the package, and its own
        file's bytes."""
        graph = source_graph()
        strings = strings_in_pickle(static_bytes)
        if strings is None or not self.fun.__module__.startswith("omnijax"):
            strings = set(graph.files)  # the static arguments' classes or the calls are not known: every module
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

    def _options(self) -> dict[str, Any]:
        """The XLA options of this platform's compiles (`compiler_options`; none for another platform)."""
        return self.compiler_options.get(_default_device().platform, {}) if self.compiler_options else {}

    def _disk_key(self, static: tuple, treedef: Any, signature: tuple) -> str | None:
        try:
            static_bytes = pickle.dumps(static, protocol=5)
        except Exception:  # noqa: BLE001 - an unpicklable static argument: this program is not kept on disk
            return None
        if b" at 0x" in static_bytes:  # an object identified by its address in this process only
            return None
        digest = hashlib.sha256()
        options = self._options()
        keyed_options = (repr(sorted(options.items())).encode(),) if options else ()  # none: the key as before
        for part in (*keyed_options, process_key(), self._sources(static_bytes, treedef), self.name.encode(),
                     repr(self.donate_argnames).encode(), static_bytes, str(treedef).encode(),
                     repr([(a.shape, str(a.dtype), getattr(a, "weak_type", False))
                           for a in map(_aval, signature)]).encode()):
            digest.update(hashlib.sha256(part).digest())
        return digest.hexdigest()

    def _load_or_compile(self, directory: Path, static: tuple, treedef: Any, signature: tuple, args: tuple,
                         kwargs: dict) -> Any:
        """The executable for these arguments, read from disk or compiled (and written); None when it must run
        through the plain jit (no disk key, or an executable that does not serialise).

        Read by its source key without tracing; else traced, and read by the traced program's digest
        (`source_keys.traced_program_digest`: an edit to a module the function reaches that leaves its program as
        it was, as most edits do for most programs), then linked under the new source key; else lowered, compiled
        and written under both keys (one file, two links)."""
        key = self._disk_key(static, treedef, signature)
        if key is None:
            return None
        directory = _version_dir(directory)
        path = directory / f"{key}.exe"
        executable = self._read(path)
        if executable is not None:
            return executable
        traced = self.jitted.trace(*args, **kwargs)
        by_program = self._program_path(directory, traced)
        if by_program is not None:
            executable = self._read(by_program)
            if executable is not None:
                self.stats["retraced"] += 1
                kept_folders.link(by_program, path)  # the next process loads it by its source key, without tracing
                return executable
        lowered = traced.lower()
        options = self._options()
        with watch_compile() as origin:
            executable = lowered.compile(compiler_options=options) if options else lowered.compile()
        self.stats["compiled"] += 1
        if origin.source == "memory":  # jax's in-memory cache answered: perhaps a copy without kernels
            self.stats["reused"] += 1
            return executable
        if origin.source == "xla_cache":  # read back from XLA's cache: kept from its entry, if read
            self.stats["xla_cached"] += 1
            if origin.entry is None:  # the entry was not read (a jax without the read compile_origin wraps)
                return executable
        try:
            payload, in_tree, out_tree = serialize(executable, origin.entry)
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
        if by_program is not None:
            kept_folders.link(path, by_program)
        return executable

    def _read(self, path: Path) -> Any:
        """The executable kept at `path`, loaded for the default device; None when there is none. A damaged or
        foreign file is removed (with a warning) and None returned, so the caller compiles it again."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # none, or removed meanwhile (another process pruned its folder)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(zlib.decompress(data))
            # on the one device it was compiled for: by default the load would span every device of the process,
            # and a process with several then expects a shard per device
            executable = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                   execution_devices=[_default_device()])
        except Exception as error:  # noqa: BLE001 - a damaged or foreign file: removed, compiled again
            warnings.warn(f"{path}: unreadable serialised executable ({type(error).__name__}: {error}); "
                          "compiling the program again", RuntimeWarning, stacklevel=4)
            path.unlink(missing_ok=True)  # replaced unless jax's in-memory cache answers the compile
            return None
        self.stats["loaded"] += 1
        try:
            os.utime(path)  # used: the size bound removes the least recently used first
        except OSError:
            pass
        return executable

    def _program_path(self, directory: Path, traced: Any) -> Path | None:
        """Where the program `traced` lowers to is kept by its digest (`PROGRAMS_DIR` of the version folder): the
        traced program, this function's compiler options for the platform and the process key (jax's settings
        and versions); None when the program has no digest a later process shares."""
        program = traced_program_digest(traced)
        if program is None:
            return None
        options = self._options()
        digest = hashlib.sha256(program + process_key() + repr(sorted(options.items())).encode()).hexdigest()
        return directory / PROGRAMS_DIR / f"{digest}.exe"


def cached_jit(fun: Callable | None = None, *, static_argnames: str | Iterable[str] = (),
               donate_argnames: str | Iterable[str] = (),
               compiler_options: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
    """`CachedJit` as a function or a decorator: `cached_jit(f, static_argnames=...)` or
    `@cached_jit(static_argnames=...)`."""
    if fun is None:
        return lambda f: CachedJit(f, static_argnames=static_argnames, donate_argnames=donate_argnames,
                                   compiler_options=compiler_options)
    return CachedJit(fun, static_argnames=static_argnames, donate_argnames=donate_argnames,
                     compiler_options=compiler_options)
