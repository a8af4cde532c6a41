"""Speech on the server routes while the thinker still writes (issue 39): on a served tiny Qwen3-Omni release whose
engine decodes one answer token a tick (tau 1), the speech pool's talker starts with the answer's first token, so
through the official `openai` SDK

- a streamed chat completion's speech starts while its answer is written, checked on what the server recorded, not
  on timing (`_spoken_while_written`: the first PCM chunk reaches the route before the answer's last tokens, and the
  client gets the deltas in the route's order), a Realtime response's first `response.output_audio.delta` comes
  before its last `response.output_audio_transcript.delta`;
- the PCM16 of both, and of a whole chat completion, equals the finished answer spoken alone (`speech.speak` on the
  prompt transformers renders and the answer `omnijax.Chat` decodes) within 1 LSB (tests/serve/engine/
  test_speech_writing.py checks the float PCM within 1e-5 of the peak);
- `audio.sampling` draws the speech `speak(..., sampling=TalkerSampling(...))` draws, seeded (two requests with one
  seed speak the same PCM, another seed other PCM); an unknown or out-of-range field is refused with HTTP 400 naming
  it, the server serving on;
- `session.audio.output.sampling` does the same for a Realtime session (echoed in its session object, kept by its
  snapshots; an unknown field refused by an error event naming it);
- the event loop computes nothing: the pool's `open` and `extend` (the text rows' projection) run off the thread that
  pushes the tokens (the event loop's), for both routes.

The same routes on a served tiny Qwen2.5-Omni release (the fixtures are parametrized by family), served with
`ServeOptions(speak_early=True)`: its engine speaks on its own pool (`Qwen25SpeechPool` with
`SpeechConfig(early_start=True)`: the talker batched on the ticks, Token2Wav streamed as it decodes), its talker
reading each answer token's thinker row as the engine's decode programs return it (`Answer.rows`). So chat
completions and Realtime responses speak while the answer is written (as above; the tests hold the engine's ticks
from the utterance's creation until it is open in the pool, so a slow thinker forward over the prompt cannot let the
answer end first; Token2Wav served without look-ahead, so that the first PCM needs only the talker's first 4 codes);
the PCM16 of the streamed and whole chat completions and of the Realtime response equals `speak_chunks` of the
finished answer (streamed as the pool streams it) within 1 LSB, and the streamed chat's and the Realtime response's
equal the finish-first path on the same pool (`speech_engine.pool_pieces` of the finished answer, run on the
server's event loop: one thinker forward over prompt and answer) bit for bit. The talker input (a thinker forward
over the prompt) is built in a worker thread and the pool's `open` / `extend` run on the engine's, neither on the
event loop. Its talker draws nothing: `audio.sampling` and `session.audio.output.sampling` are refused by name.
"""

import asyncio
import base64
import dataclasses
import io
import json
import threading
import warnings

import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

import omnijax  # noqa: E402
from omnijax.chunks.spans import SpanKind  # noqa: E402
from omnijax.media.audio import pcm16, read_wav  # noqa: E402
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStreaming  # noqa: E402
from omnijax.models.qwen3_omni import speech as S  # noqa: E402
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling  # noqa: E402
from omnijax.serve import speech_engine  # noqa: E402
from omnijax.serve import speech_output as so  # noqa: E402
from omnijax.serve.answer_text import AnswerText  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.engine.answer import Answer  # noqa: E402
from omnijax.serve.engine.speech import SpeechPool  # noqa: E402
from omnijax.serve.engine.speech_qwen25 import Qwen25SpeechPool  # noqa: E402
from omnijax.serve.engine.worker import EngineWorker  # noqa: E402
from omnijax.serve.engine.worker_speech import SpeechStream  # noqa: E402
from omnijax.serve.realtime import client_events as rte  # noqa: E402
from omnijax.serve.realtime.resume import ResumeRefused  # noqa: E402
from omnijax.serve.realtime.resume_meta import settings_of  # noqa: E402
from tests._support.qwen25_release_cache import kept_release25  # noqa: E402
from tests.chat.test_chat_speech import hf_prompt, spoken_release, stream_config  # noqa: E402

