"""Wire codec for the OpenAI Realtime API (GA event names): text output, and audio output (speech with its
transcript) where the checkpoint can speak.

Pure (the standard library and its field checks, `omnijax.serve.realtime.event_fields`; no transport, no model): client
events become small frozen dataclasses: ``session.update``, ``input_audio_buffer.append`` / ``.commit`` / ``.clear``,
``conversation.item.create`` (``message`` items of role ``user`` or ``system``, parts ``input_text`` and
``input_image``; ``function_call_output`` items), ``response.create``, ``response.cancel``. ``session.tools`` are
function tools and ``session.tool_choice`` "auto", "none" or a named function ("required" is refused: nothing constrains
decoding); the session checks them when it applies them (``omnijax.serve.realtime.tools``). A problem raises
:class:`RealtimeEventError`, whose ``to_event`` is the server ``error`` event (``error_event``; the other server events
are `omnijax.serve.realtime.server_events`). Codes: ``invalid_json``, ``unknown_event``, ``missing_field``,
``invalid_value``, ``unsupported``, ``buffer_too_large``, ``unknown_parameter``.

No field is accepted and ignored: a field an event or object does not take is refused by name (``unknown_parameter``,
with "did you mean" or where a beta field went), and the fields omnijax does not implement are accepted only at the
value that asks for nothing (``Fields.neutral``): ``response.tools`` [] and ``response.tool_choice`` "auto" or "none"
(tools are the session's), ``include`` [], null ``prompt``, ``tracing``, ``audio.input.transcription`` and
``noise_reduction``, ``audio.output.speed`` (1), ``turn_detection.idle_timeout_ms``, ``response.audio`` (the
voice and format are the session's); ``input_image.detail`` "auto". ``response.metadata`` is carried (the server
echoes it). ``output_modalities`` is ``["text"]`` or ``["audio"]``, ``audio.output.voice`` a voice name (the session
checks both against the checkpoint) and ``audio.output.format`` 16-bit ``audio/pcm`` at 24 kHz. Also refused:
custom voices, output formats other than ``audio/pcm`` at 24 kHz, input formats other than 16-bit mono
``audio/pcm`` at 24 or 16 kHz, turn detection other than null or ``server_vad``, image URLs that are not base64
``data:image/...`` (the server never fetches), out-of-band responses, and audio appends that are not base64, hold an
odd byte count or exceed ``max_bytes``.

omnijax extensions (the SDK models allow extra fields): ``response.done`` carries ``"omnijax": {"kv_cells": n}`` (the KV
cells the session holds after it); the session object carries ``"omnijax": {"input_audio_rate": r}`` (the SDK's PCM
format admits 24 kHz only); ``session.omnijax`` in ``session.update`` takes ``duplex`` (MiniCPM-o 4.5 full duplex) and
the sampling settings chat completions takes (the GA session has no sampling fields): ``temperature`` in [0, 2],
``top_p`` in (0, 1], an integer ``seed``, ``presence_penalty`` / ``frequency_penalty`` in [-2, 2],
``repetition_penalty`` in (0, 2], an integer ``top_k`` >= -1 (-1 and 0: off), ``min_p`` in [0, 1] and ``logit_bias``
(token id -> bias in [-100, 100]), echoed by the session object; ``session.truncation`` ``{"type": "retention_ratio",
...}`` is validated and carried to the server, which maps it onto its retention policy.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Union

from omnijax.serve.realtime.event_fields import EVENTS, Fields, RealtimeEventError, error_event, new_id, server_event

# `omnijax.decoding.SEED_RANGE` (signed 64-bit), spelled here: the codec imports neither jax nor the model.
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)

__all__ = [
    "ClientEvent", "ConversationItemCreate", "DEFAULT_MAX_BYTES", "FunctionCallOutput", "InputAudioBufferAppend",
    "InputAudioBufferClear", "InputAudioBufferCommit", "InputImage", "InputText", "RealtimeEventError",
    "ResponseCancel", "ResponseCreate", "RetentionRatio", "SAMPLING", "ServerVad", "SessionSettings", "SessionUpdate",
    "error_event", "new_id", "parse_client_event", "server_event",
]

DEFAULT_MAX_BYTES = 15 * 1024 * 1024
# `session.omnijax`'s sampling settings (`SessionSettings` fields of the same names), as chat completions takes them
SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
            "min_p", "logit_bias")
# name -> (type, low, high, low excluded) of the numeric ones
_RANGES = {"temperature": (float, 0.0, 2.0, False), "top_p": (float, 0.0, 1.0, True),
           "seed": (int, *SEED_RANGE, False), "presence_penalty": (float, -2.0, 2.0, False),
           "frequency_penalty": (float, -2.0, 2.0, False), "repetition_penalty": (float, 0.0, 2.0, True),
           "top_k": (int, -1, None, False), "min_p": (float, 0.0, 1.0, False)}
_RATES = (24000, 16000)


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
    """Session settings accepted so far, with defaults: output text (or ``("audio",)``, in ``output_voice``), PCM16
    input at 24000 or 16000 Hz, ``turn_detection`` None (manual commits) or :class:`ServerVad`,
    ``max_output_tokens`` an integer or "inf", ``truncation`` "auto", "disabled" or :class:`RetentionRatio`, the
    served ``model``; the omnijax extensions
    ``duplex`` and the sampling settings ``SAMPLING`` (None: the server's default)."""
    instructions: str = ""
    output_modalities: tuple = ("text",)
    output_voice: Optional[str] = None  # `audio.output.voice` as given (None: the checkpoint's first voice)
    output_format: str = "audio/pcm"  # `audio.output.format` (16-bit mono at 24 kHz, the only one)
    output_sampling: Optional[tuple] = None  # `audio.output.sampling` ((field, value), ...): the talker's draws,
    # checked against the checkpoint by the session (`audio_output.check_audio_output`); None: greedy
    input_audio_rate: int = 24000
    turn_detection: Optional[ServerVad] = None
    max_output_tokens: Union[int, Literal["inf"]] = "inf"
    truncation: Union[Literal["auto", "disabled"], RetentionRatio] = "auto"
    model: str = "omnijax"
    duplex: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    logit_bias: Optional[tuple] = None  # ((token id, bias), ...) in the order given
    tools: tuple = ()  # function definitions (checked by `omnijax.serve.tool_calls.check_function` when applied)
    tool_choice: Any = "auto"  # "auto" or "none" once applied (the session refuses others, naming them)


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
class FunctionCallOutput:
    """``conversation.item.create`` of a ``function_call_output`` item: a tool's result for the call ``call_id``."""
    event_id: Optional[str]
    item_id: Optional[str]
    call_id: str
    output: str
    previous_item_id: Optional[str] = None


@dataclass(frozen=True)
class ResponseCreate:
    """``response.create``; ``None`` fields fall back to the session settings."""
    event_id: Optional[str]
    instructions: Optional[str] = None
    max_output_tokens: Union[int, Literal["inf"], None] = None
    output_modalities: Optional[tuple] = None
    metadata: Optional[dict] = None


@dataclass(frozen=True)
class ResponseCancel:
    """``response.cancel``; ``response_id`` ``None`` means the in-progress response."""
    event_id: Optional[str]
    response_id: Optional[str] = None


ClientEvent = Union[SessionUpdate, InputAudioBufferAppend, InputAudioBufferCommit, InputAudioBufferClear,
                    ConversationItemCreate, FunctionCallOutput, ResponseCreate, ResponseCancel]


def _parse_sampling(c: Fields, ext: dict) -> dict:
    """The sampling settings of `session.omnijax` (`SAMPLING`, ranges as chat completions'), checked by name; the
    session checks `logit_bias`'s ids against the vocabulary."""
    out: dict = {}
    for name, (kind, lo, hi, open_lo) in _RANGES.items():
        if ext.get(name) is None:
            continue
        param = f"session.omnijax.{name}"
        value = c.num(ext[name], param, kind, lo, hi)
        if open_lo and value <= lo:
            c.fail("invalid_value", f"'{param}' must lie in ({lo}, {hi}]", param)
        out[name] = kind(value)
    bias = ext.get("logit_bias")
    if bias is not None:
        param = "session.omnijax.logit_bias"
        pairs = []
        for key, value in c.obj(bias, param).items():
            if not (isinstance(key, str) and key.isdigit()):
                c.fail("invalid_value", f"'{param}' keys must be token ids (digits), got {key!r}", param)
            pairs.append((int(key), float(c.num(value, f"{param}.{key}", float, -100.0, 100.0))))
        out["logit_bias"] = tuple(pairs)
    return out


def _parse_session(c: Fields, s: dict) -> dict:
    changes: dict = {}
    c.check(s, "session", "session")
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
    if s.get("tools") is not None:
        changes["tools"] = _parse_tools(c, s["tools"])
    if s.get("tool_choice") is not None:
        choice = s["tool_choice"]
        if choice == "required":
            c.fail("unsupported", "'session.tool_choice' = \"required\" is not supported: without constrained "
                   "decoding this server cannot make the model call a tool, only offer the tools; send \"auto\" "
                   "(or \"none\")", "session.tool_choice")
        if choice not in ("auto", "none") and not (isinstance(choice, dict) and choice.get("type") == "function"
                                                   and isinstance(choice.get("name"), str)):
            c.fail("invalid_value", f"'session.tool_choice' must be \"auto\", \"none\", \"required\" or "
                   f"{{\"type\": \"function\", \"name\": ...}}, got {json.dumps(choice)[:60]}",
                   "session.tool_choice")
        changes["tool_choice"] = choice  # a named function is checked against the session's tools when applied
    if s.get("omnijax") is not None:
        ext = c.obj(s["omnijax"], "session.omnijax")
        unknown = sorted(set(ext) - {"duplex", *SAMPLING})
        if unknown:
            c.fail("invalid_value", f"'session.omnijax' takes 'duplex', {', '.join(map(repr, SAMPLING))}; got "
                   f"{unknown}", "session.omnijax")
        changes.update(_parse_sampling(c, ext))
        if "duplex" in ext:
            if not isinstance(ext["duplex"], bool):
                c.fail("invalid_value", "'session.omnijax.duplex' must be a boolean", "session.omnijax.duplex")
            changes["duplex"] = ext["duplex"]
    if "truncation" in s:
        t, p = s["truncation"], "session.truncation"
        if isinstance(t, str) and t in ("auto", "disabled"):
            changes["truncation"] = t
        elif isinstance(t, dict) and t.get("type") == "retention_ratio":
            c.check(t, p, p)
            ratio = c.num(c.req(t, "retention_ratio", p + ".retention_ratio"), p + ".retention_ratio", float, 0.0, 1.0)
            post = None
            if t.get("token_limits") is not None:
                lim = c.obj(t["token_limits"], p + ".token_limits")
                c.check(lim, p + ".token_limits", p + ".token_limits")
                if lim.get("post_instructions") is not None:
                    post = c.num(lim["post_instructions"], p + ".token_limits.post_instructions", int, 1)
            changes["truncation"] = RetentionRatio(float(ratio), post)
        else:
            c.fail("invalid_value", f"'{p}' must be \"auto\", \"disabled\" or "
                   f"{{\"type\": \"retention_ratio\", \"retention_ratio\": float}}, got {t!r}", p)
    audio = s.get("audio")
    if audio is not None:
        audio = c.obj(audio, "session.audio")
        c.check(audio, "session.audio", "session.audio")
        if audio.get("output") is not None:
            changes.update(_parse_output(c, audio["output"]))
        inp = audio.get("input")
        if inp is not None:
            inp = c.obj(inp, "session.audio.input")
            c.check(inp, "session.audio.input", "session.audio.input")
            if "format" in inp:
                p = "session.audio.input.format"
                f = c.obj(inp["format"], p)
                c.check(f, p, p)
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


def _parse_output(c: Fields, out: Any) -> dict:
    """``session.audio.output``: ``voice`` (a name; the session checks it against the checkpoint's voices) and
    ``format`` (16-bit mono ``audio/pcm`` at 24 kHz, the only one sent)."""
    p = "session.audio.output"
    c.check(c.obj(out, p), p, p)
    changes: dict = {}
    voice = out.get("voice")
    if isinstance(voice, dict):
        c.fail("unsupported", f"'{p}.voice': custom voices are not supported; send the name of one of the "
               "checkpoint's voices", p + ".voice")
    if voice is not None:
        changes["output_voice"] = c.str_(voice, p + ".voice")
    if out.get("format") is not None:
        f = c.obj(out["format"], p + ".format")
        c.check(f, p + ".format", p + ".format")
        kind = f.get("type")
        if kind != "audio/pcm":
            code = "unsupported" if kind in ("audio/pcmu", "audio/pcma") else "invalid_value"
            c.fail(code, f"'{p}.format.type' {kind!r} is not supported: this server sends \"audio/pcm\" "
                   "(16-bit mono PCM at 24 kHz)", p + ".format.type")
        rate = f.get("rate", 24000)
        if isinstance(rate, bool) or rate != 24000:
            c.fail("invalid_value", f"'{p}.format.rate' must be 24000 (speech is sent at 24 kHz), got {rate!r}",
                   p + ".format.rate")
        changes["output_format"] = "audio/pcm"
    if "sampling" in out:  # an omnijax extension (`omnijax.serve.speech_sampling`); null: greedy again
        value = out["sampling"]
        if value is not None:
            value = tuple(c.obj(value, p + ".sampling").items())
        changes["output_sampling"] = value
    return changes


def _parse_tools(c: Fields, tools: Any) -> tuple:
    """``session.tools``: function tools ``{"type": "function", "name", "description", "parameters"}``."""
    if not isinstance(tools, list):
        c.fail("invalid_value", "'session.tools' must be a list of tools", "session.tools")
    functions = []
    for i, tool in enumerate(tools):
        p = f"session.tools[{i}]"
        tool = c.obj(tool, p)
        if tool.get("type") != "function":
            c.fail("invalid_value", f"'{p}.type' must be \"function\" (the only kind of tool this server runs), "
                   f"got {tool.get('type')!r}", p + ".type")
        c.check(tool, "session.tools", p)
        functions.append({k: v for k, v in tool.items() if k != "type"})
    return tuple(functions)  # each function is checked when the session applies them (`realtime.tools`)


def _parse_vad(c: Fields, td: Any) -> Optional[ServerVad]:
    p = "session.audio.input.turn_detection"
    if td is None:
        return None
    td = c.obj(td, p)
    c.check(td, p, p)
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


def _parse_image(c: Fields, url: Any, param: str, max_bytes: int) -> tuple:
    url = c.str_(url, param)
    if not url.startswith("data:"):
        c.fail("invalid_value", f"'{param}' must be a base64 data URL (data:image/...;base64,...); "
               "remote URLs are refused because the server never fetches from the network", param)
    head, sep, payload = url[5:].partition(",")
    mime, _, enc = head.partition(";")
    if not sep or enc != "base64" or not mime.startswith("image/"):
        c.fail("invalid_value", f"'{param}' must look like data:image/<type>;base64,<data>", param)
    return c.b64(payload, param, max_bytes), mime


def _parse_item(c: Fields, item: dict, max_bytes: int) -> tuple:
    if c.req(item, "type", "item.type") != "message":
        c.fail("invalid_value", f"'item.type' must be \"message\" or \"function_call_output\", got "
               f"{item['type']!r}", "item.type")
    c.check(item, "item", "item")  # the fields of a message item
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
            c.check(part, "input_text", p)
            parts.append(InputText(c.str_(c.req(part, "text", p + ".text"), p + ".text")))
        elif kind == "input_image" and role == "user":
            detail = part.get("detail") or "auto"
            if detail not in ("auto", "low", "high"):
                c.fail("invalid_value", f"'{p}.detail' must be auto, low or high", p + ".detail")
            c.check(part, "input_image", p)
            data, mime = _parse_image(c, c.req(part, "image_url", p + ".image_url"), p + ".image_url", max_bytes)
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
    c = Fields(eid if isinstance(eid, str) else None)
    c.str_(eid, "event_id", optional=True)
    kind = c.req(event, "type", "type")
    if isinstance(kind, str) and kind in EVENTS:
        c.check(event, kind, "")
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
        if item.get("type") == "function_call_output":
            c.check(item, "function_call_output", "item")
            return FunctionCallOutput(c.event_id, c.str_(item.get("id"), "item.id", optional=True),
                                      str(c.str_(c.req(item, "call_id", "item.call_id"), "item.call_id")),
                                      str(c.str_(c.req(item, "output", "item.output"), "item.output")),
                                      c.str_(event.get("previous_item_id"), "previous_item_id", optional=True))
        role, parts = _parse_item(c, item, max_bytes)
        return ConversationItemCreate(c.event_id, c.str_(item.get("id"), "item.id", optional=True), role, parts,
                                      c.str_(event.get("previous_item_id"), "previous_item_id", optional=True))
    if kind == "response.create":
        r = event.get("response")
        if r is None:
            return ResponseCreate(c.event_id)
        r = c.obj(r, "response")
        c.check(r, "response", "response")
        if r.get("conversation", "auto") != "auto" or r.get("input") is not None:
            c.fail("unsupported", "out-of-band responses ('response.conversation' other than \"auto\", "
                   "'response.input') are not supported", "response.conversation")
        if r.get("tools"):
            c.fail("unsupported", "'response.tools': tools are set for the session (session.update's "
                   "'session.tools'): the chat template renders them at the conversation's start", "response.tools")
        mods = r.get("output_modalities")
        mot = r.get("max_output_tokens")
        return ResponseCreate(
            c.event_id, c.str_(r.get("instructions"), "response.instructions", optional=True),
            None if mot is None else c.max_tokens(mot, "response.max_output_tokens"),
            None if mods is None else c.modalities(mods, "response.output_modalities"),
            c.metadata(r.get("metadata"), "response.metadata"))
    if kind == "response.cancel":
        return ResponseCancel(c.event_id, c.str_(event.get("response_id"), "response_id", optional=True))
    c.fail("unknown_event", f"unknown or unsupported client event type {kind!r}", "type")
