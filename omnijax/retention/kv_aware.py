"""Query-agnostic KV compression baselines that rank by the cached keys and values (2025-26): InfiniPot-V and
StreamMem.

Both set `needs_kv`, so `retention.base.trim` hands their plan the `SlotFeatures` of the cache (each slot's key and
value norm, averaged over layers and KV heads) when they trim; both keep positions as they are (no re-indexing).
Where the papers leave a detail open, or the library's interface differs, the choice is documented and a parameter.

    InfiniPotV(budget, recent_units, tar_fraction, visual_kinds)
        when retained > budget: keep every non-visual token and the newest `recent_units` visual units; of the older
        visual tokens keep `quota = budget - kept` of them: first the `tar_fraction` share with the least temporal
        redundancy (TaR: cosine similarity of a token's key to the key at the same span offset in the newest visual
        unit; no such key counts as -1, never redundant), then the highest value norms (VaN).
    StreamMem(budget, num_proxies, proxy_kinds)
        when retained > budget: keep SYSTEM and the proxy tokens; rank the rest by the attention the newest
        `num_proxies` proxy tokens (chat-template markers by default) pay them, and keep the best `quota`; equal
        scores keep the newer token (with no proxy every score is 0 and the newest `quota` stay: it once kept the
        oldest and evicted the question it had just written, answering "TheTheThe" on SmolLM2).
        The cache holds no queries, so the proxies' cached keys stand in for their queries
        (`softmax(k_p . k_j / sqrt(d))` over live slots, averaged over proxies): a documented substitution.

Ties go to the lower slot (page-table order), but for StreamMem's (above). Plain-Python references:
`tests/retention/test_retention_kv_aware.py`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp

from omnijax.chunks.spans import SpanKind
from omnijax.retention.base import SequenceView, SlotFeatures, register

VISUAL = (int(SpanKind.IMAGE), int(SpanKind.SLICE), int(SpanKind.VIDEO))


def _check(cls: str, **values) -> None:
    for label, (value, minimum) in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{cls}: {label} must be an int >= {minimum}, got {value!r}")


def _kinds(cls: str, kinds) -> tuple[int, ...]:
    try:
        out = tuple(int(SpanKind(int(k))) for k in kinds)
    except (TypeError, ValueError):
        raise ValueError(f"{cls}: kinds must be omnijax.chunks.spans.SpanKind values, got {kinds!r}") from None
    if not out:
        raise ValueError(f"{cls}: give at least one span kind")
    return out


def _best(score: jax.Array, eligible: jax.Array, count: jax.Array, order: jax.Array | None = None) -> jax.Array:
    """`[S]` mask of the `count` eligible slots of highest score (ties: the lower slot, or with `order` the newer
    token)."""
    S = score.shape[0]
    key = jnp.where(eligible, score, -jnp.inf)
    second = jnp.arange(S) if order is None else -order
    rank_order = jnp.lexsort((second, -key))  # descending score, then ascending slot (or descending order)
    rank = jnp.zeros((S,), jnp.int32).at[rank_order].set(jnp.arange(S, dtype=jnp.int32))
    return eligible & (rank < count)


def _newest_units(unit: jax.Array, mask: jax.Array, k: int) -> jax.Array:
    """`[S]` mask of `mask`'s tokens whose unit is among its `k` newest units: the `k` largest unit ids (units are
    numbered in stream order)."""
    units = jnp.sort(jnp.where(mask, unit, -1))[::-1]  # descending; -1 for slots outside the mask
    distinct = (units >= 0) & jnp.concatenate([jnp.ones((1,), bool), units[1:] != units[:-1]])
    within = jnp.cumsum(distinct) <= k
    threshold = jnp.min(jnp.where(within & (units >= 0), units, jnp.iinfo(jnp.int32).max))
    return mask & (unit >= threshold)


@register
@dataclasses.dataclass(frozen=True)
class InfiniPotV:
    """InfiniPot-V (2025): query-agnostic compression of streaming video KV to a budget by temporal redundancy (TaR)
    and value norm (VaN); see the module docstring for the rule and its chosen details.

    Attributes:
        budget: cells kept after a compression (and the retained count that triggers one).
        recent_units: newest visual units (largest unit ids) kept whole; redundancy is measured against the newest.
        tar_fraction: share of the older visual quota chosen by least redundancy; the rest by value norm.
        visual_kinds: span kinds compressed (IMAGE, SLICE, VIDEO).
    """

    budget: int = 2048
    recent_units: int = 1
    tar_fraction: float = 0.5
    visual_kinds: tuple[int, ...] = VISUAL

    name: ClassVar[str] = "infinipot_v"
    reindex: ClassVar[bool] = False
    needs_kv: ClassVar[bool] = True

    def __post_init__(self):
        _check("InfiniPotV", budget=(self.budget, 1), recent_units=(self.recent_units, 1))
        if isinstance(self.tar_fraction, bool) or not 0 <= self.tar_fraction <= 1:
            raise ValueError(f"InfiniPotV: tar_fraction must lie in [0, 1], got {self.tar_fraction!r}")
        object.__setattr__(self, "visual_kinds", _kinds("InfiniPotV", self.visual_kinds))

    def trigger(self, view: SequenceView) -> jax.Array:
        return view.retained > self.budget

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the budget."""
        return self.budget

    def plan(self, view: SequenceView, features: SlotFeatures) -> jax.Array:
        return jax.vmap(self._plan_one)(view.live, view.unit, view.span, view.offset, features.key,
                                        features.value_norm)

    def _plan_one(self, live, unit, span, offset, key, value_norm):
        S = live.shape[0]
        visual = live & jnp.isin(span, jnp.asarray(self.visual_kinds))
        recent = _newest_units(unit, visual, self.recent_units)
        newest = _newest_units(unit, visual, 1)
        protected = live & (~visual | recent)
        candidates = visual & ~recent
        quota = jnp.maximum(self.budget - jnp.sum(protected), 0)
        # TaR: each token's key against the newest visual unit's key at the same span offset
        slot = jnp.clip(offset, 0, S - 1)
        ref = jnp.zeros_like(key).at[jnp.where(newest, slot, S)].add(key, mode="drop")
        have = jnp.zeros((S,), bool).at[jnp.where(newest, slot, S)].set(True, mode="drop")
        ref_k = ref[slot]
        cos = jnp.sum(key * ref_k, axis=-1) / jnp.maximum(
            jnp.linalg.norm(key, axis=-1) * jnp.linalg.norm(ref_k, axis=-1), 1e-12)
        redundancy = jnp.where(have[slot], cos, -1.0)
        by_tar = jnp.floor(quota * self.tar_fraction).astype(jnp.int32)
        tar = _best(-redundancy, candidates, by_tar)
        van = _best(value_norm, candidates & ~tar, quota - jnp.sum(tar))
        return protected | tar | van


