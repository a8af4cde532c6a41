"""`evaluate` with `StreamConfig(recall=...)` (issue 40): each session's logits and answers equal those of the same
session run alone through `Session` with the same recall; recalling everything under OmniPick answers the first
question as the batched full-context program does; figures come back per session; a mesh is refused by name."""

import numpy as np
import pytest
from flax import nnx

from omnijax.eval.runner import EvalConfig, evaluate
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.retention import NoSlide, OmniPick, SinkWindow
from omnijax.retention.recall import Recall
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from omnijax.testing.synthetic import eval_sessions
from tests._support import recall_setup

CONFIG = TINY_OMNI.replace(vocab_size=256, intermediate_size=96)
PAGES, PAGE = 24, 8
TIGHT = OmniPick(high_watermark=24, low_watermark=16, recent_units=1, text_budget=4)  # evicts before the question
# The policies of the first test are test_recall_questions' SinkWindow and OmniPick (TIGHT): the batch-1 step of each
# (the evaluate runner steps a recall session by it too) compiles once per suite, and TIGHT's batched program without
# recall is the one the full-context test below runs as its bounded session.
POLICIES = [SinkWindow(sink=6, window=16), TIGHT]


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sessions():
    return eval_sessions(CONFIG.vocab_size, count=3)


def _config(policy, recall, tau=2):
    return StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=tau, recall=recall)


def _alone(model, config, chunks):
    """A batch-1 `Session` fed `chunks`, each padded to the session's longest (18 tokens: one compiled step per
    policy, shared with test_recall_questions)."""
    session = Session(model, config)
    outs = [session.feed(c) for c in recall_setup.padded(chunks)]
    return (np.stack([np.asarray(o.logits[0]) for o in outs]), np.stack([np.asarray(o.tokens[0]) for o in outs]),
            session.recall_stats())


@pytest.mark.parametrize("policy", POLICIES, ids=["sinkwindow", "omnipick"])
def test_evaluate_with_recall_equals_each_session_run_alone(model, sessions, policy):
    config = _config(policy, Recall(budget=64, top_units=4))
    res = evaluate(model, sessions, [EvalConfig("r", config, keep_logits=True),
                                     EvalConfig("off", config.replace(recall=None), keep_logits=True)],
                   progress=False)
    recalled = 0
    for s, chunks in enumerate(sessions):
        logits, tokens, stats = _alone(model, config, chunks)
        got = res["r"].sessions[s]
        assert got.num_chunks == len(chunks)
        np.testing.assert_allclose(got.logits, logits, atol=1e-5)
        np.testing.assert_array_equal(got.tokens, tokens)
        assert got.recall == stats
        recalled += stats.recalled_cells
        off = res["off"].sessions[s]  # the batched program without recall: the same until the first recall
        first = next(c for c, chunk in enumerate(chunks) if np.asarray(chunk.answer_tokens).any())
        np.testing.assert_allclose(got.logits[:first], off.logits[:first], atol=1e-5)
    assert recalled > 0  # something was recalled: the check can tell recall from none
    assert res["r"].batch_size == 1 and res["r"].num_pages == PAGES


def test_recalling_everything_answers_the_first_question_like_the_full_context(model, sessions):
    recall = evaluate(model, sessions, [EvalConfig("r", _config(TIGHT, Recall(budget=128, top_units=64)),
                                                   keep_logits=True)], progress=False)["r"]
    plain = evaluate(model, sessions, [EvalConfig("full", _config(NoSlide(), None), keep_logits=True),
                                       EvalConfig("bounded", _config(TIGHT, None), keep_logits=True)],
                     progress=False)
    for s, chunks in enumerate(sessions):
        q = next(c for c, chunk in enumerate(chunks) if np.asarray(chunk.answer_tokens).any())
        want, without = plain["full"].sessions[s].logits[q], plain["bounded"].sessions[s].logits[q]
        assert recall.sessions[s].recall.questions >= 1 and recall.sessions[s].recall.recalled_cells > 0
        np.testing.assert_allclose(recall.sessions[s].logits[q], want, atol=1e-5)
        assert np.abs(without - want).max() > 1e-3  # the bounded session had evicted what the question reads


def test_recall_with_a_mesh_is_refused_by_name(model, sessions):
    from omnijax.eval import mesh as distributed

    with pytest.raises(ValueError, match=r"config\(s\) \['r'\]: StreamConfig\(recall=...\) runs each session"):
        evaluate(model, sessions, [EvalConfig("r", _config(TIGHT, Recall(budget=64)))],
                 mesh=distributed.make_mesh(1, 1), progress=False)
