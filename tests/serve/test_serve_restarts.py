"""`omnijax serve` as a user runs it, killed and restarted: one chain of three server processes on one
`--snapshot-dir` (each start-up, 10-30 s on the test machine, serves every check that needs one).

1. A server snapshotting every turn (`--snapshot-every 1turn`) is SIGKILLed while a Realtime session is open: no
   shutdown and no snapshot at the end, only the periodic one after the session's first turn is on disk.
2. Restarted on the same directory (`--demo-model`, the command line a user types), it removes the temporary folder
   of a write the kill cut short (and says so), and the killed session's token continues exactly as the
   uninterrupted session would. Then, with a 100,000-token chat answer decoding (12,500 ticks) and another Realtime
   session open, SIGTERM answers the chat 503 at once, snapshots the open session, and the process exits within
   seconds (uvicorn's graceful shutdown used to wait for the whole answer).
3. Restarted again, that session's token continues exactly as the uninterrupted session would.

Servers 1 and 3 serve the demo checkpoint this process wrote once (`ServedCheckpoint`); the demo model is the same
at every build, so a session snapshotted by one resumes on another.
"""

import asyncio
import re
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests._support.demo_server import demo_checkpoint  # noqa: E402
from tests._support.realtime_client import say  # noqa: E402
from tests._support.served import Served, ServedCheckpoint  # noqa: E402

# 8 answer tokens a tick (the CLI's tau); a Realtime answer is capped at 8 tokens by its response.create (SAY). At most
# three sessions are open at once (two Realtime sessions and a chat): buckets 2 and 4, so each start warms up (traces)
# one tick, bucket 2 (with the default buckets, `--warmup-sessions 2` traced buckets 1 and 2: a start's largest cost).
ARGS = ("--frame-ms", "200", "--max-output-tokens", "100000", "--buckets", "2", "4")
SAY = 8


def _client(served: Served):
    return openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)


async def _resume_and_say(served: Served, token: str, text: str) -> str:
    async with _client(served).realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
        created = await conn.recv()
        assert created.type == "session.created", created
        return (await say(conn, text, SAY))[0]


def _generations(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []


def _open_session_until_the_server_ends(served: Served, result: dict, ready: threading.Event, until=None):
    """In a thread: a Realtime session says "First." (its token and answer go to `result`), waits for `until(token)`
    when given, sets `ready` and stays open until the server ends its connection (`result["closed"]`). A failure
    before that is kept in `result["error"]` (and sets `ready`)."""

    async def run():
        try:
            async with _client(served).realtime.connect(model="omnijax") as conn:
                result["token"] = (await conn.recv()).session.model_extra["omnijax"]["resume_token"]
                result["said"] = (await say(conn, "First.", SAY))[0]
                deadline = time.monotonic() + 60
                while until is not None and not until(result["token"]):
                    assert time.monotonic() < deadline, "not snapshotted after the turn"
                    await asyncio.sleep(0.05)
                ready.set()
                try:
                    await conn.recv()  # open until the server ends
                except Exception as e:  # noqa: BLE001 - the close a shutdown sends, or the socket dying
                    result["closed"] = type(e).__name__
        except Exception as e:  # noqa: BLE001 - reported by the test (closing a dead socket may raise too)
            if "closed" not in result:
                result["error"] = repr(e)
        finally:
            ready.set()

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    return thread


def test_sigkill_loses_at_most_one_interval_and_sigterm_ends_answers_and_snapshots(tmp_path):
    snapshots = tmp_path / "sessions"
    checkpoint = demo_checkpoint()

    # 1. SIGKILL: only the periodic snapshot after the first turn survives
    first = ServedCheckpoint(checkpoint, *ARGS, "--warmup-sessions", "2", "--snapshot-dir", str(snapshots),
                             "--snapshot-every", "1turn")
    killed: dict = {}
    try:
        async def reference():
            async with _client(first).realtime.connect(model="omnijax") as ref:
                await ref.recv()
                return [(await say(ref, "First.", SAY))[0], (await say(ref, "Second.", SAY))[0]]

        expected = asyncio.run(reference())
        snapshotted = threading.Event()
        client = _open_session_until_the_server_ends(first, killed, snapshotted,
                                                     until=lambda token: _generations(snapshots / token))
        assert snapshotted.wait(300) and "error" not in killed, (killed, first.log(20))
    finally:
        status = first.kill(signal.SIGKILL)  # no shutdown, no snapshot at the end: only the periodic one
    client.join(60)
    assert status == -signal.SIGKILL, first.log(20)
    token = killed["token"]
    assert killed["said"] == expected[0]
    assert _generations(snapshots / token) == ["000000000000"]  # the periodic snapshot after the first turn
    (snapshots / token / ".000000000007.k1ll.tmp" / "arrays").mkdir(parents=True)  # a write the kill cut short

    # 2. restarted: stale temp folders cleaned, the killed session resumes; then SIGTERM with work in flight
    second = Served(*ARGS, "--warmup-sessions", "2", "--snapshot-dir", str(snapshots))
    open_session: dict = {}
    try:
        assert any("cleaned 1 temp folder(s) of interrupted writes" in x for x in second.lines), second.log(40)
        assert not (snapshots / token / ".000000000007.k1ll.tmp").exists()
        assert asyncio.run(_resume_and_say(second, token, "Second.")) == expected[1]

        said = threading.Event()
        client = _open_session_until_the_server_ends(second, open_session, said)
        assert said.wait(300) and "error" not in open_session, (open_session, second.log(20))
        chat: dict = {}
        # `user` makes the server log the request once its session is open (`chat completion session=...`)
        body = {"model": "omnijax", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000,
                "user": "sigterm-check"}
        logged = len(second.lines)
        asker = threading.Thread(target=lambda: chat.setdefault(
            "r", httpx.post(second.base_url + "/chat/completions", json=body, timeout=300)))
        asker.start()
        deadline = time.monotonic() + 60
        while not any("chat completion session=" in x and "sigterm-check" in x for x in second.lines[logged:]):
            assert time.monotonic() < deadline and asker.is_alive(), ("the chat was never admitted", second.log(20))
            time.sleep(0.05)
        time.sleep(1.0)  # five frames: the answer is decoding
        assert asker.is_alive()
        start = time.monotonic()
        second.proc.send_signal(signal.SIGTERM)
        code = second.proc.wait(60)
        exit_s = time.monotonic() - start
        asker.join(30)
        client.join(60)
    finally:
        second.kill()  # nothing left to do when it has exited
    # uvicorn re-raises the signal it caught once the server has stopped: the process ends by SIGTERM
    assert code in (0, -signal.SIGTERM) and exit_s < 15, (code, exit_s, second.log(10))
    assert chat["r"].status_code == 503 and "shutting down" in chat["r"].json()["error"]["message"]
    token2 = open_session["token"]
    assert open_session["said"] == expected[0] and "closed" in open_session and (snapshots / token2).is_dir()
    assert any("snapshot session=" in line and token2 in line for line in second.log_since(second.instance_start))

    # 3. restarted again: the session SIGTERM snapshotted resumes
    third = ServedCheckpoint(checkpoint, *ARGS, "--warmup-sessions", "1", "--snapshot-dir", str(snapshots))
    try:
        assert asyncio.run(_resume_and_say(third, token2, "Second.")) == expected[1]
    finally:
        assert third.stop(120) in (0, -signal.SIGTERM)


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
