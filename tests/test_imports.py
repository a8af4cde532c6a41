"""Layering: the layer order of docs/architecture.md holds for every import of the package, those inside functions
included (only optional third-party packages may be imported inside a function, each with a comment); every module
imports on its own in a fresh interpreter (no import cycle; import order never matters); no module uses another
module's private name; the kernels import jax only; `import omnijax` has no process-wide side effect; and the old
paths (`convert`, `pallas_kernels`, `omnijax.evaluation`) still work with a DeprecationWarning."""

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnijax.convert import convert_checkpoint
from omnijax.testing import checkpoints as demo

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("omnijax", "convert", "pallas_kernels")  # the last two: deprecated aliases (omnijax.convert, .kernels)
WORKERS = 2  # modules importing at once
PYPROJECT = ROOT / "pyproject.toml"


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


# A fresh interpreter that imports the third-party modules once (stdin: JSON {"path", "packages", "preload",
# "modules", "workers", "timeout"}), checks that none of our modules came with them, then walks the package tree with
# fork: a child per name directly under the current package imports that name; a child importing a package that holds
# modules to test then serves as the parent of the names under it, and so on down. So each module is imported in a
# process where exactly its parent packages are loaded, each imported fresh in its own parent's state: what a fresh
# interpreter runs for `import a.b.c` (Python imports `a` to its end, then `a.b`, then loads `a.b.c`), its sibling
# modules and whatever they imported never present. At most `workers` processes import at once (a package's child
# holds every slot of its parent while it and its subtree run). Prints JSON {module: null or the failure's traceback}.
FORK_IMPORTS = r"""
import importlib, importlib.util, json, os, pathlib, py_compile, shutil, signal, sys, tempfile, traceback
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
# Our sources compiled to bytecode once, here, into a folder of this run (not the clone): every child reads it instead
# of compiling each module it imports again from source, which it otherwise does when bytecode is not written
# (PYTHONDONTWRITEBYTECODE) or was not written yet. Loading a module's bytecode runs the same code as compiling its
# source (a source that does not compile is compiled by the child, which reports its SyntaxError).
sys.pycache_prefix = tempfile.mkdtemp()
for package in job["packages"]:
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for source in sorted(pathlib.Path(folder).rglob("*.py")):
            try:
                py_compile.compile(str(source), doraise=True)
            except py_compile.PyCompileError:
                pass
wanted = set(job["modules"])
under = {}  # package ("" above the top-level ones) -> the names directly under it on the way to a wanted module
for module in wanted:
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        under.setdefault(".".join(parts[:i - 1]), set()).add(".".join(parts[:i]))
out = tempfile.mkdtemp()


def report(name, error):
    with open(os.path.join(out, name + (".ok" if error is None else ".err")), "w") as f:
        f.write(error or "")


def import_here(name):
    signal.alarm(job["timeout"])
    try:
        importlib.import_module(name)
        error = None
    except BaseException:
        error = traceback.format_exc()
    signal.alarm(0)
    return error


def visit(package):
    # the state: `package` (with its parents) imported fresh, nothing else of ours
    queue = sorted(under.get(package, ()), key=lambda n: (n not in under, n))  # the subpackages first
    running, free = {}, job["workers"]
    while queue or running:
        while queue and (1 if queue[0] not in under else job["workers"]) <= free:
            name = queue.pop(0)
            slots = job["workers"] if name in under else 1
            pid = os.fork()
            if pid == 0:
                error = import_here(name)
                if name in wanted:
                    report(name, error)
                if name in under:
                    if error is None:
                        visit(name)
                    else:  # a fresh `import name.x` fails on `name` itself
                        for m in wanted:
                            if m.startswith(name + "."):
                                report(m, error)
                os._exit(0)
            running[pid] = slots
            free -= slots
        pid, _ = os.wait()
        free += running.pop(pid)


visit("")
results = {}
for name in job["modules"]:
    path = os.path.join(out, name)
    if os.path.exists(path + ".ok"):
        results[name] = None
    elif os.path.exists(path + ".err"):
        results[name] = open(path + ".err").read()
    else:
        results[name] = f"killed (no report; timeout {job['timeout']} s?)"
shutil.rmtree(out, ignore_errors=True)
shutil.rmtree(sys.pycache_prefix, ignore_errors=True)
print(json.dumps(results))
"""