@register
@dataclasses.dataclass(frozen=True)
class StreamMem:
    """StreamMem-style query-agnostic compression (2025): chat-template tokens act as proxy queries and the cache is
    cut to a fixed budget by the attention they pay (see the module docstring for the substitution of keys for
    queries).

    Attributes:
        budget: cells kept after a compression (and the retained count that triggers one).
        num_proxies: the newest proxy tokens that score. Equal scores keep the newer token, so a stream with no
            proxy token (text through a chat template whose markers are TEXT) keeps its newest cells: a window.
        proxy_kinds: span kinds whose tokens are the proxies (BOUNDARY: the chat-template markers).
    """

    budget: int = 2048
    num_proxies: int = 32
    proxy_kinds: tuple[int, ...] = (int(SpanKind.BOUNDARY),)

    name: ClassVar[str] = "streammem"
    reindex: ClassVar[bool] = False
    needs_kv: ClassVar[bool] = True

    def __post_init__(self):
        _check("StreamMem", budget=(self.budget, 1), num_proxies=(self.num_proxies, 1))
        object.__setattr__(self, "proxy_kinds", _kinds("StreamMem", self.proxy_kinds))

    def trigger(self, view: SequenceView) -> jax.Array:
        return view.retained > self.budget

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the budget."""
        return self.budget

    def plan(self, view: SequenceView, features: SlotFeatures) -> jax.Array:
        return jax.vmap(self._plan_one)(view.live, view.span, view.order, features.key)

    def _plan_one(self, live, span, order, key):
        S, d = key.shape
        proxy = live & jnp.isin(span, jnp.asarray(self.proxy_kinds))
        protected = live & ((span == int(SpanKind.SYSTEM)) | proxy)
        m = min(self.num_proxies, S)
        _, picked = jax.lax.top_k(jnp.where(proxy, order, -1), m)  # the newest proxies (ties: lower slot)
        used = proxy[picked]  # [m]
        logits = key[picked] @ key.T / jnp.sqrt(jnp.float32(d))  # [m, S]
        logits = jnp.where(live[None, :], logits, -jnp.inf)
        attention = jax.nn.softmax(logits, axis=-1)
        score = jnp.sum(jnp.where(used[:, None], attention, 0.0), axis=0) / jnp.maximum(jnp.sum(used), 1)
        quota = jnp.maximum(self.budget - jnp.sum(protected), 0)
        return protected | _best(score, live & ~protected, quota, order)
