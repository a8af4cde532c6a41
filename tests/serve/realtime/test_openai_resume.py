"""Realtime sessions resumed with their token, after a reconnect and after a server restart, through the official
`openai` SDK: the answer after a resume equals the uninterrupted session's answer."""

import asyncio

import pytest

openai = pytest.importorskip("openai")

import omnijax  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from tests._support import tiny_omni  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("resume"), tokenizer=True))


def _context(model, snapshot_dir):
    stream = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=96, page_size=16,
                                  max_answer_tokens=8)
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=16, snapshot_dir=str(snapshot_dir))
    return build_context(model, options=options, stream=stream, chunk_tokens=32, buckets=(1, 2), aimd_target=0)


async def _say(conn, text, max_tokens):
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create(response={"max_output_tokens": max_tokens})
    deltas = []
    async for event in conn:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.done":
            assert event.response.status in ("completed", "incomplete")
            return "".join(deltas), event.model_extra["omnijax"]["kv_cells"]
        assert event.type != "error", event


def _client(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_resume_after_reconnect_and_after_restart(model, tmp_path):
    snapshots = tmp_path / "snapshots"

    async def reference(server):
        async with _client(server).realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
            await conn.recv()
            return [await _say(conn, "First question.", 6), await _say(conn, "Second one.", 10)]

    async def first_half(server):
        conn_manager = _client(server).realtime.connect(model="omnijax")
        conn = await conn_manager.__aenter__()
        created = await conn.recv()
        token = created.session.model_extra["omnijax"]["resume_token"]
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        await conn.recv()
        return conn_manager, token, await _say(conn, "First question.", 6)

    async def second_half(server, token):
        async with _client(server).realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.instructions == "Be brief."
            return await _say(conn, "Second one.", 10)

    async def refused(server, token):
        async with _client(server).realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
            return await conn.recv()

    with BackgroundServer(_context(model, snapshots)) as server:
        expected = asyncio.run(reference(server))

        async def reconnect():
            manager, token, first = await first_half(server)
            await manager.__aexit__(None, None, None)  # the client leaves: the session is snapshotted
            await asyncio.to_thread(server.wait_idle)
            assert (snapshots / token).is_dir()
            return token, first, await second_half(server, token)

        token, first, second = asyncio.run(reconnect())
        assert [first, second] == expected
        server.wait_idle()
        assert (snapshots / token).is_dir()  # the resumed session, once it ended, wrote a fresh snapshot
        again = asyncio.run(refused(server, "0" * 32))
        assert again.type == "error" and again.error.code == "resume_failed"

        async def before_restart():
            manager, token, first = await first_half(server)
            return manager, token, first

        manager, token2, first2 = asyncio.run(before_restart())
    # the server stopped with the session open: its shutdown snapshotted it
    assert first2 == expected[0] and (snapshots / token2).is_dir()
    with BackgroundServer(_context(model, snapshots)) as restarted:
        assert asyncio.run(second_half(restarted, token2)) == expected[1]
        restarted.wait_idle()
        stale = asyncio.run(refused(restarted, "zz"))
        assert stale.type == "error" and "32 hex digits" in stale.error.message
