"""Qwen2.5-Omni's BigVGAN vocoder (`token2wav.code2wav_bigvgan_model.*` of the full release) in Flax NNX + JAX.

Mel `[B, M, T]` (M = `mel_dim` bands, as the DiT samples it) -> waveform `[B, T * prod(upsample_rates)]` in [-1, 1]
(24 kHz, 240 samples a mel frame for the release), what transformers 5.2.0's `Qwen2_5OmniToken2WavBigVGANModel`
returns (it squeezes the batch away; `vocode` keeps it):

1. The log mel is mapped to a clamped dB scale in [-1, 1]: `20 log10(max(e^mel, 10^(-115/20))) - 20` dB, then
   `2 (dB + 115) / 115 - 1` clamped.
2. `conv_pre` (k=7, zero padding 3) -> C0 = `upsample_initial_channel` channels.
3. Per upsample stage i: a transposed conv (kernel k_i, stride r_i, padding (k_i - r_i) // 2: n -> n * r_i when
   k_i - r_i is even) to C0 / 2^(i+1) channels, then the mean of `len(resblock_kernel_sizes)` AMP blocks (one per
   kernel size). An AMP block is three residual units: anti-aliased SnakeBeta, conv (kernel k, dilation d_u, "same"
   zero padding), anti-aliased SnakeBeta, conv (kernel k, dilation 1), residual.
4. Anti-aliased SnakeBeta (`TorchActivation1d`): 2x upsampling by a transposed conv with a 12-tap Kaiser-windowed
   sinc (cutoff 0.25, half-width 0.3; replicate padding 5 each side, x2 gain, 15 trimmed each side), SnakeBeta
   `x + sin(x e^alpha)^2 / (e^beta + 1e-9)`, 2x downsampling by a strided conv with the same filter (replicate
   padding 5 left, 6 right).
5. A last anti-aliased SnakeBeta, `conv_post` (k=7, padding 3, no bias) -> 1 channel, clamp to [-1, 1].

Every convolution is non-causal ("same" padding): a sample reads neighbouring mel frames on both sides.

Parameter tree (`nnx.to_pure_dict(nnx.state(model))`), C_i = C0 // 2**i, kernels in torch's layouts (Conv1d
`[out, in, k]`, ConvTranspose1d `[in, out, k]`), for stage i and AMP block j (flat index b = i * J + j, as
transformers numbers its `resblocks`) and unit u:

    conv_pre_kernel [C0, M, 7]  conv_pre_bias [C0]
    up{i}: kernel [C_i, C_i+1, k_i]  bias [C_i+1]
    res{b}: conv1_{u}_kernel [C, C, k_j]  conv1_{u}_bias [C]  conv2_{u}_kernel  conv2_{u}_bias
            act{a}_alpha [C]  act{a}_beta [C]  (a = 2u before conv1, 2u + 1 before conv2)
    post_alpha [C_n]  post_beta [C_n]  conv_post_kernel [1, C_n, 7]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax._checks import JsonConfig, check_config_fields
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.errors import UnsupportedConfigError
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import (
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    module_from_pure_dict,
    understood_attributes,
)
from omnijax.models.layers import new_param

__all__ = ["BIGVGAN_RULES_PREFIX", "BigVGAN", "BigVGANConfig", "BigVGANConfigError", "bigvgan_component",
           "bigvgan_from_params", "kaiser_sinc_filter", "mel_to_input", "vocode", "vocode_params"]

BIGVGAN_RULES_PREFIX = "token2wav.code2wav_bigvgan_model."
FILTER_TAPS = 12  # the anti-aliasing filters of every activation (fixed by the architecture)
POST_KERNEL = 7  # conv_pre and conv_post


class BigVGANConfigError(ConfigAttributeError):
    """Inconsistent BigVGAN settings. Attributes: `attribute`, `value`."""

    subject = "Qwen2.5-Omni BigVGAN config"


@dataclasses.dataclass(frozen=True)
class BigVGANConfig(JsonConfig):
    """Static hyperparameters of the vocoder (defaults: transformers' `Qwen2_5OmniBigVGANConfig`).

    Attributes:
        mel_dim: mel bands M.
        upsample_initial_channel: channels C0 after `conv_pre`; stage i outputs C0 // 2**(i + 1).
        resblock_kernel_sizes: kernel of each AMP block of a stage (their outputs are averaged).
        resblock_dilation_sizes: per AMP block, the dilations of its three residual units.
        upsample_rates: stride of each stage's transposed conv.
        upsample_kernel_sizes: kernel of each stage's transposed conv.
        dtype: parameter dtype name; `vocode` computes in float32 whatever it is (as the reference runs).
    """

    mel_dim: int = 80
    upsample_initial_channel: int = 1536
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 7, 4, 4, 4, 4)
    dtype: str = "float32"

    def __post_init__(self):
        check_config_fields(self, BigVGANConfigError, positive=("mel_dim", "upsample_initial_channel"),
                            positive_tuples=("resblock_kernel_sizes", "upsample_rates", "upsample_kernel_sizes"))
        if len(self.upsample_kernel_sizes) != len(self.upsample_rates):
            raise BigVGANConfigError("upsample_kernel_sizes", self.upsample_kernel_sizes,
                                     f"needs one kernel per upsample rate ({len(self.upsample_rates)})")
        for k, r in zip(self.upsample_kernel_sizes, self.upsample_rates):
            if k < r or (k - r) % 2:
                raise BigVGANConfigError("upsample_kernel_sizes", self.upsample_kernel_sizes,
                                         f"kernel {k} - stride {r} must be even and >= 0 (else n -> n * r fails)")
        dil = self.resblock_dilation_sizes
        if len(dil) != len(self.resblock_kernel_sizes) or any(len(d) != 3 for d in dil):
            raise BigVGANConfigError("resblock_dilation_sizes", dil,
                                     "needs three dilations per resblock kernel size")
        if any(k % 2 == 0 for k in self.resblock_kernel_sizes):
            raise BigVGANConfigError("resblock_kernel_sizes", self.resblock_kernel_sizes,
                                     "must be odd (the reference's padding keeps the length only then)")
        if self.upsample_initial_channel >> len(self.upsample_rates) < 1:
            raise BigVGANConfigError("upsample_initial_channel", self.upsample_initial_channel,
                                     f"halved {len(self.upsample_rates)} times leaves no channel")

    def channels(self, stage: int) -> int:
        """Channels entering stage `stage` (`len(upsample_rates)`: the last stage's output)."""
        return self.upsample_initial_channel // 2 ** stage

    @property
    def hop(self) -> int:
        """Waveform samples per mel frame (240 for the release: 10 ms at 24 kHz)."""
        return math.prod(self.upsample_rates)

    @classmethod
    def from_hf(cls, bigvgan_config: Mapping[str, Any], dtype: str = "float32") -> "BigVGANConfig":
        """Reads a Hugging Face `Qwen2_5OmniBigVGANConfig` (a dict or an object with `to_dict`).

        Raises:
            UnsupportedConfigError: an attribute not understood.
            BigVGANConfigError: the values are inconsistent.
        """
        data = dict(bigvgan_config.to_dict() if hasattr(bigvgan_config, "to_dict") else bigvgan_config)
        values = understood_attributes(data, _HF_DEFAULTS, HF_PRETRAINED_CONFIG_ATTRIBUTES,
                                       error=UnsupportedConfigError, where="bigvgan_config.", encoder="BigVGAN")
        for name in ("resblock_kernel_sizes", "upsample_rates", "upsample_kernel_sizes"):
            values[name] = tuple(values[name])
        values["resblock_dilation_sizes"] = tuple(tuple(d) for d in values["resblock_dilation_sizes"])
        return cls(**values, dtype=dtype)


_HF_DEFAULTS = dict(mel_dim=80, upsample_initial_channel=1536, resblock_kernel_sizes=(3, 7, 11),
                    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)), upsample_rates=(5, 3, 2, 2, 2, 2),
                    upsample_kernel_sizes=(11, 7, 4, 4, 4, 4))


