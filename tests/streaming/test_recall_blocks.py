"""Recall blocks and "peak" scoring (issue 40): `Recall(block=B)` stores an evicted unit as blocks of the write-order
grid (against a plain-Python grid walk and against the whole-unit records of the same session), recalling every block
answers like the full context, forced blocks come back exactly where re-indexing puts them (a block cut out of the
middle of a unit rejoins its neighbours' full-context ranks); "peak" scoring is the largest preference of one head for a
unit over the average unit (against a token-by-token plain-Python twin) and ranks a unit a few heads read strongly
above units every head reads a little, where "mass" ranks it last."""

import dataclasses
import math

import numpy as np
import pytest

import omnijax
from omnijax.kv import host_tier, host_tier_scoring
from omnijax.models.config import TINY_OMNI
from omnijax.retention import OmniPick, SinkWindow, StreamingLLM
from omnijax.retention.recall import Recall, parse_recall, rerotate
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU

# recall_setup.context(): 48 context tokens, unit 2i each; each policy below first trims in the last step
POLICIES = {
    "sink_window": SinkWindow(sink=2, window=38),
    "streaming_llm": StreamingLLM(sink_tokens=2, window=30, high_watermark=40),
    "omnipick": OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4),
}
BLOCK = 3


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _question(seed=0):
    return recall_setup.question(100 + seed)


def _session(model, policy, recall=None):
    return Session(model, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                                       recall=recall))


def _fed(model, policy, recall=None):
    session = _session(model, policy, recall)
    for chunk in recall_setup.context():
        session.feed(chunk)
    return session


def _record(rng, orders, L=2, G=2, d=4, unit=7):
    n = len(orders)
    k = rng.standard_normal((L, G, n, d)).astype(np.float32)
    pos = (100 + np.arange(n, dtype=np.int32))[None]
    u = host_tier.make_unit(unit, k, -k, pos, np.zeros(n), np.arange(n), np.asarray(orders))
    return u.with_vpos(np.asarray(orders) + 1000)


@pytest.mark.parametrize("seed", range(6))
def test_blocks_are_the_plain_write_order_grid(seed):
    rng = np.random.default_rng(seed)
    orders = np.sort(rng.choice(60, size=int(rng.integers(1, 25)), replace=False))
    block = int(rng.integers(1, 9))
    u = _record(rng, orders)
    got = host_tier.split_blocks(u, block)
    want = {}  # the plain walk: token i goes to the block of its write order
    for i, o in enumerate(orders.tolist()):
        want.setdefault(o // block, []).append(i)
    assert [b.order.tolist() for b in got] == [[int(orders[i]) for i in idx] for idx in want.values()]
    for b, idx in zip(got, want.values()):
        assert b.unit == u.unit
        for f in ("k", "v"):
            np.testing.assert_array_equal(getattr(b, f), getattr(u, f)[:, :, idx])
        for f in ("pos",):
            np.testing.assert_array_equal(b.pos, u.pos[:, idx])
        for f in ("span", "offset", "order", "vpos"):
            np.testing.assert_array_equal(getattr(b, f), getattr(u, f)[idx])
        np.testing.assert_allclose(b.summary, u.k[:, :, idx].mean(axis=2), rtol=1e-6)
        assert not b.k.flags.writeable and not b.summary.flags.writeable
    assert sum(b.size for b in got) == u.size and sum(b.nbytes for b in got) >= u.nbytes
    if orders[0] // block == orders[-1] // block:
        assert got == [u]
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="block must be a positive int"):
            host_tier.split_blocks(u, bad)


