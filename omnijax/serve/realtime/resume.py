"""Resumable Realtime sessions: what a snapshot's metadata must hold to be resumed, and a session's snapshots.

A new connection's `ResumePlan` leases its token's snapshot from the server's `SnapshotStore` and checks its meta
(`restored`, in `omnijax.serve.realtime.resume_meta`: every field by name, a damaged or tampered snapshot refused with
a `resume_failed` error that changes nothing); this module re-exports those names.

`Snapshotter` writes one connection's snapshots through the server's `SnapshotStore`, only when something changed
since the last one:

- at a turn boundary: when a response ends and a snapshot is due (every `snapshot_every_turns` responses, or
  `snapshot_every_s` seconds after the last one was taken), it is taken there and is on disk before the response's
  `response.done` goes out. The client's next event waits for the export (so the conversation's meta and the cache
  it describes match), not for the disk write. A SIGKILL therefore loses only the response it cuts, never a turn
  whose `response.done` the client saw, however fast the client asks for the next one;
- between responses, every `snapshot_every_s` seconds at the first moment the session is idle (no response
  decoding, nothing queued); the export is taken then, its disk write goes on in the background while the
  connection is served;
- when the connection ends.

One write is on its way to disk at a time, in order. A write that fails (a full disk, the size cap) is reported to
the client as an `error` event (`snapshot_failed`; at a turn boundary, after that turn's `response.done`), and the
session's previous snapshot stays; it is tried again at the next interval or turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from omnijax.serve.engine.snapshot import SessionSnapshot
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime.resume_meta import TOKENS_LIMIT, Restored, ResumeRefused, meta_of, restored, settings_of
from omnijax.serve.realtime.snapshot_store import Lease, SnapshotStore, SnapshotStoreError

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext, ServeOptions
    from omnijax.serve.realtime.session import RealtimeSession

log = logging.getLogger("omnijax.serve")
__all__ = ["TOKENS_LIMIT", "Leased", "Restored", "ResumePlan", "ResumeRefused", "Snapshotter", "attach_store",
           "lease_snapshot", "meta_of", "open_store", "restored", "resume_plan", "settings_of", "store_for"]
Checked = TypeVar("Checked")  # what a connection's check makes of a snapshot it resumes
_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------------------------------- the store
def open_store(options: ServeOptions) -> SnapshotStore:
    """The `SnapshotStore` of `options.snapshot_dir` (opening it cleans it up; ValueError when unusable)."""
    return SnapshotStore(options.snapshot_dir, max_bytes=options.snapshot_max_bytes,
                         max_age_s=options.snapshot_max_age_s)


def attach_store(context: ServeContext, store: SnapshotStore | None) -> None:
    """Makes `store` the one the context's Realtime sessions use (opened at start-up by `omnijax serve`)."""
    if store is not None:
        _stores[context] = store


def store_for(context: ServeContext) -> SnapshotStore | None:
    """The context's store (opened on first use when not attached), or None without a snapshot directory."""
    if context.options.snapshot_dir is None:
        return None
    store = _stores.get(context)
    if store is None:
        store = _stores[context] = open_store(context.options)
    return store


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a new Realtime connection starts from: its token and lease (None without a store), and when it
    resumes, the snapshot and its checked meta."""

    store: SnapshotStore | None
    token: str | None
    lease: Lease | None = None
    snapshot: SessionSnapshot | None = None
    state: Restored | None = None


async def resume_plan(context: ServeContext, token: str | None) -> ResumePlan:
    """Leases a fresh token, or leases, loads and checks the snapshot of `token` (`?resume=`).

    Raises:
        ResumeRefused: the server does not resume, the token is malformed, held by another connection or has no
            readable snapshot, or its meta does not check; the message names no server path, nothing stays held.
    """
    leased = await lease_snapshot(context, token, lambda snapshot: restored(snapshot, context.options.model_name))
    return ResumePlan(leased.store, leased.token, leased.lease, leased.snapshot, leased.checked)


@dataclasses.dataclass(frozen=True)
class Leased(Generic[Checked]):
    """A connection's token and lease (None without a store) and, when it resumes, its snapshot and what the
    connection's own check made of it."""

    store: SnapshotStore | None
    token: str | None
    lease: Lease | None = None
    snapshot: SessionSnapshot | None = None
    checked: Checked | None = None


