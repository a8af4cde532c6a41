"""Recall windows (issue 40): `Recall(window=W)` scores, for every stored record, the run of up to W records that
follow one another token by token from it, and recalls the best windows' records. Window members against a
plain-Python walk of write orders; window scores against "mass" / "peak" over a tier whose records are the windows'
tokens concatenated (attention masses add); the selection against a plain-Python walk; on the tiny decoder, the
scores a question computes and the records it recalls are those of the oracles, and recalling every window answers
like the full context."""

import dataclasses

import numpy as np
import pytest

import omnijax
from omnijax.kv import host_tier, host_tier_scoring
from omnijax.retention import OmniPick, SinkWindow
from omnijax.retention.recall import Recall, parse_recall
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU

BLOCK = 3  # test_recall_blocks' block size and policies: the same compiled programs
POLICIES = {
    "sink_window": SinkWindow(sink=2, window=38),
    "omnipick": OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4),
}
ROPE = recall_setup.ROPE


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _merged(tier, members):
    """A tier whose record i is window i's tokens as one record."""
    units = []
    for i, m in enumerate(members):
        rs = [tier.units[j] for j in m]
        units.append(host_tier.make_unit(i, np.concatenate([r.k for r in rs], 2), np.concatenate([r.v for r in rs], 2),
                                         np.concatenate([r.pos for r in rs], 1), np.concatenate([r.span for r in rs]),
                                         np.concatenate([r.offset for r in rs]), np.concatenate([r.order for r in rs])))
    return dataclasses.replace(tier, units=tuple(units))


def _select_reference(scores, sizes, members, budget, top_units):
    taken, cells = [], 0
    for i in sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i)):
        for j in members[i]:
            if j in taken:
                continue
            if len(taken) + 1 > top_units or cells + int(sizes[j]) > budget:
                return sorted(taken)
            taken.append(j)
            cells += int(sizes[j])
    return sorted(taken)


@pytest.mark.parametrize("seed", range(4))
def test_window_scores_are_the_scores_of_the_windows_tokens_as_one_record(seed):
    rng = np.random.default_rng(seed)
    # three runs of records, one a lone record; a gap between runs (orders 20-29 never stored)
    tier = recall_setup.random_tier(rng, [(0, [3, 3, 2, 3]), (30, [3, 1]), (50, [2])])
    queries = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    for window in (1, 2, 3):
        members = host_tier_scoring.window_members(tier, window)
        assert [m.tolist() for m in members] == recall_setup.window_members_reference(tier, window)
        merged = _merged(tier, members)
        for name in ("mass", "peak"):
            score = getattr(host_tier_scoring, f"score_units_{name}")
            np.testing.assert_allclose(score(tier, queries, ROPE, window=window), score(merged, queries, ROPE),
                                       rtol=1e-5, atol=1e-5)
    assert max(len(m) for m in host_tier_scoring.window_members(tier, 3)) == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="window must be a positive int"):
            host_tier_scoring.window_members(tier, bad)


@pytest.mark.parametrize("seed", range(8))
def test_window_selection_is_the_plain_walk_and_one_record_windows_select_units(seed):
    rng = np.random.default_rng(seed)
    tier = recall_setup.random_tier(rng, [(0, list(rng.integers(1, 5, size=int(rng.integers(2, 7))))), (40, [2, 4])])
    U = len(tier.units)
    scores = rng.normal(size=U).astype(np.float32)
    scores[rng.integers(U)] = scores[0]  # a tie
    budget, top = int(rng.integers(0, 20)), int(rng.integers(1, U + 1))
    for window in (1, 2, 3):
        members = host_tier_scoring.window_members(tier, window)
        got = host_tier_scoring.select_windows(scores, tier.sizes, members, budget, top)
        assert got.tolist() == _select_reference(scores, tier.sizes, [m.tolist() for m in members], budget, top)
        assert tier.sizes[got].sum() <= budget and got.size <= top
    one = host_tier_scoring.window_members(tier, 1)
    np.testing.assert_array_equal(host_tier_scoring.select_windows(scores, tier.sizes, one, budget, top),
                                  host_tier_scoring.select_units(scores, tier.sizes, budget, top))
    with pytest.raises(ValueError, match="one window per record"):
        host_tier_scoring.select_windows(scores, tier.sizes, one[:-1], budget, top)


def _fed(model, policy, recall=None):
    session = Session(model, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                                          recall=recall))
    for chunk in recall_setup.context():
        session.feed(chunk)
    return session


def test_a_question_recalls_the_best_windows_records(model):
    recall = Recall(budget=9, top_units=8, block=BLOCK, window=2, scoring="peak")
    session = _fed(model, POLICIES["omnipick"], recall)
    twin = _fed(model, POLICIES["omnipick"], recall)  # the oracle's queries, from the same fed state
    question = recall_setup.question(100)
    rs = twin._recall
    raw = recall_setup.question_queries(twin, question)
    tier = session._recall.tier
    members = host_tier_scoring.window_members(tier, 2)
    assert any(len(m) == 2 for m in members)
    want_scores = host_tier_scoring.score_units_peak(_merged(tier, members), raw, rs.rope)

    report = session.recall(question)
    # windows are ranked by what each adds (test_recall_marginal): the best scores as the whole window, none more
    finite = np.isfinite(report.scores)
    assert report.scores.max() == pytest.approx(want_scores.max(), rel=1e-4, abs=1e-5)
    assert np.all(report.scores[finite] <= want_scores[finite] + 1e-5)
    want = _select_reference(report.scores, tier.sizes, [m.tolist() for m in members], 9, 8)
    assert list(report.indices) == want and report.cells == tier.sizes[want].sum() > 0
    best = int(np.argmax(report.scores))
    assert set(members[best].tolist()) <= set(report.indices)  # the best window comes back whole
    session.feed(question)  # answered and released
    assert session._recall._pending is None


@pytest.mark.parametrize("name", list(POLICIES))
def test_recalling_every_window_answers_like_the_full_context(model, name):
    want = _fed(model, omnijax.NoSlide()).feed(recall_setup.question(100))
    session = _fed(model, POLICIES[name], Recall(budget=64, top_units=64, block=BLOCK, window=2, scoring="peak"))
    evicted = sum(u.size for u in session._recall.tier.units)
    got = session.feed(recall_setup.question(100))
    assert session._recall.last.cells == evicted
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)


def test_window_setting_and_the_preset_are_parsed_and_refused_by_name():
    assert parse_recall("budget=64,block=16,window=2,scoring=peak,placement=compact") == Recall(
        budget=64, block=16, window=2, scoring="peak", placement="compact") == Recall.preset()
    assert parse_recall("preset,budget=128,keep=true") == Recall.preset(128, keep=True) == Recall(
        budget=128, block=16, window=2, scoring="peak", placement="compact", keep=True)
    assert parse_recall("preset") == Recall.preset()
    assert Recall(budget=8).window == 1
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="window must be a positive int"):
            Recall(budget=8, window=bad)
    for scoring in ("max", "mean", "two_stage"):
        with pytest.raises(ValueError, match="window=2 sums the attention mass"):
            Recall(budget=8, window=2, scoring=scoring)
