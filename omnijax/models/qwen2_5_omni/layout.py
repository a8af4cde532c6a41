"""Qwen2.5-Omni chunk builders: tokens, TMRoPE position offsets, span metadata and placeholder embeddings.

Each builder returns a batch-1, unpadded `Chunk` with 3 position axes whose offsets make a stream of units reproduce
transformers' `get_rope_index` of the concatenated token sequence (`token_layout` flattens a list of chunks into
exactly that sequence and its positions). Positions come from `omnijax.models.qwen2_5_omni.positions`.

Span kinds: the system prompt is SYSTEM throughout (its chat markers included: the whole prefix is kept); elsewhere
chat and modality markers (`<|im_start|>`, `<|im_end|>`, `<|vision_bos|>`, `<|vision_eos|>`, `<|audio_bos|>`,
`<|audio_eos|>`) are BOUNDARY, user text TEXT, model output RESPONSE, image / video / audio placeholders IMAGE /
VIDEO / AUDIO. `offset` is the index within a run of consecutive tokens of the same span kind, so the interleaved
video and audio chunks of an audiovisual unit each start at offset 0.

Embeddings: placeholder tokens (`<|AUDIO|>`, `<|IMAGE|>`, `<|VIDEO|>`) are set in `embed_mask`; encoder features
passed as `embeds` fill them in order (the order `masked_scatter` uses in transformers); with only `hidden_size` they
stay zeros for the caller to fill; with neither, the chunk carries no embeddings (`with_embeds` adds them later).
Text builders take `hidden_size` too, since a stack of chunks needs embeddings on all or none.

Streaming audio and video (`audiovisual_unit`): every 2 s unit is its own
`<|vision_bos|><|audio_bos|> V A <|audio_eos|><|vision_eos|>` group, i.e. what transformers' processor and
`get_rope_index` produce for a 2 s clip with its audio, NOT a slice of one long video's group: a session of units
matches `get_rope_index` of the concatenated per-unit sequence with one (video, audio) entry per unit.

Token ids: every builder takes `tokens`, the checkpoint's special ids (an `OmniConfig`: a loaded model's
`model.omni`, which `omnijax-convert` fills from the checkpoint's config and tokenizer); None means the release's
ids (`RELEASE`, also spelled as the module constants `IM_START`, `AUDIO`, ...). A checkpoint with other ids needs
its own: pass `tokens=model.omni` (the frontend, the server and the harness do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.chunks import builders as adapters
from omnijax.chunks.builders import concat, token_layout  # noqa: F401  (re-exported)
from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.qwen2_5_omni import positions as tmrope
from omnijax.models.qwen2_5_omni.config import OmniConfig

if TYPE_CHECKING:
    from omnijax.models.model import Model

RELEASE = OmniConfig()  # the released checkpoints' ids; the constants below spell them out
IM_START = 151644
IM_END = 151645
AUDIO = 151646  # <|AUDIO|> placeholder
AUDIO_BOS = 151647
AUDIO_EOS = 151648
VISION_BOS = 151652
VISION_EOS = 151653
IMAGE = 151655  # <|IMAGE|> placeholder
VIDEO = 151656  # <|VIDEO|> placeholder

BOUNDARY_TOKENS = RELEASE.boundary_ids
PLACEHOLDER_TOKENS = RELEASE.placeholder_ids


def token_ids_of(tokens: OmniConfig | Model | None) -> OmniConfig:
    """The ids to build with: `tokens` (an `OmniConfig`, or a model whose `omni` is one), else the release's."""
    if tokens is None:
        return RELEASE
    if not isinstance(tokens, OmniConfig):
        omni = getattr(tokens, "omni", None)
        if isinstance(omni, OmniConfig):
            return omni
        if hasattr(tokens, "omni"):  # a model without thinker ids (e.g. converted from a plain LLM)
            return RELEASE
        raise TypeError(f"tokens must be an OmniConfig (a loaded model's `omni`), got {type(tokens).__name__}")
    return tokens


def _role_ids(t: OmniConfig) -> np.ndarray:
    return np.array([t.vision_start_token_id, t.audio_start_token_id, t.video_token_id, t.audio_token_id,
                     t.audio_end_token_id, t.vision_end_token_id], np.int64)


