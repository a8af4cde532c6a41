"""Sessions that move between servers through an object store (`--snapshot-dir memory://...`, the tensorstore kvstore
path gs:// and s3:// take), on a tiny model: two servers of this process stand for two replicas (a `memory://` store
is one process's: what crosses processes is tested on `file://` in test_kv_leases.py).

- A Realtime session (the openai SDK) answers its first question on one server and leaves; the other server resumes
  it with its token, and its second answer equals the uninterrupted session's.
- A native `/session` sends three frames to one server, says bye, and continues on the other: frame numbers go on
  and every frame's tokens equal an uninterrupted session's fed the same six frames.
- Each session's snapshot is one object per generation in the store (no directory is written), and a token that is
  held is refused on the other server, not forked."""

import asyncio
import json
import secrets

import pytest

openai = pytest.importorskip("openai")
websockets = pytest.importorskip("websockets")

import omnijax  # noqa: E402
from omnijax.serve.app import BackgroundServer  # noqa: E402
from omnijax.serve.realtime.resume import store_for  # noqa: E402
from tests._support import tiny_omni  # noqa: E402
from tests._support.realtime_client import say  # noqa: E402
from tests.serve.cluster import test_native_resume as native  # noqa: E402
from tests.serve.cluster.native_client import frames, hello, refused  # noqa: E402
from tests.serve.realtime import test_realtime_durable as durable  # noqa: E402

FRAMES, MOVE_AT = 6, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("objects"), tokenizer=True))


def _objects(server, token: str) -> list[str]:
    store = store_for(server.context)
    return store.storage.location.list(f"{token}/")


def test_a_realtime_session_moves_through_an_object_store_and_answers_as_uninterrupted(model, tmp_path):
    with BackgroundServer(durable._context(model, tmp_path / "ref")) as server:
        async def reference():
            async with durable._client(server).realtime.connect(model="omnijax") as conn:
                await durable._start(conn)
                return [await say(conn, *durable.FIRST), await say(conn, *durable.SECOND)]
        expected = asyncio.run(reference())

    url = f"memory://{secrets.token_hex(6)}/sessions"
    with BackgroundServer(durable._context(model, url)) as first:
        token = durable._first_then_leave(first)
        first.wait_idle()
        written = _objects(first, token)
    assert len(written) == 1 and written[0].endswith(".snapshot"), written  # one object: one generation
    assert not (tmp_path / "memory:").exists()
    with BackgroundServer(durable._context(model, url)) as second:
        async def resumed():
            async with durable._client(second).realtime.connect(model="omnijax",
                                                                  extra_query={"resume": token}) as conn:
                created = await conn.recv()
                assert created.type == "session.created" and created.session.instructions == "Be brief."
                twin = await durable._refusal(second, token)  # held by this connection: refused, not forked
                return await say(conn, *durable.SECOND), twin
        answer, twin = asyncio.run(resumed())
        second.wait_idle()
        after = _objects(second, token)
    assert answer == expected[1], (answer, expected)
    assert twin.type == "error" and twin.error.code == "resume_failed" and "in use" in twin.error.message
    assert len(after) == 1 and after != written  # the resumed session's new generation replaced the old one


def test_a_native_session_moves_through_an_object_store_bit_exactly(model):
    with BackgroundServer(native._context(model, None)) as server:
        async def uninterrupted():
            ws, ready = await hello(native._url(server))
            async with ws:
                return await frames(ws, ready, range(FRAMES))
        expected = asyncio.run(uninterrupted())
    assert [seq for seq, _ in expected] == list(range(FRAMES)) and any(t for _, t in expected), expected

    url = f"memory://{secrets.token_hex(6)}/sessions"
    with BackgroundServer(native._context(model, url)) as first:
        async def before_move():
            ws, ready = await hello(native._url(first))
            async with ws:
                said = await frames(ws, ready, range(MOVE_AT))
                await ws.send(json.dumps({"type": "bye"}))
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
            return ready["resume_token"], said
        token, said = asyncio.run(before_move())
        first.wait_idle()
        assert len(_objects(first, token)) == 1
    assert said == expected[:MOVE_AT]

    with BackgroundServer(native._context(model, url)) as second:
        async def after_move():
            ws, ready = await hello(native._url(second, token))
            async with ws:
                assert ready["resumed"] is True and ready["seq"] == MOVE_AT, ready
                return await frames(ws, ready, range(MOVE_AT, FRAMES))
        moved = asyncio.run(after_move())
        unknown = asyncio.run(refused(native._url(second, "0" * 32)))
    assert moved == expected[MOVE_AT:], (moved, expected)
    assert unknown[0]["code"] == "resume_failed" and "no snapshot for this resume token" in unknown[0]["message"]
