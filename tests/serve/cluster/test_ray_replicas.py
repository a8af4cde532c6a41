"""`omnijax serve --demo-model --replicas 2` as a user runs it: a local Ray cluster (CPU) with two replicas behind
Ray Serve's proxy on one port, one `--snapshot-dir` both replicas see, `--snapshot-every 2s`. One server process (the
module's `cluster` fixture: its start-up, a Ray cluster and two model loads, is most of this module's time) serves
every check:

1. a Realtime session says "Turn 0." and stays on its replica: `GET /v1/omnijax/replica?resume=<token>` (routed like a
   reconnect with that token) lands on the replica holding it, every time;
2. a chat completion through the official openai SDK goes to the other replica (more admission headroom: the
   Realtime session holds one of the first replica's two session slots), named by the `x-omnijax-replica` header;
3. the session keeps talking, a turn every 0.25 s at most, for 1.5 snapshot intervals, then until a turn ends that
   the newest snapshot on disk lacks; then the holder's process is SIGKILLed (no drain, no last snapshot). The newest
   snapshot holds the first k turns: the turns lost are those the client saw end after it, and they all ended within
   one interval before the kill, plus one turn and one snapshot write (an idle-time snapshot's write, in the
   background, may be cut by the kill too);
   A native `/session` opened on the holder after the chat (fed one frame) dies with it, after its periodic
   snapshot (the same `--snapshot-every 2s`, taken by the interval's timer while the client sends nothing) is on
   disk (the kill waits for it);
4. the client reconnects with its token, lands on the survivor (which breaks the dead replica's lease at once),
   and its answer to turn k continues from the snapshot exactly; the killed native session reconnects with its
   token to the survivor (`?resume=&replica=`), continues at frame 1 and is fed its next frame;
5. Ray Serve starts a replacement replica; a second connection with the same token sent to the replacement
   (`?replica=`) while the survivor holds it is refused by name (`resume_failed`, naming the survivor): one token,
   one replica;
6. one step of a rolling restart (`omnijax.serve.cluster.roll.restart_one`) drains the survivor while both sessions
   are open there (it reports both tokens snapshotted, both connections are closed with 1012), its process exits
   and Ray Serve replaces it; the Realtime client reconnects meanwhile, lands on the first replacement, and its
   answer to turn k + 1 continues exactly; the native client reconnects again with `/session?resume=<its token>`,
   routed by Ray Serve's proxy to a live replica, and its frame numbers and tokens continue;
7. a resume token no replica has is refused by name (`resume_failed`), never started afresh;
8. an uninterrupted session, run last, is the oracle: the moved session's every answer and KV cell count equal its
   own, turn for turn. After its first turn three more sessions fill both replicas (two each, pinned by
   `?replica=`; one is a native session); then a Realtime and a native `/session` session are refused by name
   (`overloaded`, naming the cap of 2; close 1013) and a chat completion through the SDK gets a 429 with
   `Retry-After` after the one-second queue timeout, all three routed by headroom; the replicas' open and opened
   counts are unchanged by the refusals. Then the oracle's later turns still equal the moved session's, each
   Realtime filler's first answer equals the oracle's, and the native filler, fed the same frames as the moved
   native session, gives the same frame numbers and tokens (nothing changed for the admitted sessions, and both
   native moves, from a killed replica's periodic snapshot and by a drain, were bit-exact);
9. `--replicas 64` joining this cluster (`RAY_ADDRESS`, as on a multi-node cluster) is refused naming the CPUs the
   cluster has, and leaves the running application serving;
10. SIGTERM drains the replicas and shuts the cluster down (the fixture's teardown).

`--replicas 0`, a missing Ray or a directory that is no checkpoint are refused before any Ray cluster starts.
"""

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
websockets = pytest.importorskip("websockets")
# the `omnijax[ray]` extra (also in the test extra); as pytest.importorskip("ray.serve"), without importing Ray Serve
# when the module is collected: every xdist worker collects it, and the tests run Ray in subprocesses only (~1.2 CPU s)
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray Serve (the `ray` and `test` extras) is not installed", allow_module_level=True)

