"""`omnijax.compilation_cache.cached_jit`: programs kept as serialised executables and loaded by later processes
without tracing, computing what `jax.jit` computes; keys that change with the sources, the static arguments and the
shapes; the plain jit wherever an executable cannot serve the call."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax import compilation_cache, kept_executables, kept_folders, source_keys
from tests._support.empty_cache import empty_compilation_cache

# One script, three roles: "plain" compiles the function with jax.jit only (XLA's persistent cache then holds it),
# "kept" runs it through cached_jit, "plain-then-kept" both in one process; each prints how often the Python body
# was traced, what cached_jit did and the result.
SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from omnijax import compilation_cache
    compilation_cache.enable(sys.argv[1])
    traced = []
    def f(x, y, *, scale):
        traced.append(1)
        return jnp.tanh(jnp.broadcast_to(x[:, None], (x.shape[0], 16)).sum(1) * scale) + y
    x, y = jnp.arange(8.0), jnp.ones(8)
    if sys.argv[2] in ("plain", "plain-then-kept"):
        out = jax.jit(f, static_argnames="scale", donate_argnames="y")(x, y, scale=0.5)
        stats = {}
    if sys.argv[2] == "plain-then-kept":
        y = jnp.ones(8)
    if sys.argv[2] != "plain":
        kept = compilation_cache.cached_jit(f, static_argnames="scale", donate_argnames="y")
        out = kept(x, y, scale=0.5)
        stats = kept.stats
    print(json.dumps({"traced": len(traced), "stats": stats, "out": out.tolist()}))
""")


NONE = {"loaded": 0, "compiled": 0, "plain": 0, "xla_cached": 0, "reused": 0, "retraced": 0}  # stats before a call


def _run(cache: Path, role: str, devices: int = 1) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNIJAX_EXECUTABLE", "JAX_COMPILATION"))}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), role], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_the_program_without_tracing(tmp_path):
    """A process keeps the program, a later one loads it and runs it without tracing, with the function's result
    (numpy's; test_a_program_from_jaxs_memory_is_not_written compares kept programs with the plain jit's, and covers
    a folder whose XLA cache the plain jit filled first)."""
    kept = _run(tmp_path / "fresh", "kept")
    loaded = _run(tmp_path / "fresh", "kept")
    assert kept["traced"] == 1 and kept["stats"] == dict(NONE, compiled=1)
    assert loaded["traced"] == 0 and loaded["stats"] == dict(NONE, loaded=1)
    assert len(list((tmp_path / "fresh" / "executables").glob("*/*.exe"))) == 1
    np.testing.assert_array_equal(kept["out"], loaded["out"])
    np.testing.assert_allclose(kept["out"], np.tanh(np.arange(8.0) * 16 * 0.5) + 1, rtol=1e-6)


# A script run from its own file: a function outside omnijax has its file's bytes in its source key, so editing the
# file is an edit to the sources the program reaches.
EDITED = textwrap.dedent("""
    import json, sys
    import jax.numpy as jnp
    from omnijax import compilation_cache
    compilation_cache.enable(sys.argv[1])
    traced = []
    def f(x, *, scale):
        traced.append(1)
        return jnp.tanh(x * scale) + OFFSET
    OFFSET = 1.0
    kept = compilation_cache.cached_jit(f, static_argnames="scale")
    out = kept(jnp.arange(8.0), scale=0.5)
    print(json.dumps({"traced": len(traced), "stats": kept.stats, "out": out.tolist()}))
    # edit 0
""")


