"""The package passes its linter and its type checker as `pyproject.toml` configures them (`ruff check`; `mypy` in
basic mode), so style and typing stay enforced by the suite rather than by review."""

import os
import shutil
import subprocess
import sys

import pytest

from tests._support import ROOT

PACKAGES = ("omnijax", "convert", "pallas_kernels", "tests", "bench")


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(ROOT / ".venv" / "bin")) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: it is part of the test extras (pip install -e '.[test]')")
    return path


def test_ruff_passes_on_the_package():
    run = subprocess.run([_tool("ruff"), "check", "--no-cache", *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


# mypy's incremental cache, outside the clone like the compilation cache (a fresh clone on the same machine starts
# warm: ~1 minute of checking becomes seconds); mypy re-checks every file whose content changed.
MYPY_CACHE = os.environ.get("OMNIJAX_TEST_MYPY_CACHE",
                            os.path.join(os.path.expanduser("~"), ".cache", "omnijax-tests", "mypy"))


def test_mypy_passes_on_the_package():
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", MYPY_CACHE, "omnijax"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "Success" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


def test_the_checks_catch_what_they_should(tmp_path):
    """Both tools, on a module with an unused import and a call of a missing attribute, report both (so the two
    tests above can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x: int) -> int:\n    return x.missing()\n")
    ruff = subprocess.run([_tool("ruff"), "check", "--no-cache", "--isolated", "--select", "F", str(bad)],
                          capture_output=True, text=True)
    assert ruff.returncode == 1 and "F401" in ruff.stdout
    mypy = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(bad)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert mypy.returncode == 1 and '"int" has no attribute "missing"' in mypy.stdout
