"""Qwen2.5-Omni audio encoder (the thinker's `audio_tower`) in Flax NNX.

A Whisper-like tower. The `[M, T]` log-mel features (100 frames per second, see `audio_features.log_mel`) are cut
into chunks of `2 * n_window` frames (2 s; the last chunk may be shorter). Each chunk on its own runs
conv1 (k3, p1) + GELU, conv2 (k3, stride 2, p1) + GELU, giving `n_window` tokens, and gets sinusoidal positions
that restart at 0. Pre-LayerNorm transformer layers then attend within each chunk only (block-diagonal attention).
Finally the tokens of the whole clip are average-pooled in pairs, layer-normed and projected to the LLM width:
`audio_token_count(T) = ((T - 1) // 2 + 1 - 2) // 2 + 1`, 25 tokens per second.

Variable lengths: `encode_audio` pads the features to a power-of-two number of chunks and passes the true frame
count as a traced scalar, so clips compile once per chunk bucket (1, 2, 4, 8, ... chunks), not once per length.
Padding frames are zeroed after conv1 and masked out of attention, so they never change valid tokens.

Parameter pytree (`nnx.state(encoder).to_pure_dict()`), for L layers, M mel bins, D = d_model, F = encoder_ffn_dim,
O = output_dim (Linear weights are stored `[in, out]`, conv kernels `[k, in, out]`):

    conv1_kernel [3, M, D]    conv1_bias [D]
    conv2_kernel [3, D, D]    conv2_bias [D]
    layers:
      attn_norm_scale [L, D]  attn_norm_bias [L, D]
      q_proj [L, D, D]        q_bias [L, D]
      k_proj [L, D, D]                              (no bias, as in the checkpoint)
      v_proj [L, D, D]        v_bias [L, D]
      o_proj [L, D, D]        o_bias [L, D]
      mlp_norm_scale [L, D]   mlp_norm_bias [L, D]
      fc1 [L, D, F]           fc1_bias [L, F]
      fc2 [L, F, D]           fc2_bias [L, D]
    post_norm_scale [D]       post_norm_bias [D]
    proj [D, O]               proj_bias [O]

The sinusoidal position table is computed from the config, not stored. The checkpoint's
`audio_tower.audio_bos_eos_token.weight` is unused by the thinker and has no parameter here: converters skip it.

The Whisper-style pieces (`conv1d_k3`, `whisper_layer`, `AudioLayers`, `WHISPER_*_RULES` and the config checks) serve
MiniCPM-o's Whisper encoder too (`omnijax.models.minicpmo.audio`).
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
from jax.typing import DTypeLike

from omnijax._checks import JsonConfig, check_config_fields
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.errors import UnsupportedConfigError
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import (
    StackedLayers,
    dense,
    layer_norm,
    linear_rules,
    module_from_pure_dict,
    norm_rules,
)
from omnijax.models.encoders.log_mel import (
    AudioInputError,
    FeatureShapeError,
    InvalidPcmError,
    UnsupportedSampleRateError,
    log_mel,
)
from omnijax.models.layers import new_param

__all__ = ["AUDIO_RULES", "AudioConfig", "AudioEncoder", "AudioInputError", "FeatureShapeError", "InvalidPcmError",
           "UnsupportedAudioConfigError", "UnsupportedSampleRateError", "audio_component", "audio_token_count",
           "encode_audio", "encoder_from_params", "log_mel"]

_MASK = -1e30  # finite, so fully padded chunks give a uniform (not NaN) softmax

# Hugging Face audio config attributes with no effect on inference.
_HARMLESS = ("dropout", "attention_dropout", "activation_dropout", "initializer_range")
_MODEL_TYPE = "qwen2_5_omni_audio_encoder"
UNUSED_HF_TENSORS = ("audio_bos_eos_token.weight",)  # below the `audio_tower.` prefix; converters skip these


class UnsupportedAudioConfigError(UnsupportedConfigError, ValueError):
    """An audio config attribute changes the encoder's math in a way omnijax does not implement."""