_ROLE_SPANS = np.array([SpanKind.BOUNDARY, SpanKind.BOUNDARY, SpanKind.VIDEO, SpanKind.AUDIO, SpanKind.BOUNDARY,
                        SpanKind.BOUNDARY], np.int32)


def system_unit(token_ids: Sequence[int], unit: int, *, hidden_size: int | None = None,
                tokens: OmniConfig | None = None) -> Chunk:
    """The system prompt (e.g. `<|im_start|>system\\n…<|im_end|>\\n`): every token SYSTEM."""
    return _text(token_ids, unit, SpanKind.SYSTEM, 0, None, hidden_size, token_ids_of(tokens), markers=False)


def text_unit(token_ids: Sequence[int], unit: int, answer_tokens: int = 0, *, answer_unit: int | None = None,
              hidden_size: int | None = None, tokens: OmniConfig | None = None) -> Chunk:
    """User text: TEXT tokens, chat markers BOUNDARY; `answer_tokens` greedy tokens follow (as unit `answer_unit`,
    default `unit + 1`)."""
    return _text(token_ids, unit, SpanKind.TEXT, answer_tokens, answer_unit, hidden_size, token_ids_of(tokens))


def response_unit(token_ids: Sequence[int], unit: int, *, hidden_size: int | None = None,
                  tokens: OmniConfig | None = None) -> Chunk:
    """A model response fed back as input: RESPONSE tokens, chat markers BOUNDARY."""
    return _text(token_ids, unit, SpanKind.RESPONSE, 0, None, hidden_size, token_ids_of(tokens))


def image_unit(grid_thw: Sequence[int], unit: int, embeds: np.ndarray | None = None, *,
               hidden_size: int | None = None, answer_tokens: int = 0,
               spatial_merge_size: int = tmrope.SPATIAL_MERGE_SIZE, tokens: OmniConfig | None = None) -> Chunk:
    """`<|vision_bos|> <|IMAGE|>×n <|vision_eos|>` for an image grid `(t, h, w)` in patches.

    `embeds`: `[n, D]` image features (n = t·h·w / merge²), in the vision encoder's output order.
    """
    t = token_ids_of(tokens)
    seg = tmrope.image_positions(grid_thw, spatial_merge_size=spatial_merge_size)
    return _marked(t.vision_start_token_id, t.image_token_id, t.vision_end_token_id, SpanKind.IMAGE, seg, unit,
                   embeds, hidden_size, answer_tokens)


def video_unit(grid_thw: Sequence[int], second_per_grid: float, unit: int, embeds: np.ndarray | None = None, *,
               hidden_size: int | None = None, answer_tokens: int = 0,
               spatial_merge_size: int = tmrope.SPATIAL_MERGE_SIZE, tokens: OmniConfig | None = None) -> Chunk:
    """`<|vision_bos|> <|VIDEO|>×n <|vision_eos|>`: a video without its audio (`use_audio_in_video=False`)."""
    t = token_ids_of(tokens)
    seg = tmrope.video_positions(grid_thw, second_per_grid, spatial_merge_size=spatial_merge_size)
    return _marked(t.vision_start_token_id, t.video_token_id, t.vision_end_token_id, SpanKind.VIDEO, seg, unit,
                   embeds, hidden_size, answer_tokens)


def audio_unit(num_audio_tokens: int, unit: int, embeds: np.ndarray | None = None, *,
               hidden_size: int | None = None, answer_tokens: int = 0, tokens: OmniConfig | None = None) -> Chunk:
    """`<|audio_bos|> <|AUDIO|>×n <|audio_eos|>`; `embeds`: `[n, D]` audio features (25 per second)."""
    t = token_ids_of(tokens)
    seg = tmrope.audio_positions(num_audio_tokens)
    return _marked(t.audio_start_token_id, t.audio_token_id, t.audio_end_token_id, SpanKind.AUDIO, seg, unit, embeds,
                   hidden_size, answer_tokens)


