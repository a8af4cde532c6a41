"""A recall scoring error fails only its session's question (issue 40): on an engine with two recall sessions served
on a seeded schedule, session a's first question is scored by a function that raises (on the recall executor's
thread). That frame comes back with an error naming the cause, no tokens and `written=False`; every other frame of a
equals a batch-1 `Session` fed a's frames without that question (its row and tier were left as they were, so its
second question recalls as usual), and every frame of b equals b alone, including the tick the failure landed in."""

import concurrent.futures

import numpy as np
import pytest

from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests.serve.engine.test_engine_recall import (
    POLICIES,
    T,
    _assert_same,
    _config,
    _context,
    _feed_session,
    _oracle,
    _question,
    _run_engine,
    _script,
)

FAILING = 6  # the frame of a's script whose scoring raises: its first question


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _script_a(seed):
    """Context, a question (not held), more context, a second question."""
    return ([(c, False, False) for c in _context(seed)] + [(_question(seed + 1), False, False)]
            + [(c, False, False) for c in _context(seed + 2, units=20)[:3]] + [(_question(seed + 3, 110), False,
                                                                                False)])


class Boom(RuntimeError):
    pass


class Inline(concurrent.futures.Executor):
    """Runs each scoring job at once: a question's scores (or its error) are ready at the tick that asked it, so
    the tick the failure lands in is known from the schedule (the thread's timing is test_engine_recall_async's)."""

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - handed to the engine as the executor's thread would
            future.set_exception(e)
        return future


def test_a_scoring_error_fails_only_its_question_and_the_other_session_is_served_as_alone(model):
    config = _config(POLICIES["omnipick"])
    script_a, script_b = _script_a(0), _script(50)
    assert int(np.asarray(script_a[FAILING][0].answer_tokens)[0]) > 0
    oracle_a = Session(model, config)
    want_a = [_feed_session(oracle_a, *frame) for i, frame in enumerate(script_a) if i != FAILING]
    _, want_b = _oracle(model, config, script_b)

    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    engine.open("a")
    engine.open("b")
    scorer = engine.recall.sessions["a"]
    calls = []

    def score(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise Boom("scoring failed on purpose")
        return type(scorer).score(scorer, *args, **kwargs)

    scorer.score = score
    engine.recall._executor = Inline()
    reports = []
    tick = engine.tick
    engine.tick = lambda **kw: reports.append(tick(**kw)) or reports[-1]
    rng = np.random.default_rng(8)
    schedule = [s for s in (tuple(s for s in ("a", "b") if rng.random() < 0.7) for _ in range(4 * len(script_b)))
                if s]
    asked_at = [i for i, s in enumerate(schedule) if "a" in s][FAILING]
    assert "b" in schedule[asked_at]  # the seeded schedule serves b in the tick a's question fails
    got = _run_engine(engine, {"a": script_a, "b": script_b}, schedule + [("a", "b")] * 20)

    failed = [r for r in reports if "a" in r.outputs and r.outputs["a"].error is not None]
    assert len(failed) == 1 and len(calls) == 2
    out = failed[0].outputs["a"]
    assert out.tokens == [] and out.logits is None and not out.written and not out.preempted
    assert "recall failed" in out.error and "Boom: scoring failed on purpose" in out.error
    assert "b" in failed[0].outputs and failed[0].outputs["b"].error is None  # b served in the failing tick
    _assert_same(got["a"][:FAILING] + got["a"][FAILING + 1:], want_a, "a without its failed question")
    assert got["a"][FAILING] == (None, [])
    _assert_same(got["b"], want_b, "b beside the failure")
    assert engine.recall_stats("a") == oracle_a.recall_stats()
    assert engine.recall_stats("a").questions == 1 and engine.recall_stats("a").recalled_cells > 0
    assert all(o.written and o.error is None for r in reports for s, o in r.outputs.items() if
               not (s == "a" and r is failed[0]))