def check_dtype_and_sizes(config: Any, not_sizes: tuple[str, ...] = ()) -> None:
    """Refuses an audio config whose `dtype` is unknown or whose other fields (but `not_sizes`) are not positive
    integers (a bool is not one).

    Raises:
        ValueError: naming the first offending field.
    """
    name = type(config).__name__

    def error(field: str, value: Any, reason: str) -> ValueError:
        return ValueError(f"{name}.{field} {reason}, got {value!r}")

    check_config_fields(config, error, positive=[f.name for f in dataclasses.fields(config)
                                                 if f.name not in ("dtype", *not_sizes)])


def check_whisper_attributes(audio: Mapping[str, Any], *, model_type: str, implemented: str, encoder_layers: int,
                             layer_norm_eps: float | None = None, where: str = "audio_config.") -> None:
    """Refuses the attributes of a Hugging Face Whisper-style audio config that change the encoder's math in ways
    omnijax does not implement.

    Args:
        audio: the audio config as a mapping.
        model_type: the only `model_type` accepted (also the default when absent).
        implemented: the reason given when `model_type` differs.
        encoder_layers: the layers read from `encoder_layers`; `num_hidden_layers`, when set, must agree.
        layer_norm_eps: when given, the only `layer_norm_eps` accepted (the reference may hard-code its norms').
        where: prefix of the attribute names in the errors.

    Raises:
        UnsupportedAudioConfigError: another `model_type`; an `activation_function` other than `gelu`;
            `scale_embedding` true; a different `layer_norm_eps`; or `num_hidden_layers != encoder_layers`.
    """
    found = audio.get("model_type", model_type)
    if found != model_type:
        raise UnsupportedAudioConfigError(where + "model_type", found, implemented)
    act = audio.get("activation_function", "gelu")
    if act != "gelu":
        raise UnsupportedAudioConfigError(where + "activation_function", act,
                                          "only the exact (erf) GELU feed-forward is implemented")
    if audio.get("scale_embedding", False):
        raise UnsupportedAudioConfigError(
            where + "scale_embedding", audio["scale_embedding"],
            "the flag asks for embeddings scaled by sqrt(d_model) but the reference encoder never applies the "
            "scale, so the checkpoint's intended math is ambiguous")
    eps = audio.get("layer_norm_eps", layer_norm_eps)
    if layer_norm_eps is not None and eps != layer_norm_eps:
        raise UnsupportedAudioConfigError(where + "layer_norm_eps", eps,
                                          f"the reference's LayerNorms always use eps {layer_norm_eps:g}")
    layers = audio.get("num_hidden_layers", encoder_layers)
    if layers != encoder_layers:
        raise UnsupportedAudioConfigError(where + "num_hidden_layers", layers,
                                          f"differs from encoder_layers={encoder_layers}")


@dataclasses.dataclass(frozen=True)
class AudioConfig(JsonConfig):
    """Static hyperparameters of the Qwen2.5-Omni audio encoder.

    Attributes:
        num_mel_bins: mel bins M of the input features.
        d_model: encoder width D; divisible by the head count and even (sinusoidal positions).
        encoder_layers: transformer layers L.
        encoder_attention_heads: attention heads.
        encoder_ffn_dim: feed-forward width F.
        n_window: half the chunk length in mel frames; a chunk of `2 * n_window` frames gives `n_window` tokens
            before pooling (100: 2 s chunks).
        output_dim: output width O (the LLM hidden size).
        max_source_positions: rows of the sinusoidal position table; at least `n_window`.
        dtype: compute dtype name ("float32" or "bfloat16"); parameters are stored in it too.
    """

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    n_window: int = 100
    output_dim: int = 3584
    max_source_positions: int = 1500
    dtype: str = "float32"

    def __post_init__(self):
        check_dtype_and_sizes(self)
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of "
                             f"encoder_attention_heads={self.encoder_attention_heads}")
        if self.d_model % 2 or self.d_model < 4:
            raise ValueError(f"d_model must be even and at least 4 for sinusoidal positions, got {self.d_model}")
        if self.n_window > self.max_source_positions:
            raise ValueError(f"n_window={self.n_window} exceeds max_source_positions={self.max_source_positions}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def chunk_frames(self) -> int:
        """Mel frames per chunk (`2 * n_window`)."""
        return 2 * self.n_window

    @classmethod
    def from_hf(cls, audio_config: Mapping[str, Any], dtype: str = "float32") -> "AudioConfig":
        """Reads a Hugging Face `Qwen2_5OmniAudioEncoderConfig` (a dict or an object with `to_dict`).

        Missing attributes take the Hugging Face defaults. Dropout rates and `initializer_range` are ignored (no
        effect at inference), as are the generic attributes every Hugging Face config carries.

        Raises:
            UnsupportedAudioConfigError: an attribute changes the math in a way not implemented here: a
                `model_type` other than `qwen2_5_omni_audio_encoder` (e.g. Qwen3-Omni's or Qwen2-Audio's tower),
                `activation_function` other than `gelu`, `scale_embedding` true, or `num_hidden_layers` differing
                from `encoder_layers`.
        """
        data = dict(audio_config.to_dict() if hasattr(audio_config, "to_dict") else audio_config)
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "dtype"}
        values = {name: data.get(name, default) for name, default in fields.items()}
        check_whisper_attributes(data, model_type=_MODEL_TYPE, encoder_layers=values["encoder_layers"],
                                 implemented=f"only the Qwen2.5-Omni audio tower ({_MODEL_TYPE}) is implemented")
        return cls(**values, dtype=dtype)


