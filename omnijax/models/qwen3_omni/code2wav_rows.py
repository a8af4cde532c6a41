"""Code2Wav over several independent utterances in one call: each row carries its own `Code2WavState` (its own
position, attention window and conv carries), so chunks of sessions that started at different times decode together.

`decode_rows(params, config, codes [R, Q, n], states)` maps `decode_frames` over the rows (`jax.vmap`: every row is
computed as a batch-of-one call on its own state), so each row's samples equal that row's chunk decoded alone --
the serving pool (`omnijax.serve.engine.speech`) runs the due chunks of every speaking session in one call per
tick this way. The rows must agree on whether a call already ran (`Code2WavState.started`, static: the first call
returns `lag` samples fewer) and on the chunk length `n`; a shorter final chunk is padded (`pad_codes`): Code2Wav
is causal, so the first samples of a padded decode are those of the unpadded one (`kept_samples` says how many),
and only the state after it -- which a final chunk does not need -- reads the padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.models.qwen3_omni.code2wav import Code2WavConfig, output_length
from omnijax.models.qwen3_omni.code2wav_decode import Code2WavState, decode_frames, init_state

__all__ = ["decode_rows", "kept_samples", "pad_codes", "started_state"]


def started_state(config: Code2WavConfig) -> Code2WavState:
    """A batch-of-one state marked as started (zero carries): a filler row for a call of started rows."""
    return dataclasses.replace(init_state(config, 1), started=True)


def kept_samples(config: Code2WavConfig, frames: int, started: bool) -> int:
    """Samples a call returns for `frames` real frames: `frames * F`, or `output_length` on a first call."""
    return frames * config.samples_per_frame if started else output_length(config, frames)


def pad_codes(codes: np.ndarray, frames: int) -> np.ndarray:
    """`codes [Q, n]` right-padded with code 0 to `frames` frames (n <= frames)."""
    Q, n = codes.shape
    if n > frames:
        raise ValueError(f"a chunk of {n} frames does not fit a call of {frames}")
    return np.concatenate([codes, np.zeros((Q, frames - n), codes.dtype)], axis=1)


@cached_jit(static_argnames=("config",))
def _rows(params: Mapping[str, Any], codes: jax.Array, states: tuple[Code2WavState, ...], config: Code2WavConfig):
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)  # each leaf gains a leading row axis
    wav, new = jax.vmap(lambda c, s: decode_frames(params, config, c, s))(codes[:, None], stacked)
    return wav[:, 0], tuple(jax.tree.map(lambda x, i=i: x[i], new) for i in range(len(states)))


def decode_rows(params: Mapping[str, Any], config: Code2WavConfig, codes: Any,
                states: Sequence[Code2WavState]) -> tuple[jax.Array, tuple[Code2WavState, ...]]:
    """Decodes the next `n` frames of R utterances in one call (jitted: one compile per R, n and `started`).

    Args:
        params: the Code2Wav pure-dict parameter tree (`code2wav_decode.model_params`).
        config: its config.
        codes: `[R, Q, n]` int32 codes, row r continuing `states[r]`.
        states: R batch-of-one states, all started or none.

    Returns:
        `(wav [R, samples], states)`: row r's samples equal `decode_frames(params, config, codes[r:r+1],
        states[r])`'s, and its next state.

    Raises:
        ValueError: the rows disagree on `started`, a state is not batch-of-one, or `codes` has not R rows.
    """
    arr = np.asarray(codes, np.int32)
    states = tuple(states)
    if arr.ndim != 3 or arr.shape[0] != len(states) or not states:
        raise ValueError(f"codes {arr.shape} must be [R, Q, n] with one row per state ({len(states)} states)")
    if len({s.started for s in states}) != 1:
        raise ValueError("the rows of one Code2Wav call must all be first calls or all later calls (started)")
    if any(s.keys.shape[1] != 1 for s in states):
        raise ValueError("decode_rows takes batch-of-one states (one utterance per row)")
    return _rows(params, jnp.asarray(arr), states, config)
