"""Qwen3-Omni vision encoder (the Qwen3-VL ViT with DeepStack mergers, the thinker's `visual`) in Flax NNX.

Pixel rows (`[N, C * Tp * p * p]`, patches in the processor's order: frame, 2x2 block row, block column, row and
column inside the block) -> patch embedding (the Conv3d as a linear with bias) + a learned `G x G` position table
bilinearly interpolated to each grid -> `depth` pre-LayerNorm blocks (attention with a fused qkv projection and 2D
rotary positions, MLP `fc1 -> GELU(tanh) -> fc2`) -> merger (LayerNorm, 2x2 patches concatenated, Linear -> GELU ->
Linear) -> one `out_hidden_size` vector per 2x2 patches (32x32 px). The hidden states after each block listed in
`deepstack_visual_indexes` go through their own mergers, which normalise after the concatenation; these DeepStack
features are added to the LLM's first hidden states.

Attention is block-diagonal per frame (one temporal patch of one image or video). The host turns `grid_thw` into a
`VisionPlan` of index arrays (`vision_plan`): the position-table rows and bilinear weights of each patch, its rotary
(row, column), and the frames as a padded `[frames, length]` batch with an inverse index, so one compiled program
serves one grid shape. Patches stay in the processor's order throughout: no reordering.

The module carries only its config and parameters; blocks are stacked along a leading `layers` axis and run in one
`lax.scan`, which also collects the hidden states of the DeepStack layers (`jnp.where` on a static slot array).

Parameter pytree (`nnx.to_pure_dict(nnx.state(encoder))`), shapes for L blocks, D hidden, I MLP width,
P = in_channels * temporal_patch_size * patch_size**2, G = num_position_embeddings, E = spatial_merge_size**2 * D,
O out_hidden_size, K DeepStack levels (in `deepstack_visual_indexes` order); Linear weights are stored `[in, out]`:

    patch_embed [P, D]   patch_bias [D]   pos_embed [G, D]
    layers:
      norm1_scale [L, D]  norm1_bias [L, D]   norm2_scale [L, D]  norm2_bias [L, D]
      qkv [L, D, 3D]      qkv_bias [L, 3D]    (columns: q, k, v; heads inside each)
      proj [L, D, D]      proj_bias [L, D]
      fc1 [L, D, I]       fc1_bias [L, I]     fc2 [L, I, D]       fc2_bias [L, D]
    merger:
      norm_scale [D]  norm_bias [D]  fc1 [E, E]  fc1_bias [E]  fc2 [E, O]  fc2_bias [O]
    deepstack:
      norm_scale [K, E]  norm_bias [K, E]  fc1 [K, E, E]  fc1_bias [K, E]  fc2 [K, E, O]  fc2_bias [K, O]

Checkpoint names (below `thinker.visual.`) come in two conversion tables: `vision_component` (everything but the
DeepStack mergers) and `deepstack_component` (`merger_list.{i}.`, one "layer" per level, so they stack); join the
two converted trees with `vision_tree`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.kept_executables import cached_jit
from omnijax.kv import rope as rope_lib
from omnijax.models.encoders.common import (
    StackedLayers,
    dense,
    layer_norm,
    linear_rules,
    module_from_pure_dict,
    norm_rules,
)
from omnijax.models.layers import new_param
from omnijax.models.qwen3_omni.vision_config import (
    ACTIVATIONS,
    QWEN3_OMNI_30B_A3B_VISION,
    Qwen3VisionConfig,
    Qwen3VisionConfigError,
    UnsupportedVisionConfigError,
)

__all__ = ["DEEPSTACK_PREFIX", "DEEPSTACK_RULES", "QWEN3_OMNI_30B_A3B_VISION", "Qwen3VisionConfig",
           "Qwen3VisionConfigError", "Qwen3VisionEncoder", "UnsupportedVisionConfigError", "VISION_PREFIX",
           "VISION_RULES", "VisionPlan", "check_grid", "deepstack_component", "encode_vision", "encoder_from_params",
           "torch_linspace", "vision_component", "vision_components", "vision_plan", "vision_tree"]

NORM_EPS = 1e-6  # every LayerNorm of the reference
ROPE_THETA = 10000.0


# ------------------------------------------------------------------------------------------------------ host plan


class VisionPlan(NamedTuple):
    """Host-built index arrays for one `grid_thw` (N patches in the processor's order).

    Attributes:
        pos_index: `[4, N]` position-table rows of each patch's bilinear corners (floor/floor, floor/ceil,
            ceil/floor, ceil/ceil in (row, column)).
        pos_weight: `[4, N]` float32 bilinear weights of those rows.
        positions: `[N, 2]` (row, column) rotary position of each patch.
        frame_segments: `[S, Lmax]` patches of each frame, padded with N.
        frame_inverse: `[N]` flat `[S * Lmax]` position of each patch in the frame batch.
    """

    pos_index: np.ndarray
    pos_weight: np.ndarray
    positions: np.ndarray
    frame_segments: np.ndarray
    frame_inverse: np.ndarray


def torch_linspace(end: float, steps: int) -> np.ndarray:
    """`torch.linspace(0, end, steps)` in float32, bit for bit.

    torch computes `step = end / (steps - 1)` in float32, then the first half as `step * i` and the second as
    `end - step * (steps - 1 - i)`, each a fused multiply-add (one rounding; its CPU and CUDA kernels are compiled
    with FMA contraction). Here the products and differences are exact in float64 (they fit its 53 bits for
    `1 <= end < 2**10`, `steps < 2**20`) and rounded to float32 once.
    """
    if steps == 1:
        return np.zeros(1, np.float32)
    step = np.float64(np.float32(end) / np.float32(steps - 1))
    i = np.arange(steps)
    low = step * i
    high = np.float64(np.float32(end)) - step * (steps - 1 - i)
    return np.where(i < steps // 2, low, high).astype(np.float32)


def _block_order(a: np.ndarray, m: int) -> np.ndarray:
    """`[..., h, w]` raster -> `[..., h * w]` in the processor's patch order (2x2 blocks row-major, then inside)."""
    *lead, h, w = a.shape
    return a.reshape(*lead, h // m, m, w // m, m).swapaxes(-3, -2).reshape(*lead, h * w)


def _bilinear(h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and weights `[4, h, w]` that interpolate a `side x side` table to an `h x w` grid (corner-aligned)."""
    hs, ws = torch_linspace(side - 1, h), torch_linspace(side - 1, w)
    h0, w0 = hs.astype(np.int64), ws.astype(np.int64)  # truncation = floor (non-negative)
    h1, w1 = np.minimum(h0 + 1, side - 1), np.minimum(w0 + 1, side - 1)
    dh, dw = hs - h0.astype(np.float32), ws - w0.astype(np.float32)  # float32
    one = np.float32(1)
    index = [hh[:, None] * side + ww[None, :] for hh, ww in ((h0, w0), (h0, w1), (h1, w0), (h1, w1))]
    weight = [a[:, None] * b[None, :] for a, b in ((one - dh, one - dw), (one - dh, dw), (dh, one - dw), (dh, dw))]
    return np.stack(index), np.stack(weight).astype(np.float32)


def check_grid(grid_thw: npt.ArrayLike, config: Qwen3VisionConfig) -> np.ndarray:
    """Validates `grid_thw` (`[n, 3]` patches per axis) and returns it as int64 `[n, 3]`."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"grid_thw must be a non-empty integer [n, 3] array, got {grid.dtype} {grid.shape}")
    m = config.spatial_merge_size
    if (grid < 1).any() or (grid[:, 1:] % m).any():
        raise ValueError(f"grid_thw rows must be positive with h and w multiples of spatial_merge_size {m}, "
                         f"got {grid.tolist()}")
    return grid.astype(np.int64)


def vision_plan(grid_thw: npt.ArrayLike, config: Qwen3VisionConfig) -> VisionPlan:
    """Position-table interpolation, rotary positions and frame segments for `grid_thw` (host side, numpy)."""
    grid = check_grid(grid_thw, config)
    m, side = config.spatial_merge_size, config.grid_side
    index, weight, positions, sizes = [], [], [], []
    for t, h, w in grid.tolist():
        idx, wt = _bilinear(h, w, side)
        index.append(np.tile(_block_order(idx, m), (1, t)))
        weight.append(np.tile(_block_order(wt, m), (1, t)))
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        positions.append(np.tile(_block_order(np.stack([rows, cols]), m), (1, t)))
        sizes += [h * w] * t
    lengths = np.asarray(sizes, np.int64)
    n = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    j = np.arange(int(lengths.max()))
    segments = np.where(j[None] < lengths[:, None], starts[:, None] + j[None], n)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    inverse = owner * j.size + (np.arange(n) - starts[owner])
    return VisionPlan(pos_index=np.concatenate(index, axis=1).astype(np.int32),
                      pos_weight=np.concatenate(weight, axis=1).astype(np.float32),
                      positions=np.concatenate(positions, axis=1).T.astype(np.int32),
                      frame_segments=segments.astype(np.int32), frame_inverse=inverse.astype(np.int32))


# --------------------------------------------------------------------------------------------------------- module


def _frame_attention(q, k, v, segments, inverse):
    """Attention within each frame. q, k, v: `[N, H, d]`; segments `[S, Lmax]` (pad = N); inverse `[N]`."""
    n, heads, d = q.shape
    take = functools.partial(jnp.take, indices=segments, axis=0, mode="fill", fill_value=0)
    qs, ks, vs = take(q), take(k), take(v)  # [S, Lmax, H, d]
    scores = jnp.einsum("sqhd,skhd->shqk", qs, ks, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where((segments < n)[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("shqk,skhd->sqhd", probs, vs, preferred_element_type=jnp.float32).astype(q.dtype)
    return out.reshape(-1, heads, d)[inverse]  # [N, H, d]


def _merge(h: jnp.ndarray, p: Mapping[str, jnp.ndarray], merge_unit: int, *, post_norm: bool) -> jnp.ndarray:
    """Patch merger: `[N, D]` -> `[N / merge_unit, O]`; LayerNorm before (D) or after (E) the 2x2 concatenation."""
    dt = h.dtype
    if post_norm:
        x = layer_norm(h.reshape(h.shape[0] // merge_unit, -1), p["norm_scale"], p["norm_bias"], NORM_EPS)
    else:
        x = layer_norm(h, p["norm_scale"], p["norm_bias"], NORM_EPS).reshape(h.shape[0] // merge_unit, -1)
    x = jax.nn.gelu(dense(x, p["fc1"], p["fc1_bias"], dt), approximate=False)  # [M, E]
    return dense(x, p["fc2"], p["fc2_bias"], dt)  # [M, O]


class Qwen3VisionLayers(StackedLayers):
    """All blocks' parameters, stacked along a leading `layers` axis."""

    def __init__(self, config: Qwen3VisionConfig, *, rngs: nnx.Rngs):
        L, D, I, dt = config.depth, config.hidden_size, config.intermediate_size, config.jnp_dtype
        for norm in ("norm1", "norm2"):
            setattr(self, f"{norm}_scale", new_param((L, D), dt, rngs, ones=True))
            setattr(self, f"{norm}_bias", new_param((L, D), dt, rngs, zeros=True))
        for name, (fan_in, fan_out) in (("qkv", (D, 3 * D)), ("proj", (D, D)), ("fc1", (D, I)), ("fc2", (I, D))):
            setattr(self, name, new_param((L, fan_in, fan_out), dt, rngs))
            setattr(self, f"{name}_bias", new_param((L, fan_out), dt, rngs, zeros=True))


class Qwen3VisionMerger(StackedLayers):
    """A patch merger's parameters, with optional leading axes (`(K,)` for the stacked DeepStack mergers)."""

    def __init__(self, config: Qwen3VisionConfig, norm_width: int, lead: tuple[int, ...] = (), *, rngs: nnx.Rngs):
        E, O, dt = config.merged_dim, config.out_hidden_size, config.jnp_dtype
        self.norm_scale = new_param((*lead, norm_width), dt, rngs, ones=True)
        self.norm_bias = new_param((*lead, norm_width), dt, rngs, zeros=True)
        self.fc1 = new_param((*lead, E, E), dt, rngs)
        self.fc1_bias = new_param((*lead, E), dt, rngs, zeros=True)
        self.fc2 = new_param((*lead, E, O), dt, rngs)
        self.fc2_bias = new_param((*lead, O), dt, rngs, zeros=True)


class Qwen3VisionEncoder(nnx.Module):
    """Qwen3-Omni vision transformer: per-frame attention, a 2x2 patch merger and DeepStack mergers."""

    def __init__(self, config: Qwen3VisionConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        self.config = config
        self.patch_embed = new_param((c.patch_dim, c.hidden_size), dt, rngs)
        self.patch_bias = new_param((c.hidden_size,), dt, rngs, zeros=True)
        self.pos_embed = new_param((c.num_position_embeddings, c.hidden_size), dt, rngs)
        self.layers = Qwen3VisionLayers(config, rngs=rngs)
        self.merger = Qwen3VisionMerger(config, c.hidden_size, rngs=rngs)
        self.deepstack = Qwen3VisionMerger(config, c.merged_dim, (c.num_deepstack,), rngs=rngs)

    def __call__(self, pixel_values: jnp.ndarray, plan: VisionPlan) -> tuple[jnp.ndarray, jnp.ndarray]:
        """`[N, P]` pixel rows -> (`[N / merge_unit, O]` merged tokens, `[K, N / merge_unit, O]` DeepStack features)."""
        c, dt = self.config, self.config.jnp_dtype
        n, heads, d, K = pixel_values.shape[0], c.num_heads, c.head_dim, c.num_deepstack
        h = dense(pixel_values.astype(dt), self.patch_embed[...], self.patch_bias[...], dt)  # [N, D]
        corners = self.pos_embed[...][plan.pos_index].astype(jnp.float32) * plan.pos_weight[..., None]  # [4, N, D]
        h = h + (((corners[0] + corners[1]) + corners[2]) + corners[3]).astype(dt)
        inv_freq = rope_lib.inverse_frequencies(d // 2, ROPE_THETA)  # [d / 4]
        pos = plan.positions.astype(jnp.float32)
        rot = rope_lib.rotation(jnp.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1))  # [N, d/2]
        tanh_gelu = ACTIVATIONS[c.hidden_act]

        def block(carry, xs):
            h, taps = carry  # [N, D], [K, N, D]
            p, slot = xs
            x = layer_norm(h, p["norm1_scale"], p["norm1_bias"], NORM_EPS)
            qkv = dense(x, p["qkv"], p["qkv_bias"], dt).reshape(n, 3, heads, d)
            q, k = rope_lib.rotate(qkv[:, 0], rot), rope_lib.rotate(qkv[:, 1], rot)
            attn = _frame_attention(q, k, qkv[:, 2], plan.frame_segments, plan.frame_inverse).reshape(n, heads * d)
            h = h + dense(attn, p["proj"], p["proj_bias"], dt)
            x = layer_norm(h, p["norm2_scale"], p["norm2_bias"], NORM_EPS)
            x = jax.nn.gelu(dense(x, p["fc1"], p["fc1_bias"], dt), approximate=tanh_gelu)
            h = h + dense(x, p["fc2"], p["fc2_bias"], dt)
            taps = jnp.where((jnp.arange(K) == slot)[:, None, None], h[None], taps)
            return (h, taps), None

        slots = jnp.asarray(c.deepstack_slots, jnp.int32)
        taps = jnp.zeros((K, n, c.hidden_size), dt)
        (h, taps), _ = jax.lax.scan(block, (h, taps), (self.layers.stacked(), slots))
        embeds = _merge(h, self.merger.stacked(), c.merge_unit, post_norm=False)
        if K == 0:
            return embeds, jnp.zeros((0, *embeds.shape), dt)
        merge = functools.partial(_merge, merge_unit=c.merge_unit, post_norm=True)
        feats = jax.vmap(merge)(taps, self.deepstack.stacked())  # [K, M, O], in config order
        return embeds, feats[np.argsort(c.deepstack_visual_indexes)]  # in block order, as the reference lists them


@cached_jit(static_argnames=("graphdef",))
def _encode(graphdef, params, pixel_values, plan):
    return nnx.merge(graphdef, params)(pixel_values, plan)


def encode_vision(encoder: Qwen3VisionEncoder | tuple[Any, Any], pixel_values: npt.ArrayLike,
                  grid_thw: npt.ArrayLike) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Encodes preprocessed images/videos (jitted once per grid shape).

    Args:
        encoder: a `Qwen3VisionEncoder`, or its `(graphdef, params)` from `nnx.split`.
        pixel_values: `[N, P]` rows from the Qwen2-VL-style image/video processor (16 px patches; all grid entries
            concatenated, patches in the processor's 2x2 block order).
        grid_thw: `[n, 3]` patches per (time, height, width) of each entry; `N = sum(t * h * w)`.

    Returns:
        `(embeds, deepstack)`: `[N / merge_unit, out_hidden_size]` merged tokens and `[K, N / merge_unit,
        out_hidden_size]` DeepStack features (in block order: `sorted(deepstack_visual_indexes)`, each through the
        merger of its block), in the compute dtype, entries in order and the processor's token order within each.
    """
    graphdef, params = nnx.split(encoder) if isinstance(encoder, Qwen3VisionEncoder) else encoder
    config = encoder.config if isinstance(encoder, Qwen3VisionEncoder) else nnx.merge(graphdef, params).config
    plan = vision_plan(grid_thw, config)
    pixel_values = jnp.asarray(pixel_values)
    expected = (plan.frame_inverse.size, config.patch_dim)
    if pixel_values.shape != expected:
        raise ValueError(f"pixel_values has shape {pixel_values.shape}, grid_thw implies {expected}")
    return _encode(graphdef, params, pixel_values, plan)


def encoder_from_params(config: Qwen3VisionConfig, params: Mapping[str, Any]) -> Qwen3VisionEncoder:
    """A `Qwen3VisionEncoder` holding `params` (a pure-dict tree, e.g. `vision_tree(convert_in_memory(...))`).

    Leaves are cast to the config's dtype. Raises ValueError naming the first missing or mis-shaped leaf.
    """
    return module_from_pure_dict(lambda: Qwen3VisionEncoder(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="vision parameter", missing_message="{what}s lack {name}")


# ---------------------------------------------------------------------------------------------------- name table
# Symbols: P pixel row, D hidden, I MLP, T = 3D (qkv), G position table rows, E merged width, O output,
# C/Tp/p the Conv3d kernel's channels / frames / side.

_B = "blocks.{i}."
VISION_RULES: tuple[Rule, ...] = (
    Rule("patch_embed.proj.weight", "patch_embed", "P D", transform="flatten_T", src_dims="D C Tp p p"),
    Rule("patch_embed.proj.bias", "patch_bias", "D"),
    Rule("pos_embed.weight", "pos_embed", "G D"),
    *norm_rules(_B + "norm1", "layers/norm1"),
    *norm_rules(_B + "norm2", "layers/norm2"),
    *linear_rules(_B + "attn.qkv", "layers/qkv", "layers/qkv_bias", "D T"),
    *linear_rules(_B + "attn.proj", "layers/proj", "layers/proj_bias", "D D"),
    *linear_rules(_B + "mlp.linear_fc1", "layers/fc1", "layers/fc1_bias", "D I"),
    *linear_rules(_B + "mlp.linear_fc2", "layers/fc2", "layers/fc2_bias", "I D"),
    *norm_rules("merger.ln_q", "merger/norm"),
    *linear_rules("merger.mlp.0", "merger/fc1", "merger/fc1_bias", "E E"),
    *linear_rules("merger.mlp.2", "merger/fc2", "merger/fc2_bias", "E O"),
)
# One "layer" per DeepStack level: `{i}` is the level.
DEEPSTACK_RULES: tuple[Rule, ...] = (
    *norm_rules("{i}.ln_q", "norm", "E"),
    *linear_rules("{i}.mlp.0", "fc1", "fc1_bias", "E E"),
    *linear_rules("{i}.mlp.2", "fc2", "fc2_bias", "E O"),
)
VISION_PREFIX = "visual."
DEEPSTACK_PREFIX = "visual.merger_list."


def _dims(c: Qwen3VisionConfig) -> dict[str, int]:
    return {"P": c.patch_dim, "D": c.hidden_size, "I": c.intermediate_size, "T": 3 * c.hidden_size,
            "G": c.num_position_embeddings, "E": c.merged_dim, "O": c.out_hidden_size, "C": c.in_channels,
            "Tp": c.temporal_patch_size, "p": c.patch_size}


def vision_component(config: Qwen3VisionConfig) -> Component:
    """The ViT's conversion table without the DeepStack mergers (`Component.name` "vision", HF prefix "visual."
    below "thinker.")."""
    return Component(name="vision", prefix=VISION_PREFIX, rules=VISION_RULES, dims=_dims(config),
                     num_layers=config.depth)


def deepstack_component(config: Qwen3VisionConfig) -> Component:
    """The DeepStack mergers' conversion table (`Component.name` "vision_deepstack", HF prefix
    "visual.merger_list."), one layer per level, so they fill `[K, ...]` arrays."""
    return Component(name="vision_deepstack", prefix=DEEPSTACK_PREFIX, rules=DEEPSTACK_RULES, dims=_dims(config),
                     num_layers=config.num_deepstack)


def vision_components(config: Qwen3VisionConfig) -> tuple[Component, Component]:
    """Both conversion tables of the vision tower: `(vision_component, deepstack_component)`."""
    return vision_component(config), deepstack_component(config)


def vision_tree(trees: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The encoder's pure-dict tree from the converted trees of `vision_components` (by component name)."""
    return {**trees["vision"], "deepstack": dict(trees["vision_deepstack"])}
