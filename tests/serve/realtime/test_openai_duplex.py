"""MiniCPM-o 4.5 full duplex over `/v1/realtime` through the official `openai` SDK: the responses the server streams
are the spoken turns `DuplexSession` decides on the same audio and frame, and what a duplex session refuses."""

import asyncio
import base64
import io
import json
import shutil

import numpy as np
import pytest

openai = pytest.importorskip("openai")

import omnijax  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.media.audio import resample  # noqa: E402
from omnijax.media.image import read_image  # noqa: E402
from omnijax.models.minicpmo.duplex import DuplexTokens  # noqa: E402
from omnijax.models.tokenizer import MINICPMO_4_5_TEMPLATE, write_tiny_tokenizer  # noqa: E402
from omnijax.retention import NoSlide  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.engine.duplex import speak_ids  # noqa: E402
from omnijax.serve.loadgen import speech_like_pcm  # noqa: E402
from omnijax.serve.realtime.duplex import duplex_rule  # noqa: E402
from omnijax.streaming.duplex import DuplexSession  # noqa: E402
from tests._support import DATA  # noqa: E402

GOLDEN = DATA / "minicpmo45"
INSTRUCTIONS = "You are a helpful duplex assistant."
UNITS, FRAME_UNIT = 4, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("duplex")
    src = root / "hf"
    shutil.copytree(GOLDEN / "checkpoint", src)
    specials = json.loads((GOLDEN / "info.json").read_text())["special_token_ids_tiny"]
    write_tiny_tokenizer(src, vocab_size=2048, special_tokens=specials, chat_template=MINICPMO_4_5_TEMPLATE)
    return omnijax.load(convert_checkpoint(src, root / "omnijax", progress=False, log=lambda _: None))


@pytest.fixture(scope="module")
def server(model):
    stream = omnijax.StreamConfig(policy=NoSlide(), num_pages=32, page_size=32, max_answer_tokens=0)
    context = build_context(model, options=ServeOptions(port=0, frame_ms=1000), stream=stream, chunk_tokens=128,
                            buckets=(1, 2), aimd_target=0, return_logits=True)
    with BackgroundServer(context) as running:
        yield running


def _inputs():
    from PIL import Image
    pcm24 = (speech_like_pcm(UNITS * 1.5, seed=4)[:UNITS * 24000]).astype("<i2")  # 4 s at "24 kHz"
    frame = np.load(GOLDEN / "case4_duplex.npz")["frame0_uint8"]
    png = io.BytesIO()
    Image.fromarray(frame).save(png, "PNG")
    return pcm24, png.getvalue()


def _reference(model, pcm24, png):
    """The spoken turns DuplexSession decides: each a list of token ids, ended by a unit that listens."""
    tokenizer = model.tokenizer
    session = DuplexSession(model, rule=duplex_rule(model), tokens=DuplexTokens.of(model), num_pages=32,
                            page_size=32, chunk_width=128)
    session.prepare(tokenizer.encode(tokenizer.render([{"role": "system", "content": INSTRUCTIONS}])), [])
    frame = read_image(png)
    turns, current = [], None
    for u in range(UNITS):
        pcm = resample(pcm24[u * 24000:(u + 1) * 24000].astype(np.float32) / 32768.0, 24000)
        result = session.step(pcm, frame if u == FRAME_UNIT else None)
        ids = speak_ids(result, frozenset(DuplexTokens.of(model).__dict__.values()) | set(duplex_rule(model).stop))
        if ids and current is None:
            current = []
        if current is not None:
            current += ids
            if result.listened:
                turns.append(current)
                current = None
    return turns, current


