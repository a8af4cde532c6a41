"""Resident memory per stage, omnijax against transformers, on the same float32 weights: after the imports, after
loading the model, after the first streamed chunk and in the steady state (issue 38: one copy of the weights).

Each side runs in a fresh worker process of this script (`--worker omnijax|transformers`, one JSON line on stdout),
the two alternating round by round; stages are read from `/proc/self/status` (`VmRSS`: resident now; the peak is
`VmHWM`, and `ru_maxrss` at the end). Stages:

    import   omnijax: `import omnijax` + what `omnijax.load` imports (orbax, TensorStore, the tokenizer library);
             transformers: `import torch, transformers`
    load     omnijax: `omnijax.load(CKPT)` (weights ready); transformers: `AutoModelForCausalLM.from_pretrained(HF,
             dtype=float32)` of the checkpoint transformers itself wrote from the same GGUF
    first    one chunk of `--chunk` random token ids streamed (omnijax: `Session(model, num_pages=...)`,
             `session.feed`; transformers: a forward with a `DynamicCache`, `logits_to_keep=1`, inference mode),
             compilation included
    steady   `--chunks` more chunks
    trimmed  the same, after `malloc_trim(0)` returns the allocator's free heap pages to the system (what the
             steady state holds in freed compiler and step buffers, not in live data)

Each stage also records `RssAnon` (heap and anonymous maps: omnijax's weights) and `RssFile` (mapped files:
transformers' safetensors weights) beside `VmRSS`. `weights` is the bytes of the parameters (omnijax's decoder tree;
transformers' `model.parameters()`, a tied embedding counted once); `load growth` is resident after load minus after
import. torch runs with `OMP_WAIT_POLICY=PASSIVE`. Default: SmolLM2-135M-Instruct (the Q4_1 GGUF `make smollm2`
installs, dequantised to float32 by both, each conversion kept under `--cache`, default `~/.cache/omnijax-bench`:
omnijax's with `omnijax.demo.smollm2.converted`, transformers' `save_pretrained` of its GGUF load); `--smoke`: a
tiny random llama GGUF, one round, chunk 32, its conversions those `first_token --smoke` makes into the same `--out`
(`first_token.smoke_models`: made once, whichever runs first), each worker run in the script's own process (a check
that the script works: its memory figures are then the parent's, not a fresh process's).

    python -m bench.peers.load_memory --rounds 5 --out bench/peers/results
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench import harness

SIDES = ("omnijax", "transformers")
STAGES = ("import", "load", "first", "steady", "trimmed")


def _status() -> dict:
    """VmRSS, VmHWM, RssAnon (heap and anonymous maps: the weights' buffers) and RssFile (mapped files) in MB."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status
                      if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")))
    return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}


