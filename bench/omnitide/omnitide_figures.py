"""OmniTide's StreamingBench experiments as one script a cluster user runs unchanged: Fig. 13 (the quality-efficiency
frontier: accuracy against mean stream-loop session time per retention policy) and Fig. 14 (OmniPick's watermark
sweep against no-slide).

Both drive `omnijax.eval.streamingbench.run` (sessions built from the annotations, `omnijax.evaluate` over a
device mesh, questions scored by the generated letter and by log-likelihood) over configurations, then plot:

- Fig. 13 — no-slide (`full`), the paper's baselines (`unit_fifo` = basic, `token_sliding` = token-basic,
  `streaming_llm`, `h2o` on the reference attention, which alone computes the attention mass it ranks by),
  OmniPick (native layout) and OmniTide (OmniPick + OmniPage `tile_skip`) at the default
  watermarks 2500/1800. Session time is `evaluate`'s wall time per session (input processing, prefill, answers and
  KV maintenance inside the compiled stream; compilation excluded).
- Fig. 14 — OmniPick at `--watermarks` (high/low pairs; default the paper's 2500/1800 ... 20000/15000) beside
  no-slide.

    python -m bench.omnitide.omnitide_figures --checkpoint CKPT --video-root VIDEOS --mesh 8x1 --out fig/  # both
    python -m bench.omnitide.omnitide_figures --checkpoint CKPT --figure 14 --watermarks 5000/3500 8000/6000
    python -m bench.omnitide.omnitide_figures --checkpoint CKPT --figure 13 --fig13-configs no-slide OmniPick
    python -m bench.omnitide.omnitide_figures --smoke                                          # the demo model

Writes `omnitide_figures.json` (each configuration's summary: accuracy per task type, session time, KV figures),
`omnitide_fig13.png` / `omnitide_fig14.png`, and prints a table. With the demo model accuracy is chance level: the
smoke run (3 units of one video; Fig. 13's no-slide and H2O, Fig. 14's 64/48 pair) checks the pipeline, not the
numbers.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench import harness

FIG13 = {"no-slide": "full", "basic": "unit_fifo", "token-basic": "token_sliding", "StreamingLLM": "streaming_llm",
         "H2O": "h2o", "OmniPick": "omnipick", "OmniTide": "omnipick+tile_skip"}
WATERMARKS = ("2500/1800", "5000/3500", "8000/6000", "9000/7000", "20000/15000")


def configurations(figure: str, watermarks, fig13=None) -> dict[str, str]:
    """Label -> `streamingbench.parse_config` spec of the configurations a figure needs (`fig13`: the labels of
    Fig. 13's configurations to run, default all of `FIG13`)."""
    if fig13 is not None and figure == "14":
        raise ValueError("--fig13-configs picks Fig. 13's configurations, and --figure 14 runs none of them")
    if fig13 is not None:
        unknown = [label for label in fig13 if label not in FIG13]
        if unknown or not fig13:
            raise ValueError(f"--fig13-configs takes labels of {', '.join(FIG13)}; got {', '.join(unknown) or 'none'}")
    out = {label: spec for label, spec in FIG13.items() if fig13 is None or label in fig13} \
        if figure in ("13", "both") else {}
    if figure in ("14", "both"):
        out.setdefault("no-slide", "full")
        for pair in watermarks:
            high, _, low = pair.partition("/")
            if not (high.isdigit() and low.isdigit() and int(low) < int(high)):
                raise ValueError(f"a watermark pair is HIGH/LOW with LOW < HIGH, got {pair!r}")
            out[f"OmniPick {pair}"] = f"omnipick:high_watermark={high},low_watermark={low}"
    return out


def _accuracy(summary: dict, scorer: str) -> float:
    return 100.0 * summary["accuracy"]["overall"][scorer]


def plot(rows: list[dict], figure: str, out: Path, scorer: str) -> list[Path]:
    plt = harness.pyplot()
    paths = []
    if figure in ("13", "both"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in (r for r in rows if r["label"] in FIG13):
            ax.scatter(r["session_s"], r["accuracy"], s=40)
            ax.annotate(r["label"], (r["session_s"], r["accuracy"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        base = next((r for r in rows if r["label"] == "no-slide"), None)
        if base is not None:
            ax.axhline(base["accuracy"], ls="--", lw=0.8, color="grey", label="no-slide accuracy")
            ax.legend(fontsize=8)
        ax.set_xlabel("mean stream-loop time per session (s)")
        ax.set_ylabel(f"StreamingBench accuracy (%, {scorer})")
        ax.set_title("Fig. 13: quality-efficiency frontier")
        paths.append(harness.save_png(fig, out, "omnitide_fig13"))
    if figure in ("14", "both"):
        sweep = [r for r in rows if r["label"].startswith("OmniPick ")]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["label"].split()[1] for r in sweep], [r["accuracy"] for r in sweep], marker="o", label="OmniPick")
        base = next((r for r in rows if r["label"] == "no-slide"), None)
        if base is not None:
            ax.axhline(base["accuracy"], ls="--", lw=0.8, color="grey", label="no-slide")
        ax.set_xlabel("high / low watermark (cells)")
        ax.set_ylabel(f"StreamingBench accuracy (%, {scorer})")
        ax.set_title("Fig. 14: watermark sensitivity")
        ax.legend(fontsize=8)
        paths.append(harness.save_png(fig, out, "omnitide_fig14"))
    return paths


def main(argv=None) -> int:
    p = harness.parser(__doc__, out="bench/out/omnitide_figures")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--checkpoint", help="converted omnijax checkpoint (Qwen2.5-Omni 3B/7B, MiniCPM-o 4.5, ...)")
    what.add_argument("--demo", action="store_true", help="the tiny random demo model (accuracy meaningless)")
    p.add_argument("--figure", choices=["13", "14", "both"], default="both")
    p.add_argument("--watermarks", nargs="+", default=list(WATERMARKS), help="Fig. 14's HIGH/LOW pairs")
    p.add_argument("--fig13-configs", nargs="+", metavar="LABEL",
                   help=f"Fig. 13's configurations to run (default all: {', '.join(FIG13)})")
    p.add_argument("--data", help="StreamingBench annotation directory (default: the packaged files)")
    p.add_argument("--files", nargs="*", help="annotation files to use (default: all)")
    p.add_argument("--video-root", help="directory the records' video_path is relative to (else synthetic media)")
    p.add_argument("--max-videos", type=int, help="videos per annotation file")
    p.add_argument("--max-units", type=int, help="cut each session after this many 2 s units")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=1)
    p.add_argument("--mesh", help="DATAxMODEL, e.g. 8x1 (default: one device)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--scorer", choices=["generated", "loglik"], default="generated")
    # --smoke: Fig. 13's no-slide and H2O (the one configuration on the reference attention) and one watermark pair
    # that trims, so both figures, both attention paths and a trim run; the other policies run in their own tests
    args = harness.parse(p, argv, smoke=dict(demo=True, max_videos=1, max_units=3, page_size=16, figure="both",
                                             watermarks=["64/48"], files=["questions_real.json"],
                                             fig13_configs=["no-slide", "H2O"]))
    import omnijax
    from omnijax import EvalConfig, StreamConfig
    from omnijax.eval import annotations as ann
    from omnijax.eval import media as media_lib
    from omnijax.eval import mesh as distributed
    from omnijax.eval import streamingbench as sb

    if not (args.checkpoint or args.demo):
        p.error("give --checkpoint CKPT or --demo")
    try:
        labels = configurations(args.figure, args.watermarks, args.fig13_configs)
        # H2O ranks tokens by the attention mass they receive, which only the reference attention computes
        configs = [EvalConfig(spec, StreamConfig.parse(spec, max_answer_tokens=args.answer_tokens,
                                                       page_size=args.page_size,
                                                       **({"impl": "reference"} if spec == "h2o" else {})))
                   for spec in labels.values()]
        videos = sb.select_videos(ann.load_all(args.data, args.files), max_videos=args.max_videos,
                                  max_units=args.max_units)
        mesh = None
        if args.mesh:
            data, _, width = args.mesh.partition("x")
            if not (data.isdigit() and (width or "1").isdigit()):
                raise ValueError(f"--mesh must be DATAxMODEL (e.g. 8x1), got {args.mesh!r}")
            mesh = distributed.make_mesh(int(data), int(width or 1))
        model = (sb.demo_model(Path(tempfile.mkdtemp(prefix="omnitide_fig_"))) if args.demo
                 else omnijax.load(args.checkpoint))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    notices: list[str] = []
    encoder = media_lib.text_encoder(args.checkpoint, model.config.vocab_size, notices)
    print(f"{len(videos)} videos x {len(configs)} configurations: {', '.join(labels)}", flush=True)
    report = sb.run(model, videos, configs, encoder=encoder, video_root=args.video_root, mesh=mesh,
                    answer_tokens=args.answer_tokens, max_units=args.max_units, batch_size=args.batch_size,
                    progress=distributed.is_main_process(), notices=notices)
    if not distributed.is_main_process():
        return 0
    rows = []
    for label, spec in labels.items():
        summary = report.summary[spec]
        rows.append({"label": label, "config": spec, "accuracy": _accuracy(summary, args.scorer),
                     "session_s": summary["session_s"], "questions": summary["accuracy"]["overall"]["n"],
                     "mean_retained_cells": summary["kv"]["mean_retained_cells"],
                     "max_physical_span": summary["kv"]["max_physical_span"], "summary": summary})
    harness.print_table(rows, [("configuration", "label", ""), ("accuracy %", "accuracy", ".1f"),
                               ("session s", "session_s", ".3f"), ("questions", "questions", "d"),
                               ("mean cells", "mean_retained_cells", ".0f"), ("max span", "max_physical_span", "d")])
    for notice in dict.fromkeys(report.notices):
        print("notice:", notice, file=sys.stderr)
    out = harness.output_dir(args)
    harness.write_json(out, "omnitide_figures", {"figure": args.figure, "scorer": args.scorer, "rows": rows,
                                                 "notices": report.notices})
    plot(rows, args.figure, out, args.scorer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
