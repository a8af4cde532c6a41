"""`WS /v1/realtime`: an OpenAI Realtime (GA) session, served by the Metronome engine's ticks; text output, and
speech (`output_modalities: ["audio"]`) on a checkpoint with a talker: `omnijax.serve.realtime.audio_output`.

One WebSocket is one engine session and one conversation (`omnijax.conversation`). The wire codec is
`omnijax.serve.realtime.client_events` (client events) and `realtime_server_events` (server events); this module maps
events onto the conversation and the `EngineWorker`:

- `session.update` -> `session.updated`. `session.omnijax`'s sampling settings (an extension: the GA session has no
  sampling fields; `temperature`, `top_p`, `seed`, the penalties, `top_k`, `min_p`, `logit_bias`, as chat completions
  takes them) set how this session's responses are drawn (the server's `RowSampling` gives each row of the batched
  step its own settings, `omnijax.serve.realtime.sampling`; a seed reseeds the session). `instructions` become the
  system message, fed before the next item or response (a later change is fed as a new system message where the chat
  template allows it).
  `truncation` describes the server's retention policy, which every session shares (one batched program): "auto" (any
  bounded policy) and "disabled" (the unbounded `NoSlide`) are accepted when they describe it, anything else is refused
  with the `--policy` that would give it.
- `input_audio_buffer.append` / `.commit` / `.clear` and server VAD: `omnijax.serve.realtime.audio_input`.
- `conversation.item.create`: `input_text` parts are the message's text turn, `input_image` parts (video frames
  too) image units, in the order given; `conversation.item.added` now, `.done` once fed. Items are appended (the KV
  cache is append-only): a `previous_item_id` naming the last item (or "root" on an empty conversation) is honoured,
  one naming an earlier item is refused (`unsupported`), an unknown one too (`invalid_value`), as is an `item.id`
  the conversation already holds.
- Function calling (`session.tools`, `function_call` output items, `function_call_output` items):
  `omnijax.serve.realtime.tools`.
- `response.create`: the template's generation prompt, then tau tokens per tick until the end-of-turn token or
  `max_output_tokens` ("inf": the server's `--max-output-tokens`): `response.created`, the assistant item,
  `response.output_text.delta` (whole UTF-8 characters) ... `.done`, `response.done` with usage and the session's
  KV cells; the request's `metadata` is echoed in the response object. `response.cancel` ends it at the next tick
  (status "cancelled"; what was decoded stays in the cache); a `response_id` other than the active response's is
  refused.
- A `session.update` `model` other than the served one (`--model-name`) is refused (`model_not_found`), as is a
  connection whose `?model=` names another (an `error` event, then close 1008).

A malformed or refused event gets an `error` event and changes nothing; other sessions never see it; the refusal
is logged, rate-limited per reason and peer (`omnijax.serve.refusal_log`). An audio buffer
over `max_audio_buffer_s` is refused the same way. The session ends when the socket closes; its pages return. A client
that does not read (over `--max-outbox-mb` or `max_outbox` events unread, `omnijax.serve.outbox`) is dropped: its
session ends (snapshotted when resumable), then an `error` `slow_consumer` and close 1008 go out if it reads again.

Resuming (with `ServeOptions.snapshot_dir`): `session.created` carries `"omnijax": {"resume_token": t}` in the
session object. The session (KV pages, cursor, sampling key and last logits, `omnijax.serve.engine.snapshot`, and its
conversation) is written to the server's `omnijax.serve.realtime.snapshot_store` when the connection ends (the client
leaves, it idles out, or SIGTERM/SIGINT; a response still decoding is cancelled first) and, with `--snapshot-every
30s` / `5turns`, periodically: a snapshot due when a response ends is on disk before its `response.done`, others are
taken while idle, so a SIGKILL loses at most one interval (`resume.Snapshotter`).
`/v1/realtime?resume=t` (the SDK: `connect(..., extra_query={"resume": t})`), on this server or a restarted one over
the same checkpoint and pool settings, continues from the newest snapshot exactly. A token is leased to one
connection at a time (a second one gets `resume_failed` and close 1008: no fork; a reconnect while the last snapshot
is written waits for it); the snapshot stays when resumed and the session keeps writing under its token; a damaged or
altered snapshot is refused by name (`resume.restored`); a failed write is an `error` event `snapshot_failed`. Audio
appended but not yet fed (less than a frame) is not part of a snapshot.

Idle timeout (`--idle-timeout`, 0: none): a connection whose client sends nothing for that long, with no response
decoding, is snapshotted (when resumable), sent an `error` event `idle_timeout` and closed (1000); its engine session
is freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnijax.media.image import read_image
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.snapshot import SnapshotError
from omnijax.serve.outbox import Outbox, close_slow_consumer
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime import server_events as rse
from omnijax.serve.realtime.audio_input import AudioInput
from omnijax.serve.realtime.audio_output import SpokenIds, answer_and_speech, check_audio_output, response_modalities
from omnijax.serve.realtime.duplex import DuplexRealtime
from omnijax.serve.realtime.resume import ResumeRefused, Snapshotter, resume_plan
from omnijax.serve.realtime.sampling import check_sampling, duplex_penalties, session_row
from omnijax.serve.realtime.tools import ResponseOutput, apply_tools, flush_outputs, function_output, tools_of
from omnijax.serve.refusal_log import refusals

if TYPE_CHECKING:
    from omnijax.retention.base import RetentionPolicy
    from omnijax.serve.context import ServeContext

log = logging.getLogger("omnijax.serve")


def truncation_of(policy: RetentionPolicy) -> str:
    """The Realtime `truncation` that describes a retention policy: "disabled" for `NoSlide`, else "auto"."""
    return "disabled" if type(policy).__name__ == "NoSlide" else "auto"


class RealtimeSession(AudioInput):
    """One `/v1/realtime` connection (see the module docstring).

    Args:
        ws: the accepted Starlette `WebSocket`.
        context: the server's `ServeContext`.
        sid: the engine session id (already opened).
    """

    def __init__(self, ws: WebSocket, context: ServeContext, sid: str, token: str | None = None):
        self.ws, self.context, self.sid, self.token = ws, context, sid, token
        self.worker, self.options = context.worker, context.options
        self.conversation = context.conversation()
        policy = self.worker.engine.config.stream.policy
        self.settings = rte.SessionSettings(model=self.options.model_name, truncation=truncation_of(policy))
        self.session_id = rte.new_id("sess")
        self.instructions_fed: str | None = None
        self.audio = np.zeros((0,), np.int16)  # samples at the session rate not yet fed
        self.audio_fed_s = 0.0  # seconds of audio fed since the last commit
        self.audio_ms = 0  # all audio received, in ms (VAD times)
        self.speech: dict | None = None  # server VAD: {"item": id, "start": ms, "silent_ms": n}
        self.last_item: str | None = None
        self.item_ids: set[str] = set()  # every item of the conversation (since the connection, and the last one)
        self.call_ids: set[str] = set()  # the ids of the model's function calls (a function_call_output answers one)
        self.held_outputs = 0  # function_call_output messages recorded in the conversation, not yet fed
        self.spoken = SpokenIds(context, self.conversation.units)  # the talker's prompt and media rows (`audio_output`)
        self.response_id: str | None = None  # the response in progress (or the last one)
        self.tokens_since_response = 0
        self.response: asyncio.Task | None = None
        self.outbox = Outbox(self.options.max_outbox, self.options.max_outbox_bytes)
        self.tasks: set[asyncio.Task] = set()
        self.duplex = None  # `omnijax.serve.realtime.duplex.DuplexRealtime` once duplex is on
        self.snapshots: Snapshotter | None = None  # set by `realtime_endpoint` when the session is resumable
        self.last_active = 0.0  # loop time of the client's last message or the last response's end (idle timeout)
        self._wake = asyncio.Event()  # a response ended: the receive loop checks for a due snapshot
        self.handling = asyncio.Lock()  # held while a client event is applied (a turn boundary's snapshot waits)
        timers = [x / 4 for x in (self.options.idle_timeout_s, self.options.snapshot_every_s) if x]
        self._poll_s = max(0.02, min([1.0] + timers))

    # ---------------------------------------------------------------------------------------------- transport
    def send(self, event: dict) -> None:
        """Queues a server event; one the outbox cannot hold (`max_outbox` events or `max_outbox_bytes` unread)
        ends the session: its client is dropped as a slow consumer."""
        if not self.outbox.put(event):
            self._wake.set()

    async def _writer(self) -> None:
        await self.outbox.drain(self.ws.send_text)

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def run(self) -> None:
        """Serves the connection until the client closes it or it idles out (module docstring)."""

        writer = asyncio.create_task(self._writer())
        created = rse.session_created(self.settings, self.session_id)
        if self.token is not None:
            created["session"]["omnijax"]["resume_token"] = self.token
        self.send(created)
        loop = asyncio.get_running_loop()
        self.last_active = loop.time()
        receive: asyncio.Future | None = None
        idled = False
        try:
            while True:
                if receive is None:
                    receive = asyncio.ensure_future(self.ws.receive())
                wake = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({receive, wake}, timeout=self._poll_s, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                self._wake.clear()
                if self.outbox.overflow is not None:
                    break
                if self.snapshots is not None:
                    await self.snapshots.periodic()
                if not receive.done():
                    if self._idled_out(loop.time()):
                        idled = True
                        break
                    continue
                message, receive = receive.result(), None
                self.last_active = loop.time()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is None:
                    self._refused(rte.RealtimeEventError("invalid_json", "events are JSON text messages, got a "
                                                         "binary one"))
                    continue
                try:
                    async with self.handling:
                        await self.handle(rte.parse_client_event(text, max_bytes=self.options.max_message_bytes))
                except rte.RealtimeEventError as e:
                    self._refused(e)
                else:
                    if self.snapshots is not None:
                        self.snapshots.touch()
                if self.outbox.overflow is not None:
                    break
        except WebSocketDisconnect:
            pass
        finally:
            if receive is not None:
                receive.cancel()
            await self._end(writer, idled)

    def _refused(self, e: rte.RealtimeEventError) -> None:
        """Sends a refused event's `error` event; logs the refusal, rate-limited per reason and peer."""
        peer = self.ws.client.host if self.ws.client else "?"
        refusals.refuse(e.code, peer, "realtime refuse peer=%s session=%s reason=%s param=%s: %.300s", peer, self.sid,
                        e.code, e.param, e.message)
        self.send(e.to_event())

    def _idled_out(self, now: float) -> bool:
        timeout = self.options.idle_timeout_s
        responding = self.response is not None and not self.response.done()
        return bool(timeout) and not responding and now - self.last_active >= timeout

    async def _end(self, writer: asyncio.Task, idled: bool) -> None:
        """The connection ends: the last snapshot, then (idled out) the `idle_timeout` error and the close."""
        if self.snapshots is not None:
            await self.snapshots.final()
        if idled:
            saved = self.snapshots is not None and self.snapshots.version == self.snapshots.saved
            log.info("realtime session=%s: idle for %g s, closed", self.sid, self.options.idle_timeout_s)
            self.send(rte.error_event("idle_timeout", f"the session sent nothing for {self.options.idle_timeout_s:g} "
                                      f"s, the server's idle timeout (--idle-timeout), and is closed"
                                      + ("; resume it with its token" if saved else "")))
        for task in list(self.tasks):
            task.cancel()
        if self.outbox.overflow is not None:  # the client does not read: nothing more is sent here
            writer.cancel()
            return
        self.outbox.close()
        if idled:
            try:
                await asyncio.wait_for(writer, 5.0)
                await asyncio.wait_for(self.ws.close(1000, "idle timeout"), 5.0)
            except Exception as e:  # noqa: BLE001 - the client may be gone already, or not read
                log.info("realtime session=%s: idle close: %s", self.sid, type(e).__name__)
        writer.cancel()

    # ------------------------------------------------------------------------------------------------ events
    async def handle(self, event: rte.ClientEvent) -> None:
        eid = event.event_id
        if isinstance(event, rte.SessionUpdate):
            model = event.changes.get("model", self.options.model_name)
            if model != self.options.model_name:
                raise rte.RealtimeEventError("model_not_found", f"model {model!r} does not exist: this server serves "
                                             f"{self.options.model_name!r}", event_id=eid, param="session.model")
            settings = event.apply(self.settings)
            self._check_truncation(settings.truncation, eid)
            if self.duplex is not None and not settings.duplex:
                raise rte.RealtimeEventError("unsupported", "duplex cannot be turned off once on", event_id=eid,
                                             param="session.omnijax.duplex")
            check_sampling(settings, per_row=self.worker.per_row, duplex=settings.duplex, event_id=eid,
                           vocab_size=self.worker.engine.model_config.vocab_size)
            settings = check_audio_output(self, settings, eid, dict(event.changes))
            if "tools" in event.changes or "tool_choice" in event.changes:
                settings = apply_tools(self, settings, eid)  # the template renders them; refuses changing nothing
            previous, self.settings = self.settings, settings
            if settings.seed is not None and settings.seed != previous.seed:
                await self.worker.in_engine(self.worker.engine.seed_session, self.sid, settings.seed)
            if settings.duplex and self.duplex is None:
                try:
                    self.duplex = DuplexRealtime(self, eid)  # refuses (nothing changed) when it cannot run
                except rte.RealtimeEventError:
                    self.settings = previous
                    raise
            elif self.duplex is not None:  # the next decisions' penalties (the answer so far is kept)
                self.duplex.stream.penalties = duplex_penalties(settings)
            self.send(rse.session_updated(settings, self.session_id))
        elif self.duplex is not None:
            self.duplex.handle(event)
        elif isinstance(event, rte.InputAudioBufferAppend):
            await self._append(np.frombuffer(event.audio, "<i2"), eid)
        elif isinstance(event, rte.InputAudioBufferCommit):
            await self._commit(eid)
        elif isinstance(event, rte.InputAudioBufferClear):
            self.audio = self.audio[:0]
            self.send(rse.input_audio_buffer_cleared())
        elif isinstance(event, rte.ConversationItemCreate):
            await self._item(event)
        elif isinstance(event, rte.FunctionCallOutput):
            await function_output(self, event)
        elif isinstance(event, rte.ResponseCreate):
            await self._respond(event)
        elif isinstance(event, rte.ResponseCancel):
            if self.response is None or self.response.done():
                raise rte.RealtimeEventError("response_cancel_not_active", "there is no response in progress to "
                                             "cancel", event_id=eid)
            if event.response_id is not None and event.response_id != self.response_id:
                raise rte.RealtimeEventError("invalid_value", f"response {event.response_id!r} is not the response "
                                             f"in progress ({self.response_id!r})", event_id=eid,
                                             param="response_id")
            self.spoken.cancelled = True  # a response that speaks stops after its vocoder chunk in progress
            self.worker.cancel(self.sid)

    def _check_truncation(self, truncation, eid) -> None:
        policy = self.worker.engine.config.stream.policy
        served = truncation_of(policy)
        if truncation != served:
            fix = "--policy unbounded" if truncation == "disabled" else "a bounded --policy (e.g. sink_window)"
            raise rte.RealtimeEventError(
                "unsupported", f"truncation {truncation!r} is not what this server runs: every session shares the "
                f"retention policy {policy} (one batched program), which is truncation {served!r}; start the "
                f"server with {fix} for it", event_id=eid, param="session.truncation")

    def _fail(self, e: Exception, eid, param: str | None = None):
        return rte.RealtimeEventError("invalid_value", str(e), event_id=eid, param=param)

    def _feed(self, parts, done=None) -> None:
        self.spoken.fed(parts)
        self.tokens_since_response += sum(int(np.asarray(p.valid).sum()) for p in parts)
        self._spawn(self._after(self.worker.feed(self.sid, parts), done))

    async def _after(self, fed: asyncio.Future, done=None) -> None:
        """Waits until the input is written; says so when it was not (a preempted or failed session)."""
        try:
            await fed
        except RuntimeError as e:
            self.send(rte.error_event("input_not_fed", f"input was not written to the session's cache: {e}",
                                      error_type="server_error"))
            return
        if done is not None:
            done()

    async def _instructions(self, eid) -> None:
        """Feeds the tool results held (`tools.flush_outputs`), then the session's instructions as a system message
        when they changed since last fed. Every path that feeds input calls this first."""
        await flush_outputs(self, eid)
        text = self.settings.instructions
        if text and text != self.instructions_fed:
            try:
                parts = await asyncio.to_thread(self.conversation.message, "system", text)
            except ValueError as e:
                raise self._fail(e, eid, "session.instructions") from None
            self.instructions_fed = text
            self._feed(parts)

    # ----------------------------------------------------------------------------------------- items, responses
    def _check_placement(self, event: rte.ConversationItemCreate) -> None:
        """Items are appended: `previous_item_id` may name the last item ("root" when there is none); refuses any
        other placement, and an `item.id` already in the conversation, by name."""
        eid, previous, known = event.event_id, event.previous_item_id, self.item_ids | {self.last_item}
        if event.item_id is not None and event.item_id in known:
            raise rte.RealtimeEventError("invalid_value", f"item {event.item_id!r} is already in the conversation: "
                                         f"give a new id, or none", event_id=eid, param="item.id")
        if previous is None or previous == (self.last_item or "root"):
            return
        if previous == "root" or previous in known:
            raise rte.RealtimeEventError("unsupported", f"previous_item_id {previous!r}: items can only be added at "
                                         f"the end of the conversation (its KV cache is append-only); omit it or name "
                                         f"the last item, {self.last_item or 'root'!r}", event_id=eid,
                                         param="previous_item_id")
        raise rte.RealtimeEventError("invalid_value", f"previous_item_id {previous!r} names no item of this "
                                     f"conversation", event_id=eid, param="previous_item_id")

    async def _item(self, event: rte.ConversationItemCreate) -> None:
        eid = event.event_id
        self._check_placement(event)
        images = {}
        for i, part in enumerate(event.content):  # decode every image before anything is fed
            if isinstance(part, rte.InputImage):
                try:
                    images[i] = await asyncio.to_thread(read_image, part.data)
                except ValueError as e:
                    raise self._fail(e, eid, f"item.content[{i}].image_url") from None
        await self._instructions(eid)
        def build() -> list:  # the vision encoder and the template: off the event loop
            parts = []
            for i, part in enumerate(event.content):
                parts += (self.conversation.image(images[i]) if i in images
                          else self.conversation.message(event.role, part.text))
            return parts

        try:
            parts = await asyncio.to_thread(build)
        except ValueError as e:
            raise self._fail(e, eid, "item.content") from None
        item = rse.user_item(event)
        previous, self.last_item = self.last_item, item["id"]
        self.item_ids.add(item["id"])
        self.send(rse.conversation_item_added(item, previous))
        self._feed(parts, lambda: self.send(rse.conversation_item_done(item, previous)))

    async def _respond(self, event: rte.ResponseCreate) -> None:
        eid = event.event_id
        if self.response is not None and not self.response.done():
            raise rte.RealtimeEventError("conversation_already_has_active_response", "a response is in progress: "
                                         "wait for its response.done or cancel it", event_id=eid)
        if event.instructions is not None and event.instructions != self.settings.instructions:
            raise rte.RealtimeEventError("unsupported", "per-response instructions are not supported: the "
                                         "instructions are the conversation's system message (session.update)",
                                         event_id=eid, param="response.instructions")
        limit = event.max_output_tokens if event.max_output_tokens is not None else self.settings.max_output_tokens
        cap = self.options.max_output_tokens
        max_tokens = cap if limit == "inf" else min(int(limit), cap)
        modalities, voice = response_modalities(self, event.output_modalities, eid)
        await self._instructions(eid)
        prompt = await asyncio.to_thread(self.conversation.prompt, min(self.worker.tau, max_tokens))
        self.spoken.fed(prompt.parts, response=True)
        input_tokens = self.tokens_since_response + sum(int(np.asarray(p.valid).sum()) for p in prompt.parts)
        self.tokens_since_response = 0
        answer = self.worker.respond(self.sid, prompt, max_tokens, self.conversation.continuation, self._sampling())
        self.response_id = rte.new_id("resp")
        self.response = self._spawn(self._stream(answer, limit, input_tokens, self.response_id, event.metadata,
                                                 modalities, voice, list(self.spoken.ids)))

    def _sampling(self):
        """The session's sampling row (`omnijax.serve.realtime.sampling.session_row`), or None for the default."""
        engine = self.worker.engine
        return session_row(self.settings, engine.config.stream.decoding, engine.model_config.vocab_size)

    async def _stream(self, answer, limit, input_tokens: int, rid: str, metadata: dict | None = None,
                      modalities: tuple = ("text",), voice: str | None = None, talker_prompt: list | None = None
                      ) -> None:
        spoken = voice is not None  # the answer is spoken once decoded (`audio_output`)
        created = rse.response_created(rid, max_output_tokens=limit, modalities=modalities, voice=voice)
        if metadata is not None:
            created["response"]["metadata"] = metadata
        self.send(created)
        tools = tools_of(self.settings)
        output = ResponseOutput(self, rid, tools.parser() if tools.active else None, spoken)  # message, calls
        decoder = self.context.tokenizer.stream_decoder(skip_special_tokens=True)
        status, reason, tail = await answer_and_speech(self, answer, output, decoder, voice, talker_prompt, rid)
        items = output.finish(tail, status == "completed")
        reason = {"cancelled": "client_cancelled", "max_output_tokens": "max_output_tokens"}.get(reason, reason)
        done = rse.response_done(rid, status=status, output=items, input_tokens=input_tokens,
                                 output_tokens=len(answer.tokens), kv_cells=answer.kv_cells, recall=answer.recall,
                                 reason=reason if status != "completed" else None, max_output_tokens=limit,
                                 modalities=modalities, voice=voice)
        if metadata is not None:
            done["response"]["metadata"] = metadata
        failed = await self.snapshots.turn_ended() if self.snapshots is not None else []  # on disk before done
        self.send(done)
        for event in failed:
            self.send(event)
        self.last_active = asyncio.get_running_loop().time()
        if self.snapshots is not None:
            self._wake.set()


