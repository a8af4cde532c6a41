"""KV layout at the 32K checkpoint: useful cells against physical span per retention and paging mode (seed 000
§6, §7.2.3, Figure 12).

Each configuration streams one synthetic session as a single `omnijax.stream` scan and reads the per-chunk layout
statistics (`result.stats.layout`, `result.stats.moved`). The checkpoint is the first chunk whose cumulative streamed
tokens reach `--tokens` (32,768 by default). Reported there: retained (useful) cells, the page-rounded physical span
attention traverses, span / useful, active pages, and the peak span over all chunks up to it. Over the post-warm-up
stream (every chunk from the first trim up to the checkpoint): mean span, mean retained cells and the slots the
paging mode copied (its migration cost; eager compaction's count is the oracle's cost, which the paper excludes).
Right after each trim, the moment a paging mode acts: the span reduction (smallest and mean over the trims), since
the checkpoint's figure depends on where in the trim cycle it falls.

Sessions (`omnijax.testing.synthetic`): Qwen2.5-Omni, a 24-token system prompt then 2 s audiovisual units of 124 tokens
(70 video + 50 audio + 4 markers), 266 chunks = 32,884 tokens at 32K; MiniCPM-o 4.5, a 24-token system prompt then
1 s duplex units `<unit><image>E64</image>A10<|listen|></unit>` of 79 tokens without high-resolution slices (as in
`bench/omnitide/endurance.py`: slices would pad every chunk of the stacked session), 416 chunks = 32,809 tokens.

Writer model: a one-layer `TINY_OMNI` decoder (hidden 64, 2 KV heads, head dim 16, mrope) for Qwen and its 1D q/k-norm
variant for MiniCPM-o (the Qwen3 LLM), random init, float32, token ids folded into its 300-row vocab. Retention and
paging read only unit, span, order and position metadata, so the layout does not depend on the model's width, depth
or weights; the exception is H2O, whose kept set follows the writer's attention mass (its cell counts do not).

Configurations at the seed's 2500/1800 watermarks: StreamingLLM (2 sinks + 1,798 recent, trigger 2,500), OmniPick
only (native layout), H2O (900 heavy + 900 recent, trigger 2,500; needs `impl="reference"` for the attention mass),
and OmniPick with each OmniPage mode: `tile_skip` (class-aware placement, accepted if active pages or subblocks drop),
`ordered_suffix` (the paper's CUDA mode; `--min-pages`, default 1) and `eager` (pack everything after every trim:
the oracle). MiniCPM-o runs OmniPick with `source_image_whole=True` (its source image is kept whole, as in the
endurance tests). Everything else uses `impl="xla"`, page size 64, subblock 32, and a pool of `--pages` pages
(default 128 = 8,192 slots), far more than any mode needs; a run that exhausts the pool or drops a token fails.

Statistics are taken after each chunk's trim and re-layout, i.e. they describe the cache the next chunk is written
into, and (a second table) on the cache the chunk's own prefill attended over (`ChunkStats.attended`: before its
trim, with the chunk written in).

`--qwen-unit paper` streams the paper's Qwen rate instead: 1 s units of 909 tokens (video at 1 fps, one 616x1120
frame; `omnijax.testing.synthetic.QWEN_UNITS`), written to `kv_layout_paper.*`.

Run: `python -m bench.omnitide.kv_layout [--tokens 32768] [--models qwen minicpm] [--configs ...] [--min-pages 1]
[--pages 128] [--qwen-unit 2s] [--watermarks 2500 1800] [--out bench/out] [--smoke]`
"""

from __future__ import annotations

import time

import jax
import numpy as np

import omnijax
from bench import harness
from omnijax.chunks.spans import SpanKind
from omnijax.models.config import TINY_OMNI
from omnijax.paging import Paging
from omnijax.retention import H2O, InfiniPotV, OmniMemBudgets, OmniPick, StreamingLLM, StreamingVLM, StreamMem
from omnijax.testing import synthetic

