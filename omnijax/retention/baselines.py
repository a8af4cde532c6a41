"""Position- and score-based baseline retention policies (OmniTide §7.1; Metronome for `SinkWindow`).

All four are **unit-blind on purpose**: they rank live tokens by age (`view.order`, never the slot index) and, for
H2O, by accumulated attention `score`; they ignore units, span kinds and offsets. That is the point of the comparison
with OmniPick: a token-count cut may split an audiovisual unit, drop boundary tokens, or keep half an image.

The SYSTEM prefix is not pinned either. It is simply the oldest run of tokens: `StreamingLLM` and `SinkWindow` keep
its first `sink` tokens as attention sinks (exactly what the original methods do with the initial tokens), H2O keeps
its tokens only while their accumulated score makes them heavy hitters, and `TokenSliding` lets it slide out like
everything else.

Budgets (retained cells after a trim, exactly `min(retained, budget)`):

    TokenSliding(window, high_watermark)          newest `window`                         re-indexed
    StreamingLLM(sink_tokens, window, hw)         oldest `sink_tokens` + newest `window`  re-indexed
    H2O(heavy, recent, high_watermark)            newest `recent` + `heavy` top-score     re-indexed
    SinkWindow(sink, window)                      oldest `sink` + newest `window`         positions keep growing

The first three trigger when retained cells exceed `high_watermark` (OmniTide defaults: 2500 high, 1800 kept, two
StreamingLLM sinks); `SinkWindow` triggers as soon as retained cells exceed `sink + window` (Metronome: S=16,
W=1024), so its cache holds at most `sink + window` tokens after each trim.

Every plan is vectorised over `[B, S]` (one sort per ranking, no Python branching on traced values) and jittable; the
hyperparameters are static (frozen, hashable dataclasses).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp

from omnijax.retention.base import SequenceView, register

__all__ = ["H2O", "SinkWindow", "StreamingLLM", "TokenSliding", "age_ranks"]


def age_ranks(view: SequenceView) -> tuple[jax.Array, jax.Array]:
    """Age ranks of the live slots: `(from_oldest, from_newest)`, each `[B, S]` int32.

    `from_oldest` is 0 for the oldest live token of a sequence and `retained - 1` for the newest; `from_newest` is the
    reverse. Dead slots get ranks `>= retained` in `from_oldest` and negative ones in `from_newest`; mask with `live`.
    Ranks come from one stable sort of `order` with dead slots pushed to the end.
    """
    B, S = view.live.shape
    key = jnp.where(view.live, view.order, jnp.iinfo(jnp.int32).max)
    idx = jnp.argsort(key, axis=1, stable=True)
    rows = jnp.arange(B)[:, None]
    from_oldest = jnp.zeros((B, S), jnp.int32).at[rows, idx].set(jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32),
                                                                                  (B, S)))
    from_newest = view.retained.astype(jnp.int32)[:, None] - 1 - from_oldest
    return from_oldest, from_newest


def _newest(view: SequenceView, n: int) -> jax.Array:
    """`[B, S]` bool: the `n` newest live tokens."""
    _, from_newest = age_ranks(view)
    return view.live & (from_newest < n)


def _sinks_and_window(view: SequenceView, sink: int, window: int) -> jax.Array:
    """`[B, S]` bool: the `sink` oldest and the `window` newest live tokens."""
    from_oldest, from_newest = age_ranks(view)
    return view.live & ((from_oldest < sink) | (from_newest < window))


def _over(view: SequenceView, threshold: int) -> jax.Array:
    return view.retained > threshold


def _check_int(cls: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{cls}: {name} must be an int, got {value!r}")


@register
@dataclasses.dataclass(frozen=True)
class TokenSliding:
    """Token-level sliding ("token-basic", OmniTide §7.1): above `high_watermark` retained cells, keep the newest
    `window` tokens regardless of unit or span boundaries; positions are re-indexed.

    Args:
        window: tokens kept by a trim (the low watermark), `1 <= window <= high_watermark`.
        high_watermark: trim when retained cells exceed it.
    """

    window: int = 1800
    high_watermark: int = 2500

    name: ClassVar[str] = "token_sliding"
    reindex: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("TokenSliding", window=self.window, high_watermark=self.high_watermark)
        if self.window < 1:
            raise ValueError(f"TokenSliding: window must be >= 1, got {self.window}")
        if self.window > self.high_watermark:
            raise ValueError(f"TokenSliding: window ({self.window}) must not exceed high_watermark "
                             f"({self.high_watermark}), or a trim would keep more than triggered it")

    @property
    def budget(self) -> int:
        """Most retained cells after a trim."""
        return self.window

    def trigger(self, view: SequenceView) -> jax.Array:
        return _over(view, self.high_watermark)

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the high watermark."""
        return self.high_watermark

    def plan(self, view: SequenceView) -> jax.Array:
        return _newest(view, self.window)


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM:
    """StreamingLLM (attention sinks + recent window): above `high_watermark` retained cells, keep the oldest
    `sink_tokens` tokens and the newest `window`; positions are re-indexed within the cache, as in the seed's setup.

    Args:
        sink_tokens: oldest tokens pinned as attention sinks, `>= 0` (the seed uses 2).
        window: newest tokens kept, `>= 1`.
        high_watermark: trim when retained cells exceed it; `sink_tokens + window <= high_watermark`.
    """

    sink_tokens: int = 2
    window: int = 1800
    high_watermark: int = 2500

    name: ClassVar[str] = "streaming_llm"
    reindex: ClassVar[bool] = True

    def __post_init__(self):
        _check_int("StreamingLLM", sink_tokens=self.sink_tokens, window=self.window,
                   high_watermark=self.high_watermark)
        if self.sink_tokens < 0:
            raise ValueError(f"StreamingLLM: sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.window < 1:
            raise ValueError(f"StreamingLLM: window must be >= 1, got {self.window}")
        if self.sink_tokens + self.window > self.high_watermark:
            raise ValueError(f"StreamingLLM: sink_tokens + window ({self.sink_tokens} + {self.window}) must not "
                             f"exceed high_watermark ({self.high_watermark})")

    @property
    def budget(self) -> int:
        """Most retained cells after a trim."""
        return self.sink_tokens + self.window

    def trigger(self, view: SequenceView) -> jax.Array:
        return _over(view, self.high_watermark)

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the high watermark."""
        return self.high_watermark

    def plan(self, view: SequenceView) -> jax.Array:
        return _sinks_and_window(view, self.sink_tokens, self.window)


@register
@dataclasses.dataclass(frozen=True)
class H2O:
    """Heavy-hitter oracle: above `high_watermark` retained cells, keep the newest `recent` tokens plus the `heavy`
    older tokens with the largest accumulated attention `score`; positions are re-indexed.

    Ties: heavy hitters are ranked by `(score, order)` descending, so among equal scores the newer token wins. With no
    scores tracked (all zero) H2O therefore degenerates to `TokenSliding(window=heavy + recent)`. A score of `-0.0`
    counts as `0.0`; scores must not be NaN.

    Args:
        heavy: heavy hitters kept from outside the recent window, `>= 0`.
        recent: newest tokens kept, `>= 1`.
        high_watermark: trim when retained cells exceed it; `heavy + recent <= high_watermark`.
    """

    heavy: int = 900
    recent: int = 900
    high_watermark: int = 2500

    name: ClassVar[str] = "h2o"
    reindex: ClassVar[bool] = True
    needs_scores: ClassVar[bool] = True  # the stream accumulates attention mass into `kv.score` for it

    def __post_init__(self):
        _check_int("H2O", heavy=self.heavy, recent=self.recent, high_watermark=self.high_watermark)
        if self.heavy < 0:
            raise ValueError(f"H2O: heavy must be >= 0, got {self.heavy}")
        if self.recent < 1:
            raise ValueError(f"H2O: recent must be >= 1, got {self.recent}")
        if self.heavy + self.recent > self.high_watermark:
            raise ValueError(f"H2O: heavy + recent ({self.heavy} + {self.recent}) must not exceed high_watermark "
                             f"({self.high_watermark})")

    @property
    def budget(self) -> int:
        """Most retained cells after a trim."""
        return self.heavy + self.recent

    def trigger(self, view: SequenceView) -> jax.Array:
        return _over(view, self.high_watermark)

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the high watermark."""
        return self.high_watermark

    def plan(self, view: SequenceView) -> jax.Array:
        B, S = view.live.shape
        recent = _newest(view, self.recent)
        candidate = view.live & ~recent
        score = jnp.where(view.score == 0, jnp.zeros_like(view.score), view.score)  # -0.0 ties with 0.0
        # Ascending by (candidate, score, order): candidates fill the tail, the best heavy hitters last.
        idx = jnp.lexsort((view.order, score, candidate.astype(jnp.int32)), axis=-1)
        top = jnp.broadcast_to(jnp.arange(S) >= S - self.heavy, (B, S))
        heavy = jnp.zeros((B, S), bool).at[jnp.arange(B)[:, None], idx].set(top)
        return recent | (candidate & heavy)


@register
@dataclasses.dataclass(frozen=True)
class SinkWindow:
    """Metronome's sink-anchored window: as soon as retained cells exceed `sink + window`, keep the oldest `sink`
    tokens and the newest `window`. Positions are **not** re-indexed: they keep growing, as in an engine's
    sliding-window attention with pinned sinks.

    Args:
        sink: oldest tokens pinned as attention sinks, `>= 0` (Metronome: 16).
        window: newest tokens kept, `>= 1` (Metronome: 1024).
    """

    sink: int = 16
    window: int = 1024

    name: ClassVar[str] = "sink_window"
    reindex: ClassVar[bool] = False

    def __post_init__(self):
        _check_int("SinkWindow", sink=self.sink, window=self.window)
        if self.sink < 0:
            raise ValueError(f"SinkWindow: sink must be >= 0, got {self.sink}")
        if self.window < 1:
            raise ValueError(f"SinkWindow: window must be >= 1, got {self.window}")

    @property
    def budget(self) -> int:
        """Most retained cells after a trim (also the trigger threshold)."""
        return self.sink + self.window

    def trigger(self, view: SequenceView) -> jax.Array:
        return _over(view, self.sink + self.window)

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: sink + window."""
        return self.sink + self.window

    def plan(self, view: SequenceView) -> jax.Array:
        return _sinks_and_window(view, self.sink, self.window)
