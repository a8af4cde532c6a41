"""`omnijax serve --snapshot-every 1turn` killed with SIGKILL while a Realtime session is open: a server restarted
on the same --snapshot-dir removes the temp folders of interrupted writes (and says so), and resuming the session's
token continues exactly as the uninterrupted session would from its last periodic snapshot."""

import asyncio
import contextlib
import re
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from tests._support.served import Served  # noqa: E402


def _served(snapshots, *extra: str) -> Served:
    """`omnijax serve --demo-model` in a subprocess, snapshotting Realtime sessions into `snapshots`."""
    return Served("--frame-ms", "200", "--warmup-sessions", "2", "--max-output-tokens", "8", "--snapshot-dir",
                  str(snapshots), *extra)


def _client(served: Served):
    return openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


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


def _generations(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []


def test_sigkill_loses_at_most_one_interval(tmp_path):
    snapshots = tmp_path / "sessions"
    first = _served(snapshots, "--snapshot-every", "1turn")
    result: dict = {}
    snapshotted = threading.Event()

    async def before():
        async with _client(first).realtime.connect(model="omnijax") as ref:
            await ref.recv()
            result["expected"] = [await _say(ref, "First."), await _say(ref, "Second.")]
        with contextlib.suppress(Exception):  # the connection dies with the server
            async with _client(first).realtime.connect(model="omnijax") as conn:
                token = result["token"] = (await conn.recv()).session.model_extra["omnijax"]["resume_token"]
                result["said"] = await _say(conn, "First.")
                deadline = time.monotonic() + 60
                while not _generations(snapshots / token):  # a whole one, not the temp folder of one
                    assert time.monotonic() < deadline, "no periodic snapshot after the turn"
                    await asyncio.sleep(0.05)
                snapshotted.set()
                await conn.recv()  # open until the server dies

    client = threading.Thread(target=lambda: asyncio.run(before()))
    client.start()
    try:
        assert snapshotted.wait(300), "\n".join(first.lines[-20:])
    finally:
        first.proc.send_signal(signal.SIGKILL)  # no shutdown, no snapshot at the end: only the periodic one
        assert first.proc.wait(60) == -signal.SIGKILL
        client.join(60)
    token = result["token"]
    assert result["said"] == result["expected"][0]
    assert _generations(snapshots / token) == ["000000000000"]  # the periodic snapshot after the first turn
    (snapshots / token / ".000000000007.k1ll.tmp" / "arrays").mkdir(parents=True)  # a write the kill cut short
    second = _served(snapshots)
    try:
        assert any("cleaned 1 temp folder(s) of interrupted writes" in x for x in second.lines), "\n".join(second.lines)
        assert not (snapshots / token / ".000000000007.k1ll.tmp").exists()

        async def after():
            async with _client(second).realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
                await conn.recv()
                return await _say(conn, "Second.")

        assert asyncio.run(after()) == result["expected"][1]
    finally:
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(120) in (0, -signal.SIGTERM)


def test_bad_snapshot_and_idle_flags_exit_before_the_model_loads(tmp_path, capsys):
    from omnijax.serve.app import main

    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    cases = [(["--snapshot-every", "5x"], "--snapshot-every takes seconds of activity"),
             (["--snapshot-max-age", "soon"], "--snapshot-max-age is a number"),
             (["--snapshot-max-gb", "-1"], "--snapshot-max-gb must be >= 0"),
             (["--idle-timeout", "-1"], "idle_timeout_s must be >= 0")]
    for extra, named in cases:
        with pytest.raises(SystemExit) as e:
            main(["--demo-model", "--snapshot-dir", str(tmp_path / "s"), *extra])
        assert e.value.code == 2 and named in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--demo-model", "--snapshot-dir", str(a_file)])
    assert e.value.code == 2 and "cannot use it as the snapshot directory" in capsys.readouterr().err
