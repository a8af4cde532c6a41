"""`Model`: a loaded checkpoint with a one-shot, Hugging Face-style forward; `load` reads a converted directory."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.config import DecoderConfig
from omnijax.kv import paged as paged_lib
from omnijax.models.decoder import Decoder
from omnijax.units import SpanKind

# Keyword inputs of the Hugging Face thinker that later versions accept (the encoders); refused here by name.
_MULTIMODAL_INPUTS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw",
                      "pixel_values_videos", "video_grid_thw", "video_second_per_grid", "use_audio_in_video")


def text_positions(attention_mask: np.ndarray, axes: int) -> np.ndarray:
    """Positions of a (possibly left-padded) text batch: `cumsum(mask) - 1`, padding at 1 (as `get_rope_index`)."""
    pos = np.cumsum(attention_mask, axis=-1) - 1
    pos = np.where(attention_mask == 0, 1, pos).astype(np.int32)
    return np.broadcast_to(pos[None], (axes,) + pos.shape).copy()


@functools.partial(jax.jit, static_argnames=("graphdef", "page_size"))
def _forward(graphdef, params, token_ids, valid, positions, *, page_size):
    from omnijax.stream import prefill  # local import: stream imports this module's siblings

    decoder = nnx.merge(graphdef, params)
    c = decoder.config
    B, T = token_ids.shape
    pages = -(-T // page_size)
    kv = paged_lib.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        num_pages=B * pages, page_size=page_size, batch=B, max_pages=pages,
                        position_axes=c.position_axes, dtype=c.jnp_dtype)
    zeros = jnp.zeros((B, T), jnp.int32)
    meta = paged_lib.SlotMeta(pos=positions, unit=zeros, span=zeros + int(SpanKind.TEXT), offset=zeros)
    x = decoder.embed_tokens(token_ids)
    _, hidden = prefill(decoder, kv, x, valid, positions, meta)
    return decoder.logits(hidden)


class UnsupportedInputError(ValueError):
    """An input the loaded model cannot take (e.g. multimodal features without the encoders)."""


class Model:
    """A decoder with its weights. `Model(input_ids=..., attention_mask=...)` returns `[B, T, V]` float32 logits."""

    def __init__(self, decoder: Decoder, *, model_type: str = "qwen2_5_omni", source: str | None = None,
                 audio=None, vision=None, omni=None):
        self.decoder = decoder
        self.model_type = model_type
        self.source = source
        self.audio = audio  # AudioEncoder or None
        self.vision = vision  # VisionEncoder or None
        self.omni = omni  # OmniConfig (placeholder ids, TMRoPE timing) or None

    @property
    def config(self) -> DecoderConfig:
        return self.decoder.config

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, *, page_size: int = 64, **kwargs):
        """One-shot forward over a batch of token ids.

        Args:
            input_ids: `[B, T]` token ids (numpy or jax).
            attention_mask: optional `[B, T]` 1 for tokens, 0 for padding (left or right).
            position_ids: optional `[3, B, T]` (or `[B, T]`) positions; default as the Hugging Face thinker computes
                for text.
            page_size: page size of the temporary cache.

        Returns:
            `[B, T, V]` float32 logits (rows of padding tokens are not meaningful).
        """
        given = sorted(k for k, v in kwargs.items() if v is not None)
        if given:
            multimodal = [k for k in given if k in _MULTIMODAL_INPUTS]
            other = [k for k in given if k not in _MULTIMODAL_INPUTS]
            if other:
                raise TypeError(f"Model() got unexpected keyword arguments {other}")
            raise UnsupportedInputError(f"multimodal inputs {multimodal} need the audio/vision encoders, "
                                        "which this version does not include")
        if input_ids is None:
            raise ValueError("input_ids is required")
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got range "
                             f"[{ids.min()}, {ids.max()}]")
        mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask).astype(np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        axes = self.config.position_axes
        if position_ids is None:
            positions = text_positions(mask, axes)
        else:
            positions = np.asarray(position_ids).astype(np.int32)
            if positions.ndim == 2:
                positions = np.broadcast_to(positions[None], (axes,) + positions.shape)
            if positions.shape != (axes,) + ids.shape:
                raise ValueError(f"position_ids must be [{axes}, B, T] = {(axes,) + ids.shape}, "
                                 f"got {positions.shape}")
        graphdef, params = nnx.split(self.decoder)
        return _forward(graphdef, params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask.astype(bool)),
                        jnp.asarray(positions), page_size=page_size)


def _restore(directory: Path, component: str, stored_config, dtype: str | None, build):
    """Restores one module: `build(config)` defines it; weights are read in the stored dtype, then cast."""
    from omnijax import checkpoint

    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(stored_config)))
    restored = checkpoint.load_params(directory, nnx.to_pure_dict(state), component)
    if dtype is not None and dtype != stored_config.dtype:
        config = stored_config.replace(dtype=dtype)
        restored = jax.tree.map(lambda a: a.astype(config.jnp_dtype), restored)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build(config)))
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def load(directory: str | Path, *, dtype: str | None = None) -> Model:
    """Loads a directory written by `omnijax-convert` into a `Model` (with its encoders when converted).

    Args:
        directory: the converted checkpoint (holding `omnijax.json` and `params/`).
        dtype: optional compute dtype override ("float32" or "bfloat16"); weights are cast on load.
    """
    from omnijax import checkpoint
    from omnijax.models.qwen2_5_omni import audio as audio_lib
    from omnijax.models.qwen2_5_omni.config import OmniConfig

    directory = Path(directory)
    model_type, config = checkpoint.read_manifest(directory)
    manifest = checkpoint.read_manifest_dict(directory)
    decoder = _restore(directory, checkpoint.PARAMS_DIR, config, dtype,
                       lambda c: Decoder(c, rngs=nnx.Rngs(0)))
    encoders = {}
    try:
        if "audio" in manifest:
            encoders["audio"] = _restore(directory, "audio", audio_lib.AudioConfig.from_json(manifest["audio"]), dtype,
                                         lambda c: audio_lib.AudioEncoder(c, rngs=nnx.Rngs(0)))
        omni = OmniConfig.from_json(manifest["omni"]) if "omni" in manifest else None
    except (TypeError, ValueError) as e:
        raise checkpoint.CheckpointFormatError(f"{directory / checkpoint.MANIFEST}: {e}") from e
    return Model(decoder, model_type=model_type, source=str(directory), omni=omni, **encoders)
