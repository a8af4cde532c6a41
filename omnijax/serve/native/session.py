"""`WS /session`: omnijax's native per-frame protocol, the lowest-overhead path (no JSON per frame in, no chat
template): 16 kHz PCM frames in, each frame's answer tokens out, one engine tick per frame.

Protocol (every JSON message is an object with a `type`):

1. client -> `{"type": "hello", "sample_rate": 16000, "frame_ms": F}`. `sample_rate` must be 16000; `frame_ms` may be
   omitted, otherwise it must equal the server's frame budget B. A field a message does not take is refused by name
   (`bad_message`), never ignored; a `?model=` query other than the served name is refused (`model_not_found`).
2. server -> `{"type": "ready", "session": id, "sample_rate": 16000, "frame_ms": F, "frame_samples": n}`, or
   `{"type": "error", "code": "overloaded", ...}` and close 1013 when admission (AIMD cap, session caps, no engine
   slot) refuses the session.
3. client -> binary messages, each exactly one frame: n = 16000 * F / 1000 int16 little-endian mono samples (2n bytes).
   The k-th binary message has `seq` k (from 0). Text `{"type": "bye"}` ends the session: frames already sent are
   served, then close 1000.
4. server -> per served frame `{"type": "frame", "seq": k, "tokens": [...], "text": "..." (whole UTF-8 characters;
   a split one comes with a later frame), "latency_ms": frame arrival -> reply, "queue_ms": arrival -> submission to
   the engine, "tick_ms": the engine step the frame ran in, "empty": no token although some were asked, "dropped":
   tokens the exhausted pool could not hold, "preempted": bool, "occupancy": pool pages in use / pool pages,
   "skipped": frames superseded since the previous reply}`.

Each frame is encoded (log-mel -> the model's audio encoder -> its family's audio unit, `AudioFrameEncoder`) in the
engine's thread and asks for tau answer tokens. The reply waits for its tick at most `decode_wait_fraction` x B after
the frame arrived (0.8 B, as Metronome's worker caps a tick's decode wait): a tick still running then gives the frame an
on-time empty reply with `"late": true`, and when the tick ends its tokens follow as `{"type": "late_tokens", "seq": k,
"tokens": [...], "text": "...", "latency_ms": ...}` (nothing is lost; an overloaded engine shows as a wall of empty
frames at 0.8 B, as in the paper's figures). A session has at most one frame in the engine: a frame that arrives while
the previous one is still waiting supersedes it (counted in `skipped`), so a slow server never builds a backlog.

Full duplex (MiniCPM-o 4.5, `--frame-ms 1000`): a hello with `"duplex": true` makes every binary frame one 1 s unit
of a `omnijax.serve.engine.duplex.DuplexStream` (none superseded, answered in order; the hello's optional "instructions"
are the system prompt, rendered by the chat template); `{"type": "image", "data": <base64
PNG/JPEG>}` gives the next unit its video frame; each unit's reply is `{"type": "frame", "seq": k, "tokens": [spoken
ids], "text": "...", "listened": bool, "latency_ms": ...}` (no tokens and `listened` while the model listens).

Errors close that session only, after `{"type": "error", "code": C, "message": ...}` (close 1008): `bad_json`,
`bad_message`, `no_hello`, `model_not_found`, `bad_sample_rate`, `bad_frame_ms`, `odd_byte_count`, `bad_frame_size`,
`unsupported` (image frames), `hello_timeout`, `slow_consumer` (the client does not read: more than
`--max-outbox-mb` of replies, or `max_outbox` replies, wait unread; its engine session is freed first, then the error
and the close are sent if it reads within 10 s). A frame that fails inside the server gets a non-fatal
`{"type": "error", "code": "internal", "seq": k}`. When the server shuts down, open sessions are closed with 1012.

Resume (with `--snapshot-dir`; `omnijax.serve.native.resume`): `ready` also carries `"resume_token"`, `"resumed"`
and `"seq"` (the next frame's number). When the connection ends (bye, a disconnect, the idle timeout, a replica's
drain) the session is snapshotted under its token; `/session?resume=TOKEN` continues it (its engine state and frame
numbering; a frame received but not yet served when the connection ended is dropped, as a superseded one is), or is
refused with `resume_failed` (close 1008) naming why: no such snapshot, the token in use, a Realtime snapshot, other
frame settings or model. A snapshot that fails is reported as `snapshot_failed` before the close. Full-duplex
sessions do not resume. With `--snapshot-every` (`Nturns`: every N-th served frame; `30s`: seconds) the session is
also snapshotted periodically, between two frames, its disk write in the background
(`omnijax.serve.native.snapshots`): a server killed without a drain loses at most the frames served since the last
snapshot on disk, and a resume continues bit-exactly from that snapshot (`ready`'s `seq` says which frame is next).

Idle timeout (`--idle-timeout`, 0: none): a session whose client sends nothing for that long, with no frame being
served, gets `{"type": "error", "code": "idle_timeout", ...}` naming the timeout and close 1000 ("idle timeout");
its engine session is freed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from typing import TYPE_CHECKING

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnijax.media.image import read_image
from omnijax.models.minicpmo.duplex import DuplexTokens
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.duplex import DuplexStream, speak_ids
from omnijax.serve.engine.snapshot import SnapshotError
from omnijax.serve.native.protocol import (
    CLOSE_ERROR,
    CLOSE_OVERLOADED,
    SAMPLE_RATE,
    ProtocolError,
    check_fields,
    decode_frame,
    hello_duplex,
    parse_hello,
    parse_json,
)
from omnijax.serve.native.resume import NativePlan, ResumeRefused, native_meta, native_plan
from omnijax.serve.native.snapshots import NativeSnapshots
from omnijax.serve.outbox import Outbox, close_slow_consumer
from omnijax.serve.realtime.duplex import duplex_rule
from omnijax.serve.refusal_log import refusals

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

log = logging.getLogger("omnijax.serve")
HELLO_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 10.0  # the most a close frame waits for a client that does not read


class NativeSession:
    """One `/session` connection after its hello (see the module docstring)."""

    def __init__(self, ws: WebSocket, context: ServeContext, sid: str, samples: int, peer: str):
        self.ws, self.context, self.sid, self.samples, self.peer = ws, context, sid, samples, peer
        self.worker = context.worker
        self.latest: tuple[int, np.ndarray, float] | None = None  # (seq, pcm, arrival)
        self.seq = self.unit = self.skipped = 0
        self.pump: asyncio.Task | None = None
        self.text = None if context.tokenizer is None else context.tokenizer.stream_decoder(skip_special_tokens=True)
        self.outbox = Outbox(context.options.max_outbox, context.options.max_outbox_bytes)
        self.closing: tuple[int, str] | None = None  # set by the pump to end the session
        self.last_active = 0.0  # loop time of the client's last message or the last frame's reply (idle timeout)
        self._stop = asyncio.Event()
        self.token: str | None = None  # the resume token (with --snapshot-dir; `omnijax.serve.native.resume`)
        self.resumed = False
        self.snapshots: NativeSnapshots | None = None  # periodic snapshots (--snapshot-every), set by the endpoint

    async def _receive(self) -> dict | None:
        """The next WebSocket message, or None once the pump ended the session; with an idle timeout
        (`ServeOptions.idle_timeout_s`), a session whose client sends nothing for that long while no frame is being
        served ends with `closing` (1000, "idle timeout") and None."""
        loop = asyncio.get_running_loop()
        receive = asyncio.ensure_future(self.ws.receive())
        stop = asyncio.ensure_future(self._stop.wait())
        timeout = self.context.options.idle_timeout_s
        try:
            while True:
                wait_s = None
                if timeout:  # while a frame is served, look again within a second
                    wait_s = min(timeout, 1.0) if self._busy() else self.last_active + timeout - loop.time()
                    if wait_s <= 0:
                        self._idle_out()
                        return None
                snap_s = None if self.snapshots is None else self.snapshots.wait_s()
                if snap_s is not None:  # a snapshot is pending: taken here once due, between frames
                    if self._busy():  # the pump takes it after its frame; look again soon in case it was not due
                        snap_s = min(1.0, max(0.05, self.snapshots.every_s / 4))
                    elif self.snapshots.due():  # the pump takes it: a frame arriving meanwhile waits in `latest`
                        self._start_pump(loop)
                        continue
                    wait_s = max(0.02, snap_s) if wait_s is None else min(wait_s, max(0.02, snap_s))
                done, _ = await asyncio.wait({receive, stop}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                if done:
                    self.last_active = loop.time()
                    return receive.result() if receive in done else None
        finally:
            for task in (receive, stop):
                if not task.done():
                    task.cancel()

    def _start_pump(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pump = asyncio.create_task(self._pump())
        self.pump.add_done_callback(lambda _: setattr(self, "last_active", loop.time()))

    def _busy(self) -> bool:
        """Whether a frame is being served (a session waiting for its answer is not idle)."""
        return self.pump is not None and not self.pump.done()

    def _idle_out(self) -> None:
        timeout = self.context.options.idle_timeout_s
        log.info("close peer=%s session=%s: idle for %g s", self.peer, self.sid, timeout)
        self.outbox.put({"type": "error", "code": "idle_timeout", "message": f"the session sent nothing for "
                         f"{timeout:g} s, the server's idle timeout (--idle-timeout), and is closed"}, force=True)
        self.closing = (1000, "idle timeout")

    async def _writer(self) -> None:
        await self.outbox.drain(self.ws.send_text)

    def _reply(self, message: dict) -> None:
        if not self.outbox.put(message):
            raise ProtocolError("slow_consumer", f"the client does not read its replies: {self.outbox.overflow}")

    def _refused(self, e: ProtocolError) -> None:
        """Logs a refusal (rate-limited) and queues its `error` message (a slow consumer's is sent at the close)."""
        refusals.refuse(e.code, self.peer.rsplit(":", 1)[0], "refuse peer=%s session=%s reason=%s: %s", self.peer,
                        self.sid, e.code, e)
        self.outbox.put({"type": "error", "code": e.code, "message": str(e)}, force=True)

    async def run(self) -> tuple[int, str]:
        """Serves frames until bye, an error or a disconnect; returns (close code, reason)."""

        loop = asyncio.get_running_loop()
        self.last_active = loop.time()
        writer = asyncio.create_task(self._writer())
        ready = {"type": "ready", "session": self.sid, "sample_rate": SAMPLE_RATE,
                 "frame_ms": self.context.options.frame_ms, "frame_samples": self.samples}
        if self.token is not None:
            ready.update(resume_token=self.token, resumed=self.resumed, seq=self.seq)
        self._reply(ready)
        code, reason = 1000, "disconnected"
        try:
            while self.closing is None:
                message = await self._receive()
                if message is None or message["type"] == "websocket.disconnect":
                    break
                if message.get("bytes") is not None:
                    self._on_frame(decode_frame(message["bytes"], self.samples), loop.time())
                    if self.pump is None or self.pump.done():
                        self._start_pump(loop)
                    continue
                text = parse_json(message.get("text") or "")
                check_fields(text)
                if text["type"] == "bye":
                    if self.pump is not None:
                        await self.pump
                    code, reason = 1000, "bye"
                    break
                self._on_text(text)
            if self.closing is not None:
                code, reason = self.closing
        except ProtocolError as e:
            self._refused(e)
            code, reason = CLOSE_ERROR, e.code
        except WebSocketDisconnect:
            pass
        finally:
            if self.pump is not None and not self.pump.done():
                self.pump.cancel()
            if self.outbox.overflow is not None:  # a slow consumer: its error goes out at the close
                writer.cancel()
            else:
                self.outbox.close()
                try:
                    await asyncio.wait_for(writer, 5.0)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the peer is gone or does not read
                    writer.cancel()
        return code, reason

    def _on_frame(self, pcm: np.ndarray, arrival: float) -> None:
        self.skipped += self.latest is not None
        self.latest, self.seq = (self.seq, pcm, arrival), self.seq + 1

    def _on_text(self, message: dict) -> None:
        if message["type"] == "image":
            raise ProtocolError("unsupported", "image frames are taken by duplex sessions only (hello with "
                                               "\"duplex\": true); send images over /v1/realtime")
        raise ProtocolError("bad_message", f"unexpected message type {message['type']!r} (expected binary PCM or "
                                           f"bye)")

    async def _pump(self) -> None:
        """Serves the session's latest frame until none is waiting, taking a periodic snapshot between two frames
        when one is due; a reply that cannot be queued (slow consumer) ends the session."""
        while True:
            if self.snapshots is not None and self.snapshots.due():  # nothing of this session is in the engine
                await self.snapshots.take()
            if self.latest is None:
                return
            (seq, pcm, arrival), skipped = self.latest, self.skipped
            self.latest, self.skipped = None, 0
            try:
                await self._serve(seq, pcm, arrival, skipped)
            except ProtocolError as e:
                self._refused(e)
                self.closing = (CLOSE_ERROR, e.code)
                self._stop.set()
                return
            if self.snapshots is not None:
                self.snapshots.served(seq, self.unit)

    async def _serve(self, seq: int, pcm: np.ndarray, arrival: float, skipped: int) -> None:
        """One frame: encode, submit, reply on time (see the module docstring)."""
        loop = asyncio.get_running_loop()
        submitted = loop.time()
        late = False
        try:
            chunk = await self.worker.in_engine(self.context.frame_encoder.encode, pcm, self.unit)
            self.unit += 1
            result = self.worker.frame(self.sid, chunk, self.worker.tau)
            wait = self.context.options.decode_wait_fraction * self.context.options.frame_ms / 1000
            if wait > 0:
                try:
                    out = await asyncio.wait_for(asyncio.shield(result), max(0.0, arrival + wait - loop.time()))
                except asyncio.TimeoutError:  # an empty reply on time; the tokens follow when the tick ends
                    late = True
                    self._reply({"type": "frame", "seq": seq, "tokens": [], "late": True,
                                 "latency_ms": 1e3 * (loop.time() - arrival), "queue_ms": 1e3 * (submitted - arrival),
                                 "tick_ms": None, "empty": self.worker.tau > 0, "dropped": 0, "preempted": False,
                                 "skipped": skipped, "occupancy": None})
                    out = await result
            else:
                out = await result
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed frame is reported, the session goes on
            self._reply({"type": "error", "code": "internal", "seq": seq,
                         "message": f"frame {seq} failed: {type(e).__name__}: {e}"})
            return
        tokens = [int(t) for t in out.tokens]
        message = {"type": "late_tokens" if late else "frame", "seq": seq, "tokens": tokens,
                   "latency_ms": 1e3 * (loop.time() - arrival), "queue_ms": 1e3 * (submitted - arrival),
                   "tick_ms": 1e3 * out.tick_s, "empty": self.worker.tau > 0 and not tokens,
                   "dropped": int(out.dropped), "preempted": bool(out.preempted), "skipped": skipped,
                   "occupancy": float(out.occupancy)}
        if not late:
            message["late"] = False
        if self.text is not None:
            message["text"] = self.text.push(tokens)
        self._reply(message)


class NativeDuplex(NativeSession):
    """A `/session` connection in full duplex (MiniCPM-o 4.5; see the module docstring): every frame is a 1 s unit,
    none is superseded (the streaming audio encoder needs them all), each answered in order."""

    def __init__(self, ws: WebSocket, context: ServeContext, sid: str, samples: int, peer: str,
                 instructions: str = ""):

        super().__init__(ws, context, sid, samples, peer)
        self.stream = DuplexStream(context.model, self.worker, sid, rule=duplex_rule(context.model),
                                   tokens=DuplexTokens.of(context.model))
        self.units: list[tuple[int, np.ndarray, float, np.ndarray | None]] = []
        self.frame = None
        self.prepared = False
        self.instructions = instructions

    def _on_frame(self, pcm: np.ndarray, arrival: float) -> None:
        self.units.append((self.seq, pcm.astype(np.float32) / 32768.0, arrival, self.frame))
        self.seq, self.frame = self.seq + 1, None

    def _on_text(self, message: dict) -> None:
        if message["type"] != "image":
            return super()._on_text(message)
        try:
            self.frame = read_image(base64.b64decode(message.get("data") or "", validate=True))
        except (ValueError, binascii.Error) as e:
            raise ProtocolError("bad_image", f"an image message carries a base64 PNG or JPEG in 'data': {e}") from None

    async def _pump(self) -> None:

        loop = asyncio.get_running_loop()
        try:
            if not self.prepared:
                tokenizer = self.context.tokenizer
                prompt = [{"role": "system", "content": self.instructions}]
                await self.stream.prepare(tokenizer.encode(tokenizer.render(prompt)) if self.instructions else [], [])
                self.prepared = True
            while self.units:
                seq, pcm, arrival, frame = self.units.pop(0)
                result = await self.stream.step(pcm, frame)
                ids = speak_ids(result, self.stream.markers)
                message = {"type": "frame", "seq": seq, "tokens": ids, "listened": bool(result.listened),
                           "latency_ms": 1e3 * (loop.time() - arrival), "skipped": 0, "empty": False}
                if self.text is not None:
                    message["text"] = self.text.push(ids)
                self._reply(message)
        except ProtocolError as e:
            self.closing = (CLOSE_ERROR, e.code)
            self._refused(e)
            self._stop.set()
        except Exception as e:  # noqa: BLE001 - the duplex stream cannot go on: say why and end the session
            log.warning("native duplex session=%s stopped: %s: %s", self.sid, type(e).__name__, e)
            self.outbox.put({"type": "error", "code": "internal", "message": f"duplex stopped: {e}"}, force=True)
            self.closing = (CLOSE_ERROR, "internal")
            self._stop.set()


async def native_endpoint(ws: WebSocket, context: ServeContext) -> None:
    """Accepts a `/session` WebSocket: hello, admission, frames (see the module docstring)."""


    await ws.accept()
    peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "?"

    async def refuse(code: str, message: str, close_code: int = CLOSE_ERROR, sid: str = "-") -> None:
        refusals.refuse(code, peer.rsplit(":", 1)[0], "refuse peer=%s session=%s reason=%s: %s", peer, sid, code,
                        message)
        try:
            await ws.send_text(json.dumps({"type": "error", "code": code, "message": message}))
            await ws.close(close_code, code)
        except (WebSocketDisconnect, RuntimeError):
            pass

    asked, served = ws.query_params.get("model"), context.options.model_name
    if asked is not None and asked != served:
        return await refuse("model_not_found", f"model {asked!r} does not exist: this server serves {served!r}")
    try:
        first = await asyncio.wait_for(ws.receive(), HELLO_TIMEOUT_S)
        if first["type"] == "websocket.disconnect":
            return
        hello = first.get("text") if first.get("text") is not None else first.get("bytes")
        samples = parse_hello(hello, frame_ms=context.options.frame_ms)
        duplex = hello_duplex(hello)
        instructions = parse_json(hello).get("instructions", "")
        if not isinstance(instructions, str):
            raise ProtocolError("bad_message", f"'instructions' must be a string, got {type(instructions).__name__}")
        if duplex and not context.model.family.duplex:
            raise ProtocolError("unsupported", f"full duplex needs a MiniCPM-o 4.5 checkpoint; this server runs "
                                               f"{context.model.model_type!r}")
        if duplex and samples != SAMPLE_RATE:
            raise ProtocolError("unsupported", "full duplex takes 1 s units: start the server with --frame-ms 1000")
    except asyncio.TimeoutError:
        return await refuse("hello_timeout", f"no hello within {HELLO_TIMEOUT_S:g} s")
    except ProtocolError as e:
        return await refuse(e.code, str(e))
    try:
        plan = await native_plan(context, ws.query_params.get("resume"), duplex)
    except ResumeRefused as e:
        return await refuse("resume_failed", str(e))
    try:
        async with context.session(peer.rsplit(":", 1)[0], "s", plan.snapshot) as sid:
            log.info("connect peer=%s session=%s sessions=%d%s", peer, sid, len(context.worker.lanes),
                     " (resumed)" if plan.snapshot is not None else "")
            session = (NativeDuplex(ws, context, sid, samples, peer, instructions) if duplex
                       else NativeSession(ws, context, sid, samples, peer))
            session.token, session.resumed = plan.token, plan.snapshot is not None
            session.seq, session.unit = plan.seq, plan.unit
            options = context.options
            periodic = options.snapshot_every_s or options.snapshot_every_turns
            if plan.lease is not None and plan.store is not None and periodic:
                session.snapshots = NativeSnapshots(
                    sid, context.worker.export, plan.store, plan.lease, every_s=options.snapshot_every_s,
                    every_turns=options.snapshot_every_turns, frame_ms=options.frame_ms,
                    model_name=options.model_name, report=lambda message: session.outbox.put(message, force=True))
            code, reason = await session.run()
            if session.snapshots is not None:  # a periodic write in flight ends before the lease does
                await session.snapshots.settle()
            log.info("close peer=%s session=%s reason=%s frames=%d", peer, sid, reason, session.seq)
            if plan.lease is not None and session.outbox.overflow is None:
                await _save(ws, session, plan)
        # the engine session is closed: a client that does not read can hold only its socket from here on
        if session.outbox.overflow is not None:
            await close_slow_consumer(ws, {"type": "error", "code": "slow_consumer", "message": f"the client does "
                                           f"not read its replies: {session.outbox.overflow}; the session is closed"})
            return
        try:
            await asyncio.wait_for(ws.close(code, reason if code != 1000 or reason in ("bye", "idle timeout")
                                            else ""), CLOSE_TIMEOUT_S)
        except (RuntimeError, WebSocketDisconnect, asyncio.TimeoutError):  # closed by the peer, or it does not read
            pass
    except SnapshotError as e:  # the engine refused the snapshot (another model shape, too few free pages)
        await refuse("resume_failed", str(e))
    except Overloaded as e:
        await refuse("overloaded", str(e), CLOSE_OVERLOADED)
    finally:
        if plan.lease is not None and plan.store is not None:  # off the event loop: a shared lease is a file
            await asyncio.to_thread(plan.store.release, plan.lease)


async def _save(ws: WebSocket, session: NativeSession, plan: NativePlan) -> None:
    """Snapshots an ended session under its token (its engine session still open); a failure is sent to the client
    (`snapshot_failed`, when it still listens) and logged."""
    assert plan.store is not None and plan.lease is not None
    options = session.context.options
    if session.snapshots is not None:  # generations land in order: the periodic write in flight first
        await session.snapshots.settle()
    try:
        snapshot = await session.worker.export(session.sid, native_meta(session.seq, session.unit, options.frame_ms,
                                                                        options.model_name))
        await asyncio.to_thread(plan.store.save, plan.lease, snapshot)
    except (ValueError, TimeoutError, OSError) as e:  # preempted, a full store or disk: the previous one stays
        log.warning("native session=%s: snapshot failed: %s", session.sid, e)
        with contextlib.suppress(Exception):  # the client may be gone
            await ws.send_text(json.dumps({"type": "error", "code": "snapshot_failed",
                                           "message": plan.store.public_message(e)}))
