"""Decoding strategies: how an answer's next token is chosen from the last position's logits.

A strategy is a tiny frozen dataclass of static settings (part of the compiled program, like a retention policy):
`warp(logits, history)` turns raw logits into the scores it draws from (`-inf` where a token is masked) and
`select(logits, history)` picks one token per sequence inside the jitted step. `StreamConfig.decoding` holds the
strategy of a session; `stream`, `Session`, `evaluate` and the engine all answer through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
    """The most likely token (argmax over the vocabulary; ties go to the lowest id)."""

    def warp(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` as float32 scores; greedy masks nothing. `history [B, N]` (-1 = padding) is unused."""
        del history
        return logits.astype(jnp.float32)

    def select(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 next tokens for `logits [B, V]`."""
        return jnp.argmax(self.warp(logits, history), axis=-1).astype(jnp.int32)


STRATEGIES = (Greedy,)


def check_decoding(strategy) -> object:
    """Returns `strategy` if it is a decoding strategy object; refuses anything else, naming the strategies."""
    if isinstance(strategy, type) or not (callable(getattr(strategy, "warp", None))
                                          and callable(getattr(strategy, "select", None))):
        names = ", ".join(f"omnijax.decoding.{s.__name__}()" for s in STRATEGIES)
        raise TypeError(f"decoding must be a decoding strategy object such as {names}, got {strategy!r}")
    return strategy
