"""Qwen3-Omni Code2Wav (the talker's codec decoder, `code2wav.*` of the full release) in Flax NNX.

Codes `[B, Q, T]` (Q = `num_quantizers` codebooks, T frames at 12.5 Hz) -> waveform `[B, T * F - lag]` at 24 kHz,
with F = prod(upsampling_ratios) * prod(upsample_rates) = 1,920 samples per 80 ms frame and `lag` = 555 samples for
the release's rates (what transformers 5.2.0's `Qwen3OmniMoeCode2Wav.forward` returns):

1. Embedding: each codebook has its own `codebook_size` rows of one `[Q * V, D]` table; the Q embeddings of a frame
   are averaged -> `[B, T, D]`.
2. Pre-transformer: `num_hidden_layers` pre-RMSNorm layers of causal attention over a sliding window of
   `sliding_window` frames (a frame sees itself and the W - 1 before it; default RoPE, GQA, no q/k norm), a SiLU-gated
   MLP, and LayerScale (a learnt per-channel factor) on both residual branches; a final RMSNorm.
3. Upsampler: per `upsampling_ratios` factor s, a transposed convolution of kernel s and stride s (`[B, n, D]` ->
   `[B, n * s, D]`) and a ConvNeXt block (causal depthwise conv k=7, LayerNorm eps 1e-6, Linear D -> 4D, exact GELU,
   Linear 4D -> D, per-channel gamma, residual).
4. Decoder: causal conv k=7 D -> C0 (`decoder_dim`); per `upsample_rates` rate r a block: SnakeBeta, a transposed
   convolution of kernel 2r and stride r (C_b -> C_b / 2), then three residual units (SnakeBeta, causal conv k=7 with
   dilation 1, 3, 9, SnakeBeta, conv k=1, residual); SnakeBeta, causal conv k=7 -> 1 channel; clamp to [-1, 1].

Causality and lag. Every convolution is causal (zero left padding) and the attention is causal, so a sample never
depends on a later frame than the one it belongs to, with one exception: the reference trims `K - s` outputs from
both ends of each transposed convolution, so with K = 2r output `q * r + j` of a block reads inputs q and q + 1 --
one input step of look-ahead, and a call on n inputs returns (n - 1) * r outputs instead of n * r. Over the four
blocks that costs 8 -> 45 -> 184 -> 555 samples: `Code2WavConfig.lag`. Hence decoding a prefix of the codes gives a
prefix of the waveform, and streaming (`code2wav_decode`) can be exact.

Decoding -- one shot, streamed, or in re-decoded chunks -- is in `code2wav_decode`. This module holds the config,
the parameters (`Code2Wav`) and the conversion table (`code2wav_component`, the checkpoint's "code2wav"
component).

Parameter tree (`nnx.to_pure_dict(nnx.state(model))`), for L layers, D hidden, A = heads * head_dim,
G = kv_heads * head_dim, I intermediate, C_b = decoder_dim // 2**b. Linear weights are `[in, out]`; conv kernels
keep torch's layouts (Conv1d `[out, in / groups, k]`, ConvTranspose1d `[in, out, k]`):

    embedding [Q * V, D]
    layers: input_norm [L, D]  q_proj [L, D, A]  k_proj [L, D, G]  v_proj [L, D, G]  o_proj [L, A, D]
            (q/k/v/o_bias [L, A|G|D] when attention_bias)  attn_scale [L, D]  post_norm [L, D]
            gate_proj [L, D, I]  up_proj [L, D, I]  down_proj [L, I, D]  mlp_scale [L, D]
    norm [D]
    up{j}:  conv_kernel [D, D, s_j]  conv_bias [D]  dw_kernel [D, 1, 7]  dw_bias [D]  ln_scale [D]  ln_bias [D]
            fc1 [D, 4D]  fc1_bias [4D]  fc2 [4D, D]  fc2_bias [D]  gamma [D]
    conv_in_kernel [C0, D, 7]  conv_in_bias [C0]
    block{b}: alpha [C_b]  beta [C_b]  up_kernel [C_b, C_b+1, 2 r_b]  up_bias [C_b+1]
              res{u} (u = 0, 1, 2): alpha1 beta1 [C_b+1]  conv1_kernel [C_b+1, C_b+1, 7]  conv1_bias
                                    alpha2 beta2  conv2_kernel [C_b+1, C_b+1, 1]  conv2_bias
    out_alpha [C_n]  out_beta [C_n]  conv_out_kernel [1, C_n, 7]  conv_out_bias [1]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flax import nnx

from omnijax._checks import JsonConfig, check_config_fields
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.errors import UnsupportedConfigError
from omnijax.models.encoders.common import (
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    linear_rules,
    module_from_pure_dict,
    understood_attributes,
)
from omnijax.models.layers import new_param

__all__ = ["CODE2WAV_RULES_PREFIX", "DILATIONS", "KERNEL", "RESIDUAL_UNITS", "Code2Wav", "Code2WavConfig",
           "Code2WavConfigError", "code2wav_component", "code2wav_from_params", "output_length"]

CODE2WAV_RULES_PREFIX = "code2wav."
DILATIONS = (1, 3, 9)  # the residual units of every decoder block (fixed by the architecture)
KERNEL = 7  # every causal conv but the residual units' second (k=1)
RESIDUAL_UNITS = len(DILATIONS)


class Code2WavConfigError(ConfigAttributeError):
    """Inconsistent Code2Wav settings. Attributes: `attribute`, `value`."""

    subject = "Qwen3-Omni code2wav config"


@dataclasses.dataclass(frozen=True)
class Code2WavConfig(JsonConfig):
    """Static hyperparameters of Code2Wav (defaults: transformers' `Qwen3OmniMoeCode2WavConfig`).

    Attributes:
        codebook_size: entries V of each codebook.
        num_quantizers: codebooks Q per frame.
        hidden_size: width D of the embeddings, the pre-transformer and the upsampler.
        num_hidden_layers: pre-transformer layers L.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (divides the query heads).
        head_dim: per-head width.
        intermediate_size: MLP width I.
        sliding_window: frames W a frame attends to, itself included.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        attention_bias: q/k/v/o projections carry biases.
        upsampling_ratios: factors of the transposed convs (kernel = stride) before the decoder.
        upsample_rates: strides of the decoder blocks' transposed convs (kernel = 2 * stride).
        decoder_dim: channels C0 of the decoder's first conv; block b outputs `decoder_dim // 2**(b + 1)`.
        dtype: compute and parameter dtype name ("float32" or "bfloat16").
    """

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 3072
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    upsampling_ratios: tuple[int, ...] = (2, 2)
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    decoder_dim: int = 1536
    dtype: str = "float32"

    def __post_init__(self):
        check_config_fields(self, Code2WavConfigError,
                            positive=("codebook_size", "num_quantizers", "hidden_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                      "sliding_window", "decoder_dim"),
                            positive_tuples=("upsampling_ratios", "upsample_rates"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise Code2WavConfigError("num_key_value_heads", self.num_key_value_heads,
                                      f"does not divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise Code2WavConfigError("head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        if self.decoder_dim >> len(self.upsample_rates) < 1:
            raise Code2WavConfigError("decoder_dim", self.decoder_dim,
                                      f"halved {len(self.upsample_rates)} times leaves no channel")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise Code2WavConfigError("rms_norm_eps" if not self.rms_norm_eps > 0 else "rope_theta",
                                      self.rms_norm_eps if not self.rms_norm_eps > 0 else self.rope_theta,
                                      "must be positive")

    def channels(self, block: int) -> int:
        """Channels entering decoder block `block` (`len(upsample_rates)`: the last block's output)."""
        return self.decoder_dim // 2 ** block

    @property
    def samples_per_frame(self) -> int:
        """F: waveform samples per codec frame (1,920 for the release: 80 ms at 24 kHz)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def lag(self) -> int:
        """Samples a decode of T frames returns fewer than T * F (555 for the release's rates 8, 5, 4, 3)."""
        return self.samples_per_frame - output_length(self, 1)

    @classmethod
    def from_hf(cls, code2wav_config: Mapping[str, Any], dtype: str = "float32") -> "Code2WavConfig":
        """Reads a Hugging Face `Qwen3OmniMoeCode2WavConfig` (a dict or an object with `to_dict`).

        Missing attributes take the Hugging Face class defaults; `head_dim` defaults to hidden / heads as the
        reference computes it. Attributes the reference never reads (dropout, init scales, the release's
        quantizer-training leftovers) are ignored.

        Raises:
            UnsupportedConfigError: an attribute not understood, `hidden_act` other than silu, a RoPE type other
                than default, or a layer type other than sliding attention.
            Code2WavConfigError: the values are inconsistent.
        """
        data = dict(code2wav_config.to_dict() if hasattr(code2wav_config, "to_dict") else code2wav_config)
        values = understood_attributes(data, _HF_DEFAULTS, _HF_HARMLESS, error=UnsupportedConfigError,
                                       where="code2wav_config.", encoder="Code2Wav")
        act = data.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedConfigError("code2wav_config.hidden_act", act, "only the SiLU-gated MLP is implemented")
        for i, kind in enumerate(data.get("layer_types") or ()):
            if kind != "sliding_attention":
                raise UnsupportedConfigError(f"code2wav_config.layer_types[{i}]", kind,
                                             "the reference gives every layer sliding attention")
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise UnsupportedConfigError("code2wav_config.rope_parameters", rope, "must be an object")
        kind = rope.get("rope_type", rope.get("type", "default"))
        extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
        if kind != "default" or extra:
            raise UnsupportedConfigError("code2wav_config.rope_parameters", rope,
                                         "only default RoPE (rope_type, rope_theta) is implemented")
        theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
        head_dim = data.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
        ratios, rates = tuple(values.pop("upsampling_ratios")), tuple(values.pop("upsample_rates"))
        return cls(**values, head_dim=head_dim, rope_theta=float(theta), dtype=dtype, upsampling_ratios=ratios,
                   upsample_rates=rates)


# Math-bearing attributes read as they are, with the Hugging Face class defaults.
_HF_DEFAULTS = dict(codebook_size=2048, num_quantizers=16, hidden_size=1024, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=16, intermediate_size=3072, sliding_window=72,
                    rms_norm_eps=1e-5, attention_bias=False, upsampling_ratios=(2, 2), upsample_rates=(8, 5, 4, 3),
                    decoder_dim=1536)
# Checked above, or never read by the reference's forward (training-only, bookkeeping, RoPE tables computed on the
# fly, and the release's codec-training attributes: codebook_dim, the semantic quantizer, the VQ width).
_HF_HARMLESS = HF_PRETRAINED_CONFIG_ATTRIBUTES | frozenset("""
    hidden_act layer_types rope_parameters rope_scaling rope_theta head_dim attention_dropout
    layer_scale_initial_scale max_position_embeddings use_cache codebook_dim num_semantic_quantizers
    semantic_codebook_size vector_quantization_hidden_dimension
""".split())


def output_length(config: Code2WavConfig, frames: int) -> int:
    """Samples a decode of `frames` frames returns: each decoder block maps n inputs to (n - 1) * r outputs."""
    n = frames * math.prod(config.upsampling_ratios)
    for r in config.upsample_rates:
        n = max(n - 1, 0) * r
    return n


# ------------------------------------------------------------------------------------------------------- module


def _conv(rngs, dt, out_ch: int, in_ch: int, k: int) -> tuple[nnx.Param, nnx.Param]:
    return new_param((out_ch, in_ch, k), dt, rngs, std=0.2), new_param((out_ch,), dt, rngs, zeros=True)


class _Node(nnx.Module):
    """A named group of parameters (one upsampling stage, decoder block or residual unit)."""

    def __init__(self, **params: nnx.Param | nnx.Module):
        for name, value in params.items():
            setattr(self, name, value)


class Code2Wav(nnx.Module):
    """Qwen3-Omni Code2Wav: codes `[B, Q, T]` -> waveform (parameters: module docstring)."""

    def __init__(self, config: Code2WavConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        L, D, I = c.num_hidden_layers, c.hidden_size, c.intermediate_size
        A, G = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.config = config
        self.embedding = new_param((c.num_quantizers * c.codebook_size, D), dt, rngs)
        layers: dict[str, nnx.Param] = dict(
            input_norm=new_param((L, D), dt, rngs, ones=True), q_proj=new_param((L, D, A), dt, rngs),
            k_proj=new_param((L, D, G), dt, rngs), v_proj=new_param((L, D, G), dt, rngs),
            o_proj=new_param((L, A, D), dt, rngs), attn_scale=new_param((L, D), dt, rngs, ones=True),
            post_norm=new_param((L, D), dt, rngs, ones=True), gate_proj=new_param((L, D, I), dt, rngs),
            up_proj=new_param((L, D, I), dt, rngs), down_proj=new_param((L, I, D), dt, rngs),
            mlp_scale=new_param((L, D), dt, rngs, ones=True))
        if c.attention_bias:
            for name, width in (("q", A), ("k", G), ("v", G), ("o", D)):
                layers[f"{name}_bias"] = new_param((L, width), dt, rngs, zeros=True)
        self.layers = _Node(**layers)
        self.norm = new_param((D,), dt, rngs, ones=True)
        for j, s in enumerate(c.upsampling_ratios):
            kernel, bias = _conv(rngs, dt, D, D, s)
            dw_kernel, dw_bias = _conv(rngs, dt, D, 1, KERNEL)
            setattr(self, f"up{j}", _Node(
                conv_kernel=kernel, conv_bias=bias, dw_kernel=dw_kernel, dw_bias=dw_bias,
                ln_scale=new_param((D,), dt, rngs, ones=True), ln_bias=new_param((D,), dt, rngs, zeros=True),
                fc1=new_param((D, 4 * D), dt, rngs), fc1_bias=new_param((4 * D,), dt, rngs, zeros=True),
                fc2=new_param((4 * D, D), dt, rngs), fc2_bias=new_param((D,), dt, rngs, zeros=True),
                gamma=new_param((D,), dt, rngs, ones=True)))
        self.conv_in_kernel, self.conv_in_bias = _conv(rngs, dt, c.channels(0), D, KERNEL)
        for b, r in enumerate(c.upsample_rates):
            cin, cout = c.channels(b), c.channels(b + 1)
            up_kernel = new_param((cin, cout, 2 * r), dt, rngs, std=0.2)  # ConvTranspose1d layout [in, out, k]
            up_bias = new_param((cout,), dt, rngs, zeros=True)
            units = {}
            for u in range(RESIDUAL_UNITS):
                conv1_kernel, conv1_bias = _conv(rngs, dt, cout, cout, KERNEL)
                conv2_kernel, conv2_bias = _conv(rngs, dt, cout, cout, 1)
                units[f"res{u}"] = _Node(
                    alpha1=new_param((cout,), dt, rngs, zeros=True), beta1=new_param((cout,), dt, rngs, zeros=True),
                    conv1_kernel=conv1_kernel, conv1_bias=conv1_bias,
                    alpha2=new_param((cout,), dt, rngs, zeros=True), beta2=new_param((cout,), dt, rngs, zeros=True),
                    conv2_kernel=conv2_kernel, conv2_bias=conv2_bias)
            setattr(self, f"block{b}", _Node(
                alpha=new_param((cin,), dt, rngs, zeros=True), beta=new_param((cin,), dt, rngs, zeros=True),
                up_kernel=up_kernel, up_bias=up_bias, **units))
        out = c.channels(len(c.upsample_rates))
        self.out_alpha = new_param((out,), dt, rngs, zeros=True)
        self.out_beta = new_param((out,), dt, rngs, zeros=True)
        self.conv_out_kernel, self.conv_out_bias = _conv(rngs, dt, 1, out, KERNEL)


def code2wav_from_params(config: Code2WavConfig, params: Mapping[str, Any]) -> Code2Wav:
    """Builds a `Code2Wav` from a pure-dict parameter tree (e.g. `convert_in_memory(...)["code2wav"]`).

    Leaves are cast to the config's dtype; shapes must match the tree documented at the top of this module.
    """
    return module_from_pure_dict(lambda: Code2Wav(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="code2wav parameter", missing_error=KeyError)


# ---------------------------------------------------------------------------------------------------- name table


def code2wav_component(config: Code2WavConfig) -> Component:
    """The conversion table of Code2Wav for `config` (Hugging Face prefix `code2wav.`; the Qwen3-Omni converter
    writes it as the checkpoint's "code2wav" component). Conv kernels keep torch's layouts (no transform); Linear
    weights are transposed."""
    c = config
    bias = c.attention_bias
    layer = "pre_transformer.layers.{i}."
    rules: list[Rule] = [
        Rule("code_embedding.weight", "embedding", "E D"),
        Rule(layer + "input_layernorm.weight", "layers/input_norm", "D"),
        *linear_rules(layer + "self_attn.q_proj", "layers/q_proj", "layers/q_bias" if bias else None, "D A"),
        *linear_rules(layer + "self_attn.k_proj", "layers/k_proj", "layers/k_bias" if bias else None, "D G"),
        *linear_rules(layer + "self_attn.v_proj", "layers/v_proj", "layers/v_bias" if bias else None, "D G"),
        *linear_rules(layer + "self_attn.o_proj", "layers/o_proj", "layers/o_bias" if bias else None, "A D"),
        Rule(layer + "self_attn_layer_scale.scale", "layers/attn_scale", "D"),
        Rule(layer + "post_attention_layernorm.weight", "layers/post_norm", "D"),
        *linear_rules(layer + "mlp.gate_proj", "layers/gate_proj", None, "D I"),
        *linear_rules(layer + "mlp.up_proj", "layers/up_proj", None, "D I"),
        *linear_rules(layer + "mlp.down_proj", "layers/down_proj", None, "I D"),
        Rule(layer + "mlp_layer_scale.scale", "layers/mlp_scale", "D"),
        Rule("pre_transformer.norm.weight", "norm", "D"),
    ]
    for j in range(len(c.upsampling_ratios)):
        hf, ours = f"upsample.{j}.", f"up{j}/"
        rules += [Rule(hf + "0.conv.weight", ours + "conv_kernel", f"D D S{j}"),
                  Rule(hf + "0.conv.bias", ours + "conv_bias", "D"),
                  Rule(hf + "1.dwconv.conv.weight", ours + "dw_kernel", "D one K"),
                  Rule(hf + "1.dwconv.conv.bias", ours + "dw_bias", "D"),
                  Rule(hf + "1.norm.weight", ours + "ln_scale", "D"),
                  Rule(hf + "1.norm.bias", ours + "ln_bias", "D"),
                  *linear_rules(hf + "1.pwconv1", ours + "fc1", ours + "fc1_bias", "D X"),
                  *linear_rules(hf + "1.pwconv2", ours + "fc2", ours + "fc2_bias", "X D"),
                  Rule(hf + "1.gamma", ours + "gamma", "D")]
    rules += [Rule("decoder.0.conv.weight", "conv_in_kernel", "C0 D K"),
              Rule("decoder.0.conv.bias", "conv_in_bias", "C0")]
    for b in range(len(c.upsample_rates)):
        hf, ours, cin, cout = f"decoder.{b + 1}.block.", f"block{b}/", f"C{b}", f"C{b + 1}"
        rules += [Rule(hf + "0.alpha", ours + "alpha", cin), Rule(hf + "0.beta", ours + "beta", cin),
                  Rule(hf + "1.conv.weight", ours + "up_kernel", f"{cin} {cout} R{b}"),
                  Rule(hf + "1.conv.bias", ours + "up_bias", cout)]
        for u in range(RESIDUAL_UNITS):
            unit, res = f"{hf}{u + 2}.", f"{ours}res{u}/"
            rules += [Rule(unit + "act1.alpha", res + "alpha1", cout), Rule(unit + "act1.beta", res + "beta1", cout),
                      Rule(unit + "conv1.conv.weight", res + "conv1_kernel", f"{cout} {cout} K"),
                      Rule(unit + "conv1.conv.bias", res + "conv1_bias", cout),
                      Rule(unit + "act2.alpha", res + "alpha2", cout), Rule(unit + "act2.beta", res + "beta2", cout),
                      Rule(unit + "conv2.conv.weight", res + "conv2_kernel", f"{cout} {cout} one"),
                      Rule(unit + "conv2.conv.bias", res + "conv2_bias", cout)]
    nb = len(c.upsample_rates)
    rules += [Rule(f"decoder.{nb + 1}.alpha", "out_alpha", f"C{nb}"),
              Rule(f"decoder.{nb + 1}.beta", "out_beta", f"C{nb}"),
              Rule(f"decoder.{nb + 2}.conv.weight", "conv_out_kernel", f"one C{nb} K"),
              Rule(f"decoder.{nb + 2}.conv.bias", "conv_out_bias", "one")]
    dims = {"E": c.num_quantizers * c.codebook_size, "D": c.hidden_size, "A": c.num_attention_heads * c.head_dim,
            "G": c.num_key_value_heads * c.head_dim, "I": c.intermediate_size, "X": 4 * c.hidden_size, "K": KERNEL,
            "one": 1, **{f"S{j}": s for j, s in enumerate(c.upsampling_ratios)},
            **{f"C{b}": c.channels(b) for b in range(nb + 1)},
            **{f"R{b}": 2 * r for b, r in enumerate(c.upsample_rates)}}
    return Component(name="code2wav", prefix=CODE2WAV_RULES_PREFIX, rules=tuple(rules), dims=dims,
                     num_layers=c.num_hidden_layers)
