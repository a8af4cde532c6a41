"""`Model`: a loaded checkpoint with a one-shot, Hugging Face-style forward; `load` reads a converted directory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from omnijax.checkpoint import format as checkpoint
from omnijax.models.decoder import SPLIT_LAYER_BACKENDS, Decoder
from omnijax.models.family import FamilyModel
from omnijax.models.forward import forward
from omnijax.models.layers import abstract_module
from omnijax.prefill import tidekv_prefill
from omnijax.prefill.layer_major import PrefillResult

if TYPE_CHECKING:

    from omnijax.models.qwen2_5_omni.config import OmniConfig
    from omnijax.models.qwen3_omni.positions import Qwen3OmniConfig
    from omnijax.models.tokenizer import Tokenizer
    from omnijax.prefill.selectors import Selector


def text_positions(attention_mask: np.ndarray, axes: int) -> np.ndarray:
    """Positions of a (possibly left-padded) text batch: `cumsum(mask) - 1`, padding at 1 (as `get_rope_index`)."""
    pos = np.cumsum(attention_mask, axis=-1) - 1
    pos = np.where(attention_mask == 0, 1, pos).astype(np.int32)
    return np.broadcast_to(pos[None], (axes,) + pos.shape).copy()


class UnsupportedInputError(ValueError):
    """An input the loaded model cannot take (e.g. multimodal features without the encoders)."""


class Model(FamilyModel):
    """A decoder with its weights. `Model(input_ids=..., attention_mask=...)` returns `[B, T, V]` float32 logits."""

    def __init__(self, decoder: Decoder, *, model_type: str = "qwen2_5_omni", source: str | None = None,
                 audio: Any = None, vision: Any = None, omni: OmniConfig | Qwen3OmniConfig | None = None,
                 tokenizer: Tokenizer | None = None):
        self.decoder = decoder
        self.model_type = model_type
        self.source = source
        self.audio = audio  # AudioEncoder or None
        self.vision = vision  # VisionEncoder or None
        self.omni = omni  # OmniConfig / Qwen3OmniConfig (placeholder ids, position timing) or None
        self.tokenizer = tokenizer  # omnijax.models.tokenizer.Tokenizer or None (the model then takes token ids)

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, *, page_size: int = 64,
                 input_features=None, feature_attention_mask=None, pixel_values=None, image_grid_thw=None,
                 pixel_values_videos=None, video_grid_thw=None, video_second_per_grid=None,
                 use_audio_in_video: bool = False, **kwargs):
        """One-shot forward with the Hugging Face thinker's keyword inputs.

        Args:
            input_ids: `[B, T]` token ids (numpy or jax), multimodal placeholders expanded.
            attention_mask: optional `[B, T]` 1 for tokens, 0 for padding (left or right).
            position_ids: optional `[3, B, T]` (or `[B, T]`) positions; default as the Hugging Face thinker computes
                them (`get_rope_index`: TMRoPE when image or video grids are given, else consecutive).
            page_size: page size of the temporary cache.
            input_features, feature_attention_mask: `[num_audios, mel_bins, frames]` log-mel features and their
                valid-frame mask.
            pixel_values, image_grid_thw: image patch rows `[patches, 1176]` and grids `[num_images, 3]`.
            pixel_values_videos, video_grid_thw, video_second_per_grid: the same for videos, with seconds per
                temporal patch.
            use_audio_in_video: the videos' audio is interleaved with their frames.

        Returns:
            `[B, T, V]` float32 logits (rows of padding tokens are not meaningful).
        """
        ids, mask, embeds, embed_mask, positions, deepstack = self._prepare(
            input_ids, attention_mask, position_ids, input_features=input_features,
            feature_attention_mask=feature_attention_mask, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
            video_second_per_grid=video_second_per_grid, use_audio_in_video=use_audio_in_video, **kwargs)
        graphdef, params = nnx.split(self.decoder)
        return forward(graphdef, params, jnp.asarray(np.clip(ids, 0, self.config.vocab_size - 1), jnp.int32),
                        jnp.asarray(mask.astype(bool)), jnp.asarray(positions),
                        None if embeds is None else jnp.asarray(embeds), None if embed_mask is None else
                        jnp.asarray(embed_mask), None if deepstack is None else jnp.asarray(deepstack),
                        page_size=page_size)

    def _prepare(self, input_ids, attention_mask, position_ids, *, input_features=None, feature_attention_mask=None,
                 pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                 video_second_per_grid=None, use_audio_in_video: bool = False, **kwargs):
        """Validated numpy inputs of a forward: `(ids, mask, embeds | None, embed_mask | None, positions [A, B, T],
        deepstack [n, B, T, D] | None)` (multimodal features already encoded into `embeds` at `embed_mask`;
        positions int32, or float32 for Qwen3-Omni, whose temporal ids may be fractional)."""
        if kwargs:
            raise TypeError(f"Model() got unexpected keyword arguments {sorted(kwargs)}")
        if input_ids is None:
            raise ValueError("input_ids is required")
        ids = np.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        if ids.shape[1] == 0:
            raise ValueError(f"input_ids must hold at least one token per sequence, got shape {ids.shape}")
        mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError(f"attention_mask must hold only 0 and 1, got values {np.unique(mask)[:8].tolist()}")
        mask = mask.astype(np.int32)
        media = dict(input_features=input_features, feature_attention_mask=feature_attention_mask,
                     pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                     pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)
        embeds = embed_mask = deepstack = None
        audio_lengths: list[int] = []
        family = self.family
        if any(v is not None for v in media.values()):
            if self.omni is None or family.thinker_inputs is None:
                raise UnsupportedInputError(f"multimodal inputs need an omni thinker checkpoint with encoders; this "
                                            f"is a {self.model_type!r} model")
            embeds, embed_mask, deepstack, audio_lengths = family.thinker_inputs(self, ids, **media)
        text = mask.astype(bool) if embed_mask is None else mask.astype(bool) & ~embed_mask
        if text.any() and (ids[text].min() < 0 or ids[text].max() >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got range "
                             f"[{ids[text].min()}, {ids[text].max()}]")
        axes = self.config.position_axes
        grids = image_grid_thw is not None or video_grid_thw is not None
        spg = [] if video_second_per_grid is None else np.asarray(video_second_per_grid).reshape(-1).tolist()
        if position_ids is None and grids:
            if family.thinker_positions is None:
                raise UnsupportedInputError(f"image and video grids need an omni thinker; this is a "
                                            f"{self.model_type!r} model")
            positions = family.thinker_positions(
                self, ids, mask, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                audio_lengths=audio_lengths, second_per_grids=spg, use_audio_in_video=use_audio_in_video)
        elif position_ids is None:
            positions = text_positions(mask, axes)
        else:
            positions = np.asarray(position_ids)
            fractional = family.fractional_positions and positions.dtype.kind == "f"
            positions = positions.astype(np.float32 if fractional else np.int32)
            if positions.ndim == 2:
                positions = np.broadcast_to(positions[None], (axes,) + positions.shape)
            if positions.shape != (axes,) + ids.shape:
                raise ValueError(f"position_ids must be [{axes}, B, T] = {(axes,) + ids.shape}, "
                                 f"got {positions.shape}")
        return ids, mask, embeds, embed_mask, positions, deepstack

    def prefill(self, input_ids: npt.ArrayLike | None = None, attention_mask: npt.ArrayLike | None = None,
                position_ids: npt.ArrayLike | None = None, *, selector: Selector | None = None,
                budgets: int | Sequence[int] | None = None, chunk: int = 2048, page: int = 512, impl: str = "xla",
                room: int = 0, progress: bool = False, **media: Any) -> PrefillResult:
        """TideKV prefill of one prompt (layer-major, compression at each layer's end) with the same keyword inputs
        as `__call__`; returns an `omnijax.prefill.PrefillResult` whose cache decodes with
        `omnijax.prefill.decode_step` from the prompt's true next position. `budgets=None` compresses nothing.
        Padded batches are refused (every sequence must be a whole prompt).
        """
        ids, mask, embeds, embed_mask, positions, deepstack = self._prepare(input_ids, attention_mask, position_ids,
                                                                            **media)
        if not mask.all():
            raise ValueError("prefill takes unpadded prompts: attention_mask must be all ones")
        x = self.decoder.embed_tokens(jnp.asarray(np.clip(ids, 0, self.config.vocab_size - 1), jnp.int32))
        if embeds is not None:
            x = jnp.where(jnp.asarray(embed_mask)[..., None], jnp.asarray(embeds).astype(x.dtype), x)
        return tidekv_prefill(self.decoder, x, jnp.asarray(positions), selector=selector, budgets=budgets,
                              chunk=chunk, page=page, impl=impl, room=room, progress=progress,
                              deepstack=None if deepstack is None else jnp.asarray(deepstack))


def restore_module(directory: Path, component: str, stored_config: Any, dtype: str | None,
                   build: Callable[[Any], nnx.Module], quantization: dict | None = None) -> nnx.Module:
    """Restores one module: `build(config)` defines it; weights are read leaf by leaf, cast to `dtype` as they are
    read when it differs from the stored one. `quantization` (`checkpoint.read_quantization` of the manifest) names
    the parameters stored quantised: they are restored as `QuantizedWeight`s, and a `dtype` cast is refused.
    A `Decoder` restored on CPU stores its layers one array per layer (`Decoder.split_layers`: the decode step reads
    each layer's weights in place instead of copying them out of the stacks; the checkpoint keeps the stacks)."""

    graphdef, state = nnx.split(abstract_module(lambda: build(stored_config)))
    cast = dtype if dtype is not None and dtype != stored_config.dtype else None
    quantization = quantization or {}
    if quantization and cast is not None:
        raise ValueError(f"dtype={dtype!r}: {directory} holds quantised weights stored for compute in "
                         f"{stored_config.dtype}, and a dtype cast on load would recast their scales; convert the "
                         f"checkpoint again with --dtype {dtype} instead")
    # a cast happens leaf by leaf as the weights are read: one copy of them at a time
    abstract = checkpoint.quantized_abstract(nnx.to_pure_dict(state), quantization)
    restored = checkpoint.as_quantized(checkpoint.load_params(directory, abstract, component, dtype=cast),
                                       quantization)
    if cast is not None:
        graphdef, state = nnx.split(abstract_module(lambda: build(stored_config.replace(dtype=cast))))
    nnx.replace_by_pure_dict(state, restored)
    module = nnx.merge(graphdef, state)
    if isinstance(module, Decoder) and jax.default_backend() in SPLIT_LAYER_BACKENDS:
        del state, restored  # the module holds the only references: each stack is freed once it is cut
        module.split_layers()
    return module
