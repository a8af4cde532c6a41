"""Unit-granular retention: the unit ranking shared by every unit-aware policy, and the two whole-unit windows.

Units of a sequence are the distinct unit ids among its live non-SYSTEM tokens (the SYSTEM prefix is pinned and never
part of a unit window). A unit's age is the smallest write `order` among those tokens; units are ranked oldest first
(rank 0), ties on age (never produced by the cache, whose orders are unique) broken by the smaller unit id. Everything
is computed per sequence with sorts, cumsums and segment sums over the fixed slot capacity S, then vmapped over the
batch: no Python branching on traced values, so plans jit once per (policy, shape).

Whole-unit dropping (`drop_oldest_units`): given the tokens a policy would keep, drop whole units oldest first, the
fewest that bring SYSTEM + kept to at most the low watermark, but never the newest unit. If even the newest unit alone
exceeds the target, the result is SYSTEM + that unit (the low watermark is a target, not a bound).

`UnitFIFO` (the paper's "unit-level FIFO / basic" baseline) and `OfficialUnitWindow` (MiniCPM-o 4.5's own window,
watermarks 8000/6000 for text, 4000/3500 for duplex) are both that rule applied to whole units; they differ in their
default watermarks and in what they stand for in comparisons. Both re-index (`reindex = True`): the dropped units sit
between the pinned prefix and the survivors, so without closing the gap the positions would drift away from what
the model saw in training; MiniCPM-o re-aligns the RoPE of the suffix and the FIFO baseline follows the same context
shift, which keeps it comparable to OmniPick.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from omnijax.chunks.spans import SpanKind
from omnijax.retention.base import SequenceView, register

_BIG = jnp.iinfo(jnp.int32).max


class UnitRanks(NamedTuple):
    """Per slot, `[B, S]` unless noted.

    Attributes:
        member: live non-SYSTEM slot (belongs to a unit).
        rank: its unit's age rank, 0 = oldest (meaningless where not `member`).
        count: `[B]` number of units.
    """

    member: jax.Array
    rank: jax.Array
    count: jax.Array


def _ranks_one(live, span, unit, order):
    S = live.shape[0]
    member = live & (span != SpanKind.SYSTEM)
    # Group by unit id (members first), oldest token first inside each group: a group's first row holds its age.
    idx = jnp.lexsort((order, unit, ~member))
    u_s, o_s, m_s = unit[idx], order[idx], member[idx]
    first = m_s & jnp.concatenate([jnp.ones((1,), bool), u_s[1:] != u_s[:-1]])
    seg = jnp.cumsum(first) - 1  # group index of each sorted row (valid on member rows)
    count = jnp.sum(first).astype(jnp.int32)
    age = jnp.full((S,), _BIG, order.dtype).at[jnp.where(first, seg, S)].set(o_s, mode="drop")
    # Rank groups by age; argsort is stable, so equal ages keep the unit-id order of the groups.
    by_age = jnp.argsort(age)
    seg_rank = jnp.zeros((S,), jnp.int32).at[by_age].set(jnp.arange(S, dtype=jnp.int32))
    rank_sorted = jnp.where(m_s, seg_rank[jnp.clip(seg, 0, S - 1)], S)
    rank = jnp.zeros((S,), jnp.int32).at[idx].set(rank_sorted)
    return member, rank, count


def unit_ranks(view: SequenceView) -> UnitRanks:
    """Units of each sequence ranked by age (see the module docstring)."""
    member, rank, count = jax.vmap(_ranks_one)(view.live, view.span, view.unit, view.order)
    return UnitRanks(member, rank, count)


def _drop_one(system, member, select, rank, count, low):
    S = member.shape[0]
    kept = member & select
    per_unit = jnp.zeros((S,), jnp.int32).at[jnp.where(kept, rank, S)].add(1, mode="drop")  # kept tokens per rank
    before = jnp.cumsum(per_unit) - per_unit  # kept tokens in strictly older units
    total = jnp.sum(system) + jnp.sum(per_unit)
    # Dropping the d oldest units leaves total - before[d]; that is non-increasing in d, so the fewest drops that
    # meet the target is the number of d in [0, count - 1) still above it (d = count - 1 keeps only the newest unit).
    d = jnp.sum((jnp.arange(S) < count - 1) & (total - before > low))
    return system | (kept & (rank >= d))


def drop_oldest_units(view: SequenceView, units: UnitRanks, select: jax.Array, low: int) -> jax.Array:
    """`[B, S]` keep mask: SYSTEM plus the `select`ed unit tokens, after dropping whole units oldest first until
    SYSTEM + kept <= `low` or only the newest unit is left (see the module docstring)."""
    system = view.live & (view.span == SpanKind.SYSTEM)
    return jax.vmap(_drop_one, in_axes=(0, 0, 0, 0, 0, None))(system, units.member, select, units.rank, units.count,
                                                              low)


def check_watermarks(high_watermark: int, low_watermark: int) -> None:
    """ValueError unless 0 <= low <= high, high >= 1, both plain ints."""
    for label, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{label} must be an int, got {value!r}")
    if high_watermark < 1:
        raise ValueError(f"high_watermark must be >= 1, got {high_watermark}")
    if not 0 <= low_watermark <= high_watermark:
        raise ValueError(f"low_watermark must lie in [0, high_watermark={high_watermark}], got {low_watermark}")


@register
@dataclasses.dataclass(frozen=True)
class UnitFIFO:
    """Unit-level FIFO ("basic"): above the high watermark, drop the oldest whole units until SYSTEM + the rest is at
    most the low watermark, always keeping the SYSTEM prefix and the newest unit. Re-indexed."""

    high_watermark: int = 2500
    low_watermark: int = 1800

    name: ClassVar[str] = "unit_fifo"
    reindex: ClassVar[bool] = True

    def __post_init__(self):
        check_watermarks(self.high_watermark, self.low_watermark)

    def trigger(self, view: SequenceView) -> jax.Array:
        return view.retained > self.high_watermark

    def max_untrimmed_cells(self) -> int:
        """Retained cells up to which `trigger` never fires: the high watermark."""
        return self.high_watermark

    def plan(self, view: SequenceView) -> jax.Array:
        units = unit_ranks(view)
        return drop_oldest_units(view, units, units.member, self.low_watermark)


@register
@dataclasses.dataclass(frozen=True)
class OfficialUnitWindow(UnitFIFO):
    """MiniCPM-o 4.5's own policy: pinned SYSTEM prefix, whole oldest units dropped between the watermarks
    (8000/6000 for text sessions; use 4000/3500 for duplex), at least the newest unit kept, RoPE re-aligned."""

    high_watermark: int = 8000
    low_watermark: int = 6000

    name: ClassVar[str] = "official_unit_window"
    reindex: ClassVar[bool] = True