def _run_file(script: Path, cache: Path) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNIJAX_EXECUTABLE", "JAX_COMPILATION"))}
    done = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_edit_that_leaves_the_program_as_it_was_loads_it_by_the_traced_program(tmp_path):
    """After an edit to the sources a program reaches (its source key changes), a later process traces it and finds
    the program an earlier process kept by the traced program's digest: loaded, not lowered or compiled, and linked
    under the new source key (the process after loads it without tracing). An edit that changes the program (a
    constant the function reads) compiles the new program: the digest holds what the trace computes."""
    script, cache = tmp_path / "edited.py", tmp_path / "cache"
    script.write_text(EDITED)
    first = _run_file(script, cache)
    assert first["stats"] == dict(NONE, compiled=1) and first["traced"] == 1
    script.write_text(EDITED.replace("# edit 0", "# edit 1"))
    edited = _run_file(script, cache)
    assert edited["stats"] == dict(NONE, loaded=1, retraced=1) and edited["traced"] == 1
    after = _run_file(script, cache)
    assert after["stats"] == dict(NONE, loaded=1) and after["traced"] == 0
    for run in (edited, after):
        np.testing.assert_array_equal(run["out"], first["out"])
    folder = next((cache / "executables").iterdir())
    names = [*folder.glob("*.exe"), *(folder / kept_executables.PROGRAMS_DIR).glob("*.exe")]
    assert len(names) == 3 and len({p.stat().st_ino for p in names}) == 1  # one file, three names

    script.write_text(EDITED.replace("OFFSET = 1.0", "OFFSET = 2.0"))
    changed = _run_file(script, cache)
    assert changed["stats"] == dict(NONE, compiled=1) and changed["traced"] == 1
    np.testing.assert_allclose(changed["out"], np.tanh(np.arange(8.0) * 0.5) + 2.0, rtol=1e-6)


def test_the_traced_program_digest_holds_constants_avals_and_trees():
    """Two traces share a digest only when they lower to one program: closed-over constants of other values, a weak
    type, another argument tree or another donation each give another digest; a function named by its address in
    the jaxpr (a callback) gives none, and so does a Pallas kernel: its printed grid mapping leaves out the index
    maps, so two kernels reading different blocks print alike."""
    digest = lambda f, *args, **jit: source_keys.traced_program_digest(jax.jit(f, **jit).trace(*args))  # noqa: E731
    x = jnp.arange(4.0)
    table, other = np.arange(4.0), np.arange(4.0) + np.eye(4)[3]
    base = digest(lambda v: v + jnp.asarray(table), x)
    assert base is not None and base == digest(lambda v: v + jnp.asarray(table), x)
    assert digest(lambda v: v + jnp.asarray(other), x) != base
    assert digest(lambda v: v * 2, x) != digest(lambda v: v * 2, np.float32(1.0)) != digest(lambda v: v * 2, 1.0)
    assert digest(lambda v: v[0] * 2, (x,)) != digest(lambda v: v * 2, x)
    assert digest(lambda v: v * 2, x, donate_argnums=0) != digest(lambda v: v * 2, x)
    callback = lambda v: jax.pure_callback(lambda a: np.sin(a), jax.ShapeDtypeStruct(v.shape, v.dtype), v)  # noqa: E731
    assert digest(callback, x) is None
    from jax.experimental import pallas as pl

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def kernel(block):  # the first block (block 0 every step) or each step's own
        spec = pl.BlockSpec((4,), (lambda i: (0,)) if block == "first" else (lambda i: (i,)))
        return lambda v: pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(4,),
                                        in_specs=[spec], out_specs=pl.BlockSpec((4,), lambda i: (i,)),
                                        interpret=True)(v)

    first, own = (jax.jit(kernel(b)).trace(jnp.arange(16.0)) for b in ("first", "own"))
    assert str(first.jaxpr) == str(own.jaxpr)  # why: the printed jaxprs are equal, the programs are not
    assert source_keys.traced_program_digest(first) is None and source_keys.traced_program_digest(own) is None


def test_the_size_bound_counts_a_file_with_several_names_once(tmp_path):
    folder = tmp_path / "v"
    (folder / kept_executables.PROGRAMS_DIR).mkdir(parents=True)
    (folder / "a.exe").write_bytes(b"x" * 100)
    os.link(folder / "a.exe", folder / kept_executables.PROGRAMS_DIR / "p.exe")
    (folder / "b.exe").write_bytes(b"y" * 100)
    os.utime(folder / "b.exe", (1, 1))  # the least recently used
    kept_folders.bound_size(folder, 200)  # 200 bytes held under three names: nothing to remove
    assert {p.name for p in folder.rglob("*.exe")} == {"a.exe", "p.exe", "b.exe"}
    kept_folders.bound_size(folder, 150)  # the oldest file goes, the twice-named one stays
    assert {p.name for p in folder.rglob("*.exe")} == {"a.exe", "p.exe"}


