"""Qwen2.5-Omni vision encoder (the Qwen2.5-VL ViT) in Flax NNX, its config and its checkpoint conversion table.

Pixel rows (`vision_preprocess`) -> patch embedding (a linear over each 1176-value row) -> `depth` pre-norm blocks
(RMSNorm, multi-head attention with 2D rotary positions, RMSNorm, SiLU-gated MLP with biases) -> patch merger
(RMSNorm, 2x2 patches concatenated, Linear -> GELU -> Linear) -> one `out_hidden_size` vector per 28x28 px.

Attention is block-diagonal. Blocks listed in `fullatt_block_indexes` attend within each frame (one temporal patch of
one image or video); the others within windows of `window_size` px (8x8 patches). Tokens are processed in window
order (windows of a frame row-major, tokens of a window row-major, the 2x2 patches of a merged token together), and
merged tokens are put back in raster order at the end. The host turns `grid_thw` into a `VisionPlan` of index arrays
(`vision_plan`): each attention kind gathers its segments into a padded `[segments, length]` batch and scatters the
result back through an inverse index, so one compiled program serves one grid shape.

The module carries only its config and parameters; blocks are stacked along a leading `layers` axis and run in one
`lax.scan`, the attention kind chosen per layer with `lax.cond` on a static flag array.

Parameter pytree (`nnx.to_pure_dict(nnx.state(encoder))`), shapes for L blocks, D hidden, I MLP width,
P = in_channels * temporal_patch_size * patch_size**2, E = spatial_merge_size**2 * D, O out_hidden_size:

    patch_embed  [P, D]
    layers:
      norm1 [L, D]        norm2 [L, D]
      q_proj [L, D, D]    q_bias [L, D]     (same for k_, v_)
      o_proj [L, D, D]    o_bias [L, D]
      gate_proj [L, D, I] gate_bias [L, I]  up_proj [L, D, I] up_bias [L, I]
      down_proj [L, I, D] down_bias [L, D]
    merger:
      norm [D]   fc1 [E, E]   fc1_bias [E]   fc2 [E, O]   fc2_bias [O]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from omnijax._checks import DTYPES, JsonConfig
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.errors import UnsupportedConfigError
from omnijax.kept_executables import cached_jit
from omnijax.kv import rope as rope_lib
from omnijax.models.encoders.common import (
    HF_GENERATION_CONFIG_ATTRIBUTES,
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    StackedLayers,
    dense,
    linear_rules,
    module_from_pure_dict,
    understood_attributes,
)
from omnijax.models.layers import new_param, rms_norm

NORM_EPS = 1e-6  # fixed in the reference implementation
ROPE_THETA = 10000.0


class VisionConfigError(ConfigAttributeError):
    """Inconsistent vision encoder settings. Attributes: `attribute`, `value`."""

    subject = "vision config"


class UnsupportedVisionConfigError(UnsupportedConfigError, ValueError):
    """A vision config attribute changes the math in a way this encoder does not implement."""


@dataclasses.dataclass(frozen=True)
class VisionConfig(JsonConfig):
    """Static hyperparameters of the Qwen2.5-VL vision encoder.

    Attributes:
        depth: transformer blocks L.
        hidden_size: width D.
        num_heads: attention heads; `hidden_size / num_heads` must be a multiple of 4 (2D rotary halves).
        intermediate_size: SiLU-gated MLP width I.
        out_hidden_size: merger output width O (the LLM's hidden size).
        patch_size: spatial patch side in px.
        spatial_merge_size: patches per merged token side.
        temporal_patch_size: frames per patch.
        window_size: attention window side in px, a multiple of `patch_size * spatial_merge_size`.
        fullatt_block_indexes: blocks attending over whole frames instead of windows.
        in_channels: colour channels.
        dtype: compute and parameter dtype name ("float32" or "bfloat16").
    """

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    in_channels: int = 3
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        if self.dtype not in DTYPES:
            raise VisionConfigError("dtype", self.dtype, f"must be one of {sorted(DTYPES)}")
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "window_size", "in_channels"):
            if int(getattr(self, name)) < 1:
                raise VisionConfigError(name, getattr(self, name), "must be a positive integer")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise VisionConfigError("num_heads", self.num_heads, f"hidden_size {self.hidden_size} must split into "
                                    "heads whose width is a multiple of 4")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise VisionConfigError("window_size", self.window_size, "must be a multiple of patch_size * "
                                    f"spatial_merge_size = {self.patch_size * self.spatial_merge_size}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise VisionConfigError("fullatt_block_indexes", list(self.fullatt_block_indexes),
                                    f"{bad} outside the {self.depth} blocks")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per pixel row: channels * temporal patch * patch**2 (1176)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged (LLM) token."""
        return self.spatial_merge_size ** 2

    @property
    def full_attention(self) -> tuple[bool, ...]:
        """Per block: attends over whole frames (True) or windows (False)."""
        return tuple(i in self.fullatt_block_indexes for i in range(self.depth))

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any], dtype: str = "float32") -> "VisionConfig":
        """Reads a Hugging Face `vision_config` (`Qwen2_5OmniVisionEncoderConfig` as a dict).

        Missing attributes take the Hugging Face class defaults. Attributes with no effect on the encoder's math
        (bookkeeping, generation settings, `tokens_per_second` which only feeds LLM positions, and `embed_dim`,
        `in_chans`, `spatial_patch_size`, which the reference implementation does not read) are ignored.

        Raises:
            UnsupportedVisionConfigError: `hidden_act` is not SiLU, or an attribute is not understood.
            VisionConfigError: the values are inconsistent.
        """
        v = understood_attributes(vision_config, _HF_DEFAULTS, _HF_HARMLESS, error=UnsupportedVisionConfigError,
                                  where="vision_config.", encoder="vision encoder")
        if v["hidden_act"] not in ("silu", "swish"):
            raise UnsupportedVisionConfigError("vision_config.hidden_act", v["hidden_act"],
                                               "only the SiLU-gated MLP is implemented")
        del v["hidden_act"]
        v["fullatt_block_indexes"] = tuple(v["fullatt_block_indexes"] or ())
        return cls(**v, dtype=dtype)


