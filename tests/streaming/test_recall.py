"""Recall wired into `Session` (issue 40): what retention evicts is captured exactly (against the full-context cache),
recalling everything answers like the full context, forced scores restore exactly the chosen units, the release and
keep settings do what they say, the host budget's drops are reported, bad settings are refused by name, and recall
off runs the very same program."""

import dataclasses

import jax
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import stack_chunks
from omnijax.models.config import TINY_OMNI
from omnijax.retention import (
    H2O,
    OmniMemBudgets,
    OmniPick,
    SinkWindow,
    StreamingLLM,
    StreamingVLM,
    StreamMem,
    TokenSliding,
    UnitFIFO,
)
from omnijax.retention.recall import Recall, rerotate
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session, stream
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU

# Context chunks (recall_setup.SIZES tokens, unit 2i each, padded to recall_setup.T): 48 tokens. SinkWindow(2, 38)
# first trims in the last context chunk's step, after its prefill: every cached key and value was computed over the
# whole context, as in the full-context session.


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _context(seed=0):
    return recall_setup.context(seed)


def _question(seed=0, answer=3):
    return recall_setup.question(100 + seed, answer=answer)


def _session(model, policy, recall=None, paging="native", impl="xla"):
    return Session(model, StreamConfig(policy=policy, paging=paging, num_pages=PAGES, page_size=PAGE,
                                       max_answer_tokens=TAU, recall=recall, impl=impl))


def _feed_all(session, chunks):
    return [session.feed(c) for c in chunks]


def _by_order(kv):
    """{write order: (k [L, G, d], v, pos [A], unit, span, offset)} of the live slots of a batch-1 cache."""
    h = jax.device_get({f: getattr(kv, f) for f in ("k", "v", "pos", "unit", "span", "offset", "order", "valid")})
    out = {}
    for p, s in zip(*np.nonzero(h["valid"])):
        out[int(h["order"][p, s])] = (h["k"][:, p, s], h["v"][:, p, s], h["pos"][:, p, s], int(h["unit"][p, s]),
                                      int(h["span"][p, s]), int(h["offset"][p, s]))
    return out


@pytest.mark.parametrize("paging", ["native", "eager"])
def test_captured_units_hold_exactly_what_each_step_cached(model, paging):
    # Oracle: before each step of the same session without recall, a full-context session continues from a copy of
    # its state and takes the chunk: it holds every token as the step computed it, before the step's trim.
    plain, held = _session(model, SinkWindow(sink=2, window=6), paging=paging), {}
    for chunk in _context():
        shadow = Session(model, StreamConfig(num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU),
                         state=plain.state)
        shadow.feed(chunk)
        held.update(_by_order(shadow.state.kv))
        plain.feed(chunk)
    bounded = _session(model, SinkWindow(sink=2, window=6), Recall(budget=64), paging=paging)
    _feed_all(bounded, _context())  # trims in most steps; the last chunk (10) loses its own first 4 tokens
    kept = set(_by_order(bounded.state.kv))
    stats = bounded.recall_stats()
    assert stats.lost_cells == 0 and stats.dropped_units == 0
    stored = [(u, o) for u in bounded._recall.tier.units for o in range(u.size)]
    orders = sorted(int(u.order[o]) for u, o in stored)
    assert orders == sorted(set(held) - kept) and len(kept) == 8  # every evicted token, once
    assert any(int(u.order[0]) >= 38 for u in bounded._recall.tier.units)  # tokens evicted by their own step
    for u, o in stored:
        k, v, pos, unit, span, offset = held[int(u.order[o])]
        np.testing.assert_array_equal(u.k[:, :, o], k)
        np.testing.assert_array_equal(u.v[:, :, o], v)
        np.testing.assert_array_equal(u.pos[:, o], pos)
        assert (u.unit, int(u.span[o]), int(u.offset[o])) == (unit, span, offset)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("paging", ["native", "tile_skip"])
