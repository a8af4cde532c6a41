"""A StreamingBench video -> one streaming session of Qwen2.5-Omni chunks, each question asked at its timestamp.

Session layout (unit ids in brackets):

    system prompt [0]
    audiovisual unit 0 [1]  (seconds 0-2)      <- a question at 0 s or 1 s is asked here, after unit 0
    question text [2] + greedy answer [3]         (`<|im_start|>user ... options ... <|im_end|><|im_start|>assistant`)
    audiovisual unit 1 [4]  (seconds 2-4)
    ...

A question is asked after the unit containing its timestamp (`annotations.place_questions`); several questions
after the same unit come in time order. The answer is generated greedily (up to the configuration's
`max_answer_tokens`) and stays in the context, as in a live session. Long question texts are split over several
chunks of the same unit (positions and span offsets continue), so every chunk of the schedule has about the length
of one audiovisual unit; the last part carries the answer request, and its last-position logits score the options.

Units carry encoder features when the model has audio and vision encoders: its family's unit builder
(`omnijax.models.frontend.units_for`; every family: Qwen2.5-Omni's and Qwen3-Omni's 2 s units at 2 fps, MiniCPM-o's
1 s units of one frame) on the media's frames and PCM. Otherwise they are layout-only (Qwen2.5-Omni's placeholder
ids, no features; ids folded into the vocabulary) and a notice says so.

Special ids (`<|im_start|>`, `<|im_end|>`, the modality markers and placeholders) are the loaded checkpoint's
(`model.omni`, filled by `omnijax-convert` from its config and tokenizer); the text encoder only encodes text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from omnijax.chunks.chunk import Chunk, split_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.eval import annotations as ann
from omnijax.eval.media import MediaSource, TextEncoder
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel
from omnijax.models.frontend import units_for
from omnijax.models.qwen2_5_omni import layout as adapter
from omnijax.testing.synthetic import fold_ids

SYSTEM_PROMPT = ("You are a helpful assistant. You watch a live video stream with its audio and answer questions "
                 "about what has happened so far.")
INSTRUCTION = "Answer with the option's letter from the given choices directly."


@dataclasses.dataclass(frozen=True)
class Asked:
    """A question in a session: scored at chunk `chunk` (its last part), asked after video unit `unit`."""

    question: ann.Question
    chunk: int
    unit: int
    status: str  # "ok" or "past_end" (clamped to the last unit)


@dataclasses.dataclass
class BenchSession:
    """One video's session: its chunks, the questions asked in it, and those left out (with the reason)."""

    video: ann.Video
    chunks: list[Chunk]
    asked: list[Asked]
    left_out: list[tuple[ann.Question, str]]
    units: int
    media: str


def prompt_text(question: ann.Question) -> str:
    """The user turn's text: question, labelled options, instruction."""
    lines = [question.question] + [f"{ann.LETTERS[i]}. {o}" for i, o in enumerate(question.options)]
    return "\n".join(lines + [INSTRUCTION])


def split_text_chunk(chunk: Chunk, max_len: int) -> list[Chunk]:
    """Splits a batch-1 text chunk (consecutive positions) into parts of at most `max_len` tokens.

    Streaming the parts equals streaming the whole: positions continue (each part's offsets restart at 0 and the
    cursor advances by the part's length), unit, span and span offsets are kept; only the last part asks for the
    answer.
    """
    n = int(np.asarray(chunk.valid).sum())
    if not (np.asarray(chunk.positions)[:, 0, :n] == np.arange(n)).all():
        raise ValueError("split_text_chunk takes text chunks (positions 0..n-1 on every axis)")
    return [chunk] if n <= max_len else split_chunk(chunk, max_len)


