"""Resumable Realtime sessions: what a snapshot's metadata must hold to be resumed, and a session's snapshots.

`restored` checks a snapshot's `meta` (the conversation side, `meta_of`) before anything is opened:
every field's type and range is checked by name (settings as the Realtime API takes them, the conversation's
messages as `Conversation.check_message` takes them, the unit counter and the other counters in [0,
`COUNTER_LIMIT`], the unit counter past every unit the cached tokens carry), so a damaged or tampered snapshot is
refused with a `resume_failed` error and changes nothing, instead of failing later inside the session.

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
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from omnijax.conversation import Conversation
from omnijax.serve.engine.snapshot import COUNTER_LIMIT, SessionSnapshot
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime.snapshot_store import Lease, SnapshotStore, SnapshotStoreError
from omnijax.serve.tool_calls import ToolError, check_function, check_functions

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext, ServeOptions
    from omnijax.serve.realtime.session import RealtimeSession

log = logging.getLogger("omnijax.serve")
Checked = TypeVar("Checked")  # what a connection's check makes of a snapshot it resumes
_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
TOKENS_LIMIT = 2 ** 53  # token counts (usage), as JSON numbers stay exact


class ResumeRefused(ValueError):
    """A snapshot that cannot be resumed; the message names the field and says nothing of server paths."""


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
        return Leased(store, token, store.lease_new(token))
    lease = None
    try:
        lease = await store.acquire(token)
        snapshot = await asyncio.to_thread(store.load, lease)
        return Leased(store, token, lease, snapshot, check(snapshot))
    except (ValueError, OSError) as e:  # SnapshotStoreError and ResumeRefused are ValueErrors
        if lease is not None:
            store.release(lease)
        raise ResumeRefused(store.public_message(e)) from e


# -------------------------------------------------------------------------------------------------- the metadata
@dataclasses.dataclass(frozen=True)
class Restored:
    """A checked snapshot meta: what `RealtimeSession.restore` continues."""

    settings: rte.SessionSettings
    conversation: dict
    session_id: str
    instructions_fed: str | None
    last_item: str | None
    tokens_since_response: int
    call_ids: tuple = ()
    held_outputs: int = 0  # the last messages: tool results recorded, not yet fed (`tools.flush_outputs`)
    spoken: tuple | None = None  # (text ids fed, why unspeakable or None): `audio_output.SpokenIds`; None: unknown

    def apply(self, session: RealtimeSession) -> None:
        """Continues this conversation in a new session (before its first event)."""
        session.settings = self.settings
        session.conversation.restore(self.conversation)
        session.session_id, session.instructions_fed = self.session_id, self.instructions_fed
        session.last_item, session.tokens_since_response = self.last_item, self.tokens_since_response
        session.call_ids = set(self.call_ids)
        session.held_outputs = self.held_outputs
        session.spoken.restore(self.spoken)


def meta_of(session: RealtimeSession) -> dict:
    """The conversation side of a session's snapshot (JSON data; `restored` reads it back)."""
    return {"conversation": session.conversation.state(), "settings": dataclasses.asdict(session.settings),
            "session_id": session.session_id, "instructions_fed": session.instructions_fed,
            "last_item": session.last_item, "tokens_since_response": session.tokens_since_response,
            "model": session.options.model_name, "call_ids": sorted(session.call_ids),
            "held_outputs": session.held_outputs,
            "spoken": {"ids": session.spoken.ids, "unspeakable": session.spoken.unspeakable}}


def _fail(field: str, problem: str) -> ResumeRefused:
    return ResumeRefused(f"the snapshot cannot be resumed: meta {field} {problem} (a damaged or altered snapshot)")


