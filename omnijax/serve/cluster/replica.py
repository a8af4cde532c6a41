"""One replica of `omnijax serve --replicas N`: one engine behind the server's routes, as a Ray Serve deployment class.

`omnijax.serve.cluster.launch` wraps `EngineReplica` with `serve.ingress()` and `serve.deployment(...)`; this module
itself needs Ray only to learn its replica id. Each replica builds its own `ServeContext` (the model loaded, the
engine warmed up, the snapshot store opened on the shared `--snapshot-dir`) from the picklable `build` callable the
launcher passes, and serves the same Starlette application as the single-process server, wrapped in
`ReplicaSessions`, with two more routes (behind the API key like every other):

- `GET /v1/omnijax/replica`: this replica's id, admission headroom, open sessions, held resume tokens, whether it
  drains, the sessions it opened and the admissions it refused since it started, its process id. A
  `?resume=<token>` or `?replica=<id>` query is routed like a WebSocket carrying it, so it tells which replica holds
  a session;
- `POST /v1/omnijax/drain?replica=<id>[&restart=1]`: drains that replica (`EngineReplica.drain`) and answers when
  its sessions' snapshots are on disk; with `restart=1` the replica's process then exits, and Ray Serve starts a
  fresh replica in its place (which loads the code and checkpoint installed now: one step of a rolling upgrade,
  `omnijax.serve.cluster.roll`);
- `GET /v1/omnijax/replicas`: the ids of the application's replicas alive now (starting ones included).

Routing stats (`record_routing_stats`, read by `omnijax.serve.cluster.router.SessionAwareRouter`): `replica`,
`headroom` (the AIMD cap, capped by the session limit, minus the sessions open), `sessions`, `draining`, `tokens` and
`stamp` (a counter that changes with every report).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from omnijax.serve.cluster.kv_lease import KvLeases
from omnijax.serve.cluster.lease import LeaseDir
from omnijax.serve.cluster.sessions import ReplicaSessions, query_value
from omnijax.serve.context import ServeContext, ServeOptions
from omnijax.serve.realtime.snapshot_store import Lease, SnapshotStore, SnapshotStoreError, TokenInUse
from omnijax.serve.realtime.snapshot_store_kv import KvStorage

log = logging.getLogger("omnijax.serve")
DRAIN_PATH = "/v1/omnijax/drain"
REPLICA_PATH = "/v1/omnijax/replica"
REPLICAS_PATH = "/v1/omnijax/replicas"
APP_NAME = "omnijax"
DEPLOYMENT = "omnijax"
REPLICA_ACTOR_PREFIX = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#"
RESTART_EXIT_DELAY_S = 1.0  # after a restart's drain answers: its HTTP response reaches the client first


class SharedSnapshotStore(SnapshotStore):
    """A replica's view of the `--snapshot-dir` every replica shares: the same store, plus:

    - opening it removes nothing. A plain store removes the temp folders it finds at open as what a killed write
      left, but here another replica may be writing one right then (a replica Ray Serve starts to replace a failed
      one opens its store while the others serve); `omnijax serve --replicas` cleans the directory once, before any
      replica starts;
    - a token is leased across replicas too (`omnijax.serve.cluster.lease`; in an object store
      `omnijax.serve.cluster.kv_lease`): a resume on this replica of a token
      another replica's connection holds is refused (`TokenInUse`, naming that replica) after `live_grace_s`, or
      waits for it while that connection closes; a lease whose replica died is broken (at once when its process
      is gone from this host, else when its heartbeat is `stale_s` old);
    - the size cap and the expiry see every replica's snapshots (the directory is rescanned before they act) and
      never evict a token another replica holds.

    Args:
        root: the shared directory.
        owner: this replica's id (named in refusals).
        heartbeat_s, stale_s: of the cross-replica leases (`LeaseDir`).
        **kwargs: `SnapshotStore`'s.
    """

    def __init__(self, root: str | os.PathLike, *, owner: str, heartbeat_s: float = 1.0, stale_s: float = 10.0,
                 lease_host: str | None = None, lease_pid: int | None = None, **kwargs: Any):
        max_age_s = kwargs.pop("max_age_s", None)
        if max_age_s is not None and not max_age_s >= 0:
            raise ValueError(f"max_age_s must be >= 0 (or None), got {max_age_s}")
        super().__init__(root, **kwargs)  # no expiry yet: it must see the other replicas' leases
        leases = KvLeases if isinstance(self.storage, KvStorage) else LeaseDir  # an object store, or a directory
        where = self.storage.location if isinstance(self.storage, KvStorage) else self.root
        self.shared = leases(where, owner, heartbeat_s=heartbeat_s, stale_s=stale_s, host=lease_host, pid=lease_pid)
        self.max_age_s = max_age_s or None
        self.expire()

    def _clean(self) -> int:
        return 0

    def held(self, token: str) -> bool:
        """Whether a connection of this replica, or a live one of another, holds the token."""
        return super().held(token) or self.shared.held_elsewhere(token)

    async def acquire(self, token: str) -> Lease:
        """`SnapshotStore.acquire`, then the cross-replica lease (class docstring): a holder on another replica
        that is connected is refused after `live_grace_s` (`write_wait_s` while it closes or its heartbeat is
        late, until it goes stale)."""
        lease = await super().acquire(token)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            while True:
                holder = await asyncio.to_thread(self.shared.take, token, lambda: lease.closing)
                if holder is None:
                    return lease
                waited = loop.time() - start
                beating = holder.age_s < 2 * self.shared.heartbeat_s
                if beating and not holder.closing and waited >= self.live_grace_s:
                    raise TokenInUse(f"this resume token is in use by an open connection on replica {holder.owner}; "
                                     f"a token resumes one connection at a time (close the other one first)")
                if waited >= self.write_wait_s + self.shared.stale_s:
                    raise TokenInUse(f"this resume token is still held by replica {holder.owner} after "
                                     f"{waited:.0f} s (its connection closing, or its replica unresponsive); "
                                     f"try again later")
                await asyncio.sleep(0.05)
        except BaseException:
            super().release(lease)
            raise

    def lease_new(self, token: str) -> Lease:
        lease = super().lease_new(token)
        holder = self.shared.take(token, lambda: lease.closing)
        if holder is not None:  # a fresh random token another replica holds: never, short of a broken generator
            super().release(lease)
            raise SnapshotStoreError(f"resume token already leased by replica {holder.owner}")
        return lease

    def release(self, lease: Lease) -> None:
        if self._leases.get(lease.token) is lease:
            self.shared.give_back(lease.token)
        super().release(lease)

    def _rescan(self) -> None:
        """Re-reads the directory's snapshots (every replica's writes); a folder another replica removes during the
        scan makes it look again."""
        for attempt in range(3):
            try:
                return self._scan()
            except OSError:
                if attempt == 2:
                    raise

    def expire(self) -> list[str]:
        if self.max_age_s is not None:
            self._rescan()
        return super().expire()

    def _make_room(self, budget: int, keep: str) -> bool:
        self._rescan()
        return super()._make_room(budget, keep)


def shared_store(options: ServeOptions, owner: str | None = None) -> SharedSnapshotStore:
    """The `SharedSnapshotStore` of `options.snapshot_dir` (ValueError when unusable); `owner` defaults to this Ray
    Serve replica's id."""
    return SharedSnapshotStore(options.snapshot_dir, owner=owner or current_replica_id(),
                               max_bytes=options.snapshot_max_bytes, max_age_s=options.snapshot_max_age_s)