QUESTION = [{"role": "user", "content": "Say hello."}]
QUESTION25 = [{"role": "user", "content": "Hi"}]  # its tiny release's greedy answer holds no media placeholder
MAX_TOKENS, SPEECH_TOKENS = 16, 20
AUDIO = {"voice": "Chelsie", "format": "pcm16"}
QWEN3 = "qwen3_omni"
PCM: dict = {}  # (family, route) -> the PCM16 a test received, for the routes' comparison


def _stream():
    return omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=1)


@pytest.fixture(scope="module", params=[QWEN3, "qwen2_5_omni"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"written_speech_{request.param}")
    full = spoken_release(root, thinker=False)[0] if request.param == QWEN3 else kept_release25(root, tokenizer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(full)
    if request.param != QWEN3:
        # no Token2Wav look-ahead: PCM once the talker has `first_chunk` codes (with the default, the first chunk
        # of this tiny release needs more codes than its talker reads from a 16-token answer)
        model.speech.streaming = Token2WavStreaming(right_blocks=0, vocoder_right=0)
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=MAX_TOKENS, max_speech_tokens=SPEECH_TOKENS,
                           speak_early=request.param != QWEN3)
    context = build_context(model, options=options, stream=_stream(), chunk_tokens=64, buckets=(1, 2),
                            aimd_target=0)
    with BackgroundServer(context) as server:
        yield root, model, server


@pytest.fixture(scope="module")
def reference(served):
    """`Chat`'s greedy answer (text, ids) and the talker prompt transformers renders. The ids are what a spoken
    answer speaks (`Chat.last_spoken.answer_ids`): the decoded tokens without a final end-of-turn token. Chat decodes
    without speaking (the speech is `_want`'s, alone) and in blocks of 4 tokens, `test_chat_speech`'s settings (its
    compiled step for the Qwen3-Omni release; greedy tokens do not depend on the block size)."""
    root, model, _ = served
    chat = omnijax.Chat(model, stream_config())
    items = list(chat.ask(_question(model)[0]["content"], max_tokens=MAX_TOKENS))
    assert all(isinstance(i, str) for i in items) and chat.units[-1].kind == "answer"
    generated = chat.text_ids[len(chat.text_ids) - chat.units[-1].fed[int(SpanKind.RESPONSE)]:]
    answer = np.asarray(generated[:-1] if generated[-1] in model.config.eos_token_ids else generated)
    assert answer.size >= 12, "the answer is too short for the talker to speak before it ends"
    return "".join(items), np.asarray(hf_prompt(root / "hf", _question(model))), answer


def _qwen3(model) -> bool:
    return isinstance(model.speech, S.Qwen3Speech)


def _question(model) -> list:
    return QUESTION if _qwen3(model) else QUESTION25


def _want(model, reference, sampling=None):
    _, prompt, answer = reference
    more = {} if sampling is None else {"sampling": sampling}  # only Qwen3-Omni's talker draws
    if not _qwen3(model):  # Token2Wav streamed as the served pool streams it (`speak_chunks`, held equal to
        # transformers in tests/models/qwen2_5_omni/test_speech.py), the server's chunks (4 codes, then 25)
        pcm = np.concatenate(list(model.speech.speak_chunks(model, prompt, answer, voice="Chelsie",
                                                            max_new_tokens=SPEECH_TOKENS, first_chunk=4, chunk=25)))
        assert np.abs(pcm).max() > 0.05
        return pcm16(pcm).astype(np.int32)
    spoken = S.speak(model, prompt, answer, speaker="Chelsie", max_new_tokens=SPEECH_TOKENS, **more)
    assert np.abs(spoken.pcm).max() > 0.05 and len(spoken.talker_tokens) >= 6
    return pcm16(spoken.pcm).astype(np.int32)


def _ordered(kinds: list, audio: str, text: str, early: bool) -> None:
    """Spoken while written (`early`): the first audio delta before the last transcript delta; else every audio
    delta after the last transcript delta (the finished answer spoken)."""
    first_audio, last_text = kinds.index(audio), len(kinds) - 1 - kinds[::-1].index(text)
    assert (first_audio < last_text) if early else (first_audio > last_text), kinds


def _close(got, want):
    assert got.shape == want.shape
    assert int(np.abs(got - want).max()) <= 1


async def _streamed(server, audio):
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model="omnijax", messages=_question(server.context.model),
                                                  max_tokens=MAX_TOKENS, modalities=["text", "audio"], audio=audio,
                                                  stream=True)
    kinds, transcript, data = [], [], []
    async for chunk in stream:
        delta = chunk.choices[0].delta.audio if chunk.choices else None
        if delta is not None and delta.transcript:
            kinds.append("text")
            transcript.append(delta.transcript)
        if delta is not None and delta.data:
            kinds.append("audio")
            data.append(np.frombuffer(base64.b64decode(delta.data), "<i2"))
    return kinds, "".join(transcript), np.concatenate(data).astype(np.int32)