QWEN_WRITER = TINY_OMNI.replace(num_layers=1)
MINICPM_WRITER = TINY_OMNI.replace(num_layers=1, mrope_section=None, qkv_bias=False, qk_norm=True)  # 1D positions
PAGE, SUBBLOCK = 64, 32

# name -> (policy kind, paging, impl); the policy is built per model (MiniCPM-o keeps its source image whole).
CONFIGS = {
    "streaming_llm": ("streaming_llm", Paging("native"), "xla"),
    "omnipick": ("omnipick", Paging("native"), "xla"),
    "h2o": ("h2o", Paging("native"), "reference"),
    "omnipick+tile_skip": ("omnipick", Paging("tile_skip"), "xla"),
    "omnipick+ordered_suffix": ("omnipick", Paging("ordered_suffix", min_pages=1), "xla"),
    "omnipick+eager": ("omnipick", Paging("eager"), "xla"),
    "streaming_vlm": ("streaming_vlm", Paging("native"), "xla"),
    "omnimem_budgets": ("omnimem_budgets", Paging("native"), "xla"),
    "infinipot_v": ("infinipot_v", Paging("native"), "xla"),
    "streammem": ("streammem", Paging("native"), "xla"),
}
BASELINE = "omnipick"  # OmniPick on the native layout: what the OmniPage modes are compared with
# Seed 000 §7.2.3 (CUDA, 32K checkpoint): useful cells, span with OmniPick only, span with OmniPick + OmniPage.
PAPER = {"qwen": {"useful": 2778, "native_span": 3840, "omnipage_span": 2816, "reduction": 0.267},
         "minicpm": {"useful": 2095, "native_span": 2560, "omnipage_span": 2304, "reduction": 0.100}}


