"""A connection's lease on its resume token is taken and given back off the event loop.

With a shared snapshot location, leasing a token is a write every replica sees (a lease file on a shared disk, a
conditional write of a bucket's object): a network round trip. Taken on the event loop, it stalled every other
connection's frames for that long. The store here is the server's own `SnapshotStore` made slow on purpose; a
ticker task on the same loop must keep ticking while a connection leases and releases.
"""

from __future__ import annotations

import asyncio
import time

from omnijax.serve.realtime import resume
from omnijax.serve.realtime.snapshot_store import SnapshotStore

SLOW_S = 0.3
TICK_S = 0.01


class _SlowStore(SnapshotStore):
    """A store whose lease writes take `SLOW_S` (a blocking call, as a remote write is)."""

    def lease_new(self, token):
        time.sleep(SLOW_S)
        return super().lease_new(token)

    def release(self, lease):
        time.sleep(SLOW_S)
        super().release(lease)


class _Options:
    snapshot_dir = "unused: the store is attached"


class _Context:
    options = _Options()


async def _ticks_while(work) -> tuple[int, object]:
    """How many `TICK_S` ticks a second task on the loop got while `work` ran, and what `work` returned."""
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker starts first
    try:
        result = await work
    finally:
        stop.set()
        await task
    return ticks, result


def test_a_new_lease_and_a_refused_resume_leave_the_loop_free(tmp_path):
    store = _SlowStore(tmp_path)
    context = _Context()
    resume.attach_store(context, store)

    async def scenario():
        ticks_new, leased = await _ticks_while(resume.lease_snapshot(context, None, lambda snapshot: None))
        assert leased.lease is not None and store.held(leased.token)
        store.release(leased.lease)
        # a token with no snapshot: leased, the load fails, the lease is given back (slowly) and the resume refused
        refused = None

        async def resume_missing():
            nonlocal refused
            try:
                await resume.lease_snapshot(context, "0" * 32, lambda snapshot: None)
            except resume.ResumeRefused as e:
                refused = e

        ticks_refused, _ = await _ticks_while(resume_missing())
        return ticks_new, ticks_refused, refused

    ticks_new, ticks_refused, refused = asyncio.run(scenario())
    assert refused is not None and not store.held("0" * 32)
    # blocking the loop for SLOW_S gives the ticker at most one tick; off the loop it gets ~SLOW_S / TICK_S
    assert ticks_new >= 5, ticks_new
    assert ticks_refused >= 5, ticks_refused
