"""Durable, exclusive resume of Realtime sessions and idle timeouts, through the official `openai` SDK on a tiny model:
a session resumes with its token after a reconnect and after a server restart (its shutdown snapshotted it), and
unknown or malformed tokens are refused; a token is leased to one connection at a time; a reconnect while the last
snapshot is being written waits for it; a tampered snapshot is refused by name and changes nothing; periodic
snapshots are written while the connection is open; a failed write reaches the client without server paths; an idle
connection is snapshotted and closed. Every resumed answer equals the uninterrupted session's."""

import asyncio
import dataclasses
import json
import time

import pytest

openai = pytest.importorskip("openai")

import omnijax  # noqa: E402
from omnijax.retention import SinkWindow  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from omnijax.serve.realtime import resume  # noqa: E402
from tests._support import tiny_omni  # noqa: E402
from tests._support.realtime_client import say  # noqa: E402

FIRST, SECOND = ("First question.", 6), ("Second one.", 10)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("durable"), tokenizer=True))


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory):
    """The uninterrupted session's two answers."""
    with BackgroundServer(_context(model, tmp_path_factory.mktemp("ref"))) as server:
        async def reference():
            async with _client(server).realtime.connect(model="omnijax") as conn:
                await _start(conn)
                return [await say(conn, *FIRST), await say(conn, *SECOND)]
        return asyncio.run(reference())


def _context(model, snapshot_dir, **options):
    stream = omnijax.StreamConfig(policy=SinkWindow(sink=16, window=2048), num_pages=96, page_size=16,
                                  max_answer_tokens=8)
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=16, snapshot_dir=str(snapshot_dir), **options)
    return build_context(model, options=options, stream=stream, chunk_tokens=32, buckets=(1, 2), aimd_target=0)


