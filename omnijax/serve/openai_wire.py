"""What the OpenAI HTTP routes share on the wire: the error object and its response (refusals logged), the
`chat.completion` / `chat.completion.chunk` / `model` objects, usage, server-sent events, and the watcher that cancels
an answer whose client went away."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from omnijax.serve.chat_params import RequestError
from omnijax.serve.refusal_log import refusals

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

__all__ = ["cancel_on_disconnect", "completion", "completion_chunk", "error_body", "json_error", "model_object",
           "models_list", "sse", "usage"]

log = logging.getLogger("omnijax.serve")


def error_body(message: str, *, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """The OpenAI error object `{"error": {...}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}



def completion(cid: str, created: int, model: str, text: str | None, finish_reason: str, prompt_tokens: int,
               completion_tokens: int, kv_cells: int | None = None, metadata: dict | None = None,
               tool_calls: list[dict] | None = None, recall: Any = None) -> dict:
    """A `chat.completion` object (omnijax's KV cells in the extra `"omnijax"` field, and with `recall` (the answer's
    `omnijax.streaming.recall_session.RecallStats`) its fields as `"omnijax": {"recall": {...}}`; the request's
    `metadata`, when it had one, echoed back; the message's `tool_calls` when the answer made calls)."""
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    out = {"id": cid, "object": "chat.completion", "created": created, "model": model,
           "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
           "usage": usage(prompt_tokens, completion_tokens)}
    if kv_cells is not None:
        out["omnijax"] = {"kv_cells": int(kv_cells)}
    if recall is not None:
        out.setdefault("omnijax", {})["recall"] = dataclasses.asdict(recall)
    if metadata is not None:
        out["metadata"] = metadata
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(cid: str, created: int, model: str, delta: dict | None, finish_reason: str | None = None,
                     usage_: dict | None = None, metadata: dict | None = None) -> dict:
    """A `chat.completion.chunk`; `delta=None` gives the usage-only chunk (empty choices); `metadata` (the request's,
    on the first chunk) is echoed back."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                         "logprobs": None}]
    out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    if metadata is not None:
        out["metadata"] = metadata
    return out


def model_object(model_name: str, created: int) -> dict:
    """The served model as an OpenAI `model` object."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "omnijax"}


def models_list(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model_name, created)]}




def json_error(e: RequestError, headers: dict | None = None, request: Request | None = None) -> JSONResponse:
    """The error response of `e`; a refusal of `request` (a 4xx, or a 503 while stopping) is logged, rate-limited
    per reason and client (`omnijax.serve.refusal_log`)."""
    if request is not None and (e.status < 500 or e.code == "shutting_down"):
        peer = request.client.host if request.client else "?"
        refusals.refuse(e.code, peer, "chat refuse peer=%s status=%d reason=%s: %s", peer, e.status, e.code, e)
    return JSONResponse(error_body(str(e), kind=e.kind, code=e.code, param=e.param), status_code=e.status,
                        headers=headers)



async def cancel_on_disconnect(request: Request, context: ServeContext, sid: str) -> None:
    """Waits for the client of a (fully read) request to disconnect, then cancels the session's answer."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if sid in context.worker.lanes:
                log.info("chat completion session=%s: the client went away; its answer is cancelled", sid)
                context.worker.abandon(sid)
            return



def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
