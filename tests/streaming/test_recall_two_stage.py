"""Two-stage retrieval (issue 40): the summaries pick a shortlist, "mass" ranks it. Oracles: a shortlist covering
the tier scores exactly as "mass" (and a session recalls and answers exactly as with "mass"); a shorter one keeps the
units a plain reading of the mean logits ranks highest, scores them as "mass" scores them, and recalls none other."""

import dataclasses

import numpy as np
import pytest

from omnijax.kv import host_tier, host_tier_scoring
from omnijax.kv.host_tier_two_stage import score_units_two_stage, shortlist_units
from omnijax.retention import SinkWindow
from omnijax.retention.recall import Recall, rerotate
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU

ROPE = (10000.0, None, False)


def _tier(seed, L=2, G=2, d=8):
    rng = np.random.default_rng(seed)
    units, at = [], 0
    for u, n in enumerate(rng.integers(1, 7, size=9)):
        raw = rng.normal(size=(L, G, n, d)).astype(np.float32)
        pos = (at + np.arange(n))[None].astype(np.int32)
        k = np.asarray(rerotate(raw, np.zeros_like(pos), pos, theta=ROPE[0], mrope_section=None))
        units.append(host_tier.make_unit(u, k, raw, pos, np.zeros(n), np.zeros(n), at + np.arange(n)))
        at += int(n)
    return host_tier.HostTier(budget_bytes=1 << 24, units=tuple(units)), rng


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_stage_scores_are_mass_on_the_summaries_shortlist(seed):
    tier, rng = _tier(seed)
    U = len(tier.units)
    queries = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)  # [L, T, Hq, d] before RoPE
    query = rng.normal(size=(2, 4, 8)).astype(np.float32)  # rotated, averaged
    mass = host_tier_scoring.score_units_mass(tier, queries, ROPE)
    for n in (U, U + 5):  # the whole tier: "mass" bit for bit
        np.testing.assert_array_equal(score_units_two_stage(tier, queries, query, ROPE, n), mass)
    plain = host_tier_scoring.score_units_reference(tier, query, "mean")  # token by token, in Python loops
    for n in (1, 3, U - 1):
        want = sorted(range(U), key=lambda i: (-float(plain[i]), i))[:n]
        got = score_units_two_stage(tier, queries, query, ROPE, n)
        assert sorted(want) == shortlist_units(tier, query, n).tolist() == np.flatnonzero(np.isfinite(got)).tolist()
        assert np.all(got[np.isneginf(got)] == -np.inf) and np.isneginf(got).sum() == U - n
        np.testing.assert_allclose(got[want], mass[want], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shortlist must be a positive int"):
        shortlist_units(tier, query, 0)


def _run(model, recall):
    session = Session(model, StreamConfig(policy=SinkWindow(sink=2, window=12), num_pages=PAGES, page_size=PAGE,
                                          max_answer_tokens=TAU, recall=recall))
    for chunk in recall_setup.context(0):
        session.feed(chunk)
    out = session.feed(recall_setup.question(100))
    return session, out


def test_a_session_with_a_whole_tier_shortlist_recalls_and_answers_as_mass():
    model = recall_setup.decoder()
    mass, want = _run(model, Recall(budget=16, top_units=2))
    whole, got = _run(model, Recall(budget=16, top_units=2, scoring="two_stage", shortlist=64))
    assert len(mass._recall.tier.units) >= 4 and mass._recall.last.units
    a, b = mass._recall.last, whole._recall.last
    np.testing.assert_array_equal(a.scores, b.scores)
    assert (a.units, a.cells) == (b.units, b.cells)
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    # A shortlist of one: only the summaries' best unit can come back, whatever "mass" thinks of the others.
    one, _ = _run(model, Recall(budget=16, top_units=2, scoring="two_stage", shortlist=1))
    r = one._recall.last
    assert np.isfinite(r.scores).sum() == 1 and r.indices == (int(np.flatnonzero(np.isfinite(r.scores))[0]),)
    assert dataclasses.asdict(one.recall_stats())["recalled_units"] == 1


def test_shortlist_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="shortlist must be a positive int"):
        Recall(budget=8, scoring="two_stage", shortlist=0)
    with pytest.raises(ValueError, match="shortlist=4 is read by scoring='two_stage' only"):
        Recall(budget=8, shortlist=4)
