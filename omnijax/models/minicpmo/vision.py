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
reproducing the reference's float32 arithmetic (`vision_host`, see `navit_position_ids`); the module carries only its
config (`vision_config`) and parameters; blocks are stacked along a leading `layers` axis and run in one `lax.scan`.
This module re-exports the public names of both.

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

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx
from PIL import Image
from safetensors import safe_open

from omnijax.checkpoint.name_tables import Component, Rule, convert_in_memory
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import (
    StackedLayers,
    dense,
    layer_norm,
    linear_rules,
    module_from_pure_dict,
    norm_rules,
)
from omnijax.models.layers import new_param
from omnijax.models.minicpmo import image_preprocess
from omnijax.models.minicpmo.vision_config import (
    MINICPM_O_4_5_VISION,
    RESAMPLER_HEAD_WIDTH,
    UnsupportedVisionConfigError,
    VisionConfig,
    VisionConfigError,
)
from omnijax.models.minicpmo.vision_host import (
    TORCH_ARANGE_VECTOR_WIDTH,
    VisionPlan,
    navit_position_ids,
    sincos_2d,
    torch_arange_f32,
    vision_plan,
)

__all__ = ["MINICPM_O_4_5_VISION", "RESAMPLER_HEAD_WIDTH", "RESAMPLER_LN_EPS", "RESAMPLER_PREFIX", "RESAMPLER_RULES",
           "TORCH_ARANGE_VECTOR_WIDTH", "MiniCPMVision", "Resampler", "SiglipEncoder", "SiglipLayers",
           "UnsupportedVisionConfigError", "VPM_PREFIX", "VPM_RULES", "VisionConfig", "VisionConfigError",
           "VisionPlan", "encode_image", "encode_images", "load_vision", "navit_position_ids", "resampler_component",
           "sincos_2d", "torch_arange_f32", "vision_components", "vision_from_params", "vision_from_tensors",
           "vision_plan", "vpm_component"]

RESAMPLER_LN_EPS = 1e-6  # `partial(nn.LayerNorm, eps=1e-6)` in the reference resampler


# --------------------------------------------------------------------------------------------------------- module


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


class SiglipLayers(StackedLayers):
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
        h = dense(patches.astype(dt), self.patch_embed[...], self.patch_bias[...], dt)
        h = h + jnp.take(self.pos_embed[...], position_ids, axis=0)
        embeddings = h

        def block(h, p):
            x = layer_norm(h, p["ln1_scale"], p["ln1_bias"], eps)
            q, k, v = (dense(x, p[f"{s}_proj"], p[f"{s}_bias"], dt).reshape(B, L, heads, d) for s in "qkv")
            h = h + dense(_attention(q, k, v, patch_mask, scale_first=False), p["o_proj"], p["o_bias"], dt)
            x = layer_norm(h, p["ln2_scale"], p["ln2_bias"], eps)
            x = jax.nn.gelu(dense(x, p["fc1"], p["fc1_bias"], dt), approximate=True)
            h = h + dense(x, p["fc2"], p["fc2_bias"], dt)
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
        self.ln_q_scale = new_param((E,), dt, rngs, ones=True)
        self.ln_q_bias = new_param((E,), dt, rngs, zeros=True)
        self.ln_kv_scale = new_param((E,), dt, rngs, ones=True)
        self.ln_kv_bias = new_param((E,), dt, rngs, zeros=True)
        self.ln_post_scale = new_param((E,), dt, rngs, ones=True)
        self.ln_post_bias = new_param((E,), dt, rngs, zeros=True)
        self.proj = new_param((E, E), dt, rngs, std=E ** -0.5)

    def __call__(self, config: VisionConfig, x: jnp.ndarray, key_pos: jnp.ndarray,
                 patch_mask: jnp.ndarray) -> jnp.ndarray:
        """`[B, L, D]` encoder output -> `[B, query_num, embed_dim]`."""
        dt, eps, E = config.jnp_dtype, RESAMPLER_LN_EPS, config.embed_dim
        B, L = x.shape[:2]
        heads, d = config.resampler_heads, config.resampler_head_dim
        if config.has_kv_proj:
            x = dense(x, self.kv_proj[...], None, dt)
        x = layer_norm(x, self.ln_kv_scale[...], self.ln_kv_bias[...], eps)
        q = layer_norm(self.query[...], self.ln_q_scale[...], self.ln_q_bias[...], eps)
        w, b = self.in_proj[...], self.in_proj_bias[...]
        q = dense(q, w[:, :E], b[:E], dt)  # [Q, E], the same for every strip
        k = dense(x + key_pos.astype(dt), w[:, E:2 * E], b[E:2 * E], dt)
        v = dense(x, w[:, 2 * E:], b[2 * E:], dt)
        q = jnp.broadcast_to(q.reshape(1, -1, heads, d), (B, q.shape[0], heads, d))
        out = _attention(q, k.reshape(B, L, heads, d), v.reshape(B, L, heads, d), patch_mask, scale_first=True)
        out = dense(out, self.out_proj[...], self.out_bias[...], dt)
        out = layer_norm(out, self.ln_post_scale[...], self.ln_post_bias[...], eps)
        return dense(out, self.proj[...], None, dt)


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


