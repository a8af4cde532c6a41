"""`omnijax serve` under ordinary traffic (issue: four idle sockets locked everyone out, a burst left the admission
cap cut for good, an abandoned request kept computing, SIGTERM waited for answers in flight): admission counts work
not sockets, the AIMD cap recovers on an idle server, chat completions queue briefly before a 429 with Retry-After,
an abandoned request is cancelled, SIGTERM ends in-flight answers at once, and heavy inputs never stall the event
loop (another session's frames and `/v1/models` keep their latency)."""

import asyncio
import base64
import dataclasses
import io
import json
import signal
import socket
import threading
import time
import wave

import numpy as np
import pytest

pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")
httpx = pytest.importorskip("httpx", reason="httpx (the openai SDK's HTTP client) is the test client")

from tests._support.demo_server import demo_server  # noqa: E402
from tests._support.served import Served  # noqa: E402

FRAME_MS = 250.0
SAMPLES = 4000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo model served in a background thread: one bucket of 4, two answer tokens per tick (so an answer of
    n tokens takes n / 2 ticks: long answers are easy to make). The engine is test_serve_server's, whose compiled
    programs the persistent cache then holds for both modules."""
    with demo_server(tmp_path_factory.mktemp("serve"), frame_ms=FRAME_MS, max_output_tokens=4000) as server:
        yield server


@pytest.fixture
def admission(served):
    """Installs an AIMD controller on the served worker for one test (and the options it sets), then removes it."""
    from omnijax.serve.engine.admission import AIMD

    served.wait_idle()
    context, worker = served.context, served.context.worker
    options, idle_after = context.options, worker.idle_after_s

    def install(*, options_=None, **aimd):
        worker.admission = AIMD(frame_budget_s=FRAME_MS / 1000, **aimd)
        if options_:
            context.options = dataclasses.replace(options, **options_)
        return worker.admission

    yield install
    worker.admission, worker.idle_after_s, context.options = None, idle_after, options
    served.wait_idle()


def _wait_for(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _chat(served, max_tokens=2, timeout=300.0, **extra):
    body = {"model": "omnijax", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    return httpx.post(served.base_url + "/chat/completions", json=body, timeout=timeout)


async def _idle_native(url, admitted: asyncio.Event, hold: asyncio.Event):
    """A native connection that says hello, is admitted (sets `admitted`), then sends nothing until `hold` is set."""
    from websockets.asyncio.client import connect

    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
        ready = json.loads(await asyncio.wait_for(ws.recv(), 30))
        admitted.set()
        await hold.wait()
        return ready


# ----------------------------------------------------------------------------------------------------- admission
def test_idle_connections_do_not_count_against_admission(served, admission):
    """Three idle native connections under an AIMD cap of 1: a chat completion is still admitted (it was a 429:
    every open socket counted), while one busy session does hold the cap."""
    admission(initial_cap=1, max_cap=1)
    served.context.worker.idle_after_s = 0.5

    async def scenario():
        hold, idle = asyncio.Event(), []
        for _ in range(3):  # one after another, as idle sockets accumulate
            admitted = asyncio.Event()
            idle.append(asyncio.create_task(_idle_native(served.native_url, admitted, hold)))
            await asyncio.wait_for(admitted.wait(), 30)
        await asyncio.sleep(0.6)  # past idle_after_s: none of them has had work
        response = await asyncio.to_thread(_chat, served)
        hold.set()
        return [await t for t in idle], response

    ready, response = asyncio.run(scenario())
    assert [r["type"] for r in ready] == ["ready"] * 3
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def test_chat_completions_queue_then_429_with_retry_after(served, admission):
    """Under a cap of 1 held by a long answer: a request with room in the queue waits and is served once the answer
    ends; one whose wait runs out, or that finds the queue full, gets a 429 with a whole-second Retry-After."""
    admission(initial_cap=1, max_cap=1, options_=dict(queue_timeout_s=60.0, max_queued=1))
    context = served.context
    results = {}
    long = threading.Thread(target=lambda: results.setdefault("long", _chat(served, max_tokens=300)))
    long.start()
    _wait_for(lambda: context.worker.lanes)
    queued = threading.Thread(target=lambda: results.setdefault("queued", _chat(served, max_tokens=2)))
    queued.start()
    _wait_for(lambda: context.queued == 1)  # waiting, not refused
    full = _chat(served)  # the queue (max_queued=1) is full: refused at once
    assert full.status_code == 429 and "max_queued" in full.json()["error"]["message"]
    assert int(full.headers["Retry-After"]) >= 1
    long.join(120)
    queued.join(120)
    assert results["long"].status_code == 200 and results["queued"].status_code == 200, results
    long_answer = results["long"].json()  # whole: the queued request neither preempted nor cut it
    assert long_answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert long_answer["usage"]["completion_tokens"] > 20

    context.options = dataclasses.replace(context.options, queue_timeout_s=0.3)
    long = threading.Thread(target=lambda: results.update(long=_chat(served, max_tokens=300)))
    long.start()
    _wait_for(lambda: context.worker.lanes)
    start = time.monotonic()
    late = _chat(served)
    waited = time.monotonic() - start
    long.join(120)
    assert late.status_code == 429 and late.json()["error"]["code"] == "overloaded"
    assert int(late.headers["Retry-After"]) == 1 and waited >= 0.3  # it waited its queue timeout first
    assert results["long"].status_code == 200


def test_the_admission_cap_recovers_on_an_idle_server(served, admission):
    """A burst that cut the cap to its floor: with no ticks the worker steps it back to its starting value (it
    stayed at 1 for good), and a request is admitted again."""
    aimd = admission(initial_cap=3, window=1)
    worker = served.context.worker
    recovery = worker.recovery_s
    for _ in range(3):
        aimd.step(10.0, current=3)
    assert aimd.cap == 1
    worker.recovery_s = 0.05
    try:
        deadline = time.monotonic() + 10
        while aimd.cap < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.recovery_s = recovery
    assert aimd.cap == 3 and [h["action"] for h in aimd.history[-2:]] == ["recover", "recover"]


# ------------------------------------------------------------------------------------------- abandoned, shutdown
@pytest.mark.parametrize("prompt_words", [1, 20_000])
def test_an_abandoned_request_is_cancelled(served, caplog, prompt_words):
    """A client that closes its socket while its request is served — a 3,000-token answer decoding, or a 20,000-word
    prompt still being fed (~3,000 ticks of chunks) — ends it: the session is closed within seconds (the answer used
    to decode to the end, and a cancelled answer's prompt was still fed whole, holding the client's session slot)."""
    import logging

    served.wait_idle()
    caplog.set_level(logging.INFO, logger="omnijax.serve")
    body = json.dumps({"model": "omnijax", "messages": [{"role": "user", "content": "word " * prompt_words}],
                       "max_tokens": 3000}).encode()
    worker = served.context.worker
    tokens_before = worker.stats["tokens"]
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if prompt_words > 1:  # its chunks are queued
            _wait_for(lambda: any(len(lane.pending) > 100 for lane in list(worker.lanes.values())))
        else:  # its answer decodes
            _wait_for(lambda: worker.stats["tokens"] - tokens_before >= 5)
    served.wait_idle(timeout_s=10)
    assert worker.stats["tokens"] - tokens_before < 3000
    assert any("the client went away" in r.getMessage() for r in caplog.records)
    assert not served.context.per_client  # the client's session slot is free


def test_sigterm_ends_answers_in_flight_and_exits_promptly(tmp_path):
    """`omnijax serve` with a 100,000-token answer decoding (12,500 ticks): SIGTERM answers it 503 at once and
    the process exits within seconds (uvicorn's graceful shutdown used to wait for the whole answer)."""
    # test_serve_cli's settings (its compiled programs are in the persistent cache), answers 8 tokens a tick
    server = Served("--frame-ms", "200", "--warmup-sessions", "2", "--max-output-tokens", "100000")
    try:
        result = {}
        body = {"model": "omnijax", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
        client = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(server.base_url + "/chat/completions", json=body, timeout=300)))
        client.start()
        time.sleep(3.0)  # the answer is decoding
        assert client.is_alive()
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        exit_s = time.monotonic() - start
        client.join(30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    # uvicorn re-raises the signal it caught once the server has stopped: the process ends by SIGTERM
    assert code in (0, -signal.SIGTERM) and exit_s < 15, (code, exit_s, server.log(10))
    assert result["r"].status_code == 503 and "shutting down" in result["r"].json()["error"]["message"]


# ----------------------------------------------------------------------------------------- the event loop is free
def _wav_b64(seconds: float, rate: int) -> str:
    pcm = (np.sin(np.arange(int(seconds * rate)) * 0.01) * 8000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(out.getvalue()).decode()


def _png_b64(side: int) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (120, 30, 200)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


HEAVY = {  # each is near a cap the server names: seconds of audio at the highest rate, parts, pixels
    "wav_384khz": lambda: [{"type": "input_audio", "input_audio": {"data": _wav_b64(8.0, 384_000), "format": "wav"}}],
    "256_text_parts": lambda: [{"type": "text", "text": "word " * 4}] * 256,
    "png_7000x7000": lambda: [{"type": "image_url",
                               "image_url": {"url": "data:image/png;base64," + _png_b64(7000)}}],
}


@pytest.mark.parametrize("heavy", sorted(HEAVY))
def test_heavy_inputs_leave_other_sessions_and_routes_responsive(served, heavy):
    """While one request's heavy input is decoded, resampled, templated and encoded (seconds of work), a native
    session streaming a frame every budget keeps its replies coming and `/v1/models` answers within a fraction of a
    second: that work runs on executors, never on the event loop."""
    from websockets.asyncio.client import connect

    served.wait_idle()
    content = HEAVY[heavy]()
    body = {"model": "omnijax", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    pcm = np.zeros(SAMPLES, "<i2").tobytes()

    async def scenario():
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=300) as client:
            async def probe_models():
                worst = 0.0
                while not stop.is_set():
                    t = time.perf_counter()
                    assert (await client.get(served.base_url + "/models")).status_code == 200
                    worst = max(worst, time.perf_counter() - t)
                    await asyncio.sleep(0.05)
                return worst

            async def stream_frames():
                gaps, last = [], None
                async with connect(served.native_url) as ws:
                    await ws.send(json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
                    assert json.loads(await ws.recv())["type"] == "ready"
                    while not stop.is_set():
                        await ws.send(pcm)
                        while True:
                            message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                            if message["type"] == "frame":
                                break
                        now = time.perf_counter()
                        gaps += [] if last is None else [now - last]
                        last = now
                        await asyncio.sleep(FRAME_MS / 1000)
                    await ws.send(json.dumps({"type": "bye"}))
                return gaps

            probes = [asyncio.create_task(probe_models()), asyncio.create_task(stream_frames())]
            await asyncio.sleep(1.0)
            start = time.perf_counter()
            response = await client.post(served.base_url + "/chat/completions", json=body)
            heavy_s = time.perf_counter() - start
            stop.set()
            worst_models, gaps = await asyncio.gather(*probes)
            return response, heavy_s, worst_models, gaps

    response, heavy_s, worst_models, gaps = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    # the heavy request took a while; the other clients kept going meanwhile
    assert worst_models < max(0.5, heavy_s / 4), (heavy, heavy_s, worst_models)
    assert len(gaps) >= 3 and max(gaps) < FRAME_MS / 1000 + max(1.0, heavy_s / 4), (heavy, heavy_s, gaps)