def test_a_program_from_jaxs_memory_is_not_written(tmp_path):
    """A CachedJit compile answered by jax's in-memory cache (the plain jit ran the same program first in this
    process, reading it back from XLA's cache) is run and not written: the program held may be a read-back copy
    without its kernels, and a file written from it made every later process fail with "Function ... not found"
    (CI at b40b7b4: `Session`'s empty state, in three subprocesses). Where XLA's own cache held the program first (a
    plain jit filled it, as a run before an edit to the sources does), a later process keeps the program from that
    cache entry: an executable read back from XLA's cache serialises without its kernels (loading such a copy failed
    with "Function ... not found"), the entry has them, and the process after loads it and runs it without tracing.
    (One folder for both cases: the process that ran both jits wrote no executable, so the next `kept` finds what
    a folder holding only the plain jit's entry holds.)"""
    plain = _run(tmp_path, "plain")
    both = _run(tmp_path, "plain-then-kept")
    assert both["stats"] == dict(NONE, compiled=1, reused=1)
    assert not list((tmp_path / "executables").glob("*/*.exe"))
    after = _run(tmp_path, "kept")
    assert after["stats"] == dict(NONE, compiled=1, xla_cached=1)
    assert len(list((tmp_path / "executables").glob("*/*.exe"))) == 1
    loaded = _run(tmp_path, "kept")
    assert loaded["stats"] == dict(NONE, loaded=1) and loaded["traced"] == 0
    for run in (both, after, loaded):
        np.testing.assert_array_equal(run["out"], plain["out"])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """This process's caches pointed at an empty directory for the test, then back at the suite's. Programs held in
    memory are dropped first: a compile jax's in-memory cache answers is not written."""
    with empty_compilation_cache(tmp_path / "cache", monkeypatch) as path:
        yield path


def _f(x, y, *, power):
    return x ** power + y


def test_keys_follow_static_arguments_shapes_and_donation(cache_dir):
    kept = compilation_cache.cached_jit(_f, static_argnames="power", donate_argnames="y")
    reference = jax.jit(_f, static_argnames="power")
    x = jnp.arange(6.0)
    for power, shape in ((2, 6), (3, 6), (2, 6), (2, 4)):
        y = jnp.full(shape, 0.5)
        expected = reference(x[:shape], jnp.full(shape, 0.5), power=power)
        np.testing.assert_array_equal(kept(x[:shape], y, power=power), expected)
        assert y.is_deleted()  # donated, as the jit's donate_argnames says
    assert kept.stats == dict(NONE, compiled=3)
    assert len(list((cache_dir / "executables").glob("*/*.exe"))) == 3
    assert kept._cache_size() == 3
    fresh = compilation_cache.cached_jit(_f, static_argnames="power", donate_argnames="y")  # a new process's view
    np.testing.assert_array_equal(fresh(x, jnp.full(6, 0.0), power=3), x ** 3)  # weak-typed y, as above
    assert fresh.stats["loaded"] == 1 and fresh.stats["compiled"] == 0


def test_a_setting_changed_between_calls_gets_programs_of_its_own(cache_dir):
    """A jax setting changed between two calls (the suite turns LLVM optimisation off and on module by module; a
    user may change matmul precision) keys the programs compiled after it apart, in memory and on disk: the process
    key was once taken at the first call and kept, so later settings reused (and were stored under) the first one's."""
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    x = jnp.arange(4.0)
    before = compilation_cache.process_key()
    np.testing.assert_array_equal(kept(x, x, power=2), x ** 2 + x)
    flag = "jax_disable_most_optimizations"
    was = jax.config.values[flag]
    try:
        jax.config.update(flag, not was)
        after = compilation_cache.process_key()
        np.testing.assert_array_equal(kept(x, x, power=2), x ** 2 + x)
    finally:
        jax.config.update(flag, was)
    assert after != before and compilation_cache.process_key() == before
    assert kept.stats["compiled"] == 2 and kept.stats["loaded"] == 0  # the second call did not reuse the first's
    folders = sorted(p.name for p in (cache_dir / "executables").iterdir())
    assert folders == sorted([before.hex()[:16], after.hex()[:16]])
    np.testing.assert_array_equal(kept(x, x, power=2), x ** 2 + x)  # back under the first setting: held, no compile
    assert kept.stats["compiled"] == 2


