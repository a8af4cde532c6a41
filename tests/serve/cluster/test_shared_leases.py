"""Cross-replica leases of resume tokens (`omnijax.serve.cluster.lease`, `SharedSnapshotStore`), without Ray: two
stores over one directory stand for two replicas (one process; a lease of another process or host is written as
that replica would write it). One token resumes on one replica at a time; a second is refused naming the holder; a
closing holder is waited for; a dead or silent holder's lease is broken; the size cap and expiry see every replica's
snapshots and spare those another replica holds."""

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from omnijax.serve.cluster.lease import LeaseDir
from omnijax.serve.cluster.replica import SharedSnapshotStore
from omnijax.serve.realtime.snapshot_store import StoreFull, TokenInUse
from tests.serve.realtime.test_snapshot_store import snap

T = "d" * 32


def _store(root, owner: str, **kw) -> SharedSnapshotStore:
    kw.setdefault("live_grace_s", 0.3)
    kw.setdefault("write_wait_s", 2.0)
    return SharedSnapshotStore(root, owner=owner, heartbeat_s=kw.pop("heartbeat_s", 0.2),
                               stale_s=kw.pop("stale_s", 1.0), **kw)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_two_concurrent_resumes_of_one_token_on_two_replicas_one_is_refused_naming_the_holder(tmp_path):
    a, b = _store(tmp_path, "replica-a"), _store(tmp_path, "replica-b")

    async def both():
        return await asyncio.gather(a.acquire(T), b.acquire(T), return_exceptions=True)

    began = time.monotonic()
    results = asyncio.run(both())
    took = time.monotonic() - began
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], TokenInUse)
    winner = "replica-a" if results[0] is won[0] else "replica-b"
    assert f"in use by an open connection on replica {winner}" in str(lost[0])
    assert took < 0.3 + 1.5, took  # refused after the live grace, not a write wait
    loser = b if winner == "replica-a" else a
    assert not loser._leases and loser.held(T)  # the loser holds nothing itself, and sees the other replica's lease
    # the winner lets go: the other replica resumes it at once
    (a if winner == "replica-a" else b).release(won[0])
    assert not (tmp_path / ".leases" / T).exists()
    lease = asyncio.run(loser.acquire(T))
    assert json.loads((tmp_path / ".leases" / T).read_text())["owner"] == loser.shared.owner
    loser.release(lease)


def test_a_closing_holder_on_another_replica_is_waited_for(tmp_path):
    a, b = _store(tmp_path, "replica-a"), _store(tmp_path, "replica-b")

    async def run():
        held = await a.acquire(T)
        held.closing = True  # its connection ended; its last snapshot is being written

        async def finish():
            await asyncio.sleep(0.8)  # longer than the live grace: a connected holder would be refused by now
            a.save(held, snap(mark=7.0))
            a.release(held)
        writer = asyncio.ensure_future(finish())
        got = await b.acquire(T)
        await writer
        return got

    began = time.monotonic()
    got = asyncio.run(run())
    assert 0.7 < time.monotonic() - began < 2.0
    assert float(b.load(got).k.reshape(-1)[0]) == 7.0  # the closing holder's last write, not an older one
    b.release(got)


def test_the_lease_of_a_killed_replica_is_broken_at_once_and_a_silent_ones_when_stale(tmp_path, caplog):
    b = _store(tmp_path, "replica-b")
    killed = LeaseDir(tmp_path, "replica-killed", pid=_dead_pid())  # this host, its process gone
    assert killed.take(T) is None
    killed.close()
    began = time.monotonic()
    lease = asyncio.run(b.acquire(T))
    assert time.monotonic() - began < 0.3  # not even the live grace
    assert "held by replica replica-killed" in caplog.text and "its process is gone" in caplog.text
    b.release(lease)

    silent = LeaseDir(tmp_path, "replica-far", host="another-node", pid=1, heartbeat_s=0.2, stale_s=1.0)
    assert silent.take(T) is None
    silent.close()  # its node died: no more heartbeats, and its process cannot be checked from here
    time.sleep(0.3)
    began = time.monotonic()
    lease = asyncio.run(b.acquire(T))  # a late heartbeat is waited for, not refused, until it goes stale
    assert 0.4 < time.monotonic() - began < 2.0
    b.release(lease)


def test_a_live_holder_on_another_node_keeps_its_lease_by_heartbeat(tmp_path):
    b = _store(tmp_path, "replica-b")
    far = LeaseDir(tmp_path, "replica-far", host="another-node", pid=1, heartbeat_s=0.2, stale_s=1.0)
    assert far.take(T) is None
    first = (tmp_path / ".leases" / T).stat().st_mtime
    time.sleep(1.5)  # past stale_s: only its heartbeat keeps it
    assert (tmp_path / ".leases" / T).stat().st_mtime > first
    with pytest.raises(TokenInUse, match="on replica replica-far"):
        asyncio.run(b.acquire(T))
    assert not b._leases
    far.give_back(T)
    far.close()
    assert not (tmp_path / ".leases" / T).exists()


def test_cap_and_expiry_see_every_replicas_snapshots_and_spare_those_held_elsewhere(tmp_path):
    a = _store(tmp_path, "replica-a")
    t1, t2 = "1" * 32, "2" * 32

    async def write(store, token, mark):
        lease = await store.acquire(token)
        store.save(lease, snap(pages=4, mark=mark))
        return lease

    l1 = asyncio.run(write(a, t1, 1.0))
    l2 = asyncio.run(write(a, t2, 2.0))
    a.release(l2)  # t1 stays held by replica a
    size = a.total_bytes() // 2
    now = time.time()
    b = _store(tmp_path, "replica-b", max_age_s=60.0, clock=lambda: now + 120.0)  # both look 2 minutes old
    assert sorted(os.listdir(tmp_path)) == sorted([".leases", t1])  # t2 expired at b's open; t1 held by a
    assert b.expire() == []
    a.release(l1)
    assert b.expire() == [t1] and not (tmp_path / t1).exists()

    # room for the new write's estimate and 1.5 snapshots beside it
    c = _store(tmp_path, "replica-c", max_bytes=SharedSnapshotStore.estimate(snap(pages=4)) + int(1.5 * size))
    lc = asyncio.run(write(a, t1, 3.0))  # written by a after c opened: c's cap counts it
    t3 = "3" * 32
    l3 = asyncio.run(write(c, t3, 4.0))
    l4 = asyncio.run(c.acquire("4" * 32))
    with pytest.raises(StoreFull):  # StoreFull: t1 is held by a, t3 by this connection
        c.save(l4, snap(pages=4, mark=5.0))
    a.release(lc)
    c.save(l4, snap(pages=4, mark=5.0))  # now t1 (unheld, oldest) is evicted to make room
    assert not (tmp_path / t1).exists() and (tmp_path / t3).exists()
    c.release(l3)
    c.release(l4)
