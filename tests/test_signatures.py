"""Every public signature of the package is fully typed: each parameter of a public function or method (but `self` /
`cls`, `*args` and `**kwargs` included) is annotated, and each has a return annotation (but `__init__`). Public: the
module-level functions and the methods of module-level classes whose names do not start with `_` (plus `__init__` of
those classes), in modules whose path has no component starting with `_` (but `__init__.py`)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

Function = ast.FunctionDef | ast.AsyncFunctionDef


def is_public_module(relative: Path) -> bool:
    """No folder of the path starts with `_`, nor does the file's name (but `__init__.py`)."""
    return (not any(part.startswith("_") for part in relative.parts[:-1])
            and (relative.name == "__init__.py" or not relative.name.startswith("_")))


def public_functions(tree: ast.Module) -> list[tuple[Function, str, bool]]:
    """`(def, qualified name, is a method)` for the public functions of a module and the public methods (and
    `__init__`) of its public classes."""
    found: list[tuple[Function, str, bool]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            found.append((node, node.name, False))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and (not item.name.startswith("_") or item.name == "__init__")):
                    found.append((item, f"{node.name}.{item.name}", True))
    return found


def missing_annotations(function: Function, method: bool) -> list[str]:
    """The unannotated parameters of `function` (`self` / `cls` of a method but a staticmethod's excepted), and
    `return` when it has no return annotation (but `__init__`)."""
    arguments = function.args
    parameters = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    if method and not static and (arguments.posonlyargs or arguments.args):
        parameters = parameters[1:]
    parameters += [p for p in (arguments.vararg, arguments.kwarg) if p is not None]
    missing = [p.arg for p in parameters if p.annotation is None]
    if function.returns is None and function.name != "__init__":
        missing.append("return")
    return missing


def incomplete_signatures(root: Path, package: str, skip: tuple[str, ...] = ()) -> list[str]:
    """`path:line name (missing: ...)` for each public signature under `root / package` that is not fully typed;
    paths (relative to `root`) starting with an entry of `skip` are left out."""
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root)
        if not is_public_module(relative) or relative.as_posix().startswith(skip):
            continue
        for function, name, method in public_functions(ast.parse(path.read_text(), str(path))):
            missing = missing_annotations(function, method)
            if missing:
                problems.append(f"{relative.as_posix()}:{function.lineno} {name} (missing: {', '.join(missing)})")
    return problems


def test_every_public_signature_is_typed():
    problems = incomplete_signatures(ROOT, "omnijax")
    assert not problems, f"{len(problems)} public signatures are not fully typed:\n" + "\n".join(problems)


def test_the_checker_finds_untyped_signatures(tmp_path):
    """On a fake package: an unannotated parameter, a missing return, an untyped `**kwargs`, an untyped method
    parameter; what it allows: private names, private modules, `self`, `__init__` without a return, nested
    functions."""
    package = tmp_path / "pkg"
    (package / "_private").mkdir(parents=True)
    (package / "__init__.py").write_text("def exported(x):\n    return x\n")
    (package / "_private" / "hidden.py").write_text("def f(x):\n    return x\n")
    (package / "_helpers.py").write_text("def f(x):\n    return x\n")
    (package / "mod.py").write_text(
        "def typed(x: int, *args: int, y: str = '', **kw: object) -> int:\n"
        "    def inner(z):\n        return z\n"
        "    return x\n"
        "def no_return(x: int):\n    return x\n"
        "def _private(x):\n    return x\n"
        "def loose_kwargs(x: int, **kw) -> None:\n    pass\n"
        "class Public:\n"
        "    def __init__(self, a: int):\n        self.a = a\n"
        "    def method(self, b) -> int:\n        return b\n"
        "    @staticmethod\n"
        "    def static(c: int) -> int:\n        return c\n"
        "    def _hidden(self, d):\n        return d\n"
        "class _Private:\n"
        "    def method(self, e):\n        return e\n")
    problems = incomplete_signatures(tmp_path, "pkg")
    assert problems == [
        "pkg/__init__.py:1 exported (missing: x, return)",
        "pkg/mod.py:5 no_return (missing: return)",
        "pkg/mod.py:9 loose_kwargs (missing: kw)",
        "pkg/mod.py:14 Public.method (missing: b)",
    ], problems
    assert incomplete_signatures(tmp_path, "pkg", skip=("pkg/mod.py", "pkg/__init__.py")) == []