async def realtime_endpoint(ws: WebSocket, context: ServeContext) -> None:
    """Accepts a `/v1/realtime` WebSocket, leases and checks the snapshot it resumes (or refuses with a
    `resume_failed` error and close 1008), opens its engine session (or refuses with an `overloaded` error and close
    1013), and serves it."""

    await ws.accept()
    client = ws.client.host if ws.client else "?"
    asked = ws.query_params.get("model")
    if asked is not None and asked != context.options.model_name:
        await _refuse(ws, client, "model_not_found", f"model {asked!r} does not exist: this server serves "
                      f"{context.options.model_name!r} (connect with ?model={context.options.model_name})")
        return
    try:
        plan = await resume_plan(context, ws.query_params.get("resume"))
    except ResumeRefused as e:
        await _refuse(ws, client, "resume_failed", str(e))
        return
    store, lease, snapshot = plan.store, plan.lease, plan.snapshot
    slow: str | None = None
    try:
        async with context.session(client, "rt", snapshot) as sid:
            log.info("realtime connect peer=%s session=%s%s", client, sid, " (resumed)" if snapshot else "")
            session = RealtimeSession(ws, context, sid, plan.token)
            if plan.state is not None:
                plan.state.apply(session)
            if lease is not None and store is not None:
                session.snapshots = Snapshotter(session, store, lease, resumed=snapshot is not None)
            await session.run()
            slow = session.outbox.overflow
            log.info("realtime close session=%s", sid)
    except SnapshotError as e:  # the engine refused the snapshot (another model shape, too few free pages)
        await _refuse(ws, client, "resume_failed", str(e))
    except Overloaded as e:
        await _refuse(ws, client, "overloaded", str(e))
    finally:
        if lease is not None and store is not None:  # off the event loop: a shared lease is a file or an object
            await asyncio.to_thread(store.release, lease)
    if slow is not None:  # the engine session and the lease are released first: this may wait for the client
        message = f"the client does not read what the server sends: {slow}; the connection is closed"
        refusals.refuse("slow_consumer", client, "realtime refuse peer=%s session=%s reason=slow_consumer: %s",
                        client, sid, message)
        await close_slow_consumer(ws, rte.error_event("slow_consumer", message))


async def _refuse(ws: WebSocket, client: str, code: str, message: str) -> None:
    refusals.refuse(code, client, "realtime refuse peer=%s reason=%s: %s", client, code, message)
    await ws.send_text(json.dumps(rte.error_event(code, message, error_type="server_error" if code == "overloaded"
                                                  else "invalid_request_error")))
    await ws.close(1013 if code == "overloaded" else 1008, code)