def _record_route(monkeypatch) -> list:
    """What a streamed chat's route and the engine's deliveries did, in order (all on the event loop): ("token", n)
    as the answer's tokens reach it (`Answer._push`), ("chunk",) as a PCM chunk of the utterance reaches its stream
    (`SpeechStream._push`), ("text", delta?) per `AnswerText.push` / `flush` (whether it gave a transcript delta) and
    ("audio", n) per `WrittenSpeech.ready` (n chunks given to the client between the text deltas)."""
    log: list = []

    def after(cls, name, entry):
        fn = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            log.append(entry(args, out))
            return out
        monkeypatch.setattr(cls, name, wrapped)
    after(Answer, "_push", lambda args, _: ("token", len(args[0])))
    after(SpeechStream, "_push", lambda args, _: ("chunk", int(args[0].pcm.size > 0)))
    after(AnswerText, "push", lambda _, out: ("text", bool(out)))
    after(AnswerText, "flush", lambda _, out: ("text", bool(out)))
    after(speech_engine.WrittenSpeech, "ready", lambda _, out: ("audio", len(out)))
    return log


def _hold_ticks_until_open(monkeypatch) -> None:
    """Qwen2.5-Omni: no engine tick is planned from a WrittenSpeech's creation (right after the answer's request)
    until its utterance is open in the pool, so the talker starts with the answer however long the thinker forward
    over the prompt (`prepare`, in a worker thread: cold, a compile) takes. The worker's loop idles meanwhile (an
    empty plan); `open` wakes it."""
    opened = threading.Event()
    opened.set()
    init, plan, open_ = speech_engine.WrittenSpeech.__init__, EngineWorker._plan, Qwen25SpeechPool.open

    def gated_init(self, *args, **kwargs):
        if kwargs.get("rows") is not None:
            opened.clear()
        init(self, *args, **kwargs)

    def gated_open(self, *args, **kwargs):
        out = open_(self, *args, **kwargs)
        opened.set()
        return out
    monkeypatch.setattr(speech_engine.WrittenSpeech, "__init__", gated_init)
    monkeypatch.setattr(EngineWorker, "_plan", lambda self: plan(self) if opened.is_set() else {})
    monkeypatch.setattr(Qwen25SpeechPool, "open", gated_open)


def _spy_threads(monkeypatch) -> dict:
    """The threads that pushed an answer's tokens to its `WrittenSpeech` ("loop": the event loop's), ran the pools'
    `open` / `extend` ("pool") and Qwen2.5-Omni's `prepare` ("prepare"), as sets of thread ids (`_computed_off_loop`
    checks them)."""
    threads: dict = {"loop": set(), "pool": set(), "prepare": set()}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            threads[name].add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(speech_engine.WrittenSpeech, "push", spy("loop", speech_engine.WrittenSpeech.push))
    monkeypatch.setattr(so, "pool_full", spy("loop", so.pool_full))  # the spoken prompt's check, on the event loop
    for pool in (SpeechPool, Qwen25SpeechPool):
        monkeypatch.setattr(pool, "open", spy("pool", pool.open))
        monkeypatch.setattr(pool, "extend", spy("pool", pool.extend))
    monkeypatch.setattr(Qwen25SpeechPool, "prepare", spy("prepare", Qwen25SpeechPool.prepare))
    return threads