def _int(value: Any, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _fail(field, f"must be an integer in [{lo}, {hi}], got {_show(value)}")
    return value


def _num(value: Any, field: str, lo: float, hi: float, *, open_lo: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
    if not ok or (open_lo and value == lo):
        raise _fail(field, f"must be a number in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {_show(value)}")
    return float(value)


def _str(value: Any, field: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _fail(field, f"must be a string{' or null' if optional else ''}, got {_show(value)}")
    return value


def _bool(value: Any, field: str, *, optional: bool = False) -> bool | None:
    if (value is None and optional) or isinstance(value, bool):
        return value
    raise _fail(field, f"must be true or false, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _fields(value: Any, field: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise _fail(field, f"must be an object, got {_show(value)}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise _fail(field, f"has unknown fields {unknown}")
    return value


def settings_of(value: Any) -> rte.SessionSettings:
    """The `SessionSettings` of a snapshot's `settings` (missing fields take their defaults)."""
    names = tuple(f.name for f in dataclasses.fields(rte.SessionSettings))
    d = _fields(value, "settings", names)
    defaults = rte.SessionSettings()
    kw: dict[str, Any] = {}
    if "instructions" in d:
        kw["instructions"] = _str(d["instructions"], "settings.instructions")
    if "model" in d:
        kw["model"] = _str(d["model"], "settings.model")
    if "output_modalities" in d:
        if d["output_modalities"] not in (["text"], ("text",), ["audio"], ("audio",)):
            raise _fail("settings.output_modalities", f"must be ['text'] or ['audio'], got "
                        f"{_show(d['output_modalities'])}")
        kw["output_modalities"] = tuple(d["output_modalities"])
    kw["output_voice"] = _str(d.get("output_voice"), "settings.output_voice", optional=True)
    if d.get("output_format", "audio/pcm") != "audio/pcm":
        raise _fail("settings.output_format", f"must be 'audio/pcm', got {_show(d['output_format'])}")
    if "input_audio_rate" in d:
        kw["input_audio_rate"] = _int(d["input_audio_rate"], "settings.input_audio_rate", 16000, 24000)
        if kw["input_audio_rate"] not in (16000, 24000):
            raise _fail("settings.input_audio_rate", f"must be 24000 or 16000, got {kw['input_audio_rate']}")
    if d.get("turn_detection") is not None:
        vad = _fields(d["turn_detection"], "settings.turn_detection",
                      tuple(f.name for f in dataclasses.fields(rte.ServerVad)))
        v: dict[str, Any] = {}
        if vad.get("threshold") is not None:
            v["threshold"] = _num(vad["threshold"], "settings.turn_detection.threshold", 0.0, 1.0)
        for k in ("prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
            if vad.get(k) is not None:
                v[k] = _int(vad[k], f"settings.turn_detection.{k}", 0, COUNTER_LIMIT)
        for k in ("create_response", "interrupt_response"):
            v[k] = _bool(vad.get(k), f"settings.turn_detection.{k}", optional=True)
        kw["turn_detection"] = rte.ServerVad(**v)
    if "max_output_tokens" in d and d["max_output_tokens"] != "inf":
        kw["max_output_tokens"] = _int(d["max_output_tokens"], "settings.max_output_tokens", 1, COUNTER_LIMIT)
    if "truncation" in d:
        t = d["truncation"]
        if isinstance(t, dict):
            t = _fields(t, "settings.truncation", ("retention_ratio", "post_instructions"))
            post = t.get("post_instructions")
            kw["truncation"] = rte.RetentionRatio(
                _num(t.get("retention_ratio"), "settings.truncation.retention_ratio", 0.0, 1.0),
                None if post is None else _int(post, "settings.truncation.post_instructions", 1, COUNTER_LIMIT))
        elif t in ("auto", "disabled"):
            kw["truncation"] = t
        else:
            raise _fail("settings.truncation", f"must be 'auto', 'disabled' or a retention ratio, got {_show(t)}")
    if d.get("duplex", False) is not False:
        raise _fail("settings.duplex", "must be false: duplex sessions are not resumable")
    if d.get("temperature") is not None:
        kw["temperature"] = _num(d["temperature"], "settings.temperature", 0.0, 2.0)
    if d.get("top_p") is not None:
        kw["top_p"] = _num(d["top_p"], "settings.top_p", 0.0, 1.0, open_lo=True)
    if d.get("seed") is not None:
        kw["seed"] = _int(d["seed"], "settings.seed", *rte.SEED_RANGE)
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
        if d.get(name) is not None:
            kw[name] = _num(d[name], f"settings.{name}", lo, hi)
    if d.get("repetition_penalty") is not None:
        kw["repetition_penalty"] = _num(d["repetition_penalty"], "settings.repetition_penalty", 0.0, 2.0, open_lo=True)
    if d.get("top_k") is not None:
        kw["top_k"] = _int(d["top_k"], "settings.top_k", -1, COUNTER_LIMIT)
    if d.get("logit_bias") is not None:
        pairs = d["logit_bias"]
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise _fail("settings.logit_bias", f"must be a list of [token id, bias] pairs, got {_show(pairs)}")
        kw["logit_bias"] = tuple((_int(t, "settings.logit_bias", 0, COUNTER_LIMIT),
                                  _num(b, "settings.logit_bias", -100.0, 100.0)) for t, b in pairs)
    if d.get("tools"):
        kw["tools"] = tuple(_tools(d["tools"], "settings.tools", wrapped=False))
    if d.get("tool_choice") is not None:
        if d["tool_choice"] not in ("auto", "none"):
            raise _fail("settings.tool_choice", f"must be 'auto' or 'none', got {_show(d['tool_choice'])}")
        kw["tool_choice"] = d["tool_choice"]
    return dataclasses.replace(defaults, **kw)


def _tools(value: Any, field: str, *, wrapped: bool) -> list:
    """Function definitions as checked when set (`wrapped`: in the template's `{"type": "function", "function":
    {...}}` form)."""
    if not isinstance(value, (list, tuple)):
        raise _fail(field, f"must be a list, got {_show(value)}")
    try:
        if wrapped:
            return [{"type": "function", "function": check_function(t.get("function"), f"{field}[{i}]")}
                    if isinstance(t, dict) and t.get("type") == "function" else _bad_tool(f"{field}[{i}]")
                    for i, t in enumerate(value)]
        return list(check_functions([check_function(t, f"{field}[{i}]") for i, t in enumerate(value)], field))
    except ToolError as e:
        raise _fail(e.param, str(e)) from None


def _bad_tool(field: str) -> dict:
    raise ToolError("is not a function tool", field)


def restored(snapshot: SessionSnapshot, model_name: str) -> Restored:
    """Checks a snapshot's meta for this server (module docstring).

    Raises:
        ResumeRefused: naming the first field that is missing, of the wrong type or out of range.
    """
    meta = _fields(snapshot.meta, "", ("conversation", "settings", "session_id", "instructions_fed", "last_item",
                                        "tokens_since_response", "model", "call_ids", "held_outputs", "spoken"))
    if meta.get("model") != model_name:
        raise ResumeRefused(f"the snapshot is of model {_show(meta.get('model'))}, this server serves {model_name!r}")
    conv = _fields(meta.get("conversation"), "conversation", ("messages", "rendered", "next_unit", "tokens_fed",
                                                               "tools"))
    messages = conv.get("messages")
    if not isinstance(messages, list):
        raise _fail("conversation.messages", f"must be a list, got {_show(messages)}")
    for i, message in enumerate(messages):
        try:
            Conversation.check_message(message)
            _fields(message, f"conversation.messages[{i}]", ("role", "content", "tool_call_id"))
        except ValueError as e:
            raise _fail(f"conversation.messages[{i}]", f"is not a chat message: {str(e)[:120]}") from None
    held = snapshot.unit[snapshot.valid]
    first = int(held.max()) + 1 if held.size else 0
    state = {"messages": [dict(m) for m in messages], "rendered": _str(conv.get("rendered"), "conversation.rendered"),
             "next_unit": _int(conv.get("next_unit"), "conversation.next_unit", first, COUNTER_LIMIT),
             "tokens_fed": _int(conv.get("tokens_fed"), "conversation.tokens_fed", 0, TOKENS_LIMIT)}
    if conv.get("tools"):
        state["tools"] = _tools(conv["tools"], "conversation.tools", wrapped=True)
    call_ids = meta.get("call_ids") or []
    if not isinstance(call_ids, list) or not all(isinstance(c, str) for c in call_ids):
        raise _fail("call_ids", f"must be a list of strings, got {_show(call_ids)}")
    # tool results held unfed are the conversation's last messages (a snapshot written before they were kept: none)
    tail = len(messages) - next((i + 1 for i in range(len(messages) - 1, -1, -1)
                                 if messages[i].get("role") != "tool"), 0)
    held_outputs = _int(meta.get("held_outputs", 0), "held_outputs", 0, tail)
    spoken = None  # a snapshot written before spoken answers: the talker's prompt is unknown
    if meta.get("spoken") is not None:
        d = _fields(meta["spoken"], "spoken", ("ids", "unspeakable"))
        ids = d.get("ids")
        if (not isinstance(ids, list) or len(ids) > TOKENS_LIMIT
                or not all(type(t) is int and 0 <= t < 2 ** 31 for t in ids)):
            raise _fail("spoken.ids", f"must be a list of token ids, got {_show(ids)}")
        spoken = (tuple(ids), _str(d.get("unspeakable"), "spoken.unspeakable", optional=True))
    return Restored(settings=settings_of(meta.get("settings")), conversation=state,
                    session_id=str(_str(meta.get("session_id"), "session_id")),
                    instructions_fed=_str(meta.get("instructions_fed"), "instructions_fed", optional=True),
                    last_item=_str(meta.get("last_item"), "last_item", optional=True),
                    tokens_since_response=_int(meta.get("tokens_since_response"), "tokens_since_response", 0,
                                               TOKENS_LIMIT), call_ids=tuple(call_ids),
                    held_outputs=held_outputs, spoken=spoken)


# ------------------------------------------------------------------------------------------------- the snapshots
class Snapshotter:
    """One connection's snapshots (module docstring).

    Args:
        session: the `RealtimeSession`.
        store: the server's `SnapshotStore`.
        lease: the connection's lease on its token.
    """

    def __init__(self, session: RealtimeSession, store: SnapshotStore, lease: Lease):
        self.session, self.store, self.lease = session, store, lease
        options = session.options
        self.every_s, self.every_turns = options.snapshot_every_s, options.snapshot_every_turns
        self.version = 0  # bumped by every change (`touch`); `saved` is the version last written
        self.saved = -1 if not store.latest(lease.token) else 0
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
