"""The immediate-eviction controls of TideKV's prompt-encoding fidelity study (TideKV §6.5, Table 8), by selector.

Table 8 sets two immediate-eviction controls beside layer-major delayed eviction: chunked token-major prefill that
cuts every layer's KV back to the budget after each chunk, scoring it with SnapKV ("Block-SnapKV",
`baselines.immediate_eviction_prefill`) or keeping the most recent tokens ("recent-token eviction",
`recent_eviction_prefill` here). Both are in `IMMEDIATE_EVICTION` under their selector's registered name
(`SnapKV.name`, `RecentTokens.name`) with one signature, and `immediate_eviction` picks by the selector it is given.
"""

from __future__ import annotations

import jax

from omnijax.models.decoder import Decoder
from omnijax.prefill.baselines import immediate_eviction_prefill
from omnijax.prefill.layer_major import PrefillResult
from omnijax.prefill.selectors import RecentTokens, Selector


def recent_eviction_prefill(model: Decoder, x: jax.Array, positions: jax.Array, *, budget: int, chunk: int,
                            selector: Selector | None = None, room: int = 0, next_pos: jax.Array | None = None
                            ) -> PrefillResult:
    """Table 8's recent-token immediate-eviction control: chunked token-major prefill that keeps, after each chunk,
    only every layer's last `budget` tokens per KV head (`baselines.immediate_eviction_prefill` with
    `RecentTokens()`: the same attention arithmetic as the SnapKV control, only what is kept differs).

    A token in the chunk starting at s therefore attends to tokens `max(0, s - budget) ..` itself: chunks starting
    at or before `budget` see their whole history, later ones drift from uncompressed prefill. The final cache holds
    the prompt's last `budget` tokens in every layer and head, what `RecentTokens` keeps at layer end, reached
    without the full history.

    Args:
        model: the decoder.
        x: `[B, S, D]` prompt embeddings.
        positions: `[A, B, S]` absolute positions.
        budget: tokens kept per KV head (one for all layers); `budget >= S` never evicts.
        chunk: prompt chunk length.
        selector: None or a `RecentTokens` (the signature of `IMMEDIATE_EVICTION`'s entries).
        room: decode capacity per head in the returned cache.
        next_pos: `[B]` the position decoding continues from (default: max prompt position + 1).
    """
    if selector is not None and not isinstance(selector, RecentTokens):
        raise TypeError(f"recent_eviction_prefill keeps recent tokens; got selector {selector!r}")
    return immediate_eviction_prefill(model, x, positions, selector=RecentTokens(), budget=budget, chunk=chunk,
                                      room=room, next_pos=next_pos)


IMMEDIATE_EVICTION = {"snapkv": immediate_eviction_prefill, "recent": recent_eviction_prefill}


def immediate_eviction(model: Decoder, x: jax.Array, positions: jax.Array, *, selector: Selector, budget: int,
                       chunk: int, room: int = 0, next_pos: jax.Array | None = None) -> PrefillResult:
    """The immediate-eviction control for `selector` (`IMMEDIATE_EVICTION[selector.name]`): SnapKV scoring after
    every chunk for a `SnapKV`, the most recent tokens for a `RecentTokens`.

    Raises:
        ValueError: for a selector with no immediate-eviction control.
    """
    name = getattr(selector, "name", None)
    if name not in IMMEDIATE_EVICTION:
        raise ValueError(f"no immediate-eviction control for selector {selector!r}; available: "
                         f"{sorted(IMMEDIATE_EVICTION)}")
    return IMMEDIATE_EVICTION[name](model, x, positions, selector=selector, budget=budget, chunk=chunk, room=room,
                                    next_pos=next_pos)