def test_calls_an_executable_cannot_serve_run_the_plain_jit(cache_dir):
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(kept(x, 1.0, power=2), x ** 2 + 1)  # a Python scalar
    np.testing.assert_array_equal(jax.jit(lambda v: kept(v, v, power=2))(x), x ** 2 + x)  # inside another trace
    with jax.disable_jit():
        np.testing.assert_array_equal(kept(x, x, power=2), x ** 2 + x)
    # disable_jit is not counted among the plain calls: jit itself is off
    assert kept.stats == dict(NONE, plain=2)
    assert not (cache_dir / "executables").exists()


def test_a_damaged_file_is_removed_and_replaced(cache_dir):
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    x = jnp.arange(4.0)
    kept(x, x, power=2)
    (path,) = (cache_dir / "executables").glob("*/*.exe")
    path.write_bytes(b"not an executable")
    again = compilation_cache.cached_jit(_f, static_argnames="power")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_array_equal(again(x, x, power=2), x ** 2 + x)
    assert any("unreadable serialised executable" in str(w.message) for w in caught)
    # this process's jax held the program, which is run and not written (it may lack its kernels): the damaged
    # file is removed, and the next compile through XLA's cache writes the program from the cache entry
    assert again.stats == dict(NONE, compiled=1, reused=1) and not path.exists()
    jax.clear_caches()
    third = compilation_cache.cached_jit(_f, static_argnames="power")
    np.testing.assert_array_equal(third(x, x, power=2), x ** 2 + x)
    assert third.stats == dict(NONE, compiled=1, xla_cached=1) and path.read_bytes() != b"not an executable"


def test_the_off_switch(cache_dir, monkeypatch):
    for setting in ("", "on"):  # on unless turned off
        monkeypatch.setenv(compilation_cache.EXECUTABLE_ENV, setting)
        assert compilation_cache.executables_dir() == cache_dir / "executables"
    for setting in ("off", "0", "False"):
        monkeypatch.setenv(compilation_cache.EXECUTABLE_ENV, setting)
        assert compilation_cache.executables_dir() is None
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    kept(jnp.ones(2), jnp.ones(2), power=2)
    assert kept.stats == NONE
    assert not (cache_dir / "executables").exists()


def test_executable_hands_out_the_kept_program_and_a_mesh_program_stays_plain(cache_dir):
    from jax.sharding import Mesh

    def double(x, *, mesh):
        return x * 2

    kept = compilation_cache.cached_jit(double, static_argnames="mesh")
    x = jnp.arange(3.0)
    compiled = kept.executable(x, mesh=None)
    np.testing.assert_array_equal(compiled(x), x * 2)
    assert kept.stats["compiled"] == 1 and kept.executable(x, mesh=None) is compiled
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("s",))
    np.testing.assert_array_equal(kept.executable(x, mesh=mesh)(x), x * 2)
    assert kept.stats["plain"] == 1 and len(list((cache_dir / "executables").glob("*/*.exe"))) == 1


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def test_held_programs_are_bounded_and_given_back_with_their_mappings(cache_dir):
    """Every program held in memory keeps mappings of its code. A function holds at most `MAX_PROGRAMS` (the least
    recently used dropped, then loaded again from disk without compiling), and `clear_in_memory` gives every held
    program's mappings back, as the suite does between modules: held past `jax.clear_caches()`, they once took a
    worker to the kernel's limit on mappings (`vm.max_map_count`), where XLA aborted serialising the next program."""
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    kept.MAX_PROGRAMS = 4
    for n in range(1, 7):
        kept(jnp.ones(n), jnp.ones(n), power=2)
    assert len(kept.loaded) == 4 and kept.stats["compiled"] == 6
    np.testing.assert_array_equal(kept(jnp.arange(1.0), jnp.ones(1), power=2), [1.0])  # dropped: read back
    assert kept.stats["compiled"] == 6 and kept.stats["loaded"] == 1

    compilation_cache.clear_in_memory()
    held = compilation_cache.cached_jit(_f, static_argnames="power")
    before = _mappings()
    for n in range(1, 25):
        held(jnp.ones(n), jnp.ones(n), power=3)
    grown = _mappings() - before
    assert grown >= 24  # several mappings per program held
    compilation_cache.clear_in_memory()
    assert len(held.loaded) == 0 and len(kept.loaded) == 0
    assert _mappings() - before < grown / 4


