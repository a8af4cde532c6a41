"""Recall on the serving engine (issue 40, item 1): an engine session whose `StreamConfig` has `recall=Recall(...)`
carries its own host tier. Oracle: a batch-1 `omnijax.Session` with the same config fed the same padded chunks (and
holding its recall where the engine's session holds it): every frame's logits (1e-5) and answer tokens, and the
recall figures, are equal; a second session served in the same ticks on a seeded schedule changes none of it; an
engine snapshot carries the tier, and the resumed session answers as the uninterrupted one; a missing or corrupt
tier, and what the engine does not support with recall yet, are refused by name and change nothing (paging other
than native and int8 pools: test_engine_recall_paging)."""

import asyncio
import concurrent.futures
import dataclasses

import numpy as np
import pytest

from omnijax.chunks.chunk import pad_chunk, text_chunk
from omnijax.conversation import Prompt
from omnijax.retention import OmniPick, SinkWindow, StreamingLLM
from omnijax.retention.recall import Recall
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.snapshot import SnapshotFormatError, load_snapshot, save_snapshot
from omnijax.serve.engine.snapshot_tier import TIER_FILE
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests._support.engine_worker import on_worker

T, TAU, PAGES, PAGE = 10, 3, 64, 8
POLICIES = {
    "omnipick": OmniPick(high_watermark=40, low_watermark=30, recent_units=2, text_budget=4),
    "streamingllm": StreamingLLM(sink_tokens=2, window=12, high_watermark=16),
    "sinkwindow": SinkWindow(sink=4, window=16),
}
SIZES = (8, 8, 8, 8, 6, 10)


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _config(policy, recall=Recall(budget=64, top_units=8)):
    return StreamConfig(policy=policy, num_pages=PAGES, page_size=PAGE, max_answer_tokens=TAU, impl="xla",
                        recall=recall)


def _context(seed, units=0):
    rng = np.random.default_rng(seed)
    return [text_chunk(rng.integers(3, 290, n), length=T, unit=units + 2 * i) for i, n in enumerate(SIZES)]


def _question(seed, unit=100):
    return text_chunk(np.random.default_rng(seed).integers(3, 290, 5), length=T, unit=unit, answer_tokens=TAU)


def _continuation(seed, unit=101):
    c = _question(seed)
    return dataclasses.replace(c, valid=np.zeros_like(c.valid), advance=np.zeros_like(c.advance),
                               answer_unit=np.asarray([unit], np.int32))


def _script(seed):
    """(chunk, hold, release after) per frame: context, a held question answered over two continuations, more
    context, a question not held, a last question held and released."""
    held = [(_question(seed + 1), True, False), (_continuation(seed + 1), False, False),
            (_continuation(seed + 1, 102), False, True)]
    return ([(c, False, False) for c in _context(seed)] + held
            + [(c, False, False) for c in _context(seed + 2, units=20)[:3]]
            + [(_question(seed + 3, 110), False, False)] + [(c, False, False) for c in _context(seed + 4, 40)[:2]]
            + [(_question(seed + 5, 120), True, False), (_continuation(seed + 5, 121), False, True)])


def _feed_session(session, chunk, hold, release):
    if hold:
        session.hold_recall()
    answer = int(np.asarray(chunk.answer_tokens)[0])
    out = session.feed(dataclasses.replace(pad_chunk(chunk, T), answer_tokens=np.asarray([answer], np.int32)))
    if release:
        session.release_recall()
    return np.asarray(out.logits[0]), [int(t) for t in np.asarray(out.tokens[0])[:answer] if t >= 0]


def _submit(engine, sid, chunk, hold):
    if hold:
        engine.hold_recall(sid)
    engine.submit(sid, chunk, int(np.asarray(chunk.answer_tokens)[0]))


def _run_engine(engine, scripts, schedule):
    """Feeds each session's script one frame per tick where `schedule[i]` serves it (a question waiting for its
    recall's scores, `TickReport.recalling`, is waited for: its session gets no frame until it is answered), then
    ticks until every frame is answered; returns each session's (logits, tokens) per frame."""
    got = {sid: [] for sid in scripts}
    at = {sid: 0 for sid in scripts}
    inflight: dict = {}  # sid -> release after its frame
    for serve in list(schedule) + [tuple(scripts)] * 200:
        if all(at[sid] == len(scripts[sid]) for sid in scripts) and not inflight:
            break
        if inflight and all(sid in engine.recall.scoring for sid in inflight) and \
                not any(sid not in inflight and at[sid] < len(scripts[sid]) for sid in serve):
            concurrent.futures.wait(engine.recall.futures(), 60, concurrent.futures.FIRST_COMPLETED)  # nothing to do
        for sid in serve:
            if sid not in inflight and at[sid] < len(scripts[sid]):
                chunk, hold, release = scripts[sid][at[sid]]
                _submit(engine, sid, chunk, hold)
                inflight[sid] = release
                at[sid] += 1
        report = engine.tick()
        for sid, release in list(inflight.items()):
            if sid in report.recalling:
                assert sid not in report.outputs
                continue
            out = report.outputs[sid]
            assert not out.preempted and out.dropped == 0
            got[sid].append((out.logits, out.tokens))
            del inflight[sid]
            if release:
                engine.release_recall(sid)
    assert all(at[sid] == len(scripts[sid]) for sid in scripts) and not inflight
    return got


