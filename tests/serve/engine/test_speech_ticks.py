"""Speech on the engine's batched ticks (`omnijax.serve.engine.speech`, issue 39 item 4): a seeded random schedule of
utterances on a tiny converted Qwen3-Omni release, admitted at random ticks beside thinker sessions, each checked
against the same utterance spoken alone (`speech.speak` / `speak_streamed`, themselves equal to transformers'
`generate(return_audio=True)` in tests/models/qwen3_omni/test_speech.py): the same talker tokens and codes, the same
vocoder chunks, PCM within 1e-6 of the peak (the batched Code2Wav rows differ from a lone call by float rounding:
3.2e-7 of the peak at most, seen). Admission: rows and reserved talker pages refused by name (`Overloaded`), nothing
changed by a refusal, every page back when the pool empties; late chunks are reported, never dropped.

The release is `test_talker.seeded_full_model()`; its random talker never ends its speech, so every utterance runs
to its `max_new_tokens`.
"""

import logging
import types
import warnings

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.convert import convert_checkpoint
from omnijax.models.qwen3_omni import speech as S
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.speech import SpeechConfig, SpeechPool
from omnijax.serve.engine.worker_speech import SpeakingWorker, SpeechStream

torch = pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) builds the release")

from tests._support.step_clock import StepClock  # noqa: E402
from tests.models.qwen3_omni import test_talker as T  # noqa: E402  (needs torch)