QWEN2_5_OMNI_7B_AUDIO = AudioConfig()
QWEN2_5_OMNI_3B_AUDIO = AudioConfig(output_dim=2048)


def audio_token_count(frames: int) -> int:
    """LLM tokens for `frames` mel frames: `((frames - 1) // 2 + 1 - 2) // 2 + 1` (25 per second; 0 below 3 frames)."""
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 0:
        raise ValueError(f"frames must be a non-negative integer, got {frames!r}")
    if frames == 0:
        return 0
    return ((int(frames) - 1) // 2 + 1 - 2) // 2 + 1


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """`[length, channels]` float32 table: sin of `pos * exp(-k log(max_timescale) / (channels/2 - 1))`, then cos."""
    # Exponent and angle rounded to float32 as the reference computes them; sin/cos of those angles in float64.
    increment = np.float32(-np.log(max_timescale) / (channels // 2 - 1))
    exponent = (increment * np.arange(channels // 2, dtype=np.float32)).astype(np.float64)
    inv_timescales = np.exp(exponent).astype(np.float32)
    scaled = (np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :]).astype(np.float64)
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


# ------------------------------------------------------------------------------ Whisper-style encoder pieces
# Shared with MiniCPM-o's Whisper encoder (`omnijax.models.minicpmo.audio`): its config has the same size fields.


def gelu_exact(x: jnp.ndarray) -> jnp.ndarray:
    """The exact (erf) GELU computed in float32, cast back to `x.dtype`."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


def conv1d_k3(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray, stride: int, dtype: DTypeLike) -> jnp.ndarray:
    """Conv1d over time, kernel 3, padding 1: `[B, T, I]` -> `[B, (T - 1) // stride + 1, O]` (kernel `[3, I, O]`),
    accumulated in float32 and returned in `dtype`."""
    t_out = (x.shape[1] - 1) // stride + 1
    xp = jnp.pad(x, ((0, 0), (1, 1), (0, 0)))  # [B, T + 2, I]
    taps = jnp.stack([xp[:, k:k + stride * (t_out - 1) + 1:stride] for k in range(3)], axis=2)  # [B, T_out, 3, I]
    out = jnp.einsum("btki,kio->bto", taps, kernel, preferred_element_type=jnp.float32)
    return (out + bias.astype(jnp.float32)).astype(dtype)


def whisper_layer(x: jnp.ndarray, p: Mapping[str, jnp.ndarray], bias: jnp.ndarray, num_heads: int, dtype: DTypeLike,
                  kv_cache: tuple[jnp.ndarray, jnp.ndarray] | None = None, cache_start: int | jax.Array | None = None
                  ) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray] | None]:
    """One pre-LayerNorm Whisper encoder layer: self-attention (q/v/out projections with bias, k without), then an
    exact-GELU feed-forward, each with a residual connection.

    Args:
        x: `[B, S, D]` hidden states.
        p: the layer's parameters (one slice of `AudioLayers.stacked()`).
        bias: additive attention mask broadcastable to `[B, heads, S, K]`.
        num_heads: attention heads (head width `D // num_heads`).
        dtype: the compute dtype.
        kv_cache: optional `(keys, values)` `[B, K, heads, head_dim]`: this call's keys and values are written at
            `cache_start` (a possibly traced int) and attention runs over the whole cache. Without one, K = S.

    Returns:
        `(x [B, S, D], the updated kv_cache or None)`.
    """
    B, S, D = x.shape
    hd = D // num_heads
    scale = hd ** -0.5
    n = layer_norm(x, p["attn_norm_scale"], p["attn_norm_bias"])
    q = dense(n, p["q_proj"], p["q_bias"], dtype).reshape(B, S, num_heads, hd)
    k = dense(n, p["k_proj"], None, dtype).reshape(B, S, num_heads, hd)
    v = dense(n, p["v_proj"], p["v_bias"], dtype).reshape(B, S, num_heads, hd)
    if kv_cache is not None:
        cached_k, cached_v = kv_cache
        k = jax.lax.dynamic_update_slice_in_dim(cached_k, k.astype(cached_k.dtype), cache_start, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(cached_v, v.astype(cached_v.dtype), cache_start, axis=1)
        kv_cache = (k, v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)  # [B, heads, S, K]
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(dtype)
    x = x + dense(attn.reshape(B, S, num_heads * hd), p["o_proj"], p["o_bias"], dtype)
    n = layer_norm(x, p["mlp_norm_scale"], p["mlp_norm_bias"])
    x = x + dense(gelu_exact(dense(n, p["fc1"], p["fc1_bias"], dtype)), p["fc2"], p["fc2_bias"], dtype)
    return x, kv_cache


class AudioLayers(StackedLayers):
    """All Whisper encoder layers' parameters, stacked along a leading `layers` axis (`stacked()` is what
    `whisper_layer` is scanned over). `config` needs `encoder_layers`, `d_model`, `encoder_ffn_dim` and `dtype`."""

    def __init__(self, config: AudioConfig, *, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        L, D, F = c.encoder_layers, c.d_model, c.encoder_ffn_dim
        self.attn_norm_scale = new_param((L, D), dt, rngs, ones=True)
        self.attn_norm_bias = new_param((L, D), dt, rngs, zeros=True)
        self.q_proj = new_param((L, D, D), dt, rngs)
        self.q_bias = new_param((L, D), dt, rngs, zeros=True)
        self.k_proj = new_param((L, D, D), dt, rngs)
        self.v_proj = new_param((L, D, D), dt, rngs)
        self.v_bias = new_param((L, D), dt, rngs, zeros=True)
        self.o_proj = new_param((L, D, D), dt, rngs)
        self.o_bias = new_param((L, D), dt, rngs, zeros=True)
        self.mlp_norm_scale = new_param((L, D), dt, rngs, ones=True)
        self.mlp_norm_bias = new_param((L, D), dt, rngs, zeros=True)
        self.fc1 = new_param((L, D, F), dt, rngs)
        self.fc1_bias = new_param((L, F), dt, rngs, zeros=True)
        self.fc2 = new_param((L, F, D), dt, rngs)
        self.fc2_bias = new_param((L, D), dt, rngs, zeros=True)


class AudioEncoder(nnx.Module):
    """Qwen2.5-Omni audio tower: chunked log-mel features -> LLM-width audio tokens."""

    def __init__(self, config: AudioConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        M, D, O = c.num_mel_bins, c.d_model, c.output_dim
        self.config = config
        self.conv1_kernel = new_param((3, M, D), dt, rngs)
        self.conv1_bias = new_param((D,), dt, rngs, zeros=True)
        self.conv2_kernel = new_param((3, D, D), dt, rngs)
        self.conv2_bias = new_param((D,), dt, rngs, zeros=True)
        self.layers = AudioLayers(config, rngs=rngs)
        self.post_norm_scale = new_param((D,), dt, rngs, ones=True)
        self.post_norm_bias = new_param((D,), dt, rngs, zeros=True)
        self.proj = new_param((D, O), dt, rngs)
        self.proj_bias = new_param((O,), dt, rngs, zeros=True)

    def encode_chunks(self, chunks: jnp.ndarray, num_frames: jnp.ndarray) -> jnp.ndarray:
        """Runs the tower on zero-padded chunks.

        Args:
            chunks: `[C, 2 * n_window, M]` features, frame `f` of the clip at `chunks[f // W, f % W]`; frames at or
                beyond `num_frames` must be zero.
            num_frames: int32 scalar, valid frames T of the clip (may be traced).

        Returns:
            `[C * n_window // 2, O]` tokens in the compute dtype; the first `audio_token_count(T)` are the clip's.
        """
        c = self.config
        dt = c.jnp_dtype
        C, W, _ = chunks.shape
        S = W // 2
        frame_valid = (jnp.arange(C * W).reshape(C, W) < num_frames)[..., None]  # [C, W, 1]
        h = gelu_exact(conv1d_k3(chunks.astype(dt), self.conv1_kernel[...], self.conv1_bias[...], 1, dt))  # [C, W, D]
        h = h * frame_valid.astype(dt)
        h = gelu_exact(conv1d_k3(h, self.conv2_kernel[...], self.conv2_bias[...], 2, dt))  # [C, S, D]
        h = h + jnp.asarray(sinusoid_positions(S, c.d_model)).astype(dt)[None]
        after_cnn = (num_frames - 1) // 2 + 1
        key_valid = jnp.arange(C * S).reshape(C, S) < after_cnn  # [C, S]
        bias = jnp.where(key_valid, 0.0, _MASK)[:, None, None, :]  # [C, 1, 1, S]: attention within each chunk

        def layer(x, p):
            return whisper_layer(x, p, bias, c.encoder_attention_heads, dt)[0], None

        h, _ = jax.lax.scan(layer, h, self.layers.stacked())  # [C, S, D]
        pairs = (C * S) // 2
        h = h.reshape(C * S, -1)[:2 * pairs].reshape(pairs, 2, -1)  # pooling runs over the whole clip
        h = jnp.mean(h.astype(jnp.float32), axis=1).astype(dt)  # [P, D]
        h = layer_norm(h, self.post_norm_scale[...], self.post_norm_bias[...])
        return dense(h, self.proj[...], self.proj_bias[...], dt)  # [P, O]


@cached_jit(static_argnames=("graphdef",))
def _encode_chunks(graphdef, params, chunks, num_frames):
    return nnx.merge(graphdef, params).encode_chunks(chunks, num_frames)


def chunk_bucket(num_chunks: int) -> int:
    """Chunks a clip of `num_chunks` chunks is padded to: the next power of two."""
    return 1 << max(0, int(num_chunks) - 1).bit_length()


def encode_audio(encoder: AudioEncoder | tuple[Any, Any], features: npt.ArrayLike, *,
                 bucket: bool = True) -> jnp.ndarray:
    """Encodes one clip's features into LLM-width audio tokens (jitted; one compile per chunk bucket).

    Args:
        encoder: an `AudioEncoder`, or its `(graphdef, params)` from `nnx.split`.
        features: `[num_mel_bins, T]` log-mel features (`audio_features.log_mel`), T >= 3.
        bucket: pad to a power-of-two number of chunks (fewer compiles); False pads to whole chunks only.

    Returns:
        `[audio_token_count(T), output_dim]` tokens in the encoder's compute dtype.

    Raises:
        FeatureShapeError: features are not 2D, have a mel-bin count other than the config's, are too short to give
            a token, or hold NaN/inf.
    """
    graphdef, params = encoder if isinstance(encoder, tuple) else nnx.split(encoder)
    config: AudioConfig = nnx.merge(graphdef, params).config if isinstance(encoder, tuple) else encoder.config
    feats = np.asarray(features)
    if feats.ndim != 2:
        raise FeatureShapeError(f"audio features must be [num_mel_bins, frames], got shape {feats.shape}")
    if feats.shape[0] != config.num_mel_bins:
        hint = ("; features look transposed ([frames, mel])" if feats.shape[1] == config.num_mel_bins else
                f"; compute them with log_mel(..., num_mel_bins={config.num_mel_bins})")
        raise FeatureShapeError(f"audio features have {feats.shape[0]} mel bins but the encoder expects "
                                f"{config.num_mel_bins}{hint}")
    frames = feats.shape[1]
    tokens = audio_token_count(frames)
    if tokens == 0:
        raise FeatureShapeError(f"audio features have {frames} frame(s); at least 3 (30 ms) are needed for one token")
    if not np.isfinite(feats).all():
        raise FeatureShapeError("audio features hold NaN or inf")
    W = config.chunk_frames
    num_chunks = -(-frames // W)
    padded_chunks = chunk_bucket(num_chunks) if bucket else num_chunks
    chunks = np.zeros((padded_chunks * W, config.num_mel_bins), np.float32)
    chunks[:frames] = feats.T
    out = _encode_chunks(graphdef, params, jnp.asarray(chunks.reshape(padded_chunks, W, -1)),
                         jnp.asarray(frames, jnp.int32))
    return out[:tokens]


def encoder_from_params(config: AudioConfig, params: Mapping[str, Any]) -> AudioEncoder:
    """Builds an `AudioEncoder` from a pure-dict parameter tree (e.g. `convert_in_memory(...)["audio"]`).

    Leaves are cast to the config's dtype; shapes must match the tree documented at the top of this module.
    """
    return module_from_pure_dict(lambda: AudioEncoder(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="audio parameter", missing_error=KeyError)


# Conversion rules of the Whisper-style layers below the tower's prefix (shared with MiniCPM-o's `apm.*`).
# Symbols: K conv taps, M mel bins, D d_model, F ffn.
_LAYER = "layers.{i}."
WHISPER_CONV_RULES: tuple[Rule, ...] = (
    Rule("conv1.weight", "conv1_kernel", "K M D", "conv1d"),
    Rule("conv1.bias", "conv1_bias", "D"),
    Rule("conv2.weight", "conv2_kernel", "K D D", "conv1d"),
    Rule("conv2.bias", "conv2_bias", "D"),
)
WHISPER_LAYER_RULES: tuple[Rule, ...] = (
    *norm_rules(_LAYER + "self_attn_layer_norm", "layers/attn_norm"),
    *linear_rules(_LAYER + "self_attn.q_proj", "layers/q_proj", "layers/q_bias", "D D"),
    *linear_rules(_LAYER + "self_attn.k_proj", "layers/k_proj", None, "D D"),
    *linear_rules(_LAYER + "self_attn.v_proj", "layers/v_proj", "layers/v_bias", "D D"),
    *linear_rules(_LAYER + "self_attn.out_proj", "layers/o_proj", "layers/o_bias", "D D"),
    *norm_rules(_LAYER + "final_layer_norm", "layers/mlp_norm"),
    *linear_rules(_LAYER + "fc1", "layers/fc1", "layers/fc1_bias", "D F"),
    *linear_rules(_LAYER + "fc2", "layers/fc2", "layers/fc2_bias", "F D"),
)

# Conversion table for `thinker.audio_tower.*`. Symbols as above, O output.
AUDIO_RULES: tuple[Rule, ...] = (
    *WHISPER_CONV_RULES,
    *WHISPER_LAYER_RULES,
    *norm_rules("ln_post", "post_norm"),
    *linear_rules("proj", "proj", "proj_bias", "D O"),
)


def audio_component(config: AudioConfig) -> Component:
    """The conversion table of the audio tower for `config` (HF prefix `audio_tower.` below `thinker.`)."""
    dims = {"K": 3, "M": config.num_mel_bins, "D": config.d_model, "F": config.encoder_ffn_dim,
            "O": config.output_dim}
    return Component(name="audio", prefix="audio_tower.", rules=AUDIO_RULES, dims=dims,
                     num_layers=config.encoder_layers)