async def lease_snapshot(context: ServeContext, token: str | None,
                         check: Callable[[SessionSnapshot], Checked]) -> Leased[Checked]:
    """What Realtime and native connections share: without `token`, a fresh token and its lease; with it, the
    token's lease and snapshot, loaded off the event loop and passed through `check` (which raises `ResumeRefused`
    or another ValueError for a snapshot this connection cannot continue).

    Raises:
        ResumeRefused: the server does not resume (no or an unusable snapshot directory), the token is malformed,
            held by another connection, has no readable snapshot or fails `check`; the message names no server
            path and nothing stays held.
    """
    try:
        store = store_for(context)
    except ValueError as e:  # an unusable directory (opened at the first connection outside `omnijax serve`)
        log.error("resume: the snapshot directory cannot be used: %s", e)
        raise ResumeRefused("the server's snapshot directory cannot be used (see the server's log)") from e
    if store is None:
        if token is not None:
            raise ResumeRefused("this server does not resume sessions: start it with --snapshot-dir")
        return Leased(None, None)
    if token is None:
        token = secrets.token_hex(16)
        # off the event loop: a shared store's lease is a write every replica sees (a file, a bucket's object)
        return Leased(store, token, await asyncio.to_thread(store.lease_new, token))
    lease = None
    try:
        lease = await store.acquire(token)
        snapshot = await asyncio.to_thread(store.load, lease)
        return Leased(store, token, lease, snapshot, check(snapshot))
    except (ValueError, OSError) as e:  # SnapshotStoreError and ResumeRefused are ValueErrors
        if lease is not None:
            await asyncio.to_thread(store.release, lease)
        raise ResumeRefused(store.public_message(e)) from e