@cached_jit(static_argnames=("graphdef", "return_intermediates"))
def _encode(graphdef, params, patches, plan, return_intermediates):
    return nnx.merge(graphdef, params)(patches, plan, return_intermediates=return_intermediates)


def _split(model):
    if isinstance(model, MiniCPMVision):
        return nnx.split(model), model.config
    graphdef, params = model
    return (graphdef, params), nnx.merge(graphdef, params).config


def encode_images(model: MiniCPMVision | tuple[Any, Any], pixel_values: Sequence[np.ndarray],
                  tgt_sizes: npt.ArrayLike, *, max_patches: int | None = None, return_intermediates: bool = False,
                  vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> jnp.ndarray | dict[str, jnp.ndarray]:
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


def encode_image(model: MiniCPMVision | tuple[Any, Any], image: np.ndarray | Image.Image, *,
                 max_slice_nums: int = image_preprocess.MAX_SLICE_NUMS,
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
    *norm_rules(_L + "layer_norm1", "layers/ln1"),
    *norm_rules(_L + "layer_norm2", "layers/ln2"),
    *(r for s, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj"))
      for r in linear_rules(_L + f"self_attn.{hf}", f"layers/{s}_proj", f"layers/{s}_bias", "D D")),
    *linear_rules(_L + "mlp.fc1", "layers/fc1", "layers/fc1_bias", "D I"),
    *linear_rules(_L + "mlp.fc2", "layers/fc2", "layers/fc2_bias", "I D"),
    *norm_rules("post_layernorm", "post_ln"),
)
VPM_PREFIX = "vpm."

RESAMPLER_RULES: tuple[Rule, ...] = (
    Rule("query", "query", "Q E"),
    Rule("kv_proj.weight", "kv_proj", "K E", transform="T", when="kv_proj"),
    Rule("attn.in_proj_weight", "in_proj", "E F", transform="T"),
    Rule("attn.in_proj_bias", "in_proj_bias", "F"),
    *linear_rules("attn.out_proj", "out_proj", "out_bias", "E E"),
    *(r for ln in ("ln_q", "ln_kv", "ln_post") for r in norm_rules(ln, ln, "E")),
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
    return module_from_pure_dict(lambda: MiniCPMVision(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="MiniCPM-o vision parameter", missing_message="{what}s lack {name}")


def vision_from_tensors(config: VisionConfig, tensors: Mapping[str, np.ndarray]) -> MiniCPMVision:
    """A `MiniCPMVision` from Hugging Face tensors named as in the release (`vpm.*`, `resampler.*`; other tensors,
    e.g. `llm.*`, `apm.*`, are ignored).

    Raises:
        omnijax.errors.MissingTensorError: a `vpm.*` or `resampler.*` tensor the config needs is absent (named).
        omnijax.errors.UnexpectedTensorError: a `vpm.*` / `resampler.*` tensor maps to no parameter.
        omnijax.errors.ShapeMismatchError: a tensor's shape disagrees with the config.
    """
    mine = {k: v for k, v in tensors.items() if k.startswith((VPM_PREFIX, RESAMPLER_PREFIX))}
    trees = convert_in_memory(mine, vision_components(config), np.float32, strip_prefix="")
    return vision_from_params(config, trees)


def _read_vision_tensors(path: Path) -> dict[str, np.ndarray]:

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
        omnijax.errors.MissingTensorError: tensors the config needs are absent (named), e.g. no `resampler.*`.
        UnsupportedVisionConfigError, VisionConfigError: see `VisionConfig.from_hf`.
    """
    path = Path(checkpoint)
    if config is None:
        config_path = (path if path.is_dir() else path.parent) / "config.json"
        config = VisionConfig.from_hf(json.loads(config_path.read_text()), dtype=dtype)
    return vision_from_tensors(config, _read_vision_tensors(path))