def import_each_alone(modules: list[str], packages: tuple[str, ...] = PACKAGES, path: tuple[str, ...] = (),
                      preload: bool = True) -> dict[str, str | None]:
    """module -> None when it imports alone, else its traceback. Each module is imported in its own process where
    none of our modules is loaded but its parent packages, which a fresh `import` of it runs first (forked down the
    package tree from one interpreter that preloaded only `third_party_imports()`: a fresh interpreter per module
    would spend most of its time importing jax and flax again, and every module of a subpackage would import the
    subpackage's `__init__` again)."""
    job = {"packages": list(packages), "path": list(path), "preload": third_party_imports() if preload else [],
           "modules": modules, "workers": WORKERS, "timeout": 120}
    result = python(FORK_IMPORTS, stdin=json.dumps(job), timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


# The layer order of docs/architecture.md: a module may import modules of its own layer or of a lower one. Longest
# prefix wins; every module of the package must fall in one layer.
LAYERS = (
    ("omnijax._checks", "omnijax._deprecation", "omnijax._version", "omnijax.errors", "omnijax.registry",
     "omnijax.decoding", "omnijax.logits_processors", "omnijax.stop_strings",
     "omnijax.compilation_cache", "omnijax.kernels", "omnijax.chunks",
     "omnijax.media"),  # L0: no model, no cache
    ("omnijax.kv",),  # L1: the paged cache and attention over it
    ("omnijax.retention", "omnijax.paging", "omnijax.checkpoint"),  # L2: what to keep, where it lives, the format
    ("omnijax.models", "omnijax.prefill"),  # L3: families, decoder, forward; TideKV beside them (Model.prefill)
    ("omnijax.streaming",),  # L4: StreamConfig, chunk_step, stream / Session
    ("omnijax.conversation", "omnijax.chat", "omnijax.chat_records", "omnijax.plot", "omnijax.testing"),  # L5: users
    ("omnijax.serve", "omnijax.eval", "omnijax.convert", "omnijax.cli", "omnijax.commands", "omnijax.demo",
     "omnijax.distributed", "omnijax.evaluation"),  # L6: applications
    ("omnijax",),  # the package's own __init__: the public surface
)


def layer_of(module: str) -> int | None:
    """The layer of a module of the package (None: in no layer)."""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def module_path(module: str) -> Path:
    path = ROOT / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports_of(module: str, known: set[str]) -> list[tuple[str, int, bool, str]]:
    """Every import statement of `module`: `(target, line, inside a function, statement)`, the target resolved to
    the longest known module of our package (or the imported name's top-level package otherwise)."""
    path = module_path(module)
    text = path.read_text()
    tree = ast.parse(text, str(path))
    lines = [line.encode() for line in text.splitlines(keepends=True)]

    def statement(node) -> str:  # ast.get_source_segment, without splitting the whole file again for each node
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return lines[first][node.col_offset:node.end_col_offset].decode()
        return b"".join([lines[first][node.col_offset:], *lines[first + 1:last],
                         lines[last][:node.end_col_offset]]).decode()

    nested = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn) if node is not fn}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: relative import"
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = name
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            found.append((target, node.lineno, id(node) in nested, statement(node)))
    return found


def required_packages() -> set[str]:
    """Top-level import names of the base install's dependencies (pyproject `dependencies`)."""
    text = PYPROJECT.read_text()
    block = text[text.index("dependencies = ["):]
    block = block[:block.index("]")]
    names = {line.split('"')[1].split("=")[0].split(">")[0].split("<")[0].replace("-", "_")
             for line in block.splitlines() if line.strip().startswith('"')}
    aliases = {"pillow": "PIL", "orbax_checkpoint": "orbax"}
    return {aliases.get(n, n) for n in names}


