"""`omnijax serve` as a user runs it: the command line on the demo model, SIGTERM snapshots the open Realtime
session, and a restarted server resumes it with its token to the answer an uninterrupted session gives."""

import asyncio
import signal
import threading

import pytest

openai = pytest.importorskip("openai")

from tests._support.served import Served  # noqa: E402


def _served(snapshots) -> Served:
    """`omnijax serve --demo-model` in a subprocess, snapshotting Realtime sessions into `snapshots`."""
    return Served("--frame-ms", "200", "--warmup-sessions", "2", "--max-output-tokens", "8", "--snapshot-dir",
                  str(snapshots))


async def _say(conn, text):
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create()
    deltas = []
    async for event in conn:
        assert event.type != "error", event
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.done":
            return "".join(deltas)


def test_sigterm_snapshots_and_a_restarted_server_resumes(tmp_path):
    snapshots = tmp_path / "sessions"
    first = _served(snapshots)
    said, result = threading.Event(), {}

    async def before():
        client = openai.AsyncOpenAI(base_url=first.base_url, api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omnijax") as ref:
            await ref.recv()
            result["expected"] = [await _say(ref, "First."), await _say(ref, "Second.")]
        async with client.realtime.connect(model="omnijax") as conn:
            result["token"] = (await conn.recv()).session.model_extra["omnijax"]["resume_token"]
            result["said"] = await _say(conn, "First.")
            said.set()
            try:
                await conn.recv()  # open until the server shuts down
            except Exception as e:  # noqa: BLE001 - the close the shutdown sends
                result["closed"] = type(e).__name__

    client = threading.Thread(target=lambda: asyncio.run(before()))
    client.start()
    try:
        assert said.wait(300), "\n".join(first.lines[-20:])
    finally:
        code = first.stop(120)  # the session above is open: the graceful shutdown snapshots it
        client.join(60)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (so the exit status says SIGTERM)
    assert code in (0, -signal.SIGTERM), "\n".join(first.lines[-20:])
    token = result["token"]
    assert result["said"] == result["expected"][0] and "closed" in result and (snapshots / token).is_dir()
    assert any("snapshot session=rt2 " in line and token in line for line in first.lines)
    second = _served(snapshots)
    try:
        async def after():
            client = openai.AsyncOpenAI(base_url=second.base_url, api_key="unused", max_retries=0)
            async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
                await conn.recv()
                return await _say(conn, "Second.")

        assert asyncio.run(after()) == result["expected"][1]
    finally:
        assert second.stop(120) in (0, -signal.SIGTERM)
