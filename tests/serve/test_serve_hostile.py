"""Hostile inputs at the server (issue 35 item 5): over chat completions and the Realtime API, each is refused clearly
(a 4xx naming the problem, or an `error` event with a code) and the server keeps serving: a PNG claiming 20000x20000,
a truncated and a corrupt PNG, WAV sample rates of 0 and 4,000,000,000 Hz, a seed of 2**64, a payload that is not
base64, more audio than a request may carry; a WAV whose data chunk claims more than the file holds is read as what
is there. Refusals are logged rate-limited: a flood of 1,000 bad requests writes a bounded number of lines and says
how many it suppressed."""

import asyncio
import base64
import dataclasses
import io
import json
import logging
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")
httpx = pytest.importorskip("httpx", reason="httpx (the openai SDK's HTTP client) is the test client")

from omnijax.serve.refusal_log import RefusalLog, refusals  # noqa: E402
from tests._support.demo_server import demo_server  # noqa: E402
from tests._support.refusal_log import fresh_refusal_log  # noqa: E402, F401  (autouse: a fresh log per test)

MAX_AUDIO_S = 5.0


@pytest.fixture(scope="module")
def served():
    """The demo model (audio and vision encoders) served with per-request sampling (RowSampling, as `omnijax serve`
    runs), a request's audio capped at 5 s."""
    from omnijax.decoding import RowSampling

    with demo_server(decoding=RowSampling(), max_output_tokens=4,
                     max_request_audio_s=MAX_AUDIO_S) as server:
        yield server