def _oracle(model, config, script):
    session = Session(model, config)
    return session, [_feed_session(session, *frame) for frame in script]


def _assert_same(got, want, where):
    assert len(got) == len(want), where
    for i, ((logits, tokens), (w_logits, w_tokens)) in enumerate(zip(got, want)):
        np.testing.assert_allclose(logits, w_logits, atol=1e-5, rtol=0, err_msg=f"{where}: frame {i}")
        assert tokens == w_tokens, (where, i, tokens, w_tokens)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_engine_session_with_recall_answers_as_a_batch1_session_alone_and_beside_another(model, name):
    config = _config(POLICIES[name])
    script = _script(0)
    session, want = _oracle(model, config, script)
    stats = session.recall_stats()
    assert stats.questions == 3 and stats.recalled_cells > 0 and stats.captured_units > 0
    # the oracle can fail: without recall the questions read otherwise
    _, plain = _oracle(model, config.replace(recall=None), script)
    questions = [i for i, (c, _, _) in enumerate(script) if np.asarray(c.answer_tokens).any()]
    assert max(np.abs(want[i][0] - plain[i][0]).max() for i in questions) > 1e-3

    alone = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    alone.open("a")
    got = _run_engine(alone, {"a": script}, [("a",)] * len(script))
    _assert_same(got["a"], want, f"{name} alone")
    assert alone.recall_stats("a") == stats

    _beside_another(model, config, script, want, stats, name)


def _beside_another(model, config, script, want, stats, name: str) -> None:
    """Session "a" (`script`, whose batch-1 answers are `want` and recall figures `stats`) beside a second recall
    session on a seeded schedule (some ticks serve one, some both): both answer as batch-1 sessions."""
    other = _script(50)
    _, want_b = _oracle(model, config, other)
    rng = np.random.default_rng(7)
    schedule = [tuple(s for s in ("a", "b") if rng.random() < 0.7) for _ in range(4 * len(script))]
    both = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    both.open("a")
    both.open("b")
    got = _run_engine(both, {"a": script, "b": other}, [s for s in schedule if s] + [("a", "b")] * len(script))
    _assert_same(got["a"], want, f"{name} beside b")
    _assert_same(got["b"], want_b, f"{name} b")
    assert both.recall_stats("a") == stats


def test_an_engine_snapshot_carries_the_tier_and_the_resumed_session_answers_as_the_uninterrupted_one(model,
                                                                                                     tmp_path):
    config = _config(POLICIES["omnipick"])
    script = _script(0)
    cut = 10  # after the held question's release and some context
    _, want = _oracle(model, config, script)
    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    engine.open("a")
    first = _run_engine(engine, {"a": script[:cut]}, [("a",)] * cut)["a"]
    snapshot = engine.export_session("a")
    assert snapshot.tier is not None and len(snapshot.tier.tier.units) == engine.recall_stats("a").stored_units > 0
    stats = engine.recall_stats("a")
    engine.close("a")

    fresh = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    fresh.open("other")  # another session in the pool: the resumed one takes other pages
    fresh.submit("other", _context(9)[0], 0)
    fresh.tick()
    save_snapshot(tmp_path / "a", snapshot)  # the tier goes to disk beside the arrays
    loaded = load_snapshot(tmp_path / "a")
    assert [u.unit for u in loaded.tier.tier.units] == [u.unit for u in snapshot.tier.tier.units]
    fresh.import_session("a", loaded)
    assert fresh.recall_stats("a") == stats
    rest = _run_engine(fresh, {"a": script[cut:]}, [("a",)] * (len(script) - cut))["a"]
    _assert_same(first + rest, want, "resumed")


