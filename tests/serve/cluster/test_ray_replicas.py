"""`omnijax serve --demo-model --replicas 2` as a user runs it: a local Ray cluster (CPU) with two replicas behind
Ray Serve's proxy on one port, one `--snapshot-dir` both replicas see. One server process serves every check (its
start-up, a Ray cluster and two model loads, is most of this module's time):

1. an uninterrupted Realtime session says "First.", "Second.", "Third." (the oracle of the moves);
2. a second Realtime session says "First." (`--snapshot-every 1turn`: on disk before its `response.done`) and stays on
   its replica: `GET /v1/omnijax/replica?resume=<token>` (routed like a reconnect with that token) lands on the
   replica holding it, every time;
3. a chat completion through the official openai SDK goes to the other replica (more admission headroom: the
   Realtime session holds one of the first replica's four session slots), named by the `x-omnijax-replica` header;
4. the holder's process is SIGKILLed (no drain, no last snapshot); the client reconnects with its token, lands on the
   survivor, and its answer to "Second." equals the uninterrupted session's: the kill lost nothing it had seen;
5. Ray Serve starts a replacement replica; `POST /v1/omnijax/drain?replica=<survivor>` drains the survivor while the
   session is open there: it reports the session's token snapshotted, then the connection is closed with 1012;
6. the client reconnects once more, lands on the replacement, and its answer to "Third." equals the uninterrupted
   session's, token for token;
7. a resume token no replica has is refused by name (`resume_failed`), never started afresh;
8. SIGTERM drains the replicas and shuts the cluster down.

Then `--replicas 64` on this machine's local cluster is refused naming the CPUs it has, and `--replicas 0`, a
missing Ray or a directory that is no checkpoint are refused before any Ray cluster starts.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")  # the `omnijax[ray]` extra (also in the test extra)

from omnijax.testing.served import Served  # noqa: E402
from tests._support.realtime_client import say  # noqa: E402

# no AIMD (its cap moves with this machine's load): each replica's headroom is 4 sessions (the largest bucket) minus
# the sessions open on it
ARGS = ("--replicas", "2", "--frame-ms", "200", "--warmup-sessions", "1", "--aimd-target", "0", "--buckets", "1", "2",
        "4")
SAY = 8
TURNS = ("First.", "Second.", "Third.")


def _http(served: Served, path: str, method: str = "GET") -> tuple[dict, dict]:
    request = urllib.request.Request(served.base + path, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read()), dict(response.headers)


def _holder(served: Served, token: str, timeout_s: float = 60.0) -> str:
    """The replica that holds `token`, once the router knows it (routing stats are reported every second): the first
    answer that lists the token, then five more routed the same way must all come from that replica."""
    end = time.monotonic() + timeout_s
    while True:
        answer, _ = _http(served, f"/v1/omnijax/replica?resume={token}")
        if token in answer["tokens"]:
            break
        assert time.monotonic() < end, f"no replica reported {token} within {timeout_s} s: {answer}"
        time.sleep(0.3)
    again = [_http(served, f"/v1/omnijax/replica?resume={token}")[0] for _ in range(5)]
    assert all(a["replica"] == answer["replica"] and token in a["tokens"] for a in again), (answer, again)
    return answer["replica"]


def _wait_idle(served: Served, ids, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while any(_http(served, f"/v1/omnijax/replica?replica={rid}")[0]["sessions"] for rid in ids):
        assert time.monotonic() < end, "sessions still open"
        time.sleep(0.2)
    time.sleep(2.0)  # two routing-stats periods: the router sees both replicas idle


def _new_replica(served: Served, known: set, timeout_s: float = 900.0) -> str:
    """The id of a replica not in `known`, once `GET /v1/omnijax/replica` (routed by headroom) reaches it."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            answer = _http(served, "/v1/omnijax/replica")[0]["replica"]
        except OSError:
            answer = None
        if answer is not None and answer not in known:
            return answer
        assert time.monotonic() < end, f"no replica beside {known} within {timeout_s} s"
        time.sleep(1.0)


def _answers_from(served: Served, path: str, replicas: set, timeout_s: float = 900.0, times: int = 5) -> str:
    """Polls `GET path` until `times` answers in a row come from one replica of `replicas` (a request to a replica
    that just died may fail meanwhile); returns it."""
    end, streak, last = time.monotonic() + timeout_s, 0, None
    while streak < times:
        assert time.monotonic() < end, f"{path} not answered by {replicas} within {timeout_s} s (last: {last})"
        try:
            answer = _http(served, path)[0]["replica"]
        except OSError as e:  # urllib's HTTPError / URLError: the dead replica's requests
            answer = repr(e)
        streak, last = (streak + 1 if answer == last else 1) if answer in replicas else 0, answer
        time.sleep(0.2 if streak else 1.0)
    return last


