"""`Recall(placement="compact")` (issue 40): a policy that never re-indexes (SinkWindow) re-lays recalled units as a
re-indexing policy does. Oracles: recalling everything equals the full context (`NoSlide`) to 1e-5; with forced
scores exactly the chosen records come back, every cached and recalled token at the rank of its full-context
position among those present (a plain-Python compaction), keys equal to the stored ones re-rotated there."""

import numpy as np
import pytest

import omnijax
from omnijax.retention.recall import Recall, parse_recall, rerotate
from tests._support import recall_setup
from tests.streaming.test_recall_window import BLOCK, POLICIES, _fed

COMPACT = dict(block=BLOCK, window=2, scoring="peak", placement="compact")


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def test_compact_recall_of_everything_equals_the_full_context(model):
    want = _fed(model, omnijax.NoSlide()).feed(recall_setup.question(100))
    session = _fed(model, POLICIES["sink_window"], Recall(budget=64, top_units=64, **COMPACT))
    evicted = sum(u.size for u in session._recall.tier.units)
    got = session.feed(recall_setup.question(100))
    assert session._recall.last.cells == evicted > 0
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)


def test_forced_compact_recall_lays_the_chosen_records_next_to_the_cache(model):
    session = _fed(model, POLICIES["sink_window"], Recall(budget=9, top_units=2, **COMPACT))  # the two forced
    rs = session._recall
    before = recall_setup.by_order(session.state.kv)
    tier = rs.tier
    chosen = [0, len(tier.units) // 2]  # the oldest record and one from the middle
    scores = np.zeros(len(tier.units), np.float32)
    scores[chosen] = [2.0, 1.0]
    report = session.recall(recall_setup.question(100), scores=scores)
    assert sorted(report.indices) == sorted(chosen)
    after = recall_setup.by_order(session.state.kv)
    recalled = {int(o): (tier.units[i], t) for i in chosen for t, o in enumerate(tier.units[i].order)}
    # full-context position of every token present (cached ones: SinkWindow never moved them)
    full = {o: int(before[o][2][0]) for o in before}
    full.update({o: int(u.vpos[t]) for o, (u, t) in recalled.items()})
    rank = {p: r for r, p in enumerate(sorted(full.values()))}
    assert len(after) == len(before) + len(recalled)
    moved = 0
    for new_order, (k, v, pos, *_) in after.items():
        if new_order in before:
            o, k0, p0 = new_order, before[new_order][0], before[new_order][2]
        else:  # a recalled token: written at a new order, matched by its values
            matches = [o for o, (u, t) in recalled.items() if np.array_equal(u.v[:, :, t], v)]
            assert len(matches) == 1
            o = matches[0]
            u, t = recalled[o]
            k0, p0 = u.k[:, :, t], u.pos[:, t]
        assert int(pos[0]) == rank[full[o]], o
        moved += int(pos[0]) != int(p0[0])
        theta, section, interleaved = rs.rope
        want = rerotate(k0[:, :, None], p0[:, None], pos[:, None], theta=theta, mrope_section=section,
                        interleaved=interleaved)
        np.testing.assert_allclose(k, np.asarray(want)[:, :, 0], atol=1e-5)
    assert moved > 0  # the placement did move tokens (SinkWindow's own positions would move none)
    session.feed(recall_setup.question(100))
    assert rs._pending is None and not rs.at_original


def test_placement_is_parsed_and_refused_by_name():
    assert parse_recall("preset,placement=compact") == Recall.preset(placement="compact")
    assert Recall(budget=8).placement == "own"
    with pytest.raises(ValueError, match="placement must be one of"):
        Recall(budget=8, placement="near")
    assert Recall(budget=8).at_own_positions(POLICIES["sink_window"])
    assert not Recall(budget=8, placement="compact").at_own_positions(POLICIES["sink_window"])
    assert not Recall(budget=8).at_own_positions(POLICIES["omnipick"])