def _client(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


async def _start(conn) -> str:
    created = await conn.recv()
    await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
    await conn.recv()
    return created.session.model_extra["omnijax"]["resume_token"]


async def _resumed_second(server, token):
    async with _client(server).realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.instructions == "Be brief."
        return await say(conn, *SECOND)


async def _refusal(server, token):
    async with _client(server).realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
        return await conn.recv()


def _first_then_leave(server) -> str:
    async def run():
        async with _client(server).realtime.connect(model="omnijax") as conn:
            token = await _start(conn)
            await say(conn, *FIRST)
            return token
    return asyncio.run(run())


def test_resume_after_reconnect_and_after_restart(model, expected, tmp_path):
    """A client that leaves is snapshotted and resumes with its token; a server stopped with a session open
    snapshots it at shutdown, and a new server on the same directory resumes it. Unknown and malformed tokens are
    refused by name."""
    snapshots = tmp_path / "snapshots"

    async def first_half(server):
        manager = _client(server).realtime.connect(model="omnijax")
        conn = await manager.__aenter__()
        token = await _start(conn)
        return manager, token, await say(conn, *FIRST)

    with BackgroundServer(_context(model, snapshots)) as server:
        async def reconnect():
            manager, token, first = await first_half(server)
            await manager.__aexit__(None, None, None)  # the client leaves: the session is snapshotted
            await asyncio.to_thread(server.wait_idle)
            assert (snapshots / token).is_dir()
            return token, first, await _resumed_second(server, token)

        token, first, second = asyncio.run(reconnect())
        assert [first, second] == expected
        server.wait_idle()
        assert (snapshots / token).is_dir()  # the resumed session, once it ended, wrote a fresh snapshot
        unknown = asyncio.run(_refusal(server, "0" * 32))
        assert unknown.type == "error" and unknown.error.code == "resume_failed"
        _, token2, first2 = asyncio.run(first_half(server))  # still open when the server stops
    # the server stopped with the session open: its shutdown snapshotted it
    assert first2 == expected[0] and (snapshots / token2).is_dir()
    with BackgroundServer(_context(model, snapshots)) as restarted:
        assert asyncio.run(_resumed_second(restarted, token2)) == expected[1]
        restarted.wait_idle()
        stale = asyncio.run(_refusal(restarted, "zz"))
        assert stale.type == "error" and "32 hex digits" in stale.error.message


def test_a_token_is_leased_to_one_connection_at_a_time(model, expected, tmp_path):
    with BackgroundServer(_context(model, tmp_path / "s")) as server:
        async def run():
            async with _client(server).realtime.connect(model="omnijax") as conn:
                token = await _start(conn)
                assert await say(conn, *FIRST) == expected[0]
                refused = await _refusal(server, token)  # the same token while the first connection is open
                assert refused.type == "error" and refused.error.code == "resume_failed"
                assert "in use by another open connection" in refused.error.message
                assert len(server.context.worker.lanes) == 1  # no second engine session: no fork
                assert await say(conn, *SECOND) == expected[1]  # the holder goes on undisturbed

        asyncio.run(run())


def test_a_reconnect_waits_for_the_last_write_and_resuming_keeps_the_snapshot(model, expected, tmp_path):
    context = _context(model, tmp_path / "s")
    store = resume.store_for(context)
    real_save = store.save

    def slow_save(lease, snapshot):  # the last snapshot is still being written when the client comes back
        time.sleep(1.5)
        return real_save(lease, snapshot)

    store.save = slow_save
    with BackgroundServer(context) as server:
        async def run():
            async with _client(server).realtime.connect(model="omnijax") as conn:
                token = await _start(conn)
                first = await say(conn, *FIRST)
            return token, first, await _resumed_second(server, token)  # at once: the old code said "no snapshot"

        token, first, second = asyncio.run(run())
        assert [first, second] == expected
        server.wait_idle()
        gens = [p.name for p in (tmp_path / "s" / token).iterdir()]
        assert gens == ["000000000001"]  # the resumed session wrote its successor under the same token


def _edit_meta(store, token, edit) -> str:
    manifest = store.latest(token) / "session.json"
    original = manifest.read_text()
    data = json.loads(original)
    edit(data["meta"])
    manifest.write_text(json.dumps(data))
    return original


def test_a_tampered_snapshot_is_refused_by_name_and_changes_nothing(model, expected, tmp_path):
    context = _context(model, tmp_path / "s")
    store = resume.store_for(context)
    with BackgroundServer(context) as server:
        token = _first_then_leave(server)
        server.wait_idle()
        edits = {"conversation.next_unit": lambda m: m["conversation"].update(next_unit=2 ** 40),
                 "settings.temperature": lambda m: m["settings"].update(temperature="hot"),
                 "conversation.messages[1]": lambda m: m["conversation"]["messages"][1].update(content=[1])}
        for named, edit in edits.items():
            original = _edit_meta(store, token, edit)
            refused = asyncio.run(_refusal(server, token))
            assert refused.type == "error" and refused.error.code == "resume_failed", refused
            assert f"meta {named}" in refused.error.message and str(tmp_path) not in refused.error.message
            assert not server.context.worker.lanes and not store.held(token)  # nothing opened, nothing held
            (store.latest(token) / "session.json").write_text(original)
        with open(store.latest(token) / "session.json", "w") as f:
            f.write('{"format": "omnijax-session", "meta": {')  # not JSON at all
        refused = asyncio.run(_refusal(server, token))
        assert "cannot read the snapshot manifest" in refused.error.message
        assert str(tmp_path) not in refused.error.message and "session.json" in refused.error.message
        (store.latest(token) / "session.json").write_text(original)
        assert asyncio.run(_resumed_second(server, token)) == expected[1]  # nothing was poisoned


def test_periodic_snapshots_while_open_and_failed_writes_reach_the_client(model, expected, tmp_path):
    with BackgroundServer(_context(model, tmp_path / "s", snapshot_every_s=0.2)) as server:
        async def run():
            async with _client(server).realtime.connect(model="omnijax") as conn:
                token = await _start(conn)
                await say(conn, *FIRST)
                folder = tmp_path / "s" / token
                for _ in range(200):  # written while the connection is open (the old code: only at its end)
                    if (folder / "000000000000").is_dir():  # a whole generation (not its temp folder)
                        break
                    await asyncio.sleep(0.05)
                assert (folder / "000000000000" / "session.json").is_file()
                return token

        token = asyncio.run(run())
        server.wait_idle()
        assert asyncio.run(_resumed_second(server, token)) == expected[1]

    capped = _context(model, tmp_path / "full", snapshot_every_turns=1, snapshot_max_bytes=4096)
    with BackgroundServer(capped) as server:
        async def full():
            async with _client(server).realtime.connect(model="omnijax") as conn:
                await _start(conn)
                assert await say(conn, *FIRST) == expected[0]
                failed = await conn.recv()  # the write after that turn does not fit under the cap
                assert failed.type == "error" and failed.error.code == "snapshot_failed"
                assert "does not fit under the server's cap" in failed.error.message
                assert str(tmp_path) not in failed.error.message

        asyncio.run(full())


def test_an_idle_connection_is_snapshotted_and_closed(model, expected, tmp_path):
    with BackgroundServer(_context(model, tmp_path / "s", idle_timeout_s=0.6)) as server:
        async def run():
            async with _client(server).realtime.connect(model="omnijax") as conn:
                token = await _start(conn)
                assert await say(conn, *FIRST) == expected[0]
                start = time.monotonic()
                event = await conn.recv()  # the client sends nothing more
                assert event.type == "error" and event.error.code == "idle_timeout", event
                assert "sent nothing for 0.6 s" in event.error.message and "resume it" in event.error.message
                with pytest.raises(Exception) as closed:
                    await conn.recv()
                assert "1000" in str(closed.value) or type(closed.value).__name__.startswith("Connection")
                return token, time.monotonic() - start

        token, waited = asyncio.run(run())
        assert 0.5 < waited < 5
        server.wait_idle(5)  # the engine session is freed
        assert asyncio.run(_resumed_second(server, token)) == expected[1]


def test_options_refuse_bad_snapshot_and_idle_settings():
    for bad in (dict(snapshot_every_s=-1), dict(snapshot_every_s=5, snapshot_every_turns=2),
                dict(snapshot_max_bytes=0), dict(snapshot_max_age_s=0), dict(idle_timeout_s=-1),
                dict(idle_timeout_s=float("nan"))):
        with pytest.raises(ValueError):
            ServeOptions(**bad)
    assert dataclasses.replace(ServeOptions(), idle_timeout_s=0).idle_timeout_s == 0