from omnijax.serve.cluster import roll  # noqa: E402
from omnijax.testing.served import Served  # noqa: E402
from tests._support.realtime_client import say  # noqa: E402
from tests.serve.cluster import native_client  # noqa: E402

EVERY_S = 2.0
CAP = 2  # sessions per replica: the largest bucket (no AIMD: its cap moves with this machine's load), so filling
# both replicas takes four sessions; a chat completion nothing can admit waits one second (--queue-timeout) for room
ARGS = ("--replicas", "2", "--frame-ms", "200", "--warmup-sessions", "1", "--aimd-target", "0", "--buckets", "1",
        str(CAP), "--queue-timeout", "1", "--snapshot-every", f"{EVERY_S:g}s")
SAY = 8
TURNS = tuple(f"Turn {i}." for i in range(26))  # JSON strings on disk: '"Turn 1."' is not in '"Turn 11."'
MOST_BEFORE_KILL = len(TURNS) - 2  # the two resumes say the turns after the kept ones
WRITE_S = 2.0  # the longest a snapshot's disk write is allowed here (~0.2 s on a quiet machine; load 30 stretches it)
NATIVE_FRAMES, NATIVE_MOVE_AT = 4, 2  # the native session's frames, and how many it is fed before its replica drains
PACE_S = 0.25  # a turn starts at most this often (the client's think time): on a quiet machine a turn takes ~0.1 s,
# and the turns must outlast the check window below


def _http(served: Served, path: str, method: str = "GET") -> tuple[dict, dict]:
    request = urllib.request.Request(served.base + path, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read()), dict(response.headers)


def _holder(served: Served, token: str, timeout_s: float = 60.0) -> str:
    """The replica that holds `token`, once the router knows it: six answers in a row routed by the token come from
    the replica that lists it. (Routing stats are reported every second and reach the proxy's router later; under
    load, the first answer that lists the token can be a headroom pick that happened to land there, and the next
    ones then went elsewhere.)"""
    end, streak, answers = time.monotonic() + timeout_s, 0, []
    while streak < 6:
        answer, _ = _http(served, f"/v1/omnijax/replica?resume={token}")
        answers = [*answers[-7:], (answer["replica"], token in answer["tokens"])]
        same = bool(streak) and answer["replica"] == answers[-2][0]
        streak = (streak + 1 if same else 1) if token in answer["tokens"] else 0
        assert time.monotonic() < end, f"requests with {token} not routed to its holder within {timeout_s} s: {answers}"
        time.sleep(0.3 if not streak else 0.05)
    return answer["replica"]


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