def test_a_missing_or_corrupt_tier_and_unsupported_uses_are_refused_by_name(model, tmp_path):
    config = _config(POLICIES["streamingllm"])
    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    engine.open("a")
    _run_engine(engine, {"a": [(c, False, False) for c in _context(0)]}, [("a",)] * len(SIZES))
    snapshot = engine.export_session("a")
    assert snapshot.tier.tier.units
    free, sessions = engine.free_pages, engine.sessions

    with pytest.raises(ValueError, match="host tier is missing"):
        engine.import_session("b", dataclasses.replace(snapshot, tier=None))
    bad_vpos = dataclasses.replace(snapshot.tier, vpos=snapshot.tier.vpos[:-1])
    with pytest.raises(ValueError, match="host tier is corrupt: vpos"):
        engine.import_session("b", dataclasses.replace(snapshot, tier=bad_vpos))
    unit = snapshot.tier.tier.units[0]
    tampered = dataclasses.replace(unit, k=unit.k + 1)
    bad_tier = dataclasses.replace(snapshot.tier, tier=dataclasses.replace(
        snapshot.tier.tier, units=(tampered,) + snapshot.tier.tier.units[1:]))
    with pytest.raises(ValueError, match="summary is not the mean of its keys"):
        engine.import_session("b", dataclasses.replace(snapshot, tier=bad_tier))
    assert engine.free_pages == free and engine.sessions == sessions  # nothing changed

    save_snapshot(tmp_path / "s", snapshot)
    (tmp_path / "s" / TIER_FILE).unlink()
    with pytest.raises(SnapshotFormatError, match="recall host tier is missing or corrupt"):
        load_snapshot(tmp_path / "s")
    save_snapshot(tmp_path / "t", dataclasses.replace(snapshot, tier=bad_tier))
    with pytest.raises(ValueError, match="summary is not the mean of its keys"):  # found when the session resumes
        engine.import_session("b", load_snapshot(tmp_path / "t"))
    assert engine.free_pages == free and engine.sessions == sessions
    plain = Engine(model, EngineConfig(stream=config.replace(recall=None), chunk_tokens=T, buckets=(1, 2)))
    with pytest.raises(ValueError, match="carries a recall host tier but this engine"):
        plain.import_session("a", snapshot)
    assert plain.sessions == []

    with pytest.raises(ValueError, match="constrained decoding .* is not supported with StreamConfig\\(recall"):
        engine.tick(constraints={"a": object()})
    with pytest.raises(ValueError, match="recall is off for this engine"):
        plain.open("x") or plain.recall_stats("x")


def test_forks_of_a_recall_session_each_carry_its_tier_and_answer_as_its_resumed_session(model):
    config = _config(POLICIES["streamingllm"])
    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    for sid in ("a", "b", "c"):
        engine.open(sid)
    source = Session(model, config)
    for c in _context(0):
        _feed_session(source, c, False, False)
    _run_engine(engine, {"a": [(c, False, False) for c in _context(0)]}, [("a",)] * len(SIZES))
    assert engine.fork_session("a", ["b", "c"])[0] is False  # nothing shared under recall
    questions = {"a": _question(1), "b": _question(2), "c": _question(3)}
    got = _run_engine(engine, {s: [(q, False, False)] for s, q in questions.items()}, [("a", "b", "c")])
    for sid, q in questions.items():
        fork = Session.resume(model, source.snapshot(), config)
        _assert_same(got[sid], [_feed_session(fork, q, False, False)], f"fork {sid}")
        assert engine.recall_stats(sid) == fork.recall_stats() and fork.recall_stats().recalled_cells > 0


def _oracle_answer(session, question, max_tokens, stop):
    """What `Chat` does for one answer: the question's recall held over the answer's continuation chunks."""
    session.hold_recall()
    tokens, chunk = [], question
    while True:
        asked = min(TAU, max_tokens - len(tokens))
        _, new = _feed_session(session, dataclasses.replace(chunk, answer_tokens=np.asarray([asked], np.int32)),
                               False, False)
        cut = next((i + 1 for i, t in enumerate(new) if t in stop), None)
        tokens += new[:cut] if cut is not None else new
        if cut is not None or len(tokens) >= max_tokens or not new:
            break
        chunk = _continuation(0, int(np.asarray(question.answer_unit)[0]))
    session.release_recall()
    return tokens


@pytest.mark.parametrize("per_token", [False, True])
def test_the_worker_holds_each_answers_recall_as_chat_does(model, per_token):
    """Two sessions over one `EngineWorker`: context fed, a question answered over continuations, more context, a
    second question; every answer equals the batch-1 Session's held over that answer (`Chat`'s way)."""
    config = _config(POLICIES["omnipick"])
    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4), per_token=per_token))
    max_tokens = 8
    plans = {sid: (_context(seed), _question(seed + 1, 101), _context(seed + 2, 20)[:3], _question(seed + 3, 111))
             for sid, seed in (("a", 0), ("b", 30))}

    async def body(worker):
        async def one(sid):
            first, q1, more, q2 = plans[sid]
            await worker.open(sid)
            answers = []
            for context, question in ((first, q1), (more, q2)):
                await worker.feed(sid, context)
                unit = int(np.asarray(question.answer_unit)[0])
                answer = worker.respond(sid, Prompt(parts=[question], answer_unit=unit), max_tokens,
                                        lambda u, n: _continuation(0, u))
                await answer.done
                answers.append(list(answer.tokens))
                assert answer.recall is not None and answer.recall.questions == len(answers)
            return answers
        got = dict(zip(plans, await asyncio.gather(*(one(sid) for sid in plans))))
        return got, worker.stop_ids, {sid: engine.recall_stats(sid) for sid in plans}

    got, stop, stats = on_worker(engine, body)
    for sid, (first, q1, more, q2) in plans.items():
        session = Session(model, config)
        want = []
        for context, question in ((first, q1), (more, q2)):
            for c in context:
                _feed_session(session, c, False, False)
            want.append(_oracle_answer(session, question, max_tokens, stop))
        assert got[sid] == want and all(want), (sid, got[sid], want)
        assert stats[sid] == session.recall_stats() and stats[sid].questions == 2 and stats[sid].recalled_cells

