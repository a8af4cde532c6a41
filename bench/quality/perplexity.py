"""Perplexity against length on natural public-domain text, streamed through omnijax's paged cache: full context
against a bounded window without attention sinks and with them (StreamingLLM's attention-sink finding).

The vendored text (`bench/quality/data/`, Alice by default) is tokenized, cut to `--length` tokens (+1 target) and
streamed in chunks of `--chunk` tokens; every token's next-token log-likelihood is scored against the cache the
retention policy left before its chunk plus the chunk's earlier tokens (`bench/quality/_score.py`: `chunk_step`'s own
forward with every position scored, since the step returns the last position's logits only). Configurations
(`--configs`), each holding at most `--window` cells after a trim:

    full         NoSlide: every token attends to the whole text
    window       StreamingLLM(sink_tokens=0, window=W): the newest W tokens, positions re-indexed in the cache
    sinks        StreamingLLM(sink_tokens=S, window=W - S): the first S tokens pinned, positions re-indexed
    window_abs   SinkWindow(sink=0, window=W): the newest W tokens, original positions kept
    sinks_abs    SinkWindow(sink=S, window=W - S): the first S tokens pinned, original positions kept

(S = `--sinks`, 4 by default.) A token in chunk c attends to between W and W + chunk - 1 cells once the window is
full. Check: transformers (in its own process) scores the first `--check-tokens` tokens with the same weights, and
its full-context perplexity must equal omnijax's within 1e-3 relative.

Prints a table (perplexity per position bucket, overall, and past the window), writes `perplexity.json` (the
per-token log-likelihoods of every configuration, the check) and `perplexity.png` (perplexity against position).

    .venv/bin/python -m bench.quality.perplexity --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python -m bench.quality.perplexity --length 8192 --window 1024 --chunk 128 --configs full window sinks
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.quality import _common as common

CONFIGS = ("full", "window", "sinks", "window_abs", "sinks_abs")
TEXTS = ("alice29.txt", "asyoulik.txt")
CHECK_RTOL = 1e-3
SMOKE = dict(length=256, window=64, chunk=32, bucket=64, check_tokens=128)


def build_parser():
    p = harness.parser(__doc__)
    common.add_model_args(p)
    p.add_argument("--text", default=TEXTS[0], choices=TEXTS, help="the vendored text (bench/quality/data/)")
    p.add_argument("--length", type=int, default=2048, help="tokens scored")
    p.add_argument("--window", type=int, default=256, help="cells a bounded configuration holds after a trim")
    p.add_argument("--sinks", type=int, default=4, help="attention-sink tokens of `sinks` / `sinks_abs`")
    p.add_argument("--chunk", type=int, default=64, help="tokens per streamed chunk")
    p.add_argument("--bucket", type=int, default=256, help="tokens per position bucket of the table and plot")
    p.add_argument("--configs", nargs="+", default=["full", "window", "sinks"], choices=CONFIGS)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=512,
                   help="tokens transformers scores for the check (0: no check)")
    p.add_argument("--worker", choices=["transformers"], help=_hidden())
    p.add_argument("--ids", help=_hidden())
    return p


def _hidden():
    import argparse

    return argparse.SUPPRESS


def check_args(args) -> None:
    """Refuses sizes that cannot run, naming the flag."""
    for flag in ("length", "window", "chunk", "bucket", "page_size"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.sinks < args.window:
        raise SystemExit(f"--sinks must be in [0, --window), got {args.sinks} with --window {args.window}")
    if args.check_tokens < 0:
        raise SystemExit(f"--check-tokens must be >= 0, got {args.check_tokens}")


def policy_for(name: str, window: int, sinks: int):
    """The retention policy of configuration `name` (see the module docstring)."""
    from omnijax import retention as r

    make = {"full": lambda: r.NoSlide(),
            "window": lambda: r.StreamingLLM(sink_tokens=0, window=window, high_watermark=window),
            "sinks": lambda: r.StreamingLLM(sink_tokens=sinks, window=window - sinks, high_watermark=window),
            "window_abs": lambda: r.SinkWindow(sink=0, window=window),
            "sinks_abs": lambda: r.SinkWindow(sink=sinks, window=window - sinks)}
    return make[name]()


def text_ids(checkpoint: Path, name: str, length: int) -> list[int]:
    """The first `length + 1` token ids of the vendored text `name` (the checkpoint's tokenizer, no special tokens).

    Raises:
        SystemExit: the text has fewer tokens; names the most `--length` can be.
    """
    from omnijax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_directory(checkpoint)
    text = common.natural_text(name)
    chars = min(len(text), 8 * (length + 1))
    ids = tok.encode(text[:chars])
    if len(ids) <= length and chars < len(text):
        ids = tok.encode(text)
    if len(ids) <= length:
        raise SystemExit(f"--length {length}: {name} has {len(ids)} tokens with this tokenizer; give --length "
                         f"{len(ids) - 1} or less")
    return ids[:length + 1]


def ppl(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll)))) if len(nll) else float("nan")


def buckets(length: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, length)) for a in range(0, length, size)]


# ------------------------------------------------------------------------------------------------ transformers
def transformers_worker(spec: dict, out: Path) -> None:
    """Scores `spec["ids"]` in one forward of transformers and writes the per-token log-likelihoods."""
    import torch

    started = time.perf_counter()
    model, _ = common.load_transformers(spec["reference"])
    ids = torch.as_tensor([spec["ids"]])
    with torch.inference_mode():
        logits = model(input_ids=ids[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="none")
    (out / "perplexity_transformers.json").write_text(json.dumps(dict(nll=nll.tolist(),
                                                                      seconds=time.perf_counter() - started)))


def start_check(args, source: common.ModelSource, ids: list[int], out: Path):
    """Starts the transformers worker on the first `--check-tokens` tokens; None when there is nothing to check
    against (a `--checkpoint` run: no weights transformers loads) or the check is off. `--smoke` (a check that
    measures nothing) runs it to its end in this process (`harness.run_worker`) instead of beside omnijax's scoring."""
    n = min(args.check_tokens, args.length)
    if n == 0 or source.reference is None:
        return None
    spec = out / "perplexity_check.json"
    spec.write_text(json.dumps(dict(reference=source.reference, ids=ids[:n + 1])))
    command = harness.module_command(__spec__.name, "--worker", "transformers", "--ids", spec, "--out", out)
    if args.smoke:
        done = harness.run_worker(command, inline=True)
        print(done.stdout, end="", flush=True)
        print(done.stderr, end="", file=sys.stderr, flush=True)
        return done
    return subprocess.Popen(command, cwd=harness.ROOT)


def finish_check(worker, full_nll: np.ndarray | None, out: Path) -> dict:
    """Waits for the transformers worker and compares its perplexity with omnijax's full-context one."""
    if worker is None:
        return dict(ran=False, why="no transformers reference (--checkpoint run or --check-tokens 0)")
    if (worker.wait() if isinstance(worker, subprocess.Popen) else worker.returncode) != 0:
        raise SystemExit(f"the transformers check worker exited {worker.returncode} (its traceback is above)")
    theirs = np.asarray(json.loads((out / "perplexity_transformers.json").read_text())["nll"])
    if full_nll is None:
        return dict(ran=False, why="the `full` configuration was not run")
    ours = full_nll[:len(theirs)]
    a, b = ppl(ours), ppl(theirs)
    rel = abs(a - b) / b
    return dict(ran=True, tokens=len(theirs), omnijax_ppl=a, transformers_ppl=b, rel_diff=rel,
                max_token_nll_diff=float(np.max(np.abs(ours - theirs))), rtol=CHECK_RTOL, passed=rel <= CHECK_RTOL)


# ------------------------------------------------------------------------------------------------------- parent
def print_table(results: dict, args) -> list[dict]:
    cuts = buckets(args.length, args.bucket)
    table = []
    for name, r in results.items():
        nll = np.asarray(r["nll"])
        row = {"config": name, "cells": r["max_attended"]}
        for a, b in cuts:
            row[f"{a}-{b}"] = ppl(nll[a:b])
        row["all"] = ppl(nll)
        row["past window"] = ppl(nll[args.window:]) if args.window < args.length else None
        table.append(row)
    print(f"\nperplexity per token-position bucket ({args.text}, {args.length} tokens, window {args.window}, "
          f"{args.sinks} sinks, chunks of {args.chunk}); cells = most cells a chunk attended")
    harness.print_table(table, [("config", "config", ""), ("cells", "cells", "d")] +
                        [(f"{a}-{b}", f"{a}-{b}", ".2f") for a, b in cuts] +
                        [("all", "all", ".2f"), ("past window", "past window", ".2f")])
    return table


def plot(results: dict, args, out: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    cuts = buckets(args.length, args.bucket)
    for name, r in results.items():
        nll = np.asarray(r["nll"])
        # the *_abs pair dashed: `window_abs` lies on `window` (relative RoPE distances are the same in both)
        ax.plot([(a + b) / 2 for a, b in cuts], [ppl(nll[a:b]) for a, b in cuts], marker="o", label=name,
                ls="--" if name.endswith("_abs") else "-", ms=4 if name.endswith("_abs") else 6)
    ax.axvline(args.window, color="grey", ls=":", lw=1, label=f"window ({args.window} cells)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("token position")
    ax.set_ylabel(f"perplexity per {args.bucket} tokens")
    ax.set_title(f"{args.text}: full context vs window without / with {args.sinks} sinks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    harness.save_png(fig, out, "perplexity")


def header(args, source: common.ModelSource) -> dict:
    """The settings a `perplexity.json` records beside its results."""
    return dict(model=str(source.gguf or source.checkpoint), random_weights=source.tiny, text=args.text,
                length=args.length, window=args.window, sinks=args.sinks, chunk=args.chunk, bucket=args.bucket)


def main(argv=None):
    args = harness.parse(build_parser(), sys.argv[1:] if argv is None else argv, smoke=SMOKE)
    common.quiet_threads()
    out = harness.output_dir(args)
    if args.worker:
        transformers_worker(json.loads(Path(args.ids).read_text()), out)
        return
    check_args(args)
    source = common.model_source(args)
    ids = text_ids(source.checkpoint, args.text, args.length)
    worker = start_check(args, source, ids, out)
    try:
        import omnijax
        from bench.quality._score import score_stream

        model = omnijax.load(source.checkpoint)
        results = {}
        for name in args.configs:
            started = time.perf_counter()
            cells = None if name == "full" else args.window
            nll, attended = score_stream(model, np.asarray(ids), policy_for(name, args.window, args.sinks),
                                         chunk=args.chunk, cells=cells, page_size=args.page_size)
            seconds = time.perf_counter() - started
            results[name] = dict(nll=nll.tolist(), attended=attended.tolist(), max_attended=int(attended.max()),
                                 ppl=ppl(nll), seconds=seconds)
            print(f"  {name}: perplexity {ppl(nll):.3f} over {len(nll)} tokens, at most {int(attended.max())} cells "
                  f"attended, {seconds:.1f} s", flush=True)
            # each configuration as it comes: a run stopped early keeps the ones it finished
            harness.write_json(out, "perplexity", dict(header(args, source), complete=False, configs=results))
    except BaseException:
        if worker is not None:
            worker.kill()
        raise
    full = np.asarray(results["full"]["nll"]) if "full" in results else None
    check = finish_check(worker, full, out)
    if check["ran"]:
        print(f"check: full-context perplexity over the first {check['tokens']} tokens, omnijax "
              f"{check['omnijax_ppl']:.6f} vs transformers {check['transformers_ppl']:.6f} (relative "
              f"{check['rel_diff']:.1e}, limit {CHECK_RTOL:g}): {'equal' if check['passed'] else 'DIFFERENT'}")
    else:
        print(f"check: not run ({check['why']})")
    table = print_table(results, args)
    harness.write_json(out, "perplexity", dict(header(args, source), complete=True, check=check, table=table,
                                               configs=results))
    plot(results, args, out)
    if check["ran"] and not check["passed"]:
        raise SystemExit(f"the check failed: omnijax's full-context perplexity differs from transformers' by "
                         f"{check['rel_diff']:.2e} relative (limit {CHECK_RTOL:g})")


if __name__ == "__main__":
    main()
