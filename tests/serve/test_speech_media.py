"""Spoken answers about media from `omnijax serve` (Qwen3-Omni): chat completions with an image and an audio clip in a
user turn and `modalities: ["text", "audio"]`, and a Realtime session with an image item, input audio and a spoken
response, both through the official `openai` SDK, against `omnijax.Chat` speaking the same conversation (whose rows,
prompt and waveform `tests/chat/test_chat_speech_media.py` checks against transformers' `generate(return_audio=True)`):
the same text, the PCM16 within 1 LSB (float PCM within ~1e-5 of the peak). The server recomputes the rows the talker
reads (`speech_output.MediaReplay`): checked against Chat's kept rows directly, and its byte cap refused by name.
"""

import asyncio
import base64
import io
import warnings

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

import PIL.Image  # noqa: E402

import omnijax  # noqa: E402
from omnijax.chat import SpeakOptions  # noqa: E402
from omnijax.conversation import Conversation  # noqa: E402
from omnijax.media.audio import pcm16, wav_bytes  # noqa: E402
from omnijax.models.qwen3_omni import frontend as F  # noqa: E402
from omnijax.serve import speech_output as so  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.realtime.audio_output import SpokenIds  # noqa: E402
from tests.chat import test_chat_speech_media as CM  # noqa: E402
from tests.chat.test_chat_speech import stream_config  # noqa: E402

release = CM.release  # the seeded tiny full Qwen3-Omni with media ids in its talker config (module fixture)
SYSTEM, LOOK, QUESTION, SPEECH_TOKENS, MAX_TOKENS = CM.SYSTEM, CM.LOOK, CM.QUESTION, CM.SPEECH_TOKENS, 6
CLIP16 = np.round(F.tone(1.0, 330.0, seed=5) * 16000).astype(np.int16)  # 1 s at 16 kHz, exact as WAV
CLIP24 = np.round(F.tone(0.5, 330.0, seed=7, sample_rate=24000) * 16000).astype(np.int16)  # 0.5 s at 24 kHz
FRAME_MS = 200
VOICE = "Ethan"


@pytest.fixture(scope="module")
def served(release):
    _, _, model = release
    options = ServeOptions(port=0, frame_ms=FRAME_MS, max_output_tokens=8, max_speech_tokens=SPEECH_TOKENS)
    context = build_context(model, options=options, stream=stream_config(), chunk_tokens=64, buckets=(1, 2),
                            aimd_target=0)
    with warnings.catch_warnings(), BackgroundServer(context) as server:
        warnings.simplefilter("ignore", UserWarning)
        yield model, context, server


def _png_url(image):
    out = io.BytesIO()
    PIL.Image.fromarray(image).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _chat_speech(model, feed):
    """`Chat`'s answer to QUESTION after `feed(chat)`: (text, float PCM, last_spoken)."""
    chat = omnijax.Chat(model, stream_config())
    feed(chat)
    items = list(chat.ask(QUESTION, max_tokens=MAX_TOKENS,
                          speak=SpeakOptions(voice=VOICE, max_speech_tokens=SPEECH_TOKENS,
                                             first_chunk=so.FIRST_CHUNK, chunk=so.CHUNK)))
    text = "".join(i for i in items if isinstance(i, str))
    pcm = np.concatenate([i for i in items if not isinstance(i, str)])
    assert np.abs(pcm).max() > 0.05, "the reference waveform is (near) silent: the test would prove nothing"
    assert chat.last_spoken.media, "the reference conversation keeps no media rows: the test would prove nothing"
    return text, pcm, chat.last_spoken


def _completions_feed(chat):
    chat.system(SYSTEM)
    chat.user(LOOK)
    chat.image(CM.IMAGE)
    chat.audio(CLIP16.astype(np.float32) / 32768, 16000)


MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [
                {"type": "text", "text": LOOK}, {"type": "image_url", "image_url": {"url": _png_url(CM.IMAGE)}},
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(CLIP16, 16000)).decode(),
                                                        "format": "wav"}}]},
            {"role": "user", "content": QUESTION}]


