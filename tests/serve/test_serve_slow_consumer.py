"""Clients that do not read, and clients that say nothing (issue 35 item 5): the outbox of a WebSocket client is capped
in bytes as well as in events (a Realtime echo of a large image item is megabytes; the old cap counted 1024 events, so
a client that never read made the server hold every echo), and a native `/session` connection idles out like a
Realtime one."""

import asyncio
import base64
import dataclasses
import io
import json
import logging
import socket
import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

from omnijax.serve import server as srv  # noqa: E402
from omnijax.serve.native.protocol import ProtocolError  # noqa: E402
from omnijax.serve.outbox import Outbox  # noqa: E402
from tests._support.demo_server import demo_server  # noqa: E402
from tests._support.refusal_log import fresh_refusal_log  # noqa: E402, F401  (autouse: a fresh log per test)

FRAME_MS = 250.0
CAP = 2 * 2 ** 20  # the test server's max_outbox_bytes


@pytest.fixture(scope="module")
def served():
    """The demo model (with its vision encoder) served in a background thread, its outboxes capped at 2 MiB."""
    with demo_server(frame_ms=FRAME_MS, max_output_tokens=6,
                     max_outbox_bytes=CAP) as server:
        yield server


def _png_with_tail(tail_bytes: int) -> bytes:
    """A 32x32 PNG followed by `tail_bytes` random bytes (readers stop at IEND): a large image item that costs
    nothing to decode or encode."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue() + np.random.default_rng(2).bytes(tail_bytes)


def _item(png: bytes) -> str:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url}]}})


def _wait_for(condition, timeout_s=60.0, what="a condition"):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _good_realtime_turn(url: str) -> dict:
    """A well-behaved Realtime client: one text item and a response; returns its response.done."""
    from websockets.sync.client import connect

    with connect(url, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        while (event := json.loads(ws.recv(timeout=60)))["type"] != "response.done":
            assert event["type"] != "error", event
        return event


def test_a_client_that_never_reads_is_dropped_by_bytes_while_others_are_served(served, monkeypatch, caplog):
    """Image items of 1.5 MB each, whose every echo (conversation.item.added and .done carry the image back, as the
    Realtime API does) would pile up unread: the session's outbox holds at most its 2 MiB cap, the client is dropped
    as a slow consumer (engine session freed; when it reads again it finds the `slow_consumer` error and close 1008),
    and a well-behaved client is served throughout. The old outbox counted events only (1024): it held every echo."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from omnijax.serve.realtime import session as realtime

    sessions = []

    class Recorded(realtime.RealtimeSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.added = 0
            sessions.append(self)

        def send(self, event):
            self.added += event["type"] == "conversation.item.added"
            super().send(event)

    monkeypatch.setattr(realtime, "RealtimeSession", Recorded)
    caplog.set_level(logging.INFO, logger="omnijax.serve")
    served.wait_idle()
    url = f"ws://127.0.0.1:{served.port}/v1/realtime"
    item = _item(_png_with_tail(1_100_000))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's kernel holds little for it
    sock.connect(("127.0.0.1", served.port))
    with connect(url, sock=sock, max_size=None, max_queue=1) as slow:  # reads one event, then stops reading
        _wait_for(lambda: sessions, what="the slow session")
        mine = sessions[0]
        good = {}
        other = threading.Thread(target=lambda: good.update(_good_realtime_turn(url)))
        other.start()
        sent = 0
        while mine.outbox.overflow is None and sent < 40:  # each item is sent once the last one was echoed
            slow.send(item)
            sent += 1
            _wait_for(lambda: mine.added >= sent or mine.outbox.overflow is not None, what="the echo")
        assert mine.outbox.overflow is not None, f"{sent} items of {len(item):,} bytes never overflowed the outbox"
        assert "bytes of events would pile up unread" in mine.outbox.overflow
        assert CAP // 2 < mine.outbox.peak_bytes <= CAP  # it filled up, and never past the cap
        _wait_for(lambda: mine.sid not in served.context.worker.lanes, what="the engine session to close")
        other.join(60)
        assert good["response"]["status"] != "failed" and good["response"]["usage"]["output_tokens"] > 0
        events = []
        with pytest.raises(ConnectionClosed):
            while True:
                events.append(json.loads(slow.recv(timeout=10)))
    assert events[0]["type"] == "session.created" and events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "slow_consumer" and "--max-outbox-mb" in events[-1]["error"]["message"]
    assert slow.close_code == 1008 and slow.close_reason == "slow_consumer"
    lines = [r.getMessage() for r in caplog.records if "reason=slow_consumer" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("realtime refuse peer=127.0.0.1 ")
    served.wait_idle()


# ------------------------------------------------------------------------------------------------------ the outbox
def test_outbox_caps_events_and_bytes_and_counts_until_sent():
    async def scenario():
        box = Outbox(max_messages=3, max_bytes=100)
        assert box.put({"a": "x" * 150})  # one event alone may pass the byte cap when nothing else waits
        assert box.bytes == len(json.dumps({"a": "x" * 150})) and box.overflow is None
        sent, release = [], asyncio.Event()

        async def send(text):
            await release.wait()
            sent.append(text)

        writer = asyncio.create_task(box.drain(send))
        await asyncio.sleep(0)
        assert box.bytes > 100  # the event being sent still counts
        release.set()
        await asyncio.sleep(0.01)
        assert box.bytes == 0 and len(sent) == 1
        release.clear()
        assert box.put({"b": 1}) and box.put({"c": 2}) and box.put({"d": 3})
        assert not box.put({"e": 4}) and "4" not in box.overflow and "3 events pile up" in box.overflow
        assert box.bytes == 0 and len(box) == 0  # a slow consumer's queue is dropped
        assert not box.put({"f": 5})  # and nothing is queued after
        writer.cancel()

        small = Outbox(max_messages=100, max_bytes=40)
        assert small.put({"x": "y" * 10}) and small.put({"x": "y" * 10})
        assert not small.put({"x": "y" * 10}) and "(the cap is 40, --max-outbox-mb)" in small.overflow
        assert small.peak_bytes <= 40

        done = Outbox(10, 1000)
        done.put({"k": 1})
        done.close()
        out = []

        async def instant(text):
            out.append(text)

        await asyncio.wait_for(done.drain(instant), 1)  # close: what is queued goes out, then drain returns
        assert out == ['{"k": 1}']

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="max_bytes"):
        Outbox(1, 0)


def test_native_replies_are_capped_in_bytes():
    """A native session's replies go through the byte cap: past it, `_reply` raises the `slow_consumer`
    ProtocolError that ends the session (the old cap counted replies only)."""
    from omnijax.serve.context import ServeOptions
    from omnijax.serve.native.session import NativeSession

    options = ServeOptions(max_outbox_bytes=1000)
    context = types.SimpleNamespace(options=options, worker=None, tokenizer=None)

    async def scenario():
        session = NativeSession(None, context, "s1", 4000, "127.0.0.1:5")
        reply = {"type": "frame", "seq": 0, "tokens": [1, 2], "text": "x" * 200}
        count = 0
        with pytest.raises(ProtocolError) as e:
            while True:
                session._reply(reply)
                count += 1
        assert e.value.code == "slow_consumer" and "1,000" in str(e.value)
        assert count == 1000 // len(json.dumps(reply)) and session.outbox.peak_bytes <= 1000

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------- native idle timeout
def test_native_session_idles_out(served):
    """With --idle-timeout 0.5 s: a native session that sends frames is served past the timeout, then, once it
    sends nothing for 0.5 s, gets an `idle_timeout` error naming the timeout and close 1000; its engine session is
    freed. (Old: native sessions never idled out.)"""
    from websockets.asyncio.client import connect

    from omnijax.serve import loadgen

    context = served.context
    options = context.options
    context.options = dataclasses.replace(options, idle_timeout_s=0.5)
    frame = loadgen.speech_like_pcm(FRAME_MS / 1000, seed=4).tobytes()
    served.wait_idle()

    async def scenario():
        async with connect(served.native_url) as ws:
            await ws.send(json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
            ready = json.loads(await asyncio.wait_for(ws.recv(), 30))
            loop = asyncio.get_running_loop()
            start, replies = loop.time(), []
            for _ in range(5):  # 1.25 s of frames: busy, never idle
                await ws.send(frame)
                last = loop.time()
                await asyncio.sleep(FRAME_MS / 1000)
            messages = []

            async def read_to_close():
                async for message in ws:
                    messages.append(json.loads(message))

            await asyncio.wait_for(read_to_close(), 30)  # the old server never closed it
            replies = [m for m in messages if m["type"] in ("frame", "late_tokens")]
            return ready, replies, messages[-1], loop.time() - last, last - start, ws.close_code, ws.close_reason

    try:
        ready, replies, error, idle_s, busy_s, code, reason = asyncio.run(scenario())
    finally:
        context.options = options
    assert ready["type"] == "ready" and busy_s > 0.9 and replies
    assert error["type"] == "error" and error["code"] == "idle_timeout" and "0.5 s" in error["message"]
    assert code == 1000 and reason == "idle timeout"
    assert 0.5 <= idle_s < 10  # from the last frame sent, not earlier
    served.wait_idle()  # the engine session was freed


def test_native_no_idle_timeout_when_disabled(served):
    """idle_timeout_s 0: a silent session stays open (the guard: the timeout is the option, not a constant)."""
    from websockets.asyncio.client import connect

    context = served.context
    options = context.options
    context.options = dataclasses.replace(options, idle_timeout_s=0.0)

    async def scenario():
        async with connect(served.native_url) as ws:
            await ws.send(json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
            await asyncio.wait_for(ws.recv(), 30)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), 1.0)
            await ws.send(json.dumps({"type": "bye"}))
            await ws.wait_closed()
            return ws.close_code

    try:
        assert asyncio.run(scenario()) == 1000
    finally:
        context.options = options
    served.wait_idle()


def test_cli_max_outbox_mb(capsys):
    """--max-outbox-mb must be a positive number of MiB: refused by name (exit 2) before any model loads."""
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as e:
            srv.main(["--demo-model", "--max-outbox-mb", bad])
        assert e.value.code == 2 and "--max-outbox-mb must be a positive number" in capsys.readouterr().err