def test_recalling_everything_answers_like_the_full_context(model, keep, paging):
    full = _session(model, omnijax.NoSlide())
    want = _feed_all(full, _context() + [_question()])[-1]
    bounded = _session(model, SinkWindow(sink=2, window=38), paging=paging)
    without = _feed_all(bounded, _context() + [_question()])[-1]
    recalled = _session(model, SinkWindow(sink=2, window=38), Recall(budget=64, keep=keep), paging=paging)
    _feed_all(recalled, _context())
    evicted = 48 - 40
    stored = recalled.recall_stats()
    assert stored.stored_units == 2 and sum(u.size for u in recalled._recall.tier.units) == evicted
    got = recalled.feed(_question())  # a chunk asking for an answer recalls by itself
    report = recalled._recall.last
    assert report.cells == evicted and not report.forced and report.units == (0, 2)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)
    assert np.abs(np.asarray(without.logits) - np.asarray(want.logits)).max() > 1e-3  # the check can fail
    assert int(np.argmax(got.logits)) == int(want.tokens[0, 0])
    stats = recalled.recall_stats()
    assert stats.questions == 1 and stats.recalled_cells == evicted
    live = _by_order(recalled.state.kv)
    recall_orders = range(48, 48 + evicted)  # written after the context, before the question
    if keep:  # still cached (the answer's trim kept the newest 38, recalled tokens among them), out of the tier
        assert all(o in live for o in recall_orders)
        assert not {int(o) for u in recalled._recall.tier.units for o in u.order} & set(range(2, 2 + evicted))
    else:  # released: no recalled token left, their records still stored
        assert not any(o in live for o in recall_orders)
        assert [u.unit for u in recalled._recall.tier.units][:2] == [0, 2]


# OmniPick over the context: only the last chunk's step trims (48 > 40 cells); the two newest units stay whole, the
# text budget keeps the oldest unit's first 4 tokens: unit 0 is split, 4 tokens cached and 4 evicted.
OMNIPICK = OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4)


def _rotate(k, from_pos, to_pos):
    return np.asarray(rerotate(k, from_pos, to_pos, theta=TINY_OMNI.rope_base, mrope_section=TINY_OMNI.mrope_section))


def test_omnipick_recalling_everything_answers_like_the_full_context(model):
    # The split unit (module constant OMNIPICK) and three whole units come back; the cached part of unit 0, the
    # system-less sinks and the two recent units move back to their full-context positions.
    full = _session(model, omnijax.NoSlide())
    want = _feed_all(full, _context() + [_question()])[-1]
    without = _feed_all(_session(model, OMNIPICK), _context() + [_question()])[-1]
    recalled = _session(model, OMNIPICK, Recall(budget=64, top_units=8))
    _feed_all(recalled, _context())
    tier = recalled._recall.tier
    assert [(u.unit, u.size) for u in tier.units] == [(0, 4), (2, 8), (4, 8), (6, 8)]
    assert int(recalled.state.next_pos[0]) == 20
    got = recalled.feed(_question())
    assert recalled._recall.last.cells == 28 and recalled._recall.last.units == (0, 2, 4, 6)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)
    assert np.abs(np.asarray(without.logits) - np.asarray(want.logits)).max() > 1e-3  # the check can fail
    assert int(np.argmax(got.logits)) == int(want.tokens[0, 0])
    # Released: the cache holds what OmniPick keeps, at its own positions again (question and answer included).
    live = _by_order(recalled.state.kv)
    assert not any(o in live for o in range(48, 48 + 28))
    assert sorted(int(t[2][0]) for t in live.values()) == list(range(int(recalled.state.next_pos[0])))


# Every retention policy that evicts text (InfiniPot-V compresses visual spans only: its forced scores are checked
# on an audiovisual session, tests/streaming/test_recall_questions.py). H2O with the attention that accumulates its
# scores.
FORCED = [SinkWindow(sink=2, window=12), StreamingLLM(sink_tokens=2, window=12, high_watermark=16), OMNIPICK,
          TokenSliding(window=12, high_watermark=16), UnitFIFO(high_watermark=16, low_watermark=12),
          H2O(heavy=4, recent=8, high_watermark=16), StreamMem(budget=12, num_proxies=4),
          StreamingVLM(sink=2, text_window=10, vision_window=8),
          OmniMemBudgets(visual_budget=8, audio_budget=4, text_budget=12)]


