"""The repository is self-contained: no source, test, benchmark or build file reaches into a sibling `shared` folder
(the golden vectors live in `tests/_support/data/`, the StreamingBench annotations ship as package data of
`omnijax.eval`), and the harness finds its packaged annotations with no argument."""

import fnmatch
import re
import tomllib
from pathlib import Path

import omnijax
from omnijax.eval import annotations as ann
from omnijax.eval import streamingbench as sb

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("omnijax", "convert", "omnijax.kernels", "tests", "bench")
SCANNED_FILES = ("Makefile", "pyproject.toml", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".ini", ".txt", ".yaml", ".yml"}

# The sibling folder's name, spelt so that this file's own pattern and examples are not paths into it.
NAME = "sha" "red"
# A path into the sibling folder: `../NAME`, `/work/NAME`, `... / "NAME"` or `join(..., "NAME", ...)`, or a path
# written as `NAME/data/...` / `NAME/golden/...`. Prose such as "the cache NAME by every sequence" is not.
SIBLING = re.compile(rf"""\.\./{NAME}\b|/work/{NAME}\b|[/,(]\s*["']{NAME}["']|["']{NAME}["']\s*[/,)]"""
                     rf"""|(?<![\w.-]){NAME}/(data|golden)\b""")

STREAMINGBENCH_FILES = {"questions_omni.json": 300, "questions_omni_stream.json": 300,
                        "questions_proactive_50.json": 50, "questions_real.json": 499, "questions_sqa.json": 50}


def scanned_files():
    for name in SCANNED_DIRS:
        for path in sorted((ROOT / name).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
                yield path
    for name in SCANNED_FILES:
        yield ROOT / name


def test_the_pattern_catches_sibling_paths_and_not_prose():
    caught = [f'Path(__file__).resolve().parents[2] / "{NAME}" / "golden" / "minicpmo45"',
              f"os.path.join(root, '{NAME}', 'data')", f'open("../{NAME}/data/x.json")', f"/work/{NAME}/golden",
              f"Files (`{NAME}/data/streamingbench/`, from ...)", f"vectors of `{NAME}/golden/minicpmo45`"]
    missed = [f"the immutable paged KV cache pytree {NAME} by every capability", f"{NAME}_memory_per_block: 49152",
              f"Static checks {NAME} by the kernel and the reference", f'mode = "{NAME}_pool"']
    assert [s for s in caught if not SIBLING.search(s)] == []
    assert [s for s in missed if SIBLING.search(s)] == []


def test_no_file_refers_to_the_sibling_shared_folder():
    files = list(scanned_files())
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert {"omnijax/eval/streamingbench.py", "tests/models/minicpmo/test_minicpmo_llm.py", "pyproject.toml",
            "tests/test_self_contained.py"} <= names  # this file too: its pattern and examples name no such path
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
                 for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if SIBLING.search(line)]
    assert offenders == []


def test_golden_vectors_are_in_the_repository():
    golden = ROOT / "tests" / "_support" / "data" / "minicpmo45"
    for name in ("README.md", "info.json", "checkpoint/config.json", "checkpoint/model.safetensors",
                 *(f"case{i}_{k}.{ext}" for i, k in enumerate(("text", "vision", "audio", "duplex", "chat"), 1)
                   for ext in ("json", "npz"))):
        assert (golden / name).is_file(), name


def test_harness_default_is_the_packaged_copy(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("OMNIJAX_STREAMINGBENCH", raising=False)
    root = ann.default_root()
    assert root == ann.packaged_root()
    assert root.resolve().is_relative_to(Path(omnijax.__file__).resolve().parent)  # inside the package
    assert "MIT License" in (root / "LICENSE").read_text() and (root / "README.md").is_file()
    videos = ann.load_all()  # no argument: the packaged files
    counts = {name: sum(v.source == name for v in videos) for name in STREAMINGBENCH_FILES}
    assert counts == STREAMINGBENCH_FILES and len(videos) == sum(STREAMINGBENCH_FILES.values())
    assert [p.name for p in ann.annotation_files()] == sorted(STREAMINGBENCH_FILES)
    # The CLI's `--data` default is resolved when it runs: the environment variable, read then, moves it.
    monkeypatch.setenv("OMNIJAX_STREAMINGBENCH", str(tmp_path))
    assert ann.default_root() == tmp_path
    assert sb.main(["--demo"]) == 1  # an empty folder: the annotation check fails before any model is built
    assert f"no StreamingBench annotation files (*.json) in {tmp_path}" in capsys.readouterr().err


def test_packaged_annotations_are_declared_as_package_data():
    """A non-editable install copies only what `[tool.setuptools.package-data]` names: every file of the packaged
    folder must match one of its patterns."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "omnijax.eval"]
    package = ROOT / "omnijax" / "eval"
    files = [p.relative_to(package).as_posix() for p in (package / "data" / "streamingbench").iterdir()]
    assert len(files) == len(STREAMINGBENCH_FILES) + 2  # the annotation files, README.md and LICENSE
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