class ChunkBuilder:
    """Builds the chunks of a session for one model: with encoder features (its family's units) when it has audio
    and vision encoders, else layout-only.

    Args:
        model: a loaded model (any family), or a bare decoder (layout-only).
        encoder: the text encoder of questions and prompts.
        unit_seconds, fps: the audiovisual unit's length and frame rate; default the family's (2 s at 2 fps for the
            layout-only units).
        video_kwargs: frame preprocessing settings of the family's `av` (default a 56x56 minimum).
    """

    def __init__(self, model: OmniModel | Decoder, encoder: TextEncoder, *, unit_seconds: float | None = None,
                 fps: float | None = None,
                 video_kwargs: dict | None = None):
        audio, vision = (getattr(model, name, None) for name in ("audio", "vision"))  # a bare decoder has neither
        self.features = audio is not None and vision is not None
        self.units = units_for(model) if self.features else None
        self.unit_seconds = unit_seconds or (self.units.unit_seconds if self.units else 2.0)
        self.fps = fps or (self.units.fps if self.units else 2.0)
        self.model, self.encoder = model, encoder
        self.video_kwargs = {"min_pixels": 56 * 56} if video_kwargs is None else video_kwargs
        self.vocab_size, self.hidden_size = model.config.vocab_size, model.config.hidden_size
        # the layout-only path's ids (Qwen2.5-Omni's layout: the checkpoint's, or the release's)
        self.tokens = None if self.features else adapter.token_ids_of(getattr(model, "omni", None))

    @property
    def notice(self) -> str:
        return "" if self.features else ("media: the model has no audio/vision encoders; audiovisual units are "
                                         "layout-only (placeholder tokens without features)")

    def _text(self, ids: list[int], unit: int, kind: str, answer_tokens: int = 0) -> Chunk:
        if self.features:
            return self.units.text(ids, unit, SpanKind.SYSTEM if kind == "system" else SpanKind.TEXT, answer_tokens)
        chunk = (adapter.system_unit(ids, unit, tokens=self.tokens) if kind == "system"
                 else adapter.text_unit(ids, unit, answer_tokens, tokens=self.tokens))
        return fold_ids(chunk, self.vocab_size)

    def _chat_markers(self) -> tuple[int, int]:
        """The checkpoint's `<|im_start|>`, `<|im_end|>` (folded into a vocabulary too small to hold them)."""
        start, end = (self.units.chat_markers if self.units is not None
                      else (self.tokens.im_start_token_id, self.tokens.im_end_token_id))
        return start % self.vocab_size, end % self.vocab_size

    def system(self) -> Chunk:
        e, (start, end) = self.encoder, self._chat_markers()
        ids = [start, *e.encode("system\n" + SYSTEM_PROMPT), end, *e.encode("\n")]
        return self._text(ids, 0, "system")

    def question(self, question: ann.Question, unit: int, answer_tokens: int) -> Chunk:
        e, (start, end) = self.encoder, self._chat_markers()
        ids = [start, *e.encode("user\n" + prompt_text(question)), end, *e.encode("\n"), start,
               *e.encode("assistant\n")]
        return self._text(ids, unit, "text", answer_tokens)

    def audiovisual(self, frames: np.ndarray, pcm: np.ndarray, unit: int) -> Chunk:
        if self.features:
            return self.units.av(frames, pcm, unit, **self.video_kwargs)
        # Layout only: the grid a 14 px patch, 2x2 merge vision tower would give these frames.
        t = max(1, int(frames.shape[0]) // 2)
        h, w = (max(2, 2 * (int(s) // 28)) for s in frames.shape[1:3])
        audio = max(1, int(round(25 * pcm.shape[0] / 16_000)))
        return fold_ids(adapter.audiovisual_unit((t, h, w), audio, 2.0 / self.fps, unit, tokens=self.tokens),
                        self.vocab_size)


def build_session(video: ann.Video, media: MediaSource, builder: ChunkBuilder, *, answer_tokens: int = 1,
                  max_units: int | None = None, past_end: str = "clamp",
                  text_chunk_len: int | None = None) -> BenchSession:
    """One session for a video (see the module docstring).

    Args:
        video: the video and its questions.
        media: its frames and audio (decoded or synthetic).
        builder: the model's chunk builder.
        answer_tokens: greedy tokens requested after each question.
        max_units: cut the timeline after this many units; questions after the cut are left out.
        past_end: handling of questions after a known video end (`annotations.place_questions`).
        text_chunk_len: longest question chunk (default: the audiovisual unit's length).
    """
    unit_s = builder.unit_seconds
    mc = [q for q in video.questions if q.multiple_choice]
    left_out = [(q, "open-ended (no options): not scored by this harness") for q in video.questions
                if not q.multiple_choice]
    if media.duration_s is not None:
        units = ann.num_units(media.duration_s, unit_s)
        placements = ann.place_questions(mc, units, duration_s=media.duration_s, unit_seconds=unit_s,
                                         past_end=past_end)
    else:  # synthetic media: the timeline runs to the unit of the last question
        units = 1 + max((ann.unit_of(q.time_s, unit_s) for q in mc), default=0)
        placements = ann.place_questions(mc, units, unit_seconds=unit_s, past_end=past_end)
    units = units if max_units is None else min(units, max_units)
    out, asked_at, cut = lay_out(placements, units, media, builder,
                                 lambda p, unit: builder.question(p.question, unit, answer_tokens),
                                 text_chunk_len=text_chunk_len)
    asked = [Asked(p.question, at, p.unit, p.status) for at, p in asked_at]
    return BenchSession(video, out, asked, left_out + cut, units, media.kind)


def lay_out(placements: Sequence[ann.Placement], units: int, media: MediaSource, builder: ChunkBuilder,
            ask: Callable[[ann.Placement, int], Chunk], *, text_chunk_len: int | None = None
            ) -> tuple[list[Chunk], list[tuple[int, ann.Placement]], list[tuple[ann.Question, str]]]:
    """The layout every harness's sessions share: the system prompt, then each of the first `units` audiovisual
    units followed by the questions placed in it (`ask(placement, unit_id) -> Chunk`; a question takes two unit ids,
    its own and its answer's), every text chunk cut to `text_chunk_len` tokens (default: the unit's length).

    Returns:
        `(chunks, asked_at, left_out)`: the chunks, `(chunk index of the question's last part, placement)` per asked
        question, and `(question, reason)` for those placed past the end or after the cut.
    """
    left_out, by_unit = [], {}
    for p in placements:
        if p.status == "skipped":
            left_out.append((p.question, "past the end of the video (past_end='skip')"))
        elif p.unit >= units:
            left_out.append((p.question, f"after the first {units} units (max_units)"))
        else:
            by_unit.setdefault(p.unit, []).append(p)
    chunks, pending, av_lengths = [builder.system()], [], []
    unit_id = 1
    for k, (frames, pcm) in enumerate(media.units(units)):
        chunks.append(builder.audiovisual(frames, pcm, unit_id))
        av_lengths.append(chunks[-1].length)
        unit_id += 1
        for p in by_unit.get(k, []):
            pending.append((len(chunks), p))
            chunks.append(ask(p, unit_id))
            unit_id += 2  # the question, then its answer
    limit = text_chunk_len or max(av_lengths)
    text = {0} | {j for j, _ in pending}
    out: list[Chunk] = []
    index_map = {}
    for i, chunk in enumerate(chunks):
        out.extend(split_text_chunk(chunk, limit) if i in text else [chunk])
        index_map[i] = len(out) - 1
    return out, [(index_map[j], p) for j, p in pending], left_out


def letter_ids(encoder: TextEncoder, count: int) -> list[int]:
    """Ids of the option letters A, B, ... (the first `count`)."""
    return [encoder.letter_id(letter) for letter in ann.LETTERS[:count]]


def first_letter(text: str, count: int) -> str:
    """The first option letter among the first `count` in a generated answer ("" when none)."""
    if count < 1:
        return ""
    match = re.search(rf"(?<![^\W\d_])[A-{ann.LETTERS[count - 1]}](?![^\W\d_])", text)  # a letter standing alone
    return match.group(0) if match else ""


__all__ = ["Asked", "BenchSession", "ChunkBuilder", "INSTRUCTION", "SYSTEM_PROMPT", "build_session", "first_letter",
           "lay_out", "letter_ids", "prompt_text", "split_text_chunk"]