def test_old_settings_folders_are_pruned_and_files_are_compressed(cache_dir):
    """Each jax version and settings has its folder of executables; the first use in a process keeps the
    `KEEP_VERSIONS` most recently used folders (its own among them) and removes the rest that went unused for
    `KEEP_UNUSED_SECONDS` (a folder used within that time, as a running process's, stays), and first-format files."""
    base = cache_dir / "executables"
    names = [f"{chr(ord('a') + i) * 4}" for i in range(compilation_cache.KEEP_VERSIONS + 1)]  # the last the newest
    for age, name in enumerate(names):
        (base / name).mkdir(parents=True)
        (base / name / "x.exe").write_bytes(b"old")
        os.utime(base / name, (1_000_000 + age, 1_000_000 + age))
    (base / "flat.exe").write_bytes(b"first format")
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    np.testing.assert_array_equal(kept(jnp.arange(3.0), jnp.ones(3), power=2), jnp.arange(3.0) ** 2 + 1)
    own = base / compilation_cache.process_key().hex()[:16]
    assert sorted(p.name for p in base.iterdir()) == sorted([own.name, *names[-(compilation_cache.KEEP_VERSIONS - 1):]])
    # past the count, but each used within KEEP_UNUSED_SECONDS (by a process still running, perhaps): all kept
    busy = cache_dir / "busy"
    recent = time.time() - kept_folders.KEEP_UNUSED_SECONDS / 2
    for age, name in enumerate(names):
        (busy / name).mkdir(parents=True)
        os.utime(busy / name, (recent + age, recent + age))
    kept_folders.version_dir(busy, "newest")
    assert sorted(p.name for p in busy.iterdir()) == sorted([*names, "newest"])
    (path,) = own.glob("*.exe")
    import pickle
    import zlib

    assert len(pickle.loads(zlib.decompress(path.read_bytes()))) == 3  # (payload, in_tree, out_tree)


def test_a_process_with_several_devices_loads_a_single_device_program(tmp_path):
    """In a process with several devices (the suite's sharded tests force 8 CPU devices), a kept single-device program
    loads onto the one device it was compiled for: loaded onto every device, its call wanted a shard per device
    ("Expected args to execute_sharded_on_local_devices to have 2 shards")."""
    kept = _run(tmp_path, "kept", devices=2)
    loaded = _run(tmp_path, "kept", devices=2)
    assert kept["stats"]["compiled"] == 1 and loaded["stats"] == dict(NONE, loaded=1)
    np.testing.assert_array_equal(loaded["out"], kept["out"])


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_functions_key_holds_the_sources_it_reaches_and_no_others(tmp_path):
    """`SourceGraph.digest` follows module-level and function-level imports (absolute, relative, parenthesised over
    lines), module names written as strings and parent packages; an edit to a module the roots do not reach leaves
    the digest as it was, an edit to one they reach changes it."""
    files = {
        "__init__.py": "_PUBLIC = {'X': ('pkg.lazy', 'X')}\n",  # a lazy table: strings in an __init__, not followed
        "lazy.py": "X = 1\n",
        "a.py": "from pkg.b import (\n    g,\n    h,\n)\nfrom . import sub\n",
        "b.py": "def g():\n    from pkg.sub.deep import k\n    return k\nh = 'pkg.named'\n",
        "named.py": "y = 1\n",
        "sub/__init__.py": "",
        "sub/deep.py": "import pkg.leaf as leaf\nk = 2\n",
        "leaf.py": "z = 3\n",
        "other.py": "import pkg.a\n",
    }
    root = _package(tmp_path, files)

    def digest():
        return source_keys.SourceGraph(root, "pkg").digest(["pkg.a"])

    before = digest()
    for unreached in ("lazy.py", "other.py"):
        (root / unreached).write_text((root / unreached).read_text() + "# edited\n")
        assert digest() == before, unreached
    for reached in ("b.py", "named.py", "sub/deep.py", "leaf.py", "sub/__init__.py", "__init__.py"):
        (root / reached).write_text((root / reached).read_text() + "# edited\n")
        after = digest()
        assert after != before, reached
        before = after
    graph = source_keys.SourceGraph(root, "pkg")
    assert graph.modules_of(["pkg.sub.deep.k", "pkg.nothing", "numpy"]) == {"pkg.sub.deep", "pkg"}


