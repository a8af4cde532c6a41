"""What tests/serve/realtime/test_openai_server.py and test_chat_completions_video.py drive `omnijax serve` with: the
server itself (`tiny_server`), its stream settings (`stream_config`: what `omnijax.Chat`, the oracle, uses with
`Greedy`), the official `openai` SDK's clients with the
test key, `omnijax.Chat`'s answer to compare with, and readers of a Realtime connection's events."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import numpy as np
import openai

import omnijax
from omnijax.decoding import Greedy, RowSampling
from omnijax.models.family import OmniModel
from omnijax.retention import SinkWindow
from omnijax.serve.app import BackgroundServer, build_context
from omnijax.serve.context import ServeOptions

KEY = "test-key"
TAU = 8


def stream_config(decoding=None):
    """The server's settings; it decodes with RowSampling (as `omnijax serve` does: per-request temperature, top-p
    and seed; greedy by default), `omnijax.Chat`'s oracle with Greedy."""
    return omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=96, page_size=16,
                                max_answer_tokens=TAU, decoding=decoding or Greedy())


@contextlib.contextmanager
def tiny_server(model: OmniModel) -> Iterator:
    """`omnijax serve` of `model` on a free port with the test key, as the modules driving it through the SDK run
    it (RowSampling, 32-token chunks, buckets 1/2/4, no AIMD): a `BackgroundServer` while the block runs."""
    options = ServeOptions(port=0, api_key=KEY, frame_ms=200, max_output_tokens=24, max_audio_buffer_s=2.0,
                           max_sessions_per_client=8)
    context = build_context(model, options=options, stream=stream_config(RowSampling()), chunk_tokens=32,
                            buckets=(1, 2, 4), aimd_target=0)
    with BackgroundServer(context) as running:
        yield running


def sdk_client(server, key=KEY, **kwargs):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, **kwargs)


def sdk_async_client(server, key=KEY):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def chat_answer(model, system, user, max_tokens):
    chat = omnijax.Chat(model, stream_config())
    if system:
        chat.system(system)
    return "".join(chat.ask(user, max_tokens=max_tokens))


async def until(conn, kind, seen=None):
    """Events up to and including the first of type `kind`."""
    events = []
    async for event in conn:
        events.append(event)
        if seen is not None:
            seen.append(event.type)
        if event.type == kind:
            return events
    raise AssertionError(f"the connection closed before {kind}")


def response_text(events):
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done").text
    final = next(e for e in events if e.type == "response.done").response
    assert deltas == done == final.output[0].content[0].text
    return done, final


def pcm_b64(seconds, rate=24000, amplitude=8000):
    t = np.arange(int(seconds * rate)) / rate
    return base64.b64encode((amplitude * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes()).decode()
