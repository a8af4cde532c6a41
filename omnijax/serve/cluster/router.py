"""The request router of `omnijax serve --replicas N`: Ray Serve calls it for every request its proxy (or a
deployment handle) sends to the replicas, with the replicas' routing stats (`omnijax.serve.cluster.replica`).

In order:

1. a request naming a replica (`?replica=<id>` on HTTP or WebSocket, or a handle call `drain(id)` / `describe(id)`)
   goes to that replica, draining or not (it answers 404 itself when the id is not its own);
2. a request carrying a resume token (`?resume=<token>`) goes to the live replica that holds the token (a connection
   with it is open there): a reconnect then meets the lease of that replica's snapshot store, which waits for the
   closing connection's last snapshot instead of reading an older one from the shared directory;
3. everything else (chat completions, new sessions, a resume token no live replica holds) goes to the live replica
   with the most admission headroom, less the requests this router sent it since its last report and less those it
   ranked it first for that are not routed yet (ties broken at random). A burst of connections then spreads: without
   the reservation every request of the burst is ranked before the first is routed, all see the same headroom, and
   Ray Serve's pick within a rank (the shortest cached queue, the first on a tie) sent most of them to one replica
   (8 native sessions at once on two replicas of 4: 4/2 admitted, 2 refused; bench/metronome/RESULTS.md).

A draining replica is never chosen by 2 or 3; when every replica drains, requests go to them anyway and are refused
by name there, rather than waiting here forever.
"""

from __future__ import annotations

import collections
import pickle
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from omnijax.serve.cluster.sessions import query_value

TARGETED_METHODS = ("drain", "describe")  # deployment-handle methods whose first argument names the replica
RESERVE_S = 5.0  # a reservation not routed within this long (the request was cancelled) no longer counts


def _scope(pending: PendingRequest) -> dict | None:
    """The ASGI scope of a request from Ray Serve's HTTP proxy, or None (a handle call). The proxy sends its
    request object pickled (bytes it wrote itself, which the replica unpickles as well)."""
    if not pending.args:
        return None
    arg = pending.args[0]
    if isinstance(arg, bytes):
        try:
            arg = pickle.loads(arg)
        except Exception:  # noqa: BLE001 - not the proxy's request object: route it by headroom
            return None
    scope = getattr(arg, "asgi_scope", None)
    return scope if isinstance(scope, dict) else None


def request_keys(pending: PendingRequest) -> tuple[str | None, str | None]:
    """`(replica id, resume token)` a request names (each None when it names none)."""
    scope = _scope(pending)
    if scope is not None:
        return query_value(scope, "replica") or None, query_value(scope, "resume") or None
    if pending.metadata.call_method in TARGETED_METHODS and pending.args and isinstance(pending.args[0], str):
        return pending.args[0], None
    return None, None


class SessionAwareRouter(RequestRouter):
    """Ray Serve request router: replica named > resume-token holder > most admission headroom (module
    docstring)."""

    @property
    def _flying(self) -> dict[str, dict[str, Any]]:
        """replica id -> {request id: the stamp of the replica's stats when this router sent it}, for requests not
        completed yet."""
        return self.__dict__.setdefault("_omnijax_flying", {})

    @property
    def _reserved(self) -> dict[str, tuple[str, float]]:
        """request id -> (the replica this router ranked first for it, when), until the request is routed."""
        return self.__dict__.setdefault("_omnijax_reserved", {})

    def _room(self, replica: RunningReplica) -> int:
        """`_headroom` less the requests reserved for the replica."""
        rid = replica.replica_id.unique_id
        return self._headroom(replica) - sum(1 for r, _ in self._reserved.values() if r == rid)

    def _headroom(self, replica: RunningReplica) -> int:
        """Its reported headroom less the requests sent to it since that report that are still running."""
        stats = replica.routing_stats or {}
        flying = self._flying.get(replica.replica_id.unique_id, {})
        return int(stats.get("headroom", 0)) - sum(1 for stamp in flying.values() if stamp == stats.get("stamp"))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        wanted, token = request_keys(pending_request) if pending_request is not None else (None, None)
        if wanted is not None:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
            return [named] if named else [candidate_replicas]
        live = [r for r in candidate_replicas if not (r.routing_stats or {}).get("draining")]
        if not live:
            return [candidate_replicas]
        holders = [r for r in live if token is not None and token in (r.routing_stats or {}).get("tokens", ())]
        if holders:
            return [holders]
        now = time.monotonic()
        for rid, (_, when) in list(self._reserved.items()):
            if now - when > RESERVE_S:
                self._reserved.pop(rid, None)
        by_room: dict[int, list[RunningReplica]] = collections.defaultdict(list)
        for replica in live:
            by_room[self._room(replica)].append(replica)
        ranks = [by_room[room] for room in sorted(by_room, reverse=True)]
        first = random.choice(ranks[0])
        if pending_request is not None:
            self._reserved[pending_request.metadata.internal_request_id] = (first.replica_id.unique_id, now)
        rest = [r for r in ranks[0] if r is not first]
        return [[first], *([rest] if rest else []), *ranks[1:]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        replica = self.curr_replicas.get(replica_id)
        stamp = (replica.routing_stats or {}).get("stamp") if replica is not None else None
        flying = self._flying.setdefault(replica_id.unique_id, {})
        flying[pending_request.metadata.internal_request_id] = stamp
        self._reserved.pop(pending_request.metadata.internal_request_id, None)  # counted as flying now

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._flying.get(replica_id.unique_id, {}).pop(internal_request_id, None)
        self._reserved.pop(internal_request_id, None)