def audiovisual_unit(video_grid_thw: Sequence[int], num_audio_tokens: int, second_per_grid: float, unit: int,
                     video_embeds: np.ndarray | None = None, audio_embeds: np.ndarray | None = None, *,
                     hidden_size: int | None = None, answer_tokens: int = 0,
                     spatial_merge_size: int = tmrope.SPATIAL_MERGE_SIZE, tokens: OmniConfig | None = None) -> Chunk:
    """One audiovisual unit (typically 2 s): `<|vision_bos|><|audio_bos|> V0 A0 [V1 A1 …] <|audio_eos|>
    <|vision_eos|>`.

    Layout and positions are those of transformers for one video with `use_audio_in_video=True`
    (`positions.audio_in_video_positions`): both bos at offset 0, video and audio from base 1, chunks of 50 temporal
    units interleaved, both eos at (max of the last chunk) + 1. A 2 s unit at 2 fps (grid t = 2, second_per_grid 1.0)
    is `bos bos V(t=0) V(t=25) A×50 eos eos`: bos at 0, video t at 1 and 26, audio 1..50, eos at 51, and the
    cursor advances by 52.

    Args:
        video_grid_thw: `(t, h, w)` of the unit's frames in patches.
        num_audio_tokens: audio tokens of the unit (25 per second), at least 1.
        second_per_grid: seconds per temporal patch (temporal_patch_size / fps).
        unit: unit id.
        video_embeds, audio_embeds: `[n_video, D]`, `[n_audio, D]` features in encoder order.
        tokens: the checkpoint's special ids (`model.omni`); None: the release's.

    The cursor moves past the eos markers (`Chunk.advance`), exactly as transformers continues after the group,
    even when the last interleaved chunk is audio ending below an earlier video position.
    """
    seg = tmrope.audio_in_video_positions(video_grid_thw, num_audio_tokens, second_per_grid,
                                          spatial_merge_size=spatial_merge_size)
    t = token_ids_of(tokens)
    if t.video_token_id == t.audio_token_id:
        raise ValueError(f"the video and audio placeholders share id {t.video_token_id}")
    ids = _role_ids(t)[seg.roles]
    embeds, mask = adapters.place_embeds(
        ids, [(ids == t.video_token_id, video_embeds), (ids == t.audio_token_id, audio_embeds)], hidden_size)
    return adapters.make_chunk(ids, seg.positions, _ROLE_SPANS[seg.roles], unit, answer_tokens=answer_tokens,
                               embeds=embeds, embed_mask=mask, advance=seg.advance)


def with_embeds(chunk: Chunk, hidden_size: int, dtype: npt.DTypeLike = np.float32, *,
                tokens: OmniConfig | None = None) -> Chunk:
    """Adds zero embeddings `[B, T, hidden_size]` with the Qwen placeholder mask to a chunk built without them."""
    return adapters.with_embeds(chunk, hidden_size, token_ids_of(tokens).placeholder_ids, dtype)


def _text(token_ids, unit, kind, answer_tokens, answer_unit, hidden_size, t: OmniConfig, markers=True) -> Chunk:
    ids, span = adapters.text_spans(token_ids, kind, t, markers=markers)
    seg = tmrope.text_positions(ids.shape[0])
    embeds, mask = adapters.place_embeds(ids, [], hidden_size)
    return adapters.make_chunk(ids, seg.positions, span, unit, answer_tokens=answer_tokens, answer_unit=answer_unit,
                               embeds=embeds, embed_mask=mask)


def _marked(bos, placeholder, eos, kind, seg, unit, embeds, hidden_size, answer_tokens) -> Chunk:
    n = seg.positions.shape[1] - 2
    ids = np.concatenate([[bos], np.full(n, placeholder), [eos]]).astype(np.int64)
    span = np.concatenate([[SpanKind.BOUNDARY], np.full(n, int(kind)), [SpanKind.BOUNDARY]]).astype(np.int32)
    emb, mask = adapters.place_embeds(ids, [(ids == placeholder, embeds)], hidden_size)
    return adapters.make_chunk(ids, seg.positions, span, unit, answer_tokens=answer_tokens, embeds=emb,
                               embed_mask=mask)


__all__ = [
    "AUDIO", "AUDIO_BOS", "AUDIO_EOS", "BOUNDARY_TOKENS", "IMAGE", "IM_END", "IM_START", "PLACEHOLDER_TOKENS",
    "RELEASE", "VIDEO", "VISION_BOS", "VISION_EOS", "audio_unit", "audiovisual_unit", "concat", "image_unit",
    "response_unit", "system_unit", "text_unit", "token_layout", "video_unit", "with_embeds",
]
