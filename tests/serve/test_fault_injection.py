"""A fault-injection run of `omnijax serve` on the demo checkpoint (a subprocess): a mixed load — two Realtime
sessions having conversations, a chat completions client, a native `/session` streaming one PCM frame every frame
budget — while one client sends hostile inputs (WAV headers claiming 4e9 Hz and 0 Hz, a PNG header claiming
20000x20000, seed 2**64, 1,001 messages, bad JSON, an over-size body; over chat completions and over Realtime), one
Realtime client sends `response.create` and never reads, and one disconnects mid-response. The server snapshots
open sessions periodically (`--snapshot-every 2s`: a time interval, as docs/serving.md advises where native sessions
stream, whose every served frame counts as a turn; `1turn` is tested in test_realtime_durable and
test_snapshot_turn_boundary); once each conversation's last turn is on disk, the process
is SIGKILLed with the conversations still connected, restarted on the same --snapshot-dir, and each resumes with its
token.

Asserted: every hostile input got a clear 4xx / error event naming the problem (no 500, no dropped socket); the
well-behaved clients were served throughout (native replies kept arriving about every budget, every Realtime answer
and chat completion completed); every answer of each conversation, those served under the load and the next one
after the kill and the resume, equals the same conversation run alone in its own batch-1 `omnijax.Session`
(`tests._support.realtime_churn.AloneRun`: status, text, tokens, KV cells).

Both servers serve the demo checkpoint this process wrote once (`ServedCheckpoint`), and the alone runs use the model
loaded from it (`demo_model`): no start-up builds the demo model again. The servers' compiled programs come from the
suite's persistent compilation cache (`$OMNIJAX_COMPILATION_CACHE`, which the CLI turns on); the first warms up the
8-session bucket its load reaches, the second only the one its one-at-a-time resumes use.
"""

import asyncio
import base64
import json
import re
import struct
import time
import zlib

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
websockets = pytest.importorskip("websockets")

import omnijax  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from tests._support.demo_server import demo_checkpoint, demo_model  # noqa: E402
from tests._support.realtime_churn import AloneRun, Conn, Turn, sentence  # noqa: E402
from tests._support.served import Served, ServedCheckpoint  # noqa: E402

FRAME_MS = 500  # the budget this loaded 2-core test machine holds for the demo model with eight sessions
ARGS = ("--frame-ms", str(FRAME_MS), "--max-output-tokens", "8", "--buckets", "1", "8", "--aimd-target", "0",
        "--max-message-mb", "1")
# The load opens up to 7 sessions at once (native, never-reads, two conversations, chats, hostile Realtime, the
# leaver): its ticks reach the 8 bucket, compiled before it listens so that no tick under the load compiles. After
# the restart the two conversations resume one at a time: bucket 1. Two buckets, not 1, 2, 4, 8: a server's start is
# mostly tracing the warm-up tick of each bucket (each about a quarter of the first server's start with four), and
# the sessions still move between buckets as they come and go.
LOAD_WARMUP, RESUME_WARMUP = ("--warmup-sessions", "8"), ("--warmup-sessions", "1")
# Two turns per conversation under the load (periodic snapshots; the kill once the second is on disk), then one
# more after the resume: every event of three turns (a snapshot replacing an earlier one, a resumed conversation
# with history) with one tick-paced turn less per conversation.
TURNS, MAX_TOKENS = 2, 8


