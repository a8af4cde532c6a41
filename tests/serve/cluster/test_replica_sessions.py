"""`omnijax.serve.cluster.sessions.ReplicaSessions` (a replica's WebSocket middleware) without Ray or a model: plain
ASGI applications stand in for the server's routes, so what the client is sent when a drain cuts its connection is
checked message by message.

- an application that returns on the made-up disconnect without closing (a Realtime session) has the client closed
  with 1012 after it returned;
- one that closes normally itself (1000: a native session, once its snapshot is written) has that close sent as 1012
  (the client must learn to reconnect with its token), its other messages untouched;
- a close with another code (an error the application names) is passed on as it is;
- the resume token is learnt from `?resume=` or from the first message (`ready` / `session.created`), and `cut_all`
  reports the tokens of the connections that ended.
"""

import asyncio
import json

from omnijax.serve.cluster.sessions import CLOSE_SERVICE_RESTART, ReplicaSessions


def _app(close_code: int | None, first: dict | None):
    """An ASGI WebSocket application: accepts, sends `first` (as text), waits for the disconnect, then closes with
    `close_code` (None: returns without closing)."""

    async def app(scope, receive, send):
        assert scope["type"] == "websocket"
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        if first is not None:
            await send({"type": "websocket.send", "text": json.dumps(first)})
        while (await receive())["type"] != "websocket.disconnect":
            pass
        await send({"type": "websocket.send", "text": "bye"})
        if close_code is not None:
            await send({"type": "websocket.close", "code": close_code, "reason": "app's"})
    return app


def _drained(close_code: int | None, token: str, first: dict | None, query: bytes = b"") -> tuple[list[dict], list[str],
                                                                                               int]:
    """Runs one connection through the middleware, drains it; the messages the client was sent and `cut_all`'s
    report."""

    async def run():
        sessions = ReplicaSessions(_app(close_code, first), "r1")
        inbox: asyncio.Queue = asyncio.Queue()
        await inbox.put({"type": "websocket.connect"})
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "websocket", "path": "/session", "query_string": query}
        task = asyncio.ensure_future(sessions(scope, inbox.get, send))
        while not any(m["type"] == "websocket.accept" for m in sent) or (first and len(sent) < 2):
            await asyncio.sleep(0.01)
        assert sessions.tokens() == [token]  # what the replica reports to the router while it is open
        tokens, unfinished = await sessions.cut_all(5.0)
        await task
        return sent, tokens, unfinished

    return asyncio.run(run())


def test_a_connection_the_application_leaves_open_is_closed_with_1012():
    sent, tokens, unfinished = _drained(None, "a" * 32, {"type": "ready", "resume_token": "a" * 32})
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.send", "websocket.close"]
    assert sent[-1]["code"] == CLOSE_SERVICE_RESTART and "resume" in sent[-1]["reason"]
    assert tokens == ["a" * 32] and unfinished == 0


def test_a_normal_close_by_the_application_becomes_1012():
    sent, tokens, _ = _drained(1000, "b" * 32, {"type": "ready", "resume_token": "b" * 32})
    closes = [m for m in sent if m["type"] == "websocket.close"]
    assert len(closes) == 1 and closes[0]["code"] == CLOSE_SERVICE_RESTART, sent  # one close, the restart
    assert sent[-2] == {"type": "websocket.send", "text": "bye"}  # the application's own messages pass as sent
    assert tokens == ["b" * 32]


def test_another_close_code_is_passed_on():
    sent, tokens, _ = _drained(1011, "c" * 32, None, b"resume=" + b"c" * 32)
    closes = [m for m in sent if m["type"] == "websocket.close"]
    assert [(c["code"], c["reason"]) for c in closes] == [(1011, "app's")], sent
    assert tokens == ["c" * 32]
