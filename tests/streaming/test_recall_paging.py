"""Recall under the paging modes that re-lay the cache (issue 40): `ordered_suffix` (OmniPage's suffix packing),
`eager` (compaction after every trim) and `tile_skip` move survivors between slots or give emptied pages back, and
recall still restores exactly what it says it restores. The oracles are the native-layout ones
(`tests/streaming/test_recall.py`, which runs native and, for recalling everything, `tile_skip`): with a budget that
recalls everything the question's logits equal the full-context (`NoSlide`) session's to 1e-5; with scores forced to
a chosen set exactly that set comes back, at the positions the native layout gives it, keys as stored (re-rotated
only where the policy re-indexes). `ordered_suffix` runs three policies; `eager` and `tile_skip` run OmniPick, the
policy that evicts units in pieces and re-indexes, so the hardest placement."""

import numpy as np
import pytest

import omnijax
from omnijax.models.config import TINY_OMNI
from omnijax.paging import Paging
from omnijax.retention import OmniPick, SinkWindow, StreamingLLM
from omnijax.retention.recall import Recall, rerotate
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU, by_order

SUFFIX = Paging(mode="ordered_suffix")
EAGER = Paging(mode="eager")
TILE = Paging(mode="tile_skip")
OMNIPICK = OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4)


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _session(model, policy, recall=None, paging=SUFFIX):
    return Session(model, StreamConfig(policy=policy, paging=paging, num_pages=PAGES, page_size=PAGE,
                                       max_answer_tokens=TAU, recall=recall))


def _feed(session, chunks):
    return [session.feed(c) for c in chunks]


def _assert_relaid(outs, session):
    """The layout is not the native one: the relayout moved survivors, or emptied pages were given back (the
    native layout never shortens its page table: 48 slots written hold 6 pages)."""
    moved = sum(int(np.asarray(o.stats.moved).sum()) for o in outs)
    listed = int((np.asarray(session.state.kv.page_table[0]) >= 0).sum())
    assert moved > 0 or listed < 48 // PAGE, (moved, listed)


@pytest.fixture(scope="module")
def full(model):
    """The full-context session's answer to the question, and its cache before the question (native layout)."""
    session = _session(model, omnijax.NoSlide(), paging="native")
    _feed(session, recall_setup.context())
    before = by_order(session.state.kv)
    return session.feed(recall_setup.question(100)), before


@pytest.mark.parametrize("policy, paging", [(SinkWindow(sink=2, window=38), SUFFIX), (OMNIPICK, SUFFIX),
                                            (OMNIPICK, EAGER)],
                         ids=["sinkwindow-ordered_suffix", "omnipick-ordered_suffix", "omnipick-eager"])
def test_recalling_everything_under_a_relayout_answers_like_the_full_context(model, full, policy, paging):
    want, _ = full
    recalled = _session(model, policy, Recall(budget=64, top_units=8), paging=paging)
    _assert_relaid(_feed(recalled, recall_setup.context()), recalled)
    stats = recalled.recall_stats()
    assert stats.lost_cells == 0 and stats.dropped_units == 0
    evicted = 48 - len(by_order(recalled.state.kv))
    assert sum(u.size for u in recalled._recall.tier.units) == evicted > 0
    got = recalled.feed(recall_setup.question(100))
    assert recalled._recall.last.cells == evicted
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)
    without = _feed(_session(model, policy, paging=paging), recall_setup.context() + [recall_setup.question(100)])[-1]
    assert np.abs(np.asarray(without.logits) - np.asarray(want.logits)).max() > 1e-3  # the check can fail
    live = by_order(recalled.state.kv)  # released: no recalled token left, the positions closed up again
    assert not any(o in live for o in range(48, 48 + evicted))


def _rotate(k, from_pos, to_pos):
    return np.asarray(rerotate(k, from_pos, to_pos, theta=TINY_OMNI.rope_base, mrope_section=TINY_OMNI.mrope_section))


@pytest.mark.parametrize("policy, paging", [(SinkWindow(sink=2, window=12), SUFFIX),
                                            (StreamingLLM(sink_tokens=2, window=12, high_watermark=16), SUFFIX),
                                            (OMNIPICK, SUFFIX), (OMNIPICK, EAGER), (OMNIPICK, TILE)],
                         ids=["sinkwindow-ordered_suffix", "streamingllm-ordered_suffix", "omnipick-ordered_suffix",
                              "omnipick-eager", "omnipick-tile_skip"])
def test_forced_scores_under_a_relayout_restore_exactly_the_chosen_units(model, policy, paging):
    # Oracle: the native-layout session with the same forced scores, whose capture and restoration
    # tests/streaming/test_recall.py checks against the full-context cache: the same records, then the same tokens,
    # positions, keys and values after the recall, whatever slots the relayout put them in.
    suffix = _session(model, policy, Recall(budget=64, top_units=2), paging=paging)
    _assert_relaid(_feed(suffix, recall_setup.context()), suffix)
    native = _session(model, policy, Recall(budget=64, top_units=2), paging="native")
    _feed(native, recall_setup.context())
    tier, tier_native = suffix._recall.tier, native._recall.tier
    assert [(u.unit, u.size) for u in tier.units] == [(u.unit, u.size) for u in tier_native.units]
    U = len(tier.units)
    assert U >= 3
    for u, w in zip(tier.units, tier_native.units):  # stored as the native layout stores them
        np.testing.assert_array_equal(u.order, w.order)
        np.testing.assert_array_equal(u.pos, w.pos)
        # the same tokens; from the second layer on they were computed over another slot order (float32 sums)
        np.testing.assert_allclose(u.v, w.v, atol=1e-6)
        np.testing.assert_allclose(u.k, w.k, atol=1e-6)
        np.testing.assert_array_equal(u.span, w.span)
        np.testing.assert_array_equal(u.offset, w.offset)
    chosen = [0, U - 2]
    scores = np.zeros(U, np.float32)
    scores[chosen] = [5.0, 7.0]
    before, before_native = by_order(suffix.state.kv), by_order(native.state.kv)
    assert before.keys() == before_native.keys()
    report = suffix.recall(recall_setup.question(100), scores=scores)
    native.recall(recall_setup.question(100), scores=scores)
    assert report.forced and report.indices == tuple(chosen)
    assert report.cells == sum(tier.units[i].size for i in chosen)
    after, after_native = by_order(suffix.state.kv), by_order(native.state.kv)
    assert after.keys() == after_native.keys() and len(after) == len(before) + report.cells
    for o, (k, v, pos, *meta) in after.items():
        nk, nv, npos, *nmeta = after_native[o]
        np.testing.assert_array_equal(pos, npos)
        np.testing.assert_allclose(v, nv, atol=1e-6)
        np.testing.assert_allclose(k, nk, atol=1e-6)
        assert meta == nmeta
    for i in chosen:  # the recalled tokens hold the chosen records' values and span metadata
        u = tier.units[i]
        new = sorted(o for o in after if o not in before and after[o][3] == u.unit)
        assert len(new) == u.size
        for j, o in enumerate(new):
            np.testing.assert_array_equal(after[o][1], u.v[:, :, j])
            if not policy.reindex:
                np.testing.assert_array_equal(after[o][0], u.k[:, :, j])
                np.testing.assert_array_equal(after[o][2], u.pos[:, j])
    a, b = suffix.feed(recall_setup.question(100)), native.feed(recall_setup.question(100))
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5)
    assert not any(o in by_order(suffix.state.kv) for o in after if o not in before)  # released
