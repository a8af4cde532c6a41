"""The machinery of tests/test_imports.py: the package's modules found on disk, the layer table of
docs/architecture.md (`LAYERS`, checked by `layer_violations`, function-level imports included), every import
statement of a module (`imports_of`), and `import_each_alone`, which imports each module in a process of its own where
only its parent packages are loaded."""

import ast
import functools
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def parsed(path: Path) -> tuple[str, ast.Module]:
    """`(source, syntax tree)` of a file, parsed once per process and version of the file: the discovery, layer,
    private-name and kernel checks and the import walk's preload list all read every module (~0.6 CPU s a pass).
    Callers must not change the tree."""
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.cache
def _parsed(path: str, mtime_ns: int, size: int) -> tuple[str, ast.Module]:
    text = Path(path).read_text()
    return text, ast.parse(text, path)


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
            for node in ast.walk(ast.Module(body=[n for n in parsed(path)[1].body
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
import gc, importlib, importlib.util, json, os, pathlib, py_compile, shutil, signal, sys, tempfile, traceback
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
            # The objects this process holds (the preloaded packages, the parent packages) moved out of the
            # collector's reach before the fork: a child's collections would otherwise walk every inherited object
            # and write its header, copying most of the parent's heap page by page into every child (2.1 M page
            # faults over the whole walk; 32 -> 16 CPU s). What a child imports, and so what it reports, is the same.
            gc.freeze()
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
     "omnijax.compilation_cache", "omnijax.kept_executables", "omnijax.kept_folders", "omnijax.compile_origin",
     "omnijax.source_keys",
     "omnijax.heap",
     "omnijax.kernels",
     "omnijax.chunks", "omnijax.media"),  # L0: no model, no cache
    ("omnijax.kv",),  # L1: the paged cache and attention over it
    ("omnijax.retention", "omnijax.paging", "omnijax.checkpoint"),  # L2: what to keep, where it lives, the format
    ("omnijax.models", "omnijax.prefill"),  # L3: families, decoder, forward; TideKV beside them (Model.prefill)
    ("omnijax.streaming",),  # L4: StreamConfig, chunk_step, stream / Session
    ("omnijax.conversation", "omnijax.chat", "omnijax.chat_records", "omnijax.chat_speech", "omnijax.plot",
     "omnijax.testing"),  # L5: users
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
    text, tree = parsed(path)
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
        lines = parsed(module_path(module))[0].splitlines()
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
