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

(S = `--sinks`, 4 by default.) The retention policies of the pass-key bench are configurations too, each built at a
budget of W cells by the same builder (`bench/quality/_stream.policy_at`: the watermark policies trim past W down to
3W/4, the fixed-budget ones hold W):

    no_slide omnipick unit_fifo token_sliding streaming_llm h2o sink_window streaming_vlm infinipot_v streammem

(`--configs policies` names all ten.) Text is one TEXT unit per chunk (`_score.score_stream`), which is what the
unit-structured policies (OmniPick, UnitFIFO, StreamingVLM) see. `no_slide` is the `full` configuration's policy and
is not scored twice when `full` runs. InfiniPot-V compresses visual spans only and keeps every text cell (its
row says so). A bounded configuration holds at most W cells after each trim, so a chunk's forward attends to at
most W + chunk cells (history and chunk); the run refuses to write a table where one attended more. H2O runs on the
reference attention (the one that computes the attention mass it ranks by).

Check: transformers (in its own process) scores the first `--check-tokens` tokens with the same weights, and
its full-context perplexity must equal omnijax's within 1e-3 relative.

Prints a table (perplexity per position bucket, overall, and past the window), writes `perplexity.json` (the
per-token log-likelihoods of every configuration, the check), `perplexity.png` (perplexity against position) and
`perplexity_bars.png` (overall and past-window perplexity per configuration).

    .venv/bin/python -m bench.quality.perplexity --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python -m bench.quality.perplexity --length 8192 --window 1024 --chunk 128 --configs full window sinks
    .venv/bin/python -m bench.quality.perplexity --configs full window sinks policies --resume
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
from bench.quality import _stream

ABLATION = ("full", "window", "sinks", "window_abs", "sinks_abs")
CONFIGS = ABLATION + _stream.POLICIES
UNBOUNDED = ("full", "no_slide") + tuple(_stream.TEXT_ONLY_LIMITS)
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
    p.add_argument("--configs", nargs="+", default=["full", "window", "sinks"], choices=CONFIGS + ("policies",),
                   help="configurations to score, in order ('policies': the ten retention policies)")
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations OUT/perplexity.json already holds for the same settings")
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
    if args.window < 4 and set(args.configs) & set(_stream.POLICIES):
        raise SystemExit(f"--window {args.window}: the retention policies need a budget of at least 4 cells")


def expand_configs(names: list[str]) -> list[str]:
    """`names` with `policies` replaced by the ten policy names, each name once, in order."""
    out: list[str] = []
    for name in names:
        for n in (_stream.POLICIES if name == "policies" else (name,)):
            if n not in out:
                out.append(n)
    return out


