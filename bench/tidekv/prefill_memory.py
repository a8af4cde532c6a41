"""Transient construction memory of post-prefill SnapKV vs TideKV at 8K–64K prompts, and TideKV's TTFT overhead
(seed 001 §6.2/§6.6: 83.89 % lower transient construction footprint at 64K, +1.06–4.17 % TTFT).

Both methods build the *same* compressed cache (SnapKV, window 64, pooling kernel 5, the blockwise "xla" scorer, the
same uniform budget per KV head per layer); they differ only in the schedule:
    post-prefill  `token_major_prefill(chunk=None)`: one-shot prefill of every layer (all layers' full KV alive at the
                  end), then SnapKV selection layer by layer. Also `post-prefill chunked` (`chunk=C`, token-major
                  chunked prefill, still all layers' full KV alive before selection) as a second, stronger baseline:
                  it has chunk-bounded activations, so its gap to TideKV is the all-layer KV residency alone.
    TideKV        `tidekv_prefill`: a host loop over layers calling the jitted `layer_step`, which donates the hidden
                  bridge `[B, S, D]` and holds one layer's full KV and one chunk's activations.
    layer-wise one-shot (Method A only) `layer_step` with chunk = S: each layer runs the whole prompt at once and is
                  compressed at its end, i.e. the schedule of the paper's Hugging Face SnapKV baseline (one layer's
                  full KV, whole-prompt activations), which the paper's 83.89 % is measured against.
    post floor    (analytic) what any post-prefill schedule must hold however well it is chunked: the caller's
                  embeddings + the final hidden states + every layer's full K and V.

Definition. Weights and the final compressed cache are excluded; *transient construction memory* is everything
else live at the peak: the prompt embeddings the caller holds, padded copies, the bridge / hidden states, full KV,
window queries, attention/MLP activations and selection temporaries. For TideKV the finished layers' compressed
caches are part of the final cache and do not count; for post-prefill the same holds for the caches packed so far.

Method A (no execution, default Qwen2.5-Omni-7B layer shapes: 28 layers, hidden 3584, 28 heads / 4 KV heads, head
dim 128, intermediate 18944, bfloat16): the jitted programs are lowered with `jax.ShapeDtypeStruct` arguments and
compiled, and `compile().memory_analysis()` gives argument / output / alias / temp bytes. XLA_FLAGS
`--xla_cpu_experimental_ynn_fusion_type=` is set before jax is imported, otherwise XLA:CPU's fused matmul regions
hide their buffers. Weights are given to the compiler as float32 arguments: XLA:CPU computes bf16 dots in f32 and,
with bf16 weight arguments, keeps f32 copies of them as temps (26 GB for the stacked 28-layer one-shot program), a
CPU-backend artefact unrelated to cache construction; activations, KV and hidden states stay bf16. Phases:
    TideKV       x (caller's embeddings) + [layer_step: non-weight arguments (bridge, positions; the bridge output
                 aliases its argument) + temp + outputs other than the bridge and the layer cache]
    post-prefill max of  (1) x + [token_major: non-weight arguments (padded x copy, positions) + temp + outputs
                 (hidden, every layer's K and V, window queries)]
                 and (2) selection of one layer: x + padded x + hidden + all K/V + window queries + the layer's K/V
                 slices (`k_all[l, :, :S]` copies) + [select+pack jitted: temp].
The one-shot program scans the stacked weights and XLA:CPU materialises each layer's weight slices in its temp; they
are weight-derived, so they are read from the buffer assignment (`--xla_dump_to`) and subtracted (column "w-slices");
the raw figure is kept in the JSON. Largest temp buffers of every program are kept in the JSON too.

Method B (execution, narrow model: 4 layers, hidden 512, 8 heads / 2 KV heads, head dim 64, intermediate 1376,
mrope (8, 12, 12), vocab 1024, float32, random init), same selector and budget, default XLA flags (not the
memory-analysis flag). Per S:
    prime    for each method a process AOT-compiles its large jitted programs (`token_major` + the SnapKV scorer, or
             `layer_step`) into a persistent compilation cache (a temp dir) and runs the method once with those
             programs replaced by zero outputs, which compiles and caches the small eager ops around them; compiler
             memory would otherwise dominate the small TideKV peak
    base     a fresh process that only builds the model and the prompt: its VmHWM
    memory   per method a fresh process builds the same, runs the prefill once (every program comes from the cache;
             hits and misses are logged and kept in the JSON) and reads VmHWM from /proc/self/status;
             transient RSS = that VmHWM minus base's (it still includes one-time costs of a first call: tracing,
             lowering for the cache key, loading executables)
    timing   one process (no persistent cache: it compiles in its warm-up round) runs every method once (warm-up),
             then `--repeats` rounds that run every method once each, interleaved, the order rotated from round to
             round; TTFT = prefill to the last logits plus compression, `block_until_ready` on logits and cache;
             medians, and the TTFT ratios are medians of same-round ratios (robust to the machine's speed drifting).

Method B's default lengths are 4K and 8K: this 2-core CPU runs the narrow model at ~20 GFLOP/s, and one-shot
prefill (whose paged attention visits every page for every query: no causal skipping) costs tens of seconds per run
at 8K and grows with S^2, so 16K/32K with a memory run, a warm-up and 3 timed runs per method do not fit a 10-minute
run; `--append` merges separate runs (e.g. `--skip-compiled --rss-seq 16384 --append`) into one JSON/PNG.

Run: `python -m bench.tidekv.prefill_memory [--seq 8192 16384 32768 65536] [--rss-seq 4096 8192] [--budget 2048]
[--chunk 2048] [--repeats 3] [--skip-rss | --skip-compiled] [--small] [--out bench/out] [--smoke]`
(`--skip-rss` writes prefill_memory_compiled.{json,png}, `--skip-compiled` prefill_memory_rss.{json,png}; `--smoke`:
S = 1024, budget 128, chunk 512, Method A with `--small`, one timed round, Method B's worker modes all in one process
and its cache the persistent one `--smoke` turns on: a check that the script runs, not a measurement.)

Code: this script sets XLA_FLAGS, parses the command line, prints the tables and writes the JSON and PNG; Method A
lives in `_prefill_memory_compiled.py`, Method B (its worker processes run this module with `--worker`) in
`_prefill_memory_rss.py`, and what they share in `_prefill_memory_common.py` (all three in `bench/tidekv/`).
"""