def _computed_off_loop(threads: dict, model) -> None:
    """The pool's `open` / `extend` ran on a thread other than the event loop's, and Qwen2.5-Omni's `prepare` (only
    its) on neither."""
    assert threads["loop"] and threads["pool"] and not threads["loop"] & threads["pool"], threads
    assert bool(threads["prepare"]) != _qwen3(model) and not threads["prepare"] & (threads["loop"] | threads["pool"])


def _spoken_while_written(kinds: list, log: list) -> None:
    """The order of a streamed chat's deltas, checked on what the server recorded (`_record_route`), not on timing:
    the first PCM chunk reached the route before the answer's last tokens did (the talker ran beside the thinker:
    tick counts, the talker opened with the answer's first tick), and the client received the deltas in the route's
    order (each text delta, then the audio chunks `ready()` gave after it, then the rest of the speech). When the
    route had PCM to give before its last transcript delta (it read the answer no later than a few ticks behind), the
    first audio delta comes before the last transcript delta."""
    chunks = [i for i, e in enumerate(log) if e == ("chunk", 1)]
    tokens = [i for i, e in enumerate(log) if e[0] == "token" and e[1]]
    assert chunks and chunks[0] < tokens[-1], log
    route = [kind for e in log if e[0] in ("text", "audio") for kind in
             (["text"] if e == ("text", True) else ["audio"] * e[1] if e[0] == "audio" else [])]
    assert kinds[:len(route)] == route and set(kinds[len(route):]) <= {"audio"}, (kinds, log)
    given = sum(e[1] for e in log if e[0] == "audio")
    last_ready = max(i for i, e in enumerate(log) if e[0] == "audio")
    assert given == sum(1 for i in chunks if i < last_ready), log  # ready() gave every chunk that had arrived
    if given and "text" in route[route.index("audio"):]:
        _ordered(kinds, "audio", "text", True)


def test_streamed_chat_speech_order_and_pcm(served, reference, monkeypatch):
    _, model, server = served
    log = _record_route(monkeypatch)
    if not _qwen3(model):
        _hold_ticks_until_open(monkeypatch)
    threads = _spy_threads(monkeypatch)
    kinds, text, pcm = asyncio.run(asyncio.wait_for(_streamed(server, AUDIO), 600))
    PCM[_qwen3(model), "chat"] = pcm
    assert text == reference[0]
    _spoken_while_written(kinds, log)
    _close(pcm, _want(model, reference))
    _computed_off_loop(threads, model)


def test_whole_chat_speech_equals_the_finished_answer(served, reference):
    _, model, server = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    response = client.chat.completions.create(model="omnijax", messages=_question(model), max_tokens=MAX_TOKENS,
                                              modalities=["text", "audio"], audio=AUDIO | {"format": "wav"})
    samples, _ = read_wav(io.BytesIO(base64.b64decode(response.choices[0].message.audio.data)))
    assert response.choices[0].message.audio.transcript == reference[0]
    _close(np.round(samples * 32768).astype(np.int32), _want(model, reference))


def test_realtime_speech_order_and_pcm(served, reference, monkeypatch):
    """A Realtime response speaks while its answer is written (Qwen2.5-Omni: served with `speak_early`, the talker
    reading the answer's rows): its first audio delta comes before its last transcript delta, its PCM16 is the
    finished answer's within 1 LSB, and the event loop computes nothing."""
    _, model, server = served
    if not _qwen3(model):
        _hold_ticks_until_open(monkeypatch)
    threads = _spy_threads(monkeypatch)
    _, _, events = asyncio.run(asyncio.wait_for(_realtime(server, {"voice": "Chelsie"}), 600))
    _ordered([e.type for e in events], "response.output_audio.delta", "response.output_audio_transcript.delta",
             True)
    assert "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta") == reference[0]
    pcm = np.concatenate([np.frombuffer(base64.b64decode(e.delta), "<i2") for e in events
                          if e.type == "response.output_audio.delta"]).astype(np.int32)
    PCM[_qwen3(model), "realtime"] = pcm
    _close(pcm, _want(model, reference))
    assert events[-1].response.status in ("completed", "incomplete")
    _computed_off_loop(threads, model)


