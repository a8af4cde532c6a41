"""Qwen3-Omni chunk builders: tokens, interleaved-M-RoPE position offsets, span metadata, embeddings, DeepStack.

What a streaming unit is for Qwen3-Omni: a piece of text (split anywhere), or one whole modality group with its
markers: `<|audio_start|> A… <|audio_end|>`, `<|vision_start|> IMAGE… <|vision_end|>`, `<|vision_start|> VIDEO…
<|vision_end|>`, or an audiovisual group `<|vision_start|><|audio_start|> … <|audio_end|><|vision_end|>` whose video
and audio tokens are merged token by token by temporal id, video first on ties. A live audio+video stream is a
sequence of audiovisual groups, one per unit (e.g. 2 s: 2 frames at 2 fps, one temporal patch, and 200 mel frames =
26 audio tokens), each placed as transformers places one video with its audio (`use_audio_in_video=True`): a
session of units equals `get_rope_index` of the concatenated per-unit sequence with one (video, audio) entry per
unit. Within a unit the interleaving is per token, so a unit's video and audio tokens alternate as their temporal ids
say; retention sees them as VIDEO and AUDIO spans of the same unit.

Positions come from `omnijax.models.qwen3_omni.positions` (`StreamPositions`): each builder places its unit at
cursor 0 and returns the offsets and the cursor move (`Chunk.advance`). Streaming keeps an integer cursor, so the
temporal ids must be whole: `second_per_grid * position_id_per_seconds` an integer (2 fps with temporal patches of
2 frames gives 1 s per grid, 13 ids per second); fractional ids are refused here (a one-shot `Model(...)` forward
takes them).

Span kinds: SYSTEM for the system prompt; chat and modality markers BOUNDARY; user text TEXT; model output RESPONSE;
placeholders IMAGE / VIDEO / AUDIO. Embeddings: placeholders are set in `embed_mask` and filled from the encoder
features in order; DeepStack levels (`[n, tokens, D]` from `vision.encode_vision`) go to the visual tokens, zero
elsewhere; text builders take `hidden_size` and `deepstack_levels` so that a stream's chunks all carry the same
fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from omnijax.chunks import builders as adapters
from omnijax.chunks.builders import concat, token_layout  # noqa: F401  (re-exported)
from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.qwen3_omni import positions as P

if TYPE_CHECKING:
    from omnijax.models.model import Model

RELEASE = P.Qwen3OmniConfig()  # the released checkpoints' ids


def token_ids_of(tokens: P.Qwen3OmniConfig | Model | None) -> P.Qwen3OmniConfig:
    """`tokens` (a `Qwen3OmniConfig`, or a model whose `omni` is one), else the release's ids."""
    if tokens is None:
        return RELEASE
    if isinstance(tokens, P.Qwen3OmniConfig):
        return tokens
    omni = getattr(tokens, "omni", None)
    if isinstance(omni, P.Qwen3OmniConfig):
        return omni
    raise TypeError(f"tokens must be a Qwen3OmniConfig (a loaded Qwen3-Omni model's `omni`), got "
                    f"{type(tokens).__name__}")


def _place(segment, t: P.Qwen3OmniConfig) -> tuple[np.ndarray, np.ndarray | None, int]:
    """`(offsets [3, n] int, token ids or None, advance)` of one unit placed at cursor 0."""
    stream = P.StreamPositions(t)
    placed = stream.feed(segment)
    pos, advance = placed.positions, stream.next_id
    if (pos != np.round(pos)).any() or advance != round(advance):
        raise ValueError(f"{segment!r} has fractional temporal ids (second_per_grid * position_id_per_seconds = "
                         f"{getattr(segment, 'second_per_grid', 0) * t.position_id_per_seconds:g}): streaming keeps "
                         f"whole positions; sample frames so that a temporal patch spans whole ids (e.g. 2 fps with "
                         f"2-frame patches), or run the clip one-shot with Model(...)")
    return pos.astype(np.int64), placed.token_ids, int(advance)


def _levels(deepstack_levels: int, T: int, hidden_size: int | None, deepstack) -> np.ndarray | None:
    if deepstack is not None:
        return np.asarray(deepstack)
    if deepstack_levels and hidden_size is None:
        raise ValueError("deepstack_levels need hidden_size")
    return np.zeros((deepstack_levels, T, hidden_size), np.float32) if deepstack_levels else None


def _text(token_ids, unit, kind, answer_tokens, answer_unit, hidden_size, deepstack_levels, t, markers=True):
    ids, span = adapters.text_spans(token_ids, kind, t, markers=markers)
    pos, _, advance = _place(P.TextRun(ids.shape[0]), t)
    embeds, mask = adapters.place_embeds(ids, [], hidden_size)
    return adapters.make_chunk(ids, pos, span, unit, answer_tokens=answer_tokens, answer_unit=answer_unit,
                               embeds=embeds, embed_mask=mask, advance=advance,
                               deepstack=_levels(deepstack_levels, ids.shape[0], hidden_size, None))