def test_the_keeping_machinery_is_in_no_key(tmp_path):
    """Modules named `unkeyed` (omnijax's compilation cache, kept executables, their folders and source keys, which
    nearly every module imports and no traced code runs) are left out of every digest, with what only they import:
    an edit there keeps every program loadable; an edit to a module reached otherwise still changes the key."""
    root = _package(tmp_path, {"__init__.py": "", "a.py": "import pkg.cache\nimport pkg.model\n",
                               "cache.py": "import pkg.folders\n", "folders.py": "", "model.py": ""})

    def digest():
        return source_keys.SourceGraph(root, "pkg", unkeyed=("pkg.cache", "pkg.folders")).digest(["pkg.a"])

    before = digest()
    for unkeyed in ("cache.py", "folders.py"):
        (root / unkeyed).write_text((root / unkeyed).read_text() + "# edited\n")
        assert digest() == before, unkeyed
    (root / "model.py").write_text("# edited\n")
    assert digest() != before
    assert set(compilation_cache.source_graph().unkeyed) == {
        "omnijax.compilation_cache", "omnijax.kept_executables", "omnijax.kept_folders", "omnijax.source_keys"}


def test_static_arguments_and_pytree_nodes_name_their_modules():
    """The modules a program's key follows beyond its function's: those of the classes its static arguments pickle
    and of its arguments' pytree nodes."""
    import pickle

    from omnijax.retention import SinkWindow
    from omnijax.streaming.session import StreamConfig

    static = (("config", StreamConfig(policy=SinkWindow(sink=2, window=12))),)
    names = source_keys.strings_in_pickle(pickle.dumps(static, protocol=5))
    graph = compilation_cache.source_graph()
    modules = graph.modules_of(n for n in names if n.startswith("omnijax"))
    assert {SinkWindow.__module__, StreamConfig.__module__} <= modules
    assert source_keys.strings_in_pickle(b"not a pickle") is None  # unknown: the caller keys every module
    from omnijax.kv.paged import PagedKV

    fields = {f.name: None for f in __import__("dataclasses").fields(PagedKV)}
    treedef = jax.tree.structure(({"x": np.zeros(2)}, [PagedKV(**fields)]), is_leaf=lambda x: x is None)
    assert PagedKV.__module__ in source_keys.node_modules(treedef)