TTS = T.TTS
IM_START, IM_END, NL = TTS["im_start_token_id"], TTS["im_end_token_id"], 198
FIRST, CHUNK = 3, 4
SPEECH = SpeechConfig(rows=(2, 4), num_pages=40, page_size=16, first_chunk=FIRST, chunk=CHUNK)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_speech")
    T.seeded_full_model().save_pretrained(root / "hf", safe_serialization=True)
    out = convert_checkpoint(root / "hf", root / "out", progress=False, log=lambda _: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no tokenizer files: token ids in, token ids out
        return omnijax.load(out)


def prompt_ids(rng):
    """A system turn (the talker skips it), a user turn of 2-4 random words, the assistant's opening."""
    words = [int(w) for w in rng.integers(10, 200, size=int(rng.integers(2, 5)))]
    return np.asarray([IM_START, TTS["system_token_id"], NL, 10, 11, IM_END, NL, IM_START, TTS["user_token_id"], NL,
                       *words, IM_END, NL, IM_START, TTS["assistant_token_id"], NL])


def utterances(seed, n):
    rng = np.random.default_rng(seed)
    return [dict(speech_id=f"u{i}", prompt_ids=prompt_ids(rng),
                 answer_ids=rng.integers(10, 200, size=int(rng.integers(2, 7))),
                 voice=("Ethan", "chelsie")[int(rng.integers(2))], max_new_tokens=int(rng.integers(2, 13)),
                 at=int(rng.integers(0, 4))) for i in range(n)]


def alone(model, u):
    """The utterance spoken alone: its `Utterance` and its streamed chunks."""
    args = (model, u["prompt_ids"], u["answer_ids"])
    kw = dict(speaker=u["voice"], max_new_tokens=u["max_new_tokens"])
    return S.speak(*args, **kw), list(S.speak_streamed(*args, **kw, first_chunk=FIRST, chunk=CHUNK))


def test_a_random_schedule_speaks_as_each_utterance_alone(model):
    """6 utterances opened at seeded random ticks (refused while the pool is full, then retried) beside two thinker
    sessions fed every tick: each utterance's talker tokens, codes, chunk sizes and PCM equal it spoken alone."""
    stream = omnijax.StreamConfig(num_pages=32, page_size=16, max_answer_tokens=2)
    engine = Engine(model, EngineConfig(stream=stream, chunk_tokens=8, buckets=(2,), speech=SPEECH))
    pool = engine.speech
    rng = np.random.default_rng(1)
    for sid in ("a", "b"):
        engine.open(sid)
    plan, got, refused, tick = utterances(3, 6), {}, 0, 0
    waiting = sorted(plan, key=lambda u: u["at"])
    while waiting or pool.busy:
        for u in list(waiting):
            if u["at"] > tick:
                break
            before = (pool.sessions, pool.reserved, int(pool.kv.num_free))
            try:
                engine.speak(u["speech_id"], u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                             max_new_tokens=u["max_new_tokens"])
            except Overloaded as e:
                assert "speech pool holds at most 4" in str(e) or "talker pages" in str(e)
                assert (pool.sessions, pool.reserved, int(pool.kv.num_free)) == before
                refused += 1
                break
            waiting.remove(u)
            got[u["speech_id"]] = []
        for sid in ("a", "b"):
            engine.submit(sid, text_chunk(rng.integers(10, 200, size=6)), answer_tokens=int(rng.integers(0, 3)))
        report = engine.tick()
        assert set(report.outputs) == {"a", "b"}
        for c in report.speech:
            got[c.speech_id].append(c)
        tick += 1
        assert tick < 60, "the schedule did not finish"
    assert refused > 0, "the schedule never filled the pool (pick another seed)"
    assert pool.reserved == 0 and int(pool.kv.num_free) == SPEECH.num_pages
    for u in plan:
        ref, chunks = alone(model, u)
        mine = got[u["speech_id"]]
        assert mine[-1].final and not any(c.final for c in mine[:-1])
        codes = np.concatenate([c.codes for c in mine], axis=1)
        np.testing.assert_array_equal(codes, ref.codes, err_msg=u["speech_id"])
        assert [c.pcm.size for c in mine if c.pcm.size] == [c.size for c in chunks]
        pcm = np.concatenate([c.pcm for c in mine])
        assert pcm.size == ref.pcm.size
        assert_same_pcm(pcm, np.concatenate(chunks), u["speech_id"])
        assert_same_pcm(pcm, ref.pcm, u["speech_id"])
    # the vocoder batched: fewer Code2Wav calls than chunks with samples, some call carrying several sessions
    stats = pool.stats
    assert stats["vocoder_rows"] == sum(c.pcm.size > 0 for cs in got.values() for c in cs)
    assert stats["vocoder_calls"] < stats["vocoder_rows"], stats


def assert_same_pcm(pcm, ref, name):
    """PCM of the batched pool against the utterance alone: within 1e-6 of the reference's peak."""
    diff = float(np.abs(pcm - ref).max())
    assert diff <= 1e-6 * float(np.abs(ref).max()), (name, diff)


def _open(pool, u, **changes):
    u = {**u, **changes}
    return pool.open(u["speech_id"], u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                     max_new_tokens=u["max_new_tokens"])


def test_admission_refuses_by_name_and_changes_nothing(model):
    """Rows and talker pages are counted at admission: what does not fit is refused naming the numbers (the pool
    unchanged); closing returns the reserved pages; bad requests and configs are refused before anything changes."""
    pool = SpeechPool(model, SpeechConfig(rows=(1, 2), num_pages=5, page_size=16, max_pages=4))
    u = utterances(0, 1)[0] | dict(max_new_tokens=8)
    state = lambda: (pool.sessions, pool.reserved, pool.free_pages, int(pool.kv.num_free))  # noqa: E731
    empty = state()
    with pytest.raises(S.UnknownVoiceError, match="Nobody"):
        _open(pool, u, voice="Nobody")
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        _open(pool, u, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"needs 5 talker pages .* a row holds 4"):
        _open(pool, u, max_new_tokens=60)
    assert state() == empty
    need = pool.pages_needed(S.talker_input(model, u["prompt_ids"], u["answer_ids"]).rows.shape[0], 8)
    assert _open(pool, u) == need == 2 and pool.reserved == 2
    with pytest.raises(KeyError, match="already in the pool"):
        _open(pool, u)
    assert _open(pool, u, speech_id="v") == 2
    full = state()
    with pytest.raises(Overloaded, match="2 sessions are speaking, the speech pool holds at most 2") as e:
        _open(pool, u, speech_id="w")
    assert (e.value.cap, e.value.current) == (2, 2) and state() == full
    pool.close("v")
    with pytest.raises(Overloaded, match="needs 4 talker pages and 3 of 5 are free"):
        _open(pool, u, speech_id="w", max_new_tokens=40)
    pool.close(u["speech_id"])
    assert state() == empty and pool.stats["refused"] == 2
    with pytest.raises(KeyError, match="unknown speech"):
        pool.close("v")
    with pytest.raises(S.SpeechUnavailableError, match="no speech output"):
        SpeechPool(type("Thinker", (), {"speech": None, "source": "thinker-only"})())
    for bad in (dict(rows=(2, 1)), dict(num_pages=0), dict(chunk=0), dict(max_pages=9, num_pages=4),
                dict(vocoder_budget_s=0.0), dict(vocoder_rows=0)):
        with pytest.raises(ValueError, match="SpeechConfig"):
            SpeechConfig(**bad)
    engine = Engine(model, EngineConfig(stream=omnijax.StreamConfig(num_pages=8, page_size=16), chunk_tokens=8,
                                        buckets=(1,)))
    with pytest.raises(ValueError, match="no speech pool"):
        engine.speak("x", u["prompt_ids"], u["answer_ids"], voice="Ethan", max_new_tokens=4)
    with pytest.raises(TypeError, match="EngineConfig.speech"):
        EngineConfig(speech={"rows": (1,)})


def _drain(pool, clock=None, advance=0.0):
    got = {s: [] for s in pool.sessions}
    for _ in range(100):
        if not pool.busy:
            return got
        for c in pool.tick():
            got[c.speech_id].append(c)
        if clock is not None:
            clock.now += advance
    raise AssertionError("the pool did not drain")


class _SpeechHalf(SpeakingWorker):
    """The worker's speech half alone: handing a tick's chunks to their streams (`_deliver_speech`) needs no
    engine."""

    def __init__(self):
        self.stats, self._work = {}, None
        self._init_speech()


@pytest.mark.parametrize("case", ["late", "deferred"])
def test_late_or_deferred_chunks_are_sent_not_dropped(model, case, caplog):
    """late: every tick takes 10 s, so each chunk after a session's first leaves past its playback deadline: it is
    sent all the same, flagged `late_s` > 0 and counted, and the worker that hands the chunks to their streams
    reports each utterance that ended late in the server log (how many chunks, the latest by how much). deferred: a
    vocoder budget of 0.1 us per tick makes every Code2Wav call but the first of a tick wait (no later chunk is
    urgent): the chunks go out on later ticks, in deadline order, none late, nothing reported. Either way the
    utterances equal their lone runs."""
    clock = StepClock(1e-6)
    config = SpeechConfig(**{**SPEECH.__dict__, **(dict(vocoder_budget_s=1e-7, slack_s=0.0) if case == "deferred"
                                                   else {})})
    pool = SpeechPool(model, config, clock=clock)
    plan = [u | dict(max_new_tokens=n) for u, n in zip(utterances(5, 3), (9, 6, 12))]
    for u in plan[:2]:
        _open(pool, u)
    early = [c for _ in range(2) for c in pool.tick()]  # the third opens two ticks later: its first chunk shares a
    _open(pool, plan[2])  # tick with the second's last one (two Code2Wav calls: a first call and a later one)
    got = _drain(pool, clock, 10.0 if case == "late" else 0.0)
    assert not early
    chunks = [c for cs in got.values() for c in cs]
    if case == "late":
        assert all(c.late_s > 0 for cs in got.values() for c in cs[1:])
        assert all(c.late_s == 0 and c.first_pcm_s is not None for cs in got.values() for c in cs[:1])
        assert pool.stats["late_chunks"] == len(chunks) - len(plan) > 0
    else:
        assert pool.stats["deferred"] > 0 and pool.stats["late_chunks"] == 0
    for u in plan:
        ref, alone_chunks = alone(model, u)
        mine = got[u["speech_id"]]
        np.testing.assert_array_equal(np.concatenate([c.codes for c in mine], axis=1), ref.codes)
        assert [c.pcm.size for c in mine] == [c.size for c in alone_chunks]
        assert_same_pcm(np.concatenate([c.pcm for c in mine]), ref.pcm, u["speech_id"])
    assert pool.reserved == 0 and int(pool.kv.num_free) == config.num_pages

    worker = _SpeechHalf()
    worker.speaking.update({s: SpeechStream(s) for s in got})
    streams = dict(worker.speaking)
    with caplog.at_level(logging.WARNING, logger="omnijax.serve"):
        for c in chunks:
            worker._deliver_speech(types.SimpleNamespace(speech=[c]))
    assert worker.speaking == {} and worker.stats["late_chunks"] == pool.stats["late_chunks"]
    said = sorted(r.getMessage() for r in caplog.records if r.name == "omnijax.serve")
    want = []
    for s, cs in got.items():
        late = [c.late_s for c in cs if c.late_s > 0]
        assert (streams[s].chunks, streams[s].late_chunks, streams[s].max_late_s) == (len(cs), len(late),
                                                                                      max(late, default=0.0))
        if late:
            want.append(f"speech {s} ended with {len(late)} of its {len(cs)} chunks sent past their playback "
                        f"deadline (the latest {max(late):.3f} s late)")
    assert said == sorted(want) and (len(want) == len(plan) if case == "late" else not want), said


def test_the_worker_speaks_on_its_ticks_and_counts_speech_in_admission(model):
    """Through `EngineWorker.speak`: two utterances stream at once beside a thinker session fed meanwhile, each
    equal to its lone run; while both speak, the AIMD cap of 2 refuses a third utterance and a new session (speech
    counts as active work); once they end the third speaks; a cancelled utterance ends its stream and frees its
    pages."""
    import asyncio

    from omnijax.serve.engine.admission import AIMD
    from omnijax.serve.engine.worker import EngineWorker

    stream_config = omnijax.StreamConfig(num_pages=32, page_size=16, max_answer_tokens=2)
    engine = Engine(model, EngineConfig(stream=stream_config, chunk_tokens=8, buckets=(2,), speech=SPEECH))
    plan = [u | dict(max_new_tokens=n) for u, n in zip(utterances(11, 4), (10, 7, 5, 12))]

    async def speak(worker, u):
        return await worker.speak(u["speech_id"], u["prompt_ids"], u["answer_ids"], voice=u["voice"],
                                  max_new_tokens=u["max_new_tokens"])

    async def collect(stream):
        return [c async for c in stream]

    async def main():
        worker = EngineWorker(engine, admission=AIMD(initial_cap=3, frame_budget_s=1e3, window=10_000))
        await worker.start()
        try:
            await worker.open("a")
            first = [await speak(worker, u) for u in plan[:2]]
            fed = worker.feed("a", [text_chunk(np.arange(10, 16)), text_chunk(np.arange(20, 26))])
            with pytest.raises(Overloaded, match="AIMD admission cap 3"):
                await speak(worker, plan[2])
            with pytest.raises(Overloaded, match="AIMD admission cap 3"):
                await worker.open("b")
            got = await asyncio.gather(*(collect(s) for s in first))
            await fed
            late = sum(s.late_chunks for s in first)
            got.append(await collect(await speak(worker, plan[2])))
            cancelled = await speak(worker, plan[3])
            kept = [await cancelled.__anext__()]
            assert await worker.cancel_speech(plan[3]["speech_id"])
            kept += [c async for c in cancelled]
            reserved = await worker.in_engine(lambda: engine.speech.reserved)
            return got, kept, late, dict(worker.stats), reserved, worker.speaking
        finally:
            await worker.close("a")
            await worker.stop()

    got, kept, late, stats, reserved, speaking = asyncio.run(main())
    assert reserved == 0 and speaking == {}
    assert stats["speech_opened"] == 4 and stats["speech_refused"] == 1 and stats["refused"] == 1
    assert stats["late_chunks"] >= late
    assert kept and not kept[-1].final  # cancelled after its first chunks: no final chunk
    for u, mine in zip(plan, got):
        ref, chunks = alone(model, u)
        assert mine[-1].final
        np.testing.assert_array_equal(np.concatenate([c.codes for c in mine], axis=1), ref.codes)
        assert [c.pcm.size for c in mine] == [c.size for c in chunks]
        assert_same_pcm(np.concatenate([c.pcm for c in mine]), ref.pcm, u["speech_id"])