def system_unit(token_ids: Sequence[int], unit: int, *, hidden_size: int | None = None, deepstack_levels: int = 0,
                tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """The system prompt: every token SYSTEM (the whole prefix is kept)."""
    return _text(token_ids, unit, SpanKind.SYSTEM, 0, None, hidden_size, deepstack_levels, token_ids_of(tokens), False)


def text_unit(token_ids: Sequence[int], unit: int, answer_tokens: int = 0, *, answer_unit: int | None = None,
              hidden_size: int | None = None, deepstack_levels: int = 0,
              tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """User text: TEXT tokens, chat markers BOUNDARY; `answer_tokens` tokens are decoded after it."""
    return _text(token_ids, unit, SpanKind.TEXT, answer_tokens, answer_unit, hidden_size, deepstack_levels,
                 token_ids_of(tokens))


def response_unit(token_ids: Sequence[int], unit: int, *, hidden_size: int | None = None, deepstack_levels: int = 0,
                  tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """A model response fed back as input: RESPONSE tokens, chat markers BOUNDARY."""
    return _text(token_ids, unit, SpanKind.RESPONSE, 0, None, hidden_size, deepstack_levels, token_ids_of(tokens))


def _group(segment, unit, t, features, hidden_size, deepstack, deepstack_levels, answer_tokens) -> Chunk:
    pos, ids, advance = _place(segment, t)
    kinds = {t.image_token_id: SpanKind.IMAGE, t.video_token_id: SpanKind.VIDEO, t.audio_token_id: SpanKind.AUDIO}
    span = np.asarray([kinds.get(int(i), SpanKind.BOUNDARY) for i in ids], np.int32)
    embeds, mask = adapters.place_embeds(ids, [(ids == token, f) for token, f in features], hidden_size)
    levels = None
    if deepstack is not None or deepstack_levels:
        visual = np.isin(ids, [t.image_token_id, t.video_token_id])
        if embeds is None:
            raise ValueError("DeepStack levels need the unit's embeddings (pass the features or hidden_size)")
        levels = np.zeros((deepstack_levels or np.shape(deepstack)[0], ids.shape[0], embeds.shape[-1]), np.float32)
        if deepstack is not None:
            deepstack = np.asarray(deepstack, np.float32)
            if deepstack.shape[:2] != (levels.shape[0], int(visual.sum())):
                raise ValueError(f"deepstack must be [levels, {int(visual.sum())} visual tokens, D], got "
                                 f"{deepstack.shape}")
            levels[:, visual] = deepstack
    return adapters.make_chunk(ids, pos, span, unit, answer_tokens=answer_tokens, embeds=embeds, embed_mask=mask,
                               advance=advance, deepstack=levels)


def image_unit(grid_thw: Sequence[int], unit: int, embeds: np.ndarray | None = None,
               deepstack: np.ndarray | None = None, *, hidden_size: int | None = None, deepstack_levels: int = 0,
               answer_tokens: int = 0, tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """`<|vision_start|> <|image_pad|>×n <|vision_end|>` of a grid `(t, h, w)` in 16-px patches; `embeds [n, D]`
    and `deepstack [levels, n, D]` as `vision.encode_vision` returns them."""
    t = token_ids_of(tokens)
    return _group(P.ImageGroup(tuple(int(v) for v in grid_thw)), unit, t, [(t.image_token_id, embeds)],
                  hidden_size, deepstack, deepstack_levels, answer_tokens)


def video_unit(grid_thw: Sequence[int], second_per_grid: float, unit: int, embeds: np.ndarray | None = None,
               deepstack: np.ndarray | None = None, *, hidden_size: int | None = None, deepstack_levels: int = 0,
               answer_tokens: int = 0, tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """`<|vision_start|> <|video_pad|>×n <|vision_end|>`: frames without their audio."""
    t = token_ids_of(tokens)
    return _group(P.VideoGroup(tuple(int(v) for v in grid_thw), float(second_per_grid)), unit, t,
                  [(t.video_token_id, embeds)], hidden_size, deepstack, deepstack_levels, answer_tokens)


def audio_unit(num_audio_tokens: int, unit: int, embeds: np.ndarray | None = None, *, hidden_size: int | None = None,
               deepstack_levels: int = 0, answer_tokens: int = 0,
               tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """`<|audio_start|> <|audio_pad|>×n <|audio_end|>`; `embeds [n, D]` from `audio.encode_audio`
    (n = `audio_token_count(mel frames)`, 13 per second)."""
    t = token_ids_of(tokens)
    return _group(P.AudioGroup(int(num_audio_tokens)), unit, t, [(t.audio_token_id, embeds)], hidden_size, None,
                  deepstack_levels, answer_tokens)


def audiovisual_unit(video_grid_thw: Sequence[int], num_audio_tokens: int, second_per_grid: float, unit: int,
                     video_embeds: np.ndarray | None = None, audio_embeds: np.ndarray | None = None,
                     deepstack: np.ndarray | None = None, *, hidden_size: int | None = None,
                     deepstack_levels: int = 0, answer_tokens: int = 0,
                     tokens: P.Qwen3OmniConfig | Model | None = None) -> Chunk:
    """One audiovisual unit: `<|vision_start|><|audio_start|>` video and audio merged by temporal id (video first on
    ties) `<|audio_end|><|vision_end|>`; the features fill their placeholders in encoder order, `deepstack
    [levels, n_video, D]` the video tokens."""
    t = token_ids_of(tokens)
    if t.video_token_id == t.audio_token_id:
        raise ValueError(f"the video and audio placeholders share id {t.video_token_id}")
    segment = P.AudioInVideoGroup(tuple(int(v) for v in video_grid_thw), float(second_per_grid),
                                  int(num_audio_tokens))
    return _group(segment, unit, t, [(t.video_token_id, video_embeds), (t.audio_token_id, audio_embeds)],
                  hidden_size, deepstack, deepstack_levels, answer_tokens)


__all__ = ["RELEASE", "audio_unit", "audiovisual_unit", "concat", "image_unit", "response_unit", "system_unit",
           "text_unit", "token_layout", "video_unit"]
