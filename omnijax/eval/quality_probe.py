"""Metronome's quality probe (Metronome §5.4, Fig. 8, Table 2): free-running decoding under rotating questions.

Each of N sessions hears a stream of audio frames of B ms and decodes tau tokens after every frame whatever they are
(free-running: `Greedy(free_running=True)` decodes through end-of-sequence tokens), on the Metronome engine's
batched ticks. Every `segment_s` seconds a new question starts playing (session i starts at question i, so the
sessions of one tick hear different questions): its recorded clip when the question has one (`Question.audio`, a
WAV file, fed as the segment's first frames), else its text as a user turn (the chat template's rendering, fed in
place of that tick's audio frame); speech-like audio fills the rest. A session *answers the playing question* at a
frame when a keyword of that question appears in the text it decoded over the last `window_frames` frames of the
segment (case-insensitive, a lenient scorer as the paper's). Reported per condition (retention policy): the share of
sessions answering, by session age (one point per segment), its mean, and a recall probe at the end (asked for the
first question, scored by that question's keywords: what a fixed bound cannot hold, so a coherent in-window answer is
what scores).

Conditions are retention policies as the command lines write them: `unbounded`, `sink_window:sink=16,window=1024`;
`--table2` runs Table 2's sweep (sinks 0 / 16 / 32 / 64 against windows 512 / 1024 / 2048, and unbounded), `--sinks`
the sink ablation (the same window with and without sinks).

    python -m omnijax.eval.quality_probe CKPT --sessions 32 --seconds 300 --table2 --out probe/
    python -m omnijax.eval.quality_probe --demo-model --sessions 2 --seconds 8 --segment-s 4   # a smoke run

Writes `quality_probe.json` (rows per condition and age), `quality_probe.png` (answering share by age per condition)
and prints a table. The probe needs a checkpoint with an audio encoder and a tokenizer (Qwen2.5-Omni, Qwen3-Omni).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from omnijax import compilation_cache
from omnijax.chunks.chunk import split_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.decoding import Greedy
from omnijax.media.audio import read_wav, resample
from omnijax.models.family import OmniModel
from omnijax.models.frontend import units_for
from omnijax.models.registry import load
from omnijax.retention import get_policy
from omnijax.serve.app import build_demo_model
from omnijax.serve.audio_frames import AudioFrameEncoder
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.loadgen import speech_like_pcm
from omnijax.streaming.config import StreamConfig

SAMPLE_RATE = 16_000


@dataclasses.dataclass(frozen=True)
class Question:
    """A rotating question: its text, the keywords that credit an answer, and optionally a recorded clip."""

    text: str
    keywords: tuple[str, ...]
    audio: str | None = None  # a mono 16-bit WAV file; played as the segment's first frames


DEFAULT_QUESTIONS = (
    Question("What color is a clear daytime sky?", ("blue",)),
    Question("How many legs does a spider have?", ("eight", "8")),
    Question("What is the capital of France?", ("paris",)),
    Question("What do bees make?", ("honey",)),
    Question("Which planet is known as the red planet?", ("mars",)),
    Question("What is frozen water called?", ("ice",)),
    Question("What animal says moo?", ("cow",)),
    Question("How many days are in a week?", ("seven", "7")),
)


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """The workload: sessions, duration, segments, frames, answer tokens per frame, the scorer's window."""

    sessions: int = 4
    seconds: float = 300.0
    segment_s: float = 30.0
    frame_ms: float = 1000.0
    tau: int = 4
    window_frames: int = 5
    recall_tokens: int = 16
    page_size: int = 64
    chunk_tokens: int = 64

    def __post_init__(self):
        if self.sessions < 1 or self.tau < 1 or self.window_frames < 1 or self.recall_tokens < 1:
            raise ValueError("sessions, tau, window_frames and recall_tokens must be >= 1")
        if not 0 < self.frame_ms / 1000 <= self.segment_s <= self.seconds:
            raise ValueError(f"need 0 < frame ({self.frame_ms:g} ms) <= segment ({self.segment_s:g} s) <= run "
                             f"({self.seconds:g} s)")

    @property
    def frames(self) -> int:
        return int(self.seconds * 1000 // self.frame_ms)

    @property
    def frames_per_segment(self) -> int:
        return max(1, int(round(self.segment_s * 1000 / self.frame_ms)))


def table2_conditions() -> list[str]:
    """Table 2's sweep: sinks 0 / 16 / 32 / 64 against windows 512 / 1024 / 2048, and the unbounded baseline."""
    return ["unbounded"] + [f"sink_window:sink={s},window={w}" for w in (512, 1024, 2048) for s in (0, 16, 32, 64)]


def playing(frame: int, session: int, config: ProbeConfig, count: int) -> int:
    """The question a session hears at `frame`: segment index plus the session's offset, modulo `count`."""
    return (frame // config.frames_per_segment + session) % count


def answering(texts: list[str], questions: list[Question], session: int, config: ProbeConfig) -> list[bool]:
    """Per frame: a keyword of the playing question appears in the text of the last `window_frames` frames of its
    segment (case-insensitive)."""
    out = []
    for k in range(len(texts)):
        start = max(k - config.window_frames + 1, k - k % config.frames_per_segment)
        recent = "".join(texts[start:k + 1]).lower()
        keys = questions[playing(k, session, config, len(questions))].keywords
        out.append(any(word.lower() in recent for word in keys))
    return out


def by_age(correct: list[list[bool]], config: ProbeConfig) -> list[float]:
    """The share of (session, frame) pairs answering, per segment of session age."""
    per = config.frames_per_segment
    segments = -(-len(correct[0]) // per)
    return [float(np.mean([c[s * per:(s + 1) * per] for c in correct])) for s in range(segments)]


def _clip(path: str) -> np.ndarray:
    """A question clip (16-bit PCM WAV) as 16 kHz int16."""
    pcm, rate = read_wav(path, widths=(2,))
    return (resample(pcm, rate) * 32767).astype(np.int16)


def run_condition(model: OmniModel, spec: str, questions: list[Question], config: ProbeConfig, *,
                  log: Callable[[str], object] = print) -> dict:
    """One condition (a retention policy spec) on the engine: returns its rows (see the module docstring)."""

    tokenizer, units = model.tokenizer, units_for(model)
    samples = int(SAMPLE_RATE * config.frame_ms / 1000)
    T = config.chunk_tokens
    encoder = AudioFrameEncoder(model, chunk_tokens=T, answer_tokens=config.tau)
    prompts = [tokenizer.encode(tokenizer.render([{"role": "user", "content": q.text}], add_generation_prompt=True))
               for q in questions]
    clips = [None if q.audio is None else _clip(q.audio) for q in questions]
    per_session = config.frames * (T + config.tau) + max(len(p) for p in prompts) * (config.frames //
                                                                                    config.frames_per_segment + 2)
    pages = config.sessions * (-(-per_session // config.page_size) + 2)
    stream = StreamConfig(policy=get_policy(spec), num_pages=pages, page_size=config.page_size,
                                  max_answer_tokens=max(config.tau, config.recall_tokens),
                                  decoding=Greedy(free_running=True))
    buckets = tuple(sorted({1 << max(0, config.sessions - 1).bit_length()}))
    engine = Engine(model, EngineConfig(stream, chunk_tokens=T, buckets=buckets, return_logits=False))
    sids = [f"q{i}" for i in range(config.sessions)]
    for sid in sids:
        engine.open(sid)
    audio = [speech_like_pcm(config.seconds + 1, seed=i) for i in range(config.sessions)]
    pending = {sid: [] for sid in sids}  # question parts still to feed
    decoders = {sid: tokenizer.stream_decoder(skip_special_tokens=True) for sid in sids}
    texts = {sid: [] for sid in sids}
    unit = {sid: 0 for sid in sids}
    started, preempted = time.perf_counter(), set()
    for k in range(config.frames):
        for i, sid in enumerate(sids):
            q = playing(k, i, config, len(questions))
            if k % config.frames_per_segment == 0 and clips[q] is None:  # a new segment: its question as text
                chunk = units.text(prompts[q], unit[sid], SpanKind.TEXT, answer_tokens=config.tau)
                pending[sid] = split_chunk(chunk, T)
                unit[sid] += 2
            if pending[sid]:
                part = pending[sid].pop(0)
                engine.submit(sid, part, int(np.asarray(part.answer_tokens)[0]))
                continue
            offset = (k % config.frames_per_segment) * samples
            clip = clips[q]
            pcm = (clip[offset:offset + samples] if clip is not None and offset < clip.size else
                   audio[i][k * samples:(k + 1) * samples])
            pcm = np.pad(pcm, (0, samples - pcm.size))
            engine.submit(sid, encoder.encode(pcm, unit[sid]), config.tau)
            unit[sid] += 1
        report = engine.tick()
        for sid in sids:
            out = report.outputs.get(sid)
            preempted |= {sid} if out is not None and out.preempted else set()
            texts[sid].append(decoders[sid].push([] if out is None else out.tokens))
        if (k + 1) % max(1, config.frames // 10) == 0:
            log(f"  {spec}: frame {k + 1}/{config.frames}, pool {engine.occupancy:.0%}, "
                f"{time.perf_counter() - started:.0f} s")
    recall = _recall(engine, units, tokenizer, sids, unit, questions, config)
    correct = [answering(texts[sid], questions, i, config) for i, sid in enumerate(sids)]
    curve = by_age(correct, config)
    return {"condition": spec, "policy": repr(stream.policy), "answering_by_age": curve,
            "answering": float(np.mean(curve)), "recall": recall, "preempted": len(preempted),
            "peak_occupancy": float(max(r.used_pages for r in engine.telemetry.records) / pages),
            "seconds": time.perf_counter() - started, "texts": {sid: "".join(t) for sid, t in texts.items()}}


def _recall(engine, units, tokenizer, sids, unit, questions, config: ProbeConfig) -> float:
    """Asks every session for the first question it heard; the share whose answer has its keywords."""

    ids = tokenizer.encode(tokenizer.render([{"role": "user", "content": "What was the very first question you "
                                                                        "heard in this conversation?"}],
                                            add_generation_prompt=True))
    parts = {sid: split_chunk(units.text(ids, unit[sid], SpanKind.TEXT, answer_tokens=config.recall_tokens),
                              config.chunk_tokens) for sid in sids}
    answers = {sid: [] for sid in sids}
    while any(parts.values()):
        for sid in sids:
            if parts[sid]:
                part = parts[sid].pop(0)
                engine.submit(sid, part, int(np.asarray(part.answer_tokens)[0]))
        for sid, out in engine.tick().outputs.items():
            answers[sid] += out.tokens
    hits = [any(w.lower() in tokenizer.decode(answers[sid], skip_special_tokens=True).lower()
                for w in questions[playing(0, i, config, len(questions))].keywords) for i, sid in enumerate(sids)]
    return float(np.mean(hits))


def plot(rows: list[dict], config: ProbeConfig, path: Path) -> None:
    import matplotlib  # optional (omnijax[plot]): only the plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional (omnijax[plot])

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        ages = (np.arange(len(row["answering_by_age"])) + 0.5) * config.segment_s
        ax.plot(ages, row["answering_by_age"], marker="o", label=f"{row['condition']} (recall {row['recall']:.2f})")
    ax.set_xlabel("session age (s)")
    ax.set_ylabel("sessions answering the playing question")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"Free-running quality probe: {config.sessions} sessions, {config.seconds:g} s, "
                 f"B = {config.frame_ms:g} ms, tau = {config.tau}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_questions(path: str | None) -> list[Question]:
    """Questions from a JSON list of `{"text", "keywords", "audio"?}` (audio paths relative to the file), or the
    built-in set."""
    if path is None:
        return list(DEFAULT_QUESTIONS)
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: a JSON list of questions is expected")
    out = []
    for n, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("text"), str) or not e.get("keywords"):
            raise ValueError(f"{path}: question {n} needs a 'text' and a non-empty 'keywords' list")
        audio = e.get("audio")
        out.append(Question(e["text"], tuple(str(k) for k in e["keywords"]),
                            None if audio is None else str(Path(path).parent / audio)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="converted checkpoint with an audio encoder and a tokenizer")
    parser.add_argument("--demo-model", action="store_true", help="the embedded tiny random model (a smoke run)")
    parser.add_argument("--conditions", nargs="+", default=["unbounded", "sink_window:sink=16,window=1024",
                                                            "sink_window:sink=0,window=1024"])
    parser.add_argument("--table2", action="store_true", help="Table 2's S x W sweep (replaces --conditions)")
    parser.add_argument("--questions", help="JSON list of {text, keywords, audio?} (default: a built-in set)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--segment-s", type=float, default=30.0)
    parser.add_argument("--frame-ms", type=float, default=1000.0)
    parser.add_argument("--tau", type=int, default=4)
    parser.add_argument("--window-frames", type=int, default=5)
    parser.add_argument("--out", default="quality_probe_out")
    args = parser.parse_args(argv)
    if bool(args.checkpoint) == args.demo_model:
        parser.error("give a checkpoint directory or --demo-model (not both)")
    try:
        config = ProbeConfig(sessions=args.sessions, seconds=args.seconds, segment_s=args.segment_s,
                             frame_ms=args.frame_ms, tau=args.tau, window_frames=args.window_frames)
        questions = load_questions(args.questions)
    except (ValueError, OSError) as e:
        parser.error(str(e))

    conditions = table2_conditions() if args.table2 else args.conditions
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.demo_model:
            model = load(build_demo_model(tmp))
        else:
            model = load(args.checkpoint)
        if model.tokenizer is None or model.audio is None:
            print("quality_probe: error: the checkpoint needs an audio encoder and tokenizer files", file=sys.stderr)
            return 1
        rows = []
        for spec in conditions:
            print(f"condition {spec}", flush=True)
            rows.append(run_condition(model, spec, questions, config, log=lambda m: print(m, flush=True)))
    print(f"\n{'condition':<34} {'answering':>9} {'recall':>6} {'preempted':>9} {'peak pool':>9}   by age")
    for r in rows:
        curve = " ".join(f"{x:.2f}" for x in r["answering_by_age"])
        print(f"{r['condition']:<34} {r['answering']:>9.3f} {r['recall']:>6.2f} {r['preempted']:>9d} "
              f"{r['peak_occupancy']:>9.2f}   {curve}")
    (out / "quality_probe.json").write_text(json.dumps({"config": dataclasses.asdict(config), "rows": rows},
                                                       indent=1))
    plot(rows, config, out / "quality_probe.png")
    print(f"wrote {out / 'quality_probe.json'}\nwrote {out / 'quality_probe.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
