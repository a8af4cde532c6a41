"""Recall across a session's life (issue 40): a recall held over an answer's continuation chunks reads exactly what a
held recall kept as content reads (the steps over a recall do not trim: the policy trims when it ends), `Chat`
carries recall that way, and a `Session` snapshot carries the host tier: the resumed session answers exactly as the
uninterrupted one, and a missing or corrupt tier is refused by name."""

import dataclasses

import numpy as np
import pytest

import omnijax
from omnijax.kv import host_tier
from omnijax.retention import OmniPick, StreamingLLM
from omnijax.retention.recall import Recall
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session, SessionSnapshot
from tests._support import recall_setup, tiny_omni
from tests._support.recall_setup import PAGE, PAGES, TAU

OMNIPICK = OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4)
STREAMING = StreamingLLM(sink_tokens=2, window=12, high_watermark=16)


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _context(seed=0):
    return recall_setup.context(seed)


def _question():
    return recall_setup.question(100)


def _continuation():
    """No token, three more answer tokens of unit 101 (as `Chat` asks for an answer's next block)."""
    c = _question()
    return dataclasses.replace(c, valid=np.zeros_like(c.valid), advance=np.zeros_like(c.advance),
                               answer_unit=np.asarray([101], np.int32))


def _session(model, policy, recall=None, **kw):
    return Session(model, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                                       recall=recall), **kw)


def _outs(session, chunks):
    return [(np.asarray(o.logits), np.asarray(o.tokens)) for o in map(session.feed, chunks)]


def _live_orders(session):
    kv = session.state.kv
    return set(np.asarray(kv.order)[np.asarray(kv.valid)].tolist())


def test_a_held_recall_reads_like_a_kept_one_over_the_whole_answer(model):
    chunks = _context() + [_question(), _continuation(), _continuation()]
    kept = _session(model, OMNIPICK, Recall(budget=64, keep=True))
    kept.hold_recall()  # the steps over a recall do not trim until it ends, kept or not
    want = _outs(kept, chunks)
    held = _session(model, OMNIPICK, Recall(budget=64))
    held.hold_recall()
    got = _outs(held, chunks)
    assert held._recall.last.units == (0, 2, 4, 6) and held.recall_stats().questions == 1
    for (a, ta), (b, tb) in zip(want, got):  # the held recall is still cached for both continuations
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ta, tb)
    recalled = set(range(48, 48 + 28))
    assert recalled <= _live_orders(held) | set(range(48, 76)) and held._recall.pending
    held.release_recall()
    assert not held._recall.pending and not recalled & _live_orders(held)
    kept.release_recall()
    # kept: ordinary content once the recall ends; what the policy's trim then evicted is stored again
    stored_again = {int(o) for u in kept._recall.tier.units for o in u.order}
    assert recalled - _live_orders(kept) and recalled - _live_orders(kept) <= stored_again
    plain = _session(model, OMNIPICK, Recall(budget=64))  # released after the question: the blocks after differ
    loose = _outs(plain, chunks)
    np.testing.assert_array_equal(loose[6][0], want[6][0])
    # A continuation's logits are those after the previous block's last token: the second one's read the first
    # continuation's forward passes, which ran without the recalled units.
    assert np.abs(loose[8][0] - want[8][0]).max() > 1e-4
    assert plain.recall_stats().questions == 1  # a continuation chunk never recalls by itself


@pytest.mark.parametrize("policy", [STREAMING, OMNIPICK])
def test_resumed_session_answers_like_the_uninterrupted_one(model, policy):
    context = _context()
    rest = [_question(), _continuation()]
    through = _session(model, policy, Recall(budget=64, top_units=3))
    _outs(through, context[:5])
    snap = through.snapshot()
    assert isinstance(snap, SessionSnapshot) and snap.tier is not None
    stored = len(snap.tier.tier.units)
    want = _outs(through, context[5:] + rest)
    resumed = Session.resume(model, snap, StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE,
                                                       max_answer_tokens=TAU, recall=Recall(budget=64, top_units=3)))
    got = _outs(resumed, context[5:] + rest)
    for (a, ta), (b, tb) in zip(want, got):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ta, tb)
    assert resumed._recall.last.units == through._recall.last.units
    assert resumed.recall_stats() == through.recall_stats()
    if policy is STREAMING:  # units stored before the snapshot came back after it
        assert stored > 0 and min(resumed._recall.last.indices) < stored
    # Oracle that the tier and its positions matter: the same state resumed with the tier emptied answers otherwise.
    empty = dataclasses.replace(snap.tier, tier=host_tier.HostTier(budget_bytes=1 << 30))
    other = Session.resume(model, SessionSnapshot(state=snap.state, tier=empty),
                           StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                                        recall=Recall(budget=64, top_units=3)))
    if stored:
        assert np.abs(_outs(other, context[5:] + rest)[1][0] - want[1][0]).max() > 1e-4