async def _collect(pieces) -> np.ndarray:
    return np.concatenate([pcm16(p) async for p in pieces]).astype(np.int32)


@pytest.mark.parametrize("served", ["qwen2_5_omni"], indirect=True)  # the family with two paths on one pool
def test_speech_spoken_early_equals_the_finish_first_path(served, reference, monkeypatch):
    """Qwen2.5-Omni served with `speak_early`: the streamed chat completion's and the Realtime response's speech (the
    talker reading the rows the decode programs return, as the tests above received it; run here when those did not
    run) equal the finished answer spoken on the same pool (`speech_engine.pool_pieces`, on the server's event loop:
    the talker input from one thinker forward over prompt and answer) bit for bit."""
    _, model, server = served
    if (False, "chat") not in PCM:
        test_streamed_chat_speech_order_and_pcm(served, reference, monkeypatch)
    if (False, "realtime") not in PCM:
        test_realtime_speech_order_and_pcm(served, reference, monkeypatch)
    _, prompt, answer = reference
    loop = server.context.worker._task.get_loop()  # the server's (the worker's futures and events live there)
    finished = asyncio.run_coroutine_threadsafe(_collect(speech_engine.pool_pieces(
        server.context, prompt, [int(t) for t in answer], "Chelsie")), loop).result(600)
    assert np.abs(finished).max() > 1000
    for route in ("chat", "realtime"):
        np.testing.assert_array_equal(PCM[False, route], finished, err_msg=route)


@pytest.mark.parametrize("served", ["qwen2_5_omni"], indirect=True)  # its utterances open at the answer's start
def test_a_speak_cancelled_while_its_utterance_opens_leaves_the_pool(served, monkeypatch):
    """An utterance's admission cancelled (a client gone, `response.cancel`) while the engine's thread runs the
    pool's `open`: the open completes there, and the utterance it opened for an answer still written (which nobody
    would extend or end: it would hold its row and pages for ever) leaves the pool."""
    _, _, server = served
    worker = server.context.worker
    pool = worker.engine.speech
    started, release, opened = threading.Event(), threading.Event(), []
    open_ = Qwen25SpeechPool.open

    def held_open(self, *args, **kwargs):
        started.set()
        assert release.wait(60)
        out = open_(self, *args, **kwargs)
        opened.append("opening" in self.sessions)
        return out
    monkeypatch.setattr(Qwen25SpeechPool, "open", held_open)
    prompt, _ = pool.warm_ids(16)

    async def cancel_while_opening():
        task = asyncio.ensure_future(worker.speak("opening", prompt, [], voice="Chelsie", max_new_tokens=8,
                                                  writing=True))
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = asyncio.get_running_loop().time() + 10
        while (not opened or "opening" in pool.sessions) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    loop = worker._task.get_loop()  # the server's (the worker's futures live there)
    asyncio.run_coroutine_threadsafe(cancel_while_opening(), loop).result(120)
    assert opened == [True]  # the open ran after the cancel, and opened the utterance
    assert "opening" not in pool.sessions and "opening" not in worker.speaking and pool.reserved == 0