def test_two_replicas_balance_pin_kill_drain_and_resume_bit_exactly(tmp_path):
    served = Served(*ARGS, "--snapshot-dir", str(tmp_path / "sessions"), "--snapshot-every", "1turn",
                    start_timeout_s=900)
    try:
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        ready = [line for line in served.lines if "replicas on Ray Serve" in line]
        assert ready and "2 replicas" in ready[-1], served.log(20)
        ids = re.search(r"\(CPU; ([a-z0-9]+), ([a-z0-9]+)\)", ready[-1]).groups()

        async def uninterrupted() -> list[str]:
            async with client.realtime.connect(model="omnijax") as conn:
                await conn.recv()
                return [(await say(conn, text, SAY))[0] for text in TURNS]

        expected = asyncio.run(uninterrupted())
        _wait_idle(served, ids)  # the reference session's close (and its last snapshot) is done on its replica

        async def pinned_then_killed() -> dict:
            seen: dict = {}
            async with client.realtime.connect(model="omnijax") as conn:
                created = await conn.recv()
                seen["token"] = token = created.session.model_extra["omnijax"]["resume_token"]
                seen["first"] = (await say(conn, TURNS[0], SAY))[0]  # snapshotted before its response.done
                seen["holder"] = await asyncio.to_thread(_holder, served, token)
                raw = await client.chat.completions.with_raw_response.create(
                    model="omnijax", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
                seen["chat_replica"], seen["chat"] = raw.headers["x-omnijax-replica"], raw.parse()
                described, _ = await asyncio.to_thread(_http, served, f"/v1/omnijax/replica?replica={seen['holder']}")
                os.kill(described["pid"], signal.SIGKILL)  # no drain, no snapshot at the end
                try:
                    seen["after_kill"] = await asyncio.wait_for(conn.recv(), 60)
                except Exception as e:  # noqa: BLE001 - the connection dies with its replica
                    seen["lost"] = e
            return seen

        seen = asyncio.run(pinned_then_killed())
        token, killed = seen["token"], seen["holder"]
        assert seen["first"] == expected[0]
        assert seen["chat_replica"] != killed, seen  # the replica without the session had more headroom
        assert seen["chat"].choices[0].message.content is not None and seen["chat"].usage.completion_tokens > 0
        assert "lost" in seen, seen
        survivor = next(r for r in ids if r != killed)
        _answers_from(served, f"/v1/omnijax/replica?resume={token}", {survivor})  # the router dropped the dead one

        async def resumed_drained() -> dict:
            moved: dict = {}
            async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
                created = await conn.recv()
                assert created.type == "session.created", created
                moved["second"] = (await say(conn, TURNS[1], SAY))[0]
                moved["on"] = await asyncio.to_thread(_holder, served, token)
                # Ray Serve replaces the killed replica; new requests go to it (it has more headroom)
                moved["replacement"] = await asyncio.to_thread(_new_replica, served, {killed, survivor})
                moved["drain"], _ = await asyncio.to_thread(_http, served,
                                                            f"/v1/omnijax/drain?replica={survivor}", "POST")
                try:
                    moved["after_drain"] = await asyncio.wait_for(conn.recv(), 60)
                except Exception as e:  # noqa: BLE001 - the close the drain sends
                    moved["closed"] = e
            return moved

        moved = asyncio.run(resumed_drained())
        # the kill lost nothing the client had seen: the periodic snapshot of its first turn continues exactly
        assert moved["second"] == expected[1] and moved["on"] == survivor, moved
        assert moved["drain"]["replica"] == survivor and moved["drain"]["tokens"] == [token], moved["drain"]
        assert moved["drain"]["unfinished"] == 0
        assert "1012" in repr(moved.get("closed")), moved  # service restart: reconnect

        async def resumed_again() -> tuple[str, str]:
            async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
                created = await conn.recv()
                assert created.type == "session.created", created
                third = (await say(conn, TURNS[2], SAY))[0]
                return third, await asyncio.to_thread(_holder, served, token)

        third, on = asyncio.run(resumed_again())
        assert on == moved["replacement"]
        assert third == expected[2]  # two moves, invisible in the answers
        drained, _ = _http(served, f"/v1/omnijax/replica?replica={survivor}")
        assert drained["draining"] and drained["headroom"] == 0 and drained["sessions"] == 0, drained

        async def unknown_token():
            async with client.realtime.connect(model="omnijax", extra_query={"resume": "0" * 32}) as conn:
                return await conn.recv()

        refused = asyncio.run(unknown_token())  # no replica has it: refused by name, never a fresh session
        assert refused.type == "error" and refused.error.code == "resume_failed", refused
    finally:
        status = served.stop(180)
    assert status in (0, -signal.SIGTERM), served.log(30)
    assert any("drained 2 replicas" in line for line in served.log_since(served.instance_start)), served.log(30)


def test_more_replicas_than_the_cluster_has_devices_is_refused_by_name():
    proc = subprocess.run([sys.executable, "-m", "omnijax.cli", "serve", "--demo-model", "--port", "0", "--replicas",
                           "64"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"--replicas 64 needs 64 CPUs \(one per replica\); the Ray cluster has [0-9]+", proc.stderr)


def test_replicas_flag_is_checked_before_anything_loads(monkeypatch, capsys, tmp_path):
    from omnijax.serve import app
    from omnijax.serve.cluster import launch

    assert app.main([str(tmp_path), "--port", "0", "--replicas", "2"]) == 1  # no checkpoint: no Ray cluster started
    assert f"{tmp_path} is not an omnijax checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        app.main(["--demo-model", "--replicas", "0"])
    assert e.value.code == 2 and "--replicas must be >= 1, got 0" in capsys.readouterr().err
    monkeypatch.setattr(launch, "ray_installed", lambda: False)
    with pytest.raises(SystemExit) as e:
        app.main(["--demo-model", "--replicas", "2"])
    assert e.value.code == 2 and "pip install 'omnijax[ray]'" in capsys.readouterr().err
