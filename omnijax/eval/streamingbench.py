"""StreamingBench on omnijax: every video a streaming session, every question asked at its timestamp, many
retention / paging configurations evaluated as jitted (optionally sharded, multi-host) batches.

Scoring of a multiple-choice question, from the chunk that ends the question (`sessions.build_session`):
- `loglik`: the option whose letter has the highest log-probability at the prompt's last position (the prompt
  ends with `<|im_start|>assistant\\n` after "Answer with the option's letter ..."); an option is its letter, one
  token, so this is the sum of the option's token log-probabilities given the prompt;
- `generated`: the first option letter in the greedy answer (needs `max_answer_tokens` >= 1; none = wrong).
Accuracy is reported per task type and overall, per configuration, with session time and KV statistics.

    python -m omnijax.eval.streamingbench --demo --max-videos 2 --max-units 12 --configs full omnipick
    python -m omnijax.eval.streamingbench --checkpoint /ckpt/omni7b-jax --video-root /data/StreamingBench \\
        --mesh 8x1 --configs full "omnipick+tile_skip" --out sb.json

A `--demo` run uses the tiny random checkpoint of `omnijax.testing.checkpoints` (random weights: accuracy is
meaningless there). The annotation files ship with omnijax (`annotations.packaged_root()`); `--data` or
`$OMNIJAX_STREAMINGBENCH` reads another copy.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from omnijax import compilation_cache
from omnijax.convert import convert_checkpoint
from omnijax.eval import annotations as ann
from omnijax.eval import media as media_lib
from omnijax.eval import mesh as distributed
from omnijax.eval import sessions as sessions_lib
from omnijax.eval.runner import ConfigResult, EvalConfig, evaluate
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel
from omnijax.models.registry import load
from omnijax.retention.recall import Recall, parse_recall  # noqa: F401  (parse_recall: this module's name kept)
from omnijax.streaming.config import StreamConfig
from omnijax.testing import checkpoints as demo


def parse_config(spec: str, *, answer_tokens: int = 1, page_size: int = 64, recall: Recall | None = None
                 ) -> EvalConfig:
    """`policy[:key=value,...][+paging]` -> `EvalConfig` named `spec` (`omnijax.StreamConfig.parse`; the policy
    resolves through `omnijax.retention.get_policy`, where `full` is NoSlide). With `recall`, the config recalls
    evicted units at each question (`StreamConfig(recall=...)`; `evaluate` runs its sessions one at a time) and is
    named `"{spec} recall"`.

    Example: `omnipick:high_watermark=600,low_watermark=400+tile_skip`.
    """
    try:
        config = StreamConfig.parse(spec, max_answer_tokens=answer_tokens, page_size=page_size, recall=recall)
    except KeyError as e:  # an unknown policy name: the command line reports ValueErrors
        raise ValueError(e.args[0]) from None
    return EvalConfig(spec if recall is None else f"{spec} recall", config)


def configs_from_args(args: argparse.Namespace, answer_tokens: int) -> list[EvalConfig]:
    """The configurations `add_run_options`' `--configs`, `--page-size` and `--recall` ask for."""
    recall = parse_recall(args.recall) if args.recall else None
    return [parse_config(c, answer_tokens=answer_tokens, page_size=args.page_size, recall=recall)
            for c in args.configs]


def select_videos(videos: Sequence[ann.Video], *, max_videos: int | None = None, max_units: int | None = None,
                  unit_seconds: float = 2.0) -> list[ann.Video]:
    """Videos with at least one multiple-choice question inside the first `max_units` units, at most
    `max_videos` per annotation file (for smoke runs; None keeps everything)."""
    out, per_file = [], collections.Counter()
    for v in videos:
        mc = [q for q in v.questions if q.multiple_choice]
        if max_units is not None:
            mc = [q for q in mc if ann.unit_of(q.time_s, unit_seconds) < max_units]
        if mc and (max_videos is None or per_file[v.source] < max_videos):
            out.append(v)
            per_file[v.source] += 1
    return out