@pytest.mark.parametrize("served", ["qwen2_5_omni"], indirect=True)
def test_a_realtime_response_cancelled_while_spoken_early_leaves_the_pool(served, reference):
    """`response.cancel` at the first transcript delta of a Realtime response spoken while written (its utterance
    opened when the response started, waiting for the answer's rows): the response ends "cancelled" before its
    answer does, and the utterance has left the speech pool by `response.done` (no row, page or stream left; it
    would otherwise wait for the rest of its answer for ever)."""
    _, _, server = served
    worker = server.context.worker
    pool = worker.engine.speech

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "audio": {"output": {"voice": "Chelsie"}}})
            assert (await conn.recv()).type == "session.updated"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": QUESTION25[0]["content"]}]})
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            types, sent = [], False
            async for event in conn:
                types.append(event.type)
                if event.type == "response.output_audio_transcript.delta" and not sent:
                    await conn.response.cancel()
                    sent = True
                if event.type == "response.done":
                    return types, event.response.status
        raise AssertionError("the connection closed before response.done")

    left: list = []
    real = speech_engine.WrittenSpeech.aclose

    async def aclose(self):  # what the pool still holds once the response's speech is closed
        await real(self)
        left.append((list(pool.sessions), pool.reserved, list(worker.speaking)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speech_engine.WrittenSpeech, "aclose", aclose)
        types, status = asyncio.run(asyncio.wait_for(run(), 600))
    assert status == "cancelled", types
    assert types.count("response.output_audio_transcript.delta") < len(reference[2]), types  # cut short
    assert left == [([], 0, [])], left


def test_an_unknown_voice_is_refused_by_name(served):
    """A voice the checkpoint lacks: HTTP 400 naming `audio.voice` and the checkpoint's voices, nothing fed or
    spoken."""
    _, model, server = served
    engine = server.context.worker.engine
    # An earlier test's Realtime session may still be closing on the engine (it leaves after its socket does), so
    # what is checked is that this request opened nothing, not that the engine is empty.
    before, speaking = set(engine.sessions), set(engine.speech.sessions)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="omnijax", messages=_question(model), max_tokens=MAX_TOKENS,
                                       modalities=["text", "audio"], audio=AUDIO | {"voice": "aiden"})
    body = e.value.body
    assert body["param"] == "audio.voice" and str(list(model.speech.voices)) in body["message"], body
    assert set(engine.sessions) <= before and set(engine.speech.sessions) <= speaking


@pytest.mark.parametrize("served", [QWEN3], indirect=True)  # only its talker draws
def test_audio_sampling_draws_the_seeded_speech(served, reference):
    """`audio.sampling` (an omnijax extension): the streamed speech (spoken while written) and the whole one are
    `speak(..., sampling=TalkerSampling(...))`'s, seeded; another seed speaks other speech, none the greedy one."""
    _, model, server = served
    drawn = {"seed": 3, "temperature": 0.8, "top_k": 30}
    kinds, _, pcm = asyncio.run(asyncio.wait_for(_streamed(server, AUDIO | {"sampling": drawn}), 600))
    want = _want(model, reference, TalkerSampling(**drawn))
    _close(pcm, want)
    assert want.shape != _want(model, reference).shape or np.abs(want - _want(model, reference)).max() > 100
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    other = client.chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=MAX_TOKENS,
                                           modalities=["text", "audio"], audio=AUDIO | {"sampling": {"seed": 4}})
    got = np.frombuffer(base64.b64decode(other.choices[0].message.audio.data), "<i2").astype(np.int32)
    want4 = _want(model, reference, TalkerSampling(seed=4))
    _close(got, want4)
    assert want4.shape != want.shape or np.abs(want4 - want).max() > 100


@pytest.mark.parametrize("served", [QWEN3], indirect=True)  # only its talker draws
@pytest.mark.parametrize("sampling, param, says", [
    ({"temprature": 0.5}, "audio.sampling.temprature", "did you mean 'temperature'"),
    ({"temperature": 0}, "audio.sampling.temperature", "temperature"),
    ({"top_p": 1.5}, "audio.sampling.top_p", "top_p"),
    ({"top_k": 2.5}, "audio.sampling.top_k", "an integer"),
    ({"seed": -1}, "audio.sampling.seed", "[0, 2147483647]"),
    ({"seed": True}, "audio.sampling.seed", "an integer"),
    (0.9, "audio.sampling", "must be an object"),
])
def test_bad_audio_sampling_is_refused_by_name(served, sampling, param, says):
    _, _, server = served
    engine = server.context.worker.engine
    before = list(engine.sessions)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=MAX_TOKENS,
                                       modalities=["text", "audio"], audio=AUDIO | {"sampling": sampling})
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == param and says in body["message"], body
    assert list(engine.sessions) == before and not engine.speech.sessions


