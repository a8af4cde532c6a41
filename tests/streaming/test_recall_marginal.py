"""Recall windows ranked by what each adds (issue 40): `rank_windows_marginal` / `score_windows_marginal` against a
plain-Python greedy walk that scores each window's not-yet-taken records from their raw keys and the question's
queries with explicit dot products; `select_windows` over those scores against the same walk stopped by the budget;
on the tiny decoder, the scores a question computes are the oracle's and recalling every window still answers like
the full context (test_recall_window)."""

import math

import numpy as np
import pytest

from omnijax.kv import host_tier_scoring
from omnijax.retention import OmniPick
from omnijax.retention.recall import Recall
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU


def _log_mass(tier, records, queries):
    """`[L, Hq, T]` log attention mass of `records` taken as one record: explicit dot products over the raw keys
    (`recall_setup.random_tier` stores them as the values), each query head reading its kv head."""
    L, T, Hq, d = queries.shape
    G = tier.units[0].k.shape[1]
    keys = np.concatenate([tier.units[j].v for j in records], axis=2).astype(np.float64)  # [L, G, n, d]
    out = np.zeros((L, Hq, T))
    for layer in range(L):
        for h in range(Hq):
            for t in range(T):
                logits = [float(np.dot(queries[layer, t, h], keys[layer, h // (Hq // G), i])) / math.sqrt(d)
                          for i in range(keys.shape[2])]
                top = max(logits)
                out[layer, h, t] = top + math.log(sum(math.exp(a - top) for a in logits))
    return out


def _greedy_reference(tier, members, queries, scoring, budget=None, top_units=None):
    """The walk read plainly: each round, score every open window by its untaken records, take the best (ties to
    the lower index). Returns (scores, records taken before the budget stopped the walk)."""
    windows = [_log_mass(tier, m, queries) for m in members]
    base = np.mean(windows, axis=0)  # [L, Hq, T]

    def score(records):
        m = _log_mass(tier, records, queries)
        return float((m - base).mean(axis=2).max()) if scoring == "peak" else float(m.mean())

    taken, scores, open_, cells, stopped = [], [-math.inf] * len(members), list(range(len(members))), 0, False
    chosen = []
    while open_:
        current = {i: score([j for j in members[i] if j not in taken]) for i in open_}
        best = min(open_, key=lambda i: (-current[i], i))
        scores[best] = current[best]
        for j in members[best]:
            if j in taken:
                continue
            taken.append(j)
            if budget is not None and not stopped:
                if len(chosen) + 1 > top_units or cells + tier.units[j].size > budget:
                    stopped = True
                else:
                    chosen.append(j)
                    cells += tier.units[j].size
        open_ = [i for i in open_ if i != best and any(j not in taken for j in members[i])]
    return np.asarray(scores), sorted(chosen)


@pytest.mark.parametrize("seed", range(3))
def test_marginal_window_scores_are_the_plain_greedy_walk(seed):
    rng = np.random.default_rng(seed)
    tier = recall_setup.random_tier(rng, [(0, [3, 2, 3, 2]), (30, [3, 1])], L=2, G=1, d=8)
    queries = rng.normal(size=(2, 2, 2, 8)).astype(np.float32)
    for window in (1, 2, 3):
        members = host_tier_scoring.window_members(tier, window)
        assert [m.tolist() for m in members] == recall_setup.window_members_reference(tier, window)
        for scoring in ("peak", "mass"):
            got = host_tier_scoring.score_windows_marginal(tier, queries, recall_setup.ROPE, window, scoring)
            want, _ = _greedy_reference(tier, [m.tolist() for m in members], queries, scoring)
            assert np.array_equal(np.isinf(got), np.isinf(want)), (window, scoring)
            np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
            # the best window scores as the whole-window scoring's best; one-record windows are that scoring
            plain = getattr(host_tier_scoring, f"score_units_{scoring}")(tier, queries, recall_setup.ROPE,
                                                                          window=window)
            assert got.max() == pytest.approx(plain.max(), abs=1e-5)
            if window == 1:
                np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scoring must be 'peak' or 'mass'"):
        host_tier_scoring.rank_windows_marginal(np.zeros((2, 1)), [np.zeros(1, np.int64)], 1, "max")


@pytest.mark.parametrize("seed", range(4))
def test_selection_over_marginal_scores_is_the_walk_stopped_by_the_budget(seed):
    rng = np.random.default_rng(100 + seed)
    tier = recall_setup.random_tier(rng, [(0, list(rng.integers(1, 4, size=4))), (20, [2, 3])], L=1, G=1, d=8)
    queries = rng.normal(size=(1, 2, 2, 8)).astype(np.float32)
    members = host_tier_scoring.window_members(tier, 2)
    scores = host_tier_scoring.score_windows_marginal(tier, queries, recall_setup.ROPE, 2)
    for budget, top in ((int(rng.integers(1, 12)), 8), (1000, 2), (1000, 1000)):
        got = host_tier_scoring.select_windows(scores, tier.sizes, members, budget, top)
        _, want = _greedy_reference(tier, [m.tolist() for m in members], queries, "peak", budget, top)
        assert got.tolist() == want, (budget, top)
    assert host_tier_scoring.select_windows(scores, tier.sizes, members, 1000, 1000).size == len(tier.units)


def test_a_session_question_ranks_windows_by_what_they_add():
    model = recall_setup.decoder()
    recall = Recall(budget=9, top_units=8, block=3, window=2, scoring="peak")
    policy = OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4)  # test_recall_window's
    session = Session(model, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                                          recall=recall))
    for chunk in recall_setup.context():
        session.feed(chunk)
    question = recall_setup.question(100)
    rs = session._recall
    raw = recall_setup.question_queries(session, question)
    tier = rs.tier
    members = host_tier_scoring.window_members(tier, 2)
    want = host_tier_scoring.rank_windows_marginal(host_tier_scoring.unit_log_mass(tier, raw, rs.rope), members,
                                                   raw.shape[1], "peak")
    report = session.recall(question)
    np.testing.assert_allclose(report.scores, want, rtol=1e-4, atol=1e-5)
    assert list(report.indices) == host_tier_scoring.select_windows(want, tier.sizes, members, 9, 8).tolist()
    assert 0 < report.cells <= 9
    session.feed(question)
    assert session._recall._pending is None
