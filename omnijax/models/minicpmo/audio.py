"""MiniCPM-o 4.5 audio path in Flax NNX: Whisper encoder (`apm`) + projector + average pooling.

Log-mel features `[80, T]` (100 frames per second, `audio_features.log_mel`) go through conv1 (k3, p1) + GELU and
conv2 (k3, stride 2, p1) + GELU, giving `T' = (T - 1) // 2 + 1` frames (50 per second), plus the learned position
table `embed_positions[:T']` (loaded from the checkpoint, never recomputed). Pre-LayerNorm transformer layers
(q/v/out projections with bias, k without; exact GELU feed-forward; LayerNorm eps 1e-5), the final `layer_norm`,
then the projector Linear(D -> H) -> ReLU -> Linear(H -> H) and AvgPool1d(pool_step = 5) over time: 10 tokens per
second, `audio_token_count(T) = ((T - 1) // 2 + 1 - 5) // 5 + 1`.

Offline attention (`MiniCPMO.get_audio_embedding(chunk_length = audio_chunk_length)`): block-causal chunks of
`int(audio_chunk_length * 50)` frames (frame i sees frames `[0, (i // C + 1) * C)`), plus padding. Reference quirk,
reproduced: padding is decided by comparing the CNN frame index with the clip's **mel** length, so in a batch of
clips padded to a common length, a shorter clip's frames in `[T'_i, T_i)` (computed from its zero padding) are not
masked, and its tokens depend on how long the other clips of the batch are (`encode_audio_batch` reproduces a
batch exactly; `encode_audio` is a batch of one, where the quirk cannot arise).

Streaming (`encode_audio_streaming`, the 4.5 duplex path `get_audio_embedding_streaming`): each chunk's features
(with extra context frames, `audio_features.mel_stream_step`) run conv1/conv2 on their own; then
`(prefix_extra + 1) // 2` frames are dropped at the start and `(suffix_extra + 1) // 2` at the end (when fewer than
all), the rest get positions `embed_positions[past : past + n]` (indices past the table repeat its last row) and
attend to the cached keys/values of earlier chunks plus themselves (full attention); only these frames enter the
cache. Before a chunk, if `cache_length + T'_chunk >= max_source_positions` the cache is reset (the release's rule,
with T' counted before dropping the extra frames). The cache lives in `AudioStreamState`, an immutable pytree of
fixed capacity returned by every call.

Parameter pytree (`nnx.state(encoder).to_pure_dict()`), L layers, M mel bins, D d_model, F ffn, P positions,
H output_dim (Linear weights `[in, out]`, conv kernels `[k, in, out]`):

    conv1_kernel [3, M, D]   conv1_bias [D]      conv2_kernel [3, D, D]   conv2_bias [D]
    embed_positions [P, D]
    layers: attn_norm_scale/bias [L, D], q_proj [L, D, D], q_bias [L, D], k_proj [L, D, D], v_proj [L, D, D],
            v_bias [L, D], o_proj [L, D, D], o_bias [L, D], mlp_norm_scale/bias [L, D], fc1 [L, D, F],
            fc1_bias [L, F], fc2 [L, F, D], fc2_bias [L, D]
    post_norm_scale [D]      post_norm_bias [D]                      (apm.layer_norm)
    projection: linear1 [D, H], linear1_bias [H], linear2 [H, H], linear2_bias [H]

Checkpoint tensors: `apm.*` (component "audio", `AUDIO_RULES`) and `audio_projection_layer.*` (component
"audio_projection", `PROJECTION_RULES`); `audio_components(config)` gives both for `omnijax.checkpoint.name_tables`.

The config and the token arithmetic live in `audio_config` (re-exported here). The encoder layers, convolutions and
their conversion rules are the Qwen2.5-Omni audio tower's (`omnijax.models.encoders.whisper`), whose layers are
the same Whisper layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.checkpoint.name_tables import Component, Rule, convert_in_memory
from omnijax.errors import MissingTensorError
from omnijax.kept_executables import cached_jit
from omnijax.models.encoders.common import dense, layer_norm, linear_rules, module_from_pure_dict, norm_rules
from omnijax.models.encoders.whisper import (
    WHISPER_CONV_RULES,
    WHISPER_LAYER_RULES,
    AudioLayers,
    conv1d_k3,
    gelu_exact,
    whisper_layer,
)
from omnijax.models.layers import new_param
from omnijax.models.minicpmo.audio_config import (
    MINICPMO_4_5_AUDIO,
    AudioConfig,
    UnsupportedAudioConfigError,
    audio_token_count,
    cnn_frames,
)
from omnijax.models.minicpmo.audio_features import (
    AudioInputError,
    AudioTooShortError,
    FeatureShapeError,
    InvalidPcmError,
    UnsupportedSampleRateError,
    log_mel,
    log_mel_clips,
    mel_stream_start,
    mel_stream_step,
)

__all__ = ["AUDIO_PREFIX", "AUDIO_RULES", "AudioConfig", "AudioEncoder", "AudioInputError",
           "AudioTooShortError", "FeatureShapeError", "InvalidPcmError", "MINICPMO_4_5_AUDIO", "PROJECTION_PREFIX",
           "PROJECTION_RULES", "UnsupportedAudioConfigError", "UnsupportedSampleRateError", "attention_mask",
           "audio_component", "audio_components", "audio_token_count", "cnn_frames", "encode_audio",
           "encode_audio_batch", "encoder_from_checkpoint", "encoder_from_params",
           "log_mel", "log_mel_clips", "mel_stream_start", "mel_stream_step", "projection_component"]

MASK_VALUE = -1e30  # finite stand-in for the reference's -inf (no row is ever fully masked)
AUDIO_PREFIX = "apm."
PROJECTION_PREFIX = "audio_projection_layer."


def attention_mask(mel_lengths: jax.Array | np.ndarray, mel_frames: int, chunk_frames: int,
                   valid_frames: int | jax.Array | None = None) -> jax.Array:
    """The offline encoder's mask, True where attention is blocked: `[B, T', T']` bool (jnp; works traced).

    Args:
        mel_lengths: `[B]` mel frames of each clip (the reference compares CNN frame indices with these).
        mel_frames: padded mel length of the batch tensor the encoder runs on (T' = cnn_frames of it).
        chunk_frames: attention chunk in CNN frames (0: no chunking).
        valid_frames: CNN frames that exist in the reference's batch (default: all T'); frames beyond it are extra
            padding of this implementation and always masked as keys.
    """
    t = cnn_frames(mel_frames)
    idx = jnp.arange(t)
    key_pad = idx[None, :] >= jnp.asarray(mel_lengths)[:, None]  # the quirk: CNN index vs mel length
    if valid_frames is not None:
        key_pad = key_pad | (idx[None, :] >= valid_frames)
    masked = jnp.broadcast_to(key_pad[:, None, :], (key_pad.shape[0], t, t))
    if chunk_frames > 0:
        visible = idx[None, :] < (idx[:, None] // chunk_frames + 1) * chunk_frames
        masked = masked | ~visible[None]
    return masked


# --------------------------------------------------------------------------------------------------------- module


class AudioProjection(nnx.Module):
    """`audio_projection_layer`: Linear(D -> H) -> ReLU -> Linear(H -> H)."""

    def __init__(self, config: AudioConfig, *, rngs: nnx.Rngs):
        dt, D, H = config.jnp_dtype, config.d_model, config.output_dim
        self.linear1 = new_param((D, H), dt, rngs)
        self.linear1_bias = new_param((H,), dt, rngs, zeros=True)
        self.linear2 = new_param((H, H), dt, rngs)
        self.linear2_bias = new_param((H,), dt, rngs, zeros=True)

    def __call__(self, x):
        dt = x.dtype
        h = jax.nn.relu(dense(x, self.linear1[...], self.linear1_bias[...], dt))
        return dense(h, self.linear2[...], self.linear2_bias[...], dt)


class AudioEncoder(nnx.Module):
    """MiniCPM-o 4.5 audio path: log-mel features -> LLM-width audio tokens (10 per second)."""

    def __init__(self, config: AudioConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        M, D = c.num_mel_bins, c.d_model
        self.config = config
        self.conv1_kernel = new_param((3, M, D), dt, rngs)
        self.conv1_bias = new_param((D,), dt, rngs, zeros=True)
        self.conv2_kernel = new_param((3, D, D), dt, rngs)
        self.conv2_bias = new_param((D,), dt, rngs, zeros=True)
        self.embed_positions = new_param((c.max_source_positions, D), dt, rngs)
        self.layers = AudioLayers(config, rngs=rngs)
        self.post_norm_scale = new_param((D,), dt, rngs, ones=True)
        self.post_norm_bias = new_param((D,), dt, rngs, zeros=True)
        self.projection = AudioProjection(config, rngs=rngs)

    def convolve(self, features: jnp.ndarray, valid_mel: int | jax.Array | None = None, *,
                 pre_activation: bool = False) -> jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]:
        """conv1 + GELU, conv2 + GELU: `[B, T, M]` -> `[B, T', D]`. Mel frames at or past `valid_mel` are treated
        as absent (their conv1 outputs are zeroed, as conv2's zero padding would be). With `pre_activation`, returns
        `(conv2 output before its GELU, after)`."""
        dt = self.config.jnp_dtype
        h = gelu_exact(conv1d_k3(features.astype(dt), self.conv1_kernel[...], self.conv1_bias[...], 1, dt))
        if valid_mel is not None:
            h = h * (jnp.arange(h.shape[1]) < valid_mel)[None, :, None].astype(dt)
        pre = conv1d_k3(h, self.conv2_kernel[...], self.conv2_bias[...], 2, dt)
        return (pre, gelu_exact(pre)) if pre_activation else gelu_exact(pre)

    def transformer(self, h: jnp.ndarray, bias: jnp.ndarray, cache: tuple[jnp.ndarray, jnp.ndarray] | None = None,
                    cache_start: int | jax.Array | None = None, collect: bool = False
                    ) -> tuple[jnp.ndarray, jnp.ndarray | None, tuple[jnp.ndarray, jnp.ndarray] | None]:
        """The encoder layers and the final `layer_norm`.

        Args:
            h: `[B, S, D]` embedded frames (positions added).
            bias: additive mask broadcastable to `[B, 1, S, K]`, K = S without a cache, the cache capacity with one.
            cache: optional `(keys, values)` `[L, B, C, heads, head_dim]`; this call's keys/values are written at
                `cache_start` and attention runs over the whole (masked) cache.
            collect: also return the output of every layer but the last.

        Returns:
            `(out [B, S, D], layer_outputs [L - 1, B, S, D] or None, new_cache or None)`.
        """
        c, dt = self.config, self.config.jnp_dtype

        def layer(x, xs):
            p, layer_keys, layer_values = xs  # the layer's cache `[B, C, heads, head_dim]` each, or None
            layer_cache = None if layer_keys is None else (layer_keys, layer_values)
            x, layer_cache = whisper_layer(x, p, bias, c.encoder_attention_heads, dt, layer_cache, cache_start)
            layer_keys, layer_values = (None, None) if layer_cache is None else layer_cache
            return x, (x if collect else None, layer_keys, layer_values)

        keys, values = (None, None) if cache is None else cache
        h, (outs, keys, values) = jax.lax.scan(layer, h, (self.layers.stacked(), keys, values))
        out = layer_norm(h, self.post_norm_scale[...], self.post_norm_bias[...])
        return out, (outs[:-1] if collect else None), (None if cache is None else (keys, values))

    def pool(self, x: jnp.ndarray) -> jnp.ndarray:
        """AvgPool1d(pool_step, stride pool_step) over time: `[B, S, H]` -> `[B, S // pool_step, H]`."""
        step = self.config.pool_step
        B, S, H = x.shape
        n = S // step
        pooled = jnp.mean(x[:, :n * step].astype(jnp.float32).reshape(B, n, step, H), axis=2)
        return pooled.astype(x.dtype)

    def encode_offline(self, features: jnp.ndarray, mel_lengths: jnp.ndarray, valid_mel: jnp.ndarray, *,
                       collect: bool = False) -> dict[str, jnp.ndarray]:
        """Offline encoding of a zero-padded batch, mask as the reference builds it.

        Args:
            features: `[B, T, M]` features (time-major), zero past each clip.
            mel_lengths: `[B]` int32 mel frames per clip.
            valid_mel: int32 scalar, the padded length of the reference's batch (<= T); frames past it are this
                implementation's extra (bucket) padding.
            collect: also return the intermediates.

        Returns:
            dict with `pooled [B, T' // pool_step, H]`; with `collect`: `conv2_out [B, T', D]` (the `conv2` module's
            output, before its GELU), `hidden_states [L + 1, B, T', D]` (input embeddings = GELU(conv2_out) +
            positions, each layer's output, the last after the final `layer_norm`), `projection [B, T', H]`.
        """
        c = self.config
        conv2_out, conv = self.convolve(features, valid_mel, pre_activation=True)
        t = conv.shape[1]
        h = conv + self.embed_positions[:t].astype(conv.dtype)[None]
        masked = attention_mask(mel_lengths, features.shape[1], c.chunk_frames, cnn_frames(valid_mel))
        bias = jnp.where(masked, MASK_VALUE, 0.0)[:, None]  # [B, 1, T', T']
        out, layer_outs, _ = self.transformer(h, bias, collect=collect)
        proj = self.projection(out)
        result = {"pooled": self.pool(proj)}
        if collect:
            result.update(conv2_out=conv2_out, projection=proj,
                          hidden_states=jnp.concatenate([h[None], cast(jnp.ndarray, layer_outs), out[None]], axis=0))
        return result


@cached_jit(static_argnames=("graphdef", "collect"))
def _encode_offline(graphdef, params, features, mel_lengths, valid_mel, collect):
    return nnx.merge(graphdef, params).encode_offline(features, mel_lengths, valid_mel, collect=collect)


def split_encoder(encoder: AudioEncoder | tuple[Any, Any]) -> tuple[Any, Any, AudioConfig]:
    if isinstance(encoder, tuple):
        graphdef, params = encoder
        return graphdef, params, nnx.merge(graphdef, params).config
    graphdef, params = nnx.split(encoder)
    return graphdef, params, encoder.config


def check_features(feats: np.ndarray, config: AudioConfig, what: str = "audio features") -> np.ndarray:
    if feats.ndim != 2:
        raise FeatureShapeError(f"{what} must be [num_mel_bins, frames], got shape {feats.shape}")
    if feats.shape[0] != config.num_mel_bins:
        hint = "; features look transposed ([frames, mel])" if feats.shape[1] == config.num_mel_bins else ""
        raise FeatureShapeError(f"{what} have {feats.shape[0]} mel bins but the encoder expects "
                                f"{config.num_mel_bins}{hint}")
    if feats.shape[1] == 0:
        raise FeatureShapeError(f"{what} have no frames (audio shorter than one 10 ms mel frame)")
    if not np.isfinite(feats).all():
        raise FeatureShapeError(f"{what} hold NaN or inf")
    return feats.astype(np.float32)


def _bucket(frames: int, config: AudioConfig) -> int:
    """Mel frames a batch is padded to: 100 * the next power of two seconds, capped at the position table."""
    seconds = -(-frames // 100)
    return min(config.max_mel_frames, 100 * (1 << max(0, seconds - 1).bit_length()))


def encode_audio_batch(encoder: AudioEncoder | tuple[Any, Any], clips: Sequence[np.ndarray], *,
                       intermediates: bool = False, bucket: bool = True
                       ) -> list[jax.Array] | tuple[list[jax.Array], dict[str, jax.Array]]:
    """Encodes several clips together exactly as the reference does (one padded batch, same mask quirk).

    Args:
        encoder: an `AudioEncoder`, or its `(graphdef, params)` from `nnx.split`.
        clips: a list of `[num_mel_bins, T_i]` features (e.g. `log_mel_clips` pieces), padded here into one batch of
            length `max T_i`, as the processor pads them.
        intermediates: also return a dict of the batch's intermediates, cut to the reference batch length:
            `conv2_out`, `hidden_states`, `projection`, `pooled` (see `AudioEncoder.encode_offline`) and
            `attention_masked` (`[B, T', T']`, True where the reference's mask is -inf).
        bucket: pad further (beyond the reference length, masked out) to 1, 2, 4, ... s or 30 s to bound compiles.

    Returns:
        a list of `[audio_token_count(T_i), output_dim]` arrays (the clip's tokens), or `(tokens, intermediates)`.

    Raises:
        FeatureShapeError: a clip has the wrong shape, no frames, NaN/inf, or more than `2 * max_source_positions`
            (30 s) frames.
    """
    graphdef, params, config = split_encoder(encoder)
    clips = [check_features(np.asarray(c), config, f"clip {i} features") for i, c in enumerate(clips)]
    if not clips:
        raise FeatureShapeError("no audio clips given")
    features, lengths = _pad(clips)
    frames = features.shape[2]
    if frames > config.max_mel_frames:
        raise FeatureShapeError(f"a clip has {frames} mel frames, over the {config.max_mel_frames} (30 s) the "
                                f"position table covers; split long audio with log_mel_clips")
    padded = _bucket(frames, config) if bucket else frames
    batch = np.zeros((len(clips), padded, config.num_mel_bins), np.float32)
    batch[:, :frames] = features.transpose(0, 2, 1)
    out = _encode_offline(graphdef, params, jnp.asarray(batch), jnp.asarray(lengths, jnp.int32),
                          jnp.asarray(frames, jnp.int32), intermediates)
    tokens = [out["pooled"][i, :audio_token_count(int(n), config.pool_step)] for i, n in enumerate(lengths)]
    if not intermediates:
        return tokens
    t = cnn_frames(frames)
    extra = {"conv2_out": out["conv2_out"][:, :t], "hidden_states": out["hidden_states"][:, :, :t],
             "projection": out["projection"][:, :t], "pooled": out["pooled"][:, :t // config.pool_step],
             "attention_masked": attention_mask(jnp.asarray(lengths), frames, config.chunk_frames)}
    return tokens, extra


def _pad(clips):
    lengths = np.array([c.shape[1] for c in clips], np.int64)
    out = np.zeros((len(clips), clips[0].shape[0], int(lengths.max())), np.float32)
    for i, c in enumerate(clips):
        out[i, :, :c.shape[1]] = c
    return out, lengths


def encode_audio(encoder: AudioEncoder | tuple[Any, Any], features: np.ndarray, *, bucket: bool = True) -> jnp.ndarray:
    """Encodes one clip (at most 30 s) into LLM-width audio tokens, as the reference does for a batch of one.

    Args:
        encoder: an `AudioEncoder`, or its `(graphdef, params)`.
        features: `[num_mel_bins, T]` log-mel features (`audio_features.log_mel`), 1 <= T <= 3000.
        bucket: pad to 1, 2, 4, ... s or 30 s (masked out) so clips of similar length share one compile.

    Returns:
        `[audio_token_count(T), output_dim]` tokens in the compute dtype (no rows below 9 mel frames, as in the
        reference).

    Raises:
        FeatureShapeError: features are not `[num_mel_bins, T]`, have no frames, hold NaN/inf, or exceed 30 s.
    """
    return encode_audio_batch(encoder, [features], bucket=bucket)[0]


# ---------------------------------------------------------------------------------------------------- conversion

# `apm.*` below the prefix: the Whisper layers of the Qwen2.5-Omni audio tower plus a learned position table.
# Symbols: K conv taps, M mel bins, D d_model, F ffn, P positions.
AUDIO_RULES: tuple[Rule, ...] = (
    *WHISPER_CONV_RULES,
    Rule("embed_positions.weight", "embed_positions", "P D"),
    *WHISPER_LAYER_RULES,
    *norm_rules("layer_norm", "post_norm"),
)

# `audio_projection_layer.*` below the prefix. Symbols: D d_model (= encoder_ffn_dim // 4), H output_dim.
PROJECTION_RULES: tuple[Rule, ...] = (
    *linear_rules("linear1", "linear1", "linear1_bias", "D H"),
    *linear_rules("linear2", "linear2", "linear2_bias", "H H"),
)


def audio_component(config: AudioConfig) -> Component:
    """The Whisper encoder's conversion table (component "audio", HF prefix `apm.`)."""
    dims = {"K": 3, "M": config.num_mel_bins, "D": config.d_model, "F": config.encoder_ffn_dim,
            "P": config.max_source_positions}
    return Component(name="audio", prefix=AUDIO_PREFIX, rules=AUDIO_RULES, dims=dims,
                     num_layers=config.encoder_layers)


def projection_component(config: AudioConfig) -> Component:
    """The projector's conversion table (component "audio_projection", HF prefix `audio_projection_layer.`)."""
    dims = {"D": config.d_model, "H": config.output_dim}
    return Component(name="audio_projection", prefix=PROJECTION_PREFIX, rules=PROJECTION_RULES, dims=dims,
                     num_layers=0)


def audio_components(config: AudioConfig) -> tuple[Component, Component]:
    """Both conversion tables of the audio path: `(audio_component, projection_component)`."""
    return audio_component(config), projection_component(config)


def encoder_from_params(config: AudioConfig, audio_params: Mapping[str, Any],
                        projection_params: Mapping[str, Any] | None = None) -> AudioEncoder:
    """Builds an `AudioEncoder` from pure-dict trees.

    Args:
        config: the audio config.
        audio_params: the encoder tree (the "audio" component's tree from `convert_in_memory`), or the whole
            module tree including `projection` when `projection_params` is None.
        projection_params: the "audio_projection" component's tree.

    Leaves are cast to the config's dtype; shapes must match the tree documented at the top of this module.
    """
    tree = dict(audio_params)
    if projection_params is not None:
        tree["projection"] = projection_params
    return module_from_pure_dict(lambda: AudioEncoder(config, rngs=nnx.Rngs(0)), tree, config.jnp_dtype,
                                 what="audio parameter", missing_error=KeyError)


def encoder_from_checkpoint(tensors: Mapping[str, Any], config: AudioConfig) -> AudioEncoder:
    """Builds an `AudioEncoder` from a MiniCPM-o state dict (name -> array; other components' tensors ignored).

    Raises:
        MissingTensorError: the checkpoint has no `apm.*` tensors at all, or lacks some `apm.*` /
            `audio_projection_layer.*` tensor the config needs (named in the message).
        ShapeMismatchError / UnexpectedTensorError: as `omnijax.checkpoint.name_tables.plan_conversion`.
    """
    names = [n for n in tensors if n.startswith((AUDIO_PREFIX, PROJECTION_PREFIX))]
    if not any(n.startswith(AUDIO_PREFIX) for n in names):
        raise MissingTensorError("checkpoint has no audio encoder tensors (apm.*); was it saved with "
                                 "init_audio=false?")
    trees = convert_in_memory({n: tensors[n] for n in names}, audio_components(config), np.float32,
                              strip_prefix="")
    return encoder_from_params(config, trees["audio"], trees["audio_projection"])
