"""`omnijax serve --demo-model --replicas 2` as a user runs it: a local Ray cluster (CPU) with two replicas behind
Ray Serve's proxy on one port, one `--snapshot-dir` both replicas see. One server process serves every check (its
start-up, a Ray cluster and two model loads, is most of this module's time):

1. an uninterrupted Realtime session says "First." then "Second." (the oracle of the move);
2. a second Realtime session says "First." and stays on its replica: `GET /v1/omnijax/replica?resume=<token>` (routed
   like a reconnect with that token) lands on the replica holding it, every time;
3. a chat completion through the official openai SDK goes to the other replica (more admission headroom: the
   Realtime session holds one of the first replica's four session slots), named by the `x-omnijax-replica` header;
4. `POST /v1/omnijax/drain?replica=<holder>` drains the holder: it reports the session's token snapshotted, the
   client's connection is closed with 1012 after that;
5. the client reconnects with its resume token, lands on the live replica, and its answer to "Second." equals the
   uninterrupted session's, token for token;
6. a resume token no replica has is refused by name (`resume_failed`), never started afresh;
7. SIGTERM drains the replicas and shuts the cluster down.

Then `--replicas 64` on this machine's local cluster is refused naming the CPUs it has, and `--replicas 0` or a
missing Ray are refused before anything loads.
"""

import asyncio
import json
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


def test_two_replicas_balance_pin_drain_and_resume_bit_exactly(tmp_path):
    served = Served(*ARGS, "--snapshot-dir", str(tmp_path / "sessions"), start_timeout_s=900)
    try:
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        ready = [line for line in served.lines if "replicas on Ray Serve" in line]
        assert ready and "2 replicas" in ready[-1], served.log(20)
        ids = re.search(r"\(CPU; ([a-z0-9]+), ([a-z0-9]+)\)", ready[-1]).groups()

        async def uninterrupted() -> list[str]:
            async with client.realtime.connect(model="omnijax") as conn:
                await conn.recv()
                return [(await say(conn, "First.", SAY))[0], (await say(conn, "Second.", SAY))[0]]

        expected = asyncio.run(uninterrupted())
        _wait_idle(served, ids)  # the reference session's close (and its last snapshot) is done on its replica

        async def pinned_then_drained() -> dict:
            seen: dict = {}
            async with client.realtime.connect(model="omnijax") as conn:
                created = await conn.recv()
                seen["token"] = token = created.session.model_extra["omnijax"]["resume_token"]
                seen["first"] = (await say(conn, "First.", SAY))[0]
                seen["holder"] = await asyncio.to_thread(_holder, served, token)
                raw = await client.chat.completions.with_raw_response.create(
                    model="omnijax", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
                seen["chat_replica"] = raw.headers["x-omnijax-replica"]
                seen["chat"] = raw.parse()
                seen["drain"], _ = await asyncio.to_thread(_http, served,
                                                           f"/v1/omnijax/drain?replica={seen['holder']}", "POST")
                try:
                    seen["after_drain"] = await asyncio.wait_for(conn.recv(), 60)
                except Exception as e:  # noqa: BLE001 - the close the drain sends
                    seen["closed"] = e
            return seen

        seen = asyncio.run(pinned_then_drained())
        token, holder = seen["token"], seen["holder"]
        assert seen["first"] == expected[0]
        assert seen["chat_replica"] != holder, seen  # the replica without the session had more headroom
        assert seen["chat"].choices[0].message.content is not None and seen["chat"].usage.completion_tokens > 0
        assert seen["drain"]["replica"] == holder and seen["drain"]["tokens"] == [token], seen["drain"]
        assert seen["drain"]["unfinished"] == 0
        assert "1012" in repr(seen.get("closed")), seen  # service restart: reconnect

        async def resumed() -> tuple[str, str]:
            async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
                created = await conn.recv()
                assert created.type == "session.created", created
                second = (await say(conn, "Second.", SAY))[0]
                return second, await asyncio.to_thread(_holder, served, token)

        second, new_holder = asyncio.run(resumed())
        assert new_holder != holder and {holder, new_holder} == set(ids)
        assert second == expected[1]  # the move is invisible in the answer
        drained, _ = _http(served, f"/v1/omnijax/replica?replica={holder}")
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


def test_replicas_flag_is_checked_before_anything_loads(monkeypatch, capsys):
    from omnijax.serve import app
    from omnijax.serve.cluster import launch

    with pytest.raises(SystemExit) as e:
        app.main(["--demo-model", "--replicas", "0"])
    assert e.value.code == 2 and "--replicas must be >= 1, got 0" in capsys.readouterr().err
    monkeypatch.setattr(launch, "ray_installed", lambda: False)
    with pytest.raises(SystemExit) as e:
        app.main(["--demo-model", "--replicas", "2"])
    assert e.value.code == 2 and "pip install 'omnijax[ray]'" in capsys.readouterr().err
