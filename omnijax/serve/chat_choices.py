"""Chat completions with `n` choices or `logprobs` (issue 37 item 1): the requests `chat_completions` hands over.

`n` > 1: the prompt is fed once, into the first choice's session; n - 1 more sessions are then opened and forked
from it (`Engine.fork_session`): they share the prompt's full KV pages (counted per page, copied before a row's trim
changes one, `omnijax.kv.page_sharing`) and copy only its partly filled last page, and every choice decodes its own
answer in its own row of the same ticks. `SHARE_PAGES = False` serves the choices as before sharing (the first
session exported and imported into each other one, a copy of every page): the oracle the sharing is checked
against. Each choice draws with its own key: the request's `seed` folded with the choice's index
(`Engine.seed_session(sid, seed, i)`; choice 0 of a seeded request equals the same request with `n` 1), or a fresh
random seed when the request has none.

`logprobs`: each content token's log probability and its `top_logprobs` alternatives, from the raw model
distribution (the log-softmax of the logits before any sampling setting: vLLM's default, `logprobs_mode`
"raw_logprobs"), computed inside the engine's step (`omnijax.decoding.row_logprobs`); in the response as OpenAI's
`choices[i].logprobs.content[j]` (token, logprob, bytes, top_logprobs), whole and streamed (each chunk carries the
entries of the tokens it covers). Tools are not combined with either (a 400 naming the field).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from omnijax.serve.answer_text import AnswerText
from omnijax.serve.chat_params import RequestError
from omnijax.serve.chat_request import ChatRequest, build_prompt
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.openai_wire import completion, completion_chunk, error_body, json_error, sse, usage

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

# n > 1: fork the prompt's session sharing its full pages (True), or copy it through a snapshot (False; module doc).
SHARE_PAGES = True


def token_entry(tokenizer: Any, token: int, logprob: float) -> dict:
    """One token as OpenAI's logprob object: its text, log probability and UTF-8 bytes."""
    text = tokenizer.decode([int(token)])
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def logprobs_content(tokenizer: Any, tokens: list[int], entries: list) -> list[dict]:
    """`choices[i].logprobs.content`: per token, its entry with `top_logprobs` (entries as `Answer.logprobs`)."""
    return [{**token_entry(tokenizer, t, lp), "top_logprobs": [token_entry(tokenizer, i, v) for i, v in top]}
            for t, (lp, top) in zip(tokens, entries)]


class _Choice:
    """One choice's answer, read as it decodes: its text (cut at stop strings) and its content tokens."""

    def __init__(self, context: ServeContext, req: ChatRequest, sid: str, answer: Any):
        self.sid, self.answer, self.read = sid, answer, 0
        self.text = AnswerText(context.tokenizer.stream_decoder(skip_special_tokens=True), req.stop)

    def push(self, tokens: list[int]) -> tuple[str, list[int], list]:
        """`(text delta, content tokens, their logprob entries)` of the next decoded `tokens`."""
        before = self.text.tokens
        delta = self.text.push(tokens)
        used = tokens[:self.text.tokens - before]
        if used and not self.text.stopped and used[-1] in self.answer.stop:
            used = used[:-1]  # the end-of-answer token is not content
        entries = self.answer.logprobs[self.read:self.read + len(used)]
        self.read += len(tokens)
        return delta, used, entries


async def serve_choices(request: Request, context: ServeContext, req: ChatRequest) -> Response:
    """Serves a parsed request with `n` > 1 or `logprobs` (module docstring), whole or streamed."""
    tools = getattr(req, "tools", None)
    if tools is not None and getattr(tools, "active", True):
        name = "n" if req.n > 1 else "logprobs"
        return json_error(RequestError(f"'{name}' is not supported together with 'tools'", param=name,
                                        code="unsupported"), request=request)
    client = request.client.host if request.client else "?"
    stack = contextlib.AsyncExitStack()
    worker = context.worker
    try:
        sids = [await stack.enter_async_context(context.session(client, "cc", queue=True))]
    except Overloaded as e:
        return _overloaded(e, context, request)
    try:
        conversation = context.conversation()
        max_tokens = min(req.max_tokens or context.options.max_output_tokens, context.options.max_output_tokens)
        parts, prompt = await asyncio.to_thread(build_prompt, conversation, req, min(worker.tau, max_tokens))
        prompt_tokens = conversation.tokens_fed
        fed = worker.feed(sids[0], parts)
        if req.n > 1:  # the prompt is computed once; the other choices' sessions continue from it
            await fed
            if SHARE_PAGES:
                for _ in range(req.n - 1):
                    sids.append(await stack.enter_async_context(context.session(client, "cc")))
                await _fork(worker, sids)
            else:
                snapshot = await worker.export(sids[0], {})
                for _ in range(req.n - 1):
                    sids.append(await stack.enter_async_context(context.session(client, "cc", snapshot)))
        seed = req.seed if req.seed is not None or req.n == 1 else secrets.randbits(63)
        if seed is not None:
            for i, sid in enumerate(sids):
                await worker.in_engine(worker.engine.seed_session, sid, seed, i)
        choices = [_Choice(context, req, sid, worker.respond(sid, prompt, max_tokens, conversation.continuation,
                                                             req.sampling, constraint=None if req.grammar is None
                                                             else req.grammar.constraint())) for sid in sids]
    except Overloaded as e:
        await stack.aclose()
        return _overloaded(e, context, request)
    except (ValueError, RuntimeError) as e:
        await stack.aclose()
        return json_error(e if isinstance(e, RequestError) else RequestError(str(e)), request=request)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not req.stream:
        return await _whole(request, context, req, choices, stack, cid, created, prompt_tokens)
    return StreamingResponse(_events(context, req, choices, stack, cid, created, prompt_tokens),
                             media_type="text/event-stream")


