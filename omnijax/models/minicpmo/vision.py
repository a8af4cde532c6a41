"""MiniCPM-o 4.5 vision path in Flax NNX: the SigLIP/NaViT encoder (`vpm`) and the perceiver resampler, their config,
their host-side plan and their checkpoint conversion tables.

Per image or slice (a strip of `rows x cols` patches from `image_preprocess`, padded to the batch's longest strip):

    vpm:       patch embedding (the 14x14 stride-14 convolution as a linear over `C * p * p` values + bias)
               + learned position embedding (a 70 x 70 table; NaViT bucketised ids, padded patches get id 0)
               -> `num_layers` pre-norm blocks (LayerNorm, multi-head attention over the strip's real patches,
                  LayerNorm, fc1 -> GELU (tanh) -> fc2) -> post LayerNorm
    resampler: keys/values = LayerNorm(kv_proj(x)); the 2D sin-cos position table of the patch grid (computed,
               not a weight) is added to the keys only; 64 learned queries (LayerNorm'ed) cross-attend through one
               packed-projection multi-head attention (padded patches masked) -> LayerNorm -> `@ proj`
               -> `[query_num, embed_dim]` (LLM width) per image or slice.

`drop_vision_last_layer` (true in every release) removes the encoder's last block at construction time, so the
encoder runs and the checkpoint holds `vision_config.num_hidden_layers - 1` blocks.

The host turns target sizes into a `VisionPlan` (patch mask, position ids, resampler key positions) with numpy,
reproducing the reference's float32 arithmetic (see `navit_position_ids`); the module carries only its config and
parameters; blocks are stacked along a leading `layers` axis and run in one `lax.scan`.

Parameter pytree (`nnx.to_pure_dict(nnx.state(model))`), shapes for L blocks, D SigLIP width, I its MLP width,
P = C * p * p, N = (image_size / p)**2, E = embed_dim, K = D, Q = query_num:

    vpm:
      patch_embed [P, D]   patch_bias [D]   pos_embed [N, D]
      layers:
        ln1_scale [L, D]  ln1_bias [L, D]  ln2_scale [L, D]  ln2_bias [L, D]
        q_proj [L, D, D]  q_bias [L, D]   (same for k_, v_, o_)
        fc1 [L, D, I]  fc1_bias [L, I]  fc2 [L, I, D]  fc2_bias [L, D]
      post_ln_scale [D]   post_ln_bias [D]
    resampler:
      query [Q, E]   kv_proj [K, E] (only when D != E)
      in_proj [E, 3E]   in_proj_bias [3E]   out_proj [E, E]   out_bias [E]
      ln_q_scale, ln_q_bias, ln_kv_scale, ln_kv_bias, ln_post_scale, ln_post_bias [E]
      proj [E, E]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.errors import ConfigError, UnsupportedConfigError
from convert.tables import Component, Rule, convert_in_memory
from omnijax.config import DTYPES, JsonConfig
from omnijax.models.common import new_param
from omnijax.models.minicpmo import image_preprocess

RESAMPLER_LN_EPS = 1e-6  # `partial(nn.LayerNorm, eps=1e-6)` in the reference resampler
RESAMPLER_HEAD_WIDTH = 128  # the reference builds the resampler with `num_heads = embed_dim // 128`
# Width of the CPU SIMD vector (float32 lanes) torch's `arange` kernel used when the reference computed NaViT
# position ids: 8 on AVX2 machines (the golden vectors' machine), 16 on AVX-512, 4 on NEON. See `torch_arange_f32`.
TORCH_ARANGE_VECTOR_WIDTH = 8


class VisionConfigError(ConfigError, ValueError):
    """Inconsistent vision settings. Attributes: `attribute`, `value`."""

    def __init__(self, attribute: str, value, reason: str):
        self.attribute, self.value = attribute, value
        super().__init__(f"MiniCPM-o vision config {attribute}={value!r}: {reason}")


class UnsupportedVisionConfigError(UnsupportedConfigError, ValueError):
    """A vision or resampler config attribute changes the math in a way this implementation does not cover."""


@dataclasses.dataclass(frozen=True)
class VisionConfig(JsonConfig):
    """Static hyperparameters of the MiniCPM-o vision path (SigLIP/NaViT encoder + resampler).

    Attributes:
        hidden_size: SigLIP width D.
        intermediate_size: SigLIP MLP width I.
        num_layers: encoder blocks actually run (after `drop_vision_last_layer`).
        num_heads: SigLIP attention heads.
        embed_dim: resampler width E (the LLM's hidden size).
        resampler_heads: resampler attention heads (`embed_dim // 128` in the releases).
        query_num: learned queries, i.e. LLM tokens per image or slice.
        patch_size: patch side p in px.
        image_size: side in px of the learned position table (`image_size // patch_size` positions per side).
        num_channels: colour channels C.
        layer_norm_eps: SigLIP LayerNorm epsilon (the resampler's is fixed at 1e-6).
        dtype: compute and parameter dtype name ("float32" or "bfloat16").
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    embed_dim: int
    resampler_heads: int
    query_num: int = 64
    patch_size: int = 14
    image_size: int = 980
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise VisionConfigError("dtype", self.dtype, f"must be one of {sorted(DTYPES)}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "embed_dim", "resampler_heads",
                     "query_num", "patch_size", "image_size", "num_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise VisionConfigError(name, value, "must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise VisionConfigError("num_heads", self.num_heads, f"does not divide hidden_size {self.hidden_size}")
        if self.embed_dim % self.resampler_heads:
            raise VisionConfigError("resampler_heads", self.resampler_heads,
                                    f"does not divide embed_dim {self.embed_dim}")
        if self.embed_dim % 4:
            raise VisionConfigError("embed_dim", self.embed_dim, "must be a multiple of 4 (2D sin-cos positions)")
        if self.image_size < self.patch_size:
            raise VisionConfigError("image_size", self.image_size, f"smaller than one patch ({self.patch_size} px)")
        if not self.layer_norm_eps > 0:
            raise VisionConfigError("layer_norm_eps", self.layer_norm_eps, "must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def resampler_head_dim(self) -> int:
        return self.embed_dim // self.resampler_heads

    @property
    def num_patches_per_side(self) -> int:
        """Side of the learned position table (70)."""
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.num_patches_per_side ** 2

    @property
    def patch_dim(self) -> int:
        """Values per patch row: C * p * p (588)."""
        return self.num_channels * self.patch_size ** 2

    @property
    def has_kv_proj(self) -> bool:
        """The resampler projects the encoder width to `embed_dim` (else `kv_proj` is the identity)."""
        return self.hidden_size != self.embed_dim

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], dtype: str = "float32") -> "VisionConfig":
        """Reads the vision fields of a MiniCPM-o `config.json` (the whole top-level dict).

        Uses `vision_config` (missing attributes take the release's SigLIP defaults), `drop_vision_last_layer`
        (default true), `query_num` (default 64) and `hidden_size` (the LLM width, required). Other top-level
        attributes belong to the LLM, the audio tower or the processor and are not read, except those known to
        change the vision path in later releases, which are refused.

        Raises:
            UnsupportedVisionConfigError: `hidden_act` is not `gelu_pytorch_tanh`, a `vision_config` attribute is not
                understood, or a top-level attribute selects a vision variant this module does not implement.
            VisionConfigError: a required value is missing or the values are inconsistent.
        """
        for key in _REFUSED_TOP_LEVEL:
            if key in hf_config:
                raise UnsupportedVisionConfigError(key, hf_config[key], "selects a vision variant (a ViT merger or "
                                                   "another downsampling) the MiniCPM-o 4.5 vision path lacks")
        vision = hf_config.get("vision_config") or {}
        if not isinstance(vision, Mapping):
            raise VisionConfigError("vision_config", vision, "must be a mapping")
        unknown = sorted(k for k in vision if k not in _VISION_DEFAULTS and k not in _HF_HARMLESS)
        if unknown:
            raise UnsupportedVisionConfigError(f"vision_config.{unknown[0]}", vision[unknown[0]],
                                               "not understood by the omnijax MiniCPM-o vision encoder (refusing to "
                                               f"guess its effect); unknown attributes: {unknown}")
        v = {**_VISION_DEFAULTS, **{k: x for k, x in vision.items() if k in _VISION_DEFAULTS}}
        if v["hidden_act"] != "gelu_pytorch_tanh":
            raise UnsupportedVisionConfigError("vision_config.hidden_act", v["hidden_act"],
                                               "only gelu_pytorch_tanh (the tanh-approximated GELU) is implemented")
        if "hidden_size" not in hf_config:
            raise VisionConfigError("hidden_size", None, "the LLM width (the resampler's output width) is required")
        drop = hf_config.get("drop_vision_last_layer", True)
        if not isinstance(drop, bool):
            raise VisionConfigError("drop_vision_last_layer", drop, "must be true or false")
        layers = int(v["num_hidden_layers"]) - int(drop)
        if layers < 1:
            raise VisionConfigError("vision_config.num_hidden_layers", v["num_hidden_layers"],
                                    f"leaves {layers} encoder layers with drop_vision_last_layer={drop}")
        embed_dim = int(hf_config["hidden_size"])
        if embed_dim < RESAMPLER_HEAD_WIDTH:
            raise VisionConfigError("hidden_size", embed_dim, f"gives 0 resampler heads "
                                    f"(num_heads = hidden_size // {RESAMPLER_HEAD_WIDTH})")
        return cls(hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
                   num_layers=layers, num_heads=int(v["num_attention_heads"]), embed_dim=embed_dim,
                   resampler_heads=embed_dim // RESAMPLER_HEAD_WIDTH, query_num=int(hf_config.get("query_num", 64)),
                   patch_size=int(v["patch_size"]), image_size=int(v["image_size"]),
                   num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]), dtype=dtype)