def test_a_folder_past_its_size_loses_the_least_recently_used_executables(tmp_path):
    for age, name in enumerate("abcd"):
        (tmp_path / f"{name}.exe").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"{name}.exe", (1_000_000 + age, 1_000_000 + age))
    kept_folders.bound_size(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.exe", "d.exe"]


def test_a_first_call_inside_a_trace_runs_the_plain_jit_and_later_calls_keep_the_program(cache_dir, monkeypatch):
    """The concrete array class `_signature` compares leaves with is learnt on first use: learnt inside a trace it
    was the tracer's class, and a later call with a tracer then read its sharding and failed."""
    monkeypatch.setattr(kept_executables, "_array_type", [])
    kept = compilation_cache.cached_jit(_f, static_argnames="power")
    inside = jax.jit(lambda x: kept(x, x, power=2))(jnp.arange(3.0))  # traced: the plain jit
    np.testing.assert_array_equal(inside, jnp.arange(3.0) ** 2 + jnp.arange(3.0))
    assert kept.stats["plain"] == 1
    np.testing.assert_array_equal(jax.jit(lambda x: kept(x, x, power=2))(jnp.ones(3)), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(kept(jnp.ones(3), jnp.ones(3), power=2), [2.0, 2.0, 2.0])
    assert kept.stats["compiled"] == 1 and kept.stats["plain"] == 2


def test_a_program_compiled_ahead_from_shapes_serves_the_call(cache_dir):
    """`precompile` from `abstract_arguments` (shapes only, as another thread compiles while the arrays are donated
    to calls) holds the program the later call runs without compiling; `ready` says so before and after, and a
    fresh function finds it on disk."""
    kept = compilation_cache.cached_jit(_f, static_argnames="power", donate_argnames="y")
    x, y = jnp.arange(4.0), jnp.ones(4)
    shapes = kept_executables.abstract_arguments((x, y))
    assert not kept.ready(*shapes, power=3)
    assert kept.precompile(*shapes, power=3) and kept.ready(*shapes, power=3) and kept.ready(x, y, power=3)
    assert kept.stats == dict(NONE, compiled=1)
    np.testing.assert_array_equal(kept(x, y, power=3), x ** 3 + 1)
    assert kept.stats == dict(NONE, compiled=1) and y.is_deleted()  # the held program ran, donating y
    assert not kept.ready(*shapes, power=2)
    other = compilation_cache.cached_jit(_f, static_argnames="power", donate_argnames="y")
    assert other.ready(*shapes, power=3)  # kept on disk, and runs as a program compiled from arrays does
    np.testing.assert_array_equal(other(x, jnp.ones(4), power=3), x ** 3 + 1)
    assert other.stats == dict(NONE, loaded=1)
    on_mesh = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",)), jax.sharding.PartitionSpec()))
    assert not kept.precompile(on_mesh, on_mesh, power=3) and not kept.ready(on_mesh, on_mesh, power=3)


class _Scaled:
    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, x):
        return x * self.scale

    def apply(self, x):
        return x * self.scale


def test_a_bound_method_a_partial_a_callable_object_or_a_lambda_is_refused():
    """Their state (the bound object, the partial's arguments) is not in a kept program's key, and a module's lambdas
    share one name: two of them would load each other's programs, so `cached_jit` refuses them by name, before
    anything is compiled."""
    for fun in (_Scaled(2.0).apply, functools.partial(_f, power=2), _Scaled(3.0), lambda x: x):
        with pytest.raises(TypeError, match="cached_jit takes a plain named function"):
            compilation_cache.cached_jit(fun)


def test_a_function_outside_omnijax_is_keyed_by_every_module_of_the_package(monkeypatch):
    """A test's or a script's function may call any omnijax module its own imports do not name, so its programs'
    keys follow every module of the package (and its file); an omnijax function's follow only what it reaches."""
    import pickle

    from omnijax import kept_executables
    from omnijax.kv import paged

    graph = kept_executables.source_graph()
    asked = []
    digest = graph.digest
    monkeypatch.setattr(graph, "digest", lambda roots: (asked.append(set(roots)), digest(roots))[1])
    static = pickle.dumps((("power", 2),), protocol=5)
    treedef = jax.tree.structure(((np.zeros(2), np.zeros(2)), {}))
    compilation_cache.cached_jit(_f, static_argnames="power")._sources(static, treedef)
    assert asked[-1] == set(graph.files)
    compilation_cache.cached_jit(paged.release_pages)._sources(pickle.dumps((), protocol=5), treedef)
    assert paged.__name__ in asked[-1] and asked[-1] < set(graph.files)


def test_compiler_options_reach_xla_key_the_program_and_apply_on_their_platform_only(cache_dir):
    """`compiler_options` (by platform) are XLA's: one it does not know is refused by XLA itself, so they reach the
    compile; a program compiled with them computes what the plain jit does and is kept under a key of its own; options
    for another platform leave the key as it is without them."""
    platform = jax.devices()[0].platform
    x, y = jnp.arange(6.0), jnp.full(6, 0.5)
    bad = compilation_cache.cached_jit(_f, static_argnames="power", compiler_options={platform: {"no_such_option": 1}})
    with pytest.raises(Exception, match="no_such_option"):
        bad(x, y, power=2)
    quick = compilation_cache.cached_jit(_f, static_argnames="power",
                                         compiler_options={platform: {"xla_backend_optimization_level": 0}})
    plain = compilation_cache.cached_jit(_f, static_argnames="power")
    other = compilation_cache.cached_jit(_f, static_argnames="power",
                                         compiler_options={"no_such_platform": {"no_such_option": 1}})
    for kept in (quick, plain, other):
        np.testing.assert_array_equal(kept(x, y, power=2), x ** 2 + 0.5)
    assert quick.stats["compiled"] == plain.stats["compiled"] == 1
    assert other.stats["compiled"] == 0 and other.stats["loaded"] == 1  # plain's program: the same key
    assert len(list((cache_dir / "executables").glob("*/*.exe"))) == 2  # quick's and plain's
