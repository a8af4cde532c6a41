"""`omnijax serve` on converted tiny checkpoints of the other families (Qwen3-Omni thinker, MiniCPM-o 4.5), through
the official `openai` SDK: chat completions answer as `omnijax.Chat` does, and a Realtime session takes text, audio
and an image and answers."""

import asyncio
import base64
import io

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

import omnijax  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402

FRAME_MS = {"qwen3_omni": 200, "minicpmo": 1000}


def _qwen3(root):
    from tests._support import qwen3_omni_models as Q
    src = Q.save_thinker(Q.build_thinker(seed=3, scale=0.3, audio_overrides={"num_mel_bins": 128}), root / "hf")
    Q.write_tokenizer(src)
    return src


def _minicpmo(root):
    from tests._support import tiny_omni
    return tiny_omni.minicpmo_source(root)


def _stream_config():
    return omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=64, page_size=16,
                                max_answer_tokens=4)


@pytest.fixture(scope="module", params=["qwen3_omni", "minicpmo"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = {"qwen3_omni": _qwen3, "minicpmo": _minicpmo}[request.param](root)
    model = omnijax.load(convert_checkpoint(src, root / "omnijax", progress=False, log=lambda _: None))
    assert model.tokenizer is not None
    options = ServeOptions(port=0, frame_ms=FRAME_MS[request.param], max_output_tokens=8)
    context = build_context(model, options=options, stream=_stream_config(), chunk_tokens=64, buckets=(1, 2),
                            aimd_target=0)
    with BackgroundServer(context) as server:
        yield request.param, model, server


def _pcm_b64(seconds, rate=24000):
    t = np.arange(int(seconds * rate)) / rate
    return base64.b64encode((6000 * np.sin(2 * np.pi * 300 * t)).astype("<i2").tobytes()).decode()


def test_chat_completions_answer_as_chat(served):
    family, model, server = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="omnijax", messages=[{"role": "user", "content": "Describe it."}],
                                            max_tokens=6, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    chat = omnijax.Chat(model, _stream_config())
    assert text == "".join(chat.ask("Describe it.", max_tokens=6)), family


def test_realtime_text_audio_and_image(served):
    family, model, server = served
    from PIL import Image
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (64, 64, 3), np.uint8)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()

    async def scenario():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as conn:
            await conn.recv()
            done = []
            for step in ("text", "audio", "image"):
                if step == "text":
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_text", "text": "Hello"}]})
                elif step == "audio":
                    await conn.input_audio_buffer.append(audio=_pcm_b64(1.0))
                    await conn.input_audio_buffer.commit()
                else:
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_image", "image_url": url}]})
                await conn.response.create(response={"max_output_tokens": 3})
                async for event in conn:
                    assert event.type != "error", event
                    if event.type == "response.done":
                        done.append(event)
                        break
            return done

    done = asyncio.run(scenario())
    assert [d.response.status in ("completed", "incomplete") for d in done] == [True] * 3, family
    cells = [d.model_extra["omnijax"]["kv_cells"] for d in done]
    assert cells[0] < cells[1] < cells[2], (family, cells)
