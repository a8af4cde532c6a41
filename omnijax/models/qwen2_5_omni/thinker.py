"""Hugging Face-style thinker inputs: encoder embeddings for the placeholders and whole-sequence TMRoPE positions.

`Model(**hf_inputs)` accepts what the Hugging Face thinker takes (input_ids, attention_mask, input_features,
feature_attention_mask, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, video_second_per_grid,
use_audio_in_video). This module turns them into the decoder's inputs: an embedding override for every placeholder
token (encoder outputs in order of appearance) and the 3-axis positions of the whole sequence, assembled from the
same per-segment TMRoPE functions the streaming adapters use, so one-shot and streamed positions cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from omnijax.models.encoders import whisper as audio_lib
from omnijax.models.qwen2_5_omni import positions as tmrope
from omnijax.models.qwen2_5_omni import vision as vision_lib
from omnijax.models.qwen2_5_omni.config import OmniConfig

if TYPE_CHECKING:
    from omnijax.models.model import Model


class ThinkerInputError(ValueError):
    """Multimodal inputs that do not fit together (placeholder counts, missing grids or encoders)."""


def rope_index(input_ids: np.ndarray, attention_mask: np.ndarray, omni: OmniConfig, *,
               image_grid_thw: np.ndarray | None = None, video_grid_thw: np.ndarray | None = None,
               audio_lengths: Sequence[int] = (),
               second_per_grids: Sequence[float] = (), use_audio_in_video: bool = False,
               spatial_merge_size: int = 2) -> np.ndarray:
    """`[3, B, T]` positions of a batch, as `get_rope_index` assigns them.

    Args:
        input_ids: `[B, T]` ids with placeholders expanded (one per encoder output token).
        attention_mask: `[B, T]`, 0 for padding (padding gets position 1, as in transformers).
        omni: placeholder ids and TMRoPE timing.
        image_grid_thw, video_grid_thw: `[n, 3]` patch grids, in order of appearance over the batch.
        audio_lengths: mel frames of each audio clip, in order (they fix the audio token counts).
        second_per_grids: seconds per temporal patch of each video.
        use_audio_in_video: videos carry their audio interleaved (`<|vision_bos|><|audio_bos|> V A … `).
        spatial_merge_size: the vision merger's size.
    """
    ids = np.asarray(input_ids)
    mask = np.asarray(attention_mask).astype(bool)
    B, T = ids.shape
    out = np.ones((3, B, T), np.int32)
    if image_grid_thw is None and video_grid_thw is None:  # transformers' text path, audio included
        pos = np.where(mask, np.cumsum(mask, axis=1) - 1, 1).astype(np.int32)
        return np.broadcast_to(pos, (3, B, T)).copy()
    images = [tuple(int(v) for v in g) for g in (image_grid_thw if image_grid_thw is not None else [])]
    videos = [tuple(int(v) for v in g) for g in (video_grid_thw if video_grid_thw is not None else [])]
    audios = [int(n) for n in audio_lengths]
    spgs = [float(s) for s in second_per_grids] or [1.0] * len(videos)
    counters = {"image": 0, "video": 0, "audio": 0}
    merge = dict(spatial_merge_size=spatial_merge_size, position_id_per_seconds=omni.position_id_per_seconds)

    def take(kind, items):
        i = counters[kind]
        if i >= len(items):
            raise ThinkerInputError(f"input_ids hold more {kind} placeholder groups than {kind} inputs ({len(items)})")
        counters[kind] += 1
        return items[i]

    for b in range(B):
        row = ids[b][mask[b]]
        segments, st = [], 0
        kinds = {omni.image_token_id: "image", omni.video_token_id: "video", omni.audio_token_id: "audio"}
        hits = np.flatnonzero(np.isin(row, list(kinds)))
        while True:
            hits = hits[hits >= st]
            if hits.size == 0:
                break
            ed = int(hits[0])
            kind = kinds[int(row[ed])]
            before = 2 if kind == "video" and use_audio_in_video else 1
            if ed - st - before > 0:
                segments.append(tmrope.text_positions(ed - st - before))
            if kind == "audio":
                seg = tmrope.audio_positions(tmrope.audio_token_count(take("audio", audios)))
            elif kind == "image":
                seg = tmrope.image_positions(take("image", images), **merge)
            elif not use_audio_in_video:
                i = counters["video"]
                seg = tmrope.video_positions(take("video", videos), spgs[i], **merge)
            else:
                i = counters["video"]
                grid = take("video", videos)
                seg = tmrope.audio_in_video_positions(
                    grid, tmrope.audio_token_count(take("audio", audios)), spgs[i],
                    seconds_per_chunk=omni.seconds_per_chunk, **merge)
            segments.append(seg)
            st = ed - before + seg.positions.shape[1]
        if st < row.shape[0]:
            segments.append(tmrope.text_positions(row.shape[0] - st))
        pos, _ = tmrope.place(segments)
        if pos.shape[1] != row.shape[0]:
            raise ThinkerInputError(f"row {b}: the placeholder layout covers {pos.shape[1]} tokens, the row has "
                                    f"{row.shape[0]} (do placeholder counts match the grids and audio lengths?)")
        out[:, b, mask[b]] = pos
    return out


def multimodal_embeddings(model: Model, input_ids: np.ndarray, *, input_features: np.ndarray | None = None,
                          feature_attention_mask: np.ndarray | None = None, pixel_values: np.ndarray | None = None,
                          image_grid_thw: np.ndarray | None = None, pixel_values_videos: np.ndarray | None = None,
                          video_grid_thw: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Encoder outputs scattered onto the placeholder tokens.

    Returns:
        `(embeds [B, T, D] float32, embed_mask [B, T] bool, audio_lengths)`: rows of placeholder tokens hold the
        encoder outputs in order of appearance (batch-major), as transformers' `masked_scatter` places them.
    """
    omni: OmniConfig = model.omni or OmniConfig()
    ids = np.asarray(input_ids)
    D = model.config.hidden_size
    embeds = np.zeros(ids.shape + (D,), np.float32)
    embed_mask = np.zeros(ids.shape, bool)
    audio_lengths: list[int] = []
    groups: list[tuple[str, int, Any]] = []
    if input_features is not None:
        encoder = encoder_of(model, "audio")
        feats = np.asarray(input_features, np.float32)
        if feats.ndim != 3:
            raise ThinkerInputError(f"input_features must be [num_audios, mel_bins, frames], got {feats.shape}")
        lengths = (np.asarray(feature_attention_mask).sum(axis=1).astype(int) if feature_attention_mask is not None
                   else np.full(feats.shape[0], feats.shape[2]))
        outs = [np.asarray(audio_lib.encode_audio(encoder, feats[i][:, :n]), np.float32)
                for i, n in enumerate(lengths)]
        audio_lengths = [int(n) for n in lengths]
        groups.append(("audio", omni.audio_token_id, np.concatenate(outs)))
    for kind, pixels, grid, token in (("image", pixel_values, image_grid_thw, omni.image_token_id),
                                      ("video", pixel_values_videos, video_grid_thw, omni.video_token_id)):
        if pixels is None:
            continue
        if grid is None:
            raise ThinkerInputError(f"{kind} pixels need their {kind}_grid_thw")
        out = vision_lib.encode_vision(encoder_of(model, "vision"), np.asarray(pixels, np.float32), np.asarray(grid))
        groups.append((kind, token, np.asarray(out, np.float32)))
    for kind, token, features in groups:
        scatter_features(embeds, embed_mask, ids == token, features, kind)
    return embeds, embed_mask, audio_lengths


def scatter_features(embeds: np.ndarray, embed_mask: np.ndarray, where: np.ndarray, features: np.ndarray,
                     kind: str) -> None:
    """Writes encoder `features [n, D]` onto the `n` placeholder tokens `where [B, T]` of `embeds [B, T, D]` in
    order (batch-major, as transformers' `masked_scatter`), marking them in `embed_mask`; refuses a count or width
    that does not fit."""
    if int(where.sum()) != features.shape[0]:
        raise ThinkerInputError(f"{kind} features and {kind} tokens do not match: {int(where.sum())} placeholder "
                                f"tokens, {features.shape[0]} encoder outputs")
    if features.shape[1] != embeds.shape[-1]:
        raise ThinkerInputError(f"{kind} encoder outputs are {features.shape[1]} wide, the decoder takes "
                                f"{embeds.shape[-1]}")
    embeds[where] = features
    embed_mask |= where


def encoder_of(model: Model, kind: str) -> Any:
    encoder = getattr(model, kind)
    if encoder is None:
        raise ThinkerInputError(f"this checkpoint has no {kind} encoder (convert a checkpoint that includes it)")
    return encoder