def kaiser_sinc_filter(cutoff: float, half_width: float, taps: int) -> np.ndarray:
    """The Kaiser-windowed sinc low-pass `[taps]` (float32, sums to 1) of the anti-aliased activations."""
    half = taps // 2
    attenuation = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    t = np.arange(-half, half) + 0.5 if taps % 2 == 0 else np.arange(taps) - half
    f = 2 * cutoff * np.kaiser(taps, beta) * np.sinc(2 * cutoff * t)
    return (f / f.sum()).astype(np.float32)


# ------------------------------------------------------------------------------------------------------- module


class _Node(nnx.Module):
    """A named group of parameters (one upsample stage or AMP block)."""

    def __init__(self, **params: nnx.Param | nnx.Module):
        for name, value in params.items():
            setattr(self, name, value)


class BigVGAN(nnx.Module):
    """The vocoder's parameters (tree: module docstring); `vocode` runs it."""

    def __init__(self, config: BigVGANConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        self.config = config
        self.conv_pre_kernel = new_param((c.channels(0), c.mel_dim, POST_KERNEL), dt, rngs, std=0.1)
        self.conv_pre_bias = new_param((c.channels(0),), dt, rngs, zeros=True)
        J = len(c.resblock_kernel_sizes)
        for i, k in enumerate(c.upsample_kernel_sizes):
            cin, cout = c.channels(i), c.channels(i + 1)
            setattr(self, f"up{i}", _Node(kernel=new_param((cin, cout, k), dt, rngs, std=0.1),
                                          bias=new_param((cout,), dt, rngs, zeros=True)))
            for j, kj in enumerate(c.resblock_kernel_sizes):
                p: dict[str, nnx.Param] = {}
                for u in range(3):
                    for conv in ("conv1", "conv2"):
                        p[f"{conv}_{u}_kernel"] = new_param((cout, cout, kj), dt, rngs, std=0.05)
                        p[f"{conv}_{u}_bias"] = new_param((cout,), dt, rngs, zeros=True)
                for a in range(6):
                    p[f"act{a}_alpha"] = new_param((cout,), dt, rngs, zeros=True)
                    p[f"act{a}_beta"] = new_param((cout,), dt, rngs, zeros=True)
                setattr(self, f"res{i * J + j}", _Node(**p))
        out = c.channels(len(c.upsample_rates))
        self.post_alpha = new_param((out,), dt, rngs, zeros=True)
        self.post_beta = new_param((out,), dt, rngs, zeros=True)
        self.conv_post_kernel = new_param((1, out, POST_KERNEL), dt, rngs, std=0.05)


def bigvgan_from_params(config: BigVGANConfig, params: Mapping[str, Any]) -> BigVGAN:
    """Builds a `BigVGAN` from a pure-dict parameter tree shaped as the module docstring says."""
    return module_from_pure_dict(lambda: BigVGAN(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="bigvgan parameter", missing_error=KeyError)


def vocode_params(model: BigVGAN) -> dict[str, Any]:
    """The model's pure-dict parameter tree, what `vocode` reads."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# --------------------------------------------------------------------------------------------------------- math

_F32 = jnp.float32
_DN = ("NWC", "WIO", "NWC")


def _conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, *, dilation: int = 1) -> jax.Array:
    """Conv1d with "same" zero padding (odd kernel): `x [B, n, Cin]`, kernel `[Cout, Cin, k]` -> `[B, n, Cout]`."""
    pad = dilation * (kernel.shape[-1] - 1) // 2
    y = jax.lax.conv_general_dilated(x, kernel.transpose(2, 1, 0), (1,), [(pad, pad)], rhs_dilation=(dilation,),
                                     dimension_numbers=_DN, preferred_element_type=_F32)
    return y if bias is None else y + bias.astype(_F32)


def _conv_transpose(x: jax.Array, kernel: jax.Array, bias: jax.Array, stride: int) -> jax.Array:
    """torch's ConvTranspose1d with padding (k - s) // 2: `x [B, n, Cin]`, kernel `[Cin, Cout, k]` ->
    `[B, n * s, Cout]` (the input dilated by s, padded by k - 1 - p each side, correlated with the flipped kernel)."""
    k = kernel.shape[-1]
    pad = k - 1 - (k - stride) // 2
    w = jnp.flip(kernel, -1).transpose(2, 0, 1)  # [k, Cin, Cout]
    y = jax.lax.conv_general_dilated(x, w, (1,), [(pad, pad)], lhs_dilation=(stride,), dimension_numbers=_DN,
                                     preferred_element_type=_F32)
    return y + bias.astype(_F32)


def _aa_snake(x: jax.Array, alpha: jax.Array, beta: jax.Array, lowpass: jax.Array) -> jax.Array:
    """Anti-aliased SnakeBeta on `[B, n, C]`: 2x up (Kaiser sinc), SnakeBeta, 2x down -> `[B, n, C]`."""
    C, taps = x.shape[-1], lowpass.shape[0]
    depthwise = jnp.broadcast_to(lowpass[:, None, None], (taps, 1, C))  # WIO, one group per channel
    pad = taps // 2 - 1  # 5
    xp = jnp.pad(x, ((0, 0), (pad, pad), (0, 0)), mode="edge")  # [B, n + 10, C]
    # transposed conv, stride 2, no padding: dilate by 2, pad taps - 1 each side, flipped filter
    up = jax.lax.conv_general_dilated(xp, jnp.flip(depthwise, 0), (1,), [(taps - 1, taps - 1)], lhs_dilation=(2,),
                                      dimension_numbers=_DN, feature_group_count=C, preferred_element_type=_F32)
    trim = pad * 2 + (taps - 2) // 2  # 15 each side: [B, 2n + 30, C] -> [B, 2n, C]
    up = 2.0 * up[:, trim:up.shape[1] - trim]
    up = up + jnp.sin(up * jnp.exp(alpha.astype(_F32))) ** 2 / (jnp.exp(beta.astype(_F32)) + 1e-9)
    up = jnp.pad(up, ((0, 0), (taps // 2 - 1, taps // 2), (0, 0)), mode="edge")  # even taps: 5 left, 6 right
    return jax.lax.conv_general_dilated(up, depthwise, (2,), "VALID", dimension_numbers=_DN, feature_group_count=C,
                                        preferred_element_type=_F32)


def _amp_block(x: jax.Array, p: Mapping[str, jax.Array], dilations: tuple[int, ...], lowpass: jax.Array) -> jax.Array:
    """One AMP block on `[B, n, C]` (three residual units)."""
    for u, d in enumerate(dilations):
        h = _aa_snake(x, p[f"act{2 * u}_alpha"], p[f"act{2 * u}_beta"], lowpass)
        h = _conv(h, p[f"conv1_{u}_kernel"], p[f"conv1_{u}_bias"], dilation=d)
        h = _aa_snake(h, p[f"act{2 * u + 1}_alpha"], p[f"act{2 * u + 1}_beta"], lowpass)
        x = x + _conv(h, p[f"conv2_{u}_kernel"], p[f"conv2_{u}_bias"])
    return x


def mel_to_input(mel: jax.Array) -> jax.Array:
    """The reference's `process_mel_spectrogram`: log mel -> clamped dB scaled to [-1, 1] (elementwise)."""
    floor = math.exp(-115 / 20.0 * math.log(10))
    db = 20 * jnp.log10(jnp.maximum(jnp.exp(mel.astype(_F32)), floor)) - 20
    return jnp.clip(2 * (db + 115) / 115 - 1, -1.0, 1.0)


@cached_jit(static_argnames="config")
def vocode(params: Mapping[str, Any], config: BigVGANConfig, mel: jax.Array) -> jax.Array:
    """Mel `[B, M, T]` -> waveform `[B, T * hop]` (float32, clamped to [-1, 1]); pure, jitted per shape.

    Args:
        params: `vocode_params(model)`.
        config: the vocoder's config (static).
        mel: log-mel frames, bands first (what the DiT's `sample` returns).
    """
    c = config
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, _F32), params)
    lowpass = jnp.asarray(kaiser_sinc_filter(0.25, 0.3, FILTER_TAPS))
    x = _conv(mel_to_input(mel).transpose(0, 2, 1), params["conv_pre_kernel"], params["conv_pre_bias"])  # [B, T, C0]
    J = len(c.resblock_kernel_sizes)
    for i, r in enumerate(c.upsample_rates):
        up = params[f"up{i}"]
        x = _conv_transpose(x, up["kernel"], up["bias"], r)  # [B, n * r, C_i+1]
        x = sum(_amp_block(x, params[f"res{i * J + j}"], c.resblock_dilation_sizes[j], lowpass)
                for j in range(J)) / J
    x = _aa_snake(x, params["post_alpha"], params["post_beta"], lowpass)
    wav = _conv(x, params["conv_post_kernel"], None)[..., 0]  # [B, T * hop]
    return jnp.clip(wav, -1.0, 1.0)


