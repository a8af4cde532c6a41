"""Timed prompts in streamed sessions: the pieces the OVO-Bench and OmniMMI harnesses share beside StreamingBench.

StreamingBench's `sessions.build_session` asks multiple-choice `annotations.Question`s; the newer benchmarks also
ask yes/no probes, counts, open-ended questions, multi-turn remarks and repeated polls. A `Probe` is any user turn
asked at a time (its full text, optional earlier chat turns, and how many option letters score it), and
`build_probe_session` lays probes out exactly as `build_session` lays out questions: system prompt, then the 2 s
audiovisual units, each probe asked after the unit containing its time (`annotations.place_questions`), its greedy
answer kept in the context, long prompts split by `sessions.split_text_chunk`. A multiple-choice probe's text is
`sessions.prompt_text` of the question, so its chunk is the one `build_session` would build.

Execution and reporting reuse StreamingBench's: `omnijax.evaluate` over the sessions (optionally on a mesh),
`streamingbench.summarize` for time and KV figures, `streamingbench.parse_config` and `demo_model` on the command
line (`add_common_args` / `prepare` mirror `streamingbench.main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
from jax.sharding import Mesh

from omnijax.chunks.chunk import Chunk
from omnijax.eval import annotations as ann
from omnijax.eval import media as media_lib
from omnijax.eval import mesh as distributed
from omnijax.eval import sessions as sessions_lib
from omnijax.eval import streamingbench
from omnijax.eval import streamingbench as sb
from omnijax.eval.runner import EvalConfig, evaluate
from omnijax.eval.streamingbench import time_and_kv_lines
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel
from omnijax.models.registry import load


@dataclasses.dataclass(frozen=True)
class Probe:
    """One user turn asked at a time of a session.

    Attributes:
        key: identifies the probe in the records (unique within a run).
        task: the benchmark's task name.
        time_s: when it is asked, seconds from the video start (after the unit containing it).
        text: the user turn's full text.
        index: order among probes asked at the same time.
        history: earlier (user, assistant) turns given before this one, in the same chunk.
        options: number of option letters scored by log-likelihood (0: none).
        answer_tokens: greedy tokens after this probe (None: the session's `answer_tokens`).
    """

    key: str
    task: str
    time_s: float
    text: str
    index: int = 0
    history: tuple[tuple[str, str], ...] = ()
    options: int = 0
    answer_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class AskedProbe:
    """A probe in a session: its answer follows chunk `chunk`, asked after video unit `unit`."""

    probe: Probe
    chunk: int
    unit: int
    status: str  # "ok" or "past_end" (clamped to the last unit)


@dataclasses.dataclass
class ProbeSession:
    """One session: its chunks, the probes asked in it, and those left out (with the reason)."""

    name: str
    video_path: str
    chunks: list[Chunk]
    asked: list[AskedProbe]
    left_out: list[tuple[Probe, str]]
    units: int
    media: str


class PromptBuilder(sessions_lib.ChunkBuilder):
    """`sessions.ChunkBuilder` that also builds free-text user turns (with optional earlier chat turns)."""

    def prompt(self, text: str, unit: int, answer_tokens: int,
               history: Sequence[tuple[str, str]] = ()) -> Chunk:
        """`[<|im_start|>user\\n{u}<|im_end|>\\n<|im_start|>assistant\\n{a}<|im_end|>\\n]* <|im_start|>user\\n{text}
        <|im_end|>\\n<|im_start|>assistant\\n`, then `answer_tokens` greedy tokens."""
        e, (start, end) = self.encoder, self._chat_markers()
        ids: list[int] = []
        for user, assistant in history:
            ids += [start, *e.encode("user\n" + user), end, *e.encode("\n"), start,
                    *e.encode("assistant\n" + assistant), end, *e.encode("\n")]
        ids += [start, *e.encode("user\n" + text), end, *e.encode("\n"), start, *e.encode("assistant\n")]
        return self._text(ids, unit, "text", answer_tokens)

    @property
    def end_id(self) -> int:
        """`<|im_end|>` as the model generates it (folded into a small vocabulary)."""
        return self._chat_markers()[1]


def build_probe_session(name: str, video_path: str, probes: Sequence[Probe], media: media_lib.MediaSource,
                        builder: PromptBuilder, *, answer_tokens: int = 1, max_units: int | None = None,
                        past_end: str = "clamp", text_chunk_len: int | None = None,
                        nominal_s: float | None = None) -> ProbeSession:
    """One session asking `probes` over `media` (the layout of `sessions.build_session`).

    Args:
        name: the session's name in the records.
        video_path: the video, relative to the video root.
        probes: what is asked (any order: asked by time, then `index`).
        media: frames and audio (decoded or synthetic).
        builder: the model's `PromptBuilder`.
        answer_tokens: greedy tokens requested after each probe.
        max_units: cut the timeline after this many units; probes after the cut are left out.
        past_end: handling of probes after a known video end (`annotations.place_questions`).
        text_chunk_len: longest prompt chunk (default: the audiovisual unit's length).
        nominal_s: the timeline's length when the media has no duration of its own (synthetic media); the
            timeline always reaches the unit of the last probe.
    """
    unit_s = builder.unit_seconds
    ordered = sorted(probes, key=lambda p: (p.time_s, p.index))
    if media.duration_s is not None:
        units = ann.num_units(media.duration_s, unit_s)
        placements = ann.place_questions(ordered, units, duration_s=media.duration_s, unit_seconds=unit_s,
                                         past_end=past_end)
    else:
        units = 1 + max((ann.unit_of(p.time_s, unit_s) for p in ordered), default=0)
        if nominal_s is not None:
            units = max(units, ann.num_units(nominal_s, unit_s))
        placements = ann.place_questions(ordered, units, unit_seconds=unit_s, past_end=past_end)
    units = units if max_units is None else min(units, max_units)

    def ask(p, unit_id):
        tokens = answer_tokens if p.question.answer_tokens is None else p.question.answer_tokens
        return builder.prompt(p.question.text, unit_id, tokens, p.question.history)

    out, asked_at, left_out = sessions_lib.lay_out(placements, units, media, builder, ask,
                                                   text_chunk_len=text_chunk_len)
    asked = [AskedProbe(p.question, at, p.unit, p.status) for at, p in asked_at]
    return ProbeSession(name, video_path, out, asked, left_out, units, media.kind)


def execute(model: OmniModel | Decoder, sessions: Sequence[ProbeSession], configs: Sequence[EvalConfig],
            builder: PromptBuilder, *, score_ids: Sequence[int], mesh: Mesh | None = None,
            batch_size: int | None = None, progress: bool = True) -> tuple[dict, list[dict]]:
    """`omnijax.evaluate` over the sessions' chunks under every configuration, then `answers` of every probe.

    Raises:
        ValueError: no session asks anything (all probes left out, e.g. by `max_units`).
    """
    if not any(s.asked for s in sessions):
        raise ValueError("nothing to ask (check the sessions and max_units)")
    results = evaluate(model, [s.chunks for s in sessions], configs, mesh=mesh, batch_size=batch_size,
                       score_ids=list(score_ids), progress=progress)
    return results, answers(sessions, results, builder.encoder, builder.end_id)


def first_token_id(encoder: media_lib.TextEncoder, word: str) -> int:
    """The first token of `word` (what a yes/no answer is scored by)."""
    return encoder.encode(word)[0]


def answer_text(tokens: Sequence[int], encoder: media_lib.TextEncoder, end_id: int) -> tuple[str, bool]:
    """Generated ids -> (text up to `<|im_end|>`, silent): silent when nothing came before `<|im_end|>`."""
    ids = [int(t) for t in tokens if int(t) >= 0]
    if end_id in ids:
        ids = ids[:ids.index(end_id)]
    return (encoder.decode(ids) if ids else ""), not ids


def answers(sessions: Sequence[ProbeSession], results: dict, encoder: media_lib.TextEncoder,
            end_id: int) -> list[dict]:
    """One row per (configuration, asked probe): generated text, silence, score columns, retained cells."""
    rows = []
    for name, result in results.items():
        for session, sres in zip(sessions, result.sessions):
            for asked in session.asked:
                text, silent = answer_text(sres.tokens[asked.chunk] if sres.tokens.size else [], encoder, end_id)
                scores = [] if sres.scores is None else [float(x) for x in sres.scores[asked.chunk]]
                rows.append({"config": name, "session": session.name, "video": session.video_path,
                             "key": asked.probe.key, "task": asked.probe.task, "time_s": asked.probe.time_s,
                             "unit": asked.unit, "status": asked.status, "generated": text, "silent": silent,
                             "scores": scores, "retained_cells": int(sres.stats["retained_cells"][asked.chunk])})
    return rows


def open_all(video_paths: Sequence[str], video_root: str | Path | None, unit_seconds: float,
             notices: list[str]) -> list:
    """Each video's media (`media.open_media`), with one notice counting the synthetic fallbacks."""
    sources = [media_lib.open_media(video_root, v, unit_seconds=unit_seconds) for v in video_paths]
    fallbacks = [s.notice for s in sources if s.kind == "synthetic"]
    if fallbacks:
        notices.append(f"media: {len(fallbacks)} of {len(sources)} videos use synthetic frames and tones "
                       f"(first: {fallbacks[0]})")
    return sources


def run_summary(results: dict, rows: Sequence[dict]) -> dict[str, dict]:
    """Per configuration: session time and KV figures (`streamingbench.summarize`), without its accuracy table."""
    out = {}
    for name, s in sb.summarize([], results, []).items():
        s.pop("accuracy")
        at = [r["retained_cells"] for r in rows if r["config"] == name]
        s["kv"]["mean_retained_at_question"] = float(np.mean(at)) if at else float("nan")
        out[name] = s
    return out


def format_report(summary: dict[str, dict], metrics: dict[str, dict[str, dict]]) -> str:
    """Time and KV lines per configuration (as `streamingbench.format_summary`), then one row per metric group:
    `metrics[config][group] = {column: value}`."""
    lines = []
    for name, s in summary.items():
        lines += time_and_kv_lines(name, s)
        for group, values in metrics.get(name, {}).items():
            cells = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
            lines.append(f"   {group:<28} {cells}")
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def mean(values: Sequence[float]) -> float:
    """Mean of `values`, NaN when there are none."""
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(values)) if values else float("nan")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options `streamingbench.main` has (model, videos, configurations, mesh, output) for another benchmark."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", "--model", dest="checkpoint",
                      help="converted omnijax checkpoint directory (tokenizer files used if there)")
    what.add_argument("--demo", "--demo-model", dest="demo", action="store_true",
                      help="the tiny random demo model (scores meaningless)")
    parser.add_argument("--max-sessions", type=int, help="at most this many sessions (smoke runs)")
    streamingbench.add_run_options(parser)


