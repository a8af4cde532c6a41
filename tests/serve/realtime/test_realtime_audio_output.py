"""The Realtime API's audio output (`output_modalities: ["audio"]`) from `omnijax serve` on a converted tiny
Qwen3-Omni full release, through the official `openai` SDK's realtime client: the transcript deltas, then the answer
spoken as base64 PCM16 deltas (one per vocoder chunk) whose concatenation is `speech.speak` of the talker prompt
transformers renders and the answer `omnijax.Chat` decodes, within 1 LSB; every audio event carrying exactly the
SDK's fields; each refusal an `error` event naming its field, the session unchanged.
"""

import asyncio
import base64
import io
import types

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

import PIL.Image  # noqa: E402
from openai.types import realtime as rt  # noqa: E402

import omnijax  # noqa: E402
from omnijax.chat import SpeakOptions  # noqa: E402
from omnijax.media.audio import pcm16  # noqa: E402
from omnijax.models.qwen3_omni import speech as S  # noqa: E402
from omnijax.serve import speech_output as so  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.realtime import client_events as rte  # noqa: E402
from omnijax.serve.realtime.audio_output import check_audio_output  # noqa: E402
from tests.chat.test_chat_speech import SPEECH_TOKENS, stream_config  # noqa: E402
from tests.serve import test_chat_completions_audio as cca  # noqa: E402

# the served tiny speaking release and the reference answer, as chat completions' audio tests build them
served, reference, MAX_TOKENS, QUESTION = cca.served, cca.reference, cca.MAX_TOKENS, cca.QUESTION

SPOKEN = {"type": "realtime", "output_modalities": ["audio"],
          "audio": {"output": {"voice": "Chelsie", "format": {"type": "audio/pcm", "rate": 24000}}}}
TURNS = ("Say hello.", "Once more.")
AUDIO_EVENTS = {"response.output_audio.delta": rt.ResponseAudioDeltaEvent,
                "response.output_audio.done": rt.ResponseAudioDoneEvent,
                "response.output_audio_transcript.delta": rt.ResponseAudioTranscriptDeltaEvent,
                "response.output_audio_transcript.done": rt.ResponseAudioTranscriptDoneEvent}


def _session(server, update: dict | None, **kwargs):
    return asyncio.wait_for(_run_session(server, update, **kwargs), 900)  # a lost response.done fails, not hangs


async def _run_session(server, update: dict | None, *, modalities: list | None = None, bad: list = ()):
    """A Realtime session: each of `bad` (session updates) sent first, its reply kept; then `update`, the question
    and one response (`modalities` its `output_modalities` when given). Returns (replies to `bad`, the session
    object after `update`, every event from `response.create` to `response.done`)."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        replies = []
        for session in bad:
            await conn.session.update(session=session)
            replies.append(await conn.recv())
        session_object = None
        if update is not None:
            await conn.session.update(session=update)
            updated = await conn.recv()
            assert updated.type == "session.updated", updated
            session_object = updated.session
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": QUESTION[0]["content"]}]})
        response: dict = {"max_output_tokens": MAX_TOKENS}
        if modalities is not None:
            response["output_modalities"] = modalities
        await conn.response.create(response=response)
        events = []
        async for event in conn:
            if event.type in ("conversation.item.added", "conversation.item.done") and event.item.role == "user":
                continue
            events.append(event)
            assert event.type != "error", event
            if event.type == "response.done":
                return replies, session_object, events
    raise AssertionError("the connection closed before response.done")


def _exact_fields(event) -> None:
    """The event has every field of its SDK model and no other (the SDK's models accept extra fields)."""
    model = AUDIO_EVENTS[event.type]
    assert isinstance(event, model)
    assert set(model.model_fields) <= event.model_fields_set and not event.model_extra, event


def test_a_spoken_response_streams_its_transcript_then_its_speech(served, reference):
    _, model, _, server = served
    text, spoken = reference
    _, session, events = asyncio.run(_session(server, SPOKEN))
    assert session.output_modalities == ["audio"]
    assert session.audio.output.voice == "chelsie" and session.audio.output.format.type == "audio/pcm"
    kinds = [e.type for e in events]
    n_text = kinds.count("response.output_audio_transcript.delta")
    n_audio = kinds.count("response.output_audio.delta")
    assert n_text >= 1 and n_audio >= 1
    assert kinds == (["response.created", "conversation.item.added"] + ["response.output_audio_transcript.delta"]
                     * n_text + ["response.output_audio.delta"] * n_audio
                     + ["response.output_audio.done", "response.output_audio_transcript.done",
                        "conversation.item.done", "response.done"]), kinds
    created, added, done = events[0], events[1], events[-1]
    item_id, rid = added.item.id, created.response.id
    for event in events[2:-2]:
        _exact_fields(event)
        assert (event.item_id, event.response_id, event.output_index, event.content_index) == (item_id, rid, 0, 0)
    assert "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta") == text
    assert events[-3].transcript == text  # response.output_audio_transcript.done
    item = events[-2].item
    assert item.id == item_id and item.role == "assistant" and len(item.content) == 1
    part = item.content[0]
    assert part.type == "output_audio" and part.transcript == text and part.audio is None
    assert done.response.output_modalities == ["audio"] and done.response.audio.output.voice == "chelsie"
    assert done.response.status in ("completed", "incomplete") and done.response.output[0].content[0].transcript == text
    chunks = [np.frombuffer(base64.b64decode(e.delta), "<i2") for e in events
              if e.type == "response.output_audio.delta"]
    # one delta per vocoder call: the server's first chunk, then its later chunks, the last what is left
    # (`--speech-first-chunk` / `--speech-chunk` of the served fixture, not the defaults)
    F = model.speech.code2wav.config.samples_per_frame
    frames, first, later = spoken.codes.shape[1], cca.FIRST, cca.LATER
    lag = first * F - chunks[0].shape[0]
    full = (frames - first - 1) // later
    assert frames > first + later, "too few frames to see the later chunks"
    assert 0 <= lag < F and [c.shape[0] for c in chunks] == \
        [first * F - lag] + [later * F] * full + [(frames - first - later * full) * F]
    got, want = np.concatenate(chunks).astype(np.int32), pcm16(spoken.pcm).astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1