# ---------------------------------------------------------------------------------------------------- name table


def bigvgan_component(config: BigVGANConfig, prefix: str = BIGVGAN_RULES_PREFIX) -> Component:
    """The conversion table of the vocoder (Hugging Face prefix `token2wav.code2wav_bigvgan_model.`; the
    Qwen2.5-Omni converter writes it into the "token2wav" component). Kernels keep torch's layouts, so no rule
    transforms."""
    c = config
    dims: dict[str, int] = {}

    def rule(hf: str, path: str, shape: tuple[int, ...]) -> Rule:
        for n in shape:
            dims[f"n{n}"] = n
        return Rule(hf, path, " ".join(f"n{n}" for n in shape))

    C0, M, K = c.channels(0), c.mel_dim, POST_KERNEL
    rules = [rule("conv_pre.weight", "conv_pre_kernel", (C0, M, K)), rule("conv_pre.bias", "conv_pre_bias", (C0,))]
    J = len(c.resblock_kernel_sizes)
    for i, k in enumerate(c.upsample_kernel_sizes):
        cin, cout = c.channels(i), c.channels(i + 1)
        rules += [rule(f"ups.{i}.0.weight", f"up{i}/kernel", (cin, cout, k)),
                  rule(f"ups.{i}.0.bias", f"up{i}/bias", (cout,))]
        for j, kj in enumerate(c.resblock_kernel_sizes):
            b = i * J + j
            for u in range(3):
                for conv in ("1", "2"):
                    rules += [rule(f"resblocks.{b}.convs{conv}.{u}.weight", f"res{b}/conv{conv}_{u}_kernel",
                                   (cout, cout, kj)),
                              rule(f"resblocks.{b}.convs{conv}.{u}.bias", f"res{b}/conv{conv}_{u}_bias", (cout,))]
            for a in range(6):
                rules += [rule(f"resblocks.{b}.activations.{a}.act.alpha", f"res{b}/act{a}_alpha", (cout,)),
                          rule(f"resblocks.{b}.activations.{a}.act.beta", f"res{b}/act{a}_beta", (cout,))]
    out = c.channels(len(c.upsample_rates))
    rules += [rule("activation_post.act.alpha", "post_alpha", (out,)),
              rule("activation_post.act.beta", "post_beta", (out,)),
              rule("conv_post.weight", "conv_post_kernel", (1, out, K))]
    return Component(name="bigvgan", prefix=prefix, rules=tuple(rules), dims=dims, num_layers=0)
