"""MiniCPM-o 4.5's streaming audio path (the duplex encoder): each 1 s chunk of log-mel features runs through the
Whisper encoder on top of a key/value cache of the previous chunks, an immutable pytree returned by every call.
The offline encoder, its config and its weights live in `omnijax.models.minicpmo.audio`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.kept_executables import cached_jit
from omnijax.models.minicpmo.audio import (
    MASK_VALUE,
    AudioConfig,
    AudioEncoder,
    audio_token_count,
    check_features,
    cnn_frames,
    split_encoder,
)
from omnijax.models.minicpmo.audio_features import FeatureShapeError, MelChunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AudioStreamState:
    """Immutable streaming-encoder cache: per-layer keys/values of the frames encoded so far.

    Attributes:
        keys, values: `[L, 1, capacity, heads, head_dim]`; rows `[0, length)` are valid.
        length: cached frames (a static int: the reset rule and the positions are decided on host).
    """

    keys: jax.Array
    values: jax.Array
    length: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def empty(cls, config: AudioConfig, capacity: int | None = None) -> "AudioStreamState":
        """An empty cache holding up to `capacity` frames (default `max_source_positions`, the most the release's
        reset rule lets accumulate)."""
        capacity = config.max_source_positions if capacity is None else int(capacity)
        shape = (config.encoder_layers, 1, capacity, config.encoder_attention_heads, config.head_dim)
        return cls(keys=jnp.zeros(shape, config.jnp_dtype), values=jnp.zeros(shape, config.jnp_dtype), length=0)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])


@cached_jit(static_argnames=("graphdef", "drop_front", "keep", "collect"))
def _stream_step(graphdef, params, features, keys, values, past, drop_front, keep, collect):
    encoder = nnx.merge(graphdef, params)
    c = encoder.config
    conv = encoder.convolve(features)[:, drop_front:drop_front + keep]  # [1, n, D]
    pos = jnp.minimum(past + jnp.arange(keep), c.max_source_positions - 1)  # past the table: repeat the last row
    h = conv + encoder.embed_positions[...][pos].astype(conv.dtype)[None]
    key_valid = jnp.arange(keys.shape[2]) < past + keep
    bias = jnp.where(key_valid, 0.0, MASK_VALUE)[None, None, None, :]  # full attention over cache + chunk
    out, layer_outs, (keys, values) = encoder.transformer(h, bias, cache=(keys, values), cache_start=past,
                                                          collect=collect)
    proj = encoder.projection(out)
    pooled = encoder.pool(proj)
    hidden = jnp.concatenate([h[None], layer_outs, out[None]], axis=0) if collect else None
    return pooled[0], keys, values, hidden


def encode_audio_streaming(encoder: AudioEncoder | tuple[Any, Any], chunk: MelChunk | Any,
                           state: AudioStreamState | None = None, *, prefix_extra_frames: int | None = None,
                           suffix_extra_frames: int | None = None, use_extra_context: bool = True,
                           intermediates: bool = False
                           ) -> tuple[jax.Array, AudioStreamState] | tuple[jax.Array, AudioStreamState, jax.Array]:
    """Encodes one streaming chunk on top of the cache of the previous ones (the 4.5 duplex audio path).

    Args:
        encoder: an `AudioEncoder`, or its `(graphdef, params)`.
        chunk: a `MelChunk` from `audio_features.mel_stream_step`, or `[num_mel_bins, T]` features (then give the
            extra-frame counts).
        state: the cache returned by the previous call (None or `AudioStreamState.empty(config)` to start).
        prefix_extra_frames, suffix_extra_frames: context frames on each side of the chunk's new frames (default:
            the `MelChunk`'s, i.e. 0/2 for the first chunk, 2/2 after).
        use_extra_context: drop the CNN frames of the extra context (the duplex path does; False keeps them all).
        intermediates: also return the chunk's hidden states `[L + 1, n, D]` (same convention as offline).

    Returns:
        `(tokens [n_tokens, output_dim], new_state)` or `(tokens, new_state, hidden_states)`; 10 tokens per 1 s
        chunk with the duplex settings.

    Raises:
        FeatureShapeError: bad features, or a chunk longer than the cache capacity.
    """
    graphdef, params, config = split_encoder(encoder)
    if isinstance(chunk, MelChunk):
        features = chunk.features
        prefix = chunk.prefix_extra_frames if prefix_extra_frames is None else prefix_extra_frames
        suffix = chunk.suffix_extra_frames if suffix_extra_frames is None else suffix_extra_frames
    else:
        features, prefix, suffix = chunk, prefix_extra_frames or 0, suffix_extra_frames or 0
    feats = check_features(np.asarray(features), config, "streaming chunk features")
    if prefix < 0 or suffix < 0:
        raise ValueError(f"extra frame counts must be non-negative, got {prefix}, {suffix}")
    state = AudioStreamState.empty(config) if state is None else state
    frames = feats.shape[1]
    t = cnn_frames(frames)
    if state.length > 0 and state.length + t >= config.max_source_positions:
        state = AudioStreamState.empty(config, state.capacity)  # the release's reset rule
    drop_front = (prefix + 1) // 2 if use_extra_context and prefix > 0 else 0
    drop_back = (suffix + 1) // 2 if use_extra_context and suffix > 0 else 0
    keep = t - drop_front
    if 0 < drop_back < keep:
        keep -= drop_back
    if keep < 1:
        raise FeatureShapeError(f"streaming chunk of {frames} mel frames has no frames left after dropping "
                                f"{drop_front} context frame(s)")
    if state.length + keep > state.capacity:
        raise FeatureShapeError(f"streaming chunk of {keep} CNN frames does not fit the audio cache "
                                f"({state.length} + {keep} > capacity {state.capacity})")
    pooled, keys, values, hidden = _stream_step(
        graphdef, params, jnp.asarray(feats.T[None]), state.keys, state.values,
        jnp.asarray(state.length, jnp.int32), drop_front, keep, intermediates)
    tokens = pooled[:audio_token_count(frames, config.pool_step)]
    new_state = AudioStreamState(keys=keys, values=values, length=state.length + keep)
    if intermediates:
        return tokens, new_state, hidden[:, 0]
    return tokens, new_state