# ---------------------------------------------------------------------------------------------------- the inputs
def _png(width=32, height=32) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer,
                                                                                                          "PNG")
    return buffer.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A small valid PNG whose header (IHDR, CRC fixed) claims `width` x `height`."""
    data = bytearray(_png())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _wav(rate: int, seconds: float = 0.5, data_size: int | None = None) -> bytes:
    """16-bit mono PCM WAV; `data_size` overrides the size its data chunk claims."""
    samples = int(seconds * min(max(rate, 1000), 48000))  # what a sane rate would hold: the header may lie
    body = (np.sin(np.arange(samples) * 0.05) * 8000).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    size = len(body) if data_size is None else data_size
    return (b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data"
            + struct.pack("<I", size) + body)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _image_part(data: bytes | str) -> dict:
    payload = data if isinstance(data, str) else _b64(data)
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + payload}}


def _audio_part(data: bytes | str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data if isinstance(data, str) else _b64(data),
                                                   "format": "wav"}}


def _chat(served, content, **extra):
    body = {"model": "omnijax", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    return httpx.post(served.base_url + "/chat/completions", json=body, timeout=120)


GOOD_PNG = _png()
CHAT_REFUSED = {
    "png claiming 20000x20000": ([_image_part(_png_claiming(20000, 20000))], {}, "MAX_IMAGE_PIXELS"),
    "truncated png": ([_image_part(GOOD_PNG[:len(GOOD_PNG) // 2])], {}, "could not be decoded"),
    "corrupt png": ([_image_part(GOOD_PNG[:8] + b"\x00" * 64 + GOOD_PNG[72:])], {}, "could not be decoded"),
    "wav rate 0": ([_audio_part(_wav(0))], {}, "sample rate 0 Hz is outside the supported range"),
    "wav rate 4e9": ([_audio_part(_wav(4_000_000_000))], {}, "4000000000 Hz is outside the supported range"),
    "seed 2**64": ("hi", {"seed": 2 ** 64}, "'seed' must be a signed 64-bit integer"),
    "image not base64": ([_image_part("%%% not base64 %%%")], {}, "is not valid base64"),
    "audio not base64": ([_audio_part("not*base64")], {}, "is not valid base64"),
    "too much audio": ([_audio_part(_wav(1000, 3.0)), _audio_part(_wav(1000, 3.0))], {},
                       f"over the {MAX_AUDIO_S:g} s one request may carry (--max-request-audio-s)"),
}


@pytest.mark.parametrize("case", list(CHAT_REFUSED))
def test_chat_completions_refuse_hostile_inputs_clearly(served, case):
    content, extra, message = CHAT_REFUSED[case]
    response = _chat(served, content, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"]
    assert "object at 0x" not in error["message"]  # PIL's repr of the file object is no explanation
    assert _chat(served, "hello").status_code == 200  # and the server goes on serving


def test_chat_audio_cap_counts_every_part_before_resampling(served):
    """The cap is on the request's audio in all: each 3 s file alone is served, two of them (6 s > 5 s) are not;
    the old server resampled and encoded any amount (a 6 MB WAV at 1 kHz is 3000 s of audio)."""
    one = _chat(served, [_audio_part(_wav(1000, 3.0))])
    assert one.status_code == 200, one.text
    two = _chat(served, [_audio_part(_wav(1000, 3.0)), _audio_part(_wav(1000, 3.0))])
    assert two.status_code == 400 and two.json()["error"]["code"] == "audio_too_long"
    assert two.json()["error"]["param"] == "messages[0].content[1]"


def test_wav_data_chunk_claiming_more_than_the_file_is_read_as_what_is_there(served):
    """A data chunk whose size runs past the end of the file (streaming encoders write 0xFFFFFFFF) is read as the
    samples present: the same prompt as the honest file, no 500."""
    honest = _chat(served, [_audio_part(_wav(16000, 0.5))])
    claims = _chat(served, [_audio_part(_wav(16000, 0.5, data_size=0xFFFFFFF0))])
    assert honest.status_code == claims.status_code == 200, claims.text
    assert claims.json()["usage"]["prompt_tokens"] == honest.json()["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------------------------- Realtime
def _image_item(payload: str) -> dict:
    return {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + payload}]}}


REALTIME_REFUSED = {
    "png claiming 20000x20000": (_image_item(_b64(_png_claiming(20000, 20000))), "invalid_value", "MAX_IMAGE_PIXELS"),
    "truncated png": (_image_item(_b64(GOOD_PNG[:len(GOOD_PNG) // 2])), "invalid_value", "could not be decoded"),
    "corrupt png": (_image_item(_b64(GOOD_PNG[:8] + b"\x00" * 64 + GOOD_PNG[72:])), "invalid_value",
                    "could not be decoded"),
    "image not base64": (_image_item("%%% not base64 %%%"), "invalid_value", "is not valid base64"),
    "audio not base64": ({"type": "input_audio_buffer.append", "audio": "not*base64"}, "invalid_value",
                         "is not valid base64"),
    "seed 2**64": ({"type": "session.update", "session": {"omnijax": {"seed": 2 ** 64}}}, "invalid_value",
                   "session.omnijax.seed"),
    "input rate 0": ({"type": "session.update", "session": {"audio": {"input": {"format": {
        "type": "audio/pcm", "rate": 0}}}}}, "invalid_value", "must be 24000 or 16000, got 0"),
    "input rate 4e9": ({"type": "session.update", "session": {"audio": {"input": {"format": {
        "type": "audio/pcm", "rate": 4_000_000_000}}}}}, "invalid_value", "got 4000000000"),
    "wav rate 0 as an item": ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                            "content": [{"type": "input_audio",
                                                                                         "audio": _b64(_wav(0))}]}},
                              "invalid_value", "'input_audio' is not supported"),
}


def test_realtime_refuses_hostile_events_clearly_and_keeps_the_session(served):
    """Every hostile event on one Realtime connection gets an `error` event with its code and a message naming the
    problem; the same session then answers a text item (nothing was changed by the refused events)."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{served.port}/v1/realtime", max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        for case, (event, code, message) in REALTIME_REFUSED.items():
            ws.send(json.dumps({**event, "event_id": f"evt_{len(case)}"}))
            reply = json.loads(ws.recv(timeout=60))
            assert reply["type"] == "error", (case, reply)
            assert reply["error"]["code"] == code and message in reply["error"]["message"], (case, reply)
            assert "object at 0x" not in reply["error"]["message"]
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        events = []
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(ws.recv(timeout=60)))
        assert not [e for e in events if e["type"] == "error"]
        assert events[-1]["response"]["status"] != "failed" and events[-1]["response"]["usage"]["output_tokens"]
    assert _chat(served, "hello").status_code == 200


