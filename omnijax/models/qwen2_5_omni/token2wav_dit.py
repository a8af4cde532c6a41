"""Qwen2.5-Omni Token2Wav's flow-matching DiT (`token2wav.code2wav_dit_model.*` of the full release) in NNX + JAX.

One forward (`dit_forward`) predicts the flow's velocity for noisy mel frames `x [B, T, M]` at time t, given codec
tokens `[B, T / repeats]`, a reference mel `[B, T_ref, M]` and a speaker vector per frame `[B, T, E]` (E =
`enc_emb_dim`), as transformers 5.2.0's `Qwen2_5OmniToken2WavDiTModel.forward`:

1. Time: a 256-wide sinusoidal embedding of `1000 t` (sin half then cos half), Linear, SiLU, Linear -> `[B, D]`.
2. Codes: a `[num_embeds + 1, emb_dim]` table, each row repeated `repeats` times along time (the release: 2 mel frames
   of 10 ms per 50 Hz token); "dropped" codes are all index 0.
3. The reference mel goes through an ECAPA-TDNN (`speaker_encoder`: a TDNN, SE-Res2Net blocks, multi-layer
   aggregation, attentive statistics pooling, a 1x1 conv; every conv "same"-padded by reflection) -> `[B, enc_dim]`,
   broadcast over time; `[x, that, code rows, speaker]` concatenated and projected to D.
4. `num_hidden_layers` DiT blocks: AdaLayerNorm-zero (LayerNorm eps 1e-6 without affine, shift/scale/gate from
   `Linear(SiLU(time))`), attention with RoPE on the **first head only** (pairs (2j, 2j+1) rotated by angles of
   frequency j mod hd/2 -- the reference's training quirk), a tanh-GELU MLP. Attention is block-restricted: frames
   are cut into blocks of `block_size`; a frame sees its own block, plus the previous block in `look_backward_layers`
   and the next block in `look_ahead_layers`. Hence output block b depends on input blocks b - n_back .. b + n_ahead
   (n_ahead = number of look-ahead layers: a streamed decode waits for that many blocks of future codes).
5. A final AdaLayerNorm (scale then shift) and a projection to M mel bands.

With classifier-free guidance (`apply_cfg`, how `sample` calls it) the batch is doubled: the second half has the
reference mel and speaker zeroed and the codes dropped, and the output is `[2B, T, M]`.

Parameter tree (`nnx.to_pure_dict(nnx.state(model))`), L layers, A = heads * head_dim, F = D * ff_mult, P = M +
enc_dim + emb_dim + E, ECAPA channels C_0..C_n (n = len(enc_channels) - 1), Res2Net scale s; Linear weights
`[in, out]`, conv kernels in torch's `[out, in, k]`:

    time_fc1 [256, D]  time_fc2 [D, D]  in_proj [P, D]  (each + _bias [out])  codec_embed [num_embeds + 1, emb_dim]
    spk: tdnn0_kernel [C_0, M, k_0] (+ _bias)
         se{i} (i = 1 .. n-1): tdnn1_kernel [C_i, C_i-1, 1]  res{j}_kernel [C_i/s, C_i/s, k_i] (j < s - 1)
             tdnn2_kernel [C_i, C_i, 1]  se1_kernel [se, C_i, 1]  se2_kernel [C_i, se, 1]  (each + _bias)
         mfa_kernel [C_n, C_n, k_n]  asp_tdnn_kernel [att, 3 C_n, 1]  asp_conv_kernel [C_n, att, 1]
         fc_kernel [enc_dim, 2 C_n, 1]  (each + _bias)
    layers: ada [L, D, 6D]  q k v [L, D, A]  o [L, A, D]  ff1 [L, D, F]  ff2 [L, F, D]  (each + _bias [L, out])
    final_ada [D, 2D] (+ _bias)  proj_out [D, M] (+ _bias)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax._checks import JsonConfig, check_config_fields, int_fields
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.errors import UnsupportedConfigError
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import (
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    dense,
    module_from_pure_dict,
    understood_attributes,
)
from omnijax.models.layers import new_param

__all__ = ["DIT_RULES_PREFIX", "DiT", "DiTConfig", "DiTConfigError", "dit_component", "dit_forward",
           "dit_from_params", "dit_params", "speaker_encoder", "time_embedding"]

DIT_RULES_PREFIX = "token2wav.code2wav_dit_model."
FREQ_DIM = 256  # width of the sinusoidal time embedding (fixed by the architecture)


class DiTConfigError(ConfigAttributeError):
    """Inconsistent DiT settings. Attributes: `attribute`, `value`."""

    subject = "Qwen2.5-Omni token2wav DiT config"


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(not isinstance(v, bool) and isinstance(v, int) for v in value)


@dataclasses.dataclass(frozen=True)
class DiTConfig(JsonConfig):
    """Static hyperparameters of the DiT (defaults: transformers' `Qwen2_5OmniDiTConfig`; field meanings as
    there). `look_ahead_layers` / `look_backward_layers` list the layers that also attend to the next / previous
    block of `block_size` frames. `dtype`: parameter dtype name; `dit_forward` computes in float32."""

    hidden_size: int = 1024
    num_hidden_layers: int = 22
    num_attention_heads: int = 16
    ff_mult: float = 2
    emb_dim: int = 512
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    block_size: int = 24
    look_ahead_layers: tuple[int, ...] = (10,)
    look_backward_layers: tuple[int, ...] = (0, 20)
    repeats: int = 2
    num_embeds: int = 8193
    mel_dim: int = 80
    enc_emb_dim: int = 192
    enc_dim: int = 128
    enc_channels: tuple[int, ...] = (256, 256, 256, 256, 768)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 64
    enc_res2net_scale: int = 2
    enc_se_channels: int = 64
    dtype: str = "float32"

    def __post_init__(self):
        check_config_fields(self, DiTConfigError, positive=int_fields(type(self)))
        for name in ("look_ahead_layers", "look_backward_layers"):
            value = getattr(self, name)
            if not _ints(value) or any(not 0 <= i < self.num_hidden_layers for i in value):
                raise DiTConfigError(name, value, f"must list layers in [0, {self.num_hidden_layers})")
        n = len(self.enc_channels)
        for name in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
            value = getattr(self, name)
            if not _ints(value) or len(value) != n or n < 3 or any(v < 1 for v in value):
                raise DiTConfigError(name, value, "must be positive integers, as many as enc_channels (>= 3)")
        if any(self.enc_channels[i] != self.enc_channels[i - 1] for i in range(1, n - 1)):
            raise DiTConfigError("enc_channels", self.enc_channels, "the SE-Res2Net blocks are residual: "
                                 "enc_channels[0 .. n-2] must be equal")
        if sum(self.enc_channels[1:-1]) != self.enc_channels[-1]:
            raise DiTConfigError("enc_channels", self.enc_channels,
                                 "the last entry must be the sum of the SE-Res2Net blocks' (they are concatenated)")
        if any(c % self.enc_res2net_scale for c in self.enc_channels[:-1]):
            raise DiTConfigError("enc_res2net_scale", self.enc_res2net_scale, "must divide enc_channels")
        if self.head_dim % 2:
            raise DiTConfigError("head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        if not self.ff_mult > 0 or int(self.hidden_size * self.ff_mult) < 1:
            raise DiTConfigError("ff_mult", self.ff_mult, "must give a positive MLP width")
        if not self.rope_theta > 0:
            raise DiTConfigError("rope_theta", self.rope_theta, "must be positive")

    @property
    def ff_dim(self) -> int:
        return int(self.hidden_size * self.ff_mult)

    @property
    def in_dim(self) -> int:
        return self.mel_dim + self.enc_dim + self.emb_dim + self.enc_emb_dim

    @classmethod
    def from_hf(cls, dit_config: Mapping[str, Any], dtype: str = "float32") -> "DiTConfig":
        """Reads a Hugging Face `Qwen2_5OmniDiTConfig` (a dict or an object with `to_dict`).

        Raises:
            UnsupportedConfigError: an attribute not understood, or a RoPE other than default.
            DiTConfigError: the values are inconsistent.
        """
        data = dict(dit_config.to_dict() if hasattr(dit_config, "to_dict") else dit_config)
        values = understood_attributes(data, _HF_DEFAULTS, _HF_HARMLESS, error=UnsupportedConfigError,
                                       where="dit_config.", encoder="token2wav DiT")
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise UnsupportedConfigError("dit_config.rope_parameters", rope, "must be an object")
        extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
        if rope.get("rope_type", rope.get("type", "default")) != "default" or extra:
            raise UnsupportedConfigError("dit_config.rope_parameters", rope,
                                         "only default RoPE (rope_type, rope_theta) is implemented")
        for name in ("look_ahead_layers", "look_backward_layers", "enc_channels", "enc_kernel_sizes",
                     "enc_dilations"):
            values[name] = tuple(values[name])
        return cls(**values, rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))), dtype=dtype)


_HF_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DiTConfig) if f.name not in ("dtype", "rope_theta")}
# dropout is training-only; RoPE is checked above
_HF_HARMLESS = HF_PRETRAINED_CONFIG_ATTRIBUTES | frozenset({"dropout", "rope_parameters", "rope_scaling",
                                                            "rope_theta"})


# ------------------------------------------------------------------------------------------------------- module


def _shapes(config: DiTConfig) -> dict[str, Any]:
    """Every parameter's shape, as the tree of the module docstring (shared by the module and the name table)."""
    c = config
    D, A, F, L, M = c.hidden_size, c.num_attention_heads * c.head_dim, c.ff_dim, c.num_hidden_layers, c.mel_dim
    C, K, s = c.enc_channels, c.enc_kernel_sizes, c.enc_res2net_scale
    n = len(C) - 1

    def lin(name: str, i: int, o: int, lead: tuple[int, ...] = ()) -> dict[str, tuple[int, ...]]:
        return {name: (*lead, i, o), f"{name}_bias": (*lead, o)}

    def conv(name: str, o: int, i: int, k: int) -> dict[str, tuple[int, ...]]:
        return {f"{name}_kernel": (o, i, k), f"{name}_bias": (o,)}

    spk = {**conv("tdnn0", C[0], M, K[0])}
    for i in range(1, n):
        block = {**conv("tdnn1", C[i], C[i - 1], 1), **conv("tdnn2", C[i], C[i], 1),
                 **conv("se1", c.enc_se_channels, C[i], 1), **conv("se2", C[i], c.enc_se_channels, 1)}
        for j in range(s - 1):
            block.update(conv(f"res{j}", C[i] // s, C[i] // s, K[i]))
        spk[f"se{i}"] = block
    spk.update({**conv("mfa", C[n], C[n], K[n]), **conv("asp_tdnn", c.enc_attention_channels, 3 * C[n], 1),
                **conv("asp_conv", C[n], c.enc_attention_channels, 1), **conv("fc", c.enc_dim, 2 * C[n], 1)})
    layers = {**lin("ada", D, 6 * D, (L,)), **lin("q", D, A, (L,)), **lin("k", D, A, (L,)), **lin("v", D, A, (L,)),
              **lin("o", A, D, (L,)), **lin("ff1", D, F, (L,)), **lin("ff2", F, D, (L,))}
    return {**lin("time_fc1", FREQ_DIM, D), **lin("time_fc2", D, D), "codec_embed": (c.num_embeds + 1, c.emb_dim),
            **lin("in_proj", c.in_dim, D), "spk": spk, "layers": layers, **lin("final_ada", D, 2 * D),
            **lin("proj_out", D, M)}


class _Node(nnx.Module):
    """A named group of parameters."""

    def __init__(self, **params: nnx.Param | nnx.Module):
        for name, value in params.items():
            setattr(self, name, value)


def _build(shapes: Mapping[str, Any], dt: Any, rngs: nnx.Rngs) -> dict[str, nnx.Param | nnx.Module]:
    return {k: _Node(**_build(v, dt, rngs)) if isinstance(v, Mapping) else
            new_param(v, dt, rngs, zeros=k.endswith("bias"), std=0.02) for k, v in shapes.items()}


class DiT(nnx.Module):
    """The DiT's parameters (tree: module docstring); `dit_forward` runs one velocity prediction."""

    def __init__(self, config: DiTConfig, *, rngs: nnx.Rngs | None = None):
        self.config = config
        for name, value in _build(_shapes(config), config.jnp_dtype, rngs or nnx.Rngs(0)).items():
            setattr(self, name, value)


def dit_from_params(config: DiTConfig, params: Mapping[str, Any]) -> DiT:
    """Builds a `DiT` from a pure-dict parameter tree shaped as the module docstring says."""
    return module_from_pure_dict(lambda: DiT(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="token2wav DiT parameter", missing_error=KeyError)


def dit_params(model: DiT) -> dict[str, Any]:
    """The model's pure-dict parameter tree, what `dit_forward` reads."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# --------------------------------------------------------------------------------------------------------- math

_F32 = jnp.float32


def _tdnn(x: jax.Array, p: Mapping[str, jax.Array], name: str, dilation: int = 1, relu: bool = True) -> jax.Array:
    """Conv1d with "same" reflection padding (+ ReLU): `[B, n, Cin]` -> `[B, n, Cout]`, kernel `[Cout, Cin, k]`."""
    kernel = p[f"{name}_kernel"]
    total = dilation * (kernel.shape[-1] - 1)
    if total:
        x = jnp.pad(x, ((0, 0), (total // 2, total - total // 2), (0, 0)), mode="reflect")
    y = jax.lax.conv_general_dilated(x, kernel.transpose(2, 1, 0), (1,), "VALID", rhs_dilation=(dilation,),
                                     dimension_numbers=("NWC", "WIO", "NWC"), preferred_element_type=_F32)
    y = y + p[f"{name}_bias"].astype(_F32)
    return jax.nn.relu(y) if relu else y


def _stats(x: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted mean and std over time of `[B, n, C]` (weights `[B, n, C]` or broadcastable, summing to 1)."""
    mean = jnp.sum(weights * x, axis=1)
    std = jnp.sqrt(jnp.maximum(jnp.sum(weights * (x - mean[:, None]) ** 2, axis=1), 1e-12))
    return mean, std


def speaker_encoder(p: Mapping[str, Any], config: DiTConfig, mel: jax.Array) -> jax.Array:
    """The ECAPA-TDNN: reference mel `[B, T_ref, M]` -> `[B, enc_dim]` (T_ref must exceed the largest padding)."""
    c = config
    C, dil, s = c.enc_channels, c.enc_dilations, c.enc_res2net_scale
    reach = max(d * (k - 1) - d * (k - 1) // 2 for k, d in zip(c.enc_kernel_sizes, dil))
    if mel.shape[1] <= reach:
        raise ValueError(f"reference mel has {mel.shape[1]} frames; the speaker encoder's reflection padding "
                         f"needs more than {reach}")
    x = _tdnn(mel.astype(_F32), p, "tdnn0", dil[0])
    outs = []
    for i in range(1, len(C) - 1):
        b = p[f"se{i}"]
        h = _tdnn(x, b, "tdnn1")
        parts, y = jnp.split(h, s, axis=-1), []
        for j, part in enumerate(parts):
            y.append(part if j == 0 else _tdnn(part if j == 1 else part + y[-1], b, f"res{j - 1}", dil[i]))
        h = _tdnn(jnp.concatenate(y, axis=-1), b, "tdnn2")
        gate = jax.nn.sigmoid(_tdnn(_tdnn(jnp.mean(h, axis=1, keepdims=True), b, "se1"), b, "se2", relu=False))
        x = h * gate + x
        outs.append(x)
    x = _tdnn(jnp.concatenate(outs, axis=-1), p, "mfa", dil[-1])  # [B, T_ref, C_n]
    n = x.shape[1]
    mean, std = _stats(x, jnp.full((1, n, 1), 1.0 / n, _F32))
    att = jnp.concatenate([x, jnp.broadcast_to(mean[:, None], x.shape), jnp.broadcast_to(std[:, None], x.shape)], -1)
    att = _tdnn(jnp.tanh(_tdnn(att, p, "asp_tdnn")), p, "asp_conv", relu=False)
    mean, std = _stats(x, jax.nn.softmax(att, axis=1))
    pooled = jnp.concatenate([mean, std], axis=-1)  # [B, 2 C_n]
    return pooled @ p["fc_kernel"][..., 0].T.astype(_F32) + p["fc_bias"].astype(_F32)


def _layer_norm(x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)


def time_embedding(p: Mapping[str, Any], t: jax.Array) -> jax.Array:
    """`t [B]` -> `[B, D]`: sinusoids of 1000 t (sin half, cos half), Linear, SiLU, Linear."""
    half = FREQ_DIM // 2
    freqs = jnp.exp(jnp.arange(half, dtype=_F32) * -(math.log(10000) / (half - 1)))
    emb = 1000 * t.astype(_F32)[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=-1)
    return dense(jax.nn.silu(dense(emb, p["time_fc1"], p["time_fc1_bias"], _F32)), p["time_fc2"], p["time_fc2_bias"],
                 _F32)


def _rope_first_head(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The reference's RoPE on head 0 of `[B, T, H, hd]`: pairs (2j, 2j+1) rotated, cos/sin `[T, hd]`."""
    h0 = x[:, :, 0]
    pairs = h0.reshape(*h0.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(h0.shape)
    return x.at[:, :, 0].set(h0 * cos + rotated * sin)


def _block(x: jax.Array, p: Mapping[str, jax.Array], temb: jax.Array, cos: jax.Array, sin: jax.Array,
           allowed: jax.Array, config: DiTConfig) -> jax.Array:
    """One DiT block on `[B, T, D]`; `temb [B, D]`, `allowed [T, T]` the block mask of this layer."""
    c = config
    B, T, _ = x.shape
    H, hd = c.num_attention_heads, c.head_dim
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = jnp.split(
        dense(jax.nn.silu(temb), p["ada"], p["ada_bias"], _F32)[:, None], 6, axis=-1)  # each [B, 1, D]
    h = _layer_norm(x) * (1 + scale_a) + shift_a
    q, k, v = (dense(h, p[n], p[f"{n}_bias"], _F32).reshape(B, T, H, hd) for n in "qkv")
    q, k = _rope_first_head(q, cos, sin), _rope_first_head(k, cos, sin)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
    probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)  # a frame always sees its own block
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, H * hd)
    x = x + gate_a * dense(attn, p["o"], p["o_bias"], _F32)
    h = _layer_norm(x) * (1 + scale_m) + shift_m
    h = dense(jax.nn.gelu(dense(h, p["ff1"], p["ff1_bias"], _F32), approximate=True), p["ff2"], p["ff2_bias"], _F32)
    return x + gate_m * h


@cached_jit(static_argnames=("config", "apply_cfg", "drop_audio_conditioning", "drop_code"))
def dit_forward(params: Mapping[str, Any], config: DiTConfig, x: jax.Array, reference_mel: jax.Array,
                speaker: jax.Array, codes: jax.Array, time: jax.Array, *, apply_cfg: bool = True,
                drop_audio_conditioning: bool = False, drop_code: bool = False,
                offset: jax.Array | int = 0) -> jax.Array:
    """One velocity prediction, what the reference's `forward` returns (pure, jitted per shape).

    Args:
        params: `dit_params(model)`.
        config: the DiT's config (static).
        x: `[B, T, M]` the noisy mel at `time`.
        reference_mel: `[B, T_ref, M]` the speaker's reference mel (the ECAPA input).
        speaker: `[B, T, E]` the speaker vector of every frame.
        codes: `[B, T / repeats]` codec tokens in [0, num_embeds].
        time: `[]` or `[B]` flow time in [0, 1].
        apply_cfg: also predict the unconditioned half (zeroed reference and speaker, codes dropped): `[2B, T, M]`.
        drop_audio_conditioning: without `apply_cfg`, zero the reference mel and speaker.
        drop_code: without `apply_cfg`, drop the codes (all index 0).
        offset: the position of `x`'s first frame in the utterance (a window of a streamed decode starts there;
            traced). It matters: the reference's RoPE rotates the two halves of a pair by different frequencies, so
            attention scores are not a function of relative position alone.

    Returns:
        `[B, T, M]` (`[2B, T, M]` with `apply_cfg`: conditioned rows first) float32 velocities.
    """
    c = config
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, _F32), params)
    B, T, _ = x.shape
    if codes.shape[1] * c.repeats != T:
        raise ValueError(f"codes cover {codes.shape[1]} x {c.repeats} frames, x has {T}")
    temb = time_embedding(params, jnp.broadcast_to(jnp.asarray(time, _F32), (B,)))  # [B, D]
    table = params["codec_embed"].astype(_F32)
    code_rows = jnp.repeat(table[jnp.where(drop_code and not apply_cfg, 0, codes)], c.repeats, axis=1)
    x, reference_mel, speaker = x.astype(_F32), reference_mel.astype(_F32), speaker.astype(_F32)
    if apply_cfg:
        x = jnp.concatenate([x, x])
        speaker = jnp.concatenate([speaker, jnp.zeros_like(speaker)])
        reference_mel = jnp.concatenate([reference_mel, jnp.zeros_like(reference_mel)])
        code_rows = jnp.concatenate([code_rows, jnp.repeat(table[jnp.zeros_like(codes)], c.repeats, axis=1)])
        temb = jnp.concatenate([temb, temb])
    elif drop_audio_conditioning:
        speaker, reference_mel = jnp.zeros_like(speaker), jnp.zeros_like(reference_mel)
    cond = speaker_encoder(params["spk"], c, reference_mel)  # [B', enc_dim]
    h = jnp.concatenate([x, jnp.broadcast_to(cond[:, None], (*x.shape[:2], c.enc_dim)), code_rows, speaker], -1)
    h = dense(h, params["in_proj"], params["in_proj_bias"], _F32)  # [B', T, D]
    inv = 1.0 / c.rope_theta ** (jnp.arange(0, c.head_dim, 2, dtype=_F32) / c.head_dim)
    angles = (jnp.asarray(offset, _F32) + jnp.arange(T, dtype=_F32))[:, None] * inv[None]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, hd]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    blocks = jnp.arange(T) // c.block_size
    diff = blocks[None, :] - blocks[:, None]  # [T, T] key block - query block
    back = jnp.asarray([int(i in c.look_backward_layers) for i in range(c.num_hidden_layers)])
    ahead = jnp.asarray([int(i in c.look_ahead_layers) for i in range(c.num_hidden_layers)])

    def step(h, layer):
        p, b, a = layer
        return _block(h, p, temb, cos, sin, (diff >= -b) & (diff <= a), c), None

    h, _ = jax.lax.scan(step, h, (params["layers"], back, ahead))
    scale, shift = jnp.split(dense(jax.nn.silu(temb), params["final_ada"], params["final_ada_bias"], _F32)[:, None],
                             2, axis=-1)
    return dense(_layer_norm(h) * (1 + scale) + shift, params["proj_out"], params["proj_out_bias"], _F32)


# ---------------------------------------------------------------------------------------------------- name table


def dit_component(config: DiTConfig, prefix: str = DIT_RULES_PREFIX) -> Component:
    """The conversion table of the DiT (Hugging Face prefix `token2wav.code2wav_dit_model.`; the Qwen2.5-Omni
    converter writes it into the "token2wav" component). Linear weights are transposed; conv kernels and the
    embedding keep torch's layouts."""
    shapes, dims = _shapes(config), {}

    def rule(hf: str, path: str, transform: str | None = None) -> Rule:
        node: Any = shapes
        for key in path.split("/"):
            node = node[key]
        shape = node[1:] if hf.startswith("transformer_blocks.") else node
        for n in shape:
            dims[f"n{n}"] = n
        return Rule(hf, path, " ".join(f"n{n}" for n in shape), transform)

    def lin(hf: str, path: str) -> list[Rule]:
        return [rule(f"{hf}.weight", path, "T"), rule(f"{hf}.bias", f"{path}_bias")]

    def conv(hf: str, path: str) -> list[Rule]:
        return [rule(f"{hf}.weight", f"{path}_kernel"), rule(f"{hf}.bias", f"{path}_bias")]

    spk = "input_embed.spk_encoder."
    rules = [*lin("time_embed.time_mlp.0", "time_fc1"), *lin("time_embed.time_mlp.2", "time_fc2"),
             rule("text_embed.codec_embed.weight", "codec_embed"), *lin("input_embed.proj", "in_proj"),
             *conv(spk + "blocks.0.conv", "spk/tdnn0")]
    n = len(config.enc_channels) - 1
    for i in range(1, n):
        hf, ours = f"{spk}blocks.{i}.", f"spk/se{i}/"
        rules += [*conv(hf + "tdnn1.conv", ours + "tdnn1"), *conv(hf + "tdnn2.conv", ours + "tdnn2"),
                  *conv(hf + "se_block.conv1", ours + "se1"), *conv(hf + "se_block.conv2", ours + "se2")]
        for j in range(config.enc_res2net_scale - 1):
            rules += conv(f"{hf}res2net_block.blocks.{j}.conv", f"{ours}res{j}")
    rules += [*conv(spk + "mfa.conv", "spk/mfa"), *conv(spk + "asp.tdnn.conv", "spk/asp_tdnn"),
              *conv(spk + "asp.conv", "spk/asp_conv"), *conv(spk + "fc", "spk/fc")]
    layer = "transformer_blocks.{i}."
    for hf, ours in (("attn_norm.linear", "ada"), ("attn.to_q", "q"), ("attn.to_k", "k"), ("attn.to_v", "v"),
                     ("attn.to_out.0", "o"), ("ff.ff.0", "ff1"), ("ff.ff.3", "ff2")):
        rules += lin(layer + hf, f"layers/{ours}")
    rules += [*lin("norm_out.linear", "final_ada"), *lin("proj_out", "proj_out")]
    return Component(name="dit", prefix=prefix, rules=tuple(rules), dims=dims, num_layers=config.num_hidden_layers)