def test_peak_scoring_is_the_largest_head_preference_over_the_average_unit():
    rng = np.random.default_rng(1)
    L, G, Hq, d, T = 2, 2, 4, 8, 3
    rope = (10000.0, None, False)
    queries = rng.normal(size=(L, T, Hq, d)).astype(np.float32)
    raws, units = [], []
    for u, (n, start) in enumerate([(3, 5), (5, 40), (2, 900), (4, 61)]):
        raw = rng.normal(size=(L, G, n, d)).astype(np.float32)
        pos = (start + np.arange(n))[None].astype(np.int32)
        k = np.asarray(rerotate(raw, np.zeros_like(pos), pos, theta=rope[0], mrope_section=None))
        raws.append(raw)
        units.append(host_tier.make_unit(u, k, raw, pos, np.zeros(n), np.zeros(n), np.arange(n)))
    tier = host_tier.HostTier(budget_bytes=1 << 20, units=tuple(units))
    want = [-math.inf] * len(raws)
    for layer in range(L):
        for h in range(Hq):
            lift = [0.0] * len(raws)
            for t in range(T):
                q = queries[layer, t, h].astype(np.float64)
                mass = [math.log(sum(math.exp(float(np.dot(q, raw[layer, h // 2, i])) / math.sqrt(d))
                                     for i in range(raw.shape[2]))) for raw in raws]
                mean = sum(mass) / len(mass)
                lift = [a + (m - mean) / T for a, m in zip(lift, mass)]
            want = [max(w, x) for w, x in zip(want, lift)]
    got = host_tier_scoring.score_units_peak(tier, queries, rope)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert host_tier_scoring.score_units_peak(dataclasses.replace(tier, units=()), queries, rope).shape == (0,)


def test_peak_ranks_a_unit_few_heads_read_strongly_first_where_mass_ranks_it_last():
    # Four query heads, one kv head each (head h reads axis h). Seven filler units draw every head a little (logit 1);
    # the key unit draws head 0 strongly (logit 8) and the others not at all (logit -3). Averaged logs ("mass") put the
    # key last; the largest preference of one head over the average unit ("peak") first: head 0's for the key.
    L, G, d, n = 1, 4, 4, 2
    rope = (10000.0, None, False)
    queries = np.eye(d, dtype=np.float32)[None, None] * 2.0  # [L, T=1, Hq=4, d]; logit = 2 * key[h] / sqrt(4)
    key = np.full((L, G, n, d), -3.0, np.float32)
    key[0, 0, :, 0] = 8.0
    keys = [np.ones((L, G, n, d), np.float32)] * 7 + [key]
    pos = np.zeros((1, n), np.int32)
    tier = host_tier.HostTier(budget_bytes=1 << 20, units=tuple(
        host_tier.make_unit(u, k, k, pos, np.zeros(n), np.zeros(n), np.arange(n)) for u, k in enumerate(keys)))
    mass = host_tier_scoring.score_units_mass(tier, queries, rope)
    peak = host_tier_scoring.score_units_peak(tier, queries, rope)
    assert int(np.argmin(mass)) == 7 and int(np.argmax(peak)) == 7


@pytest.mark.parametrize("name", list(POLICIES))
def test_block_records_are_the_unit_records_cut_on_the_grid(model, name):
    whole = _fed(model, POLICIES[name], Recall(budget=64, top_units=16))
    blocks = _fed(model, POLICIES[name], Recall(budget=64, top_units=16, block=BLOCK))
    want = [b for u in whole._recall.tier.units for b in host_tier.split_blocks(u, BLOCK)]
    got = blocks._recall.tier.units
    assert len(got) == len(want) > len(whole._recall.tier.units)
    for a, b in zip(got, want):
        assert a.unit == b.unit
        for f in ("k", "v", "pos", "span", "offset", "order", "summary", "vpos"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert all(len(set((u.order // BLOCK).tolist())) == 1 for u in got)
    stats = blocks.recall_stats()
    assert stats.captured_units == len(got) and stats.lost_cells == 0 and stats.dropped_units == 0


@pytest.mark.parametrize("name", list(POLICIES))
def test_recalling_every_block_answers_like_the_full_context(model, name):
    want = _fed(model, omnijax.NoSlide()).feed(_question())
    without = _fed(model, POLICIES[name]).feed(_question())
    session = _fed(model, POLICIES[name], Recall(budget=64, top_units=64, block=BLOCK))
    evicted = sum(u.size for u in session._recall.tier.units)
    got = session.feed(_question())
    assert session._recall.last.cells == evicted and len(session._recall.last.units) > 2
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)
    assert np.abs(np.asarray(without.logits) - np.asarray(want.logits)).max() > 1e-3  # the check can fail


def _live(kv):
    """{write order: (k [L, G, d], v, pos [A])} of a batch-1 cache's live slots."""
    k, v, pos, order, valid = (np.asarray(getattr(kv, f)) for f in ("k", "v", "pos", "order", "valid"))
    return {int(order[p, s]): (k[:, p, s], v[:, p, s], pos[:, p, s]) for p, s in zip(*np.nonzero(valid))}


def _rotate(k, from_pos, to_pos):
    return np.asarray(rerotate(k, from_pos, to_pos, theta=TINY_OMNI.rope_base, mrope_section=TINY_OMNI.mrope_section))


@pytest.mark.parametrize("name", list(POLICIES))
def test_forced_blocks_come_back_exactly_at_their_full_context_ranks(model, name):
    policy = POLICIES[name]
    session = _fed(model, policy, Recall(budget=64, top_units=2, block=BLOCK))
    full_pos = {o: int(t[2][0]) for o, t in _live(_fed(model, omnijax.NoSlide()).state.kv).items()}
    tier = session._recall.tier
    # two blocks: one cut out of the middle of a unit whose neighbours stay in the tier, and the newest
    middle = next(i for i in range(1, len(tier.units) - 1)
                  if tier.units[i - 1].unit == tier.units[i].unit == tier.units[i + 1].unit)
    chosen = [middle, len(tier.units) - 1]
    scores = np.zeros(len(tier.units), np.float32)
    scores[chosen] = [3.0, 2.0]
    before = _live(session.state.kv)
    report = session.recall(_question(), scores=scores)
    assert report.indices == tuple(chosen)
    after = _live(session.state.kv)
    records = [tier.units[i] for i in chosen]
    new = sorted((o, t) for o, t in after.items() if o not in before)
    assert len(new) == sum(u.size for u in records) and set(before) <= set(after)
    if policy.reindex:  # each token at the rank of its full-context position among the cached and recalled ones
        wanted = sorted([full_pos[o] for o in before] + [full_pos[int(o)] for u in records for o in u.order])
        rank = {p: i for i, p in enumerate(wanted)}
        targets = [np.broadcast_to([rank[full_pos[int(o)]] for o in u.order], u.pos.shape) for u in records]
        for o in before:
            assert (after[o][2] == rank[full_pos[o]]).all()
    else:  # SinkWindow: at their own positions, keys as stored
        targets = [u.pos for u in records]
    i = 0
    for u, target in zip(records, targets):
        keys = _rotate(u.k, u.pos, target)
        for t in range(u.size):
            k, v, p = new[i][1]
            np.testing.assert_array_equal(p, target[:, t])
            np.testing.assert_array_equal(v, u.v[:, :, t])
            np.testing.assert_allclose(k, keys[:, :, t], atol=1e-6)
            i += 1
    session.feed(_question())
    assert not {o for o, _ in new} & set(_live(session.state.kv))  # released after the answer


def test_block_setting_is_parsed_and_refused_by_name():
    assert parse_recall("budget=64,block=32,scoring=peak") == Recall(budget=64, block=32, scoring="peak")
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="block must be a positive int"):
            Recall(budget=8, block=bad)
    with pytest.raises(ValueError, match="block must be a positive int"):
        parse_recall("budget=64,block=0")