# Math-bearing attributes and the Hugging Face class defaults.
_HF_DEFAULTS = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16, in_channels=3,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                    fullatt_block_indexes=[7, 15, 23, 31])
# Attributes with no effect on the math: the generic ones, those the reference does not read, generation settings.
_HF_HARMLESS = HF_PRETRAINED_CONFIG_ATTRIBUTES | HF_GENERATION_CONFIG_ATTRIBUTES | frozenset("""
    tokens_per_second embed_dim in_chans spatial_patch_size
""".split())

QWEN2_5_OMNI_7B_VISION = VisionConfig(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                                      out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31))
QWEN2_5_OMNI_3B_VISION = QWEN2_5_OMNI_7B_VISION.replace(out_hidden_size=2048)


# ------------------------------------------------------------------------------------------------------ host plan


class VisionPlan(NamedTuple):
    """Host-built index arrays for one `grid_thw` (N patches, M = N / merge_unit merged tokens).

    Attributes:
        patch_order: `[N]` raster patch index of each window-order slot.
        positions: `[N, 2]` (row, column) rotary position of each window-order slot.
        window_segments, frame_segments: `[S, Lmax]` window-order slots of each attention segment, padded with N.
        window_inverse, frame_inverse: `[N]` flat `[S * Lmax]` position of each slot in its segment batch.
        reverse_index: `[M]` window-order merged token of each raster-order merged token.
    """

    patch_order: np.ndarray
    positions: np.ndarray
    window_segments: np.ndarray
    window_inverse: np.ndarray
    frame_segments: np.ndarray
    frame_inverse: np.ndarray
    reverse_index: np.ndarray