def _kept_turns(snapshots: Path, token: str) -> int:
    """How many of `TURNS` the newest snapshot of `token` on disk holds (the user messages of its conversation; 0
    without one)."""
    folder = snapshots / token
    generations = sorted(p for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []
    if not generations:
        return 0
    text = (generations[-1] / "session.json").read_text()
    kept = [json.dumps(t) in text for t in TURNS]
    k = sum(kept)
    assert kept == [True] * k + [False] * (len(TURNS) - k), kept  # a prefix of the conversation
    return k


def _native_kept(snapshots: Path, token: str) -> int:
    """The next frame (`seq`) of the newest native snapshot of `token` on disk (0 without one)."""
    folder = snapshots / token
    generations = sorted(p for p in folder.iterdir() if re.fullmatch(r"[0-9]{12}", p.name)) if folder.is_dir() else []
    return json.loads((generations[-1] / "session.json").read_text())["meta"]["native"]["seq"] if generations else 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's server: `(Served, its --snapshot-dir, the first two replicas' ids)`; SIGTERM at the end, which
    must drain the replicas."""
    snapshots = tmp_path_factory.mktemp("ray") / "sessions"
    began = time.monotonic()
    served = Served(*ARGS, "--snapshot-dir", str(snapshots), start_timeout_s=900)
    try:
        ready = [line for line in served.lines if "replicas on Ray Serve" in line]
        assert ready and "2 replicas" in ready[-1], served.log(20)
        ids = re.search(r"\(CPU; ([a-z0-9]+), ([a-z0-9]+)\)", ready[-1]).groups()
        print(f"cluster up in {time.monotonic() - began:.1f} s")
        yield served, snapshots, ids
    finally:
        began = time.monotonic()
        status = served.stop(180)
        print(f"SIGTERM to exit: {time.monotonic() - began:.1f} s")
    assert status in (0, -signal.SIGTERM), served.log(30)
    assert any(re.search(r"drained [0-9]+ replicas", line)
               for line in served.log_since(served.instance_start)), served.log(30)


def test_two_replicas_balance_pin_kill_roll_and_resume_bit_exactly(cluster):
    served, snapshots, ids = cluster
    client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
    phases = [("start", time.monotonic())]

    async def pinned_then_killed() -> dict:
        seen: dict = {"said": [], "done": []}
        async with client.realtime.connect(model="omnijax") as conn:
            created = await conn.recv()
            seen["token"] = token = created.session.model_extra["omnijax"]["resume_token"]
            seen["said"].append(await say(conn, TURNS[0], SAY))
            seen["done"].append(time.monotonic())
            seen["holder"] = holder = await asyncio.to_thread(_holder, served, token)
            # the router ranks by headroom as the replicas last reported it (every second; later under load): a
            # request routed by headroom reaches the other replica three times in a row first
            other = next(r for r in ids if r != holder)
            await asyncio.to_thread(_answers_from, served, "/v1/omnijax/replica", {other}, 120.0, 3)
            raw = await client.chat.completions.with_raw_response.create(
                model="omnijax", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
            seen["chat_replica"], seen["chat"] = raw.headers["x-omnijax-replica"], raw.parse()
            described, _ = await asyncio.to_thread(_http, served, f"/v1/omnijax/replica?replica={seen['holder']}")
            # a native session beside it: its periodic snapshot (the interval's timer) is what the kill leaves
            native, ready = await native_client.hello(f"{served.ws_url}/session?replica={seen['holder']}")
            seen["native_token"] = ready["resume_token"]
            seen["native_frames"] = await native_client.frames(native, ready, range(1))
            began = time.monotonic()
            while len(seen["said"]) < MOST_BEFORE_KILL:
                await asyncio.sleep(max(0.0, seen["done"][-1] + PACE_S - time.monotonic()))
                seen["said"].append(await say(conn, TURNS[len(seen["said"])], SAY))
                seen["done"].append(time.monotonic())
                if time.monotonic() - began >= 1.5 * EVERY_S and len(seen["said"]) >= 3:
                    # kill when the disk lacks the newest turn (a snapshot was not due at its end): the worst case
                    if (await asyncio.to_thread(_kept_turns, snapshots, token) < len(seen["said"])
                            and await asyncio.to_thread(_native_kept, snapshots, seen["native_token"]) == 1):
                        break
            seen["killed_at"] = time.monotonic()
            os.kill(described["pid"], signal.SIGKILL)  # no drain, no snapshot at the end
            try:
                seen["after_kill"] = await asyncio.wait_for(conn.recv(), 60)
            except Exception as e:  # noqa: BLE001 - the connection dies with its replica
                seen["lost"] = e
            await native.close()
        return seen

    seen = asyncio.run(pinned_then_killed())
    phases.append(("pin, chat, talk, kill", time.monotonic()))
    token, killed = seen["token"], seen["holder"]
    assert seen["chat_replica"] != killed, seen  # the replica without the session had more headroom
    assert seen["chat"].choices[0].message.content is not None and seen["chat"].usage.completion_tokens > 0
    assert "lost" in seen, seen
    k, n = _kept_turns(snapshots, token), len(seen["said"])
    # the longest paced turn (the first gap also holds the routing checks, the chat and the native session's frame)
    turn_s = max(b - a for a, b in zip(seen["done"][1:], seen["done"][2:]))
    lost_s = seen["killed_at"] - seen["done"][k] if k < n else 0.0  # since the first turn the kill lost ended
    behind_s = seen["killed_at"] - seen["done"][k - 1] if k else float("nan")  # the newest turn on disk ended
    gaps = " ".join(f"{b - a:.2f}" for a, b in zip(seen["done"], seen["done"][1:]))
    print(f"--snapshot-every {EVERY_S:g}s, SIGKILL after {n} turns: the disk held {k}; lost {n - k} turns "
          f"({(n - k) * SAY} tokens at most) that ended in the last {lost_s:.2f} s; the newest turn on disk ended "
          f"{behind_s:.2f} s before the kill; seconds between turns' ends {gaps}")
    notes = [x for x in served.lines if re.search("snapshot|evict|lease", x)][-30:]
    assert 0 < k <= n, (k, n, sorted(os.listdir(snapshots)), notes)
    # at most one interval, one turn, and a background write still in flight at the kill (its time under load)
    assert lost_s <= EVERY_S + turn_s + WRITE_S, (k, n, lost_s, turn_s)
    survivor = next(r for r in ids if r != killed)
    _answers_from(served, f"/v1/omnijax/replica?resume={token}", {survivor})  # the router dropped the dead one

    async def resumed_rolled() -> dict:
        moved: dict = {}
        async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
            created = await conn.recv()
            assert created.type == "session.created", created
            moved["after_kill"] = await say(conn, TURNS[k], SAY)
            moved["on"] = await asyncio.to_thread(_holder, served, token)
            # the killed native session resumes in the survivor's other slot from its periodic snapshot (the dead
            # replica's lease broken), and is fed its next frames before the roll moves it again
            native, ready = await native_client.hello(
                f"{served.ws_url}/session?resume={seen['native_token']}&replica={survivor}")
            try:
                moved["native_killed_ready"] = ready
                assert ready["type"] == "ready" and ready["resumed"] is True, ready
                moved["native_token"] = ready["resume_token"]
                moved["native_before"] = await native_client.frames(native, ready, range(ready["seq"],
                                                                                          NATIVE_MOVE_AT))
                # Ray Serve replaces the killed replica; new requests go to it (it has more headroom)
                moved["replacement"] = await asyncio.to_thread(_new_replica, served, {killed, survivor})
                async with client.realtime.connect(
                        model="omnijax", extra_query={"resume": token, "replica": moved["replacement"]}) as twin:
                    moved["twin"] = await twin.recv()  # the survivor holds the token: refused, not forked
                roll_step = asyncio.ensure_future(asyncio.to_thread(roll.restart_one, served.base, survivor,
                                                                    poll_s=0.5))
                try:
                    moved["after_drain"] = await asyncio.wait_for(conn.recv(), 120)
                except Exception as e:  # noqa: BLE001 - the close the drain sends
                    moved["closed"] = e
                moved["native_close"] = await native_client.closed_code(native, 120)
            finally:
                await native.close()
        async with client.realtime.connect(model="omnijax", extra_query={"resume": token}) as conn:
            created = await conn.recv()
            assert created.type == "session.created", created
            moved["after_roll"] = await say(conn, TURNS[k + 1], SAY)
            moved["on_again"] = await asyncio.to_thread(_holder, served, token)
        # the native client reconnects with its token alone: no live replica holds it, so the proxy's router sends
        # it by headroom to a live one, which reads the drained snapshot from the shared directory
        native, ready = await native_client.hello(f"{served.ws_url}/session?resume={moved['native_token']}")
        try:
            moved["native_ready"] = ready
            assert ready["type"] == "ready", ready
            moved["native_on"] = await asyncio.to_thread(_holder, served, moved["native_token"])
            moved["native_after"] = await native_client.frames(native, ready, range(NATIVE_MOVE_AT, NATIVE_FRAMES))
        finally:
            await native.close()
        moved["roll"] = await roll_step
        return moved

    moved = asyncio.run(resumed_rolled())
    phases.append(("resume, replacement, roll", time.monotonic()))
    assert moved["on"] == survivor, moved
    ready = moved["native_killed_ready"]  # the killed replica's native session: from its periodic snapshot
    assert ready["seq"] == 1 and ready["resume_token"] == seen["native_token"], ready
    assert moved["twin"].type == "error" and moved["twin"].error.code == "resume_failed", moved["twin"]
    assert f"in use by an open connection on replica {survivor}" in moved["twin"].error.message, moved["twin"]
    assert "1012" in repr(moved.get("closed")), moved  # service restart: reconnect
    assert moved["native_close"] == 1012, moved  # the native client is told the same
    assert moved["on_again"] == moved["replacement"], moved
    report = moved["roll"]
    assert report["replica"] == survivor, report
    assert report["drain"]["tokens"] == sorted([token, moved["native_token"]]), report  # both snapshotted
    assert report["drain"]["unfinished"] == 0 and report["drain"]["restart"] is True, report
    assert len(report["replacements"]) == 1 and report["replacements"][0] not in (killed, survivor), report
    live = [moved["replacement"], *report["replacements"]]
    assert sorted(roll.replicas(served.base)) == sorted(live)
    ready = moved["native_ready"]
    assert ready["resumed"] is True and ready["seq"] == NATIVE_MOVE_AT, ready
    assert ready["resume_token"] == moved["native_token"], ready
    assert moved["native_on"] in live, moved  # another replica than the one it started on (drained, gone)

    async def unknown_token():
        async with client.realtime.connect(model="omnijax", extra_query={"resume": "0" * 32}) as conn:
            return await conn.recv()

    refused = asyncio.run(unknown_token())  # no replica has it: refused by name, never a fresh session
    assert refused.type == "error" and refused.error.code == "resume_failed", refused

    async def full_then_uninterrupted() -> dict:
        out: dict = {}
        async with contextlib.AsyncExitStack() as stack:
            conn = await stack.enter_async_context(client.realtime.connect(model="omnijax"))
            created = await conn.recv()
            out["expected"] = [await say(conn, TURNS[0], SAY)]
            home = await asyncio.to_thread(_holder, served, created.session.model_extra["omnijax"]["resume_token"])
            fillers, out["began"] = [], time.monotonic()
            other = next(r for r in live if r != home)
            for rid in [home] * (CAP - 1) + [other] * (CAP - 1):
                filler = await stack.enter_async_context(
                    client.realtime.connect(model="omnijax", extra_query={"replica": rid}))
                created = await filler.recv()
                assert created.type == "session.created", (rid, created)
                fillers.append(filler)
            native, native_ready = await native_client.hello(f"{served.ws_url}/session?replica={other}")
            stack.push_async_callback(native.close)
            assert native_ready["type"] == "ready", native_ready
            described = lambda: [_http(served, f"/v1/omnijax/replica?replica={r}")[0] for r in live]  # noqa: E731
            out["full"] = await asyncio.to_thread(described)
            async with client.realtime.connect(model="omnijax") as extra:  # routed by headroom: none anywhere
                out["refused_realtime"] = await extra.recv()
            out["refused_native"], out["native_close"] = await native_client.refused(f"{served.ws_url}/session")
            began = time.monotonic()
            # a client of this event loop: `client`'s pooled HTTP connection belongs to an earlier, closed one
            async with openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as fresh:
                try:
                    await fresh.chat.completions.create(model="omnijax", max_tokens=4,
                                                        messages=[{"role": "user", "content": "Hello"}])
                except openai.RateLimitError as e:
                    out["refused_chat"], out["chat_wait_s"] = e, time.monotonic() - began
            out["after"] = await asyncio.to_thread(described)
            out["refused_at"] = time.monotonic()

            out["expected"] += [await say(conn, text, SAY) for text in TURNS[1:k + 2]]
            # one session at a time: turns at once would batch them, and each replica would compile (or load) the
            # 2-row programs here (177 s once under load, against ~6 s for these one by one)
            began = time.monotonic()
            out["fillers"] = [await say(filler, TURNS[0], SAY) for filler in fillers]
            out["native"] = await native_client.frames(native, native_ready, range(NATIVE_FRAMES))
            out["talk_s"] = time.monotonic() - began
        return out

    full = asyncio.run(full_then_uninterrupted())
    phases.append(("fill, refuse, oracle", time.monotonic()))
    expected = full["expected"]
    print(f"every replica full: filling both and the three refusals took {full['refused_at'] - full['began']:.1f} "
          f"s (the chat's queue wait {full.get('chat_wait_s', float('nan')):.1f} s); the fillers' turns and the "
          f"native frames {full['talk_s']:.1f} s")
    assert [(d["replica"], d["sessions"], d["headroom"]) for d in full["full"]] == [(r, CAP, 0) for r in live], full
    event = full["refused_realtime"]
    assert event.type == "error" and event.error.code == "overloaded", event
    assert f"the server holds at most {CAP}" in event.error.message, event
    native = full["refused_native"]
    assert native["type"] == "error" and native["code"] == "overloaded", native
    assert f"holds at most {CAP}" in native["message"] and full["native_close"] == 1013, full
    refused = full.get("refused_chat")
    assert refused is not None and refused.status_code == 429, full
    assert refused.response.headers["retry-after"] == "1", refused.response.headers
    assert refused.response.headers["x-omnijax-replica"] in live, refused.response.headers
    assert "no room came within the queue timeout of 1 s" in refused.message, refused.message
    assert full["chat_wait_s"] >= 1.0, full["chat_wait_s"]
    # the refusals opened nothing, closed nothing: the same sessions, the same count of sessions ever opened
    assert [(d["sessions"], d["opened"]) for d in full["after"]] == [(d["sessions"], d["opened"])
                                                                      for d in full["full"]], full
    assert sum(d["refused"] for d in full["after"]) >= sum(d["refused"] for d in full["full"]) + 3, full
    assert full["fillers"] == [expected[0]] * (2 * CAP - 2), full  # admitted sessions answer as if alone
    m = min(n, k + 2)
    assert seen["said"][:m] == expected[:m]  # the turns before the kill, as far as the oracle went
    # two moves (a kill, a rolling restart), invisible in the answers and the cache
    assert moved["after_kill"] == expected[k] and moved["after_roll"] == expected[k + 1], (moved, expected)
    # the native session's move through the proxy (a drain, a resume by token): the same frames, the same tokens
    assert [seq for seq, _ in full["native"]] == list(range(NATIVE_FRAMES)), full["native"]
    assert any(tokens for _, tokens in full["native"]), full["native"]  # the frames made the model answer
    assert seen["native_frames"] + moved["native_before"] + moved["native_after"] == full["native"], (
        seen, moved, full["native"])
    print("phases (s): " + ", ".join(f"{name} {b - a:.1f}" for (_, a), (name, b) in zip(phases, phases[1:])))


def test_more_replicas_than_the_cluster_has_devices_is_refused_by_name(cluster):
    """Joins the module's cluster as `RAY_ADDRESS` makes any `omnijax serve` on a multi-node cluster: refused by
    name, and the application running there keeps serving (the refusal does not shut Ray Serve down). The cluster
    `ray.init()` started has token authentication on (Ray's default), and a driver joining by an explicit address
    must turn it on itself (`RAY_AUTH_MODE=token`; the token is this machine's `~/.ray/auth_token`)."""
    served, _, _ = cluster
    address = [re.search(r"Ray cluster at (\S+)", line) for line in served.lines]
    address = [a.group(1) for a in address if a]
    assert address, served.log(40)
    before = roll.replicas(served.base)
    proc = subprocess.run([sys.executable, "-m", "omnijax.cli", "serve", "--demo-model", "--port", "0", "--replicas",
                           "64"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ADDRESS": address[-1], "RAY_AUTH_MODE": "token"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"Ray cluster at {address[-1]}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]  # joined it
    cpus = int(re.search(r"--replicas 64 needs 64 CPUs \(one per replica\); the Ray cluster has ([0-9]+)",
                         proc.stderr).group(1))
    assert len(before) <= cpus < 64, (before, cpus)
    assert sorted(roll.replicas(served.base)) == sorted(before)
    for rid in before:  # still serving, not draining
        answer, _ = _http(served, f"/v1/omnijax/replica?replica={rid}")
        assert answer["replica"] == rid and answer["draining"] is False, answer


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