@pytest.mark.parametrize("policy", FORCED, ids=[type(p).name for p in FORCED])
def test_forced_scores_restore_exactly_the_chosen_units(model, policy):
    impl = "reference" if isinstance(policy, H2O) else "xla"
    session = _session(model, policy, Recall(budget=64, top_units=2), impl=impl)
    _feed_all(session, _context())
    full = _session(model, omnijax.NoSlide())
    _feed_all(full, _context())
    full_pos = {o: int(t[2][0]) for o, t in _by_order(full.state.kv).items()}  # same write orders: no answers yet
    tier = session._recall.tier
    U = len(tier.units)
    assert U >= (3 if policy is OMNIPICK or policy not in FORCED[:2] else 4)
    chosen = [0, U - 2]
    if policy is OMNIPICK:
        assert tier.units[0].unit == 0 and tier.units[0].size == 4  # the evicted piece of the split unit
    scores = np.zeros(U, np.float32)
    scores[chosen] = [5.0, 7.0]
    before = _by_order(session.state.kv)
    cursor = int(session.state.next_pos[0])
    report = session.recall(_question(), scores=scores)
    assert report.forced and report.indices == tuple(chosen)
    after = _by_order(session.state.kv)
    assert {o: after[o] for o in before}.keys() == before.keys()
    new = {o: after[o] for o in after if o not in before}
    records = [tier.units[i] for i in chosen]
    assert len(new) == sum(u.size for u in records)
    if policy.reindex:
        # Oracle: the cached and recalled tokens sit where a re-indexing that had kept the recalled ones puts them:
        # for contiguous text, the rank of each one's full-context position among them all; the cursor past them.
        wanted = sorted([full_pos[o] for o in before] + [full_pos[int(o)] for u in records for o in u.order])
        rank = {p: i for i, p in enumerate(wanted)}
        positions = [np.broadcast_to([rank[full_pos[int(o)]] for o in u.order], u.pos.shape) for u in records]
        assert int(session.state.next_pos[0]) == len(wanted)
        for o, (k, v, p, *meta) in before.items():  # cached tokens moved (keys turned with them) where needed
            assert (after[o][2] == rank[full_pos[o]]).all()
            np.testing.assert_allclose(after[o][0], _rotate(k[:, :, None], p[:, None], after[o][2][:, None])[:, :, 0],
                                       atol=1e-5)
            np.testing.assert_array_equal(after[o][1], v)
        if policy is OMNIPICK:  # the split unit's evicted piece rejoins its cached part, right after it
            assert [int(positions[0][0, o]) for o in range(4)] == [4, 5, 6, 7]
            assert sorted(int(t[2][0]) for o, t in after.items() if t[3] == 0) == list(range(8))
    else:  # back at their own positions, keys as stored
        positions = [u.pos for u in records]
        assert int(session.state.next_pos[0]) == cursor
    got = sorted(new.items())  # write order = the records laid one after the other, tokens in write order
    i = 0
    for u, pos in zip(records, positions):
        keys = _rotate(u.k, u.pos, pos)
        for o in range(u.size):
            k, v, p, unit, span, offset = got[i][1]
            np.testing.assert_array_equal(p, pos[:, o])
            np.testing.assert_array_equal(v, u.v[:, :, o])
            np.testing.assert_allclose(k, keys[:, :, o], atol=1e-6)
            if not policy.reindex:
                np.testing.assert_array_equal(k, u.k[:, :, o])
            assert (unit, span, offset) == (u.unit, int(u.span[o]), int(u.offset[o]))
            i += 1
    session.feed(_question())  # answers over them, then releases them
    assert not set(new) & set(_by_order(session.state.kv))
    assert session.recall_stats().questions == 1  # the feed did not recall a second time


def test_host_budget_drops_oldest_units_and_reports_them(model):
    probe = _session(model, SinkWindow(sink=2, window=12), Recall(budget=64))
    _feed_all(probe, _context())
    sizes = [u.nbytes for u in probe._recall.tier.units]
    budget = sum(sizes[-2:])
    session = _session(model, SinkWindow(sink=2, window=12), Recall(budget=64, host_bytes=budget))
    _feed_all(session, _context())
    stats = session.recall_stats()
    assert stats.stored_bytes <= budget and stats.dropped_units > 0
    assert stats.captured_units == stats.stored_units + stats.dropped_units
    assert stats.captured_bytes == stats.stored_bytes + stats.dropped_bytes
    assert [u.unit for u in session._recall.tier.units] == [u.unit for u in probe._recall.tier.units][-len(
        session._recall.tier.units):]


def test_recall_off_runs_the_same_program_bit_for_bit(model):
    assert StreamConfig().recall is None and StreamConfig() == StreamConfig(recall=None)
    assert hash(StreamConfig()) == hash(StreamConfig(recall=None))
    chunks = _context() + [_question()]
    off = _feed_all(_session(model, SinkWindow(sink=2, window=12)), chunks)
    # Recall on, but nothing fits its budget: capture runs around every step and changes nothing.
    on_session = _session(model, SinkWindow(sink=2, window=12), Recall(budget=1))
    on = _feed_all(on_session, chunks)
    assert on_session._recall.last.units == () and on_session.recall_stats().stored_units > 0
    for a, b in zip(off, on):
        np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    ref = stream(model, stack_chunks(chunks), StreamConfig(policy=SinkWindow(sink=2, window=12), num_pages=PAGES,
                                                           page_size=PAGE, max_answer_tokens=TAU))
    # `stream` scans the chunks in one program, Session runs one step program per chunk: the same arithmetic, but
    # XLA:CPU may fuse the two programs differently on another CPU (7e-8 apart on one machine), so it is 1e-5 here;
    # the off/on comparison above is what must be bit for bit (the same step program).
    np.testing.assert_allclose(np.asarray(ref.logits[-1]), np.asarray(off[-1].logits), rtol=0, atol=1e-5)


