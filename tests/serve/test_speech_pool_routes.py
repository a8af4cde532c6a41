"""The server's spoken answers on the engine's speech pool (`omnijax.serve.speech_engine`, Qwen3-Omni), through the
official `openai` SDK on the converted tiny Qwen3-Omni release of tests/serve/test_chat_completions_audio.py: the
served engine has a pool (`build_context`); two spoken chat completions at once both speak on it (some tick carries
both talkers) and each equals the answer spoken alone (`speech.speak`, within 1 LSB); with every row of a one-row
pool speaking, a spoken chat completion is refused with HTTP 429 naming the cap and a Realtime `response.create` for
audio with an `overloaded` error event, each changing nothing (no engine session left, the Realtime conversation
answers in text after); a spoken stream closed early leaves the pool (its pages return).
"""

import asyncio
import base64
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from omnijax.media.audio import pcm16  # noqa: E402
from omnijax.serve.app import BackgroundServer  # noqa: E402
from omnijax.serve.context import ServeContext, ServeOptions  # noqa: E402
from omnijax.serve.engine.engine import Engine, EngineConfig  # noqa: E402
from omnijax.serve.engine.speech import SpeechConfig, SpeechPool  # noqa: E402
from omnijax.serve.engine.worker import EngineWorker  # noqa: E402
from omnijax.serve.speech_engine import speech_config_for  # noqa: E402
from tests.chat.test_chat_speech import stream_config  # noqa: E402
from tests.serve import test_chat_completions_audio as cca  # noqa: E402

served, reference, MAX_TOKENS, QUESTION = cca.served, cca.reference, cca.MAX_TOKENS, cca.QUESTION
AUDIO = {"voice": "Chelsie", "format": "pcm16"}
LONG_SPEECH = 200  # talker tokens of the filler: the seeded talker never ends early, so it speaks ~200 ticks


def _async_client(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_the_served_engine_speaks_on_its_pool(served):
    """`build_context` gives a Qwen3-Omni engine a speech pool; a thinker-only checkpoint's engine has none."""
    _, model, mute, server = served
    assert speech_config_for(model, max_speech_tokens=12, context_tokens=1024) is not None
    assert speech_config_for(mute, max_speech_tokens=12, context_tokens=1024) is None
    assert _pool(server).config.max_pages == -(-(1024 + 12) // 64)  # a row holds the context and the speech


def test_two_spoken_answers_at_once_share_the_ticks_and_each_equals_it_alone(served, reference):
    """Two streamed spoken chat completions sent together: both complete, each PCM16 equal to `speak` alone within 1
    LSB, and the pool's ticks carried both talkers at once (more frames than talker steps). (Whether their vocoder
    chunks share a call depends on the tick each answer ended in; tests/serve/engine/test_speech_ticks.py checks
    that batching.)"""
    server = served[3]
    text, spoken = reference
    want = pcm16(spoken.pcm).astype(np.int32)

    async def one(client):
        stream = await client.chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                      modalities=["text", "audio"], audio=AUDIO, stream=True)
        transcript, data = [], []
        async for chunk in stream:
            audio = chunk.choices[0].delta.audio if chunk.choices else None
            if audio is not None and audio.transcript is not None:
                transcript.append(audio.transcript)
            if audio is not None and audio.data is not None:
                data.append(np.frombuffer(base64.b64decode(audio.data), "<i2"))
        return "".join(transcript), np.concatenate(data).astype(np.int32)

    async def both():
        client = _async_client(server)
        return await asyncio.gather(one(client), one(client))

    pool = _pool(server)
    before = dict(pool.stats)
    got = asyncio.run(asyncio.wait_for(both(), 600))
    after = pool.stats
    for got_text, pcm in got:
        assert got_text == text
        assert pcm.shape == want.shape and int(np.abs(pcm - want).max()) <= 1
    assert after["opened"] - before["opened"] == 2
    assert after["frames"] - before["frames"] > after["steps"] - before["steps"], "the talkers never shared a tick"
    assert not pool.sessions and pool.reserved == 0


def _pool(server) -> SpeechPool:
    pool = server.context.worker.engine.speech
    assert isinstance(pool, SpeechPool)
    return pool


@pytest.fixture(scope="module")
def tight(served):
    """A server of the same model whose speech pool holds one utterance, spoken answers of `LONG_SPEECH` tokens."""
    model = served[1]
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=8, max_speech_tokens=LONG_SPEECH,
                           queue_timeout_s=0.0)
    speech = SpeechConfig(rows=(1,), num_pages=32, page_size=64)
    engine = Engine(model, EngineConfig(stream_config(), chunk_tokens=64, frame_budget_s=0.2, buckets=(1, 2),
                                        speech=speech))
    with BackgroundServer(ServeContext(model, EngineWorker(engine), options)) as server:
        yield server


def _wait(predicate, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_full_pool_refuses_by_name_and_changes_nothing(tight):
    """A spoken stream holds the one row: a second spoken chat completion gets HTTP 429 naming the pool's cap, a
    Realtime `response.create` for audio an `overloaded` error naming it (the conversation then answers in text);
    no engine session is left behind. Closing the first stream early takes its utterance out of the pool."""
    server = tight
    pool, engine = _pool(server), server.context.worker.engine

    async def run():
        client = _async_client(server)
        stream = await client.chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                      modalities=["text", "audio"], audio=AUDIO, stream=True)
        async for chunk in stream:  # until the first speech: the utterance holds the pool's row
            if chunk.choices and chunk.choices[0].delta.audio is not None and chunk.choices[0].delta.audio.data:
                break
        assert len(pool.sessions) == 1
        sessions = list(engine.sessions)
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                 modalities=["text", "audio"], audio=AUDIO)
        body = e.value.body
        assert e.value.status_code == 429 and body["code"] == "overloaded" and body["param"] == "modalities", body
        assert "speech pool holds at most 1" in body["message"], body
        assert list(engine.sessions) == sessions and len(pool.sessions) == 1  # nothing fed, nothing left
        async with client.realtime.connect(model="omnijax") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": QUESTION[0]["content"]}]})
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS, "output_modalities": ["audio"]})
            error = None
            async for event in conn:
                if event.type == "error":
                    error = event
                    break
                assert not event.type.startswith("response."), event  # nothing started
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS, "output_modalities": ["text"]})
            async for event in conn:
                assert event.type != "error", event
                if event.type == "response.done":
                    done = event
                    break
        await stream.close()  # the filler's client goes: its utterance leaves the pool
        return error, done

    error, done = asyncio.run(asyncio.wait_for(run(), 600))
    assert error.error.code == "overloaded" and error.error.param == "response.output_modalities", error
    assert "speech pool holds at most 1" in error.error.message, error
    assert done.response.status in ("completed", "incomplete") and done.response.output_modalities == ["text"]
    # cancelled before its 200 talker tokens (read from this thread: wait for the close to finish too)
    _wait(lambda: not pool.sessions and int(pool.kv.num_free) == pool.config.num_pages, 600)
    assert pool.reserved == 0
    assert pool.stats["frames"] < LONG_SPEECH - 1, pool.stats
