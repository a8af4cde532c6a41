"""`max_untrimmed_cells` of every registered policy (`omnijax.retention.base.untrimmed_capacity`): no sequence whose
retained cells stay within it triggers a trim, whatever its slots hold (random spans, units, orders and scores,
seeded); where the bound is a watermark or budget, one cell more can trigger. A stream relies on it to run a
program without the trim (`chunk_step(..., trim=False)`) and compute what the trimming one does."""

from __future__ import annotations

import numpy as np
import pytest

from omnijax.chunks import SpanKind
from omnijax.retention import REGISTRY, SequenceView
from omnijax.retention.base import NEVER_TRIMS, untrimmed_capacity

S = 48  # slots a view holds
SPANS = np.array([int(k) for k in SpanKind], np.int32)
# small settings, so that bounds fall inside S; every registered policy appears (checked below)
POLICIES = {
    "no_slide": {},
    "token_sliding": dict(window=8, high_watermark=12),
    "streaming_llm": dict(sink_tokens=2, window=6, high_watermark=10),
    "h2o": dict(heavy=3, recent=4, high_watermark=9),
    "sink_window": dict(sink=2, window=9),
    "infinipot_v": dict(budget=11),
    "streammem": dict(budget=13),
    "streaming_vlm": dict(sink=2, text_window=7, vision_window=5, audio_window=None),
    "omnimem_budgets": dict(visual_budget=6, audio_budget=4, text_budget=9),
    "omnipick": dict(high_watermark=14, low_watermark=10, text_budget=4),
    "unit_fifo": dict(high_watermark=12, low_watermark=8),
    "official_unit_window": dict(high_watermark=15, low_watermark=11),
}
TIGHT = {"token_sliding", "streaming_llm", "h2o", "sink_window", "infinipot_v", "streammem", "omnipick", "unit_fifo",
         "official_unit_window"}  # bound = the count trigger compares with: one cell more triggers


def _views(rng: np.random.Generator, retained: int, B: int = 16) -> SequenceView:
    live = np.zeros((B, S), bool)
    for b in range(B):
        live[b, rng.choice(S, retained, replace=False)] = True
    return SequenceView(live=live, pos=np.tile(np.arange(S, dtype=np.int32), (1, B, 1)),
                        unit=np.sort(rng.integers(0, 6, (B, S)), axis=1).astype(np.int32),
                        span=rng.choice(SPANS, (B, S)).astype(np.int32),
                        offset=rng.integers(0, 5, (B, S)).astype(np.int32),
                        order=np.stack([rng.permutation(S) for _ in range(B)]).astype(np.int32),
                        score=rng.random((B, S)).astype(np.float32), retained=live.sum(axis=1).astype(np.int32))


def test_every_registered_policy_is_covered():
    assert set(POLICIES) == set(REGISTRY.names())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_within_the_bound_nothing_triggers(name):
    policy = REGISTRY.create(name, **POLICIES[name])
    bound = untrimmed_capacity(policy)
    rng = np.random.default_rng(sorted(POLICIES).index(name))
    assert bound == NEVER_TRIMS if name == "no_slide" else 0 <= bound < S
    for retained in sorted({0, 1, min(bound, S) // 2, min(bound, S)}):
        fired = np.asarray(policy.trigger(_views(rng, retained)))
        assert not fired.any(), (name, bound, retained)
    if name in TIGHT:
        assert np.asarray(policy.trigger(_views(rng, bound + 1))).all(), (name, bound)


def test_a_policy_without_the_method_may_trim_at_any_size():
    class Custom:
        name, reindex = "custom", False

        def trigger(self, view):
            return view.retained > 0

        def plan(self, view):
            return view.live

    assert untrimmed_capacity(Custom()) == 0