# -------------------------------------------------------------------------------------------- rate-limited refusals
class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_refusal_log_limits_each_reason_and_peer_and_reports_what_it_suppressed(caplog):
    clock = _Clock()
    log = RefusalLog(logging.getLogger("omnijax.test.refusals"), burst=3, interval_s=10.0, global_burst=50,
                     global_per_s=1.0, max_peers=8, clock=clock)
    caplog.set_level(logging.WARNING, logger="omnijax.test.refusals")
    logged = [log.refuse("bad", "10.0.0.1", "refuse %s #%d", "10.0.0.1", i) for i in range(100)]
    assert logged == [True] * 3 + [False] * 97 and log.suppressed == 97
    assert log.refuse("other", "10.0.0.1", "another reason") and log.refuse("bad", "10.0.0.2", "another peer")
    clock.now += 5.0  # half an interval: still nothing for the flooding pair
    assert not log.refuse("bad", "10.0.0.1", "refuse %s #%d", "10.0.0.1", 100)
    clock.now += 5.0
    assert log.refuse("bad", "10.0.0.1", "refuse %s #%d", "10.0.0.1", 101)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["refuse 10.0.0.1 #0", "refuse 10.0.0.1 #1", "refuse 10.0.0.1 #2"]
    assert lines[-1] == "refuse 10.0.0.1 #101 [98 similar refusals suppressed over 10 s]"
    assert len(lines) == 6 and log.logged == 6
    # the global bucket bounds a flood spread over many peers; forgotten pairs' counts are reported later
    many = RefusalLog(logging.getLogger("omnijax.test.refusals"), burst=5, global_burst=10, global_per_s=1.0,
                      max_peers=4, clock=clock)
    assert sum(many.refuse("bad", f"10.1.0.{i}", "x") for i in range(300)) == 10
    clock.now += 1.0
    caplog.clear()
    assert many.refuse("bad", "10.9.9.9", "resumed")
    assert caplog.records[-1].getMessage() == "resumed [287 refusals of other peers suppressed]"
    with pytest.raises(ValueError, match="burst"):
        RefusalLog(logging.getLogger("x"), burst=0)


def test_a_flood_of_unauthorized_requests_logs_a_bounded_number_of_lines(served, caplog, monkeypatch):
    """1,000 requests with a wrong key in a burst: every one is refused (401), the log gets the first 10 lines of
    (unauthorized, 127.0.0.1) and no more; the next line after the interval says how many were suppressed. The old
    middleware logged all 1,000."""
    from omnijax.serve.app import build_app
    from omnijax.serve.context import ServeContext

    clock = _Clock()
    monkeypatch.setattr(refusals, "clock", clock)
    refusals.reset()
    caplog.set_level(logging.WARNING, logger="omnijax.serve")
    context = served.context
    keyed = ServeContext(context.model, context.worker, dataclasses.replace(context.options, api_key="right-key"))
    app = build_app(keyed)  # the middleware alone answers: no lifespan, no engine work

    async def flood(count):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5555))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Authorization": "Bearer wrong-key"}
            return [(await client.get("/v1/models", headers=headers)).status_code for _ in range(count)]

    statuses = asyncio.run(flood(1000))
    assert statuses == [401] * 1000
    lines = [r.getMessage() for r in caplog.records if "reason=unauthorized" in r.getMessage()]
    assert len(lines) == refusals.burst == 10 and refusals.suppressed == 990
    assert all(line.startswith("refuse peer=127.0.0.1 path=/v1/models reason=unauthorized") for line in lines)
    clock.now += refusals.interval_s
    assert asyncio.run(flood(1)) == [401]
    lines = [r.getMessage() for r in caplog.records if "reason=unauthorized" in r.getMessage()]
    assert len(lines) == 11 and lines[-1].endswith("[990 similar refusals suppressed over 10 s]")


def test_chat_refusals_are_logged_rate_limited(served, caplog):
    """Bad chat requests (which logged nothing before) log one line each up to the burst, then are counted."""
    caplog.set_level(logging.WARNING, logger="omnijax.serve")
    for _ in range(15):
        assert _chat(served, "hi", seed=2 ** 64).status_code == 400
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat refuse ")]
    assert len(lines) == 10 and refusals.suppressed == 5
    assert lines[0].startswith("chat refuse peer=127.0.0.1 status=400 reason=invalid_value: 'seed' must be")
