"""Field checks of the Realtime client-event codec (`omnijax.serve.realtime.client_events`): the error it raises,
typed field access, what each event and object takes, and the `error` server event.

No field is accepted and ignored: `FIELDS` lists what each client event and each object in one takes; a field it does
not list is refused by name (`unknown_parameter`, with "did you mean" when it is close to a listed one), and a field
listed as one the server does not implement is accepted only at null or the values that ask for nothing, else refused
(`unsupported`, naming those values and why). Pure: the standard library only, like the codec.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import itertools
import math
import uuid
from typing import Any, NoReturn, Optional, Union

__all__ = ["EVENTS", "FIELDS", "Fields", "RealtimeEventError", "error_event", "new_id", "server_event"]

# What each event and object takes: its fields (any other is refused by name), and the fields the server does not
# implement, each with the values (besides null) that ask for nothing and why others are refused.
EVENTS = {"session.update": ("session",), "input_audio_buffer.append": ("audio",), "input_audio_buffer.commit": (),
          "input_audio_buffer.clear": (), "conversation.item.create": ("item", "previous_item_id"),
          "response.create": ("response",), "response.cancel": ("response_id",)}
NO_PROMPT = "prompts stored by id are not supported"
FIELDS: dict[str, tuple[tuple, dict]] = {
    **{kind: (("type", "event_id", *more), {}) for kind, more in EVENTS.items()},
    "session": (("type", "model", "instructions", "output_modalities", "max_output_tokens", "tools", "tool_choice",
                 "truncation", "audio", "include", "prompt", "tracing", "omnijax"),
                {"include": (([],), "input transcription is not supported"), "prompt": ((), NO_PROMPT),
                 "tracing": ((), "the server keeps no traces")}),
    "session.truncation": (("type", "retention_ratio", "token_limits"), {}),
    "session.truncation.token_limits": (("post_instructions",), {}),
    "session.audio": (("input", "output"), {}),
    "session.audio.output": (("format", "voice", "speed", "sampling"),
                             {"speed": ((1.0, 1), "the speech is sent at the talker's own pace")}),
    "session.audio.output.format": (("type", "rate"), {}),
    "session.audio.input": (("format", "turn_detection", "transcription", "noise_reduction"),
                            {"transcription": ((), "input transcription is not supported"),
                             "noise_reduction": ((), "the audio is fed as sent, with no noise reduction")}),
    "session.audio.input.format": (("type", "rate"), {}),
    "session.audio.input.turn_detection": (("type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                                            "idle_timeout_ms", "create_response", "interrupt_response"),
                                           {"idle_timeout_ms": ((), "silence after a response triggers nothing")}),
    "item": (("id", "type", "role", "content", "object", "status"),
             {"object": (("realtime.item",), "an item is a realtime.item"),
              "status": (("completed",), "an item the client creates is complete")}),
    "function_call_output": (("id", "type", "call_id", "output", "object", "status"),
                             {"object": (("realtime.item",), "an item is a realtime.item"),
                              "status": (("completed",), "an item the client creates is complete")}),
    "session.tools": (("type", "name", "description", "parameters"), {}),
    "input_text": (("type", "text"), {}),
    "input_image": (("type", "image_url", "detail"),
                    {"detail": (("auto",), "images are encoded at the model's own resolution")}),
    "response": (("conversation", "input", "instructions", "max_output_tokens", "metadata", "output_modalities",
                  "prompt", "tool_choice", "tools", "audio"),
                 {"tool_choice": (("auto", "none"), "a response takes no tools of its own: set 'session.tools' "
                                  "and 'session.tool_choice'"), "prompt": ((), NO_PROMPT),
                  "audio": ((), "the voice and format are the session's: set them with session.update's "
                            "'session.audio.output'")}),
}
_MOVED = {"temperature": "sampling is set per session: session.update's 'session.omnijax.temperature'",
          "input_audio_transcription": "input transcription is not supported (the beta API's field; the GA API's is "
                                       "'session.audio.input.transcription')"}


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


class Fields:
    """Field access helpers that raise :class:`RealtimeEventError` tagged with the event id."""

    def __init__(self, event_id: Optional[str]):
        self.event_id = event_id

    def fail(self, code: str, message: str, param: Optional[str] = None) -> NoReturn:
        raise RealtimeEventError(code, message, event_id=self.event_id, param=param)

    def check(self, obj: dict, kind: str, where: str) -> None:
        """Refuses a field of `obj` that `FIELDS[kind]` does not list (`unknown_parameter`, `param` `where.key`, with
        a hint), and one it lists as unimplemented at a value other than null or its neutral ones (`unsupported`)."""
        allowed, neutral = FIELDS[kind]
        for key in obj:
            name = f"{where}.{key}" if where else str(key)
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.75)
                hint = f" ({_MOVED[key]})" if key in _MOVED else f" (did you mean '{close[0]}'?)" if close else ""
                self.fail("unknown_parameter", f"unknown parameter '{name}'{hint}: the server refuses the fields it "
                          f"does not know rather than ignore them", name)
            if key in neutral and obj[key] is not None:
                values, why = neutral[key]
                if not any(type(obj[key]) is type(v) and obj[key] == v for v in values):
                    shown = " or ".join(["null", *(repr(v) for v in values)])
                    self.fail("unsupported", f"'{name}' = {repr(obj[key])[:60]} is not supported: {why}; omit it "
                              f"or send {shown}", name)

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

    def num(self, value: Any, param: str, kind: type = int, lo: float | None = None, hi: float | None = None
            ) -> Any:
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
        """`["text"]` or `["audio"]` (speech with its transcript, as the GA API takes them); the session checks
        that the checkpoint can speak."""
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            self.fail("invalid_value", f"'{param}' must be a list of strings", param)
        if list(value) not in (["text"], ["audio"]):
            self.fail("invalid_value", f"'{param}' must be [\"text\"] or [\"audio\"] (audio comes with its "
                      f"transcript), got {value!r}", param)
        return tuple(value)

    def metadata(self, value: Any, param: str) -> Optional[dict]:
        """Up to 16 string pairs (keys up to 64 characters, values up to 512), as the API allows."""
        if value is None:
            return None
        if (not isinstance(value, dict) or len(value) > 16
                or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                           for k, v in value.items())):
            self.fail("invalid_value", f"'{param}' must be an object of at most 16 string values (keys up to 64 "
                      "characters, values up to 512)", param)
        return dict(value)

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


_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """Returns a fresh id such as ``event_000001a3f...``: a prefix, a process counter and uuid hex."""
    return f"{prefix}_{next(_counter):06d}{uuid.uuid4().hex[:16]}"


def server_event(kind: str, **fields: Any) -> dict:
    """A server event of `kind` with a fresh `event_id` and `fields`."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(code: str, message: str, *, event_id: Optional[str] = None, param: Optional[str] = None,
                error_type: str = "invalid_request_error") -> dict:
    """Builds an ``error`` event; ``event_id`` is the offending client event's id."""
    return server_event("error", error={"type": error_type, "code": code, "message": message, "event_id": event_id,
                                        "param": param})
