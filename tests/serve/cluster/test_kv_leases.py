"""Cross-replica leases in an object store (`omnijax.serve.cluster.kv_lease.KvLeases`, `SharedSnapshotStore` over a
kvstore URL), without Ray.

On `memory://` (one process's store: two `SharedSnapshotStore`s of this process stand for two replicas, as
tests/serve/cluster/test_shared_leases.py does for a directory): one token resumes on one replica at a time, a second
is refused naming the holder; a closing holder is waited for; a dead or silent holder's lease is broken and a live one
is kept by its heartbeat; a lease broken under its holder is let go, never taken back (every change is one
conditional write of the lease object, never a conditional delete, which S3 does not make atomic).

A `memory://` store cannot be shared between processes, so what crosses processes runs on `file://`, through the same
tensorstore kvstore code path (the driver interface gs:// and s3:// implement): replicas in separate processes race
for one token and exactly one wins (the create-only write); a replica process holding a token is refused to the
others by name, and once it is SIGKILLed its lease is broken at once and its snapshot resumes elsewhere bit-exactly."""

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnijax.serve.cluster.kv_lease import KvLeases
from omnijax.serve.cluster.replica import SharedSnapshotStore
from omnijax.serve.engine.snapshot_kv import open_location
from omnijax.serve.realtime.snapshot_store import TokenInUse
from tests.serve.realtime.test_snapshot_store import snap

T = "e" * 32
ROOT = Path(__file__).resolve().parents[3]


def _store(url: str, owner: str, **kw) -> SharedSnapshotStore:
    kw.setdefault("live_grace_s", 0.3)
    kw.setdefault("write_wait_s", 2.0)
    return SharedSnapshotStore(url, owner=owner, heartbeat_s=kw.pop("heartbeat_s", 0.2),
                               stale_s=kw.pop("stale_s", 1.0), **kw)


def _memory() -> str:
    return f"memory://{secrets.token_hex(6)}/shared"


def _lease(store: SharedSnapshotStore, token: str = T) -> dict:
    data, _ = store.storage.location.read(f".leases/{token}")
    return json.loads(data) if data is not None else None


def test_two_concurrent_resumes_one_refused_naming_the_holder_then_the_other_takes_it():
    url = _memory()
    a, b = _store(url, "replica-a"), _store(url, "replica-b")

    async def both():
        return await asyncio.gather(a.acquire(T), b.acquire(T), return_exceptions=True)

    results = asyncio.run(both())
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], TokenInUse), results
    winner = a if results[0] is won[0] else b
    loser = b if winner is a else a
    assert f"in use by an open connection on replica {winner.shared.owner}" in str(lost[0])
    assert not loser._leases and loser.held(T) and _lease(a)["owner"] == winner.shared.owner
    winner.save(won[0], snap(mark=4.0))
    winner.release(won[0])
    assert _lease(a)["released"] is True and a.shared.holder(T) is None  # given back: a released record
    lease = asyncio.run(loser.acquire(T))
    assert _lease(a)["owner"] == loser.shared.owner and float(loser.load(lease).k.reshape(-1)[0]) == 4.0
    loser.release(lease)


def test_a_closing_holder_is_waited_for_and_its_last_write_resumed():
    url = _memory()
    a, b = _store(url, "replica-a"), _store(url, "replica-b")

    async def run():
        held = await a.acquire(T)
        held.closing = True  # its connection ended: the heartbeat marks the lease closing within 0.1 s

        async def finish():
            await asyncio.sleep(0.8)  # past the live grace: a connected holder would be refused by now
            a.save(held, snap(mark=7.0))
            a.release(held)
        writer = asyncio.ensure_future(finish())
        got = await b.acquire(T)
        await writer
        return got

    began = time.monotonic()
    got = asyncio.run(run())
    assert 0.7 < time.monotonic() - began < 2.0
    assert float(b.load(got).k.reshape(-1)[0]) == 7.0
    b.release(got)