def layer_violations(modules: list[str]) -> list[str]:
    """Imports that break the layer rule or sit inside a function without being an optional third-party package
    with a comment."""
    known, required = set(modules), required_packages()
    problems = []
    for module in modules:
        source = layer_of(module)
        if source is None:
            problems.append(f"{module}: in no layer of LAYERS")
            continue
        lines = module_path(module).read_text().splitlines()
        for target, line, nested, statement in imports_of(module, known):
            where = f"{module}:{line} `{statement}`"
            top = target.partition(".")[0]
            if target in known:
                if layer_of(target) > source:
                    problems.append(f"{where}: L{source} imports L{layer_of(target)}")
                if nested:
                    problems.append(f"{where}: our module imported inside a function")
            elif nested and (top in required or top in sys.stdlib_module_names):
                problems.append(f"{where}: a standard or required package imported inside a function")
            elif nested and "#" not in lines[line - 1]:
                problems.append(f"{where}: an optional package imported inside a function needs a comment saying so")
    return problems


def test_discovery_finds_every_package():
    found = [m for package in PACKAGES for m in MODULES[package]]
    assert len(found) == len(set(found))
    for name in ("omnijax.streaming.session", "omnijax.eval.runner", "omnijax.models.encoders.whisper",
                 "omnijax.models.minicpmo.vision", "omnijax.serve.engine.engine", "omnijax.checkpoint.name_tables",
                 "omnijax.convert.__main__", "omnijax.kernels.block_sparse_attention", "omnijax.models.registry"):
        assert name in found
    assert len(MODULES["omnijax"]) > 100 and len(MODULES["convert"]) >= 10 and len(MODULES["pallas_kernels"]) >= 4
    preload = third_party_imports()
    assert {"jax", "numpy", "flax.nnx"} <= set(preload)
    assert not [n for n in preload if n.partition(".")[0] in PACKAGES + ("os", "json")]