def worker(side: str, path: Path, chunk: int, chunks: int) -> dict:
    """One side's stages in this process."""
    rng = np.random.default_rng(0)
    stages = {}
    if side == "omnijax":
        import orbax.checkpoint  # noqa: F401  (what omnijax.load imports, counted with the imports)
        import tensorstore  # noqa: F401
        import tokenizers  # noqa: F401

        import omnijax
        import omnijax.models.registry  # noqa: F401

        stages["import"] = _status()
        model = omnijax.load(path)
        import jax
        from flax import nnx

        leaves = jax.tree.leaves(nnx.state(model.decoder))
        jax.block_until_ready(leaves)
        weights = sum(a.nbytes for a in leaves)
        stages["load"] = _status()
        from omnijax.chunks.chunk import text_chunk

        vocab = model.config.vocab_size
        session = omnijax.Session(model, num_pages=(chunks + 1) * chunk // 64 + 2, page_size=64)
        for i in range(chunks + 1):
            out = session.feed(text_chunk(rng.integers(0, vocab, chunk), length=chunk))
            np.asarray(out.logits)  # waits for the step
            if i == 0:
                stages["first"] = _status()
        if session.check_pool():
            raise SystemExit("the pool ran out: the measurement would be of a shorter stream")
    else:
        import torch
        import transformers

        stages["import"] = _status()
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
        stages["load"] = _status()
        cache = transformers.DynamicCache()
        vocab = model.config.vocab_size
        with torch.inference_mode():
            for i in range(chunks + 1):
                ids = torch.from_numpy(rng.integers(0, vocab, (1, chunk)))
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                if i == 0:
                    stages["first"] = _status()
    stages["steady"] = _status()
    ctypes.CDLL(None).malloc_trim(0)  # glibc: the freed heap pages go back to the system
    stages["trimmed"] = _status()
    return {"side": side, "weights_mb": weights / 2 ** 20,
            "rss_mb": {s: stages[s]["VmRSS"] for s in STAGES}, "hwm_mb": {s: stages[s]["VmHWM"] for s in STAGES},
            "anon_mb": {s: stages[s]["RssAnon"] for s in STAGES}, "file_mb": {s: stages[s]["RssFile"] for s in STAGES},
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_worker(side: str, path: Path, args) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    # --smoke (a check, its figures meaningless): the worker runs in this process (`harness.run_worker`)
    done = harness.run_worker(harness.module_command(__spec__.name, "--worker", side, "--path", path, "--chunk",
                                                     args.chunk, "--chunks", args.chunks),
                              inline=args.smoke, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{side} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), loadavg=os.getloadavg()[0])


def checkpoints(args, out: Path) -> tuple[Path, Path]:
    """(omnijax checkpoint, transformers checkpoint) of the same GGUF file."""
    from bench.peers.first_token import smoke_models
    from omnijax.demo import smollm2

    if args.smoke and not args.gguf:  # the tiny GGUF's two conversions, shared with first_token's smoke run
        _, models = smoke_models(out)
        return models / "omnijax", models / "hf"
    gguf_path = smollm2.find_gguf(args.gguf)
    cache = Path(args.cache).expanduser()
    hf = cache / "smollm2-hf"
    ours, _ = smollm2.converted(gguf_path, cache / "smollm2-omnijax", log=lambda line: None)
    if not (hf / "config.json").is_file():
        code = ("import sys, torch, transformers; p, name, dst = sys.argv[1:]; "
                "m = transformers.AutoModelForCausalLM.from_pretrained(p, gguf_file=name, dtype=torch.float32); "
                "m.save_pretrained(dst)")
        subprocess.run([sys.executable, "-c", code, str(gguf_path.parent), gguf_path.name, str(hf)], check=True,
                       capture_output=True, timeout=1800, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    return ours, hf


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--gguf", help="the GGUF file (default: the installed SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=5, help="worker pairs (alternating order)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per streamed chunk")
    p.add_argument("--chunks", type=int, default=8, help="chunks after the first (the steady state)")
    p.add_argument("--cache", default="~/.cache/omnijax-bench",
                   help="where both conversions of the GGUF file are kept between runs")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = harness.parse(p, argv, smoke={"rounds": 1, "chunk": 32, "chunks": 2})
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.path), args.chunk, args.chunks)))
        return 0
    out = harness.output_dir(args)
    ours, hf = checkpoints(args, out)
    rows = []
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            row = dict(run_worker(side, ours if side == "omnijax" else hf, args), round=r)
            rows.append(row)
            print(f"  round {r + 1}/{args.rounds} {side}: " + ", ".join(
                f"{s} {row['rss_mb'][s]:.0f}" for s in STAGES) + f" MB; peak {row['peak_mb']:.0f} MB", flush=True)
    summary = {}
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        med = {s: float(np.median([r["rss_mb"][s] for r in mine])) for s in STAGES}
        summary[side] = {"weights_mb": mine[0]["weights_mb"], "rss_mb": med,
                         "anon_mb": {s: float(np.median([r["anon_mb"][s] for r in mine])) for s in STAGES},
                         "rss_spread_mb": {s: float(np.ptp([r["rss_mb"][s] for r in mine])) for s in STAGES},
                         "peak_mb": float(np.median([r["peak_mb"] for r in mine])),
                         "load_growth_mb": float(np.median([r["rss_mb"]["load"] - r["rss_mb"]["import"]
                                                            for r in mine]))}
        summary[side]["load_growth_over_weights"] = summary[side]["load_growth_mb"] / summary[side]["weights_mb"]
    ratio = {s: harness.same_round_ratio([r["rss_mb"][s] for r in rows if r["side"] == "omnijax"],
                                         [r["rss_mb"][s] for r in rows if r["side"] == "transformers"])
             for s in STAGES}
    ratio["peak"] = harness.same_round_ratio([r["peak_mb"] for r in rows if r["side"] == "omnijax"],
                                             [r["peak_mb"] for r in rows if r["side"] == "transformers"])
    table = [dict(side=s, weights=summary[s]["weights_mb"], growth=summary[s]["load_growth_over_weights"],
                  peak=summary[s]["peak_mb"], **summary[s]["rss_mb"]) for s in SIDES]
    table.append(dict(side="omnijax / transformers", weights=None, growth=None, **ratio))
    harness.print_table(table, [("side", "side", ""), ("weights MB", "weights", ".0f"), *[
        (f"{s} MB", s, ".2f") for s in STAGES], ("peak MB", "peak", ".2f"), ("load growth / weights", "growth",
                                                                              ".2f")])
    loadavg = [r["loadavg"] for r in rows]
    print(f"load average at the workers' ends: {min(loadavg):.1f}-{max(loadavg):.1f}")
    harness.write_json(out, "load_memory", {"smoke": bool(args.smoke), "rounds": args.rounds, "chunk": args.chunk,
                                            "chunks": args.chunks, "rows": rows, "median": summary,
                                            "ratio_omnijax_over_transformers": ratio})
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x = np.arange(len(STAGES))
    for k, (side, color) in enumerate(zip(SIDES, ("tab:blue", "tab:gray"))):
        ax.bar(x + (k - 0.5) * 0.38, [summary[side]["rss_mb"][s] for s in STAGES], 0.38, color=color, label=side)
    ax.axhline(summary["omnijax"]["weights_mb"], color="k", lw=0.8, ls="--", label="weights")
    ax.set_xticks(x, STAGES)
    ax.set_ylabel("resident memory (MB)")
    ax.legend(fontsize=7)
    ax.set_title(f"resident memory per stage (median of {args.rounds})", fontsize=9)
    harness.save_png(fig, out, "load_memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
