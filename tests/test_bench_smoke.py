"""Every bench script runs at its smallest setting (`--smoke`) and writes the JSON rows and PNG it promises.

The scripts are the modules of the group packages `bench/<group>/` (those whose name does not start with `_`), each
run from the repository root as `python -m bench.<group>.<script> --smoke --out DIR` would run it, into one shared
DIR (the scripts that read captured layouts reuse the tiny ones `omnitide.attention_kernel --smoke` writes there, so
they start after it ends). Most run inside a few smoke runners (`python -m bench.harness --smoke-all - --out DIR`,
which takes script names on its stdin and calls each script's `main` in turn), so the interpreter, the imports and
jax's start are paid once per runner rather than once per script; `OWN_PROCESS` run exactly as the command line
reads, each in its own interpreter: those that change the process at import (XLA flags, jax's platform) and a few
more, so the documented command form stays tested. Two lanes run at a time, each taking the next script (the
longest first), one lane preferring the scripts that import torch, transformers or kvpress (`imports_torch`) and the
other the rest, so those imports (~6 CPU s a process) are paid in one runner rather than in each: a lane takes from
the other's queue only when its own is empty. A third lane (there were three) kept the cores busier while a lane
waited, but its runner paid the imports once more, and inside the suite the other pytest worker keeps the cores busy
anyway. `--smoke` runs use
the persistent compilation cache (`OMNIJAX_COMPILATION_CACHE`, which tests/conftest.py points at the suite's), so a
warm run mostly loads programs, and compile with the suite's quick settings (`_env`): they are checks, not
measurements. `bench/harness.py` prints `wrote PATH` for every output file; a script passes when
it exits 0 and names at least one JSON and one PNG file that exist.

The quality scripts (`bench/quality/`) measure a real model by default; their `--smoke` runs a tiny random Llama
built on the fly (`bench/quality/_tiny.py`), so they run here without the SmolLM2 file, and their figures on it are
checked where they are exact (transformers' perplexity, kvpress's kept sets on the same weights).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import queue
import re
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import harness
from tests._support import xla_flags

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
GROUPS = sorted(p.parent.name for p in BENCH.glob("*/__init__.py"))
# "<group>.<script>", run as `python -m bench.<group>.<script>`
SCRIPTS = sorted(f"{g}.{p.stem}" for g in GROUPS for p in (BENCH / g).glob("*.py") if not p.name.startswith("_"))
FIRST = "omnitide.attention_kernel"  # writes the smoke layouts that migration_cost, kernel_configs, placement_sim read
# started first, in this order (the longest, warm or cold; first_token, at ~40 CPU s the longest by far, converts the
# tiny GGUF that convert_gguf, load_memory and vs_kvpress then reuse: they follow by name, once its conversions are
# done rather than waiting for them); the others follow by name
SLOW = ("peers.first_token", "omnitide.omnitide_figures", FIRST, "metronome.serve_cliff", "peers.vs_transformers",
        "metronome.realtime_load", "tidekv.prefill_memory")
# Run as `python -m bench.<group>.<script>` in a fresh interpreter: prefill_memory sets XLA_FLAGS before jax starts
# and gpu_census jax's platform; omnitide_figures ends with `sys.exit(main())`, whose status the command gives.
OWN_PROCESS = ("tidekv.prefill_memory", "omnitide.gpu_census", "omnitide.omnitide_figures")
LANES = 2  # the first prefers the `imports_torch` scripts, the others the rest
OPTIONAL = ("kvpress", "torch")  # packages a script may need; it is skipped, naming them, when they are absent
TIMEOUT_S = 600


def source(script: str) -> str:
    return (BENCH / (script.replace(".", "/") + ".py")).read_text()


def needs(script: str) -> list[str]:
    text = source(script)
    missing = [m for m in OPTIONAL if re.search(rf"^\s*(import|from) {m}\b", text, re.M)
               and importlib.util.find_spec(m) is None]
    return missing


HEAVY = re.compile(r"^\s*(import|from) (torch|transformers|kvpress)\b", re.M)


def _bench_imports(module: str) -> set[str]:
    """The bench modules `module` imports (at its top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench."):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("bench.")}
    return {m for m in found if (ROOT / (m.replace(".", "/") + ".py")).is_file()}


def imports_torch(script: str) -> bool:
    """Whether the script or a bench module it reaches imports torch, transformers or kvpress somewhere: a
    scheduling hint (which lane prefers it), not a promise that its smoke run does."""
    seen, todo = set(), [f"bench.{script}"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += _bench_imports(module)
    return any(HEAVY.search((ROOT / (m.replace(".", "/") + ".py")).read_text()) for m in seen)


def changes_the_process_at_import(script: str) -> bool:
    """Whether the script's module touches `os.environ` outside its functions and classes (at import): such a
    script must start its own interpreter."""
    top = [node for node in ast.parse(source(script)).body
           if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return any(isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name)
               and n.value.id == "os" for node in top for n in ast.walk(node))


def _env() -> dict[str, str]:
    """The scripts' environment: the suite's quick-to-compile settings (tests/_support/xla_flags.py: its XLA flags and
    LLVM optimisation off, unless `OMNIJAX_TEST_QUICK_COMPILE=0`). A smoke run checks that a script runs, it measures
    nothing, and on these tiny models most of its CPU is XLA compiling: decode_profile --smoke with an empty cache
    took 0.46x the CPU seconds of the production settings (33 vs 73 s) and 1.1x warm (15 vs 14 s). torch's OpenMP
    threads wait passively (`OMP_WAIT_POLICY`, as the scripts' own torch workers do): a smoke run's workers run
    inside the runner (`harness.run_worker`), whose later scripts' jax threads share the cores with them."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if env.get(xla_flags.QUICK_ENV, "1") != "0":
        env[xla_flags.JAX_ENV] = "1"
    return env


def run(script: str, out: Path) -> dict:
    """`python -m bench.<script> --smoke --out OUT` in its own process (killed after `TIMEOUT_S`); its CPU seconds
    are the process's own and its waited-for children's (`os.wait4`: the other lanes' processes are not counted)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"bench.{script}", "--smoke", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    texts: dict[str, str] = {}
    readers = [threading.Thread(target=lambda name=name: texts.setdefault(name, getattr(proc, name).read()),
                                daemon=True) for name in ("stdout", "stderr")]
    for reader in readers:
        reader.start()
    killer = threading.Timer(TIMEOUT_S, proc.kill)
    killer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    for reader in readers:
        reader.join(60)
    timed_out = time.perf_counter() - start >= TIMEOUT_S and proc.returncode < 0
    return {"rc": proc.returncode, "stdout": texts.get("stdout", ""),
            "stderr": texts.get("stderr", "") + (f"\n(killed after {TIMEOUT_S} s)" if timed_out else ""),
            "seconds": time.perf_counter() - start, "cpu": usage.ru_utime + usage.ru_stime, "process": "own"}


class Runner:
    """One `python -m bench.harness --smoke-all - --out OUT` process: `run(script)` hands it a script's name and
    returns what the script printed (stdout and stderr apart), its exit status and seconds."""

    def __init__(self, out: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.harness", "--smoke-all", "-", "--out", str(out)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=_env(), cwd=ROOT)
        self.lines = {"stdout": queue.Queue(), "stderr": queue.Queue()}
        self.pumps = [threading.Thread(target=self._pump, args=(name,), daemon=True) for name in self.lines]
        for pump in self.pumps:
            pump.start()

    def _pump(self, name: str) -> None:
        for line in getattr(self.proc, name):
            self.lines[name].put(line)
        self.lines[name].put(None)  # the process ended

    def _until_end(self, name: str, script: str, deadline: float) -> tuple[str, dict[str, str] | None]:
        """What the runner printed on `name` up to the script's `SMOKE_END` line, and that line's fields (rc,
        seconds, cpu); None when the script never ended."""
        text = []
        while True:
            try:
                line = self.lines[name].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return "".join(text) + f"\n(no end after {TIMEOUT_S} s)", None
            if line is None:
                return "".join(text) + f"\n(the runner ended: rc {self.proc.poll()})", None
            end = f"{harness.SMOKE_END} bench.{script} "
            if line.startswith(end):
                return "".join(text), dict(f.split("=") for f in line[len(end):].split())
            if not line.startswith(f"{harness.SMOKE_BEGIN} bench.{script}"):
                text.append(line)

    def run(self, script: str) -> dict:
        start = time.perf_counter()
        self.proc.stdin.write(f"bench.{script}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + TIMEOUT_S
        stdout, end = self._until_end("stdout", script, deadline)
        stderr, _ = self._until_end("stderr", script, deadline)
        if end is None:  # it hangs or died: the lane starts another runner for its next script
            self.close(kill=True)
            return {"rc": -1, "stdout": stdout, "stderr": stderr, "seconds": time.perf_counter() - start,
                    "cpu": float("nan"), "process": "runner"}
        return {"rc": int(end["rc"]), "stdout": stdout, "stderr": stderr, "seconds": float(end["seconds"]),
                "cpu": float(end["cpu"]), "process": "runner"}

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:  # a runner that died leaves a broken pipe
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_smoke")
    runnable = [s for s in SCRIPTS if not needs(s)]
    readers = {s for s in runnable if "layouts_path" in source(s) and s != FIRST}
    # decided here, before the lanes start: ast.parse is not thread-safe (CPython 3.11 raises SystemError)
    alone = {s for s in runnable if s in OWN_PROCESS or changes_the_process_at_import(s)}
    torchy = {s for s in runnable if imports_torch(s)}
    # the longest first, the layout readers last (each waits for FIRST's layouts); two queues: lane 0 prefers the
    # scripts that import torch (`imports_torch`), the other lanes the rest
    first = [s for s in SLOW if s in runnable]
    order = first + sorted(s for s in runnable if s not in readers and s not in first) + sorted(readers)
    queues: tuple[queue.Queue, queue.Queue] = (queue.Queue(), queue.Queue())
    for s in order:
        queues[0 if s in torchy else 1].put(s)
    done: dict[str, dict] = {}
    first_done = threading.Event()
    if FIRST not in runnable:
        first_done.set()

    def lane(mine: int) -> None:
        runner = None
        try:
            while True:
                try:
                    s = queues[mine].get_nowait()
                except queue.Empty:
                    try:  # its own queue is done: it helps with the other's
                        s = queues[1 - mine].get_nowait()
                    except queue.Empty:
                        return
                if s in readers:
                    first_done.wait(2 * TIMEOUT_S)
                try:
                    if s in alone:
                        done[s] = run(s, out)
                    else:
                        if runner is None or runner.proc.poll() is not None:
                            runner = Runner(out)
                        done[s] = runner.run(s)
                except Exception:  # the lane goes on: this script fails with the reason, the others still run
                    done[s] = {"rc": -1, "stdout": "", "stderr": traceback.format_exc(), "seconds": 0.0,
                               "cpu": 0.0, "process": "none"}
                print(f"bench smoke: {s} {done[s]['seconds']:.0f} s, CPU {done[s]['cpu']:.0f} s", flush=True)
                if done[s]["rc"] != 0:  # said at once: a run stopped before the tests report keeps the reason
                    print(f"bench smoke: {s} exited {done[s]['rc']}:\n{done[s]['stderr'][-2000:]}", flush=True)
                if s == FIRST:
                    first_done.set()
        finally:
            if runner is not None:
                runner.close()

    with ThreadPoolExecutor(max_workers=LANES) as pool:
        for f in [pool.submit(lane, min(i, 1)) for i in range(LANES)]:
            f.result()
    done = {s: done[s] for s in order}
    print("\nbench smoke seconds (wall / CPU), longest CPU first: " + ", ".join(
        f"{s} {r['seconds']:.0f}/{r['cpu']:.0f}" for s, r in sorted(done.items(), key=lambda x: -x[1]["cpu"])))
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


def _json(results, stem: str) -> dict:
    import json

    out, done = results
    return json.loads((out / f"{stem}.json").read_text())


def test_quality_smoke_runs_the_tiny_model(results):
    """Every quality script's --smoke ran on the tiny random Llama (no real model needed), and what is exact on
    any weights holds on it: omnijax's full-context perplexity equals transformers' (the script also exits 1 when
    it does not), and kvpress keeps the same entries and answers the same as omnijax's SnapKV and KeyDiff."""
    for script in ("passkey", "selectors", "perplexity"):
        if needs(f"quality.{script}"):
            pytest.skip(f"quality.{script} needs {', '.join(needs(f'quality.{script}'))}, not installed")
    assert _json(results, "passkey")["random_weights"] is True
    rows = _json(results, "passkey")["rows"]
    assert {(r["mode"], r["policy"]) for r in rows} == {(m, p) for m in ("single", "multi")
                                                         for p in ("omnipick", "sink_window")}
    assert all(r["peak_cells"] <= 160 + 64 for r in rows), [r["peak_cells"] for r in rows]
    ppl = _json(results, "perplexity")
    check = ppl["check"]
    assert ppl["random_weights"] is True and check["ran"] and check["tokens"] == 128, check
    assert check["rel_diff"] <= 1e-3 and check["max_token_nll_diff"] < 1e-3, check
    assert set(ppl["configs"]) == {"full", "window", "sinks"}
    assert max(ppl["configs"]["window"]["attended"]) <= 64 + 32 < max(ppl["configs"]["full"]["attended"])
    sel = _json(results, "selectors")
    assert sel["random_weights"] is True and {r["selector"] for r in sel["rows"]} == {"snapkv", "keydiff"}
    for r in sel["rows"]:
        assert r["sets_identical"] == 1.0 and r["answers_equal"], r


def test_quality_scorer_matches_chunk_step():
    """bench/quality/_score.py is chunk_step's forward with every position scored: under a policy that evicts, the
    score of each chunk's last token equals the log-likelihood chunk_step's last logits give it, chunk by chunk."""
    import jax
    import numpy as np

    import omnijax
    from bench.quality import _common, _score, _tiny
    from bench.quality.perplexity import policy_for
    from omnijax.chunks.chunk import text_chunk
    from omnijax.streaming.config import StreamConfig
    from omnijax.streaming.session import Session

    checkpoint, _ = _tiny.tiny_model(_common.DEFAULT_WORK)
    model = omnijax.load(checkpoint)
    ids = np.random.default_rng(0).integers(0, _tiny.SPECIALS["<|endoftext|>"], 161)
    window, chunk = 48, 32
    policy = policy_for("sinks", window, 4)
    nll, attended = _score.score_stream(model, ids, policy, chunk=chunk, cells=window)
    assert nll.shape == (160,) and np.all(np.isfinite(nll))
    assert list(attended) == [32, 64, window + chunk, window + chunk, window + chunk]
    session = Session(model, StreamConfig(policy=policy, num_pages=4, page_size=64))
    for i, a in enumerate(range(0, 160, chunk)):
        out = session.feed(text_chunk(ids[a:a + chunk], unit=i + 1))
        want = -np.asarray(jax.nn.log_softmax(out.logits[0]))[ids[a + chunk]]
        assert abs(nll[a + chunk - 1] - want) < 1e-4, (i, nll[a + chunk - 1], want)
        assert int(np.asarray(out.stats.layout.retained_cells)[0]) == min(a + chunk, window)


def test_quality_kvpress_pyramid_budgets_equal_kvpress():
    """selectors' `pyramidkv_kv` accounting gives every layer the budget kvpress's PyramidKVPress gives it (its own
    get_layer_budget, asked per layer), at the ratios and lengths of the tables and where kvpress falls back to
    uniform budgets (the top layer below the window); omnijax's own `pyramid_budgets` differs in shape, same total
    (rounding aside)."""
    kvpress = pytest.importorskip("kvpress", reason="the comparison is against kvpress's own budgets")
    from types import SimpleNamespace

    from bench.quality.selectors import BETA, KERNEL, WINDOW, kvpress_pyramid
    from omnijax.prefill import kvpress_budget, pyramid_budgets

    L = 30
    shapes = set()
    for S in (300, 1041, 2077, 4113):
        for ratio in (0.25, 0.5, 0.75):
            press = kvpress.PyramidKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL, beta=BETA)
            theirs = tuple(press.get_layer_budget(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=L),
                                                                  layer_idx=i), S) for i in range(L))
            ours = kvpress_pyramid(ratio, S, L)
            assert ours == theirs, (S, ratio, ours, theirs)
            shapes.add("uniform" if len(set(ours)) == 1 else "ramp")
            omni = pyramid_budgets(L * kvpress_budget(ratio, S), L, window=WINDOW, beta=BETA)
            assert abs(sum(omni) - sum(ours)) <= L, (S, ratio)
    assert shapes == {"uniform", "ramp"}  # both of kvpress's branches were compared


def test_quality_kvpress_floor_guarantees_what_kvpress_does():
    """`adakv_kv`'s floor makes omnijax AdaKV guarantee each head the tokens kvpress's AdaKVPress does: its top
    `int(alpha * n_kept)` scores, the window (scored highest) counted inside."""
    from bench.quality.selectors import FLOOR, WINDOW, kvpress_floor
    from omnijax.prefill import kvpress_budget

    for S in (300, 1041, 2077, 4113):
        for ratio in (0.25, 0.5, 0.75):
            budget = kvpress_budget(ratio, S)
            floor = kvpress_floor(ratio, S)
            assert 0.0 <= floor <= 1.0
            omnijax_guaranteed = WINDOW + int(floor * (budget - WINDOW))
            kvpress_guaranteed = max(WINDOW, max(1, int(budget * FLOOR)))
            assert omnijax_guaranteed == kvpress_guaranteed, (S, ratio, omnijax_guaranteed, kvpress_guaranteed)


def test_quality_passkey_resume_keeps_every_row(tmp_path):
    """passkey --resume keeps every row of an earlier run (other lengths and policies too, so runs add up in one
    file) and refuses an earlier run with another chunk size, naming both."""
    import json

    from bench.quality import passkey

    rows = [dict(mode="single", policy="omnipick", budget=512, length=1024, depth=0.5, key_index=0),
            dict(mode="multi", policy="h2o", budget=256, length=2048, depth=0.0)]
    (tmp_path / "passkey.json").write_text(json.dumps(dict(chunk=128, rows=rows)))
    args = passkey.build_parser().parse_args(["--lengths", "1024", "--policies", "omnipick", "--resume"])
    kept = passkey.resumed_rows(tmp_path, args)
    assert [passkey.session_key(r) for r in kept] == [("single", "omnipick", 512, 1024, 0.5, 0),
                                                      ("multi", "h2o", 256, 2048, 0.0, 0)]
    assert passkey.resumed_rows(tmp_path / "none", args) == []
    args.chunk = 64
    with pytest.raises(SystemExit, match="--chunk 128.*asks 64"):
        passkey.resumed_rows(tmp_path, args)


def test_quality_selectors_collect_tables_the_finished_cases(tmp_path):
    """selectors --collect builds the table from what both workers of a stopped run finished, without a model:
    the cases both sides have, kept-set agreement per (layer, KV head), and `complete` false."""
    import json

    import numpy as np

    from bench.quality import selectors

    S, L, G = 40, 3, 2
    cases = [dict(length=32, depth=0.5, key="12345", ids=list(range(S)), selector=sel, ratio=0.5)
             for sel in ("snapkv", "keydiff", "recent")]
    spec = dict(checkpoint="ckpt", reference=str(tmp_path / "m.gguf"), random_weights=False, cases=cases)
    (tmp_path / "selectors_cases.json").write_text(json.dumps(spec))
    kept = np.zeros((L, G, S), bool)
    kept[..., S // 2:] = True
    other = kept.copy()
    other[1, 0, 0], other[1, 0, -1] = True, False  # one (layer, head) set differs in one token
    sides = {"omnijax": [kept, kept, kept], "kvpress": [kept, other]}  # kvpress stopped after two cases
    answers = {"omnijax": ["It is 12345.", "No idea.", "x"], "kvpress": ["It is 12345.", "No."]}
    for side, masks in sides.items():
        np.savez_compressed(tmp_path / f"selectors_{side}_kept.npz",
                            **{f"case{i}": np.packbits(m, axis=-1) for i, m in enumerate(masks)})
        (tmp_path / f"selectors_{side}.json").write_text(json.dumps(
            [dict(case=i, answer=a, cells=int(m.sum()), seconds=1.0) for i, (a, m) in enumerate(zip(answers[side],
                                                                                                 masks))]))
    selectors.main(["--collect", "--out", str(tmp_path)])
    got = json.loads((tmp_path / "selectors.json").read_text())
    assert got["complete"] is False and got["random_weights"] is False
    rows = got["rows"]
    assert [r["selector"] for r in rows] == ["snapkv", "keydiff"]
    assert rows[0]["sets_identical"] == 1.0 and rows[0]["answers_equal"] and rows[0]["omnijax_right"]
    assert rows[1]["sets_identical"] == pytest.approx(1 - 1 / (L * G)) and not rows[1]["answers_equal"]
    assert rows[1]["jaccard"] < 1.0
    (tmp_path / "selectors_cases.json").unlink()
    with pytest.raises(SystemExit, match="selectors_cases.json is missing"):
        selectors.main(["--collect", "--out", str(tmp_path)])


def test_quality_selectors_skip_done_runs_only_new_cases(tmp_path):
    """selectors --skip-done drops the cases selectors.json already has (a case is its selector, ratio, length,
    tokens, depth and key: another key, depth or token count is new), and is refused without --append."""
    import json

    from bench.quality import selectors

    def case(sel="snapkv", ratio=0.5, key="12345", depth=0.5, n=40):
        return dict(length=32, depth=depth, key=key, ids=list(range(n)), selector=sel, ratio=ratio)

    planned = [case(), case(key="54321"), case(depth=0.1), case(n=41), case(sel="keydiff"), case(ratio=0.25)]
    assert selectors.not_done(planned, tmp_path / "selectors.json") == planned  # no table yet: every case runs
    old = [dict(selector="snapkv", ratio=0.5, length=32, tokens=40, depth=0.5, key="12345"),
           dict(selector="keydiff", ratio=0.5, length=32, tokens=40, depth=0.5, key="12345")]
    (tmp_path / "selectors.json").write_text(json.dumps(dict(rows=old)))
    assert selectors.not_done(planned, tmp_path / "selectors.json") == [planned[i] for i in (1, 2, 3, 5)]
    with pytest.raises(SystemExit, match="--skip-done .* pass --append too"):
        selectors.main(["--skip-done", "--out", str(tmp_path)])


def test_smoke_runner_reports_each_script_and_refuses_other_modules(tmp_path):
    """`python -m bench.harness --smoke-all` refuses a module outside the bench groups by name, before running
    anything; `run_main` gives the status `python -m` would (an exception: 1 with its traceback; SystemExit's code)."""
    done = subprocess.run([sys.executable, "-m", "bench.harness", "--smoke-all", "omnijax.demo", "--out",
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=_env())
    assert done.returncode == 2 and "not bench scripts: omnijax.demo" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
    assert harness.run_main("bench.quality.passkey", ["--bogus-flag"]) == 2  # argparse's own exit status
    with pytest.raises(ValueError, match="'tests.conftest' is not a bench script"):
        harness.smoke_all(["tests.conftest"], tmp_path)


def test_inline_worker_runs_the_command_in_process():
    """`harness.run_worker(..., inline=True)` (a smoke run's workers) gives what the worker's fresh process gives:
    its exit status and what it printed (here argparse's refusal of a bad flag, and its help on stdout with status
    0); a command that is not a bench module's is refused by name."""
    bad = harness.module_command("bench.quality.passkey", "--bogus-flag")
    inline, fresh = harness.run_worker(bad, inline=True), harness.run_worker(bad, env=_env(), timeout=120)
    assert inline.returncode == fresh.returncode == 2, (inline, fresh)
    assert "unrecognized arguments: --bogus-flag" in inline.stderr and "--bogus-flag" in fresh.stderr
    helped = harness.run_worker(harness.module_command("bench.quality.passkey", "--help"), inline=True)
    assert helped.returncode == 0 and helped.stdout.startswith("usage:") and "--smoke" in helped.stdout, helped
    with pytest.raises(ValueError, match="is not a module_command"):
        harness.run_worker(["git", "status"], inline=True)


def test_inline_worker_runs_under_the_given_environment(monkeypatch):
    """An inline worker's `env` is the environment its main sees, and the process's own comes back after it (even
    when the main raises)."""
    seen = []

    def main(name, argv):
        seen.append((name, argv, os.environ.get("OMNIJAX_BENCH_PROBE")))
        if argv == ["--fail"]:
            raise RuntimeError("failed")
        return 0

    monkeypatch.setattr(harness, "run_main", main)
    monkeypatch.delenv("OMNIJAX_BENCH_PROBE", raising=False)
    env = dict(os.environ, OMNIJAX_BENCH_PROBE="on")
    done = harness.run_worker(harness.module_command("bench.quality.passkey", "--x"), inline=True, env=env)
    assert done.returncode == 0 and seen == [("bench.quality.passkey", ["--x"], "on")]
    assert "OMNIJAX_BENCH_PROBE" not in os.environ
    with pytest.raises(RuntimeError, match="failed"):
        harness.run_worker(harness.module_command("bench.quality.passkey", "--fail"), inline=True, env=env)
    assert "OMNIJAX_BENCH_PROBE" not in os.environ
    harness.run_worker(harness.module_command("bench.quality.passkey", "--y"), inline=True)  # no env: as it is
    assert seen[-1] == ("bench.quality.passkey", ["--y"], None)


def test_gpu_checks_syntax():
    done = subprocess.run(["bash", "-n", str(BENCH / "gpu_checks.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
