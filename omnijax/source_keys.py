"""What a kept program's keys hold: the omnijax sources its tracing can reach, read from the sources
(`SourceGraph`), and, once traced, the traced program itself (`traced_program_digest`).

`omnijax.compilation_cache.CachedJit` keys every program by the bytes of the modules its function imports
(transitively, at module and function level), of the classes its static arguments hold and of its arguments' pytree
nodes, so an edit elsewhere in the package leaves it loadable without tracing. An edit the function's modules do
reach changes that key; the program it traces may still be the same, and its second key, the traced program's
digest, then finds it without lowering or compiling it again.
"""

from __future__ import annotations

import hashlib
import pickletools
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

# `import a.b`, `from a.b import c, d` (parenthesised over lines too), relative forms included
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)|import[ \t]+([^\n]+))", re.M)


class SourceGraph:
    """The modules of a package and what each imports, read from the sources (module-level and function-level import
    statements, and module names written as strings, which `importlib.import_module` takes), so that a function's
    key holds the bytes of every module its traced code can reach and nothing else: an edit to the server leaves the
    streamed session's programs loadable, an edit to the decoder does not.

    A package's `__init__` is part of every module below it (it runs first), but the names it only lists as strings
    (a lazy table of public names) are not followed: a traced function reaches code through imports.

    `unkeyed` names modules that no traced code runs (the keeping machinery itself, which nearly every module imports
    to make its programs kept): they are left out of every digest, and their imports are not followed, so an edit
    there keeps every program loadable. A change to how executables are serialised or loaded bumps
    `kept_executables.EXECUTABLE_FORMAT` instead, which is in every key.
    """

    def __init__(self, root: Path, package: str, unkeyed: Iterable[str] = ()):
        self.unkeyed = frozenset(unkeyed)
        self.files: dict[str, Path] = {}
        for path in root.rglob("*.py"):
            parts = (package, *path.relative_to(root).with_suffix("").parts)
            self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.package = package
        # a module named in a string, as `importlib.import_module` takes it
        self.named = re.compile(r"[\"'](" + re.escape(package) + r"(?:\.\w+)+)[\"']")
        self.imports: dict[str, frozenset[str]] = {}
        self.digests: dict[str, bytes] = {}
        self.closures: dict[frozenset, bytes] = {}
        self.lock = threading.Lock()

    def _with_parents(self, module: str) -> set[str]:
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in self.files}

    def _read(self, module: str) -> frozenset[str]:
        path = self.files[module]
        text = path.read_bytes()
        self.digests[module] = hashlib.sha256(module.encode() + b"\0" + text).digest()
        source = text.decode("utf-8", errors="replace")
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for origin, names, plain in _IMPORT.findall(source):
            if plain:
                targets = [part.strip().split(" as ")[0].strip() for part in plain.split("#")[0].split(",")]
            else:
                if origin.startswith("."):
                    level = len(origin) - len(origin.lstrip("."))
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - (level - 1)] if level > 1 else base
                    origin = ".".join(base + ([origin.lstrip(".")] if origin.lstrip(".") else []))
                targets = [origin] + [f"{origin}.{name.strip().split(' as ')[0].strip()}"
                                      for name in names.split("#")[0].strip("()").replace("\n", " ").split(",")]
            found.update(t for t in targets if t == self.package or t.startswith(self.package + "."))
        if not is_package:
            found.update(self.named.findall(source))
        deps: set[str] = set()
        for target in found:
            deps |= self._with_parents(target)
        return frozenset(deps - {module})

    def modules_of(self, names: Iterable[str]) -> set[str]:
        """The package's modules among `names` (a module named inside the package, or its nearest package)."""
        found: set[str] = set()
        for name in names:
            while name and name not in self.files:
                name = name.rpartition(".")[0]
            if name.startswith(self.package):
                found.add(name)
        return found

    def digest(self, roots: Iterable[str]) -> bytes:
        """sha256 over the bytes of `roots` and every module they reach (imports followed transitively, parent
        packages included)."""
        key = frozenset(roots)
        with self.lock:
            known = self.closures.get(key)
            if known is not None:
                return known
            seen: set[str] = set()
            todo = [parent for root in key for parent in self._with_parents(root)]
            while todo:
                module = todo.pop()
                if module in seen or module in self.unkeyed:
                    continue
                seen.add(module)
                if module not in self.imports:
                    self.imports[module] = self._read(module)
                todo.extend(self.imports[module] - seen)
            digest = hashlib.sha256()
            for module in sorted(seen):
                digest.update(self.digests[module])
            self.closures[key] = digest.digest()
            return self.closures[key]


def strings_in_pickle(data: bytes) -> set[str] | None:
    """Every string a pickle holds: among them the modules of the classes and functions it references. None when
    `pickletools` cannot walk the stream (the caller must then assume every module)."""
    found: set[str] = set()
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if isinstance(arg, str):
                found.add(arg)
            if opcode.name in ("GLOBAL", "INST") and isinstance(arg, str):
                found.add(arg.split(" ")[0])
    except Exception:  # noqa: BLE001 - a stream genops cannot walk: its strings are not known
        return None
    return found


def node_modules(treedef: Any) -> set[str]:
    """The modules of the pytree node types in `treedef` (their flatten and unflatten run when a program is traced)."""
    found: set[str] = set()
    todo = [treedef]
    while todo:
        node = todo.pop()
        data = node.node_data()
        if data is not None:
            found.add(getattr(data[0], "__module__", "") or "")
        todo.extend(node.children())
    return found


def traced_program_digest(traced: Any) -> bytes | None:
    """sha256 of what a traced jit call lowers from: its jaxpr (printed, every nested jaxpr and primitive parameter
    included), the values of the constants it closes over, its argument and result trees and its arguments' avals
    (with weak types) and donation. Two calls with one digest lower to one program under the same jax settings and
    compiler options (which the caller keys apart). None when the printed jaxpr names an object by its address in
    this process (a callback's function: such a program has no digest a later process shares), and for a program
    with a Pallas kernel, whose printed grid mapping leaves out the blocks' index maps (two kernels that read
    different blocks print alike).

    Args:
        traced: `jax.jit(f).trace(*args)`'s `jax.stages.Traced`.
    """
    jaxpr = traced.jaxpr  # ClosedJaxpr
    text = str(jaxpr)
    if " at 0x" in text or "pallas_call[" in text:
        return None
    digest = hashlib.sha256(text.encode())
    for part in (str(traced.in_tree), str(traced.out_tree), repr(traced.in_avals), repr(traced.donate_argnums)):
        digest.update(b"\0" + part.encode())
    for const in jaxpr.consts:
        if hasattr(const, "shape") and hasattr(const, "dtype"):
            value = np.asarray(const)
            digest.update(f"\0{value.dtype}{value.shape}".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        else:
            digest.update(b"\0" + repr(const).encode())
    return digest.digest()