def test_a_response_may_ask_for_speech_or_text_itself(served, reference):
    """`response.output_modalities` overrides the session's for one response: ["audio"] on a text session speaks
    (the same PCM), ["text"] on a spoken session answers in text events only."""
    server = served[3]
    text, spoken = reference
    _, _, events = asyncio.run(_session(server, None, modalities=["audio"]))
    got = np.concatenate([np.frombuffer(base64.b64decode(e.delta), "<i2") for e in events
                          if e.type == "response.output_audio.delta"]).astype(np.int32)
    assert np.abs(got - pcm16(spoken.pcm).astype(np.int32)).max() <= 1
    _, _, events = asyncio.run(_session(server, SPOKEN, modalities=["text"]))
    kinds = {e.type for e in events}
    assert "response.output_text.done" in kinds and not any("audio" in k for k in kinds), kinds
    assert events[-1].response.output_modalities == ["text"] and events[-1].response.output[0].content[0].text == text


@pytest.fixture(scope="module")
def two_turns(served):
    """The int32 PCM16 of `speak` on `Chat`'s prompt and answer ids after each of `TURNS`, asked in one `Chat`."""
    model = served[1]
    chat = omnijax.Chat(model, stream_config())
    want = []
    for question in TURNS:
        list(chat.ask(question, max_tokens=MAX_TOKENS, speak=SpeakOptions(voice="chelsie",
                                                                          max_speech_tokens=SPEECH_TOKENS)))
        last = chat.last_spoken
        want.append(pcm16(S.speak(model, np.asarray(last.prompt_ids), np.asarray(last.answer_ids),
                                  speaker="chelsie", max_new_tokens=SPEECH_TOKENS).pcm).astype(np.int32))
    assert want[0].shape != want[1].shape or np.abs(want[0] - want[1]).max() > 1  # two different utterances
    return want


async def _spoken_turn(conn, question: str) -> np.ndarray:
    """Asks `question` in a spoken session; the response's PCM16 (int32) once `response.done` came."""
    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": question}]})
    await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
    chunks = []
    async for event in conn:
        assert event.type != "error", event
        if event.type == "response.output_audio.delta":
            chunks.append(np.frombuffer(base64.b64decode(event.delta), "<i2"))
        if event.type == "response.done":
            return np.concatenate(chunks).astype(np.int32)
    raise AssertionError("the connection closed before response.done")


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and int(np.abs(got - want).max()) <= 1


def test_a_second_spoken_turn_reads_the_whole_conversation(served, two_turns):
    """The talker's prompt of a later response is every text id the session fed: both responses' PCM equal `speak`
    of `Chat`'s prompt and answer ids for the same two turns (within 1 LSB). (Qwen3-Omni's talker reads the system
    and user turns of its prompt, not earlier answers: dropping those from the prompt is not seen here.)"""
    server = served[3]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session=SPOKEN)
            return [await _spoken_turn(conn, question) for question in TURNS]

    got = asyncio.run(asyncio.wait_for(run(), 900))
    assert all(_close(g, w) for g, w in zip(got, two_turns))


def test_a_resumed_spoken_session_speaks_on(served, two_turns, tmp_path):
    """The snapshot keeps the text ids fed (`spoken` in its meta): a spoken session left after its first turn and
    resumed on a server with snapshots speaks its second turn as one unbroken session does."""
    model = served[1]
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=8, max_speech_tokens=SPEECH_TOKENS,
                           snapshot_dir=str(tmp_path / "snapshots"))
    context = build_context(model, options=options, stream=stream_config(), chunk_tokens=64, buckets=(1, 2),
                            aimd_target=0)

    async def run(server):
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            token = (await conn.recv()).session.model_extra["omnijax"]["resume_token"]
            await conn.session.update(session=SPOKEN)
            first = await _spoken_turn(conn, TURNS[0])
        async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.output_modalities == ["audio"], created
            return first, await _spoken_turn(conn, TURNS[1])

    with BackgroundServer(context) as server:
        got = asyncio.run(asyncio.wait_for(run(server), 900))
    assert all(_close(g, w) for g, w in zip(got, two_turns))


