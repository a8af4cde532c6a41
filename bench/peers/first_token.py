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
side by side. torch runs with `OMP_WAIT_POLICY=PASSIVE` (its spinning threads otherwise slow the other process on a
shared machine). Default model: the SmolLM2-135M-Instruct Q4_1 GGUF `make smollm2` installs (converted once into
`<out>/first_token_model/`, by `omnijax convert` and by transformers' GGUF loader + `save_pretrained`); `--smoke`:
a tiny random llama GGUF, one round, a 16-token answer, and both omnijax sides read the smoke run's persistent
cache, unprimed (a check that the script runs, not a measurement: the cold side loads what the warm one compiled);
the tiny GGUF and its conversions are made once under `<out>/smoke_tiny_gguf/` and shared with `load_memory --smoke`
(`smoke_models`).

    python -m bench.peers.first_token --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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


def _omnijax(model_dir: Path, cache: str, marks: dict, max_tokens: int) -> str:
    import omnijax
    from omnijax.retention import OmniPick

    omnijax.enable_compilation_cache(cache)
    marks["imported"] = time.time()
    model = omnijax.load(model_dir)
    marks["loaded"] = time.time()
    config = omnijax.StreamConfig(policy=OmniPick(high_watermark=512, low_watermark=384, text_budget=128),
                                  page_size=16, num_pages=68, max_answer_tokens=16)
    chat = omnijax.Chat(model, config)
    chat.system(SYSTEM)
    answer = []
    for delta in chat.ask(QUESTION, max_tokens=max_tokens):
        if delta and "first_token" not in marks:
            marks["first_token"] = time.time()
        answer.append(delta)
    return "".join(answer)


def _transformers(model_dir: Path, marks: dict, max_tokens: int) -> str:
    import torch
    import transformers

    marks["imported"] = time.time()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    marks["loaded"] = time.time()

    class FirstToken:  # generate's streamer: the first put() is the prompt, the second the first new token
        calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                marks["first_token"] = time.time()

        def end(self):
            pass

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, streamer=FirstToken())
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def worker(side: str, models: Path, cache: str, max_tokens: int = MAX_TOKENS) -> dict:
    """One chat turn in this process; returns the wall-clock time of each stage and the answer."""
    marks: dict[str, float] = {}
    if side == "transformers":
        answer = _transformers(models / "hf", marks, max_tokens)
    else:
        answer = _omnijax(models / "omnijax", cache, marks, max_tokens)
    marks["answered"] = time.time()
    return {"marks": marks, "answer": answer}


def prepare_models(gguf_path: Path, models: Path, chat_template: str | None = None) -> None:
    """Both checkpoints of `gguf_path` under `models/` (`omnijax/`, `hf/`), each made once (a fresh process), with
    `chat_template` written beside each when given."""
    for name, convert in (("omnijax", "omnijax"), ("hf", "transformers")):
        if (models / name / ".complete").exists():
            continue
        shutil.rmtree(models / name, ignore_errors=True)
        print(f"converting {gguf_path.name} for {convert} into {models / name}", flush=True)
        command = harness.module_command("bench.peers.convert_gguf", "--worker", convert, "--gguf", gguf_path,
                                         "--dst", models / name)
        done = subprocess.run(command, cwd=harness.ROOT, capture_output=True, text=True, timeout=1800,
                              env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false"))
        if done.returncode != 0:
            raise SystemExit(f"converting for {convert} failed ({done.returncode}):\n{done.stderr[-3000:]}")
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
        prepare_models(gguf_path, root / "models", CHATML_TEMPLATE)
    return gguf_path, root / "models"


def run_one(side: str, models: Path, cache: str, max_tokens: int = MAX_TOKENS) -> dict:
    """`side`'s chat turn in a fresh process: seconds from the process's start to each stage."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each omnijax side names its own cache
    # omnijax_kept (and omnijax_cold) run as a user's process does, kept executables on; omnijax_warm without them
    env["OMNIJAX_EXECUTABLE_CACHE"] = "on" if side != "omnijax_warm" else "off"
    load = os.getloadavg()[0]
    start = time.time()
    done = subprocess.run(harness.module_command(__spec__.name, "--worker", side, "--models", models, "--cache",
                                                 cache, "--max-tokens", max_tokens),
                          cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=1800)
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"side": side, "load_avg": load, "answer": row["answer"], "exit_s": exited - start,
            **{f"{k}_s": row["marks"][k] - start for k in STAGES}}


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=5, help="runs per side (alternating order)")
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
        print(json.dumps(worker(args.worker, Path(args.models), args.cache, args.max_tokens)))
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
            run_one("omnijax_kept", models, warm_cache, args.max_tokens)  # fills both caches: XLA compiles anew
        rows = []
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                cache = warm_cache if side != "omnijax_cold" else tempfile.mkdtemp(dir=work, prefix="cold_cache_")
                if args.smoke and side == "omnijax_cold":  # a check: the cold side loads what the warm one compiled
                    cache = warm_cache
                row = dict(run_one(side, models, cache, args.max_tokens), round=r)
                rows.append(row)
                print(f"  round {r + 1}/{args.rounds} {side:13s} first token {row['first_token_s']:.2f} s "
                      f"(imported {row['imported_s']:.2f}, loaded {row['loaded_s']:.2f}), load avg "
                      f"{row['load_avg']:.1f}", flush=True)
    summary = {s: {k: float(np.median([r[f"{k}_s"] for r in rows if r["side"] == s])) for k in STAGES}
               for s in SIDES}
    by_round = {(r["round"], r["side"]): r["first_token_s"] for r in rows}
    ratio = {s: float(np.median([by_round[(i, s)] / by_round[(i, "transformers")] for i in range(args.rounds)]))
             for s in OURS}
    answers = {s: next(r["answer"] for r in rows if r["side"] == s) for s in SIDES}
    harness.print_table([dict(side=s, **summary[s], ratio=ratio.get(s, 1.0)) for s in SIDES],
                        [("side", "side", ""), ("imported s", "imported", ".2f"), ("loaded s", "loaded", ".2f"),
                         ("first token s", "first_token", ".2f"), ("answered s", "answered", ".2f"),
                         ("first token / transformers", "ratio", ".2f")])
    for s in SIDES:
        print(f"  {s}: {answers[s]!r}")
    harness.write_json(out, "first_token", {
        "gguf": gguf_path.name, "smoke": bool(args.smoke), "rounds": args.rounds, "max_tokens": args.max_tokens,
        "question": QUESTION,
        "rows": rows, "median_s": summary, "first_token_ratio_over_transformers": ratio, "answers": answers})
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