def test_duplex_session_streams_the_turns_duplex_session_decides(server, model):
    pcm24, png = _inputs()

    async def scenario():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "instructions": INSTRUCTIONS,
                                               "omnijax": {"duplex": True}})
            updated = await conn.recv()
            assert updated.type == "session.updated" and updated.session.model_extra["omnijax"]["duplex"]
            for u in range(UNITS):
                if u == FRAME_UNIT:  # the next unit's video frame
                    url = "data:image/png;base64," + base64.b64encode(png).decode()
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_image", "image_url": url}]})
                for half in range(2):  # audio arrives in halves of a unit
                    part = pcm24[u * 24000 + half * 12000:u * 24000 + (half + 1) * 12000]
                    await conn.input_audio_buffer.append(audio=base64.b64encode(part.tobytes()).decode())
            await conn.send({"type": "response.create"})  # refused: the model decides when to speak
            await conn.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                          "content": [{"type": "input_text",
                                                                                       "text": "hi"}]}})
            await conn.input_audio_buffer.commit()  # answered once the four units are
            events = []
            async for event in conn:
                events.append(event)
                if event.type == "input_audio_buffer.committed":
                    return events

    events = asyncio.run(scenario())
    errors = [e for e in events if e.type == "error"]
    assert [e.error.code for e in errors] == ["unsupported", "unsupported"]
    turns, open_turn = _reference(model, pcm24, png)
    tokenizer = model.tokenizer
    done = [e for e in events if e.type == "response.done"]
    texts = [e.response.output[0].content[0].text for e in done]
    assert texts == [tokenizer.decode(t, skip_special_tokens=True) for t in turns]
    assert [e.response.usage.output_tokens for e in done] == [len(t) for t in turns]
    created = [e for e in events if e.type == "response.created"]
    assert len(created) == len(turns) + (open_turn is not None)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    spoken = sum(turns, []) + (open_turn or [])
    assert len(spoken) >= 3, "the tiny model speaks in these four units"
    assert streamed == tokenizer.decode(spoken, skip_special_tokens=True)


def test_duplex_is_refused_where_it_cannot_run(server):
    async def scenario():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.input_audio_buffer.append(audio=base64.b64encode(bytes(4800)).decode())
            await conn.session.update(session={"type": "realtime", "omnijax": {"duplex": True}})
            late = await conn.recv()
            return late

    late = asyncio.run(scenario())
    assert late.type == "error" and late.error.code == "unsupported" and "before any input" in late.error.message


def test_native_duplex_answers_each_unit_as_duplex_session(server, model):
    from websockets.asyncio.client import connect

    pcm24, png = _inputs()
    pcm16 = [(32767 * resample(pcm24[u * 24000:(u + 1) * 24000].astype(np.float32) / 32768.0, 24000)).astype("<i2")
             for u in range(UNITS)]

    async def scenario():
        url = server.base_url.replace("http://", "ws://").replace("/v1", "/session")
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "hello", "duplex": True, "instructions": INSTRUCTIONS}))
            ready = json.loads(await ws.recv())
            assert ready["type"] == "ready" and ready["frame_samples"] == 16000
            for u in range(UNITS):
                if u == FRAME_UNIT:
                    await ws.send(json.dumps({"type": "image", "data": base64.b64encode(png).decode()}))
                await ws.send(pcm16[u].tobytes())
            await ws.send(json.dumps({"type": "bye"}))
            return [json.loads(m) async for m in ws]

    replies = asyncio.run(scenario())
    assert [r["seq"] for r in replies] == list(range(UNITS))
    tokenizer = model.tokenizer
    session = DuplexSession(model, rule=duplex_rule(model), tokens=DuplexTokens.of(model), num_pages=32,
                            page_size=32, chunk_width=128)
    session.prepare(tokenizer.encode(tokenizer.render([{"role": "system", "content": INSTRUCTIONS}])), [])
    markers = frozenset(DuplexTokens.of(model).__dict__.values()) | set(duplex_rule(model).stop)
    for u, reply in enumerate(replies):
        result = session.step(pcm16[u].astype(np.float32) / 32768.0, read_image(png) if u == FRAME_UNIT else None)
        assert reply["tokens"] == speak_ids(result, markers) and reply["listened"] == result.listened, u
    assert sum(len(r["tokens"]) for r in replies) >= 3
