"""Server events of the OpenAI Realtime API (GA names), built as plain dicts.

The builders of what the server sends: `session.created` / `.updated` (the session object of a `SessionSettings`),
`input_audio_buffer.committed` / `.cleared` / `.speech_started` / `.speech_stopped`, `conversation.item.added` /
`.done` (user and assistant items), `response.created`, `response.output_text.delta` / `.done`, the spoken answer's
`response.output_audio_transcript.delta` / `.done` and `response.output_audio.delta` / `.done`, and `response.done`
(usage, plus omnijax's KV cells in the extra `"omnijax"` field). `error` events come from
`realtime_events.RealtimeEventError.to_event` / `error_event`. The client side (parsing, settings, the refusals) is
`omnijax.serve.realtime.client_events`; both are pure and import only the standard library besides each other.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Optional, Union

from omnijax.serve.realtime.client_events import (
    SAMPLING,
    ConversationItemCreate,
    FunctionCallOutput,
    InputText,
    RetentionRatio,
    SessionSettings,
    new_id,
    server_event,
)

__all__ = [
    "assistant_item", "conversation_item_added", "conversation_item_done", "input_audio_buffer_cleared",
    "input_audio_buffer_committed", "input_audio_buffer_speech_started", "input_audio_buffer_speech_stopped",
    "response_created", "response_done", "response_output_text_delta", "response_output_text_done",
    "session_created", "session_object", "session_updated", "user_item", "function_call_item",
    "function_call_output_item", "response_function_call_arguments_delta", "response_function_call_arguments_done",
    "response_output_item_added", "response_output_item_done", "response_output_audio_delta",
    "response_output_audio_done", "response_output_audio_transcript_delta", "response_output_audio_transcript_done",
]


def session_object(settings: SessionSettings, session_id: Optional[str] = None) -> dict:
    """Builds the ``realtime`` session object for ``session.created`` / ``session.updated``."""
    fmt: dict = {"type": "audio/pcm"}
    if settings.input_audio_rate == 24000:
        fmt["rate"] = 24000
    td = None
    if settings.turn_detection is not None:
        td = {"type": "server_vad", **{k: v for k, v in dataclasses.asdict(settings.turn_detection).items()
                                       if v is not None}}
    tr = settings.truncation
    if isinstance(tr, RetentionRatio):
        tr = {"type": "retention_ratio", "retention_ratio": tr.retention_ratio,
              **({"token_limits": {"post_instructions": tr.post_instructions}}
                 if tr.post_instructions is not None else {})}
    out = {"type": "realtime", "object": "realtime.session", "id": session_id or new_id("sess"),
           "model": settings.model, "instructions": settings.instructions,
           "output_modalities": list(settings.output_modalities), "max_output_tokens": settings.max_output_tokens,
           "truncation": tr, "audio": {"input": {"format": fmt, "turn_detection": td},
                                         "output": {"format": {"type": settings.output_format, "rate": 24000},
                                                    "voice": settings.output_voice,
                                                    **({"sampling": dict(settings.output_sampling)}
                                                       if settings.output_sampling is not None else {})}},
           "tools": [{"type": "function", **f} for f in settings.tools], "tool_choice": settings.tool_choice,
           "omnijax": {"input_audio_rate": settings.input_audio_rate, "duplex": settings.duplex,
                       **{k: getattr(settings, k) for k in SAMPLING
                          if k != "logit_bias" and getattr(settings, k) is not None},
                       **({"logit_bias": {str(t): b for t, b in settings.logit_bias}}
                          if settings.logit_bias is not None else {})}}
    return out


def session_created(settings: SessionSettings, session_id: Optional[str] = None) -> dict:
    """Builds ``session.created``."""
    return server_event("session.created", session=session_object(settings, session_id))


def session_updated(settings: SessionSettings, session_id: Optional[str] = None) -> dict:
    """Builds ``session.updated``."""
    return server_event("session.updated", session=session_object(settings, session_id))


def input_audio_buffer_committed(item_id: str, previous_item_id: Optional[str] = None) -> dict:
    """Builds ``input_audio_buffer.committed``."""
    return server_event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous_item_id)


def input_audio_buffer_cleared() -> dict:
    """Builds ``input_audio_buffer.cleared``."""
    return server_event("input_audio_buffer.cleared")


def input_audio_buffer_speech_started(item_id: str, audio_start_ms: int) -> dict:
    """Builds ``input_audio_buffer.speech_started``."""
    return server_event("input_audio_buffer.speech_started", item_id=item_id, audio_start_ms=int(audio_start_ms))


def input_audio_buffer_speech_stopped(item_id: str, audio_end_ms: int) -> dict:
    """Builds ``input_audio_buffer.speech_stopped``."""
    return server_event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=int(audio_end_ms))


def user_item(item: ConversationItemCreate, item_id: Optional[str] = None) -> dict:
    """Builds the conversation item dict for a parsed ``conversation.item.create`` (images re-encoded)."""
    parts = []
    for p in item.content:
        if isinstance(p, InputText):
            parts.append({"type": "input_text", "text": p.text})
        else:
            url = f"data:{p.mime_type};base64,{base64.b64encode(p.data).decode('ascii')}"
            parts.append({"type": "input_image", "image_url": url, "detail": p.detail})
    return {"id": item_id or item.item_id or new_id("item"), "object": "realtime.item", "type": "message",
            "role": item.role, "status": "completed", "content": parts}


def assistant_item(item_id: str, text: Optional[str] = None, status: str = "completed", audio: bool = False
                   ) -> dict:
    """Builds an assistant message item; ``text=None`` gives an empty, in-progress-style item; ``audio``: its part
    is ``output_audio`` with ``text`` its transcript (the server keeps no audio: the part carries none)."""
    part = {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
    content = [] if text is None else [part]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str = "", status: str = "completed"
                       ) -> dict:
    """Builds a ``function_call`` item (a tool call of the model; ``arguments`` the JSON text so far)."""
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def function_call_output_item(item: FunctionCallOutput, item_id: Optional[str] = None) -> dict:
    """Builds the ``function_call_output`` item of a parsed ``conversation.item.create``."""
    return {"id": item_id or item.item_id or new_id("item"), "object": "realtime.item",
            "type": "function_call_output", "status": "completed", "call_id": item.call_id, "output": item.output}


def response_output_item_added(response_id: str, item: dict, output_index: int) -> dict:
    """Builds ``response.output_item.added``."""
    return server_event("response.output_item.added", response_id=response_id, output_index=output_index, item=item)


def response_output_item_done(response_id: str, item: dict, output_index: int) -> dict:
    """Builds ``response.output_item.done``."""
    return server_event("response.output_item.done", response_id=response_id, output_index=output_index, item=item)


def response_function_call_arguments_delta(response_id: str, item_id: str, call_id: str, delta: str, *,
                                           output_index: int) -> dict:
    """Builds ``response.function_call_arguments.delta`` (more of a call's arguments, as the model writes them)."""
    return server_event("response.function_call_arguments.delta", response_id=response_id, item_id=item_id,
                        output_index=output_index, call_id=call_id, delta=delta)


def response_function_call_arguments_done(response_id: str, item_id: str, call_id: str, name: str, arguments: str,
                                          *, output_index: int) -> dict:
    """Builds ``response.function_call_arguments.done``."""
    return server_event("response.function_call_arguments.done", response_id=response_id, item_id=item_id,
                        output_index=output_index, call_id=call_id, name=name, arguments=arguments)


def conversation_item_added(item: dict, previous_item_id: Optional[str] = None) -> dict:
    """Builds ``conversation.item.added``."""
    return server_event("conversation.item.added", item=item, previous_item_id=previous_item_id)


def conversation_item_done(item: dict, previous_item_id: Optional[str] = None) -> dict:
    """Builds ``conversation.item.done``."""
    return server_event("conversation.item.done", item=item, previous_item_id=previous_item_id)


def _response(response_id: str, status: str, output: list, max_output_tokens: Any, conversation_id: Optional[str],
              modalities: tuple = ("text",), voice: Optional[str] = None) -> dict:
    out = {"object": "realtime.response", "id": response_id, "status": status, "output": output,
           "output_modalities": list(modalities), "max_output_tokens": max_output_tokens,
           "conversation_id": conversation_id}
    if "audio" in modalities:
        out["audio"] = {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": voice}}
    return out


def response_created(response_id: str, *, max_output_tokens: Union[int, str] = "inf",
                     conversation_id: Optional[str] = None, modalities: tuple = ("text",),
                     voice: Optional[str] = None) -> dict:
    """Builds ``response.created`` (status ``in_progress``, no output yet; ``modalities`` ``("audio",)`` with the
    ``voice`` it speaks in)."""
    return server_event("response.created", response=_response(response_id, "in_progress", [], max_output_tokens,
                                                               conversation_id, modalities, voice))


def response_output_audio_transcript_delta(response_id: str, item_id: str, delta: str, *, output_index: int = 0,
                                           content_index: int = 0) -> dict:
    """Builds ``response.output_audio_transcript.delta`` (more of a spoken answer's text)."""
    return server_event("response.output_audio_transcript.delta", response_id=response_id, item_id=item_id,
                        output_index=output_index, content_index=content_index, delta=delta)


def response_output_audio_transcript_done(response_id: str, item_id: str, transcript: str, *,
                                          output_index: int = 0, content_index: int = 0) -> dict:
    """Builds ``response.output_audio_transcript.done``."""
    return server_event("response.output_audio_transcript.done", response_id=response_id, item_id=item_id,
                        output_index=output_index, content_index=content_index, transcript=transcript)


def response_output_audio_delta(response_id: str, item_id: str, pcm: bytes, *, output_index: int = 0,
                                content_index: int = 0) -> dict:
    """Builds ``response.output_audio.delta``: ``pcm`` (16-bit little-endian mono PCM at 24 kHz) in base64."""
    return server_event("response.output_audio.delta", response_id=response_id, item_id=item_id,
                        output_index=output_index, content_index=content_index,
                        delta=base64.b64encode(pcm).decode("ascii"))


def response_output_audio_done(response_id: str, item_id: str, *, output_index: int = 0, content_index: int = 0
                               ) -> dict:
    """Builds ``response.output_audio.done``."""
    return server_event("response.output_audio.done", response_id=response_id, item_id=item_id,
                        output_index=output_index, content_index=content_index)


def response_output_text_delta(response_id: str, item_id: str, delta: str, *, output_index: int = 0,
                               content_index: int = 0) -> dict:
    """Builds ``response.output_text.delta``."""
    return server_event("response.output_text.delta", response_id=response_id, item_id=item_id, delta=delta,
               output_index=output_index, content_index=content_index)


def response_output_text_done(response_id: str, item_id: str, text: str, *, output_index: int = 0,
                              content_index: int = 0) -> dict:
    """Builds ``response.output_text.done``."""
    return server_event("response.output_text.done", response_id=response_id, item_id=item_id, text=text,
               output_index=output_index, content_index=content_index)


def response_done(response_id: str, *, status: str = "completed", output: Optional[list] = None,
                  input_tokens: int = 0, output_tokens: int = 0, kv_cells: Optional[int] = None,
                  reason: Optional[str] = None, max_output_tokens: Union[int, str] = "inf",
                  conversation_id: Optional[str] = None, modalities: tuple = ("text",),
                  voice: Optional[str] = None, recall: Any = None) -> dict:
    """Builds ``response.done``.

    Args:
        response_id: The response's id.
        status: ``completed``, ``cancelled``, ``incomplete`` or ``failed``.
        output: Output items, e.g. from :func:`assistant_item`.
        input_tokens: Prompt tokens consumed by the response.
        output_tokens: Tokens generated.
        kv_cells: omnijax extension: KV cells held after the response, sent as ``"omnijax": {"kv_cells": n}``.
        reason: ``status_details.reason``, e.g. ``client_cancelled`` or ``max_output_tokens``.
        max_output_tokens: The limit used.
        conversation_id: The conversation the output was added to.
        modalities: ``("text",)`` or ``("audio",)`` (then ``voice``, the voice it spoke in).
        recall: omnijax extension: the answer's recall figures (``RecallStats``, with ``StreamConfig(recall=...)``),
            sent beside ``kv_cells`` as ``"omnijax": {"recall": {...}}``.
    """
    resp = _response(response_id, status, list(output or []), max_output_tokens, conversation_id, modalities, voice)
    resp["usage"] = {"input_tokens": int(input_tokens), "output_tokens": int(output_tokens),
                     "total_tokens": int(input_tokens) + int(output_tokens)}
    if status != "completed" or reason is not None:
        resp["status_details"] = {"type": status, "reason": reason}
    ev = server_event("response.done", response=resp)
    if kv_cells is not None:
        ev["omnijax"] = {"kv_cells": int(kv_cells)}
    if recall is not None:
        ev.setdefault("omnijax", {})["recall"] = dataclasses.asdict(recall)
    return ev