def test_the_layer_check_finds_what_it_should(tmp_path, monkeypatch):
    """The checker itself, on a fake package: an upward import, an internal import inside a function, a standard
    module inside a function, an optional package inside a function without a comment; and what it allows."""
    package = tmp_path / "omnijax"
    (package / "kv").mkdir(parents=True)
    (package / "models").mkdir()
    for init in ("__init__.py", "kv/__init__.py", "models/__init__.py"):
        (package / init).write_text("")
    (package / "kv" / "low.py").write_text(
        "from omnijax.models import high\n"
        "def f():\n    import json\n    import matplotlib\n    import matplotlib.pyplot  # optional: plots\n")
    (package / "models" / "high.py").write_text(
        "from omnijax.kv import low\ndef g():\n    from omnijax.kv import low\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = layer_violations(["omnijax", "omnijax.kv", "omnijax.kv.low", "omnijax.models", "omnijax.models.high"])
    assert len(problems) == 4, problems
    assert "omnijax.kv.low:1 `from omnijax.models import high`: L1 imports L3" in problems
    assert any("omnijax.models.high:3" in p and "inside a function" in p for p in problems)
    assert any("`import json`: a standard or required package" in p for p in problems)
    assert any("`import matplotlib`: an optional package imported inside a function needs a comment" in p
               for p in problems)


def test_the_layer_order_holds_for_every_import():
    """Every import of every module of the package, those inside functions included."""
    problems = layer_violations(MODULES["omnijax"])
    assert not problems, f"{len(problems)} imports break the layer rule:\n" + "\n".join(problems)


def test_no_module_uses_another_modules_private_name():
    """`from omnijax.x import _y` and `x_lib._y` (x_lib an imported module of ours) are refused: what a module
    shares is public."""
    modules = MODULES["omnijax"]
    known, problems = set(modules), []
    for module in modules:
        path = module_path(module)
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.partition(".")[0] == "omnijax":
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        problems.append(f"{module}:{node.lineno}: from {node.module} import {alias.name}")
                    if f"{node.module}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in known:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                problems.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not problems, "private names used across modules:\n" + "\n".join(problems)


def test_the_import_check_reports_order_dependent_cycles(tmp_path):
    """A cycle that imports only in one order: `b` alone works (it starts the cycle), `a` alone fails. Each child
    starts without the modules its siblings imported, so `a` fails even though `b` was imported before it."""
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\nX = 1\n")
    (package / "b.py").write_text("from cyclic.a import X\n")
    # in a subpackage (the tree's deeper levels): the same cycle entered from below, a module that needs a sibling
    # it does not import (loaded only when that sibling came first), and a package whose `__init__` fails
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("import cyclic.a\n")
    (package / "sub" / "d.py").write_text("import sys\nY = sys.modules['cyclic.sub.e'].Y\n")
    (package / "sub" / "e.py").write_text("Y = 2\n")
    (package / "broken").mkdir()
    (package / "broken" / "__init__.py").write_text("raise RuntimeError('broken package')\n")
    (package / "broken" / "f.py").write_text("")
    modules = ["cyclic.b", "cyclic.a", "cyclic.missing", "cyclic.sub.e", "cyclic.sub.d", "cyclic.sub.c",
               "cyclic.broken.f"]
    results = import_each_alone(modules, packages=("cyclic",), path=(str(tmp_path),), preload=False)
    assert sorted(results) == sorted(modules)
    assert results["cyclic.b"] is None and results["cyclic.sub.e"] is None
    assert "ImportError: cannot import name 'X' from partially initialized module" in results["cyclic.a"]
    assert "ImportError: cannot import name 'X' from partially initialized module" in results["cyclic.sub.c"]
    assert "ModuleNotFoundError" in results["cyclic.missing"]
    assert "KeyError: 'cyclic.sub.e'" in results["cyclic.sub.d"]
    assert "RuntimeError: broken package" in results["cyclic.broken.f"]


def test_every_module_imports_alone():
    """Each module of the package (and of the deprecated aliases) in a process of its own; every failure is
    reported, with its last traceback line."""
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


def test_kernels_import_jax_only():
    """Past what jax and its Pallas Triton backend import themselves (and the package's own `__init__`, which any
    import of a submodule runs), the kernels bring in no other package."""
    code = ("import sys\n"
            "import jax, jax.numpy, jax.experimental.pallas, jax.experimental.pallas.triton\n"
            "import omnijax\n"
            "before = set(sys.modules)\n"
            + _imports_all([m for m in MODULES["omnijax"] if m.startswith("omnijax.kernels")]) +
            "new = {m.partition('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)\n"
            "assert new <= {'omnijax'}, f'omnijax.kernels imported {sorted(new)}'\n")
    result = python(code)
    assert result.returncode == 0, result.stderr
    for module in (m for m in MODULES["omnijax"] if m.startswith("omnijax.kernels")):
        tops = {t.partition(".")[0] for t, *_ in imports_of(module, set(MODULES["omnijax"]))}
        assert tops <= {"jax", "omnijax", "__future__", "dataclasses", "functools", "math", "typing"}, (module, tops)


def test_importing_omnijax_has_no_process_wide_side_effect():
    """No compilation cache is turned on by `import omnijax`; `omnijax.enable_compilation_cache` turns it on."""
    code = ("import os, sys, jax\n"
            "os.environ.pop('OMNIJAX_COMPILATION_CACHE', None)\n"
            "import omnijax\n"
            "assert jax.config.jax_compilation_cache_dir is None, jax.config.jax_compilation_cache_dir\n"
            "path = omnijax.enable_compilation_cache(sys.argv[1])\n"
            "assert jax.config.jax_compilation_cache_dir == str(path), jax.config.jax_compilation_cache_dir\n")
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        result = python(code, directory)
    assert result.returncode == 0, result.stderr


def test_old_paths_work_with_a_deprecation_warning():
    """`convert`, `pallas_kernels` and `omnijax.evaluation` are the new modules themselves, each announced with a
    DeprecationWarning that names the new path."""
    code = ("import warnings\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    import convert, convert.errors, convert.tables\n"
            "    from pallas_kernels import block_sparse_attention\n"
            "    import omnijax.evaluation\n"
            "import omnijax, omnijax.convert, omnijax.errors, omnijax.checkpoint.name_tables, omnijax.kernels\n"
            "assert convert.convert_checkpoint is omnijax.convert.convert_checkpoint\n"
            "assert convert.errors.ConfigError is omnijax.errors.ConfigError\n"
            "assert convert.tables.Rule is omnijax.checkpoint.name_tables.Rule\n"
            "assert block_sparse_attention is omnijax.kernels.block_sparse_attention\n"
            "assert omnijax.evaluation.evaluate is omnijax.evaluate\n"
            "text = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
            "for old, new in [('convert', 'omnijax.convert'), ('pallas_kernels', 'omnijax.kernels'),\n"
            "                 ('omnijax.evaluation', 'omnijax.eval.runner')]:\n"
            "    assert any(t.startswith(old + ' is deprecated') and new in t for t in text), (old, text)\n")
    result = python(code)
    assert result.returncode == 0, result.stderr


def test_load_in_a_fresh_interpreter(tmp_path):
    """`omnijax.load` restores the encoders too, whatever was imported before, without importing the converter."""
    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf", encoders=True)
    dst = convert_checkpoint(src, tmp_path / "out", progress=False)
    code = ("import sys, omnijax; m = omnijax.load(sys.argv[1]); assert m.audio is not None and m.vision is not None\n"
            "assert m.family.name == 'qwen2_5_omni'\n"
            "assert not [n for n in sys.modules if n.startswith('omnijax.convert')], 'load imported the converter'")
    result = python(code, str(dst))
    assert result.returncode == 0, result.stderr


def test_import_omnijax_and_the_command_line_help_do_not_import_jax():
    """`import omnijax`, `omnijax --help` and `omnijax --version` import no jax (a --help once took 4 s); the first
    public name used imports what it needs."""
    code = ("import contextlib, io, sys\n"
            "import omnijax\n"
            "from omnijax import cli\n"
            "for argv in (['--help'], ['--version']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        cli.main(argv)\n"
            "    assert out.getvalue(), argv\n"
            "assert 'jax' not in sys.modules, 'the dispatcher imported jax'\n"
            "assert omnijax.Chat.__module__ == 'omnijax.chat' and 'jax' in sys.modules\n"
            "assert omnijax.plot.__name__ == 'omnijax.plot'\n")
    result = python(code)
    assert result.returncode == 0, result.stderr


def test_the_public_names_resolve_and_type_checkers_see_the_same_names():
    import importlib.metadata

    import omnijax
    assert omnijax.__version__ == importlib.metadata.version("omnijax")  # pyproject.toml's version
    for name in omnijax.__all__:
        assert getattr(omnijax, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        omnijax.nonesuch  # noqa: B018
    tree = ast.parse(Path(omnijax.__file__).read_text())
    checked = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
               for stmt in node.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}
    assert checked == set(omnijax.__all__) - {"__version__"} == set(omnijax._PUBLIC)


def test_every_subcommand_of_the_dispatcher_is_an_application_module():
    from omnijax import cli
    for name, (module, function, _) in cli.SUBCOMMANDS.items():
        assert layer_of(module) == len(LAYERS) - 2, (name, module)  # the applications layer, as omnijax.cli
        assert callable(getattr(importlib.import_module(module), function)), name


def test_a_model_built_from_its_own_module_finds_its_family():
    """`import omnijax` registers no family (it imports nothing until a name is used); `family_for` imports the
    registry when asked for a type it does not hold yet (a Qwen3-Omni model built from its module failed to find
    its family when no test of the module had imported the registry)."""
    code = ("from omnijax.models.family import FAMILIES, family_for\n"
            "assert not FAMILIES, sorted(FAMILIES)\n"
            "assert family_for('qwen3_omni').name == 'qwen3_omni'\n"
            "try:\n"
            "    family_for('nonesuch')\n"
            "except ValueError as e:\n"
            "    assert 'qwen2_5_omni' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('nonesuch was found')\n")
    result = python(code)
    assert result.returncode == 0, result.stderr


def test_the_type_checking_imports_bind_what_the_public_table_names():
    """`omnijax.__all__` is the lazy table's names and `__version__`, and the `if TYPE_CHECKING:` imports (what type
    checkers see) bind exactly the table's names, each to the module and attribute the table gives it: a name added,
    moved or renamed in one place and not the other fails here."""
    import omnijax

    assert omnijax.__all__ == ["__version__", *omnijax._PUBLIC] and len(set(omnijax.__all__)) == len(omnijax.__all__)
    tree = ast.parse(Path(omnijax.__file__).read_text())
    guarded = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    assert len(guarded) == 1, "omnijax/__init__.py should hold one `if TYPE_CHECKING:` block"
    bound = [(alias.asname or alias.name, (stmt.module, alias.name)) for stmt in guarded[0].body
             if isinstance(stmt, ast.ImportFrom) for alias in stmt.names]
    assert len(bound) == len(dict(bound)), f"a name bound twice: {sorted(n for n, _ in bound)}"
    assert dict(bound) == omnijax._PUBLIC
