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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.errors import UnsupportedConfigError
from convert.tables import Component, Rule
from omnijax.config import DTYPES, JsonConfig
from omnijax.models.common import new_param
from omnijax.models.qwen2_5_omni.audio_features import (
    AudioInputError, FeatureShapeError, InvalidPcmError, UnsupportedSampleRateError, log_mel)

__all__ = ["AUDIO_RULES", "AudioConfig", "AudioEncoder", "AudioInputError", "FeatureShapeError", "InvalidPcmError",
           "UnsupportedAudioConfigError", "UnsupportedSampleRateError", "audio_component", "audio_token_count",
           "encode_audio", "encoder_from_params", "log_mel"]

_LN_EPS = 1e-5  # torch.nn.LayerNorm default, used by every norm of the tower
_MASK = -1e30  # finite, so fully padded chunks give a uniform (not NaN) softmax

# Hugging Face audio config attributes with no effect on inference.
_HARMLESS = ("dropout", "attention_dropout", "activation_dropout", "initializer_range")
_MODEL_TYPE = "qwen2_5_omni_audio_encoder"
UNUSED_HF_TENSORS = ("audio_bos_eos_token.weight",)  # below the `audio_tower.` prefix; converters skip these


class UnsupportedAudioConfigError(UnsupportedConfigError, ValueError):
    """An audio config attribute changes the encoder's math in a way omnijax does not implement."""


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
        if self.dtype not in DTYPES:
            raise ValueError(f"AudioConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "dtype" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"AudioConfig.{f.name} must be a positive integer, got {value!r}")
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
        where = "audio_config."
        model_type = data.get("model_type", _MODEL_TYPE)
        if model_type != _MODEL_TYPE:
            raise UnsupportedAudioConfigError(where + "model_type", model_type,
                                              f"only the Qwen2.5-Omni audio tower ({_MODEL_TYPE}) is implemented")
        act = data.get("activation_function", "gelu")
        if act != "gelu":
            raise UnsupportedAudioConfigError(where + "activation_function", act,
                                              "only the exact (erf) GELU feed-forward is implemented")
        if data.get("scale_embedding", False):
            raise UnsupportedAudioConfigError(
                where + "scale_embedding", data["scale_embedding"],
                "the flag asks for embeddings scaled by sqrt(d_model) but the reference encoder never applies the "
                "scale, so the checkpoint's intended math is ambiguous")
        fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "dtype"}
        values = {name: data.get(name, default) for name, default in fields.items()}
        layers = data.get("num_hidden_layers", values["encoder_layers"])
        if layers != values["encoder_layers"]:
            raise UnsupportedAudioConfigError(where + "num_hidden_layers", layers,
                                              f"differs from encoder_layers={values['encoder_layers']}")
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


def layer_norm(x: jnp.ndarray, scale: jnp.ndarray, bias: jnp.ndarray) -> jnp.ndarray:
    """LayerNorm over the last axis with float32 statistics; the result is cast back to `x.dtype`."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + _LN_EPS)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _dense(x, w, b, dt):
    """`x @ w + b` accumulated in float32, cast to the compute dtype."""
    out = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        out = out + b.astype(jnp.float32)
    return out.astype(dt)


def _conv3(x, kernel, bias, stride, dt):
    """Per-chunk Conv1d, kernel 3, padding 1: `[C, W, I]` -> `[C, W // stride, O]` (kernel `[3, I, O]`)."""
    W = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (1, 1), (0, 0)))  # [C, W + 2, I]
    taps = jnp.stack([xp[:, k:k + W:stride] for k in range(3)], axis=2)  # [C, W // stride, 3, I]
    out = jnp.einsum("cwki,kio->cwo", taps, kernel, preferred_element_type=jnp.float32)
    return (out + bias.astype(jnp.float32)).astype(dt)


def _gelu(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


class AudioLayers(nnx.Module):
    """All encoder layers' parameters, stacked along a leading `layers` axis."""

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

    def stacked(self) -> dict[str, jnp.ndarray]:
        """The stacked parameter arrays as a plain dict (scanned over in `AudioEncoder.encode_chunks`)."""
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}


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
        S, H, hd = W // 2, c.encoder_attention_heads, c.head_dim
        frame_valid = (jnp.arange(C * W).reshape(C, W) < num_frames)[..., None]  # [C, W, 1]
        h = _gelu(_conv3(chunks.astype(dt), self.conv1_kernel[...], self.conv1_bias[...], 1, dt))  # [C, W, D]
        h = h * frame_valid.astype(dt)
        h = _gelu(_conv3(h, self.conv2_kernel[...], self.conv2_bias[...], 2, dt))  # [C, S, D]
        h = h + jnp.asarray(sinusoid_positions(S, c.d_model)).astype(dt)[None]
        after_cnn = (num_frames - 1) // 2 + 1
        key_valid = jnp.arange(C * S).reshape(C, S) < after_cnn  # [C, S]
        bias = jnp.where(key_valid, 0.0, _MASK)[:, None, None, :]  # [C, 1, 1, S]
        scale = hd ** -0.5

        def layer(x, p):
            n = layer_norm(x, p["attn_norm_scale"], p["attn_norm_bias"])
            q = _dense(n, p["q_proj"], p["q_bias"], dt).reshape(C, S, H, hd)
            k = _dense(n, p["k_proj"], None, dt).reshape(C, S, H, hd)
            v = _dense(n, p["v_proj"], p["v_bias"], dt).reshape(C, S, H, hd)
            scores = jnp.einsum("cqhd,ckhd->chqk", q, k, preferred_element_type=jnp.float32) * scale + bias
            probs = jax.nn.softmax(scores, axis=-1).astype(dt)  # [C, H, S, S]
            attn = jnp.einsum("chqk,ckhd->cqhd", probs, v, preferred_element_type=jnp.float32).astype(dt)
            x = x + _dense(attn.reshape(C, S, H * hd), p["o_proj"], p["o_bias"], dt)
            n = layer_norm(x, p["mlp_norm_scale"], p["mlp_norm_bias"])
            x = x + _dense(_gelu(_dense(n, p["fc1"], p["fc1_bias"], dt)), p["fc2"], p["fc2_bias"], dt)
            return x, None

        h, _ = jax.lax.scan(layer, h, self.layers.stacked())  # [C, S, D]
        pairs = (C * S) // 2
        h = h.reshape(C * S, -1)[:2 * pairs].reshape(pairs, 2, -1)  # pooling runs over the whole clip
        h = jnp.mean(h.astype(jnp.float32), axis=1).astype(dt)  # [P, D]
        h = layer_norm(h, self.post_norm_scale[...], self.post_norm_bias[...])
        return _dense(h, self.proj[...], self.proj_bias[...], dt)  # [P, O]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _encode_chunks(graphdef, params, chunks, num_frames):
    return nnx.merge(graphdef, params).encode_chunks(chunks, num_frames)