def _wav(rate: int, seconds: float = 0.1) -> bytes:
    """A 16-bit mono WAV whose header states `rate` (the samples are 0.1 s at 16 kHz, whatever it says)."""
    data = np.zeros(1600, "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) % 2 ** 32, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _png_header(width: int, height: int) -> bytes:
    """A PNG with only its IHDR (claiming width x height RGB) and IEND: no pixels at all."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _user(content) -> dict:
    return {"model": "omnijax", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


HOSTILE_HTTP = {  # name: (body bytes, expected status, a word the error must carry)
    "wav 4e9 Hz": (json.dumps(_user([{"type": "input_audio", "input_audio": {
        "data": _b64(_wav(4_000_000_000)), "format": "wav"}}])).encode(), 400, "sample rate"),
    "wav 0 Hz": (json.dumps(_user([{"type": "input_audio", "input_audio": {
        "data": _b64(_wav(0)), "format": "wav"}}])).encode(), 400, "sample rate"),
    "png 20000x20000": (json.dumps(_user([{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + _b64(_png_header(20000, 20000))}}])).encode(), 400, "pixels"),
    "seed 2**64": (json.dumps({**_user("hi"), "seed": 2 ** 64}).encode(), 400, "seed"),
    "1,001 messages": (json.dumps({"model": "omnijax", "messages": [{"role": "user", "content": "x"}] * 1001})
                       .encode(), 400, "1000"),
    "bad json": (b'{"model": "omnijax", "messages": [', 400, "json"),
    "over-size body": (json.dumps(_user("x" * 1_200_000)).encode(), 413, "bytes"),
}


async def _hostile_http(base_url: str) -> dict:
    out = {}
    async with httpx.AsyncClient(timeout=120) as http:
        for name, (body, _, _) in HOSTILE_HTTP.items():
            r = await http.post(f"{base_url}/chat/completions", content=body,
                                headers={"Content-Type": "application/json"})
            out[name] = (r.status_code, r.text[:400])
    return out


async def _hostile_realtime(client) -> tuple[list, object]:
    """Bad JSON, seed 2**64, a 20000x20000 PNG over Realtime; then the same connection answers normally."""
    conn = await Conn.open(client)
    await conn.conn.send_raw('{"type": "session.update", ')
    await conn.conn.session.update(session={"type": "realtime", "omnijax": {"seed": 2 ** 64}})
    await conn.conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + _b64(_png_header(20000, 20000))}]})
    deadline = time.monotonic() + 60
    while len(conn.errors) < 3:
        assert time.monotonic() < deadline, conn.errors
        await asyncio.sleep(0.05)
    errors, conn.errors = list(conn.errors), []
    result = await asyncio.wait_for(await conn.say("Are you still there?", 4), 120)
    await conn.close()
    return errors, result


async def _never_reads(ws_url: str, stop: asyncio.Event) -> int:
    """A Realtime connection that keeps sending response.create and never receives; returns how many it sent."""
    sent = 0
    try:
        # close_timeout: it never reads, so the server's close frame waits behind the replies it never took; the
        # closing handshake gives up after 1 s (websockets waits 10 by default), then the socket is dropped
        async with websockets.connect(f"{ws_url}/v1/realtime?model=omnijax", max_size=None, close_timeout=1) as ws:
            while not stop.is_set() and sent < 400:
                await ws.send(json.dumps({"type": "response.create"}))
                sent += 1
                await asyncio.sleep(0.01)
            await stop.wait()
    except websockets.ConnectionClosed:  # the server may drop it as a slow consumer: that is its right
        pass
    return sent


async def _native(ws_url: str, stop: asyncio.Event) -> tuple[int, list[tuple]]:
    """A native session sending one PCM frame every budget until `stop`; returns (frames sent, replies as (arrival
    time, frames superseded since the previous reply, the reply's latency in ms))."""
    replies: list[tuple] = []
    async with websockets.connect(f"{ws_url}/session") as ws:
        await ws.send(json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready", ready
        n = ready["frame_samples"]
        t = np.arange(n) / 16000

        async def read():
            async for message in ws:
                event = json.loads(message)
                assert event["type"] in ("frame", "late_tokens"), event
                if event["type"] == "frame":
                    replies.append((time.monotonic(), event["skipped"], event["latency_ms"]))

        reader = asyncio.create_task(read())
        sent, start = 0, time.monotonic()
        while not stop.is_set():
            frame = (3000 * np.sin(2 * np.pi * (220 + 20 * sent) * t)).astype("<i2")
            await ws.send(frame.tobytes())
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * FRAME_MS / 1000 - time.monotonic()))
        await ws.send(json.dumps({"type": "bye"}))
        await asyncio.wait_for(reader, 60)
    return sent, replies


async def _conversation(client, rng) -> tuple[Conn, list]:
    conn = await Conn.open(client)
    said = []
    for _ in range(TURNS):
        text = sentence(rng, 3, 12)
        result = await asyncio.wait_for(await conn.say(text, MAX_TOKENS), 120)
        said.append((text, result))
    return conn, said


async def _chats(client) -> list:
    out = []
    for i in range(3):
        r = await client.chat.completions.create(model="omnijax", max_tokens=6, messages=[
            {"role": "user", "content": f"Question number {i}."}])
        out.append(r.choices[0].finish_reason)
    return out


def _generations(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []


async def _snapshotted(token: str, folder, turns: int) -> None:
    """Waits until the newest periodic snapshot of `token` on disk holds its conversation's `turns` answers."""
    deadline = time.monotonic() + 60
    while True:
        gens = _generations(folder)
        if gens:
            try:
                meta = json.loads((folder / gens[-1] / "session.json").read_text())["meta"]
            except (OSError, ValueError, KeyError):  # an older generation deleted under us: look again
                meta = None
            roles = [m["role"] for m in meta["conversation"]["messages"]] if meta else []
            if roles.count("assistant") == turns and roles[-1] == "assistant":
                return
        assert time.monotonic() < deadline, f"no snapshot of {token[:8]}... holding its {turns} turns"
        await asyncio.sleep(0.05)


def _alone_stream(served: Served) -> tuple[omnijax.StreamConfig, int]:
    """The served sessions' `StreamConfig` and T, from the server's start line (the CLI's defaults: sink_window
    16 + 1024, greedy, which `omnijax serve`'s RowSampling at temperature 0 equals)."""
    line = next(x for x in served.lines if x.startswith("omnijax serve: ") and "pool " in x)
    match = re.search(r"pool (\d+)x(\d+), .*T=(\d+), tau=(\d+)", line)
    assert match and str(SinkWindow(16, 1024)) in line, line
    pages, page_size, chunk_tokens, tau = (int(g) for g in match.groups())
    stream = omnijax.StreamConfig(policy=SinkWindow(16, 1024), num_pages=pages, page_size=page_size,
                                  max_answer_tokens=tau)
    return stream, chunk_tokens


def test_a_mixed_load_survives_hostile_clients_and_a_sigkill(tmp_path):
    snapshots = tmp_path / "sessions"
    first = ServedCheckpoint(demo_checkpoint(), *ARGS, *LOAD_WARMUP, "--snapshot-dir", str(snapshots),
                             "--snapshot-every", "2s")
    rng = np.random.default_rng(8)

    async def load():
        client = openai.AsyncOpenAI(base_url=first.base_url, api_key="unused", max_retries=0)
        stop = asyncio.Event()
        native = asyncio.create_task(_native(first.ws_url, stop))
        never = asyncio.create_task(_never_reads(first.ws_url, stop))
        await asyncio.sleep(3 * FRAME_MS / 1000)
        talk = [asyncio.create_task(_conversation(client, rng)) for _ in range(2)]
        chats = asyncio.create_task(_chats(client))
        hostile_http = asyncio.create_task(_hostile_http(first.base_url))
        hostile_rt = asyncio.create_task(_hostile_realtime(client))
        leaver = await Conn.open(client)
        await leaver.say("Leave while answering.", 8)
        await leaver.manager.__aexit__(None, None, None)  # mid-response
        results = [await t for t in talk], await chats, await hostile_http, await hostile_rt
        stop.set()
        frames, replies = await native
        sent = await never
        for conn, _ in results[0]:  # still connected: only the periodic snapshots after their turns are on disk
            await _snapshotted(conn.token, snapshots / conn.token, TURNS)
        status = first.kill()  # SIGKILL with the conversations open: no snapshot at their disconnect
        for conn, _ in results[0]:
            await conn.reader  # ends with the connection
        return status, results, (frames, replies), sent

    try:
        killed, (talks, chats, http, (rt_errors, rt_after)), (frames, replies), sent = asyncio.run(load())
    finally:
        status = first.kill()  # the status of the kill in `load` (or of this one, when it failed before)
    assert killed == status == -9, first.log()
    assert "Traceback" not in "\n".join(first.lines), first.log(80)
    for name, (code, text) in http.items():  # a clear 4xx naming the problem, never a 500 or a dropped socket
        _, expected, word = HOSTILE_HTTP[name]
        assert code == expected and word in text.lower(), (name, code, text)
    codes = sorted(e.error.code for e in rt_errors)
    assert codes == ["invalid_json", "invalid_value", "invalid_value"], rt_errors
    assert rt_after.status in ("completed", "incomplete")
    assert all(r in ("stop", "length") for r in chats), chats
    for conn, said in talks:
        assert conn.errors == [] and all(r.status in ("completed", "incomplete") for _, r in said), said
    # cadence: every frame answered or counted as superseded by a later one (none lost); replies on time (the
    # median at most 0.8 B after its frame, with slack for this loaded machine; none more than 2.5 B late) and never
    # far apart. The bound is on the median because one reply of nine can wait a scheduler slice on 2 shared cores
    # (a slower machine, 2 cores shared with the suite's other worker: replies of 400-440 ms with one at 921 ms); a
    # server that stalls (a request computing on the event loop) misses both bounds and the spacing. At least a third
    # of the frames are answered themselves (a cold suite on a slow day: 9 replies for 20 frames, 11 superseded, every
    # reply within 0.84 s; the spacing bound alone would allow a quarter).
    arrivals, skipped, latency = (np.asarray(x) for x in zip(*replies))
    assert len(replies) + skipped.sum() == frames and len(replies) >= frames / 3, (frames, replies)
    assert np.median(latency) <= 0.8 * FRAME_MS + 300 and latency.max() <= 2.5 * FRAME_MS, replies
    # spacing: two gaps may reach 8 B (the cold suite's compiles on the shared cores once held a reply 2.03 s, 4.06 B,
    # behind the previous one; CI at b40b7b4 had two, 2.41 s and 2.12 s), every other stays under 4 B; a server
    # computing on its event loop stalls at each of the load's requests (4 turns, 3 chats, the leaver's, the hostile
    # ones), not once or twice
    gaps = np.sort(np.diff(arrivals))[::-1]
    assert gaps[0] < 8 * FRAME_MS / 1000 and gaps[1] < 8 * FRAME_MS / 1000 and gaps[2] < 4 * FRAME_MS / 1000, replies
    assert sent >= 50

    second = ServedCheckpoint(demo_checkpoint(), *ARGS, *RESUME_WARMUP, "--snapshot-dir", str(snapshots))
    try:
        async def after():
            client = openai.AsyncOpenAI(base_url=second.base_url, api_key="unused", max_retries=0)
            resumed_turns = []
            for conn, _ in talks:
                follow = sentence(rng, 3, 12)
                resumed = await Conn.open(client, conn.token)
                got = await asyncio.wait_for(await resumed.say(follow, MAX_TOKENS), 120)
                await resumed.close()
                assert resumed.errors == [], resumed.errors
                resumed_turns.append(Turn(follow, MAX_TOKENS, "", connection=2, result=got))
            return resumed_turns

        resumed_turns = asyncio.run(after())
        stream, chunk_tokens = _alone_stream(second)
    finally:
        second.stop()
    model = demo_model()
    for k, ((_, said), follow) in enumerate(zip(talks, resumed_turns)):  # each conversation alone, from its start
        alone = AloneRun(model, stream, chunk_tokens)
        for i, (text, result) in enumerate(said):
            alone.check(Turn(text, MAX_TOKENS, "", result=result), f"conversation {k} turn {i} (under load)")
        alone.check(follow, f"conversation {k}: the turn after the SIGKILL and the resume")