def replica_ids() -> list[str]:
    """The ids of the application's replicas that are alive (Ray's named actors)."""
    import ray  # optional: the `omnijax[ray]` extra

    names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n[len(REPLICA_ACTOR_PREFIX):] for n in names if n.startswith(REPLICA_ACTOR_PREFIX))


def current_replica_id() -> str:
    """This Ray Serve replica's unique id (RuntimeError outside a replica)."""
    from ray import serve  # optional: the `omnijax[ray]` extra; only replicas, which Ray Serve runs, call this

    return serve.get_replica_context().replica_id.unique_id


class EngineReplica:
    """One engine and its routes (module docstring).

    Args:
        build: returns the replica's `ServeContext` (model loaded, engine warmed up, snapshot store attached) and the
            server's ASGI application for it (`omnijax.serve.app.replica_app` with its arguments bound).
        stats_period_s: how often Ray Serve collects routing stats; a drain waits for one report that says so
            before it ends connections, so routers stop sending sessions here first.
        drain_timeout_s: how long a drain waits for its connections to end (their snapshots written).
    """

    def __init__(self, build: Callable[[], tuple[ServeContext, Any]], stats_period_s: float = 1.0,
                 drain_timeout_s: float = 30.0):
        self.context, app = build()
        self.replica_id = current_replica_id()
        self.stats_period_s, self.drain_timeout_s = float(stats_period_s), float(drain_timeout_s)
        self.draining = False
        self.drained: dict | None = None
        self._stamp = 0
        self._told_draining: asyncio.Event | None = None
        app.router.routes.extend([Route(REPLICA_PATH, self._describe_route, methods=["GET"]),
                                  Route(REPLICAS_PATH, self._replicas_route, methods=["GET"]),
                                  Route(DRAIN_PATH, self._drain_route, methods=["POST"])])
        self.sessions = ReplicaSessions(app, self.replica_id)
        log.info("replica %s ready", self.replica_id)

    def __serve_build_asgi_app__(self) -> ReplicaSessions:
        return self.sessions

    # ------------------------------------------------------------------------------------------------ state
    def headroom(self) -> int:
        """Sessions this replica would still admit now: min(AIMD cap, session limit) minus sessions open (0 while
        draining)."""
        worker = self.context.worker
        cap = worker.max_sessions if worker.admission is None else min(worker.admission.cap, worker.max_sessions)
        return 0 if self.draining else max(0, cap - len(worker.lanes))

    def describe(self) -> dict:
        """What `GET /v1/omnijax/replica` answers (module docstring)."""
        worker = self.context.worker
        return {"replica": self.replica_id, "headroom": self.headroom(), "sessions": len(worker.lanes),
                "draining": self.draining, "tokens": self.sessions.tokens(), "opened": worker.stats["opened"],
                "refused": worker.stats["refused"], "pid": os.getpid()}

    async def record_routing_stats(self) -> dict:
        """Ray Serve's routing-stats hook (module docstring)."""
        self._stamp += 1
        if self.draining and self._told_draining is not None:
            self._told_draining.set()
        return {**self.describe(), "stamp": self._stamp}

    # ------------------------------------------------------------------------------------------------ drain
    async def drain(self, replica_id: str | None = None, restart: bool = False) -> dict:
        """Drains this replica: it stops taking sessions and requests (its routing stats say so, and it waits for
        Ray Serve to collect them once), ends the responses in flight, ends every WebSocket connection after its
        session's snapshot is written, and answers `{"replica", "tokens": the Realtime sessions snapshotted and
        closed, "unfinished": connections that did not end within the drain timeout, "seconds"}`. Idempotent.

        Args:
            replica_id: the replica the caller meant (the router sends the call there); ValueError naming both when
                it is another.
            restart: once drained, end this replica's process (`RESTART_EXIT_DELAY_S` after the answer) so that Ray
                Serve replaces it with a fresh one; the answer then has `"restart": true`.
        """
        if replica_id is not None and replica_id != self.replica_id:
            raise ValueError(f"drain asked for replica {replica_id!r}, but this is replica {self.replica_id!r}")
        if self.drained is None:
            await self._drain()
        assert self.drained is not None
        if restart and not self.drained.get("restart"):
            self.drained = {**self.drained, "restart": True}
            log.warning("replica %s drained for a restart: its process exits in %.1f s; Ray Serve replaces it",
                        self.replica_id, RESTART_EXIT_DELAY_S)
            asyncio.get_running_loop().call_later(RESTART_EXIT_DELAY_S, os._exit, 0)
        return self.drained

    async def _drain(self) -> None:
        began = time.monotonic()
        self._told_draining = asyncio.Event()
        self.draining = True
        log.info("replica %s draining: %d sessions open", self.replica_id, len(self.context.worker.lanes))
        self.context.worker.begin_shutdown("this replica is draining; retry, or reconnect with your resume token")
        try:  # the routers learn that this replica drains before its connections end
            await asyncio.wait_for(self._told_draining.wait(), 3 * self.stats_period_s + 5.0)
            await asyncio.sleep(min(1.0, self.stats_period_s))  # the controller's broadcast to the routers
        except TimeoutError:
            log.warning("replica %s: Ray Serve did not collect routing stats while draining", self.replica_id)
        tokens, unfinished = await self.sessions.cut_all(self.drain_timeout_s)
        self.drained = {"replica": self.replica_id, "tokens": tokens, "unfinished": unfinished,
                        "seconds": round(time.monotonic() - began, 3)}
        log.info("replica %s drained: %s", self.replica_id, self.drained)

    async def _describe_route(self, request: Request) -> JSONResponse:
        return JSONResponse(self.describe())

    async def _replicas_route(self, request: Request) -> JSONResponse:
        return JSONResponse({"replicas": await asyncio.to_thread(replica_ids)})

    async def _drain_route(self, request: Request) -> JSONResponse:
        asked = query_value(request.scope, "replica")
        restart = query_value(request.scope, "restart") or "0"
        if restart not in ("0", "1"):
            return JSONResponse({"error": {"message": f"restart is 0 or 1, got {restart!r}", "param": "restart",
                                           "type": "invalid_request_error"}}, status_code=400)
        if not asked:
            return JSONResponse({"error": {"message": "POST /v1/omnijax/drain needs ?replica=<id> (GET "
                                           "/v1/omnijax/replica names replicas)", "param": "replica",
                                           "type": "invalid_request_error"}}, status_code=400)
        if asked != self.replica_id:  # the router found no live replica of that id
            return JSONResponse({"error": {"message": f"no replica {asked!r} (this is {self.replica_id!r})",
                                           "param": "replica", "type": "invalid_request_error"}}, status_code=404)
        return JSONResponse(await self.drain(asked, restart=restart == "1"))