async def _fork(worker: Any, sids: list[str], timeout_s: float = 30.0) -> None:
    """Forks the first session into the others once its prompt is written and nothing decodes in it (as
    `EngineWorker.export` waits)."""
    worker.cancel(sids[0])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while worker.busy(sids[0]):
        if loop.time() > deadline:
            raise TimeoutError(f"session {sids[0]!r} did not become idle within {timeout_s:g} s")
        await asyncio.sleep(0.01)
    await worker.in_engine(lambda: worker.engine.fork_session(sids[0], sids[1:]))


def _overloaded(e: Overloaded, context: ServeContext, request: Request) -> Response:
    if context.worker.stopping:
        return json_error(RequestError(str(e), status=503, code="shutting_down", kind="server_error"),
                           request=request)
    return json_error(RequestError(str(e), status=429, code="overloaded", kind="rate_limit_error"),
                       headers={"Retry-After": str(context.retry_after_s)}, request=request)


async def _whole(request, context, req: ChatRequest, choices: list, stack, cid: str, created: int,
                 prompt_tokens: int) -> Response:
    tokenizer = context.tokenizer

    async def read(choice: _Choice) -> tuple[str, list, list]:
        pieces, tokens, entries = [], [], []
        async for delta in choice.answer:
            text, used, lps = choice.push(delta)
            pieces.append(text)
            tokens += used
            entries += lps
            if choice.text.stopped:  # the rest of the answer is not wanted
                context.worker.cancel(choice.sid)
                break
        await choice.answer.done
        return "".join(pieces) + choice.text.flush(), tokens, entries

    watcher = asyncio.ensure_future(_cancel_all_on_disconnect(request, context, [c.sid for c in choices]))
    try:
        read_all = await asyncio.gather(*(read(c) for c in choices))
    finally:
        watcher.cancel()
        await stack.aclose()
    failed = next((c.answer for c in choices if c.answer.status == "failed"), None)
    if failed is not None:
        stopping = context.worker.stopping
        return json_error(RequestError(f"the answer failed: {failed.reason}", status=503 if stopping else 500,
                                        code="shutting_down" if stopping else "server_error", kind="server_error"))
    used = sum(c.text.completion_tokens(c.answer) for c in choices)
    out = completion(cid, created, req.model, "", "stop", prompt_tokens, used,
                     metadata=req.labels.get("metadata"))
    kv = [c.answer.kv_cells for c in choices]
    out["omnijax"] = {"kv_cells": int(kv[0]), "choices_kv_cells": [int(k) for k in kv]}
    if choices[0].answer.recall is not None:  # StreamConfig(recall=...): each choice's RecallStats, as kv_cells
        recalls = [dataclasses.asdict(c.answer.recall) for c in choices]
        out["omnijax"].update(recall=recalls[0], choices_recall=recalls)
    out["choices"] = [{"index": i, "message": {"role": "assistant", "content": text},
                       "finish_reason": c.text.finish_reason(c.answer),
                       "logprobs": None if req.top_logprobs is None else
                       {"content": logprobs_content(tokenizer, tokens, entries), "refusal": None}}
                      for i, (c, (text, tokens, entries)) in enumerate(zip(choices, read_all))]
    return JSONResponse(out)


async def _events(context, req: ChatRequest, choices: list, stack, cid: str, created: int, prompt_tokens: int):
    """The choices' chunks as they decode, interleaved (each names its `index`), then each one's finish."""
    tokenizer = context.tokenizer
    queue: asyncio.Queue = asyncio.Queue()

    def chunk(i: int, delta: dict, reason: str | None = None, lps: list | None = None) -> str:
        out = completion_chunk(cid, created, req.model, delta, reason,
                               metadata=req.labels.get("metadata") if delta.get("role") else None)
        out["choices"][0]["index"] = i
        if lps is not None:
            out["choices"][0]["logprobs"] = {"content": lps, "refusal": None}
        return sse(out)

    async def pump(i: int, choice: _Choice) -> None:
        try:
            async for delta in choice.answer:
                text, used, entries = choice.push(delta)
                lps = logprobs_content(tokenizer, used, entries) if req.top_logprobs is not None else None
                if text or lps:
                    await queue.put(chunk(i, {"content": text}, lps=lps))
                if choice.text.stopped:  # the rest of the answer is not wanted
                    context.worker.cancel(choice.sid)
                    break
            await choice.answer.done
            tail = choice.text.flush()
            if tail:
                await queue.put(chunk(i, {"content": tail}))
            if choice.answer.status == "failed":
                await queue.put(sse(error_body(f"the answer failed: {choice.answer.reason}", kind="server_error")))
            else:
                await queue.put(chunk(i, {}, choice.text.finish_reason(choice.answer)))
        finally:
            await queue.put(None)

    tasks: list[asyncio.Task] = []
    try:
        for i in range(len(choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item
        if req.include_usage:
            used = sum(c.text.completion_tokens(c.answer) for c in choices)
            yield sse(completion_chunk(cid, created, req.model, None, usage_=usage(prompt_tokens, used)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for c in choices:
            if c.answer.status is None:
                context.worker.abandon(c.sid)
        await stack.aclose()


async def _cancel_all_on_disconnect(request: Request, context: ServeContext, sids: list[str]) -> None:
    """Waits for the client of a (fully read) request to disconnect, then cancels every choice's answer."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for sid in sids:
                if sid in context.worker.lanes:
                    context.worker.abandon(sid)
            return
