"""The server `hostile_probe` attacks, and its clients: `omnijax serve --demo-model` in a subprocess on a free
loopback port (`ProbeServer`, the package's `omnijax.testing.served.Served` with the probe's settings: start, health
check, SIGKILL, restart, resident memory, its log), an HTTP call that reports what came back (`http`), and
WebSocket exchanges with the Realtime and native routes (`Realtime`, `native_open`), each turning what happened into
an `Observed`: refused (with the error code), accepted, dropped (a socket closed with no error message, or a 5xx), or
a verdict a scenario reached itself."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import httpx

from omnijax.testing.served import Served

KEY = "probe-key-0123"
FRAME_MS = 1000  # the server's frame budget B (its default)
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclasses.dataclass
class Observed:
    """What one case saw: `outcome` "refused" (`code`: the error code or HTTP status), "accepted", "dropped"
    (500, a socket closed with no error message: a crash), or a scenario's own verdict ("ok", "clear", "crash",
    "hang", "silent", "loss"); `detail` says what in words; `param` the field a refusal's error body names."""

    outcome: str
    detail: str = ""
    code: str | None = None
    param: str | None = None


class Busy(Exception):
    """The server refused a session as overloaded (AIMD admission, a cap): not the case's input at fault; the
    probe retries the case."""


class ProbeServer(Served):
    """The server the probe attacks: `omnijax.testing.served.Served` (started by the caller with `start`) with the
    probe's settings: an API key, frame budget `FRAME_MS`, a snapshot directory written every turn, short idle and
    queue timeouts; in its own process group. `healthy` sends the key."""

    def __init__(self, snapshot_dir: Path, *, warmup_sessions: int = 2, extra: tuple[str, ...] = ()):
        self.snapshot_dir = Path(snapshot_dir)
        super().__init__("--frame-ms", str(FRAME_MS), "--warmup-sessions", str(warmup_sessions),
                         "--max-output-tokens", "64", "--max-message-mb", "4", "--snapshot-dir", str(snapshot_dir),
                         "--snapshot-every", "1turn", "--api-key", KEY, "--idle-timeout", "120", "--queue-timeout",
                         "5", *extra, start_timeout_s=None, new_session=True)

    def healthy(self, headers: dict | None = None, timeout_s: float = 2.0) -> float | None:
        return super().healthy(AUTH if headers is None else headers, timeout_s)


_OPENED = re.compile(r"\bconnect peer=\S+ session=(\w+)")
_CLOSED = re.compile(r"\bclose (?:peer=\S+ )?session=(\w+)")


def unclosed(lines: list[str], start: int = 0) -> dict[str, int]:
    """The Realtime and native sessions the server logged as connected but not (yet) as closed, in `lines[start:]`:
    session id -> index of its connect line."""
    opened: dict[str, int] = {}
    for i in range(start, len(lines)):
        if m := _OPENED.search(lines[i]):
            opened[m.group(1)] = i
        elif m := _CLOSED.search(lines[i]):
            opened.pop(m.group(1), None)
    return opened


def problems(lines: list[str]) -> list[str]:
    """The server log lines that report a failure of the server itself (tracebacks, ASGI exceptions)."""
    return [x for x in lines if re.search(r"Traceback|Exception in ASGI|ERROR|Error in|Task exception", x)]