async def _realtime(server, output: dict, bad: dict | None = None):
    """A Realtime session: `bad` (an `audio.output`) first, its error kept; then `output` and one spoken
    response. Returns (the error, the session.updated session, the response's events)."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        error = None
        if bad is not None:
            await conn.session.update(session={"type": "realtime", "audio": {"output": bad}})
            error = await conn.recv()
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "audio": {"output": output}})
        updated = await conn.recv()
        assert updated.type == "session.updated", updated
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": _question(server.context.model)[0]["content"]}]})
        await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
        events = []
        async for event in conn:
            assert event.type != "error", event
            events.append(event)
            if event.type == "response.done":
                return error, updated.session, events
    raise AssertionError("the connection closed before response.done")


@pytest.mark.parametrize("served", [QWEN3], indirect=True)  # only its talker draws
def test_realtime_audio_output_sampling_draws_the_seeded_speech(served, reference):
    """`session.audio.output.sampling` (the omnijax extension): echoed in the session, the response's speech is
    `speak(..., sampling=...)`'s; an unknown field is refused with an error event naming it, changing nothing."""
    _, model, server = served
    drawn = {"seed": 3, "temperature": 0.8, "top_k": 30}
    error, session, events = asyncio.run(asyncio.wait_for(_realtime(
        server, {"voice": "Chelsie", "sampling": drawn}, bad={"sampling": {"seed": 3, "top_kk": 4}}), 600))
    assert error.type == "error" and error.error.param == "session.audio.output.sampling.top_kk", error
    assert session.audio.output.model_extra["sampling"] == drawn
    pcm = np.concatenate([np.frombuffer(base64.b64decode(e.delta), "<i2") for e in events
                          if e.type == "response.output_audio.delta"]).astype(np.int32)
    _close(pcm, _want(model, reference, TalkerSampling(**drawn)))


async def _realtime_refusal(server, output: dict):
    """A Realtime session's `session.update` with `audio.output` `output`: (the error event, the session object a
    later `session.update` without it returns)."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "audio": {"output": output}})
        error = await conn.recv()
        await conn.session.update(session={"type": "realtime"})
        return error, (await conn.recv()).session


@pytest.mark.parametrize("served", ["qwen2_5_omni"], indirect=True)  # its talker draws nothing
def test_talker_sampling_is_refused_by_name_on_qwen25(served):
    """Qwen2.5-Omni's talker decodes greedily only (on the pool, early or finish-first, and in `Chat`): a chat
    completion's `audio.sampling` is refused with HTTP 400 (`unsupported`, naming it), a Realtime session's
    `session.audio.output.sampling` with an error event naming it, the session's settings unchanged; nothing fed or
    spoken."""
    _, _, server = served
    engine = server.context.worker.engine
    before = list(engine.sessions)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="omnijax", messages=QUESTION25, max_tokens=MAX_TOKENS,
                                       modalities=["text", "audio"], audio=AUDIO | {"sampling": {"seed": 3}})
    body = e.value.body
    assert body["param"] == "audio.sampling" and body["code"] == "unsupported", body
    assert "greedily only" in body["message"], body
    error, session = asyncio.run(asyncio.wait_for(_realtime_refusal(
        server, {"voice": "Chelsie", "sampling": {"seed": 3}}), 120))
    assert error.type == "error" and error.error.param == "session.audio.output.sampling", error
    assert "greedily only" in error.error.message and session.output_modalities == ["text"], (error, session)
    server.wait_idle()
    assert list(engine.sessions) == before and not engine.speech.sessions


def test_a_snapshot_keeps_the_talker_sampling():
    """`settings.output_sampling` round-trips through a snapshot's JSON meta; a bad one is refused naming it."""
    settings = rte.SessionSettings(output_modalities=("audio",), output_sampling=(("seed", 3), ("top_k", 30)))
    assert settings_of(json.loads(json.dumps(dataclasses.asdict(settings)))) == settings
    for bad in ([["seed", "3"]], [["top_kk", 3]], [["temperature", 0]]):
        with pytest.raises(ResumeRefused, match="settings.output_sampling"):
            settings_of(dataclasses.asdict(settings) | {"output_sampling": bad})