def parse_mesh(spec: str | None) -> Mesh | None:
    """`DATAxMODEL` -> a mesh (`omnijax.eval.mesh.make_mesh`), None for None."""
    if not spec:
        return None
    data, _, width = spec.partition("x")
    if not (data.isdigit() and (width or "1").isdigit()):
        raise ValueError(f"--mesh must be DATAxMODEL (e.g. 8x1 or 4x2), got {spec!r}")
    return distributed.make_mesh(int(data), int(width or 1))


def prepare(args: argparse.Namespace, answer_tokens: int, notices: list[str], prefix: str
            ) -> tuple[list[EvalConfig], Mesh | None, OmniModel, media_lib.TextEncoder]:
    """Configurations, mesh, model and text encoder from `add_common_args`' options (after
    `distributed.initialize`). Raises ValueError for what a user can get wrong (reported without a traceback)."""
    configs = sb.configs_from_args(args, answer_tokens)
    mesh = parse_mesh(args.mesh)
    if args.demo:
        model = sb.demo_model(Path(tempfile.mkdtemp(prefix=prefix)))
        notices.append("model: tiny random demo checkpoint: scores are meaningless (chance level expected)")
    else:
        model = load(args.checkpoint)
    encoder = media_lib.text_encoder(args.checkpoint, model.config.vocab_size, notices)
    return configs, mesh, model, encoder


def print_notices(notices: Sequence[str]) -> None:
    """Each distinct notice once, on stderr."""
    for notice in dict.fromkeys(notices):
        print("notice:", notice, file=sys.stderr)


__all__ = ["AskedProbe", "Probe", "ProbeSession", "PromptBuilder", "add_common_args", "answer_text", "answers",
           "build_probe_session", "execute", "first_token_id", "format_report", "mean", "open_all", "parse_mesh",
           "prepare", "print_notices", "run_summary"]