def error_param(body: Any) -> str | None:
    """The `param` an OpenAI error body names (None: none)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("param") is not None:
        return str(body["error"]["param"])
    return None


def error_code(body: Any) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("code") or body["error"].get("type"))
    return None


async def http(client: httpx.AsyncClient, method: str, url: str, *, body: Any = None, raw: bytes | None = None,
               headers: dict | None = None) -> Observed:
    """One HTTP request; a 2xx is "accepted", a 4xx with an OpenAI error body "refused" (code: the body's code,
    else the status), a 4xx without one "refused" with the status as code, a 5xx or a dropped connection "dropped"."""
    headers = AUTH if headers is None else headers
    try:
        if raw is not None:
            r = await client.request(method, url, content=raw, headers={"content-type": "application/json",
                                                                         **headers})
        elif body is not None:
            r = await client.request(method, url, content=json.dumps(body, allow_nan=True),
                                     headers={"content-type": "application/json", **headers})
        else:
            r = await client.request(method, url, headers=headers)
    except httpx.LocalProtocolError as e:  # the probe's own request is malformed: not the server's doing
        return Observed("wrong", f"probe error: the HTTP client refused to send it: {e}")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError) as e:
        return Observed("dropped", f"connection dropped: {type(e).__name__}: {e}")
    try:
        data = r.json()
    except ValueError:
        data = None
    text = r.text[:300]
    if r.status_code >= 500:
        return Observed("dropped", f"HTTP {r.status_code}: {text}", str(r.status_code))
    if r.status_code >= 400:
        code = error_code(data)
        if r.status_code == 429:
            retry = r.headers.get("retry-after")
            return Observed("refused", f"HTTP 429 Retry-After {retry}: {text[:160]}", "overloaded" if retry else
                            "429_without_retry_after")
        return Observed("refused", f"HTTP {r.status_code} {code}: {text[:200]}", code or str(r.status_code),
                        error_param(data))
    if isinstance(data, dict) and data.get("object") == "chat.completion":
        choice = data["choices"][0]
        return Observed("accepted", f"HTTP {r.status_code}, {data['usage']['completion_tokens']} tokens, "
                        f"finish_reason {choice['finish_reason']}")
    return Observed("accepted", f"HTTP {r.status_code}: {text[:120]}")


class Realtime:
    """One `/v1/realtime` connection (websockets' asyncio client): `events` received so far, `created` the
    `session.created` event."""

    def __init__(self, ws, created: dict):
        self.ws, self.created, self.events = ws, created, [created]

    @property
    def token(self) -> str | None:
        return ((self.created.get("session") or {}).get("omnijax") or {}).get("resume_token")

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, base_ws: str, *, query: str = "model=omnijax", headers: dict | None = None,
                   subprotocols: list[str] | None = None, max_queue: int | None = 1024, busy_ok: bool = False):
        from websockets.asyncio.client import connect

        async with connect(f"{base_ws}/v1/realtime?{query}", additional_headers=AUTH if headers is None else headers,
                           subprotocols=subprotocols, max_size=None, max_queue=max_queue, open_timeout=30,
                           ping_interval=None, close_timeout=2) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if not busy_ok and first.get("type") == "error" and first["error"].get("code") == "overloaded":
                raise Busy(first["error"].get("message"))
            yield cls(ws, first)

    async def send(self, event: Any) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else json.dumps(event, allow_nan=True))

    async def until(self, kinds: set[str], *, errors: bool = True) -> dict:
        """Events up to the first of a type in `kinds` (or an error, when `errors`); that event."""
        while True:
            event = json.loads(await self.ws.recv())
            self.events.append(event)
            if event.get("type") in kinds or (errors and event.get("type") == "error"):
                return event

    async def probe(self, event: Any, accepted: set[str]) -> Observed:
        """Sends `event`, then `input_audio_buffer.clear` as a control: an `error` event before the control's
        answer is "refused" (its code), the control answered with none is "accepted" (when `accepted` is empty, or
        one of its types came first), a close is "dropped" unless an error event said why first."""
        from websockets.exceptions import ConnectionClosed

        start = len(self.events)
        try:
            await self.send(event)
            await self.send({"type": "input_audio_buffer.clear", "event_id": "control"})
            await self.until({"input_audio_buffer.cleared"}, errors=False)
        except ConnectionClosed as e:
            return closed(e, self.events[start:])
        seen = self.events[start:]
        errors = [e for e in seen if e.get("type") == "error"]
        if errors:
            err = errors[0]["error"]
            return Observed("refused", f"error {err.get('code')}: {str(err.get('message'))[:160]}", err.get("code"))
        types = [e.get("type") for e in seen]
        if accepted and not accepted & set(types):
            return Observed("refused", f"no {sorted(accepted)} among {types}", "missing_reply")
        return Observed("accepted", "events: " + ", ".join(types[:8]))


def closed(e: Exception, seen: list[dict]) -> Observed:
    """A WebSocket that closed: "refused" when an `error` event (or a close code below 1011 with a reason) said
    why, else "dropped"."""
    rcvd = getattr(e, "rcvd", None)
    code, reason = (rcvd.code, rcvd.reason) if rcvd is not None else (1006, "no close frame")
    errors = [x for x in seen if x.get("type") == "error"]
    if errors:
        err = errors[0].get("error", errors[0])
        return Observed("refused", f"error {err.get('code')}, then close {code}: {str(err.get('message'))[:160]}",
                        str(err.get("code")))
    if code in (1008, 1009, 1013) or (code == 1000 and reason):
        return Observed("refused", f"close {code} {reason}", f"close_{code}")
    return Observed("dropped", f"socket closed {code} {reason!r} with no error event")


async def native_open(base_ws: str, *, headers: dict | None = None, subprotocols: list[str] | None = None):
    from websockets.asyncio.client import connect

    return await connect(f"{base_ws}/session", additional_headers=AUTH if headers is None else headers,
                         subprotocols=subprotocols, max_size=None, open_timeout=30, ping_interval=None,
                         close_timeout=2)


async def native_exchange(base_ws: str, messages: list, *, replies: int = 1) -> Observed:
    """Opens `/session`, sends `messages` (str: text, bytes: binary), reads until an error message and the close
    ("refused": the error code), `replies` frame replies ("accepted"), or a close with no error ("dropped")."""
    from websockets.exceptions import ConnectionClosed

    ws = await native_open(base_ws)
    seen: list[dict] = []
    try:
        for m in messages:
            await ws.send(m)
        frames = 0
        while True:
            reply = json.loads(await ws.recv())
            seen.append(reply)
            if reply.get("type") == "error":
                code = reply.get("code")
                with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
                    await asyncio.wait_for(ws.recv(), 5)
                closing = ws.close_code
                return Observed("refused", f"error {code}, close {closing}: {str(reply.get('message'))[:160]}", code)
            if reply.get("type") in ("frame", "late_tokens"):
                frames += 1
            if frames >= replies and reply.get("type") in ("frame", "late_tokens", "ready") and frames:
                return Observed("accepted", "replies: " + ", ".join(r.get("type", "?") for r in seen))
            if replies == 0 and reply.get("type") == "ready":
                return Observed("accepted", "ready")
    except ConnectionClosed as e:
        rcvd = e.rcvd
        if rcvd is not None and rcvd.code == 1000 and replies == 0:
            return Observed("accepted", f"closed 1000 {rcvd.reason!r} after {[r.get('type') for r in seen]}")
        return closed(e, [{"type": "error", "error": r} for r in seen if r.get("type") == "error"])
    finally:
        await ws.close()