@dataclasses.dataclass
class BenchReport:
    """Everything a run produced: per-question records, per-config summaries, what was left out and why."""

    records: list[dict]
    summary: dict[str, dict]
    left_out: list[dict]
    notices: list[str]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def run(model: OmniModel | Decoder, videos: Sequence[ann.Video], configs: Sequence[EvalConfig], *,
        encoder: media_lib.TextEncoder | None = None, video_root: str | Path | None = None,
        mesh: Mesh | None = None, answer_tokens: int = 1, max_units: int | None = None, past_end: str = "clamp",
        batch_size: int | None = None, unit_seconds: float = 2.0, progress: bool = True,
        notices: list[str] | None = None) -> BenchReport:
    """Builds one session per video, evaluates them under every configuration and scores every question.

    Args:
        model: an `omnijax.Model` (with encoders for real features) or a `Decoder`.
        videos: from `annotations.load_all` (see `select_videos`).
        configs: the configurations.
        encoder: a `TextEncoder` (default: `ByteTextEncoder` over the model's vocabulary).
        video_root: directory holding the videos (`video_path` is relative to it); None: synthetic media.
        mesh: optional `(data, model)` mesh for `omnijax.evaluate`.
        answer_tokens: greedy tokens requested after each question.
        max_units, past_end: see `sessions.build_session`.
        batch_size: sessions per program call.
        unit_seconds: seconds per audiovisual unit.
        progress: tqdm bars over videos and session batches.
        notices: a list collecting notices (fallbacks and data issues); one is made if None.
    """
    notices = [] if notices is None else notices
    config = getattr(model, "decoder", model).config
    encoder = encoder or media_lib.text_encoder(None, config.vocab_size, notices)
    builder = sessions_lib.ChunkBuilder(model, encoder, unit_seconds=unit_seconds)
    if builder.notice:
        notices.append(builder.notice)
    iterator = videos
    if progress:
        iterator = tqdm(videos, desc="sessions", unit="video")
    sessions, fallbacks = [], []
    for video in iterator:
        source = media_lib.open_media(video_root, video.video_path, unit_seconds=unit_seconds)
        if source.kind == "synthetic":
            fallbacks.append(source.notice)
        sessions.append(sessions_lib.build_session(video, source, builder, answer_tokens=answer_tokens,
                                                   max_units=max_units, past_end=past_end))
    if fallbacks:
        notices.append(f"media: {len(fallbacks)} of {len(sessions)} videos use synthetic frames and tones "
                       f"(first: {fallbacks[0]})")
    notices.extend(issue for v in videos for issue in v.issues)
    if not sessions or not any(s.asked for s in sessions):
        raise ValueError("no multiple-choice question to ask (check the videos and max_units)")
    options = max(len(a.question.options) for s in sessions for a in s.asked)
    results = evaluate(model, [s.chunks for s in sessions], configs, mesh=mesh, batch_size=batch_size,
                       score_ids=sessions_lib.letter_ids(encoder, options), progress=progress)
    records = score(sessions, results, encoder)
    left_out = [{"file": s.video.source, "video": s.video.video_path, "index": q.index, "task_type": q.task_type,
                 "reason": reason} for s in sessions for q, reason in s.left_out]
    return BenchReport(records, summarize(records, results, sessions), left_out, notices)


def score(sessions: Sequence[sessions_lib.BenchSession], results: dict[str, ConfigResult],
          encoder: media_lib.TextEncoder) -> list[dict]:
    """One record per (configuration, asked question): predictions of both scorers and their correctness."""
    records = []
    for name, result in results.items():
        for session, sres in zip(sessions, result.sessions):
            for asked in session.asked:
                q = asked.question
                n = len(q.options)
                loglik = sres.scores[asked.chunk, :n]
                tokens = [int(t) for t in sres.tokens[asked.chunk] if t >= 0] if sres.tokens.size else []
                text = encoder.decode(tokens) if tokens else ""
                pred_ll = ann.LETTERS[int(np.argmax(loglik))]
                pred_gen = sessions_lib.first_letter(text, n)
                records.append({
                    "config": name, "file": session.video.source, "video": session.video.video_path,
                    "index": q.index, "task_type": q.task_type, "time_s": q.time_s, "unit": asked.unit,
                    "status": asked.status, "answer": q.answer, "loglik": [float(x) for x in loglik],
                    "pred_loglik": pred_ll, "generated": text, "pred_generated": pred_gen,
                    "correct_loglik": pred_ll == q.answer, "correct_generated": pred_gen == q.answer,
                    "retained_cells": int(sres.stats["retained_cells"][asked.chunk])})
    return records