# ------------------------------------------------------------------------------------------------- the snapshots
class Snapshotter:
    """One connection's snapshots (module docstring).

    Args:
        session: the `RealtimeSession`.
        store: the server's `SnapshotStore`.
        lease: the connection's lease on its token.
        resumed: the connection resumed the token's snapshot (so one is on the store).
    """

    def __init__(self, session: RealtimeSession, store: SnapshotStore, lease: Lease, *, resumed: bool):
        self.session, self.store, self.lease = session, store, lease
        options = session.options
        self.every_s, self.every_turns = options.snapshot_every_s, options.snapshot_every_turns
        self.version = 0  # bumped by every change (`touch`); `saved` is the version last written
        # a resumed session's snapshot is on the store already (it was just read): nothing to write until it changes
        self.saved = 0 if resumed else -1
        self.turns = 0
        self.turn_due = False
        self.last_write = time.monotonic()  # when the last write was taken (exported)
        self._saving: asyncio.Task | None = None  # the disk write of the last export, while in flight
        self._held: list[dict] | None = None  # error events held back while a turn boundary's write goes on

    def touch(self) -> None:
        """Notes a change of the session (an event handled, a response ended)."""
        self.version += 1

    async def turn_ended(self) -> list[dict]:
        """A response ended and its `response.done` is not sent yet: counts the turn and, when a snapshot is due
        (every `every_turns`-th response, or `every_s` since the last one), takes it and waits until it is on disk.

        The export is taken holding the session's `handling` lock, so no client event (an item sent while the
        response decoded, or right after it) is applied between the conversation's meta and the cache export.

        Returns:
            The `snapshot_failed` error events of a failed write, for the caller to send after `response.done`.
        """
        self.touch()
        self.turns += 1
        if self.every_turns and self.turns % self.every_turns == 0:
            self.turn_due = True
        if self.session.duplex is not None or not self.due():  # duplex streams are not resumable
            return []
        self._held = []
        try:
            async with self.session.handling:
                taken = await self._take()
            if taken is not None:
                await self._write(*taken)
            return self._held
        finally:
            self._held = None

    def due(self) -> bool:
        """Whether a periodic snapshot is due (something changed, and the turn or the interval came)."""
        if self.version == self.saved:
            return False
        return self.turn_due or bool(self.every_s and time.monotonic() - self.last_write >= self.every_s)

    def idle(self) -> bool:
        s = self.session
        return (s.duplex is None and (s.response is None or s.response.done())
                and not s.worker.busy(s.sid))

    async def periodic(self) -> bool:
        """Takes a due snapshot when the session is idle and no write is in flight; its disk write goes on in the
        background (the connection keeps being served). Whether one was taken."""
        if (self._saving is not None and not self._saving.done()) or not self.due() or not self.idle():
            return False
        return await self.write(wait=False)

    async def write(self, *, wait: bool = True) -> bool:
        """Exports the session and writes it (`wait`: to the end); on failure sends `snapshot_failed` and logs.
        The caller makes sure no client event is applied meanwhile (the connection's loop, or its end)."""
        taken = await self._take()
        return taken is not None and await self._write(*taken, wait=wait)

    async def _take(self) -> tuple[SessionSnapshot, int] | None:
        """The session's export and the version it holds (None: failed, said)."""
        s = self.session
        version = self.version
        self.turn_due, self.last_write = False, time.monotonic()  # retried at the next interval or turn on failure
        try:
            return await s.worker.export(s.sid, meta_of(s)), version
        except Exception as e:  # noqa: BLE001 - the engine's export (a preempted session, a timeout)
            log.warning("realtime snapshot session=%s failed: %s: %s", s.sid, type(e).__name__, e)
            self._failed(f"the session could not be exported ({type(e).__name__}: "
                         f"{self.store.public_message(e)[:200]})")
            return None

    async def _write(self, snapshot: SessionSnapshot, version: int, *, wait: bool = True) -> bool:
        """Writes an export to disk after the write before it (one at a time, in order)."""
        if self._saving is not None and not self._saving.done():
            await asyncio.shield(self._saving)
        self._saving = asyncio.ensure_future(self._save(snapshot, version))
        return await asyncio.shield(self._saving) if wait else True  # a cancelled waiter leaves the write going

    async def _save(self, snapshot: SessionSnapshot, version: int) -> bool:
        try:
            path = await asyncio.to_thread(self.store.save, self.lease, snapshot)
        except SnapshotStoreError as e:
            self._failed(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - anything else the write raised: said, never lost in a task
            self._failed(f"the session snapshot could not be written ({type(e).__name__}: "
                         f"{self.store.public_message(e)[:200]})")
            return False
        self.saved = max(self.saved, version)
        log.info("realtime snapshot session=%s pages=%d -> %s", self.session.sid, snapshot.num_pages, path)
        return True

    def _failed(self, reason: str) -> None:
        log.warning("realtime snapshot session=%s failed (its previous snapshot stays): %s", self.session.sid, reason)
        event = rte.error_event("snapshot_failed", f"{reason}. Resuming this session's token continues from its "
                                f"previous snapshot, if any", error_type="server_error")
        if self._held is not None:
            self._held.append(event)
        else:
            self.session.send(event)

    async def final(self) -> None:
        """The connection ends: a response still decoding is cancelled, then the session is written (when it
        changed since the last write). The lease stays held (closing) until the caller releases it."""
        self.lease.closing = True
        s = self.session
        if s.duplex is not None:  # duplex streams are not resumable
            return
        try:
            if s.response is not None and not s.response.done():
                s.worker.cancel(s.sid)
                await asyncio.wait_for(asyncio.shield(s.response), 30.0)
        except Exception as e:  # noqa: BLE001 - write what the cache holds either way
            log.warning("realtime session=%s: response did not end before its snapshot: %s", s.sid, e)
        if self._saving is not None:
            await asyncio.shield(self._saving)  # one write at a time, in order
        if self.version != self.saved:
            await self.write()
