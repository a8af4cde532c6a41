"""What a Realtime session's snapshot metadata holds (`meta_of`) and the checks it passes before a session resumes
from it (`restored`); `omnijax.serve.realtime.resume` re-exports these names.

`restored` checks a snapshot's `meta` (the conversation side, `meta_of`) before anything is opened:
every field's type and range is checked by name (settings as the Realtime API takes them, the conversation's
messages as `Conversation.check_message` takes them, the unit counter and the other counters in [0,
`COUNTER_LIMIT`], the unit counter past every unit the cached tokens carry), so a damaged or tampered snapshot is
refused with a `resume_failed` error and changes nothing, instead of failing later inside the session.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from omnijax.conversation import Conversation
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.serve.engine.snapshot import COUNTER_LIMIT, SessionSnapshot
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.speech_sampling import FIELDS
from omnijax.serve.tool_calls import ToolError, check_function, check_functions

if TYPE_CHECKING:
    from omnijax.serve.realtime.session import RealtimeSession

TOKENS_LIMIT = 2 ** 53  # token counts (usage), as JSON numbers stay exact


class ResumeRefused(ValueError):
    """A snapshot that cannot be resumed; the message names the field and says nothing of server paths."""



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


def _sampling(value: Any) -> tuple:
    """A snapshot's `settings.output_sampling`: `[[field, value], ...]` of `TalkerSampling`'s fields."""
    where = "settings.output_sampling"
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and p[0] in FIELDS and isinstance(p[1], (int, float))
            and not isinstance(p[1], bool) for p in value):
        raise _fail(where, f"must be a list of [field, number] pairs of {list(FIELDS)}, got {_show(value)}")
    pairs = tuple((str(k), v) for k, v in value)
    try:
        TalkerSampling(**dict(pairs))
    except (TypeError, ValueError) as e:
        raise _fail(where, str(e)) from None
    return pairs


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
    if d.get("output_sampling") is not None:
        kw["output_sampling"] = _sampling(d["output_sampling"])
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
