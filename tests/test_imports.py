"""Layering: every module of `omnijax`, `convert` and `omnijax.kernels` imports on its own in a fresh interpreter (so
there is no import cycle and import order never matters), the models never import the converter, the kernels import
jax only, and `load` works in a fresh interpreter without the converter."""

import ast
import json
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnijax.convert import convert_checkpoint
from omnijax import demo

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("omnijax", "convert", "omnijax.kernels")
WORKERS = 2  # modules importing at once


def discover(package: str) -> list[str]:
    """Every module and subpackage of `package`, found on disk (nothing is imported to find them)."""
    names = [package]
    for info in pkgutil.iter_modules([str(ROOT / package.replace(".", "/"))], prefix=package + "."):
        names.extend(discover(info.name) if info.ispkg else [info.name])
    return names


MODULES = {package: discover(package) for package in PACKAGES}


def python(code: str, *args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter started in the repository root."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def third_party_imports() -> list[str]:
    """The modules outside our packages (and the standard library) that our modules import at import time (the
    statements of module bodies, not those inside functions), e.g. `jax.numpy`, `flax.nnx`, `orbax.checkpoint`."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.Module(body=[n for n in ast.parse(path.read_text()).body
                                                  if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef))], type_ignores=[])):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names)  # may be submodules
    top = {name.partition(".")[0] for name in found}
    return sorted(n for n in found if n.partition(".")[0] not in set(PACKAGES) | set(sys.stdlib_module_names)
                  and n.partition(".")[0] in top)


# A fresh interpreter that imports the third-party modules once (stdin: JSON {"preload", "modules", "workers"}),
# checks that none of our modules came with them, then forks one child per module; the child imports that module
# alone (none of ours is loaded in it) and exits. Prints JSON {module: null or the failure's traceback}.
FORK_IMPORTS = r"""
import importlib, json, os, signal, sys, tempfile, traceback
job = json.load(sys.stdin)
sys.path[:0] = job["path"]
ours = tuple(p + "." for p in job["packages"]) + tuple(job["packages"])
for name in job["preload"]:
    try:
        importlib.import_module(name)
    except Exception:
        pass  # `from x import name` where name is not a module
loaded = sorted(m for m in sys.modules if m.startswith(ours) and m.partition(".")[0] in job["packages"])
assert not loaded, f"preloading third-party modules imported ours: {loaded}"
out, running, queue, results = tempfile.mkdtemp(), {}, list(job["modules"]), {}
while queue or running:
    while queue and len(running) < job["workers"]:
        name = queue.pop(0)
        report = os.path.join(out, name)
        pid = os.fork()
        if pid == 0:
            signal.alarm(job["timeout"])
            code = 0
            try:
                importlib.import_module(name)
            except BaseException:
                code = 1
                with open(report, "w") as f:
                    f.write(traceback.format_exc())
            os._exit(code)
        running[pid] = (name, report)
    pid, status = os.wait()
    name, report = running.pop(pid)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        results[name] = None
    elif os.path.exists(report):
        results[name] = open(report).read()
    else:
        results[name] = f"killed (wait status {status}; timeout {job['timeout']} s?)"
print(json.dumps(results))
"""


def import_each_alone(modules: list[str], packages: tuple[str, ...] = PACKAGES, path: tuple[str, ...] = (),
                      preload: bool = True) -> dict[str, str | None]:
    """module -> None when it imports alone, else its traceback. Each module is imported in its own process where
    none of our modules is loaded (forked from one interpreter that preloaded only `third_party_imports()`: a fresh
    interpreter per module would spend most of its time importing jax and flax again)."""
    job = {"packages": list(packages), "path": list(path), "preload": third_party_imports() if preload else [], "modules": modules,
           "workers": WORKERS, "timeout": 120}
    result = python(FORK_IMPORTS, stdin=json.dumps(job), timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def test_discovery_finds_every_package():
    found = [m for package in PACKAGES for m in MODULES[package]]
    assert len(found) == len(set(found))
    for name in ("omnijax.streaming.session", "omnijax.eval.runner", "omnijax.models.encoders.whisper",
                 "omnijax.models.minicpmo.vision", "omnijax.serve.engine.engine", "omnijax.checkpoint.tables", "omnijax.convert.__main__",
                 "omnijax.kernels.block_sparse_attention"):
        assert name in found
    assert "omnijax.stream" not in found and "omnijax.evaluate" not in found  # renamed modules are gone
    assert len(MODULES["omnijax"]) > 50 and len(MODULES["convert"]) >= 8 and len(MODULES["omnijax.kernels"]) >= 4
    preload = third_party_imports()
    assert {"jax", "numpy", "flax.nnx"} <= set(preload)
    assert not [n for n in preload if n.partition(".")[0] in PACKAGES + ("os", "json")]


def test_the_import_check_reports_order_dependent_cycles(tmp_path):
    """A cycle that imports only in one order: `b` alone works (it starts the cycle), `a` alone fails. Each child
    starts without the modules its siblings imported, so `a` fails even though `b` was imported before it."""
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\nX = 1\n")
    (package / "b.py").write_text("from cyclic.a import X\n")
    results = import_each_alone(["cyclic.b", "cyclic.a", "cyclic.missing"], packages=("cyclic",),
                                path=(str(tmp_path),), preload=False)
    assert results["cyclic.b"] is None
    assert "ImportError: cannot import name 'X' from partially initialized module" in results["cyclic.a"]
    assert "ModuleNotFoundError" in results["cyclic.missing"]


def test_every_module_imports_alone():
    """Each module of the three packages in a process of its own; every failure is reported, with its last
    traceback line."""
    modules = [m for package in PACKAGES for m in MODULES[package]]
    start = time.perf_counter()
    results = import_each_alone(modules)
    elapsed = time.perf_counter() - start
    assert sorted(results) == sorted(modules)
    failed = {m: last_line(why) for m, why in results.items() if why is not None}
    assert not failed, (f"{len(failed)} of {len(results)} modules fail to import alone ({elapsed:.0f} s):\n"
                        + "\n".join(f"  {m}: {why}" for m, why in sorted(failed.items())))


def _imports_all(modules: list[str]) -> str:
    return "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)


def test_models_never_import_the_converter():
    models = [m for m in MODULES["omnijax"] if m.startswith("omnijax.models.")]
    assert "omnijax.models.minicpmo.model" in models and "omnijax.models.qwen2_5_omni.vision" in models
    code = _imports_all(models) + (
        "import sys\n"
        "bad = sorted(m for m in sys.modules if m == 'convert' or m.startswith('convert.'))\n"
        "assert not bad, f'omnijax.models imported the converter: {bad}'\n")
    result = python(code)
    assert result.returncode == 0, result.stderr


def test_kernels_import_jax_only():
    """Past what jax and its Pallas Triton backend import themselves, the kernels bring in no other package."""
    code = ("import sys\n"
            "import jax, jax.numpy, jax.experimental.pallas, jax.experimental.pallas.triton\n"
            "before = {m.partition('.')[0] for m in sys.modules}\n"
            + _imports_all(MODULES["omnijax.kernels"]) +
            "new = {m.partition('.')[0] for m in sys.modules} - before - set(sys.stdlib_module_names)\n"
            "assert new == {'omnijax.kernels'}, f'omnijax.kernels imported {sorted(new)}'\n")
    result = python(code)
    assert result.returncode == 0, result.stderr


def test_converter_reexports_the_shared_tables_and_errors():
    """`omnijax.checkpoint.tables` / `omnijax.errors` are the omnijax objects themselves, so `except omnijax.errors.X` catches
    what the models raise."""
    import omnijax.errors
    import omnijax.checkpoint.tables
    import omnijax.errors
    import omnijax.checkpoint.name_tables

    for name in omnijax.errors.__all__:
        assert getattr(omnijax.errors, name) is getattr(omnijax.errors, name)
    for name in omnijax.checkpoint.tables.__all__:
        assert getattr(omnijax.checkpoint.tables, name) is getattr(omnijax.checkpoint.name_tables, name)
    assert {"ConvertError", "ConfigError", "MissingTensorError", "UnsupportedConfigError"} <= set(
        omnijax.errors.__all__)
    assert {"Component", "Rule", "TRANSFORMS", "convert_in_memory", "param_shapes", "plan_conversion"} <= set(
        omnijax.checkpoint.tables.__all__)


def test_load_in_a_fresh_interpreter(tmp_path):
    """`omnijax.load` restores the encoders too, whatever was imported before, without importing the converter."""
    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf", encoders=True)
    dst = convert_checkpoint(src, tmp_path / "out", progress=False)
    code = ("import sys, omnijax; m = omnijax.load(sys.argv[1]); assert m.audio is not None and m.vision is not None\n"
            "assert not [n for n in sys.modules if n.partition('.')[0] == 'convert'], 'load imported convert'")
    result = python(code, str(dst))
    assert result.returncode == 0, result.stderr
