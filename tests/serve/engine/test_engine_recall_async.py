"""The engine scores a question's recall off its thread (issue 40): while one session's stored units are scored
against its question, the other sessions' ticks go on; the question lands (recalled into its row, then answered)
once its scores are ready, and every session's logits and tokens still equal a batch-1 `Session` with the same
config fed the same chunks (the oracle of `test_engine_recall`).

The scoring is held on a `threading.Event` the test sets after the other session has ticked on: with scoring on the
engine thread, the first tick would wait for it (here up to `HOLD_S`) and answer the question in that tick, so no
tick of the other session would pass while it scores, and the counts below fail."""

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

from omnijax.conversation import Prompt
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.streaming.recall_session import RecallSession
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.engine_worker import on_worker
from tests.serve.engine.test_engine_recall import (
    POLICIES,
    T,
    _config,
    _context,
    _continuation,
    _feed_session,
    _oracle_answer,
    _question,
)

HOLD_S = 20.0
B_TICKS = 3  # ticks of session b while a's question is held


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


@pytest.fixture
def held(monkeypatch):
    """`RecallSession.score` held until the returned event is set; records the threads it ran on."""
    release, threads = threading.Event(), []
    score = RecallSession.score

    def held_score(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        release.wait(HOLD_S)
        return score(self, *args, **kwargs)

    monkeypatch.setattr(RecallSession, "score", held_score)
    return release, threads


def _out(report, sid):
    out = report.outputs[sid]
    assert not out.preempted and out.dropped == 0
    return out.logits, out.tokens


def test_other_sessions_tick_on_while_a_question_is_scored(model, held):
    release, threads = held
    config = _config(POLICIES["omnipick"])
    context_a, context_b, question = _context(0), _context(60, units=200), _question(1)
    more_b = _context(61, units=300)[:B_TICKS + 1]
    oracle_a, oracle_b = Session(model, config), Session(model, config)
    for c in context_a:
        _feed_session(oracle_a, c, False, False)
    want_b = [_feed_session(oracle_b, c, False, False) for c in context_b + more_b]

    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4), return_logits=True))
    engine.open("a")
    engine.open("b")
    got_b = []
    for ca, cb in zip(context_a, context_b):
        engine.submit("a", ca, 0)
        engine.submit("b", cb, 0)
        report = engine.tick()
        got_b.append(_out(report, "b"))
    assert engine.recall_stats("a").stored_units > 0, "nothing stored: the question would not be scored"

    engine.submit("a", question, int(question.answer_tokens[0]))
    b_ticks = 0
    for cb in more_b[:B_TICKS]:  # a's question is scored (held) meanwhile: b is served, a waits
        engine.submit("b", cb, 0)
        report = engine.tick()
        got_b.append(_out(report, "b"))
        assert report.recalling == ("a",) and "a" not in report.outputs
        b_ticks += 1
    assert b_ticks == B_TICKS and threads and all(name.startswith("omnijax-recall") for name in threads), threads
    release.set()
    concurrent.futures.wait(engine.recall.futures(), 60)
    engine.submit("b", more_b[B_TICKS], 0)
    report = engine.tick()  # a's scores are ready: recalled and answered in this tick, beside b's frame
    assert report.recalling == ()
    got_b.append(_out(report, "b"))
    logits, tokens = _out(report, "a")

    want_logits, want_tokens = _feed_session(oracle_a, question, False, False)
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
    assert tokens == want_tokens and engine.recall_stats("a") == oracle_a.recall_stats()
    assert oracle_a.recall_stats().recalled_cells > 0
    for i, ((lg, tk), (w_lg, w_tk)) in enumerate(zip(got_b, want_b, strict=True)):
        np.testing.assert_allclose(lg, w_lg, atol=1e-5, rtol=0, err_msg=f"b frame {i}")
        assert tk == w_tk, (i, tk, w_tk)


def test_the_worker_feeds_other_sessions_while_an_answer_waits_for_its_scores(model, held):
    """Over `EngineWorker`: a's answer waits for its scores while b's feed is written; the answer then equals the
    batch-1 Session's (held over its continuations, as `Chat`)."""
    release, _ = held
    config = _config(POLICIES["streamingllm"])
    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    question, max_tokens = _question(1, 101), 7

    async def body(worker):
        await worker.open("a")
        await worker.open("b")
        await asyncio.gather(worker.feed("a", _context(0)), worker.feed("b", _context(60, units=200)))
        answer = worker.respond("a", Prompt(parts=[question], answer_unit=101), max_tokens,
                                lambda u, n: _continuation(0, u))
        fed = worker.feed("b", _context(61, units=300)[:B_TICKS])
        await asyncio.wait_for(fed, HOLD_S / 2)  # b's chunks are written while a's question is held
        assert not answer.done.done() and worker.busy("a")
        release.set()
        await asyncio.wait_for(answer.done, 60)
        return list(answer.tokens), answer.recall, worker.stop_ids

    tokens, figures, stop = on_worker(engine, body)
    session = Session(model, config)
    for c in _context(0):
        _feed_session(session, c, False, False)
    want = _oracle_answer(session, question, max_tokens, stop)
    assert tokens == want and want
    assert figures == session.recall_stats() and figures.recalled_cells > 0