# Math-bearing `vision_config` attributes and the defaults the release's MiniCPMOConfig gives them (SigLIP-400M
# sizes; activation, eps and channels from SiglipVisionConfig).
_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                        patch_size=14, image_size=980, num_channels=3, layer_norm_eps=1e-6,
                        hidden_act="gelu_pytorch_tanh")
# Attributes with no effect on inference (dropout is off in eval; attention kernels compute the same math).
_HF_HARMLESS = frozenset("""
    model_type transformers_version architectures _name_or_path dtype torch_dtype initializer_range init_std
    attention_dropout dropout return_dict output_hidden_states output_attentions torchscript use_bfloat16
    tf_legacy_loss chunk_size_feed_forward is_encoder_decoder is_decoder add_cross_attention
    cross_attention_hidden_size tie_encoder_decoder tie_word_embeddings pruned_heads id2label label2id num_labels
    problem_type finetuning_task tokenizer_class prefix task_specific_params bos_token_id eos_token_id pad_token_id
    sep_token_id decoder_start_token_id _attn_implementation _attn_implementation_autoset
    _attn_implementation_internal
""".split())
# Top-level attributes of later MiniCPM-V/o releases that change the vision path (ViT-inserted merger, ...).
_REFUSED_TOP_LEVEL = ("vision_model_type", "insert_layer_id")