def test_bad_recall_settings_are_refused_by_name(model):
    with pytest.raises(ValueError, match="host_bytes must be a positive int.*zero bytes"):
        Recall(budget=8, host_bytes=0)
    for name in ("budget", "top_units"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            Recall(**{"budget": 8, name: 0})
    with pytest.raises(ValueError, match="keep must be a bool"):
        Recall(budget=8, keep=1)
    with pytest.raises(ValueError, match="scoring must be one of"):
        Recall(budget=8, scoring="sum")
    with pytest.raises(ValueError, match=r"budget \(17 cells\) is larger than the KV pool \(16 cells"):
        StreamConfig(num_pages=2, page_size=8, recall=Recall(budget=17))
    with pytest.raises(ValueError, match="larger than the KV pool"):  # the Session's default pool
        Session(model, StreamConfig(page_size=8, recall=Recall(budget=64 * 8 + 1)))
    with pytest.raises(TypeError, match="recall must be an omnijax.retention.recall.Recall"):
        StreamConfig(recall=64)
    config = StreamConfig(policy=SinkWindow(sink=2, window=12), num_pages=PAGES, page_size=PAGE,
                          recall=Recall(budget=8))
    with pytest.raises(ValueError, match="batch-1 sessions only"):
        Session(model, config, batch=2)
    with pytest.raises(ValueError, match="omnijax.evaluate and the serving engine only so far: stream"):
        stream(model, stack_chunks(_context()), config)
    with pytest.raises(ValueError, match="recall is off"):
        _session(model, SinkWindow(sink=2, window=12)).recall(_question())
    session = _session(model, SinkWindow(sink=2, window=12), Recall(budget=64))
    _feed_all(session, _context())
    U = session.recall_stats().stored_units
    state = jax.tree.map(np.asarray, session.state)
    for bad in (np.zeros(U + 1), np.full(U, np.nan)):
        with pytest.raises(ValueError, match=f"scores must be {U} finite numbers"):
            session.recall(_question(), scores=bad)
    jax.tree.map(np.testing.assert_array_equal, state, jax.tree.map(np.asarray, session.state))  # nothing changed
    session.recall(_question(), scores=np.arange(U))
    with pytest.raises(ValueError, match="already waiting for its question"):
        session.recall(_question())
    assert dataclasses.asdict(session.recall_stats())["questions"] == 1


def test_mass_scoring_is_the_attention_mass_before_rope():
    # Oracle: keys drawn before RoPE and rotated at arbitrary positions; the score read from the rotated records
    # equals the log-sum-exp over each unit's raw keys, token by token in plain Python, wherever the unit sits.
    import math

    from omnijax.kv import host_tier, host_tier_scoring

    rng = np.random.default_rng(0)
    L, G, Hq, d, T = 2, 2, 4, 8, 3
    rope = (10000.0, None, False)
    queries = rng.normal(size=(L, T, Hq, d)).astype(np.float32)
    raws, units = [], []
    for u, (n, start) in enumerate([(3, 5), (5, 40), (2, 900)]):
        raw = rng.normal(size=(L, G, n, d)).astype(np.float32)
        pos = (start + np.arange(n))[None].astype(np.int32)
        k = np.asarray(rerotate(raw, np.zeros_like(pos), pos, theta=rope[0], mrope_section=None))
        raws.append(raw)
        units.append(host_tier.make_unit(u, k, raw, pos, np.zeros(n), np.zeros(n), np.arange(n)))
    tier = host_tier.HostTier(budget_bytes=1 << 20, units=tuple(units))
    want = []
    for raw in raws:
        total = 0.0
        for layer in range(L):
            for h in range(Hq):
                for t in range(T):
                    logits = [float(np.dot(queries[layer, t, h].astype(np.float64), raw[layer, h // 2, i]))
                              / math.sqrt(d) for i in range(raw.shape[2])]
                    top = max(logits)
                    total += top + math.log(sum(math.exp(a - top) for a in logits))
        want.append(total / (L * Hq * T))
    got = host_tier_scoring.score_units_mass(tier, queries, rope)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    moved = [dataclasses.replace(u, pos=u.pos + 1000, k=np.asarray(rerotate(u.k, u.pos, u.pos + 1000, theta=rope[0],
                                                                              mrope_section=None)))
             for u in units]
    moved_tier = dataclasses.replace(tier, units=tuple(moved))
    np.testing.assert_allclose(host_tier_scoring.score_units_mass(moved_tier, queries, rope), got, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="queries must be"):
        host_tier_scoring.score_units_mass(tier, queries[:, :, :3], rope)