def chunk_bucket(num_chunks: int) -> int:
    """Chunks a clip of `num_chunks` chunks is padded to: the next power of two."""
    return 1 << max(0, int(num_chunks) - 1).bit_length()


def encode_audio(encoder: AudioEncoder | tuple[Any, Any], features, *, bucket: bool = True) -> jnp.ndarray:
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
    graphdef, state = nnx.split(nnx.eval_shape(lambda: AudioEncoder(config, rngs=nnx.Rngs(0))))
    want = nnx.to_pure_dict(state)
    dt = config.jnp_dtype

    def cast(path, expected):
        got = params
        for key in path:
            got = got[key.key if hasattr(key, "key") else key]
        if tuple(np.shape(got)) != tuple(expected.shape):
            raise ValueError(f"audio parameter {'/'.join(str(getattr(k, 'key', k)) for k in path)} has shape "
                             f"{tuple(np.shape(got))}, expected {tuple(expected.shape)}")
        return jnp.asarray(got, dt)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(cast, want))
    return nnx.merge(graphdef, state)


# Conversion table for `thinker.audio_tower.*`. Symbols: K conv taps, M mel bins, D d_model, F ffn, O output.
AUDIO_RULES: tuple[Rule, ...] = (
    Rule("conv1.weight", "conv1_kernel", "K M D", "conv1d"),
    Rule("conv1.bias", "conv1_bias", "D"),
    Rule("conv2.weight", "conv2_kernel", "K D D", "conv1d"),
    Rule("conv2.bias", "conv2_bias", "D"),
    Rule("layers.{i}.self_attn_layer_norm.weight", "layers/attn_norm_scale", "D"),
    Rule("layers.{i}.self_attn_layer_norm.bias", "layers/attn_norm_bias", "D"),
    Rule("layers.{i}.self_attn.q_proj.weight", "layers/q_proj", "D D", "T"),
    Rule("layers.{i}.self_attn.q_proj.bias", "layers/q_bias", "D"),
    Rule("layers.{i}.self_attn.k_proj.weight", "layers/k_proj", "D D", "T"),
    Rule("layers.{i}.self_attn.v_proj.weight", "layers/v_proj", "D D", "T"),
    Rule("layers.{i}.self_attn.v_proj.bias", "layers/v_bias", "D"),
    Rule("layers.{i}.self_attn.out_proj.weight", "layers/o_proj", "D D", "T"),
    Rule("layers.{i}.self_attn.out_proj.bias", "layers/o_bias", "D"),
    Rule("layers.{i}.final_layer_norm.weight", "layers/mlp_norm_scale", "D"),
    Rule("layers.{i}.final_layer_norm.bias", "layers/mlp_norm_bias", "D"),
    Rule("layers.{i}.fc1.weight", "layers/fc1", "D F", "T"),
    Rule("layers.{i}.fc1.bias", "layers/fc1_bias", "F"),
    Rule("layers.{i}.fc2.weight", "layers/fc2", "F D", "T"),
    Rule("layers.{i}.fc2.bias", "layers/fc2_bias", "D"),
    Rule("ln_post.weight", "post_norm_scale", "D"),
    Rule("ln_post.bias", "post_norm_bias", "D"),
    Rule("proj.weight", "proj", "D O", "T"),
    Rule("proj.bias", "proj_bias", "O"),
)


def audio_component(config: AudioConfig) -> Component:
    """The conversion table of the audio tower for `config` (HF prefix `audio_tower.` below `thinker.`)."""
    dims = {"K": 3, "M": config.num_mel_bins, "D": config.d_model, "F": config.encoder_ffn_dim,
            "O": config.output_dim}
    return Component(name="audio", prefix="audio_tower.", rules=AUDIO_RULES, dims=dims,
                     num_layers=config.encoder_layers)