# Release sizes: MiniCPM-o 4.5 = SigLIP-400M (27 layers configured, the last dropped) + resampler into Qwen3-8B.
MINICPM_O_4_5_VISION = VisionConfig(hidden_size=1152, intermediate_size=4304, num_layers=26, num_heads=16,
                                    embed_dim=4096, resampler_heads=32)


# ------------------------------------------------------------------------------------------------------ host plan


def torch_arange_f32(start: float, end: float, step: float,
                     vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> np.ndarray:
    """`torch.arange(start, end, step)` with a float32 result, element for element as torch's CPU kernel writes it.

    The length is `ceil((end - start) / step)` in double. Element `i` is `float(start + step * i)` computed in
    double, except inside the kernel's vectorised main loop (blocks of `2 * vector_width` elements), where each
    vector of `vector_width` lanes starting at `b` holds `float(double(float(start + step * b)) + k * step)`. The
    two differ by one float32 ulp now and then, which decides a bucket when a coordinate sits on a boundary.
    `vector_width = 0` gives the scalar path everywhere.
    """
    n = max(int(math.ceil((end - start) / step)), 0)
    out = (start + step * np.arange(n, dtype=np.float64)).astype(np.float32)
    if vector_width:
        vectorised = (n // (2 * vector_width)) * 2 * vector_width
        lanes = np.arange(vector_width, dtype=np.float64) * step
        for b in range(0, vectorised, vector_width):
            base = np.float64(np.float32(start + step * b))
            out[b:b + vector_width] = (base + lanes).astype(np.float32)
    return out


def navit_position_ids(tgt_sizes, num_patches_per_side: int, max_patches: int | None = None,
                       vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> np.ndarray:
    """SigLIP position id of every patch, `[n, max_patches]` int64 (padded patches get 0).

    For a `rows x cols` grid the fractional coordinates `arange(0, 1 - 1e-6, 1 / rows)` (step = the float32
    reciprocal) are bucketised (right=True) against the float32 boundaries `arange(1/S, 1, 1/S)`,
    `S = num_patches_per_side`, in float32 as the reference does; id = bucket_row * S + bucket_col (row-major).
    """
    sizes = np.asarray(tgt_sizes, np.int64)
    counts = sizes[:, 0] * sizes[:, 1]
    length = int(counts.max()) if max_patches is None else int(max_patches)
    S = int(num_patches_per_side)
    boundaries = torch_arange_f32(1 / S, 1.0, 1 / S, vector_width)
    ids = np.zeros((len(sizes), length), np.int64)

    def buckets(n: int) -> np.ndarray:
        step = float(np.float32(1) / np.float32(n))
        coords = torch_arange_f32(0.0, 1 - 1e-6, step, vector_width)
        return np.searchsorted(boundaries, coords, side="right")

    for i, (rows, cols) in enumerate(sizes.tolist()):
        ids[i, :rows * cols] = (buckets(rows)[:, None] * S + buckets(cols)[None, :]).reshape(-1)
    return ids


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """`[..., dim]` float32: `[sin(pos * w), cos(pos * w)]`, `w_i = 1 / 10000**(i / (dim / 2))`, numpy float32 math."""
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("hw,d->hwd", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=-1)


def sincos_2d(embed_dim: int, rows: int, cols: int) -> np.ndarray:
    """The resampler's key position table for a `rows x cols` grid, `[rows * cols, embed_dim]` float32 (row-major).

    Dims `[0, E/2)` encode the column, `[E/2, E)` the row, each as `[sin, cos]` halves (`get_2d_sincos_pos_embed`).
    """
    grid_w, grid_h = np.meshgrid(np.arange(cols, dtype=np.float32), np.arange(rows, dtype=np.float32))
    emb = np.concatenate([_sincos_1d(embed_dim // 2, grid_w), _sincos_1d(embed_dim // 2, grid_h)], axis=-1)
    return emb.reshape(rows * cols, embed_dim).astype(np.float32)


class VisionPlan(NamedTuple):
    """Host-built arrays for one batch of strips (n strips padded to L patches).

    Attributes:
        patch_mask: `[n, L]` bool, True for real patches.
        position_ids: `[n, L]` int32 rows of the learned position table (0 on padding).
        key_pos: `[n, L, embed_dim]` float32 resampler key positions (0 on padding).
    """

    patch_mask: np.ndarray
    position_ids: np.ndarray
    key_pos: np.ndarray


def vision_plan(tgt_sizes, config: VisionConfig, max_patches: int | None = None,
                vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> VisionPlan:
    """Patch mask, NaViT position ids and resampler key positions for `tgt_sizes` (`[n, 2]` rows, cols)."""
    sizes = np.asarray(tgt_sizes)
    if sizes.ndim != 2 or sizes.shape[1] != 2 or sizes.shape[0] == 0 or not np.issubdtype(sizes.dtype, np.integer):
        raise ValueError(f"tgt_sizes must be a non-empty integer [n, 2] array, got {sizes.dtype} {sizes.shape}")
    if (sizes < 1).any():
        raise ValueError(f"tgt_sizes must be positive, got {sizes.tolist()}")
    mask = image_preprocess.patch_attention_mask(sizes, max_patches)[:, 0]
    length = mask.shape[1]
    ids = navit_position_ids(sizes, config.num_patches_per_side, length, vector_width)
    key_pos = np.zeros((len(sizes), length, config.embed_dim), np.float32)
    for i, (rows, cols) in enumerate(sizes.tolist()):
        key_pos[i, :rows * cols] = sincos_2d(config.embed_dim, rows, cols)
    return VisionPlan(patch_mask=mask, position_ids=ids.astype(np.int32), key_pos=key_pos)


# --------------------------------------------------------------------------------------------------------- module


def layer_norm(x: jnp.ndarray, scale: jnp.ndarray, bias: jnp.ndarray, eps: float) -> jnp.ndarray:
    """LayerNorm over the last axis with float32 statistics, cast back to `x.dtype`."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _linear(x: jnp.ndarray, w: jnp.ndarray, b: jnp.ndarray | None, dtype) -> jnp.ndarray:
    """`x @ w (+ b)` accumulated in float32, returned in `dtype`."""
    out = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        out = out + b.astype(jnp.float32)
    return out.astype(dtype)


def _attention(q, k, v, key_mask, scale_first: bool):
    """Multi-head attention. q `[B, Lq, H, d]`, k/v `[B, Lk, H, d]`, key_mask `[B, Lk]` -> `[B, Lq, H * d]`.

    `scale_first` scales the queries before the product (torch's `multi_head_attention_forward`); otherwise the
    scores after it (SigLIP's eager attention).
    """
    d = q.shape[-1]
    scale = d ** -0.5
    if scale_first:
        q = q * jnp.asarray(scale, q.dtype)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if not scale_first:
        scores = scores * scale
    scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(v.dtype)
    return out.reshape(*out.shape[:2], -1)


class SiglipLayers(nnx.Module):
    """All encoder blocks' parameters, stacked along a leading `layers` axis."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        L, D, I, dt = config.num_layers, config.hidden_size, config.intermediate_size, config.jnp_dtype
        for name in ("ln1", "ln2"):
            setattr(self, f"{name}_scale", new_param((L, D), dt, rngs, ones=True))
            setattr(self, f"{name}_bias", new_param((L, D), dt, rngs, zeros=True))
        for name, (fan_in, fan_out) in (("q", (D, D)), ("k", (D, D)), ("v", (D, D)), ("o", (D, D))):
            setattr(self, f"{name}_proj", new_param((L, fan_in, fan_out), dt, rngs))
            setattr(self, f"{name}_bias", new_param((L, fan_out), dt, rngs, zeros=True))
        self.fc1 = new_param((L, D, I), dt, rngs)
        self.fc1_bias = new_param((L, I), dt, rngs, zeros=True)
        self.fc2 = new_param((L, I, D), dt, rngs)
        self.fc2_bias = new_param((L, D), dt, rngs, zeros=True)

    def stacked(self) -> dict[str, jnp.ndarray]:
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}


class SiglipEncoder(nnx.Module):
    """SigLIP/NaViT vision transformer (`vpm`): variable-size strips, bucketised learned positions."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        D, dt = config.hidden_size, config.jnp_dtype
        self.patch_embed = new_param((config.patch_dim, D), dt, rngs)
        self.patch_bias = new_param((D,), dt, rngs, zeros=True)
        self.pos_embed = new_param((config.num_positions, D), dt, rngs)
        self.layers = SiglipLayers(config, rngs=rngs)
        self.post_ln_scale = new_param((D,), dt, rngs, ones=True)
        self.post_ln_bias = new_param((D,), dt, rngs, zeros=True)

    def __call__(self, config: VisionConfig, patches: jnp.ndarray, position_ids: jnp.ndarray,
                 patch_mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """`[B, L, P]` patch rows -> (embeddings `[B, L, D]`, per-layer outputs `[layers, B, L, D]`,
        post-LayerNorm output `[B, L, D]`). Padded patches are computed but never attended to."""
        dt, eps = config.jnp_dtype, config.layer_norm_eps
        B, L = patches.shape[:2]
        heads, d = config.num_heads, config.head_dim
        h = _linear(patches.astype(dt), self.patch_embed[...], self.patch_bias[...], dt)
        h = h + jnp.take(self.pos_embed[...], position_ids, axis=0)
        embeddings = h

        def block(h, p):
            x = layer_norm(h, p["ln1_scale"], p["ln1_bias"], eps)
            q, k, v = (_linear(x, p[f"{s}_proj"], p[f"{s}_bias"], dt).reshape(B, L, heads, d) for s in "qkv")
            h = h + _linear(_attention(q, k, v, patch_mask, scale_first=False), p["o_proj"], p["o_bias"], dt)
            x = layer_norm(h, p["ln2_scale"], p["ln2_bias"], eps)
            x = jax.nn.gelu(_linear(x, p["fc1"], p["fc1_bias"], dt), approximate=True)
            h = h + _linear(x, p["fc2"], p["fc2_bias"], dt)
            return h, h

        h, layer_outputs = jax.lax.scan(block, h, self.layers.stacked())
        return embeddings, layer_outputs, layer_norm(h, self.post_ln_scale[...], self.post_ln_bias[...], eps)


class Resampler(nnx.Module):
    """Perceiver resampler: `query_num` learned queries cross-attend over one strip's encoder output."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        E, dt = config.embed_dim, config.jnp_dtype
        self.query = new_param((config.query_num, E), dt, rngs)
        if config.has_kv_proj:
            self.kv_proj = new_param((config.hidden_size, E), dt, rngs)
        self.in_proj = new_param((E, 3 * E), dt, rngs)
        self.in_proj_bias = new_param((3 * E,), dt, rngs, zeros=True)
        self.out_proj = new_param((E, E), dt, rngs)
        self.out_bias = new_param((E,), dt, rngs, zeros=True)
        for name in ("ln_q", "ln_kv", "ln_post"):
            setattr(self, f"{name}_scale", new_param((E,), dt, rngs, ones=True))
            setattr(self, f"{name}_bias", new_param((E,), dt, rngs, zeros=True))
        self.proj = new_param((E, E), dt, rngs, std=E ** -0.5)

    def __call__(self, config: VisionConfig, x: jnp.ndarray, key_pos: jnp.ndarray,
                 patch_mask: jnp.ndarray) -> jnp.ndarray:
        """`[B, L, D]` encoder output -> `[B, query_num, embed_dim]`."""
        dt, eps, E = config.jnp_dtype, RESAMPLER_LN_EPS, config.embed_dim
        B, L = x.shape[:2]
        heads, d = config.resampler_heads, config.resampler_head_dim
        if config.has_kv_proj:
            x = _linear(x, self.kv_proj[...], None, dt)
        x = layer_norm(x, self.ln_kv_scale[...], self.ln_kv_bias[...], eps)
        q = layer_norm(self.query[...], self.ln_q_scale[...], self.ln_q_bias[...], eps)
        w, b = self.in_proj[...], self.in_proj_bias[...]
        q = _linear(q, w[:, :E], b[:E], dt)  # [Q, E], the same for every strip
        k = _linear(x + key_pos.astype(dt), w[:, E:2 * E], b[E:2 * E], dt)
        v = _linear(x, w[:, 2 * E:], b[2 * E:], dt)
        q = jnp.broadcast_to(q.reshape(1, -1, heads, d), (B, q.shape[0], heads, d))
        out = _attention(q, k.reshape(B, L, heads, d), v.reshape(B, L, heads, d), patch_mask, scale_first=True)
        out = _linear(out, self.out_proj[...], self.out_bias[...], dt)
        out = layer_norm(out, self.ln_post_scale[...], self.ln_post_bias[...], eps)
        return _linear(out, self.proj[...], None, dt)


class MiniCPMVision(nnx.Module):
    """The MiniCPM-o vision path: SigLIP/NaViT encoder (`vpm`) + resampler."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.vpm = SiglipEncoder(config, rngs=rngs)
        self.resampler = Resampler(config, rngs=rngs)

    def __call__(self, patches: jnp.ndarray, plan: VisionPlan, *,
                 return_intermediates: bool = False) -> jnp.ndarray | dict[str, jnp.ndarray]:
        """`[B, L, P]` patch rows (`image_preprocess.patch_rows`) -> `[B, query_num, embed_dim]` embeddings.

        With `return_intermediates`, a dict with `embeddings` `[B, L, D]`, `layer_outputs` `[layers, B, L, D]`,
        `last_hidden_state` `[B, L, D]` (after post LayerNorm) and `resampler_out` `[B, Q, E]`.
        """
        c = self.config
        mask = jnp.asarray(plan.patch_mask, jnp.bool_)
        embeddings, layer_outputs, last = self.vpm(c, patches, jnp.asarray(plan.position_ids), mask)
        out = self.resampler(c, last, jnp.asarray(plan.key_pos), mask)
        if return_intermediates:
            return dict(embeddings=embeddings, layer_outputs=layer_outputs, last_hidden_state=last,
                        resampler_out=out)
        return out


@functools.partial(jax.jit, static_argnames=("graphdef", "return_intermediates"))
def _encode(graphdef, params, patches, plan, return_intermediates):
    return nnx.merge(graphdef, params)(patches, plan, return_intermediates=return_intermediates)


def _split(model):
    if isinstance(model, MiniCPMVision):
        return nnx.split(model), model.config
    graphdef, params = model
    return (graphdef, params), nnx.merge(graphdef, params).config


def encode_images(model, pixel_values: Sequence[np.ndarray], tgt_sizes, *, max_patches: int | None = None,
                  return_intermediates: bool = False, vector_width: int = TORCH_ARANGE_VECTOR_WIDTH):
    """Encodes preprocessed strips (source images and slices) into LLM embeddings, as `get_vision_embedding`.

    Strips are padded to the longest one (or `max_patches`, to reuse one compiled program across batches); the
    result of a strip does not depend on the others. One program is compiled per `(n, L)` shape.

    Args:
        model: a `MiniCPMVision`, or its `(graphdef, params)` from `nnx.split`.
        pixel_values: `[C, p, n_i * p]` strips (`SlicedImage.pixel_values`, possibly of several images).
        tgt_sizes: `[n, 2]` patches per strip as (rows, cols).
        max_patches: pad length L (default: the longest strip).
        return_intermediates: also return the encoder's intermediate tensors (see `MiniCPMVision.__call__`).
        vector_width: see `torch_arange_f32`.

    Returns:
        `[n, query_num, embed_dim]` embeddings in the compute dtype (or the dict of intermediates).

    Raises:
        image_preprocess.PixelValuesError: strips and target sizes disagree.
    """
    (graphdef, params), config = _split(model)
    patches, _ = image_preprocess.patch_rows(pixel_values, tgt_sizes, max_patches, config.patch_size)
    if patches.shape[-1] != config.patch_dim:
        raise image_preprocess.PixelValuesError(f"patch rows have {patches.shape[-1]} values, the encoder expects "
                                                f"{config.patch_dim} ({config.num_channels} channels)")
    plan = vision_plan(tgt_sizes, config, patches.shape[1], vector_width)
    return _encode(graphdef, params, jnp.asarray(patches), plan, return_intermediates)


def encode_image(model, image, *, max_slice_nums: int = image_preprocess.MAX_SLICE_NUMS,
                 scale_resolution: int = image_preprocess.SCALE_RESOLUTION, never_split: bool = False
                 ) -> tuple[jnp.ndarray, image_preprocess.SlicedImage]:
    """One image -> (`[1 + slices, query_num, embed_dim]` embeddings, source first then slices row-major; the
    `SlicedImage` it was cut into, whose `grid` lays out the prompt's slice placeholders)."""
    config = _split(model)[1]
    sliced = image_preprocess.preprocess_image(image, max_slice_nums=max_slice_nums,
                                               scale_resolution=scale_resolution, patch_size=config.patch_size,
                                               never_split=never_split)
    return encode_images(model, sliced.pixel_values, sliced.tgt_sizes), sliced


# ---------------------------------------------------------------------------------------------------- name table

_L = "encoder.layers.{i}."
VPM_RULES: tuple[Rule, ...] = (
    Rule("embeddings.patch_embedding.weight", "patch_embed", "P D", transform="flatten_T", src_dims="D C p p"),
    Rule("embeddings.patch_embedding.bias", "patch_bias", "D"),
    Rule("embeddings.position_embedding.weight", "pos_embed", "N D"),
    Rule(_L + "layer_norm1.weight", "layers/ln1_scale", "D"),
    Rule(_L + "layer_norm1.bias", "layers/ln1_bias", "D"),
    Rule(_L + "layer_norm2.weight", "layers/ln2_scale", "D"),
    Rule(_L + "layer_norm2.bias", "layers/ln2_bias", "D"),
    *(r for s, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj"))
      for r in (Rule(_L + f"self_attn.{hf}.weight", f"layers/{s}_proj", "D D", transform="T"),
                Rule(_L + f"self_attn.{hf}.bias", f"layers/{s}_bias", "D"))),
    Rule(_L + "mlp.fc1.weight", "layers/fc1", "D I", transform="T"),
    Rule(_L + "mlp.fc1.bias", "layers/fc1_bias", "I"),
    Rule(_L + "mlp.fc2.weight", "layers/fc2", "I D", transform="T"),
    Rule(_L + "mlp.fc2.bias", "layers/fc2_bias", "D"),
    Rule("post_layernorm.weight", "post_ln_scale", "D"),
    Rule("post_layernorm.bias", "post_ln_bias", "D"),
)
VPM_PREFIX = "vpm."

RESAMPLER_RULES: tuple[Rule, ...] = (
    Rule("query", "query", "Q E"),
    Rule("kv_proj.weight", "kv_proj", "K E", transform="T", when="kv_proj"),
    Rule("attn.in_proj_weight", "in_proj", "E F", transform="T"),
    Rule("attn.in_proj_bias", "in_proj_bias", "F"),
    Rule("attn.out_proj.weight", "out_proj", "E E", transform="T"),
    Rule("attn.out_proj.bias", "out_bias", "E"),
    *(Rule(f"{ln}.{hf}", f"{ln}_{leaf}", "E") for ln in ("ln_q", "ln_kv", "ln_post")
      for hf, leaf in (("weight", "scale"), ("bias", "bias"))),
    Rule("proj", "proj", "E E"),
)
RESAMPLER_PREFIX = "resampler."


def vpm_component(config: VisionConfig) -> Component:
    """The SigLIP encoder's conversion table (`Component.name` "vpm", HF prefix "vpm.")."""
    c = config
    dims = {"D": c.hidden_size, "I": c.intermediate_size, "P": c.patch_dim, "C": c.num_channels,
            "p": c.patch_size, "N": c.num_positions}
    return Component(name="vpm", prefix=VPM_PREFIX, rules=VPM_RULES, dims=dims, num_layers=c.num_layers)


def resampler_component(config: VisionConfig) -> Component:
    """The resampler's conversion table (`Component.name` "resampler", HF prefix "resampler.")."""
    c = config
    dims = {"Q": c.query_num, "E": c.embed_dim, "F": 3 * c.embed_dim, "K": c.hidden_size}
    return Component(name="resampler", prefix=RESAMPLER_PREFIX, rules=RESAMPLER_RULES, dims=dims, num_layers=0,
                     flags={"kv_proj": c.has_kv_proj})


def vision_components(config: VisionConfig) -> tuple[Component, Component]:
    """Both conversion tables of the vision path: `(vpm_component, resampler_component)`."""
    return vpm_component(config), resampler_component(config)


# ------------------------------------------------------------------------------------------------------- loading


def vision_from_params(config: VisionConfig, params: Mapping[str, Any]) -> MiniCPMVision:
    """A `MiniCPMVision` holding `params` (`{"vpm": tree, "resampler": tree}`, e.g. from `convert_in_memory`).

    Leaves are cast to the config's dtype. Raises ValueError naming the first missing or mis-shaped leaf.
    """
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MiniCPMVision(config, rngs=nnx.Rngs(0))))

    def fetch(path, expected):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        node = params
        for key in path:
            key = getattr(key, "key", key)
            if not isinstance(node, Mapping) or key not in node:
                raise ValueError(f"MiniCPM-o vision parameters lack {name}")
            node = node[key]
        if tuple(np.shape(node)) != tuple(expected.shape):
            raise ValueError(f"MiniCPM-o vision parameter {name} has shape {tuple(np.shape(node))}, "
                             f"expected {expected.shape}")
        return jnp.asarray(node, config.jnp_dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fetch, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def vision_from_tensors(config: VisionConfig, tensors: Mapping[str, np.ndarray]) -> MiniCPMVision:
    """A `MiniCPMVision` from Hugging Face tensors named as in the release (`vpm.*`, `resampler.*`; other tensors,
    e.g. `llm.*`, `apm.*`, are ignored).

    Raises:
        convert.errors.MissingTensorError: a `vpm.*` or `resampler.*` tensor the config needs is absent (named).
        convert.errors.UnexpectedTensorError: a `vpm.*` / `resampler.*` tensor maps to no parameter.
        convert.errors.ShapeMismatchError: a tensor's shape disagrees with the config.
    """
    mine = {k: v for k, v in tensors.items() if k.startswith((VPM_PREFIX, RESAMPLER_PREFIX))}
    trees = convert_in_memory(mine, vision_components(config), np.float32, strip_prefix="")
    return vision_from_params(config, trees)


def _read_vision_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    if path.is_dir():
        single, index = path / "model.safetensors", path / "model.safetensors.index.json"
        if single.exists():
            files = [single]
        elif index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for k, f in weight_map.items() if k.startswith((VPM_PREFIX, RESAMPLER_PREFIX))})
        else:
            raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    else:
        files = [path]
    out = {}
    for file in files:
        with safe_open(os.fspath(file), framework="numpy") as f:
            for name in f.keys():
                if name.startswith((VPM_PREFIX, RESAMPLER_PREFIX)):
                    out[name] = f.get_tensor(name)
    return out


def load_vision(checkpoint: str | os.PathLike, config: VisionConfig | None = None, *,
                dtype: str = "float32") -> MiniCPMVision:
    """Loads the vision path of a MiniCPM-o checkpoint (a directory with `config.json` and `model.safetensors` or a
    sharded index, or one `.safetensors` file together with `config`), reading only `vpm.*` and `resampler.*`.

    Raises:
        convert.errors.MissingTensorError: tensors the config needs are absent (named), e.g. no `resampler.*`.
        UnsupportedVisionConfigError, VisionConfigError: see `VisionConfig.from_hf`.
    """
    path = Path(checkpoint)
    if config is None:
        config_path = (path if path.is_dir() else path.parent) / "config.json"
        config = VisionConfig.from_hf(json.loads(config_path.read_text()), dtype=dtype)
    return vision_from_tensors(config, _read_vision_tensors(path))
