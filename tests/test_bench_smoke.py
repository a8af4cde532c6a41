"""Every bench script runs at its smallest setting (`--smoke`) and writes the JSON rows and PNG it promises.

Each script runs in its own process with `--smoke --out DIR` (one shared DIR: the scripts that read captured layouts
reuse the tiny ones `attention_kernel.py --smoke` writes there, so it runs first). The others run two at a time,
since most of their time is single-threaded compilation. `bench/harness.py` prints `wrote PATH` for every output
file; a script passes when it exits 0 and names at least one JSON and one PNG file that exist.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_") and p.name != "harness.py")
FIRST = "attention_kernel.py"  # writes the smoke layouts that migration_cost, kernel_configs and placement_sim read
SLOW = ("prefill_memory.py", FIRST, "serve_cliff.py", "retention.py")  # started first
OPTIONAL = ("kvpress", "torch")  # packages a script may need; it is skipped, naming them, when they are absent
TIMEOUT_S = 600


def needs(script: str) -> list[str]:
    text = (BENCH / script).read_text()
    return [m for m in OPTIONAL if re.search(rf"^\s*(import|from) {m}\b", text, re.M)
            and importlib.util.find_spec(m) is None]


def run(script: str, out: Path) -> dict:
    start = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env, cwd=BENCH.parent)
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
            "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_smoke")
    runnable = [s for s in SCRIPTS if not needs(s)]
    readers = {s for s in runnable if "layouts_path" in (BENCH / s).read_text() and s != FIRST}
    # the longest first, the layout readers last (each waits for FIRST's layouts)
    order = sorted((s for s in runnable if s not in readers), key=lambda s: (s not in SLOW, s)) + sorted(readers)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {}
        for s in order:
            wait = futures.get(FIRST) if s in readers else None
            futures[s] = pool.submit(lambda s=s, wait=wait: (wait.result() if wait else None, run(s, out))[1])
        done = {s: f.result() for s, f in futures.items()}
    print("\nbench smoke seconds: " + ", ".join(f"{s} {r['seconds']:.0f}" for s, r in done.items()))
    return out, done


def test_scripts_found():
    assert FIRST in SCRIPTS and len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_smoke(script, results):
    missing = needs(script)
    if missing:
        pytest.skip(f"{script} needs {', '.join(missing)}, not installed")
    out, done = results
    r = done[script]
    assert r["rc"] == 0, f"{script} exited {r['rc']}:\n{r['stdout'][-3000:]}\n{r['stderr'][-5000:]}"
    written = [Path(line[len("wrote "):].strip()) for line in r["stdout"].splitlines() if line.startswith("wrote ")]
    written = [p for p in written if p.suffix in (".json", ".png")]
    assert any(p.suffix == ".json" for p in written), f"{script} wrote no JSON:\n{r['stdout'][-2000:]}"
    assert any(p.suffix == ".png" for p in written), f"{script} wrote no PNG:\n{r['stdout'][-2000:]}"
    for p in written:
        assert p.exists() and p.stat().st_size > 0, p
        assert p.resolve().is_relative_to(out.resolve()), f"{p} is outside --out {out}"


def test_gpu_checks_syntax():
    done = subprocess.run(["bash", "-n", str(BENCH / "gpu_checks.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