def test_missing_or_corrupt_tier_is_refused_by_name(model):
    recall = Recall(budget=64)
    session = _session(model, STREAMING, recall)
    _outs(session, _context())
    snap = session.snapshot()
    units = snap.tier.tier.units
    assert units

    def resume(tier, **kw):
        config = StreamConfig(policy=STREAMING, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU,
                              recall=kw.pop("recall", recall))
        return Session.resume(model, SessionSnapshot(state=snap.state, tier=tier), config)

    with pytest.raises(ValueError, match="host tier is missing"):
        resume(None)
    with pytest.raises(ValueError, match="host tier is missing"):
        _session(model, STREAMING, recall, state=snap.state)
    with pytest.raises(ValueError, match="recall is off"):
        _session(model, STREAMING, tier=snap.tier)
    u = units[0]
    bad_k = dataclasses.replace(u, k=u.k + 1)
    bad_shape = dataclasses.replace(u, v=u.v[:, :, :-1])
    for unit, msg in ((bad_k, "summary is not the mean"), (bad_shape, "do not fit this model")):
        tier = dataclasses.replace(snap.tier, tier=dataclasses.replace(snap.tier.tier, units=(unit,) + units[1:]))
        with pytest.raises(ValueError, match=f"host tier is corrupt: unit {u.unit}.*{msg}"):
            resume(tier)
    with pytest.raises(ValueError, match="host tier is corrupt: vpos must be int64"):
        resume(dataclasses.replace(snap.tier, vpos=snap.tier.vpos[:-1]))
    with pytest.raises(ValueError, match="more than Recall\\(host_bytes=100\\)"):
        resume(snap.tier, recall=Recall(budget=64, host_bytes=100))
    with pytest.raises(ValueError, match="takes a Session.snapshot"):
        Session.resume(model, snap.state)
    session.hold_recall()
    session.feed(_question())
    with pytest.raises(ValueError, match="a recall is in progress"):
        session.snapshot()
    session.release_recall()
    assert session.snapshot().tier is not None


def test_records_larger_than_the_host_budget_are_reported_dropped_never_silently_lost(model):
    # Oracle: the same session with a roomy tier, whose stored records are exactly what this one captures. A host
    # budget one byte short of the smallest record stores none of them: each is captured and dropped at once, and
    # the figures say so (some records fit the budget without their full-context positions, which are stored too).
    probe = _session(model, STREAMING, Recall(budget=64))
    _outs(probe, _context())
    records = probe._recall.tier.units
    assert len(records) >= 2 and probe.recall_stats().dropped_units == 0
    budget = min(u.nbytes for u in records) - 1
    assert any(u.nbytes - u.vpos.nbytes <= budget for u in records)
    session = _session(model, STREAMING, Recall(budget=64, host_bytes=budget))
    plain = _session(model, STREAMING)
    for chunk in _context():
        session.feed(chunk)
        plain.feed(chunk)
    stats, want = session.recall_stats(), probe.recall_stats()
    assert stats.stored_units == stats.stored_bytes == 0
    assert (stats.dropped_units, stats.dropped_bytes) == (len(records), sum(u.nbytes for u in records))
    assert (stats.captured_units, stats.captured_bytes) == (want.captured_units, want.captured_bytes)
    assert stats.captured_units == stats.stored_units + stats.dropped_units
    got, without = session.feed(_question()), plain.feed(_question())  # nothing stored: the plain session's answer
    assert session._recall.last is None and session.recall_stats().questions == 0
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(without.logits))


def test_stream_still_refuses_recall_by_name(model):
    config = StreamConfig(policy=STREAMING, num_pages=PAGES, page_size=PAGE, recall=Recall(budget=8))
    with pytest.raises(ValueError, match="and the serving engine only so far: stream would ignore it"):
        omnijax.stream(model, omnijax.chunks.chunk.stack_chunks(_context()), config)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("recall_chat"), tokenizer=True))


def test_chat_carries_recall_over_each_answer(chat_model):
    def chat(keep):
        c = omnijax.Chat(chat_model, StreamConfig(policy=OmniPick(high_watermark=48, low_watermark=36, recent_units=1,
                                                                  text_budget=4),
                                                  num_pages=32, page_size=8, max_answer_tokens=2,
                                                  recall=Recall(budget=96, keep=keep)))
        c.system("You keep notes.")
        for i in range(4):
            c.user(f"note {i}: the code word is {'alpha bravo charlie delta'.split()[i]} and more words follow")
        return c

    answers = {}
    for keep in (True, False):
        c = chat(keep)
        assert c.session.recall_stats().stored_units > 0
        answers[keep] = "".join(c.ask("what was the first code word?", max_tokens=6))
        stats = c.session.recall_stats()
        assert stats.questions == 1 and stats.recalled_cells > 0  # one recall for the whole answer
        assert not c.session._recall.pending  # released (or kept) when the answer ended
        assert len([s for s in c.steps if s.label == "answer"]) >= 1  # continuation blocks ran
    assert answers[False] == answers[True]