@pytest.mark.parametrize("session, code, param, says", [
    ({"audio": {"output": {"voice": "alloy"}}}, "invalid_value", "session.audio.output.voice", "['chelsie', 'ethan']"),
    ({"audio": {"output": {"voice": {"id": "voice_1"}}}}, "unsupported", "session.audio.output.voice",
     "custom voices"),
    ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, "unsupported", "session.audio.output.format.type",
     "audio/pcm"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "invalid_value",
     "session.audio.output.format.rate", "24000"),
    ({"audio": {"output": {"speed": 1.5}}}, "unsupported", "session.audio.output.speed", "own pace"),
    ({"output_modalities": ["audio", "text"]}, "invalid_value", "session.output_modalities", "[\"audio\"]"),
    ({"output_modalities": ["audio"], "tools": [{"type": "function", "name": "f", "parameters": {}}]},
     "unsupported", "session.output_modalities", "tools"),
])
def test_bad_audio_settings_are_refused_by_name_and_change_nothing(served, session, code, param, says):
    server = served[3]
    replies, _, events = asyncio.run(_session(server, None, bad=[{"type": "realtime", **session}]))
    (error,) = replies
    assert error.type == "error" and (error.error.code, error.error.param) == (code, param), error
    assert says in error.error.message, error.error.message
    kinds = {e.type for e in events}  # the session answers in text, as before the refused update
    assert "response.output_text.done" in kinds and not any("audio" in k for k in kinds), kinds


def test_a_checkpoint_without_a_talker_refuses_audio_output(served):
    mute = served[2]
    fake = types.SimpleNamespace(context=types.SimpleNamespace(model=mute),
                                 options=types.SimpleNamespace(model_name="omnijax"))
    for changes, param in (({"output_modalities": ("audio",)}, "session.output_modalities"),
                           ({"output_voice": "chelsie"}, "session.audio.output.voice"),
                           ({"output_format": "audio/pcm"}, "session.audio.output.format")):
        with pytest.raises(rte.RealtimeEventError) as e:
            check_audio_output(fake, rte.SessionSettings(**changes), None, changes)  # type: ignore[arg-type]
        assert (e.value.code, e.value.param) == ("unsupported", param) and "has no speech output" in e.value.message
    text_only = rte.SessionSettings()
    assert check_audio_output(fake, text_only, None, {}) is text_only  # type: ignore[arg-type]


def test_a_conversation_whose_media_outgrow_the_cap_is_not_spoken(served, monkeypatch):
    """An image in a user turn needs its thinker rows replayed (`speech_output.MediaReplay`, checked against Chat in
    `tests/serve/test_speech_media.py`); past the server's byte cap a spoken response is refused naming the
    modalities and the cap, and the session answers in text after it."""
    server = served[3]
    monkeypatch.setattr(so, "SPEECH_MEDIA_BYTES", 1000)  # read when the session opens
    png = io.BytesIO()
    PIL.Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session=SPOKEN)
            assert (await conn.recv()).type == "session.updated"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]})
            await conn.response.create(response={"max_output_tokens": 2})
            seen = []
            async for event in conn:
                seen.append(event)
                if event.type == "error":
                    break
            kinds = [e.type for e in seen]  # the item's .done comes once it is fed, maybe after the refusal
            assert kinds[0] == "conversation.item.added" and kinds[-1] == "error" and len(kinds) <= 3, seen
            await conn.response.create(response={"max_output_tokens": 2, "output_modalities": ["text"]})
            async for event in conn:
                assert event.type != "error", event
                if event.type == "response.done":
                    return seen[-1], event
        raise AssertionError("the connection closed early")

    error, done = asyncio.run(asyncio.wait_for(run(), 900))
    assert error.error.param == "session.output_modalities" and "cap of 1000 bytes" in error.error.message, error
    assert done.response.output_modalities == ["text"] and done.response.status in ("completed", "incomplete")


def test_a_cancel_while_speaking_stops_the_speech(served, reference):
    """`response.cancel` sent when the first audio delta arrives: the next vocoder chunk (7 more talker steps and a
    vocoder call, far longer than the cancel's trip over loopback) is not sent, the audio and transcript still end
    (`.done` events), and the response is "cancelled" with its whole transcript."""
    server = served[3]
    text, spoken = reference

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session=SPOKEN)
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": QUESTION[0]["content"]}]})
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            events, cancelled = [], False
            async for event in conn:
                assert event.type != "error", event
                events.append(event)
                if event.type == "response.output_audio.delta" and not cancelled:
                    await conn.response.cancel()
                    cancelled = True
                if event.type == "response.done":
                    return events
        raise AssertionError("the connection closed before response.done")

    events = asyncio.run(asyncio.wait_for(run(), 900))
    kinds = [e.type for e in events]
    assert kinds.count("response.output_audio.delta") == 1, kinds
    assert kinds[-4:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "conversation.item.done", "response.done"], kinds
    done = events[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "client_cancelled", done
    assert events[-3].transcript == text and done.output[0].status == "incomplete"
