"""Hugging Face-style Qwen3-Omni thinker inputs: encoder outputs on the placeholders, DeepStack levels, positions.

`Model(**hf_inputs)` on a Qwen3-Omni checkpoint takes what transformers' `Qwen3OmniMoeThinkerForConditionalGeneration`
takes (input_ids, attention_mask, input_features, feature_attention_mask, pixel_values, image_grid_thw,
pixel_values_videos, video_grid_thw, video_second_per_grid, use_audio_in_video). This module turns them into the
decoder's inputs:

- an embedding override for every placeholder token: audio, image and video encoder outputs in order of appearance
  (batch-major), as the reference's `masked_scatter` places them;
- the DeepStack side input `[n, B, T, D]`: level i of the vision encoder at every image or video token (each token
  its own modality's features, in order), zero elsewhere; the decoder adds level i after layer i;
- the `[3, B, T]` float positions of `positions.rope_index`, which equal the reference's `get_rope_index` (computed
  whenever grids are given; the reference computes them only when an attention mask is passed).

Audio clips are encoded one at a time (`audio.encode_audio`, windowed attention over `n_window_infer` frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from omnijax.models.qwen2_5_omni.thinker import ThinkerInputError, encoder_of, scatter_features
from omnijax.models.qwen3_omni import audio as audio_lib
from omnijax.models.qwen3_omni import positions as positions_lib
from omnijax.models.qwen3_omni import vision as vision_lib

if TYPE_CHECKING:
    from omnijax.models.model import Model

__all__ = ["ThinkerInputError", "multimodal_inputs", "rope_index"]


def _clip_lengths(feats: np.ndarray, feature_attention_mask) -> list[int]:
    if feature_attention_mask is None:
        return [feats.shape[2]] * feats.shape[0]
    mask = np.asarray(feature_attention_mask)
    if mask.shape != (feats.shape[0], feats.shape[2]):
        raise ThinkerInputError(f"feature_attention_mask must be [num_audios, frames] = "
                                f"{(feats.shape[0], feats.shape[2])}, got {mask.shape}")
    return [int(n) for n in mask.sum(axis=1)]


def multimodal_inputs(model: Model, input_ids: np.ndarray, *, input_features: np.ndarray | None = None,
                      feature_attention_mask: np.ndarray | None = None, pixel_values: np.ndarray | None = None,
                      image_grid_thw: np.ndarray | None = None, pixel_values_videos: np.ndarray | None = None,
                      video_grid_thw: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, list[int]]:
    """Encoder outputs scattered onto the placeholders, and the DeepStack levels.

    Returns:
        `(embeds [B, T, D] float32, embed_mask [B, T] bool, deepstack [n, B, T, D] float32 or None,
        audio_lengths)`: `audio_lengths` are the clips' mel-frame counts (they fix the audio positions).
    """
    ids_config: positions_lib.Qwen3OmniConfig = model.omni
    ids = np.asarray(input_ids)
    D = model.config.hidden_size
    embeds = np.zeros(ids.shape + (D,), np.float32)
    embed_mask = np.zeros(ids.shape, bool)
    deepstack = None
    audio_lengths: list[int] = []
    if input_features is not None:
        encoder = encoder_of(model, "audio")
        feats = np.asarray(input_features, np.float32)
        if feats.ndim != 3:
            raise ThinkerInputError(f"input_features must be [num_audios, mel_bins, frames], got {feats.shape}")
        audio_lengths = _clip_lengths(feats, feature_attention_mask)
        if min(audio_lengths) < 1:
            raise ThinkerInputError(f"audio clip {audio_lengths.index(min(audio_lengths))} has no frame "
                                    f"(feature_attention_mask sums to 0); it must hold at least one mel frame")
        out = np.concatenate([np.asarray(audio_lib.encode_audio(encoder, feats[i][:, :n]), np.float32)
                              for i, n in enumerate(audio_lengths)])
        scatter_features(embeds, embed_mask, ids == ids_config.audio_token_id, out, "audio")
    for kind, pixels, grid, token in (("image", pixel_values, image_grid_thw, ids_config.image_token_id),
                                      ("video", pixel_values_videos, video_grid_thw, ids_config.video_token_id)):
        if pixels is None:
            continue
        if grid is None:
            raise ThinkerInputError(f"{kind} pixels need their {kind}_grid_thw")
        out, levels = vision_lib.encode_vision(encoder_of(model, "vision"), np.asarray(pixels, np.float32),
                                               np.asarray(grid))
        where = ids == token
        scatter_features(embeds, embed_mask, where, np.asarray(out, np.float32), kind)
        if deepstack is None:
            deepstack = np.zeros((levels.shape[0],) + ids.shape + (D,), np.float32)
        deepstack[:, where] = np.asarray(levels, np.float32)
    return embeds, embed_mask, deepstack, audio_lengths


def rope_index(model: Model, input_ids: npt.ArrayLike, attention_mask: npt.ArrayLike | None, *,
               image_grid_thw: npt.ArrayLike | None = None, video_grid_thw: npt.ArrayLike | None = None,
               audio_lengths: Sequence[int] = (), second_per_grids: Sequence[float] = (),
               use_audio_in_video: bool = False) -> np.ndarray:
    """`[3, B, T]` float32 positions (`positions.rope_index` with the model's ids); layout errors become
    `ThinkerInputError`."""
    try:
        return positions_lib.rope_index(input_ids, attention_mask, model.omni, image_grid_thw=image_grid_thw,
                                        video_grid_thw=video_grid_thw, audio_seqlens=tuple(audio_lengths),
                                        second_per_grids=tuple(second_per_grids),
                                        use_audio_in_video=use_audio_in_video)
    except ThinkerInputError:
        raise
    except ValueError as e:
        raise ThinkerInputError(str(e)) from e