def _segments(lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous segments of the given lengths -> (padded `[S, Lmax]` indices, `[n]` inverse)."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.cumsum(lengths) - lengths
    width = int(lengths.max())
    j = np.arange(width)
    seg = np.where(j[None] < lengths[:, None], starts[:, None] + j[None], n)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    inverse = owner * width + (np.arange(n) - starts[owner])
    return seg.astype(np.int32), inverse.astype(np.int32)


def check_grid(grid_thw: npt.ArrayLike, config: VisionConfig) -> np.ndarray:
    """Validates `grid_thw` (`[n, 3]` patches per axis) and returns it as int64 `[n, 3]`."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"grid_thw must be a non-empty integer [n, 3] array, got {grid.dtype} {grid.shape}")
    m = config.spatial_merge_size
    if (grid < 1).any() or (grid[:, 1:] % m).any():
        raise ValueError(f"grid_thw rows must be positive with h and w multiples of {m}, got {grid.tolist()}")
    return grid.astype(np.int64)


def vision_plan(grid_thw: npt.ArrayLike, config: VisionConfig) -> VisionPlan:
    """Window order, rotary positions and attention segments for `grid_thw` (host side, numpy)."""
    grid = check_grid(grid_thw, config)
    m, u = config.spatial_merge_size, config.merge_unit
    win = config.window_size // (m * config.patch_size)  # merged tokens per window side
    order, window_lengths, frame_lengths, positions = [], [], [], []
    offset = 0
    for t, h, w in grid.tolist():
        lh, lw = h // m, w // m
        nh, nw = -(-lh // win), -(-lw // win)
        padded = np.full((t, nh * win, nw * win), -1, np.int64)
        padded[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw) + offset
        windows = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, win * win)
        lengths = (windows >= 0).sum(axis=1)
        order.append(windows[windows >= 0])
        window_lengths.append(lengths[lengths > 0] * u)
        frame_lengths += [h * w] * t
        rows = np.broadcast_to(np.arange(h)[:, None], (h, w))
        cols = np.broadcast_to(np.arange(w)[None, :], (h, w))
        blocked = [a.reshape(lh, m, lw, m).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)]
        positions.append(np.tile(np.stack(blocked, axis=-1), (t, 1)))
        offset += t * lh * lw
    window_index = np.concatenate(order)  # [M] raster merged token of each window-order merged token
    patch_order = (window_index[:, None] * u + np.arange(u)).reshape(-1)
    n = patch_order.size
    window_segments, window_inverse = _segments(np.concatenate(window_lengths), n)
    frame_segments, frame_inverse = _segments(np.asarray(frame_lengths), n)
    return VisionPlan(
        patch_order=patch_order.astype(np.int32),
        positions=np.concatenate(positions)[patch_order].astype(np.int32),
        window_segments=window_segments, window_inverse=window_inverse,
        frame_segments=frame_segments, frame_inverse=frame_inverse,
        reverse_index=np.argsort(window_index).astype(np.int32))


# --------------------------------------------------------------------------------------------------------- module


def _segment_attention(q, k, v, segments, inverse):
    """Attention within padded segments. q, k, v: `[N, H, d]`; segments `[S, Lmax]` (pad = N); inverse `[N]`."""
    n, heads, d = q.shape
    take = functools.partial(jnp.take, indices=segments, axis=0, mode="fill", fill_value=0)
    qs, ks, vs = take(q), take(k), take(v)  # [S, Lmax, H, d]
    scores = jnp.einsum("sqhd,skhd->shqk", qs, ks, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where((segments < n)[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("shqk,skhd->sqhd", probs, vs, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape(-1, heads, d)[inverse]  # [N, H, d]


class VisionLayers(StackedLayers):
    """All blocks' parameters, stacked along a leading `layers` axis."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        L, D, I, dt = config.depth, config.hidden_size, config.intermediate_size, config.jnp_dtype
        self.norm1 = new_param((L, D), dt, rngs, ones=True)
        self.norm2 = new_param((L, D), dt, rngs, ones=True)
        for name, (fan_in, fan_out) in (("q", (D, D)), ("k", (D, D)), ("v", (D, D)), ("o", (D, D)),
                                        ("gate", (D, I)), ("up", (D, I)), ("down", (I, D))):
            setattr(self, f"{name}_proj", new_param((L, fan_in, fan_out), dt, rngs))
            setattr(self, f"{name}_bias", new_param((L, fan_out), dt, rngs, zeros=True))


class VisionMerger(nnx.Module):
    """RMSNorm, 2x2 patch concatenation, Linear -> GELU -> Linear."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        D, O, dt = config.hidden_size, config.out_hidden_size, config.jnp_dtype
        E = config.merge_unit * D
        self.norm = new_param((D,), dt, rngs, ones=True)
        self.fc1 = new_param((E, E), dt, rngs)
        self.fc1_bias = new_param((E,), dt, rngs, zeros=True)
        self.fc2 = new_param((E, O), dt, rngs)
        self.fc2_bias = new_param((O,), dt, rngs, zeros=True)

    def __call__(self, h: jnp.ndarray, merge_unit: int) -> jnp.ndarray:
        dt = h.dtype
        x = rms_norm(h, self.norm[...], NORM_EPS).reshape(h.shape[0] // merge_unit, -1)  # [M, E]
        x = jax.nn.gelu(dense(x, self.fc1[...], self.fc1_bias[...], dt), approximate=False)
        return dense(x, self.fc2[...], self.fc2_bias[...], dt)  # [M, O]


class VisionEncoder(nnx.Module):
    """Qwen2.5-VL vision transformer with window attention and a 2x2 patch merger."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.patch_embed = new_param((config.patch_dim, config.hidden_size), config.jnp_dtype, rngs)
        self.layers = VisionLayers(config, rngs=rngs)
        self.merger = VisionMerger(config, rngs=rngs)

    def __call__(self, pixel_values: jnp.ndarray, plan: VisionPlan) -> jnp.ndarray:
        """`[N, P]` pixel rows (raster order, as preprocessed) -> `[N / merge_unit, O]` merged tokens (raster)."""
        c, dt = self.config, self.config.jnp_dtype
        n, heads, d = pixel_values.shape[0], c.num_heads, c.head_dim
        h = jnp.einsum("np,pd->nd", pixel_values.astype(dt), self.patch_embed[...],
                       preferred_element_type=jnp.float32).astype(dt)
        h = h[plan.patch_order]  # window order
        inv_freq = rope_lib.inverse_frequencies(d // 2, ROPE_THETA)  # [d / 4]
        pos = plan.positions.astype(jnp.float32)
        angles = jnp.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1)  # [N, d / 2]
        rot = rope_lib.rotation(angles)  # once for all blocks

        def attend_frames(q, k, v):
            return _segment_attention(q, k, v, plan.frame_segments, plan.frame_inverse)

        def attend_windows(q, k, v):
            return _segment_attention(q, k, v, plan.window_segments, plan.window_inverse)

        def block(h, xs):
            p, full = xs
            x = rms_norm(h, p["norm1"], NORM_EPS)
            q, k, v = (dense(x, p[f"{s}_proj"], p[f"{s}_bias"], dt).reshape(n, heads, d) for s in "qkv")
            q, k = rope_lib.rotate(q, rot), rope_lib.rotate(k, rot)
            attn = jax.lax.cond(full, attend_frames, attend_windows, q, k, v).reshape(n, heads * d)
            h = h + dense(attn, p["o_proj"], p["o_bias"], dt)
            x = rms_norm(h, p["norm2"], NORM_EPS)
            gate = jax.nn.silu(dense(x, p["gate_proj"], p["gate_bias"], dt))
            act = gate * dense(x, p["up_proj"], p["up_bias"], dt)
            return h + dense(act, p["down_proj"], p["down_bias"], dt), None

        flags = jnp.asarray(c.full_attention, jnp.bool_)
        h, _ = jax.lax.scan(block, h, (self.layers.stacked(), flags))
        return self.merger(h, c.merge_unit)[plan.reverse_index]


@cached_jit(static_argnames=("graphdef",))
def _encode(graphdef, params, pixel_values, plan):
    return nnx.merge(graphdef, params)(pixel_values, plan)


def encode_vision(encoder: VisionEncoder | tuple[Any, Any], pixel_values: npt.ArrayLike,
                  grid_thw: npt.ArrayLike) -> jnp.ndarray:
    """Encodes preprocessed images/videos (jitted once per grid shape).

    Args:
        encoder: a `VisionEncoder`, or its `(graphdef, params)` from `nnx.split`.
        pixel_values: `[N, P]` rows from `vision_preprocess` (all grid entries concatenated).
        grid_thw: `[n, 3]` patches per (time, height, width) of each entry; `N = sum(t * h * w)`.

    Returns:
        `[N / merge_unit, out_hidden_size]` tokens in the compute dtype, entries in order, raster order within each.
    """
    graphdef, params = nnx.split(encoder) if isinstance(encoder, VisionEncoder) else encoder
    config = encoder.config if isinstance(encoder, VisionEncoder) else nnx.merge(graphdef, params).config
    plan = vision_plan(grid_thw, config)
    pixel_values = jnp.asarray(pixel_values)
    if pixel_values.shape != (plan.patch_order.size, config.patch_dim):
        raise ValueError(f"pixel_values has shape {pixel_values.shape}, grid_thw implies "
                         f"{(plan.patch_order.size, config.patch_dim)}")
    return _encode(graphdef, params, pixel_values, plan)


def encoder_from_params(config: VisionConfig, params: Mapping[str, Any]) -> VisionEncoder:
    """A `VisionEncoder` holding `params` (a pure-dict tree, e.g. `convert_in_memory(...)["vision"]`).

    Leaves are cast to the config's dtype. Raises ValueError naming the first missing or mis-shaped leaf.
    """
    return module_from_pure_dict(lambda: VisionEncoder(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="vision parameter", missing_message="{what}s lack {name}")


# ---------------------------------------------------------------------------------------------------- name table

_B = "blocks.{i}."
VISION_RULES: tuple[Rule, ...] = (
    Rule("patch_embed.proj.weight", "patch_embed", "P D", transform="flatten_T", src_dims="D C Tp p p"),
    Rule(_B + "norm1.weight", "layers/norm1", "D"),
    Rule(_B + "norm2.weight", "layers/norm2", "D"),
    *(r for s, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "proj"))
      for r in linear_rules(_B + f"attn.{hf}", f"layers/{s}_proj", f"layers/{s}_bias", "D D")),
    *(r for s, dims in (("gate", "D I"), ("up", "D I"), ("down", "I D"))
      for r in linear_rules(_B + f"mlp.{s}_proj", f"layers/{s}_proj", f"layers/{s}_bias", dims)),
    Rule("merger.ln_q.weight", "merger/norm", "D"),
    *linear_rules("merger.mlp.0", "merger/fc1", "merger/fc1_bias", "E E"),
    *linear_rules("merger.mlp.2", "merger/fc2", "merger/fc2_bias", "E O"),
)
VISION_PREFIX = "visual."


def vision_component(config: VisionConfig) -> Component:
    """The vision tower's conversion table with its sizes (`Component.name` "vision", HF prefix "visual.")."""
    c = config
    dims = {"D": c.hidden_size, "I": c.intermediate_size, "E": c.merge_unit * c.hidden_size, "O": c.out_hidden_size,
            "P": c.patch_dim, "C": c.in_channels, "Tp": c.temporal_patch_size, "p": c.patch_size}
    return Component(name="vision", prefix=VISION_PREFIX, rules=VISION_RULES, dims=dims, num_layers=c.depth)
