"""What the server holds for one WebSocket client that has not read it yet: `Outbox`, capped in events and in bytes.

A client that stops reading makes every event the server sends it pile up in memory (a Realtime echo of a large image
item is over 10 MB). The outbox serializes each event when it is queued and counts its bytes until the transport has
taken it; an event that would take the count past `max_messages` events or `max_bytes` bytes is not queued: the
outbox `overflow`s, refuses everything after, and its session drops the client as a slow consumer
(`close_slow_consumer`). One event larger than `max_bytes` is still queued when nothing else waits (a client that reads
is never dropped for one large echo), so the bytes held never exceed `max(max_bytes, the largest event)`.

An `error` event's message is cut to `MAX_ERROR_CHARS` characters (saying so) when it is queued: refusals quote the
offending value (`got 'rrr...'`), and a client sending megabyte values it knows will be refused must not make the server
build, hold and send a megabyte echo for each. The WebSocket transport itself does not negotiate permessage-deflate
(`omnijax.serve.app`): with it, a few KB on the wire decompress to hundreds of MB of messages queued in the server
before the application reads the first, and compressed echoes never fill the socket, so neither cap would hold.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Awaitable, Callable

from starlette.websockets import WebSocket

log = logging.getLogger("omnijax.serve")
# How long a slow consumer's `error` event and close frame may wait for it to read before the server gives up on them
# (the session's engine state is released before this wait).
SLOW_CLOSE_S = 10.0
CLOSE_SLOW_CONSUMER = 1008
# The longest message an `error` event carries; a longer one (quoting a huge refused value) is cut, saying so.
MAX_ERROR_CHARS = 2048


def cap_error_message(event: dict, limit: int = MAX_ERROR_CHARS) -> dict:
    """`event` with its error message cut to `limit` characters, saying how long it was (a copy; the event itself when
    it is no `error` event or its message is short). Both shapes are handled: Realtime's `{"type": "error", "error":
    {"message": ...}}` and the native protocol's `{"type": "error", "message": ...}`."""
    if event.get("type") != "error":
        return event
    inner = event.get("error")
    holder: dict = inner if isinstance(inner, dict) else event
    message = holder.get("message")
    if not isinstance(message, str) or len(message) <= limit:
        return event
    cut = message[:limit] + f"... [message cut: {len(message):,} characters, an error event carries at most {limit:,}]"
    if holder is event:
        return {**event, "message": cut}
    return {**event, "error": {**holder, "message": cut}}


class Outbox:
    """Serialized server events queued for one client, in order (see the module docstring).

    Args:
        max_messages: the most events queued unread (the one the transport is taking included).
        max_bytes: the most bytes of serialized events queued unread.
    """

    def __init__(self, max_messages: int, max_bytes: int):
        if max_messages < 1 or max_bytes < 1:
            raise ValueError(f"max_messages and max_bytes must be >= 1, got {max_messages}, {max_bytes}")
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self._queue: collections.deque[str] = collections.deque()
        self._ready = asyncio.Event()
        self._closed = False
        self.bytes = 0  # serialized bytes queued, the event being sent included
        self.peak_bytes = 0  # the most `bytes` ever held
        self.overflow: str | None = None  # why the client was found too slow (None while it keeps up)

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, event: dict, *, force: bool = False) -> bool:
        """Queues `event` (a JSON object); False, queueing nothing, once the outbox overflowed or when the event would
        pass a cap (which sets `overflow`). `force` skips the caps (a last message before a normal close)."""
        if self.overflow is not None or self._closed:
            return False
        text = json.dumps(cap_error_message(event))  # ASCII (ensure_ascii): its length is its size on the wire
        if not force:
            if len(self._queue) >= self.max_messages:
                self.overflow = f"{len(self._queue)} events pile up unread (the cap is {self.max_messages})"
            elif self._queue and self.bytes + len(text) > self.max_bytes:
                self.overflow = (f"{self.bytes + len(text):,} bytes of events would pile up unread (the cap is "
                                 f"{self.max_bytes:,}, --max-outbox-mb)")
            if self.overflow is not None:
                self.discard()
                return False
        self._queue.append(text)
        self.bytes += len(text)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._ready.set()
        return True

    def close(self) -> None:
        """No more events: `drain` returns once what is queued has been sent."""
        self._closed = True
        self._ready.set()

    def discard(self) -> None:
        """Drops every queued event (a slow consumer's: it will not read them)."""
        self._queue.clear()
        self.bytes = 0
        self._ready.set()

    async def drain(self, send: Callable[[str], Awaitable[None]]) -> None:
        """Sends queued events with `send` (e.g. `WebSocket.send_text`) in order until `close`d and empty; an event
        counts until `send` returns (it may wait while the client does not read)."""
        while True:
            while not self._queue:
                if self._closed or self.overflow is not None:
                    return
                self._ready.clear()
                await self._ready.wait()
            text = self._queue[0]
            await send(text)
            if self._queue and self._queue[0] is text:  # `discard` may have run while `send` waited
                self._queue.popleft()
                self.bytes -= len(text)


async def close_slow_consumer(ws: WebSocket, error: dict, timeout_s: float = SLOW_CLOSE_S) -> bool:
    """Sends `error` and closes the WebSocket with 1008 "slow_consumer", giving up after `timeout_s` when the client
    still does not read; whether both went out. Call it after the session's writer is cancelled and its engine state
    released."""
    async def close() -> None:
        await ws.send_text(json.dumps(cap_error_message(error)))
        await ws.close(CLOSE_SLOW_CONSUMER, "slow_consumer")

    try:
        await asyncio.wait_for(close(), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
    except Exception as e:  # noqa: BLE001 - the client may be gone already
        log.info("slow consumer close: %s: %s", type(e).__name__, e)
        return False


__all__ = ["CLOSE_SLOW_CONSUMER", "MAX_ERROR_CHARS", "Outbox", "SLOW_CLOSE_S", "cap_error_message",
           "close_slow_consumer"]