def _assert_pcm16(got, want_float):
    want = pcm16(want_float).astype(np.int32)
    assert got.shape == want.shape
    assert np.abs(got.astype(np.int32) - want).max() <= 1  # float PCM within ~1e-8: a rounding may flip one LSB


def test_the_replayed_rows_are_chats_kept_rows(release):
    """`MediaReplay` over the engine's parts (split at the engine's chunk length) gives `Chat`'s kept rows."""
    _, _, model = release
    _, _, spoken = _chat_speech(model, _completions_feed)
    conversation = Conversation(model, model.tokenizer, 8)  # 8-token parts: the image and the clip come in several
    parts = conversation.message("system", SYSTEM) + conversation.message("user", LOOK)
    parts += conversation.image(CM.IMAGE) + conversation.audio(CLIP16.astype(np.float32) / 32768)
    parts += conversation.message("user", QUESTION) + conversation.prompt(4).parts
    replay = so.MediaReplay(model, stream_config(), 64)
    replay.fed(parts)
    assert replay.ids == list(spoken.prompt_ids) and replay.needs_replay
    rows = replay.rows()
    assert [(r.grid, r.layer) for r in rows] == [(m.grid, m.layer) for m in spoken.media]
    for got, want in zip(rows, spoken.media):
        np.testing.assert_array_equal(got.positions, want.positions)
        peak = np.abs(want.rows).max()
        np.testing.assert_allclose(got.rows, want.rows, rtol=0, atol=2e-5 * peak)
    capped = so.MediaReplay(model, stream_config(), 64, cap=1000)
    capped.fed(parts)
    assert capped.unspeakable is not None and "outgrew the server's cap of 1000 bytes" in capped.unspeakable
    with pytest.raises(ValueError, match="SPEECH_MEDIA_BYTES"):
        capped.rows()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_speak_about_an_image_and_audio_as_chat_does(served, stream):
    model, _, server = served
    text, pcm, _ = _chat_speech(model, _completions_feed)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    kwargs = dict(model="omnijax", messages=MESSAGES, max_tokens=MAX_TOKENS, modalities=["text", "audio"],
                  audio={"voice": VOICE.lower(), "format": "pcm16"})
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.content is None and message.audio.transcript == text
        _assert_pcm16(np.frombuffer(base64.b64decode(message.audio.data), "<i2"), pcm)
        return
    transcript, data = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        audio = chunk.choices[0].delta.audio if chunk.choices else None
        if audio is not None and audio.transcript is not None:
            transcript.append(audio.transcript)
        if audio is not None and audio.data is not None:
            data.append(np.frombuffer(base64.b64decode(audio.data), "<i2"))
    assert "".join(transcript) == text and len(data) >= 2  # the first vocoder chunk, then the rest
    _assert_pcm16(np.concatenate(data), pcm)


def test_media_past_the_servers_cap_is_refused_by_name(served, monkeypatch):
    server = served[2]
    monkeypatch.setattr(so, "SPEECH_MEDIA_BYTES", 1000)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="omnijax", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"})
    assert e.value.body["param"] == "messages" and "cap of 1000 bytes" in e.value.body["message"], e.value.body
    monkeypatch.undo()
    answer = client.chat.completions.create(model="omnijax", messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].message.content is not None  # the server serves on


