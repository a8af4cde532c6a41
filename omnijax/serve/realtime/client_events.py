"""Wire codec for the text-output subset of the OpenAI Realtime API (GA event names).

This module is pure: it parses client events into small frozen dataclasses (the server events are built by
`omnijax.serve.realtime.server_events`). It has no transport and no model, and imports only the standard library.

Covered client events: ``session.update``, ``input_audio_buffer.append`` / ``.commit`` /
``.clear``, ``conversation.item.create`` (``message`` items, roles ``user`` and ``system``,
content parts ``input_text`` and ``input_image``), ``response.create`` and ``response.cancel``.
Any problem raises :class:`RealtimeEventError`, whose :meth:`RealtimeEventError.to_event` is the
server ``error`` event. Codes: ``invalid_json``, ``unknown_event``, ``missing_field``,
``invalid_value``, ``unsupported``, ``buffer_too_large``.

Server events: ``error`` here (``error_event``, ``server_event`` for any kind); the others in
`omnijax.serve.realtime.server_events`.

omnijax extensions (the SDK models allow extra fields, so these still validate):

* ``response.done`` carries ``"omnijax": {"kv_cells": n}`` at the event's top level: the number of
  KV-cache cells the session holds after the response.
* The session object carries ``"omnijax": {"input_audio_rate": r}``, because the SDK's PCM format
  only admits 24 kHz; a 16 kHz session reports ``{"type": "audio/pcm"}`` plus this field.
* ``session.omnijax`` (in ``session.update``; the GA session has no sampling fields): ``{"duplex": true}`` asks for
  full duplex (MiniCPM-o 4.5: the model decides per 1 s unit whether to listen or speak); ``"temperature"`` (in
  [0, 2]; 0 takes the most likely token), ``"top_p"`` (in (0, 1]) and ``"seed"`` (an int) set how the session's
  responses are sampled. The session object echoes them.
* ``session.truncation`` ``{"type": "retention_ratio", "retention_ratio": f}`` is accepted and
  mapped onto the retention policy by the server (this codec only validates and carries it).

Refused, and why:

* Audio output (``output_modalities`` containing ``"audio"``): omnijax serves text only.
* Input audio formats other than 16-bit mono ``audio/pcm`` at 24000 or 16000 Hz (no G.711).
* Turn detection other than ``null`` or ``server_vad`` (no semantic VAD model).
* Image URLs that are not base64 ``data:image/...`` URLs: the server never fetches from the network.
* Out-of-band responses (``conversation`` other than ``"auto"``, or ``input``) and tools.
* Audio appends that are not base64, hold an odd byte count, or exceed ``max_bytes``.

The SDK's GA session object has no sampling fields (no ``temperature``): sampling comes through ``session.omnijax``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, NoReturn, Optional, Union

# `omnijax.decoding.SEED_RANGE` (signed 64-bit), spelled here: this module imports neither jax nor the package.
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)

__all__ = [
    "ClientEvent", "ConversationItemCreate", "DEFAULT_MAX_BYTES", "InputAudioBufferAppend", "InputAudioBufferClear",
    "InputAudioBufferCommit", "InputImage", "InputText", "RealtimeEventError", "ResponseCancel", "ResponseCreate",
    "RetentionRatio", "ServerVad", "SessionSettings", "SessionUpdate", "error_event", "new_id", "parse_client_event",
    "server_event",
]

DEFAULT_MAX_BYTES = 15 * 1024 * 1024
_RATES = (24000, 16000)
_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """Returns a fresh id such as ``event_000001a3f...``: a prefix, a process counter and uuid hex."""
    return f"{prefix}_{next(_counter):06d}{uuid.uuid4().hex[:16]}"


class RealtimeEventError(Exception):
    """A client event the codec refuses.

    Args:
        code: Machine-readable code, e.g. ``invalid_value``.
        message: Human-readable message naming the problem.
        event_id: The offending client event's ``event_id``, if it had one.
        param: Dotted path of the offending field, if any.
    """

    def __init__(self, code: str, message: str, *, event_id: Optional[str] = None, param: Optional[str] = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.event_id, self.param = code, message, event_id, param

    def to_event(self) -> dict:
        """Returns the server ``error`` event describing this error."""
        return error_event(self.code, self.message, event_id=self.event_id, param=self.param)


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ServerVad:
    """Accepted ``server_vad`` turn-detection settings; ``None`` means the server default."""
    threshold: Optional[float] = None
    prefix_padding_ms: Optional[int] = None
    silence_duration_ms: Optional[int] = None
    idle_timeout_ms: Optional[int] = None
    create_response: Optional[bool] = None
    interrupt_response: Optional[bool] = None


@dataclass(frozen=True)
class RetentionRatio:
    """``retention_ratio`` truncation, mapped onto the retention policy by the server."""
    retention_ratio: float
    post_instructions: Optional[int] = None


@dataclass(frozen=True)
class SessionSettings:
    """Session settings accepted so far, with defaults.

    Attributes:
        instructions: System instructions.
        output_modalities: Always ``("text",)``.
        input_audio_rate: PCM16 input sample rate, 24000 or 16000.
        turn_detection: ``None`` (manual commits) or :class:`ServerVad`.
        max_output_tokens: Integer limit or ``"inf"``.
        truncation: ``"auto"``, ``"disabled"`` or :class:`RetentionRatio`.
        model: Model name reported to the client.
        duplex: Full duplex (omnijax extension ``session.omnijax.duplex``).
        temperature, top_p, seed: Sampling of responses (omnijax extension; None: the server's default).
    """
    instructions: str = ""
    output_modalities: tuple = ("text",)
    input_audio_rate: int = 24000
    turn_detection: Optional[ServerVad] = None
    max_output_tokens: Union[int, Literal["inf"]] = "inf"
    truncation: Union[Literal["auto", "disabled"], RetentionRatio] = "auto"
    model: str = "omnijax"
    duplex: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None


# ----------------------------------------------------------------------------- client events
@dataclass(frozen=True)
class SessionUpdate:
    """``session.update``; ``changes`` maps :class:`SessionSettings` field names to new values."""
    event_id: Optional[str]
    changes: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, settings: SessionSettings) -> SessionSettings:
        """Returns ``settings`` with this update's changes applied."""
        return dataclasses.replace(settings, **self.changes)


@dataclass(frozen=True)
class InputAudioBufferAppend:
    """``input_audio_buffer.append`` with the decoded PCM16 bytes."""
    event_id: Optional[str]
    audio: bytes


@dataclass(frozen=True)
class InputAudioBufferCommit:
    """``input_audio_buffer.commit``."""
    event_id: Optional[str]


@dataclass(frozen=True)
class InputAudioBufferClear:
    """``input_audio_buffer.clear``."""
    event_id: Optional[str]


@dataclass(frozen=True)
class InputText:
    """An ``input_text`` content part."""
    text: str


@dataclass(frozen=True)
class InputImage:
    """An ``input_image`` content part decoded from a base64 data URL."""
    data: bytes
    mime_type: str
    detail: str = "auto"


@dataclass(frozen=True)
class ConversationItemCreate:
    """``conversation.item.create`` for a ``message`` item."""
    event_id: Optional[str]
    item_id: Optional[str]
    role: Literal["user", "system"]
    content: tuple
    previous_item_id: Optional[str] = None


@dataclass(frozen=True)
class ResponseCreate:
    """``response.create``; ``None`` fields fall back to the session settings."""
    event_id: Optional[str]
    instructions: Optional[str] = None
    max_output_tokens: Union[int, Literal["inf"], None] = None
    output_modalities: Optional[tuple] = None


@dataclass(frozen=True)
class ResponseCancel:
    """``response.cancel``; ``response_id`` ``None`` means the in-progress response."""
    event_id: Optional[str]
    response_id: Optional[str] = None


ClientEvent = Union[SessionUpdate, InputAudioBufferAppend, InputAudioBufferCommit, InputAudioBufferClear,
                    ConversationItemCreate, ResponseCreate, ResponseCancel]


class _Ctx:
    """Field access helpers that raise :class:`RealtimeEventError` tagged with the event id."""

    def __init__(self, event_id: Optional[str]):
        self.event_id = event_id

    def fail(self, code: str, message: str, param: Optional[str] = None) -> NoReturn:
        raise RealtimeEventError(code, message, event_id=self.event_id, param=param)

    def obj(self, value: Any, param: str) -> dict:
        if not isinstance(value, dict):
            self.fail("invalid_value", f"'{param}' must be an object, got {type(value).__name__}", param)
        return value

    def req(self, d: dict, key: str, param: str) -> Any:
        if key not in d:
            self.fail("missing_field", f"missing required field '{param}'", param)
        return d[key]

    def str_(self, value: Any, param: str, optional: bool = False) -> Optional[str]:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            self.fail("invalid_value", f"'{param}' must be a string, got {type(value).__name__}", param)
        return value

    def num(self, value: Any, param: str, kind: type = int, lo: float | None = None, hi: float | None = None):
        ok = isinstance(value, int) and not isinstance(value, bool)
        if kind is float:
            ok = ok or isinstance(value, float)
        if not ok:
            self.fail("invalid_value", f"'{param}' must be {'a number' if kind is float else 'an integer'}", param)
        if isinstance(value, float) and not math.isfinite(value):
            self.fail("invalid_value", f"'{param}' must be finite, got {value}", param)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            self.fail("invalid_value", f"'{param}' must be in [{lo}, {hi}], got {value}", param)
        return value

    def max_tokens(self, value: Any, param: str) -> Union[int, str]:
        if value == "inf" and isinstance(value, str):
            return "inf"
        if isinstance(value, str):
            self.fail("invalid_value", f"'{param}' must be an integer or \"inf\", got {value!r}", param)
        return self.num(value, param, int, 1)

    def modalities(self, value: Any, param: str) -> tuple:
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            self.fail("invalid_value", f"'{param}' must be a list of strings", param)
        if "audio" in value:
            self.fail("invalid_value", f"'{param}': audio output is not supported; omnijax outputs text only "
                      "(use [\"text\"])", param)
        if list(value) != ["text"]:
            self.fail("invalid_value", f"'{param}' must be [\"text\"], got {value!r}", param)
        return ("text",)

    def b64(self, value: Any, param: str, max_bytes: int) -> bytes:
        s = self.str_(value, param)
        if (len(s) // 4) * 3 > max_bytes + 3:
            self.fail("buffer_too_large", f"'{param}' decodes to more than the limit of {max_bytes} bytes", param)
        try:
            data = base64.b64decode(s, validate=True)
        except (binascii.Error, ValueError) as e:
            self.fail("invalid_value", f"'{param}' is not valid base64: {e}", param)
        if len(data) > max_bytes:
            self.fail("buffer_too_large", f"'{param}' decodes to {len(data)} bytes, over the limit of "
                      f"{max_bytes} bytes", param)
        return data


def _parse_session(c: _Ctx, s: dict) -> dict:
    changes: dict = {}
    if "type" in s and s["type"] != "realtime":
        c.fail("invalid_value", f"'session.type' must be \"realtime\", got {s['type']!r}", "session.type")
    if "instructions" in s:
        changes["instructions"] = c.str_(s["instructions"], "session.instructions")
    if "model" in s:
        changes["model"] = c.str_(s["model"], "session.model")
    if "output_modalities" in s:
        changes["output_modalities"] = c.modalities(s["output_modalities"], "session.output_modalities")
    if "max_output_tokens" in s:
        changes["max_output_tokens"] = c.max_tokens(s["max_output_tokens"], "session.max_output_tokens")
    if s.get("tools"):
        c.fail("unsupported", "'session.tools': tools are not supported", "session.tools")
    if s.get("omnijax") is not None:
        ext = c.obj(s["omnijax"], "session.omnijax")
        unknown = sorted(set(ext) - {"duplex", "temperature", "top_p", "seed"})
        if unknown:
            c.fail("invalid_value", f"'session.omnijax' takes 'duplex', 'temperature', 'top_p' and 'seed', got "
                   f"{unknown}", "session.omnijax")
        if ext.get("temperature") is not None:
            changes["temperature"] = float(c.num(ext["temperature"], "session.omnijax.temperature", float, 0.0, 2.0))
        if ext.get("top_p") is not None:
            top_p = float(c.num(ext["top_p"], "session.omnijax.top_p", float, 0.0, 1.0))
            if top_p <= 0:
                c.fail("invalid_value", "'session.omnijax.top_p' must lie in (0, 1]", "session.omnijax.top_p")
            changes["top_p"] = top_p
        if ext.get("seed") is not None:
            changes["seed"] = int(c.num(ext["seed"], "session.omnijax.seed", int, *SEED_RANGE))
        if "duplex" in ext:
            if not isinstance(ext["duplex"], bool):
                c.fail("invalid_value", "'session.omnijax.duplex' must be a boolean", "session.omnijax.duplex")
            changes["duplex"] = ext["duplex"]
    if "truncation" in s:
        t, p = s["truncation"], "session.truncation"
        if isinstance(t, str) and t in ("auto", "disabled"):
            changes["truncation"] = t
        elif isinstance(t, dict) and t.get("type") == "retention_ratio":
            ratio = c.num(c.req(t, "retention_ratio", p + ".retention_ratio"), p + ".retention_ratio", float, 0.0, 1.0)
            post = None
            if t.get("token_limits") is not None:
                lim = c.obj(t["token_limits"], p + ".token_limits")
                if lim.get("post_instructions") is not None:
                    post = c.num(lim["post_instructions"], p + ".token_limits.post_instructions", int, 1)
            changes["truncation"] = RetentionRatio(float(ratio), post)
        else:
            c.fail("invalid_value", f"'{p}' must be \"auto\", \"disabled\" or "
                   f"{{\"type\": \"retention_ratio\", \"retention_ratio\": float}}, got {t!r}", p)
    audio = s.get("audio")
    if audio is not None:
        audio = c.obj(audio, "session.audio")
        out = audio.get("output")
        if isinstance(out, dict) and out.get("format") is not None:
            c.fail("invalid_value", "'session.audio.output': audio output is not supported; omnijax outputs "
                   "text only", "session.audio.output")
        inp = audio.get("input")
        if inp is not None:
            inp = c.obj(inp, "session.audio.input")
            if "format" in inp:
                p = "session.audio.input.format"
                f = c.obj(inp["format"], p)
                if f.get("type") != "audio/pcm":
                    c.fail("invalid_value", f"'{p}.type' must be \"audio/pcm\" (16-bit mono PCM); "
                           f"{f.get('type')!r} is not supported", p + ".type")
                rate = f.get("rate", 24000)
                if isinstance(rate, bool) or rate not in _RATES:
                    c.fail("invalid_value", f"'{p}.rate' must be 24000 or 16000, got {rate!r}", p + ".rate")
                changes["input_audio_rate"] = int(rate)
            if "turn_detection" in inp:
                changes["turn_detection"] = _parse_vad(c, inp["turn_detection"])
    return changes


def _parse_vad(c: _Ctx, td: Any) -> Optional[ServerVad]:
    p = "session.audio.input.turn_detection"
    if td is None:
        return None
    td = c.obj(td, p)
    if td.get("type") != "server_vad":
        c.fail("invalid_value", f"'{p}.type' must be \"server_vad\" (or turn_detection null), "
               f"got {td.get('type')!r}", p + ".type")
    kw: dict = {}
    if td.get("threshold") is not None:
        kw["threshold"] = float(c.num(td["threshold"], p + ".threshold", float, 0.0, 1.0))
    for k in ("prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
        if td.get(k) is not None:
            kw[k] = c.num(td[k], f"{p}.{k}", int, 0)
    for k in ("create_response", "interrupt_response"):
        if td.get(k) is not None:
            if not isinstance(td[k], bool):
                c.fail("invalid_value", f"'{p}.{k}' must be a boolean", f"{p}.{k}")
            kw[k] = td[k]
    return ServerVad(**kw)


def _parse_image(c: _Ctx, url: Any, param: str, max_bytes: int) -> tuple:
    url = c.str_(url, param)
    if not url.startswith("data:"):
        c.fail("invalid_value", f"'{param}' must be a base64 data URL (data:image/...;base64,...); "
               "remote URLs are refused because the server never fetches from the network", param)
    head, sep, payload = url[5:].partition(",")
    mime, _, enc = head.partition(";")
    if not sep or enc != "base64" or not mime.startswith("image/"):
        c.fail("invalid_value", f"'{param}' must look like data:image/<type>;base64,<data>", param)
    return c.b64(payload, param, max_bytes), mime


def _parse_item(c: _Ctx, item: dict, max_bytes: int) -> tuple:
    if c.req(item, "type", "item.type") != "message":
        c.fail("invalid_value", f"'item.type' must be \"message\", got {item['type']!r}", "item.type")
    role = c.req(item, "role", "item.role")
    if role not in ("user", "system"):
        c.fail("invalid_value", f"'item.role' must be \"user\" or \"system\", got {role!r}", "item.role")
    content = c.req(item, "content", "item.content")
    if not isinstance(content, list) or not content:
        c.fail("invalid_value", "'item.content' must be a non-empty list", "item.content")
    parts = []
    for i, part in enumerate(content):
        p = f"item.content[{i}]"
        part = c.obj(part, p)
        kind = c.req(part, "type", p + ".type")
        if kind == "input_text":
            parts.append(InputText(c.str_(c.req(part, "text", p + ".text"), p + ".text")))
        elif kind == "input_image" and role == "user":
            data, mime = _parse_image(c, c.req(part, "image_url", p + ".image_url"), p + ".image_url", max_bytes)
            detail = part.get("detail") or "auto"
            if detail not in ("auto", "low", "high"):
                c.fail("invalid_value", f"'{p}.detail' must be auto, low or high", p + ".detail")
            parts.append(InputImage(data, mime, detail))
        else:
            c.fail("invalid_value", f"'{p}.type' {kind!r} is not supported for role {role!r} "
                   "(use input_text, or input_image for user messages)", p + ".type")
    return role, tuple(parts)


def parse_client_event(event: Union[str, bytes, Mapping[str, Any]], *, max_bytes: int = DEFAULT_MAX_BYTES
                       ) -> ClientEvent:
    """Validates one client event and returns its dataclass.

    Args:
        event: The JSON text of the event, or the already decoded dict.
        max_bytes: Largest decoded payload (audio append or image) accepted.

    Returns:
        One of the :data:`ClientEvent` dataclasses.

    Raises:
        RealtimeEventError: For malformed JSON, unknown types, missing fields or refused values.
    """
    if isinstance(event, (str, bytes, bytearray)):
        try:
            event = json.loads(event)
        except (ValueError, RecursionError) as e:
            raise RealtimeEventError("invalid_json", f"event is not valid JSON: {e}") from None
    if not isinstance(event, Mapping):
        raise RealtimeEventError("invalid_json", f"event must be a JSON object, got {type(event).__name__}")
    event = dict(event)
    eid = event.get("event_id")
    c = _Ctx(eid if isinstance(eid, str) else None)
    c.str_(eid, "event_id", optional=True)
    kind = c.req(event, "type", "type")
    if kind == "session.update":
        return SessionUpdate(c.event_id, _parse_session(c, c.obj(c.req(event, "session", "session"), "session")))
    if kind == "input_audio_buffer.append":
        data = c.b64(c.req(event, "audio", "audio"), "audio", max_bytes)
        if len(data) % 2:
            c.fail("invalid_value", f"'audio' decodes to {len(data)} bytes, an odd count; 16-bit PCM needs "
                   "an even number of bytes", "audio")
        return InputAudioBufferAppend(c.event_id, data)
    if kind == "input_audio_buffer.commit":
        return InputAudioBufferCommit(c.event_id)
    if kind == "input_audio_buffer.clear":
        return InputAudioBufferClear(c.event_id)
    if kind == "conversation.item.create":
        item = c.obj(c.req(event, "item", "item"), "item")
        role, parts = _parse_item(c, item, max_bytes)
        return ConversationItemCreate(c.event_id, c.str_(item.get("id"), "item.id", optional=True), role, parts,
                                      c.str_(event.get("previous_item_id"), "previous_item_id", optional=True))
    if kind == "response.create":
        r = event.get("response")
        if r is None:
            return ResponseCreate(c.event_id)
        r = c.obj(r, "response")
        if r.get("conversation", "auto") != "auto" or r.get("input") is not None:
            c.fail("unsupported", "out-of-band responses ('response.conversation' other than \"auto\", "
                   "'response.input') are not supported", "response.conversation")
        if r.get("tools"):
            c.fail("unsupported", "'response.tools': tools are not supported", "response.tools")
        mods = r.get("output_modalities")
        mot = r.get("max_output_tokens")
        return ResponseCreate(
            c.event_id, c.str_(r.get("instructions"), "response.instructions", optional=True),
            None if mot is None else c.max_tokens(mot, "response.max_output_tokens"),
            None if mods is None else c.modalities(mods, "response.output_modalities"))
    if kind == "response.cancel":
        return ResponseCancel(c.event_id, c.str_(event.get("response_id"), "response_id", optional=True))
    c.fail("unknown_event", f"unknown or unsupported client event type {kind!r}", "type")


# ----------------------------------------------------------------------------- the error event
def server_event(kind: str, **fields: Any) -> dict:
    """A server event of `kind` with a fresh `event_id` and `fields`."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(code: str, message: str, *, event_id: Optional[str] = None, param: Optional[str] = None,
                error_type: str = "invalid_request_error") -> dict:
    """Builds an ``error`` event; ``event_id`` is the offending client event's id."""
    return server_event("error", error={"type": error_type, "code": code, "message": message, "event_id": event_id,
                               "param": param})