def policy_for(name: str, window: int, sinks: int):
    """The retention policy of configuration `name` (see the module docstring): a retention policy's name builds it
    at a budget of `window` cells (`_stream.policy_at`)."""
    from omnijax import retention as r

    if name in _stream.POLICIES:
        return _stream.policy_at(name, window)
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
    fig, ax = plt.subplots(figsize=(7.5 if len(results) <= 5 else 10.0, 4.2))
    cuts = buckets(args.length, args.bucket)
    colours = plt.get_cmap("tab20").colors
    for i, (name, labels) in enumerate(equal_groups(results).items()):
        nll = np.asarray(results[name]["nll"])
        # the *_abs pair dashed: `window_abs` lies on `window` (relative RoPE distances are the same in both)
        ax.plot([(a + b) / 2 for a, b in cuts], [ppl(nll[a:b]) for a, b in cuts], marker="o", label=" = ".join(labels),
                ls="--" if name.endswith("_abs") else "-", ms=4 if name.endswith("_abs") else 6,
                color=colours[i % len(colours)])
    ax.axvline(args.window, color="grey", ls=":", lw=1, label=f"window ({args.window} cells)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("token position")
    ax.set_ylabel(f"perplexity per {args.bucket} tokens")
    ax.set_title(f"{args.text}: full context vs window without / with {args.sinks} sinks" if
                 set(results) <= set(ABLATION) else f"{args.text}: retention policies at {args.window} cells")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    harness.save_png(fig, out, "perplexity")


def equal_groups(results: dict) -> dict[str, list[str]]:
    """Configurations whose per-token log-likelihoods are equal, grouped under the first of them (one line each)."""
    groups: dict[str, list[str]] = {}
    for name, r in results.items():
        same = next((g for g in groups if results[g]["nll"] == r["nll"]), None)
        groups.setdefault(same or name, []).append(name)
    return groups


def resumed(out: Path, settings: dict, names: list[str]) -> dict:
    """The configurations of `names` that OUT/perplexity.json holds for the same `settings` (empty when there is
    no file).

    Raises:
        SystemExit: the file was written with other settings (naming them), so its rows cannot join this run.
    """
    path = out / "perplexity.json"
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    differ = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
    if differ:
        raise SystemExit(f"--resume: {path} was written with other settings {differ} (its value, this run's); give "
                         "another --out or the same settings")
    kept = {k: v for k, v in old["configs"].items() if k in names}
    print(f"--resume: {', '.join(kept) or 'nothing'} kept from {path}", flush=True)
    return kept


def check_budget(results: dict, args) -> None:
    """Refuses a bounded configuration that attended more than `--window` retained cells plus its chunk."""
    limit = args.window + args.chunk
    over = {k: r["max_attended"] for k, r in results.items() if k not in UNBOUNDED and r["max_attended"] > limit}
    if over:
        raise SystemExit(f"configurations held more than --window {args.window} cells after a trim (most cells a "
                         f"chunk attended, limit {limit}): {over}")


def plot_bars(table: list[dict], args, out: Path) -> None:
    """`perplexity_bars.png`: each configuration's perplexity overall and past the window, side by side."""
    plt = harness.pyplot()
    names = [row["config"] for row in table]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(names) + 2), 4.2))
    x = np.arange(len(names))
    for i, (key, label) in enumerate((("all", "all tokens"), ("past window", f"past token {args.window}"))):
        values = [row[key] if row[key] is not None else np.nan for row in table]
        bars = ax.bar(x + (i - 0.5) * 0.4, values, 0.4, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=6)
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("perplexity")
    ax.set_title(f"{args.text}, {args.length} tokens: bounded configurations hold {args.window} cells "
                 f"(chunks of {args.chunk})")
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, 1.15 * max(row["all"] for row in table))
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    harness.save_png(fig, out, "perplexity_bars")


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
    args.configs = expand_configs(args.configs)
    check_args(args)
    source = common.model_source(args)
    ids = text_ids(source.checkpoint, args.text, args.length)
    worker = start_check(args, source, ids, out)
    try:
        import omnijax
        from bench.quality._score import score_stream

        model = omnijax.load(source.checkpoint)
        results = resumed(out, header(args, source), args.configs) if args.resume else {}
        for name in args.configs:
            if name in results:
                continue
            if name == "no_slide" and "full" in results:  # the same policy, the same program: not scored twice
                results[name] = dict(results["full"], same_as="full")
                continue
            policy = policy_for(name, args.window, args.sinks)
            started = time.perf_counter()
            nll, attended = score_stream(model, np.asarray(ids), policy, chunk=args.chunk,
                                         cells=None if name in UNBOUNDED else args.window, page_size=args.page_size,
                                         impl="reference" if getattr(policy, "needs_scores", False) else "xla")
            seconds = time.perf_counter() - started
            results[name] = dict(nll=nll.tolist(), attended=attended.tolist(), max_attended=int(attended.max()),
                                 ppl=ppl(nll), seconds=seconds, policy=repr(policy),
                                 note=_stream.TEXT_ONLY_LIMITS.get(name))
            print(f"  {name}: perplexity {ppl(nll):.3f} over {len(nll)} tokens, at most {int(attended.max())} cells "
                  f"attended, {seconds:.1f} s", flush=True)
            # each configuration as it comes: a run stopped early keeps the ones it finished
            harness.write_json(out, "perplexity", dict(header(args, source), complete=False, configs=results))
        check_budget(results, args)
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
    if len(results) > 1:
        plot_bars(table, args, out)
    if check["ran"] and not check["passed"]:
        raise SystemExit(f"the check failed: omnijax's full-context perplexity differs from transformers' by "
                         f"{check['rel_diff']:.2e} relative (limit {CHECK_RTOL:g})")


if __name__ == "__main__":
    main()
