"""Layering: the layer order of docs/architecture.md holds for every import of the package, those inside functions
included (only optional third-party packages may be imported inside a function, each with a comment); every module
imports on its own in a fresh interpreter (no import cycle; import order never matters); no module uses another
module's private name; the kernels import jax only; `import omnijax` has no process-wide side effect; and the old
paths (`convert`, `pallas_kernels`, `omnijax.evaluation`) still work with a DeprecationWarning."""

import ast
import importlib
import time
from pathlib import Path

import pytest

from omnijax.convert import convert_checkpoint
from omnijax.testing import checkpoints as demo
from tests._support import import_layers
from tests._support.import_layers import (
    LAYERS,
    MODULES,
    PACKAGES,
    import_each_alone,
    imports_of,
    last_line,
    layer_of,
    layer_violations,
    module_path,
    python,
    third_party_imports,
)


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
    monkeypatch.setattr(import_layers, "ROOT", tmp_path)
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
        tree = import_layers.parsed(path)[1]
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