async def _realtime(server):
    """A spoken Realtime session: instructions, a user item with text and an image, input audio (committed), the
    question, one response; returns (transcript, PCM16 of the audio deltas)."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "instructions": SYSTEM, "output_modalities": ["audio"],
            "audio": {"output": {"voice": VOICE, "format": {"type": "audio/pcm", "rate": 24000}}}})
        assert (await conn.recv()).type == "session.updated"
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": LOOK}, {"type": "input_image", "image_url": _png_url(CM.IMAGE)}]})
        await conn.input_audio_buffer.append(audio=base64.b64encode(CLIP24.tobytes()).decode())
        await conn.input_audio_buffer.commit()
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": QUESTION}]})
        await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
        return await _spoken_response(conn)


async def _spoken_response(conn) -> tuple[str, np.ndarray]:
    """The transcript and PCM16 of the spoken response in flight, read up to its `response.done`."""
    transcript, data = [], []
    async for event in conn:
        assert event.type != "error", event
        if event.type == "response.output_audio_transcript.delta":
            transcript.append(event.delta)
        elif event.type == "response.output_audio.delta":
            data.append(np.frombuffer(base64.b64decode(event.delta), "<i2"))
        elif event.type == "response.done":
            assert event.response.status in ("completed", "incomplete"), event.response
            return "".join(transcript), np.concatenate(data)
    raise AssertionError("the connection closed before response.done")


def test_a_realtime_session_speaks_about_an_image_and_input_audio_as_chat_does(served):
    model, _, server = served
    frame = 24000 * FRAME_MS // 1000

    def feed(chat):
        chat.system(SYSTEM)
        chat.user(LOOK)
        chat.image(CM.IMAGE)
        for start in range(0, CLIP24.size, frame):  # the server feeds each 200 ms frame as its own audio unit
            piece = np.zeros(frame, np.int16)
            piece[:min(frame, CLIP24.size - start)] = CLIP24[start:start + frame]
            chat.audio(piece.astype(np.float32) / 32768, 24000)

    text, pcm, spoken = _chat_speech(model, feed)
    assert len(spoken.media) == 1 + -(-CLIP24.size // frame)  # the image and each audio frame keep rows
    got_text, got = asyncio.run(asyncio.wait_for(_realtime(server), 900))
    assert got_text == text
    _assert_pcm16(got, pcm)


def test_a_resumed_realtime_conversation_with_media_rows_is_unspeakable_by_name(served):
    """A snapshot keeps the ids fed, not the media a replay needs: a resumed conversation whose user turns hold
    media is refused by name; one whose media lie outside user turns still speaks."""
    model, context, _ = served
    conversation = Conversation(model, model.tokenizer, 64)
    ids = SpokenIds(context, conversation.units)
    ids.fed(conversation.message("system", SYSTEM) + conversation.audio(CLIP16.astype(np.float32) / 32768))
    assert ids.unspeakable is None and not ids.replay.needs_replay  # audio after the system turn: no rows read
    saved = (tuple(ids.ids), None)
    ids.fed(conversation.message("user", LOOK) + conversation.image(CM.IMAGE))
    assert ids.unspeakable is None and ids.replay.needs_replay
    with_rows = (tuple(ids.ids), None)
    for snapshot, speakable in ((saved, True), (with_rows, False)):
        resumed = SpokenIds(context, conversation.units)
        resumed.restore(snapshot)
        assert (resumed.unspeakable is None) == speakable, resumed.unspeakable
    resumed = SpokenIds(context, conversation.units)
    resumed.restore(saved)
    resumed.fed(conversation.message("user", LOOK) + conversation.image(CM.IMAGE))
    assert "resumed from a snapshot" in resumed.unspeakable


def test_media_after_an_answer_are_replayed_over_the_answer(served):
    """A Realtime conversation whose image comes in the second turn: the replay feeds the first answer (a response
    unit of its decoded tokens) before the image, so the rows and the speech equal `Chat`'s, whose first answer was
    written by its decoding."""
    model, _, server = served
    turn = "And this?"

    def feed(chat):
        chat.system(SYSTEM)
        list(chat.ask(LOOK, max_tokens=MAX_TOKENS))
        chat.user(turn)
        chat.image(CM.IMAGE)

    text, pcm, spoken = _chat_speech(model, feed)
    assert len(spoken.media) == 1 and len(spoken.prompt_ids) > int(spoken.media[0].positions[0]) > 0

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session={"type": "realtime", "instructions": SYSTEM,
                                               "output_modalities": ["text"], "audio": {"output": {"voice": VOICE}}})
            assert (await conn.recv()).type == "session.updated"
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": LOOK}]})
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            async for event in conn:
                assert event.type != "error", event
                if event.type == "response.done":
                    break
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": turn}, {"type": "input_image", "image_url": _png_url(CM.IMAGE)}]})
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": QUESTION}]})
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS, "output_modalities": ["audio"]})
            return await _spoken_response(conn)

    got_text, got = asyncio.run(asyncio.wait_for(run(), 900))
    assert got_text == text
    _assert_pcm16(got, pcm)
