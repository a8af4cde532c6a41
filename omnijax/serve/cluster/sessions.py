"""The WebSocket connections of one replica, so a drain can move them: ASGI middleware in front of the server's app.

A drain (`ReplicaSessions.cut_all`) makes each open WebSocket's application see the client leave (its `receive`
returns `websocket.disconnect`), which is exactly what a client's own disconnect does: a Realtime session cancels
the response still decoding, writes its last snapshot and lets its resume token go. Only when the application has
returned is the client sent close code 1012 ("service restart"), so a client that reconnects at the close finds its
session's newest snapshot already on disk, on whichever replica the router sends it to. An application that closes
the cut connection itself with a normal close (1000: a native session does, once its snapshot is written) has that
close sent as 1012 too.

The middleware also learns each Realtime or native connection's resume token (the `?resume=` it connected with, or
the one the server's `session.created` event, or native `ready` message, gave it), which the replica reports to the
router, and stamps every HTTP response with the replica that served it (`x-omnijax-replica`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

log = logging.getLogger("omnijax.serve")
REPLICA_HEADER = "x-omnijax-replica"
CLOSE_SERVICE_RESTART = 1012  # RFC 6455: the server restarts; the client may reconnect
DRAINED_REASON = "replica drained; reconnect (with ?resume=<token>) to continue"

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def query_value(scope: Message, name: str) -> str | None:
    """The first `name=` value of an ASGI scope's query string, or None."""
    values = parse_qs(bytes(scope.get("query_string") or b"").decode("latin-1")).get(name)
    return values[0] if values else None


@dataclasses.dataclass(eq=False)
class _Connection:
    token: str | None
    cut: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    sniffed: bool = False  # the first text message (session.created) was read for its resume token


class ReplicaSessions:
    """ASGI middleware around one replica's server application (module docstring).

    Args:
        app: the server's ASGI application (`omnijax.serve.app.build_app`).
        replica_id: this replica's id, sent as `x-omnijax-replica` on every HTTP response.
    """

    def __init__(self, app: Callable, replica_id: str):
        self.app, self.replica_id = app, replica_id
        self.connections: set[_Connection] = set()

    def tokens(self) -> list[str]:
        """The resume tokens of the open WebSocket connections (sorted)."""
        return sorted({c.token for c in self.connections if c.token})

    async def cut_all(self, timeout_s: float) -> tuple[list[str], int]:
        """Ends every open WebSocket connection as described in the module docstring and waits (up to `timeout_s`)
        for their handlers to return. Returns the tokens of the Realtime sessions that ended (their snapshots are on
        disk) and how many connections had not ended in time."""
        connections = list(self.connections)
        for connection in connections:
            connection.cut.set()
        if connections:
            await asyncio.wait([asyncio.ensure_future(c.done.wait()) for c in connections], timeout=timeout_s)
        ended = [c for c in connections if c.done.is_set()]
        return sorted({c.token for c in ended if c.token}), len(connections) - len(ended)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            return await self.app(scope, receive, self._stamped(send))
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        token = query_value(scope, "resume")
        connection = _Connection(token=token if token else None)
        self.connections.add(connection)
        closed = False

        async def sending(message: Message) -> None:
            nonlocal closed
            kind = message["type"]
            if kind == "websocket.close" and connection.cut.is_set() and message.get("code", 1000) == 1000:
                # the application closes normally on the disconnect the drain made up (a native session does, after
                # its snapshot): the client is told the truth, a restart to reconnect from
                message = {**message, "code": CLOSE_SERVICE_RESTART, "reason": DRAINED_REASON}
            if kind == "websocket.close" or kind.startswith("websocket.http.response"):
                closed = True
            elif kind == "websocket.send" and not connection.sniffed and message.get("text"):
                connection.sniffed = True
                connection.token = connection.token or _created_token(message["text"])
            await send(message)

        try:
            await self.app(scope, self._cuttable(connection, receive), sending)
        finally:
            self.connections.discard(connection)
            if connection.cut.is_set() and not closed:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await send({"type": "websocket.close", "code": CLOSE_SERVICE_RESTART, "reason": DRAINED_REASON})
            connection.done.set()

    def _stamped(self, send: Send) -> Send:
        header = (REPLICA_HEADER.encode(), self.replica_id.encode())

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)
        return stamped

    @staticmethod
    def _cuttable(connection: _Connection, receive: Receive) -> Receive:
        """`receive`, returning `websocket.disconnect` once the connection is cut."""

        async def receiving() -> Message:
            if connection.cut.is_set():
                return {"type": "websocket.disconnect", "code": CLOSE_SERVICE_RESTART}
            inner = asyncio.ensure_future(receive())
            cut = asyncio.ensure_future(connection.cut.wait())
            try:
                await asyncio.wait({inner, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                cut.cancel()
                if not inner.done():
                    inner.cancel()
            if inner.done() and not inner.cancelled():
                return inner.result()
            return {"type": "websocket.disconnect", "code": CLOSE_SERVICE_RESTART}
        return receiving


def _created_token(text: str) -> str | None:
    """The resume token of a Realtime `session.created` event's text or of a native `/session` `ready`, or None."""
    if '"resume_token"' not in text:
        return None
    try:
        event = json.loads(text)
        token = event["resume_token"] if event["type"] == "ready" else event["session"]["omnijax"]["resume_token"]
    except (ValueError, KeyError, TypeError):
        return None
    return token if isinstance(token, str) else None