from __future__ import annotations

import os
import sys
import tempfile

_ORIG_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--worker" not in sys.argv:  # Method A process: count fused buffers, dump buffer assignments for the breakdown
    _DUMP_DIR = tempfile.mkdtemp(prefix="prefill_memory_dump_")
    os.environ["XLA_FLAGS"] = " ".join([_ORIG_XLA_FLAGS, "--xla_cpu_experimental_ynn_fusion_type=",
                                        f"--xla_dump_to={_DUMP_DIR}",
                                        "--xla_dump_hlo_module_re=layer_step|token_major|select_pack"]).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

# The measurement modules import jax: only after XLA_FLAGS is set above.
from bench import harness  # noqa: E402
from bench.tidekv._prefill_memory_common import NARROW, PAGE, GiB, MiB  # noqa: E402
from bench.tidekv._prefill_memory_compiled import method_a  # noqa: E402
from bench.tidekv._prefill_memory_rss import method_b, worker  # noqa: E402


def main(argv=None):
    """Runs the methods the command line asks for, prints their tables and writes `<out>/<name>.{json,png}`; with
    `--worker`, runs one worker process of Method B instead."""
    parser = harness.parser(__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768, 65536],
                        help="Method A prompt lengths (Qwen2.5-Omni-7B shapes)")
    parser.add_argument("--rss-seq", type=int, nargs="+", default=[4096, 8192],
                        help="Method B prompt lengths (narrow executable model)")
    parser.add_argument("--budget", type=int, default=2048, help="tokens per KV head per layer (Method A)")
    parser.add_argument("--rss-budget", type=int, default=2048, help="tokens per KV head per layer (Method B)")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-rss", action="store_true", help="Method A only (compile-only, no execution)")
    parser.add_argument("--skip-compiled", action="store_true", help="Method B only")
    parser.add_argument("--small", action="store_true", help="Method A on a 2-layer narrow model (a quick check)")
    parser.add_argument("--append", action="store_true",
                        help="merge the rows into an existing output JSON (rows of the same S are replaced)")
    parser.add_argument("--worker", choices=["base", "prime", "memory", "timing", "every"], help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--worker-seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = harness.parse(parser, argv, smoke=dict(seq=[1024], rss_seq=[1024], budget=128, rss_budget=128, chunk=512,
                                                  window=16, repeats=1, small=True))
    if args.worker:
        return worker(args)
    out = harness.output_dir(args)
    t_run = time.perf_counter()
    summary = {"definition": "transient = peak live bytes minus weights minus the final compressed cache",
               "budget_per_kv_head_per_layer": args.budget, "chunk": args.chunk, "page": PAGE,
               "selector": f"SnapKV(window={args.window}, pool_kernel=5, impl='xla', block_size=512)", "impl": "xla"}
    a_rows, b_rows = [], []
    try:
        if not args.skip_compiled:
            print("Method A: compiled memory analysis (Qwen2.5-Omni-7B layer shapes, bf16, batch 1)", flush=True)
            cfg, a_rows = method_a(args, _DUMP_DIR)
            summary["method_a"] = {"config": cfg.to_json(), "weights_given_as": "float32 arguments", "rows": a_rows}
    finally:
        shutil.rmtree(_DUMP_DIR, ignore_errors=True)
    if not args.skip_rss:
        print("Method B: transient peak RSS and TTFT of fresh processes (narrow float32 model)", flush=True)
        # --smoke: the persistent cache `harness.parse` turned on (kept), so a second smoke run compiles nothing
        shared = os.environ.get("JAX_COMPILATION_CACHE_DIR") if args.smoke else None
        args.cache_dir = shared or tempfile.mkdtemp(prefix="prefill_memory_cc_")
        try:
            b_rows = method_b(args, entry_module=__spec__.name, worker_xla_flags=_ORIG_XLA_FLAGS)
        finally:
            if not shared:
                shutil.rmtree(args.cache_dir, ignore_errors=True)
        summary["method_b"] = {"config": NARROW.to_json(), "budget_per_kv_head_per_layer": args.rss_budget,
                               "repeats": args.repeats, "rows": b_rows}

    name = "prefill_memory" if a_rows and b_rows else "prefill_memory_compiled" if a_rows else "prefill_memory_rss"
    path = out / f"{name}.json"
    if args.append and path.exists():  # merge with an earlier run's rows (same S replaced)
        old = json.loads(path.read_text())
        for key, rows in (("method_a", a_rows), ("method_b", b_rows)):
            if key in old and key in summary:
                mine = {r["seq"] for r in rows}
                rows[:0] = [r for r in old[key]["rows"] if r["seq"] not in mine]
                rows.sort(key=lambda r: r["seq"])
                summary[key]["rows"] = rows
        summary["earlier_runtimes_s"] = old.get("earlier_runtimes_s", []) + [old.get("runtime_s")]
    if a_rows:
        print(f"\nMethod A (compiled, GiB; budget {args.budget}/head/layer, chunk {args.chunk}):")
        print(f"{'S':>6} {'post 1-shot':>11} {'w-slices':>8} {'post chunk':>10} {'lw 1-shot':>9} {'post floor':>10} "
              f"{'TideKV':>7} {'vs 1-shot':>9} {'vs chunked':>10} {'vs lw':>7} {'vs floor':>8} {'cache MiB':>9} same")
        for r in a_rows:
            t, p, pc, lw = r["tidekv"], r["post_oneshot"], r["post_chunked"], r["layerwise_oneshot"]
            print(f"{r['seq']:>6} {p['transient'] / GiB:>11.2f} {p['weight_slices'] / GiB:>8.2f} "
                  f"{pc['transient'] / GiB:>10.2f} {lw['transient'] / GiB:>9.2f} {r['post_floor'] / GiB:>10.2f} "
                  f"{t['transient'] / GiB:>7.3f} {100 * r['reduction_vs_oneshot']:>8.2f}% "
                  f"{100 * r['reduction_vs_chunked']:>9.2f}% {100 * r['reduction_vs_layerwise_oneshot']:>6.2f}% "
                  f"{100 * r['reduction_vs_post_floor']:>7.2f}% {t['cache_all_bytes'] / MiB:>9.2f} "
                  f"{'yes' if r['same_cache_bytes'] else 'NO'}")
    if b_rows:
        print(f"\nMethod B (fresh-process transient RSS in MiB; TTFT median of {args.repeats} interleaved rounds in s; "
              f"ratios = median of same-round ratios):")
        print(f"{'S':>6} {'post 1-shot':>11} {'post chunk':>10} {'TideKV':>7} {'vs 1-shot':>9} {'vs chunk':>8} "
              f"{'TTFT 1-shot':>11} {'TTFT chunk':>10} {'TTFT Tide':>9} {'Tide/1-shot':>11} {'Tide/chunk':>10} "
              f"{'cache KiB':>9} same")
        for r in b_rows:
            p, pc, t = r["post_oneshot"], r["post_chunked"], r["tidekv"]
            print(f"{r['seq']:>6} {p['transient_rss'] / MiB:>11.0f} {pc['transient_rss'] / MiB:>10.0f} "
                  f"{t['transient_rss'] / MiB:>7.0f} {100 * r['rss_reduction_vs_oneshot']:>8.1f}% "
                  f"{100 * r['rss_reduction_vs_chunked']:>7.1f}% "
                  f"{p['ttft_median_s']:>11.3f} {pc['ttft_median_s']:>10.3f} {t['ttft_median_s']:>9.3f} "
                  f"{r['ttft_ratio_vs_oneshot']:>11.3f} {r['ttft_ratio_vs_chunked']:>10.3f} "
                  f"{t['cache_all_bytes'] / 1024:>9.0f} {'yes' if r['same_cache_bytes'] else 'NO'}")
    runtime = time.perf_counter() - t_run
    summary["runtime_s"] = runtime
    print(f"total runtime {runtime:.0f} s")
    harness.write_json(out, name, summary, indent=2)
    plot(a_rows, b_rows, out, name)


def plot(a_rows, b_rows, out, name):
    """Method A's transient memory, Method B's transient RSS and TTFT ratios against S, one panel each."""
    plt = harness.pyplot()
    panels = (1 if a_rows else 0) + (2 if b_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    styles = {"post_oneshot": ("post-prefill SnapKV (one-shot)", "o"),
              "post_chunked": ("post-prefill SnapKV (chunked prefill)", "s"), "tidekv": ("TideKV", "^")}
    if a_rows:
        ax = axes.pop(0)
        x = [r["seq"] for r in a_rows]
        for key, (label, marker) in styles.items():
            ax.plot(x, [r[key]["transient"] / GiB for r in a_rows], marker=marker, label=label)
        ax.plot(x, [r["layerwise_oneshot"]["transient"] / GiB for r in a_rows], marker="v",
                label="SnapKV layer-wise one-shot (HF-style)")
        ax.plot(x, [r["post_floor"] / GiB for r in a_rows], linestyle=":", color="gray",
                label="post-prefill floor: x + hidden + all-layer KV")
        top = a_rows[-1]
        ax.annotate(f"{100 * top['reduction_vs_oneshot']:.1f}% lower",
                    xy=(top["seq"], top["tidekv"]["transient"] / GiB),
                    xytext=(0.45, 0.45), textcoords="axes fraction", arrowprops=dict(arrowstyle="->"))
        ax.set_title("A: compiled transient (Qwen2.5-Omni-7B shapes, bf16)", fontsize=9)
        ax.set_ylabel("transient construction memory (GiB)")
        ax.set_yscale("log")
    if b_rows:
        ax = axes.pop(0)
        x = [r["seq"] for r in b_rows]
        for key, (label, marker) in styles.items():
            ax.plot(x, [r[key]["transient_rss"] / MiB for r in b_rows], marker=marker, label=label)
        ax.set_title("B: fresh-process peak RSS minus base (narrow, f32)", fontsize=9)
        ax.set_ylabel("transient RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax = axes.pop(0)
        ax.plot(x, [r["ttft_ratio_vs_oneshot"] for r in b_rows], marker="o", label="TideKV / post one-shot")
        ax.plot(x, [r["ttft_ratio_vs_chunked"] for r in b_rows], marker="s", label="TideKV / post chunked")
        ax.axhline(1.05, color="gray", linestyle="--", linewidth=1, label="+5 % target")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title("B: TTFT ratio (median)", fontsize=9)
        ax.set_ylabel("TTFT ratio")
    for ax in fig.axes:
        ax.set_xscale("log", base=2)
        ticks = sorted({r["seq"] for r in (a_rows or b_rows)} | {r["seq"] for r in b_rows})
        ax.set_xticks(ticks, [f"{t // 1024}K" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens S")
        ax.legend(fontsize=7)
    harness.save_png(fig, out, name)


if __name__ == "__main__":
    main()