def summarize(records: list[dict], results: dict[str, ConfigResult],
              sessions: Sequence[sessions_lib.BenchSession]) -> dict[str, dict]:
    """Per configuration: accuracy per task type and overall (both scorers), session time, KV statistics."""
    out = {}
    for name, result in results.items():
        rows = [r for r in records if r["config"] == name]
        groups = collections.defaultdict(list)
        for r in rows:
            groups[r["task_type"]].append(r)
        groups["overall"] = rows

        def acc(rs, key):
            return float(np.mean([r[key] for r in rs])) if rs else float("nan")

        stats = {k: np.concatenate([s.stats[k] for s in result.sessions]) for k in result.sessions[0].stats}
        out[name] = dict(recall_figures(result))
        out[name] |= {
            "accuracy": {task: {"n": len(rs), "loglik": acc(rs, "correct_loglik"),
                                "generated": acc(rs, "correct_generated")} for task, rs in sorted(groups.items())},
            "sessions": len(result.sessions), "chunks": int(sum(s.num_chunks for s in result.sessions)),
            "wall_s": result.wall_s, "compile_s": result.compile_s,
            "session_s": result.wall_s / max(1, len(result.sessions)), "chunks_per_s": result.chunks_per_s,
            "mesh": result.mesh_shape, "num_pages": result.num_pages, "batch_size": result.batch_size,
            "kv": {"mean_retained_cells": float(stats["retained_cells"].mean()),
                   "max_retained_cells": int(stats["retained_cells"].max()),
                   "max_physical_span": int(stats["physical_span"].max()),
                   "mean_active_pages": float(stats["active_pages"].mean()),
                   "evicted": int(stats["evicted"].sum()), "moved": int(stats["moved"].sum()),
                   "exhausted_sessions": int(sum(bool(s.stats["exhausted"].any()) for s in result.sessions)),
                   "mean_retained_at_question": float(np.mean([r["retained_cells"] for r in rows])) if rows
                   else float("nan")}}
    return out


def recall_figures(result: ConfigResult) -> dict[str, Any]:
    """`{"recall": figures summed over the sessions}` for a config with `StreamConfig(recall=...)`, else `{}`."""
    figures = [s.recall for s in result.sessions if s.recall is not None]
    if not figures:
        return {}
    names = ("questions", "recalled_units", "recalled_cells", "recalled_bytes", "captured_units", "dropped_units",
             "dropped_bytes", "lost_cells")
    total = {n: int(sum(getattr(f, n) for f in figures)) for n in names}
    return {"recall": total | {"max_stored_bytes": int(max(f.stored_bytes for f in figures))}}


def time_and_kv_lines(name: str, s: dict) -> list[str]:
    """A configuration's time and KV lines of a report (`summarize`'s figures)."""
    kv = s["kv"]
    recall = s.get("recall")
    extra = [] if recall is None else [
        f"   recall: {recall['questions']} questions, {recall['recalled_units']} units / {recall['recalled_cells']} "
        f"cells recalled, host tier max {recall['max_stored_bytes'] / 1e6:.1f} MB, dropped "
        f"{recall['dropped_units']} units, lost {recall['lost_cells']} cells"]
    return extra + [f"== {name}: {s['sessions']} sessions, {s['chunks']} chunks, {s['wall_s']:.2f} s "
            f"({s['session_s']:.3f} s/session, {s['chunks_per_s']:.1f} chunks/s, compile "
            f"{s['compile_s']:.1f} s), mesh {s['mesh']}",
            f"   KV: retained mean {kv['mean_retained_cells']:.0f} / max {kv['max_retained_cells']}, span max "
            f"{kv['max_physical_span']}, active pages mean {kv['mean_active_pages']:.1f}, evicted "
            f"{kv['evicted']}, moved {kv['moved']}, exhausted sessions {kv['exhausted_sessions']}"]