def test_dead_and_silent_holders_are_broken_and_a_live_one_keeps_its_lease(caplog):
    url = _memory()
    b = _store(url, "replica-b")
    location = b.storage.location
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    killed = KvLeases(location, "replica-killed", pid=proc.pid)  # this host, its process gone
    assert killed.take(T) is None
    killed.close()
    began = time.monotonic()
    lease = asyncio.run(b.acquire(T))
    assert time.monotonic() - began < 0.3 and "held by replica replica-killed" in caplog.text
    assert "its process is gone" in caplog.text
    b.release(lease)

    far = KvLeases(location, "replica-far", host="another-node", pid=1, heartbeat_s=0.2, stale_s=1.0)
    assert far.take(T) is None
    first = _lease(b)["beat"]
    time.sleep(1.5)  # past stale_s: only its heartbeat keeps it
    assert _lease(b)["beat"] > first
    with pytest.raises(TokenInUse, match="on replica replica-far"):
        asyncio.run(b.acquire(T))
    far.close()  # its node died: no more heartbeats
    time.sleep(0.3)
    began = time.monotonic()
    lease = asyncio.run(b.acquire(T))  # a late heartbeat is waited for, not refused, until it goes stale
    assert 0.4 < time.monotonic() - began < 2.0 and _lease(b)["owner"] == "replica-b"
    far.give_back(T)  # the broken holder lets go late: the new holder's lease stays
    assert _lease(b)["owner"] == "replica-b"
    b.release(lease)


def test_a_lease_broken_under_its_holder_is_let_go_not_taken_back(caplog):
    location = open_location(_memory())
    slow = KvLeases(location, "replica-slow", host="another-node", pid=1, heartbeat_s=0.2, stale_s=0.5,
                    clock=lambda: time.time() - 10)  # its clock (its beats) 10 s behind: stale to everyone
    assert slow.take(T) is None
    other = KvLeases(location, "replica-other", heartbeat_s=0.2, stale_s=1.0)
    assert other.take(T) is None  # broken as stale, then taken
    time.sleep(0.5)  # the slow holder's next beats fail their compare-and-swap
    assert "is gone: broken as stale by another replica" in caplog.text and T not in slow._mine
    assert json.loads(location.read(f".leases/{T}")[0])["owner"] == "replica-other"
    slow.close()
    other.give_back(T)
    other.close()
    assert json.loads(location.read(f".leases/{T}")[0])["released"] is True and other.holder(T) is None


RACER = """
import sys, time
from pathlib import Path
from omnijax.serve.cluster.kv_lease import KvLeases
from omnijax.serve.engine.snapshot_kv import open_location
url, owner, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
leases = KvLeases(open_location(url), owner, heartbeat_s=0.2, stale_s=5.0)
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
holder = leases.take("%s")
print("won" if holder is None else "lost to " + holder.owner, flush=True)
time.sleep(1.0)
""" % T

HOLDER = """
import asyncio, sys, time
import numpy as np
from omnijax.serve.cluster.replica import SharedSnapshotStore
from tests.serve.realtime.test_snapshot_store import snap
store = SharedSnapshotStore(sys.argv[1], owner="replica-child", heartbeat_s=0.2, stale_s=30.0)
lease = asyncio.run(store.acquire("%s"))
store.save(lease, snap(pages=3, mark=9.0))
print("held", flush=True)
time.sleep(600)
""" % T


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def test_replica_processes_race_for_a_token_on_file_and_exactly_one_wins(tmp_path):
    url = f"file://{tmp_path}/bucket/shared"
    go = tmp_path / "go"
    racers = [_spawn(RACER, url, f"replica-{i}", str(go)) for i in range(3)]
    try:
        assert [p.stdout.readline().strip() for p in racers] == ["ready"] * 3
        go.touch()
        said = [p.stdout.readline().strip() for p in racers]
    finally:
        for p in racers:
            p.wait(timeout=60)
    winners = [i for i, s in enumerate(said) if s == "won"]
    assert len(winners) == 1, said
    assert all(s == f"lost to replica-{winners[0]}" for i, s in enumerate(said) if i != winners[0]), said


def test_a_killed_replica_process_lease_is_broken_and_its_snapshot_resumes_bit_exactly(tmp_path, caplog):
    url = f"file://{tmp_path}/bucket/shared"
    child = _spawn(HOLDER, url)
    try:
        assert child.stdout.readline().strip() == "held"
        here = _store(url, "replica-here", stale_s=30.0)
        with pytest.raises(TokenInUse, match="in use by an open connection on replica replica-child"):
            asyncio.run(here.acquire(T))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        began = time.monotonic()
        lease = asyncio.run(here.acquire(T))  # its process is gone from this host: broken at once, not after 30 s
        assert time.monotonic() - began < 1.0 and "its process is gone" in caplog.text
        got = here.load(lease)
        want = snap(pages=3, mark=9.0)
        assert all(getattr(got, n).tobytes() == getattr(want, n).tobytes() for n in want.arrays())
        here.release(lease)
    finally:
        child.kill()
        child.wait()