def policy_for(kind: str, model: str, high: int = 2500, low: int = 1800):
    """The retention policy of a configuration for one model (at the seed's 2500/1800 watermarks by default)."""
    if kind == "streaming_llm":
        return StreamingLLM(sink_tokens=2, window=low - 2, high_watermark=high)
    if kind == "h2o":
        return H2O(heavy=low // 2, recent=low - low // 2, high_watermark=high)
    if kind == "streaming_vlm":  # text sinks and windows summing to the low watermark
        return StreamingVLM(sink=low // 16, text_window=low // 5, vision_window=low - low // 16 - low // 5)
    if kind == "omnimem_budgets":  # modality budgets summing to the low watermark (text kept)
        return OmniMemBudgets(visual_budget=2 * low // 3, audio_budget=low - 2 * low // 3)
    if kind == "infinipot_v":  # key/value-ranked compression to the low watermark, audio compressed as video is
        return InfiniPotV(budget=low, visual_kinds=(SpanKind.IMAGE, SpanKind.SLICE, SpanKind.VIDEO, SpanKind.AUDIO))
    if kind == "streammem":
        return StreamMem(budget=low)
    return OmniPick(high_watermark=high, low_watermark=low, source_image_whole=model == "minicpm")


def session(model: str, tokens: int, qwen_unit: str = "2s"):
    """`(decoder, stacked chunks up to the checkpoint)`: the fewest chunks whose streamed tokens reach `tokens`."""
    if model == "qwen":
        cfg = QWEN_WRITER
        unit = synthetic.qwen_unit_tokens(qwen_unit)
        build = lambda n: synthetic.qwen_av_session(n, vocab_size=cfg.vocab_size, unit_kind=qwen_unit)  # noqa: E731
    else:
        cfg, unit = MINICPM_WRITER, 79
        build = lambda n: synthetic.minicpm_duplex_session(n, vocab_size=cfg.vocab_size, slices_every=0)  # noqa: E731
    chunks = build(-(-tokens // unit) + 1)
    cum = np.cumsum(np.asarray(chunks.valid).sum(axis=(1, 2)))
    last = int(np.argmax(cum >= tokens))
    if cum[last] < tokens:
        raise ValueError(f"{model}: session too short for {tokens} tokens")
    return omnijax.Decoder(cfg), jax.tree.map(lambda x: x[: last + 1], chunks)


def measure(model: str, name: str, decoder, chunks, pages: int, watermarks=(2500, 1800)) -> dict:
    """Streams one configuration and returns its row (checkpoint = the last chunk of `chunks`)."""
    kind, paging, impl = CONFIGS[name]
    policy = policy_for(kind, model, *watermarks)
    start = time.perf_counter()
    result = omnijax.stream(decoder, chunks, policy=policy, paging=paging, impl=impl,
                            num_pages=pages, page_size=PAGE, subblock=SUBBLOCK)
    stats = jax.device_get(result.stats)
    seconds = time.perf_counter() - start
    lay, att = stats.layout, stats.attended
    if bool(np.any(lay.exhausted | att.exhausted)) or int(np.max(lay.dropped)) != 0:
        raise RuntimeError(f"{model}/{name}: the {pages}-page pool ran out")
    retained, span = lay.retained_cells[:, 0].astype(int), lay.physical_span[:, 0].astype(int)
    att_retained, att_span = att.retained_cells[:, 0].astype(int), att.physical_span[:, 0].astype(int)
    evicted, moved = stats.evicted[:, 0].astype(int), stats.moved[:, 0].astype(int)
    if not evicted.any():
        raise RuntimeError(f"{model}/{name}: never trimmed")
    first = int(np.argmax(evicted > 0))
    post = slice(first, None)
    return {"model": model, "config": name, "policy": repr(policy), "paging": paging.mode,
            "impl": impl, "chunks": int(len(span)), "tokens": int(np.asarray(chunks.valid).sum()),
            "first_trim_chunk": first, "trims": int((evicted > 0).sum()),
            "retained": int(retained[-1]), "span": int(span[-1]), "span_over_useful": float(span[-1] / retained[-1]),
            "active_pages": int(lay.active_pages[-1, 0]), "active_subblocks": int(lay.active_subblocks[-1, 0]),
            "peak_span": int(span.max()), "mean_span": float(span[post].mean()),
            "mean_retained": float(retained[post].mean()), "mean_active_pages": float(lay.active_pages[post, 0].mean()),
            "moved_total": int(moved.sum()), "peak_pool_pages": int(pages - np.min(lay.free_pages)),
            "span_series": span.tolist(), "retained_series": retained.tolist(),
            # The cache each chunk's prefill attended over: the history before the chunk's trim, the chunk written.
            "attended_retained": int(att_retained[-1]), "attended_span": int(att_span[-1]),
            "attended_active_pages": int(att.active_pages[-1, 0]), "attended_peak_span": int(att_span.max()),
            "mean_attended_span": float(att_span[post].mean()),
            "mean_attended_retained": float(att_retained[post].mean()),
            "attended_span_series": att_span.tolist(), "attended_retained_series": att_retained.tolist(),
            "trim_chunks": np.flatnonzero(evicted > 0).tolist(),
            "tokens_series": np.cumsum(np.asarray(chunks.valid).sum(axis=(1, 2))).tolist(), "seconds": seconds}


def add_reductions(rows):
    """Adds span reductions vs OmniPick on the native layout (same model), at the checkpoint and as a session mean."""
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["config"] == BASELINE), None)
        for key in ("span", "mean_span", "attended_span", "mean_attended_span"):
            r[f"{key}_reduction"] = None if base is None else 1 - r[key] / base[key]
        # Right after each trim of this configuration (when a paging mode acts), against the baseline's span then.
        at = r["trim_chunks"] if base is not None and r["policy"] == base["policy"] else []
        cut = [1 - r["span_series"][i] / base["span_series"][i] for i in at]
        r["trim_span_reduction_min"] = min(cut) if cut else None
        r["trim_span_reduction_mean"] = sum(cut) / len(cut) if cut else None


def pct(x):
    """A fraction as a signed percentage ("-" for None)."""
    return "-" if x is None else f"{100 * x + 0.0:+.1f}%"


def print_table(rows, models):
    """Prints one line per (model, configuration) and the paper's figures under each model."""
    print(f"\n{'model':>7} {'config':>23} {'useful':>6} {'span':>5} {'ratio':>5} {'pages':>5} {'peak':>5} "
          f"{'mean span':>9} {'mean kept':>9} {'moved':>7} {'-span@ckpt':>10} {'-mean span':>10} "
          f"{'-span@trims min/mean':>20} {'s':>5}")
    for m in models:
        for r in (r for r in rows if r["model"] == m):
            red = lambda x: "-" if x is None or r["config"] == BASELINE else pct(-x)  # noqa: E731
            moved = f"{r['moved_total']}" + ("*" if r["paging"] == "eager" else "")
            print(f"{m:>7} {r['config']:>23} {r['retained']:>6} {r['span']:>5} {r['span_over_useful']:>5.2f} "
                  f"{r['active_pages']:>5} {r['peak_span']:>5} {r['mean_span']:>9.0f} {r['mean_retained']:>9.0f} "
                  f"{moved:>7} {red(r['span_reduction']):>10} {red(r['mean_span_reduction']):>10} "
                  f"{red(r['trim_span_reduction_min']) + ' / ' + red(r['trim_span_reduction_mean']):>20} "
                  f"{r['seconds']:>5.0f}")
        p = PAPER[m]
        print(f"{m:>7} {'paper (CUDA)':>23} {p['useful']:>6} {p['native_span']:>5} -> {p['omnipage_span']} with "
              f"OmniPage ({pct(-p['reduction'])})")
    print("* eager compaction is the oracle: its copies are its cost, excluded in the paper; span changes are "
          "relative to OmniPick on the native layout (negative = shorter); @trims: right after each trim, when a "
          "paging mode acts")
    print("\nThe cache each chunk's prefill attends over (before the chunk's trim, the chunk written in):")
    print(f"{'model':>7} {'config':>23} {'useful':>6} {'span':>5} {'ratio':>5} {'pages':>5} {'peak':>5} "
          f"{'mean span':>9} {'mean kept':>9} {'-span@ckpt':>10} {'-mean span':>10}")
    for m in models:
        for r in (r for r in rows if r["model"] == m):
            red = lambda x: "-" if x is None or r["config"] == BASELINE else pct(-x)  # noqa: E731
            print(f"{m:>7} {r['config']:>23} {r['attended_retained']:>6} {r['attended_span']:>5} "
                  f"{r['attended_span'] / r['attended_retained']:>5.2f} {r['attended_active_pages']:>5} "
                  f"{r['attended_peak_span']:>5} {r['mean_attended_span']:>9.0f} {r['mean_attended_retained']:>9.0f} "
                  f"{red(r['attended_span_reduction']):>10} {red(r['mean_attended_span_reduction']):>10}")


def plot(rows, models, out, stem):
    """Top: stacked useful / waste bars and peak span per model; bottom: span over the session (first model)."""
    fig = harness.pyplot().figure(figsize=(max(6 * len(models), 12), 8))
    top = max(r["peak_span"] for r in rows) * 1.18
    for i, m in enumerate(models):
        ax = fig.add_subplot(2, len(models), i + 1)
        mine = [r for r in rows if r["model"] == m]
        x = np.arange(len(mine))
        useful = np.array([r["retained"] for r in mine])
        waste = np.array([r["span"] for r in mine]) - useful
        ax.bar(x, useful, color="tab:blue", label="useful cells")
        ax.bar(x, waste, bottom=useful, color="tab:orange", alpha=0.7, label="span waste")
        ax.plot(x, [r["attended_span"] for r in mine], "kx", label="span the checkpoint chunk attended over")
        for xi, r in zip(x, mine):
            ax.text(xi, max(r["span"], r["peak_span"]) + 60, f"{r['span_over_useful']:.2f}", ha="center", fontsize=8)
        twin = ax.twinx()
        twin.plot(x, [r["peak_span"] for r in mine], "k--o", label="peak span (cumulative)")
        for a in (ax, twin):
            a.set_ylim(0, top)
        ax.set_xticks(x, [r["config"].replace("omnipick+", "OP+") for r in mine], rotation=30, ha="right",
                      fontsize=8)
        ax.set_ylabel("KV slots at the checkpoint")
        twin.set_ylabel("peak physical span")
        ax.set_title(f"{m}: layout at {mine[0]['tokens']:,} tokens (labels: span / useful)")
        lines = ax.get_legend_handles_labels()
        extra = twin.get_legend_handles_labels()
        ax.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=7, loc="lower left")
    series = [r for r in rows if r["model"] == models[0] and r["config"].startswith("omnipick")]
    for col, (prefix, when) in enumerate((("", "after each chunk's trim"),
                                          ("attended_", "attended by each chunk (before its trim)"))):
        ax = fig.add_subplot(2, 2, 3 + col)
        for r, style in zip(series, ["-", "--", "-.", ":"]):
            ax.plot(r["tokens_series"], r[f"{prefix}span_series"], style, label=f"span, {r['config']}",
                    linewidth=1.4)
        if series:
            ax.plot(series[0]["tokens_series"], series[0][f"{prefix}retained_series"], color="gray", linewidth=0.8,
                    label="retained cells (every mode)")
        ax.set_xlabel("streamed tokens")
        ax.set_ylabel("KV slots")
        ax.set_title(f"{models[0]}: physical span {when}", fontsize=10)
        ax.legend(fontsize=7, ncol=2, loc="lower right")
    harness.save_png(fig, out, stem)


def main(argv=None):
    """Parses arguments, streams every (model, configuration), prints, writes JSON and PNG."""
    parser = harness.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32768, help="checkpoint, in cumulative streamed tokens")
    parser.add_argument("--models", nargs="+", default=["qwen", "minicpm"], choices=["qwen", "minicpm"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--pages", type=int, default=128, help="pool pages (and page-table width)")
    parser.add_argument("--min-pages", type=int, default=1, help="ordered_suffix: least span reduction, in pages")
    parser.add_argument("--qwen-unit", default="2s", choices=sorted(synthetic.QWEN_UNITS),
                        help="Qwen2.5-Omni unit kind (omnijax.testing.synthetic.QWEN_UNITS); "
                             "'paper': 909-token 1 s units")
    parser.add_argument("--watermarks", type=int, nargs=2, default=[2500, 1800], metavar=("HIGH", "LOW"),
                        help="the policies' high and low watermarks")
    args = harness.parse(parser, argv, smoke=dict(tokens=600, models=["qwen"], configs=["omnipick",
                                                                                        "omnipick+tile_skip"],
                                                  pages=16, watermarks=[300, 200]))
    CONFIGS["omnipick+ordered_suffix"] = ("omnipick", Paging("ordered_suffix", min_pages=args.min_pages), "xla")
    out = harness.output_dir(args)
    start = time.perf_counter()
    rows = []
    for m in args.models:
        decoder, chunks = session(m, args.tokens, args.qwen_unit)
        for name in args.configs:
            rows.append(measure(m, name, decoder, chunks, args.pages, args.watermarks))
            r = rows[-1]
            print(f"  {m}/{name}: {r['chunks']} chunks, {r['tokens']} tokens, useful {r['retained']}, span "
                  f"{r['span']}, {r['seconds']:.0f} s", flush=True)
    add_reductions(rows)
    print_table(rows, args.models)
    runtime = time.perf_counter() - start
    print(f"total runtime {runtime:.0f} s")
    summary = {"tokens": args.tokens, "qwen_unit": args.qwen_unit, "min_pages": args.min_pages, "page_size": PAGE,
               "subblock": SUBBLOCK, "pool_pages": args.pages, "watermarks": args.watermarks,
               "writers": {"qwen": QWEN_WRITER.to_json(), "minicpm": MINICPM_WRITER.to_json()}, "paper": PAPER,
               "runtime_s": runtime, "rows": rows}
    stem = "kv_layout" if args.qwen_unit == "2s" else f"kv_layout_{args.qwen_unit}"
    harness.write_json(out, stem, summary)
    plot(rows, args.models, out, stem)


if __name__ == "__main__":
    main()
