"""Native `/session` connections resume by token (`omnijax.serve.native.resume`), without Ray: two servers on one
snapshot directory stand in for two replicas. A session sends three PCM frames to one server, says bye (its snapshot
is written under the token `ready` gave it), and continues on the other server with `?resume=TOKEN`: the frame
numbers continue and every frame's tokens equal those of an uninterrupted session fed the same six frames. A token
no server has, one held by an open connection, a Realtime session's snapshot and a server without `--snapshot-dir`
are refused by name (`resume_failed`), never started afresh. The client waits for each frame's tokens before it
sends the next (no frame superseded), so the two runs see the same frames."""

import asyncio
import json

import pytest

websockets = pytest.importorskip("websockets")

import omnijax  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from tests._support import tiny_omni  # noqa: E402
from tests.serve.cluster.native_client import frames as _frames  # noqa: E402
from tests.serve.cluster.native_client import hello as _hello  # noqa: E402
from tests.serve.cluster.native_client import refused as _refused  # noqa: E402

FRAMES = 6
MOVE_AT = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("native"), tokenizer=True))


def _context(model, snapshot_dir):
    stream = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=96, page_size=16,
                                  max_answer_tokens=4)
    options = ServeOptions(port=0, frame_ms=200, snapshot_dir=None if snapshot_dir is None else str(snapshot_dir))
    return build_context(model, options=options, stream=stream, chunk_tokens=32, buckets=(1, 2), aimd_target=0)


def _url(server, resume: str | None = None) -> str:
    base = server.base_url.replace("http://", "ws://").replace("/v1", "/session")
    return base if resume is None else f"{base}?resume={resume}"


def test_a_native_session_moves_to_another_server_and_continues_bit_exactly(model, tmp_path):
    with BackgroundServer(_context(model, tmp_path / "ref")) as server:
        async def uninterrupted():
            ws, ready = await _hello(_url(server))
            async with ws:
                assert ready["type"] == "ready" and ready["resumed"] is False and ready["seq"] == 0, ready
                return await _frames(ws, ready, range(FRAMES))
        expected = asyncio.run(uninterrupted())
    assert [seq for seq, _ in expected] == list(range(FRAMES))
    assert any(tokens for _, tokens in expected), expected  # the frames made the model answer something

    snapshots = tmp_path / "snapshots"
    with BackgroundServer(_context(model, snapshots)) as first:
        async def before_move():
            ws, ready = await _hello(_url(first))
            async with ws:
                said = await _frames(ws, ready, range(MOVE_AT))
                await ws.send(json.dumps({"type": "bye"}))
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await ws.recv()
            return ready["resume_token"], said, closed.value.rcvd.code
        token, said, code = asyncio.run(before_move())
    assert code == 1000 and said == expected[:MOVE_AT]

    with BackgroundServer(_context(model, snapshots)) as second:
        async def after_move():
            ws, ready = await _hello(_url(second, token))
            async with ws:
                assert ready["type"] == "ready" and ready["resumed"] is True, ready
                assert ready["seq"] == MOVE_AT and ready["resume_token"] == token, ready
                twin = await _refused(_url(second, token))  # the token is held: refused, not forked
                moved = await _frames(ws, ready, range(MOVE_AT, FRAMES))
            unknown = await _refused(_url(second, "0" * 32))
            return moved, twin, unknown
        moved, twin, unknown = asyncio.run(after_move())
    assert moved == expected[MOVE_AT:], (moved, expected)  # same frame numbers, same tokens
    for refusal, why in ((twin, "in use by another open connection"), (unknown, "no snapshot for this resume token")):
        message, close = refusal
        assert message["type"] == "error" and message["code"] == "resume_failed", message
        assert why in message["message"] and close == 1008, refusal

    with BackgroundServer(_context(model, None)) as plain:
        message, close = asyncio.run(_refused(_url(plain, token)))
    assert message["code"] == "resume_failed" and "start it with --snapshot-dir" in message["message"], message


def test_a_realtime_snapshot_is_not_resumed_as_a_native_session(model, tmp_path):
    openai = pytest.importorskip("openai")
    with BackgroundServer(_context(model, tmp_path / "s")) as server:
        async def run():
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            async with client.realtime.connect(model="omnijax") as conn:
                created = await conn.recv()
                token = created.session.model_extra["omnijax"]["resume_token"]
            for _ in range(200):  # its snapshot is written as the connection ends
                if server.context.worker.lanes == {}:
                    break
                await asyncio.sleep(0.05)
            return token, await _refused(_url(server, token))
        token, (message, close) = asyncio.run(run())
    assert message["code"] == "resume_failed" and "not a native session's" in message["message"], message
    assert close == 1008
