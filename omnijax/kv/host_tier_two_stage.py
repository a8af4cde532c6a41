"""Two-stage retrieval over a host tier (issue 40): the per-unit summaries pick a shortlist, "mass" ranks it.

"mass" scoring (`omnijax.kv.host_tier_scoring.score_units_mass`) reads every stored key for every question: its cost
grows with the tier (seconds per question at 4K-16K stored tokens on a CPU), while "mean" reads one summary key per
layer and kv head per unit (milliseconds) but ranks a single salient sentence below recent filler. Two stages keep the
ranking of "mass" at a cost that no longer grows with the stored keys: "mean" picks the `shortlist` best units from
the summaries alone, and only those units' keys are read to rank them by their attention mass. Units off the
shortlist get the score `-inf` (never recalled).

With a shortlist at least as long as the tier, every unit is ranked by "mass" in the tier's own order, so the scores
are those of `score_units_mass` bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.kv.host_tier import HostTier
from omnijax.kv.host_tier_scoring import score_units, score_units_mass


def shortlist_units(tier: HostTier, query: np.ndarray, shortlist: int) -> np.ndarray:
    """Indices (ascending, storage order) of the `shortlist` units whose summaries score highest ("mean"
    scoring of `query`), ties to the older unit; every unit when the tier holds at most `shortlist`.

    Args:
        tier: the host tier.
        query: `[L, Hq, d]` (or `[Hq, d]`) the question's rotated queries averaged over its tokens.
        shortlist: most units kept (> 0).
    """
    if isinstance(shortlist, bool) or not isinstance(shortlist, (int, np.integer)) or shortlist < 1:
        raise ValueError(f"shortlist must be a positive int, got {shortlist!r}")
    U = len(tier.units)
    if U <= shortlist:
        return np.arange(U)
    scores = score_units(tier, query, "mean").astype(np.float64)
    rank = np.lexsort((np.arange(U), -scores))
    return np.sort(rank[:shortlist])


def score_units_two_stage(tier: HostTier, queries: np.ndarray, query: np.ndarray, rope: tuple,
                          shortlist: int) -> np.ndarray:
    """`[U]` float32: `score_units_mass` of the shortlisted units (`shortlist_units`), `-inf` for the others.

    Args:
        tier: the host tier.
        queries: `[L, T, Hq, d]` the question's queries before RoPE (what `score_units_mass` takes).
        query: `[L, Hq, d]` the question's rotated queries averaged over its tokens (what the summaries are scored
            with: the summaries are means of keys as rotated when stored).
        rope: `(theta, mrope_section, interleaved)` of the model.
        shortlist: most units whose keys are read.
    """
    short = shortlist_units(tier, query, shortlist)
    out = np.full(len(tier.units), -np.inf, np.float32)
    if short.size:
        sub = dataclasses.replace(tier, units=tuple(tier.units[i] for i in short))
        out[short] = score_units_mass(sub, queries, rope)
    return out