def format_summary(report: BenchReport) -> str:
    """A plain-text table: accuracy per task type and configuration, then time and KV figures."""
    lines = []
    for name, s in report.summary.items():
        lines += time_and_kv_lines(name, s)
        lines.append(f"   {'task type':<36} {'n':>5} {'loglik':>7} {'generated':>9}")
        for task, a in s["accuracy"].items():
            lines.append(f"   {task:<36} {a['n']:>5} {a['loglik']:>7.3f} {a['generated']:>9.3f}")
    return "\n".join(lines)


def demo_model(directory: Path) -> OmniModel:
    """The tiny random Qwen2.5-Omni of `omnijax.testing.checkpoints` (encoders included), converted under
    `directory`."""

    hf = demo.write_tiny_hf_checkpoint(directory / "hf", text_config=demo.TINY_OMNI_TEXT_CONFIG)
    return load(convert_checkpoint(hf, directory / "omnijax", progress=False, log=lambda _: None))


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every harness's command line shares: videos, configurations, page size, the cut, the mesh, the
    batch, the output, the cluster flags."""
    parser.add_argument("--video-root", help="directory the records' video paths are relative to")
    parser.add_argument("--configs", nargs="+", default=["full", "omnipick"], help="policy[:k=v,...][+paging]")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--recall", help="recall evicted units at each question, every config: key=value,... of "
                                         "omnijax.retention.recall.Recall, e.g. budget=2048,scoring=two_stage")
    parser.add_argument("--max-units", type=int, help="cut each session after this many 2 s units")
    parser.add_argument("--past-end", default="clamp", choices=["clamp", "skip", "error"])
    parser.add_argument("--mesh", help="DATAxMODEL, e.g. 8x1 or 4x2 (default: one device)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--out", help="write the report (records, summary, notices) as JSON here")
    distributed.add_cluster_flags(parser)


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", help="converted omnijax checkpoint directory (tokenizer files used if there)")
    what.add_argument("--demo", action="store_true", help="the tiny random demo model (accuracy meaningless)")
    parser.add_argument("--data", help="directory of the annotation *.json files (default: $OMNIJAX_STREAMINGBENCH "
                                       "if set, else the copy shipped with omnijax)")
    parser.add_argument("--files", nargs="*", help="annotation files to use (default: all)")
    parser.add_argument("--answer-tokens", type=int, default=1)
    parser.add_argument("--max-videos", type=int, help="videos per annotation file (smoke runs)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    distributed.initialize(distributed.cluster_from_args(args))  # before any other JAX work

    notices: list[str] = []
    try:  # what a user can get wrong, the cheap checks first: configurations, annotations, mesh, checkpoint
        configs = configs_from_args(args, args.answer_tokens)
        videos = select_videos(ann.load_all(args.data, args.files), max_videos=args.max_videos,
                               max_units=args.max_units)
        mesh = None
        if args.mesh:
            data, _, width = args.mesh.partition("x")
            if not (data.isdigit() and (width or "1").isdigit()):
                raise ValueError(f"--mesh must be DATAxMODEL (e.g. 8x1 or 4x2), got {args.mesh!r}")
            mesh = distributed.make_mesh(int(data), int(width or 1))
        if args.demo:
            model = demo_model(Path(tempfile.mkdtemp(prefix="sb_demo_")))
            notices.append("model: tiny random demo checkpoint: accuracy is meaningless (chance level expected)")
        else:
            model = load(args.checkpoint)
    except ValueError as e:  # CheckpointFormatError, AnnotationError and bad settings are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    encoder = media_lib.text_encoder(args.checkpoint, model.config.vocab_size, notices)
    report = run(model, videos, configs, encoder=encoder, video_root=args.video_root, mesh=mesh,
                 answer_tokens=args.answer_tokens, max_units=args.max_units, past_end=args.past_end,
                 batch_size=args.batch_size, progress=distributed.is_main_process(), notices=notices)
    if distributed.is_main_process():
        for notice in dict.fromkeys(report.notices):
            print("notice:", notice, file=sys.stderr)
        print(format_summary(report))
        if args.out:
            Path(args.out).write_text(json.dumps(report.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
