"""Periodic snapshots of a native `/session` connection (`--snapshot-dir` with `--snapshot-every`), so that a replica
killed without a drain loses at most the last interval of a native session, not the whole of it.

The interval has Realtime's syntax and meaning (`omnijax.serve.realtime.snapshot_store.parse_every`), with a served
frame as the native session's turn:

- `Nturns`: after the N-th frame served since the previous snapshot was taken;
- `30s`: after the first frame served 30 s or more after the previous snapshot was taken, or, when the client sends
  nothing, as soon as the interval has passed (the connection's receive loop wakes for it).

One write is on its way to disk at a time: a snapshot that falls due while the previous one is still being written
is taken at the first moment between frames after that write ended (a frame never waits for a disk write, and at
most one export waits in memory), so on a slow disk the snapshots come as often as the disk takes them.

The cost is the export (the next frame waits for it) and the write's CPU beside the engine: with `1turn` a write is
nearly always in flight. Measured on the loaded 2-core test machine (tiny model, a frame every 200 ms, 40 frames):
without periodic snapshots p90 latency 81-82 ms and no frame superseded; with `1turn` 161 ms and 18-24 of 40
superseded. A time interval (`30s`) costs one export per interval; native sessions are better served by one.

A snapshot is only ever taken between two frames: after a frame's reply is queued and before the next frame goes to
the engine (the session has at most one frame in the engine, see `omnijax.serve.native.session`), so the engine
state it exports is exactly that of the frames served so far. Its meta (`omnijax.serve.native.resume.native_meta`)
says `seq` = the served frame's number + 1 and the audio unit the next frame is encoded as: a resume by token
continues from there bit-exactly (the frames after it give the tokens an uninterrupted session gives).

The export runs in the engine's thread; its disk write runs in a worker thread in the background while the next
frames are served. A write that fails is reported to the client as a
non-fatal `{"type": "error", "code": "snapshot_failed"}` and the token's previous snapshot stays (the next interval
tries again). The connection's last snapshot (at its end, `omnijax.serve.native.session`) waits for the write in
flight, so generations land in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from omnijax.serve.engine.snapshot import SessionSnapshot
from omnijax.serve.native.resume import native_meta
from omnijax.serve.realtime.snapshot_store import Lease, SnapshotStore, SnapshotStoreError

log = logging.getLogger("omnijax.serve")


class NativeSnapshots:
    """One native connection's periodic snapshots (module docstring).

    Args:
        sid: the engine session.
        export: the worker's `export(sid, meta)` coroutine function (runs in the engine's thread).
        store: the server's `SnapshotStore`.
        lease: the connection's lease on its token.
        every_s: seconds between snapshots (0: not by time).
        every_turns: served frames between snapshots (0: not by frames); at most one of the two is set.
        frame_ms: the server's frame budget (in the meta).
        model_name: the served model's name (in the meta).
        report: queues a message to the client (a failed write's `snapshot_failed` error).
    """

    def __init__(self, sid: str, export: Callable, store: SnapshotStore, lease: Lease, *, every_s: float,
                 every_turns: int, frame_ms: float, model_name: str, report: Callable[[dict], object]):
        if every_s and every_turns:
            raise ValueError(f"a snapshot interval is seconds or frames, not both: {every_s} s, {every_turns} frames")
        self.sid, self.export, self.store, self.lease = sid, export, store, lease
        self.every_s, self.every_turns = float(every_s), int(every_turns)
        self.frame_ms, self.model_name, self.report = frame_ms, model_name, report
        self.frames = 0  # frames served by this connection
        self.frames_taken = 0  # `frames` when the last snapshot was taken
        self.state: tuple[int, int] | None = None  # (seq, unit) after the last served frame; None: nothing new
        self.last_take = time.monotonic()  # when the last snapshot was taken (exported), or the connection began
        self.taken = self.written = self.failed = 0
        self._saving: asyncio.Task | None = None  # the write in flight

    @property
    def enabled(self) -> bool:
        """Whether periodic snapshots are on."""
        return bool(self.every_s or self.every_turns)

    def served(self, seq: int, unit: int) -> None:
        """Notes that frame `seq` was served and the next frame is encoded as audio unit `unit`."""
        self.frames += 1
        self.state = (seq + 1, unit)

    def _came(self) -> bool:
        """Whether the interval came (frames or seconds since the last snapshot was taken)."""
        if self.every_turns:
            return self.frames - self.frames_taken >= self.every_turns
        return time.monotonic() - self.last_take >= self.every_s

    def writing(self) -> bool:
        """Whether a write is on its way to disk."""
        return self._saving is not None and not self._saving.done()

    def due(self) -> bool:
        """Whether a snapshot is to be taken now: something was served since the last one, its interval came, and
        no write is in flight."""
        return self.state is not None and self.enabled and self._came() and not self.writing()

    def wait_s(self) -> float | None:
        """How long the connection may wait before looking at `due` again (> 0 unless due now); None when nothing
        will fall due without another frame."""
        if self.state is None or not self.enabled:
            return None
        if self._came():
            return 0.0 if not self.writing() else 0.05  # taken once the write in flight ends
        if not self.every_s:
            return None
        return max(0.0, self.last_take + self.every_s - time.monotonic())

    async def take(self) -> bool:
        """Exports the session (the caller makes sure no frame is in the engine) and starts its write after the one
        in flight; returns whether the export was taken."""
        if self.state is None:
            return False
        seq, unit = self.state
        self.state, self.last_take, self.frames_taken = None, time.monotonic(), self.frames  # a failure: next interval
        try:
            snapshot = await self.export(self.sid, native_meta(seq, unit, self.frame_ms, self.model_name))
        except Exception as e:  # noqa: BLE001 - the engine's export (preempted, a timeout): said, the session goes on
            self._failed(f"the session could not be exported ({type(e).__name__}: "
                         f"{self.store.public_message(e)[:200]})")
            return False
        self.taken += 1
        previous = self._saving  # the connection's last snapshot may follow a periodic one still being written
        self._saving = asyncio.ensure_future(self._write(previous, snapshot, seq))
        return True

    async def settle(self) -> None:
        """Waits for the write in flight (if any)."""
        if self._saving is not None:
            await asyncio.shield(self._saving)

    async def _write(self, previous: asyncio.Task | None, snapshot: SessionSnapshot, seq: int) -> bool:
        if previous is not None:
            await asyncio.shield(previous)
        try:
            path = await asyncio.to_thread(self.store.save, self.lease, snapshot)
        except SnapshotStoreError as e:
            self._failed(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - a full disk, a store gone: said, never lost in a task
            self._failed(f"the session snapshot could not be written ({type(e).__name__}: "
                         f"{self.store.public_message(e)[:200]})")
            return False
        self.written += 1
        log.info("native snapshot session=%s seq=%d pages=%d -> %s", self.sid, seq, snapshot.num_pages, path)
        return True

    def _failed(self, reason: str) -> None:
        self.failed += 1
        log.warning("native snapshot session=%s failed (its previous snapshot stays): %s", self.sid, reason)
        self.report({"type": "error", "code": "snapshot_failed", "message": f"{reason}; resuming this session's "
                     f"token continues from its previous snapshot, if any"})
