"""Qwen3-Omni audio encoder (AuT, the thinker's `audio_tower`) in Flax NNX.

The `[M, T]` log-mel features (100 frames per second) are cut into chunks of `2 * n_window` = 100 frames (1 s); the
last chunk may be shorter. Each chunk on its own runs three Conv2d (kernel 3, stride 2, padding 1, exact GELU) over
(mel, time), which gives 13 tokens per full chunk; their `[channels, mel / 8]` features are flattened and projected
to `d_model` by `conv_out`, and sinusoidal positions that restart at 0 in every chunk are added. Pre-LayerNorm
transformer layers (attention with q/k/v/out biases, exact-GELU MLP) follow, then `ln_post`, `proj1`, GELU, `proj2`.
`audio_token_count(T) = 13 * (T // 100) + ceil^3(T % 100)` (`ceil^3(n)`: n halved, rounded up, three times).

Attention windows. Attention runs within windows of `n_window_infer // (2 * n_window)` consecutive chunks (8 chunks
= 104 tokens = 8 s for Qwen3-Omni-30B-A3B). transformers 5.2.0 builds these windows (`cu_seqlens`) but honours them
only on its flash-attention path; its eager and sdpa paths attend across the whole clip. This module implements the
windowed attention, what deployments (flash attention, vLLM) compute. Both agree for clips of at most one window
(`n_window_infer` frames); longer clips differ from transformers' eager/sdpa output.

Padding, as the reference does it for one clip: when the clip has several chunks, the short last chunk is
zero-padded to 100 frames before the convolutions, so its last tokens see GELU(bias) of the padded positions; a clip
of a single chunk is not padded. The plan (`plan_audio`) reproduces both cases exactly by giving each chunk a conv
extent: conv activations beyond it are zeroed, which equals the reference's shorter padding. (transformers pads
the chunks of all clips of one call together, so there a clip under 100 frames batched with a longer one is padded
to 100 frames too; `encode_audio` gives what the reference computes for the clip alone.)

Variable lengths: `plan_audio` pads the clip to a bucket of chunks (a power of two, rounded up to whole windows), so
one compiled program serves every length in a bucket; padding tokens are masked out of attention and dropped.

Parameter pytree (`nnx.to_pure_dict(nnx.state(encoder))`), for L layers, M mel bins, C = downsample_hidden_size,
P = C * ceil^3(M), D = d_model, F = encoder_ffn_dim, O = output_dim. Linear weights are stored `[in, out]`; conv
kernels keep torch's `[out, in, kh, kw]` (OIHW) layout:

    conv1_kernel [C, 1, 3, 3]   conv1_bias [C]
    conv2_kernel [C, C, 3, 3]   conv2_bias [C]
    conv3_kernel [C, C, 3, 3]   conv3_bias [C]
    conv_out [P, D]                                  (no bias, as in the checkpoint)
    layers:
      attn_norm_scale [L, D]    attn_norm_bias [L, D]
      q_proj [L, D, D]          q_bias [L, D]
      k_proj [L, D, D]          k_bias [L, D]
      v_proj [L, D, D]          v_bias [L, D]
      o_proj [L, D, D]          o_bias [L, D]
      mlp_norm_scale [L, D]     mlp_norm_bias [L, D]
      fc1 [L, D, F]             fc1_bias [L, F]
      fc2 [L, F, D]             fc2_bias [L, D]
    post_norm_scale [D]         post_norm_bias [D]
    proj1 [D, D]                proj1_bias [D]
    proj2 [D, O]                proj2_bias [O]

The sinusoidal position table is computed from the config, not stored (it is not in the checkpoint either).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import (
    StackedLayers,
    dense,
    layer_norm,
    linear_rules,
    module_from_pure_dict,
    norm_rules,
)
from omnijax.models.encoders.log_mel import FeatureShapeError
from omnijax.models.encoders.whisper import (
    UnsupportedAudioConfigError,
    gelu_exact,
    sinusoid_positions,
)
from omnijax.models.layers import new_param
from omnijax.models.qwen3_omni.audio_config import (
    QWEN3_OMNI_30B_A3B_AUDIO,
    Qwen3AudioConfig,
    Qwen3AudioConfigError,
    audio_token_count,
    ceil_half,
    conv_tokens,
)

__all__ = ["AUDIO_RULES", "AudioPlan", "FeatureShapeError", "QWEN3_OMNI_30B_A3B_AUDIO", "Qwen3AudioConfig",
           "Qwen3AudioConfigError", "Qwen3AudioEncoder", "UnsupportedAudioConfigError", "audio_component",
           "audio_token_count", "encode_audio", "encoder_from_params", "plan_audio"]

_MASK = -1e30  # finite, so windows holding only padding give a uniform (not NaN) softmax


# --------------------------------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class AudioPlan:
    """How one clip of `frames` frames is laid out for the compiled program (host side, from the frame count).

    Attributes:
        frames: valid mel frames T of the clip.
        tokens: output tokens (`audio_token_count(frames)`); the first `tokens` rows of the program's output.
        num_chunks: chunks holding clip frames.
        padded_chunks: chunks the program runs on (the bucket): a multiple of `window_chunks`.
        window_chunks: chunks per attention window in the program (`min(config.window_chunks, padded_chunks)`).
        conv_frames: `[padded_chunks]` int32, frames each chunk's convolutions treat as present (zeros beyond the
            clip included): 100 for every chunk of a multi-chunk clip, `frames` for a single-chunk clip, 0 for
            bucket padding.
        token_valid: `[padded_chunks, tokens_per_chunk]` bool, which chunk tokens belong to the clip.
        window_ids: `[padded_chunks]` int32, attention window of each chunk.
        cu_seqlens: the reference's window boundaries in clip tokens (its `cu_seqlens`), for checks.
    """

    frames: int
    tokens: int
    num_chunks: int
    padded_chunks: int
    window_chunks: int
    conv_frames: np.ndarray
    token_valid: np.ndarray
    window_ids: np.ndarray
    cu_seqlens: tuple[int, ...]


def _bucket(num_chunks: int, window: int) -> int:
    """Chunks a clip of `num_chunks` chunks runs on: the next power of two, rounded up to whole windows."""
    padded = 1 << max(0, num_chunks - 1).bit_length()
    return padded if padded <= window else -(-padded // window) * window


def plan_audio(config: Qwen3AudioConfig, frames: int, *, bucket: bool = True) -> AudioPlan:
    """The chunk layout, padding masks and attention windows of a clip of `frames` frames.

    Args:
        config: the encoder config.
        frames: mel frames of the clip, at least 1.
        bucket: pad to a power-of-two number of chunks (fewer compiles); False pads to whole windows only.

    Raises:
        FeatureShapeError: `frames` is below 1.
    """
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)):
        raise FeatureShapeError(f"frames must be an integer, got {frames!r}")
    frames = int(frames)
    if frames < 1:
        raise FeatureShapeError(f"audio features have {frames} frames; at least 1 (10 ms) is needed for a token")
    W, T, k = config.chunk_frames, config.tokens_per_chunk, config.window_chunks
    num_chunks = -(-frames // W)
    padded = _bucket(num_chunks, k) if bucket else (num_chunks if num_chunks <= k else -(-num_chunks // k) * k)
    window = min(k, padded)
    lengths = np.zeros(padded, np.int64)  # frames of the clip in each chunk
    lengths[:num_chunks] = W
    lengths[num_chunks - 1] = frames - (num_chunks - 1) * W
    # The reference pads every chunk to the longest one: 100 frames unless the clip is a single chunk.
    conv_frames = np.where(lengths > 0, lengths.max(), 0).astype(np.int32)
    chunk_tokens = conv_tokens(lengths)  # [padded]
    token_valid = np.arange(T)[None, :] < chunk_tokens[:, None]
    tokens = int(chunk_tokens.sum())
    assert tokens == audio_token_count(frames), (tokens, frames)
    # The reference's windows: `max chunk tokens * window chunks` clip tokens each. Only the last chunk can be
    # short, so they are groups of `window` whole chunks, which is how the program lays them out.
    size = int(chunk_tokens.max()) * k
    cu_seqlens = tuple(range(0, tokens, size)) + (tokens,)
    chunk_starts = np.concatenate([[0], np.cumsum(chunk_tokens)])
    assert cu_seqlens == tuple(int(chunk_starts[c]) for c in range(0, num_chunks, k)) + (tokens,), frames
    window_ids = (np.arange(padded) // window).astype(np.int32)
    return AudioPlan(frames, tokens, num_chunks, padded, window, conv_frames, token_valid, window_ids, cu_seqlens)


# ------------------------------------------------------------------------------------------------------- module


def _conv2d_gelu(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray, dtype) -> jnp.ndarray:
    """Conv2d (kernel 3, stride 2, padding 1) + exact GELU: `[N, I, H, W]` -> `[N, O, ceil(H/2), ceil(W/2)]`,
    kernel `[O, I, 3, 3]`, accumulated in float32 and returned in `dtype`."""
    out = jax.lax.conv_general_dilated(x, kernel, window_strides=(2, 2), padding=((1, 1), (1, 1)),
                                       dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                       preferred_element_type=jnp.float32)
    return gelu_exact(out + bias.astype(jnp.float32)[None, :, None, None]).astype(dtype)


def _layer(x: jnp.ndarray, p: Mapping[str, jnp.ndarray], bias: jnp.ndarray, num_heads: int, dtype) -> jnp.ndarray:
    """One pre-LayerNorm encoder layer on `[B, S, D]` windows; `bias` `[B, 1, 1, S]` masks padding keys."""
    B, S, D = x.shape
    hd = D // num_heads
    n = layer_norm(x, p["attn_norm_scale"], p["attn_norm_bias"])
    q = dense(n, p["q_proj"], p["q_bias"], dtype).reshape(B, S, num_heads, hd)
    k = dense(n, p["k_proj"], p["k_bias"], dtype).reshape(B, S, num_heads, hd)
    v = dense(n, p["v_proj"], p["v_bias"], dtype).reshape(B, S, num_heads, hd)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * hd ** -0.5 + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)  # [B, heads, S, S]
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(dtype)
    x = x + dense(attn.reshape(B, S, D), p["o_proj"], p["o_bias"], dtype)
    n = layer_norm(x, p["mlp_norm_scale"], p["mlp_norm_bias"])
    return x + dense(gelu_exact(dense(n, p["fc1"], p["fc1_bias"], dtype)), p["fc2"], p["fc2_bias"], dtype)


class Qwen3AudioLayers(StackedLayers):
    """All encoder layers' parameters, stacked along a leading `layers` axis (scanned by `_layer`)."""

    def __init__(self, config: Qwen3AudioConfig, *, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        L, D, F = c.encoder_layers, c.d_model, c.encoder_ffn_dim
        self.attn_norm_scale = new_param((L, D), dt, rngs, ones=True)
        self.attn_norm_bias = new_param((L, D), dt, rngs, zeros=True)
        for name in ("q", "k", "v", "o"):
            setattr(self, f"{name}_proj", new_param((L, D, D), dt, rngs))
            setattr(self, f"{name}_bias", new_param((L, D), dt, rngs, zeros=True))
        self.mlp_norm_scale = new_param((L, D), dt, rngs, ones=True)
        self.mlp_norm_bias = new_param((L, D), dt, rngs, zeros=True)
        self.fc1 = new_param((L, D, F), dt, rngs)
        self.fc1_bias = new_param((L, F), dt, rngs, zeros=True)
        self.fc2 = new_param((L, F, D), dt, rngs)
        self.fc2_bias = new_param((L, D), dt, rngs, zeros=True)


class Qwen3AudioEncoder(nnx.Module):
    """Qwen3-Omni audio tower: chunked log-mel features -> LLM-width audio tokens (parameters: module docstring)."""

    def __init__(self, config: Qwen3AudioConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        C, D, O = c.downsample_hidden_size, c.d_model, c.output_dim
        self.config = config
        self.conv1_kernel = new_param((C, 1, 3, 3), dt, rngs)
        self.conv1_bias = new_param((C,), dt, rngs, zeros=True)
        self.conv2_kernel = new_param((C, C, 3, 3), dt, rngs)
        self.conv2_bias = new_param((C,), dt, rngs, zeros=True)
        self.conv3_kernel = new_param((C, C, 3, 3), dt, rngs)
        self.conv3_bias = new_param((C,), dt, rngs, zeros=True)
        self.conv_out = new_param((c.conv_out_features, D), dt, rngs)
        self.layers = Qwen3AudioLayers(config, rngs=rngs)
        self.post_norm_scale = new_param((D,), dt, rngs, ones=True)
        self.post_norm_bias = new_param((D,), dt, rngs, zeros=True)
        self.proj1 = new_param((D, D), dt, rngs)
        self.proj1_bias = new_param((D,), dt, rngs, zeros=True)
        self.proj2 = new_param((D, O), dt, rngs)
        self.proj2_bias = new_param((O,), dt, rngs, zeros=True)

    def encode_chunks(self, chunks: jnp.ndarray, conv_frames: jnp.ndarray, token_valid: jnp.ndarray) -> jnp.ndarray:
        """Runs the tower on zero-padded chunks laid out by `plan_audio`.

        Args:
            chunks: `[N, M, 100]` features; frame `f` of the clip at `chunks[f // 100, :, f % 100]`, zeros elsewhere.
            conv_frames: `[N]` int32, `AudioPlan.conv_frames`.
            token_valid: `[N, 13]` bool, `AudioPlan.token_valid`; N must be a multiple of the window's chunks
                (`min(config.window_chunks, N)`).

        Returns:
            `[N * 13, O]` tokens in the compute dtype; the clip's are the first `AudioPlan.tokens`.
        """
        c = self.config
        dt = c.jnp_dtype
        N = chunks.shape[0]
        h = chunks.astype(dt)[:, None]  # [N, 1, M, W]
        extent = conv_frames
        for i in (1, 2, 3):
            h = _conv2d_gelu(h, getattr(self, f"conv{i}_kernel")[...], getattr(self, f"conv{i}_bias")[...], dt)
            extent = ceil_half(extent)  # positions this chunk has at this stage; zeros beyond, as in the reference
            h = h * (jnp.arange(h.shape[-1])[None, :] < extent[:, None]).astype(dt)[:, None, None, :]
        _, ch, f, t = h.shape  # [N, C, M/8, 13]
        h = h.transpose(0, 3, 1, 2).reshape(N, t, ch * f)  # [N, 13, P], features ordered (channel, mel)
        h = dense(h, self.conv_out[...], None, dt)  # [N, 13, D]
        h = h + jnp.asarray(sinusoid_positions(t, c.d_model)).astype(dt)[None]  # positions restart per chunk
        window = min(c.window_chunks, N)
        if N % window:
            raise ValueError(f"{N} chunks are not whole attention windows of {window} chunks")
        h = h.reshape(N // window, window * t, -1)  # [windows, S, D]
        bias = jnp.where(token_valid.reshape(N // window, 1, 1, window * t), 0.0, _MASK)  # [windows, 1, 1, S]

        def layer(x, p):
            return _layer(x, p, bias, c.encoder_attention_heads, dt), None

        h, _ = jax.lax.scan(layer, h, self.layers.stacked())
        h = layer_norm(h.reshape(N * t, -1), self.post_norm_scale[...], self.post_norm_bias[...])  # [N * 13, D]
        h = gelu_exact(dense(h, self.proj1[...], self.proj1_bias[...], dt))
        return dense(h, self.proj2[...], self.proj2_bias[...], dt)  # [N * 13, O]


@cached_jit(static_argnames=("graphdef",))
def _encode_chunks(graphdef, params, chunks, conv_frames, token_valid):
    return nnx.merge(graphdef, params).encode_chunks(chunks, conv_frames, token_valid)


def encode_audio(encoder: Qwen3AudioEncoder | tuple[Any, Any], features: npt.ArrayLike, *,
                 bucket: bool = True) -> jnp.ndarray:
    """Encodes one clip's features into LLM-width audio tokens (jitted; one compile per chunk bucket).

    Args:
        encoder: a `Qwen3AudioEncoder`, or its `(graphdef, params)` from `nnx.split`.
        features: `[num_mel_bins, T]` log-mel features, T >= 1.
        bucket: pad to a power-of-two number of chunks (fewer compiles); False pads to whole windows only.

    Returns:
        `[audio_token_count(T), output_dim]` tokens in the encoder's compute dtype.

    Raises:
        FeatureShapeError: features are not 2D, have a mel-bin count other than the config's, have no frame, or
            hold NaN/inf.
    """
    graphdef, params = encoder if isinstance(encoder, tuple) else nnx.split(encoder)
    config: Qwen3AudioConfig = nnx.merge(graphdef, params).config if isinstance(encoder, tuple) else encoder.config
    feats = np.asarray(features)
    if feats.ndim != 2:
        raise FeatureShapeError(f"audio features must be [num_mel_bins, frames], got shape {feats.shape}")
    M = config.num_mel_bins
    if feats.shape[0] != M:
        hint = "; features look transposed ([frames, mel])" if feats.shape[1] == M else ""
        raise FeatureShapeError(f"audio features have {feats.shape[0]} mel bins but the encoder expects {M}{hint}")
    plan = plan_audio(config, feats.shape[1], bucket=bucket)
    if not np.isfinite(feats).all():
        raise FeatureShapeError("audio features hold NaN or inf")
    W = config.chunk_frames
    chunks = np.zeros((plan.padded_chunks * W, M), np.float32)
    chunks[:plan.frames] = feats.T
    chunks = chunks.reshape(plan.padded_chunks, W, M).transpose(0, 2, 1)  # [N, M, W]
    out = _encode_chunks(graphdef, params, jnp.asarray(chunks), jnp.asarray(plan.conv_frames),
                         jnp.asarray(plan.token_valid))
    return out[:plan.tokens]


def encoder_from_params(config: Qwen3AudioConfig, params: Mapping[str, Any]) -> Qwen3AudioEncoder:
    """Builds a `Qwen3AudioEncoder` from a pure-dict parameter tree (e.g. `convert_in_memory(...)["audio"]`).

    Leaves are cast to the config's dtype; shapes must match the tree documented at the top of this module.
    """
    return module_from_pure_dict(lambda: Qwen3AudioEncoder(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="audio parameter", missing_error=KeyError)


# ---------------------------------------------------------------------------------------------------- name table
# Symbols: C conv channels, I conv1 input channels (1), K kernel side (3), P conv_out input (C * ceil^3(M)),
# D d_model, F ffn, O output. Conv kernels keep torch's OIHW layout (no transform).
_LAYER = "layers.{i}."
AUDIO_RULES: tuple[Rule, ...] = (
    Rule("conv2d1.weight", "conv1_kernel", "C I K K"),
    Rule("conv2d1.bias", "conv1_bias", "C"),
    Rule("conv2d2.weight", "conv2_kernel", "C C K K"),
    Rule("conv2d2.bias", "conv2_bias", "C"),
    Rule("conv2d3.weight", "conv3_kernel", "C C K K"),
    Rule("conv2d3.bias", "conv3_bias", "C"),
    *linear_rules("conv_out", "conv_out", None, "P D"),
    *norm_rules(_LAYER + "self_attn_layer_norm", "layers/attn_norm"),
    *linear_rules(_LAYER + "self_attn.q_proj", "layers/q_proj", "layers/q_bias", "D D"),
    *linear_rules(_LAYER + "self_attn.k_proj", "layers/k_proj", "layers/k_bias", "D D"),
    *linear_rules(_LAYER + "self_attn.v_proj", "layers/v_proj", "layers/v_bias", "D D"),
    *linear_rules(_LAYER + "self_attn.out_proj", "layers/o_proj", "layers/o_bias", "D D"),
    *norm_rules(_LAYER + "final_layer_norm", "layers/mlp_norm"),
    *linear_rules(_LAYER + "fc1", "layers/fc1", "layers/fc1_bias", "D F"),
    *linear_rules(_LAYER + "fc2", "layers/fc2", "layers/fc2_bias", "F D"),
    *norm_rules("ln_post", "post_norm"),
    *linear_rules("proj1", "proj1", "proj1_bias", "D D"),
    *linear_rules("proj2", "proj2", "proj2_bias", "D O"),
)


def audio_component(config: Qwen3AudioConfig) -> Component:
    """The conversion table of the audio tower for `config` (HF prefix `audio_tower.` below `thinker.`)."""
    dims = {"C": config.downsample_hidden_size, "I": 1, "K": 3, "P": config.conv_out_features, "D": config.d_model,
            "F": config.encoder_ffn_dim, "O": config.output_dim}
    return Component(name="audio", prefix="audio_tower.", rules=AUDIO_RULES, dims=dims,
                     num_layers=config.encoder_layers)
