"""Recall with an int8 KV pool (issue 40, `StreamConfig(kv_dtype="int8")`): the host tier holds what retention
evicts dequantised (`q * scale`, `omnijax.kv.host_tier`'s "int8 pools"), and recall writes it back through the
pool's quantising write. Oracles: the int8 full-context (`NoSlide`) session, and a full-context int8 session that
continues from the bounded one's state before each step (it holds every token as that step computed and quantised
it, before the step's trim)."""

import jax
import numpy as np
import pytest

import omnijax
from omnijax.kv.quant_kv import QuantPages
from omnijax.models.config import TINY_OMNI
from omnijax.retention import OmniPick, SinkWindow
from omnijax.retention.recall import Recall, rerotate
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.recall_setup import PAGE, PAGES, TAU, by_order

OMNIPICK = OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4)


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _session(model, policy, recall=None, state=None):
    return Session(model, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                                       recall=recall, kv_dtype="int8"), state=state)


def _feed(session, chunks):
    return [session.feed(c) for c in chunks]


def _codes(kv) -> dict:
    """{write order: (k codes [L, G, d], k scales [L, G], v codes, v scales)} of the live slots of an int8 cache."""
    assert isinstance(kv.k, QuantPages) and isinstance(kv.v, QuantPages)
    h = jax.device_get({"kq": kv.k.values, "ks": kv.k.scale, "vq": kv.v.values, "vs": kv.v.scale,
                        "order": kv.order, "valid": kv.valid})
    return {int(h["order"][p, s]): (h["kq"][:, p, s], h["ks"][:, p, s], h["vq"][:, p, s], h["vs"][:, p, s])
            for p, s in zip(*np.nonzero(h["valid"]))}


@pytest.fixture(scope="module")
def full(model):
    """The int8 full-context session: its question's output, its cache before the question (native layout)."""
    session = _session(model, omnijax.NoSlide())
    _feed(session, recall_setup.context())
    before = by_order(session.state.kv)
    return session.feed(recall_setup.question(100)), before


@pytest.mark.parametrize("policy", [SinkWindow(sink=2, window=38), OMNIPICK], ids=["sinkwindow", "omnipick"])
def test_recalling_everything_with_an_int8_pool_answers_like_the_int8_full_context(model, full, policy):
    want = np.asarray(full[0].logits)
    recalled = _session(model, policy, Recall(budget=64, top_units=8))
    _feed(recalled, recall_setup.context())
    assert isinstance(recalled.state.kv.k, QuantPages)
    stats = recalled.recall_stats()
    evicted = 48 - len(by_order(recalled.state.kv))
    assert stats.lost_cells == 0 and sum(u.size for u in recalled._recall.tier.units) == evicted > 0
    assert all(u.k.dtype == np.float32 for u in recalled._recall.tier.units)  # stored dequantised
    got = np.asarray(recalled.feed(recall_setup.question(100)).logits)
    assert recalled._recall.last.cells == evicted
    without = np.asarray(_feed(_session(model, policy), recall_setup.context() + [recall_setup.question(100)])[-1]
                         .logits)
    miss = np.abs(without - want).max()
    assert miss > 1e-3  # the check can fail
    if not policy.reindex:  # recalled at their own positions: the very codes the full-context pool holds
        np.testing.assert_allclose(got, want, atol=1e-5)
    else:  # keys re-rotated and requantised (as re-indexing does): the int8 path's tolerance, 2 % of the range
        assert np.abs(got - want).max() <= 0.02 * np.ptp(want) and np.abs(got - want).max() < miss / 10
    assert int(np.argmax(got)) == int(np.argmax(want))


def _rotate(k, from_pos, to_pos):
    return np.asarray(rerotate(k, from_pos, to_pos, theta=TINY_OMNI.rope_base, mrope_section=TINY_OMNI.mrope_section))


@pytest.mark.parametrize("policy", [SinkWindow(sink=2, window=12), OMNIPICK], ids=["sinkwindow", "omnipick"])
def test_forced_scores_with_an_int8_pool_restore_exactly_the_chosen_units(model, full, policy):
    session, held = _session(model, policy, Recall(budget=64, top_units=2)), {}
    for chunk in recall_setup.context():  # the shadow oracle (module docstring)
        shadow = _session(model, omnijax.NoSlide(), state=session.state)
        shadow.feed(chunk)
        held.update(_codes(shadow.state.kv))
        session.feed(chunk)
    tier = session._recall.tier
    U = len(tier.units)
    assert U >= 3 and session.recall_stats().lost_cells == 0
    for u in tier.units:  # each record holds its tokens' codes times their scales, as cached when evicted
        for o in range(u.size):
            kq, ks, vq, vs = held[int(u.order[o])]
            np.testing.assert_array_equal(u.k[:, :, o], kq * ks[..., None])
            np.testing.assert_array_equal(u.v[:, :, o], vq * vs[..., None])
    chosen = [0, U - 2]
    scores = np.zeros(U, np.float32)
    scores[chosen] = [5.0, 7.0]
    before = by_order(session.state.kv)
    report = session.recall(recall_setup.question(100), scores=scores)
    assert report.forced and report.indices == tuple(chosen)
    after, codes = by_order(session.state.kv), _codes(session.state.kv)
    new = sorted(o for o in after if o not in before)  # the recalled tokens: the records laid in order
    records = [tier.units[i] for i in chosen]
    assert len(new) == sum(u.size for u in records) == report.cells
    full_pos = {o: int(t[2][0]) for o, t in full[1].items()}  # same write orders: no answers yet
    if policy.reindex:  # where a re-indexing that had kept them puts them (tests/streaming/test_recall.py)
        wanted = sorted([full_pos[o] for o in before] + [full_pos[int(o)] for u in records for o in u.order])
        rank = {p: i for i, p in enumerate(wanted)}
    i = 0
    for u in records:
        for o in range(u.size):
            k, v, pos, unit, span, offset = after[new[i]]
            kq, ks, vq, vs = held[int(u.order[o])]
            assert (unit, span, offset) == (u.unit, int(u.span[o]), int(u.offset[o]))
            np.testing.assert_array_equal(codes[new[i]][2], vq)  # values: the codes they had
            np.testing.assert_allclose(codes[new[i]][3], vs, rtol=1e-6)
            if not policy.reindex:  # at their own positions: keys' codes as they were
                np.testing.assert_array_equal(pos, u.pos[:, o])
                np.testing.assert_array_equal(codes[new[i]][0], kq)
                np.testing.assert_allclose(codes[new[i]][1], ks, rtol=1e-6)
            else:  # re-rotated to the re-indexed position and requantised: within half a quantisation step
                assert (pos == rank[full_pos[int(u.order[o])]]).all()
                turned = _rotate(u.k[:, :, o:o + 1], u.pos[:, o:o + 1], pos[:, None])[:, :, 0]
                step = np.abs(turned).max(axis=-1, keepdims=True) / 127
                assert (np.abs(k - turned) <= step / 2 + 1e-6).all()
            i += 1
    session.feed(recall_setup.question(100))  # answers over them, then releases them
    assert not set(new) & set(by_order(session.state.kv))
