"""`POST /v1/completions`: the legacy text-completions route (what lm-evaluation-harness's `local-completions` and
many benchmarks call) on the Metronome engine.

A prompt is raw text (no chat template) or token ids; it is fed to a fresh engine session and its continuation
decodes over the engine's ticks, as a chat completion's answer does (same admission, queue and 429, same sampling
and stop strings). Accepted:

- `prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists (at most `MAX_PROMPTS`
  prompts; each non-empty). Several prompts are served one after another, each from an empty cache, as choices
  `index` 0, 1, ... of one response (`n` must be 1; `best_of` 1).
- `max_tokens` (default 16, 0 allowed: nothing is generated, the prompt is only echoed and scored), `echo` (the
  prompt's text before the completion), `stop`, `stream` (server-sent `text_completion` chunks, then
  `data: [DONE]`), `stream_options.include_usage`, `user` (logged), and the sampling fields of chat completions
  (`omnijax.serve.chat_sampling`: `temperature`, `top_p`, `seed`, the penalties, `logit_bias`, vLLM's `top_k` /
  `min_p` / `repetition_penalty`), applied per row inside the engine's compiled step.
- `logprobs` (an integer 0-5, the legacy API's top-alternatives count): `tokens`, `token_logprobs`,
  `top_logprobs` (the `logprobs` most likely tokens at each position and the chosen one; a dict keyed by token
  text, so ids that decode alike share a key, holding the likeliest's value) and `text_offset` (where each token
  starts in `text`); all are the raw model distribution's (before the sampling processors, as vLLM returns by
  default). The generated tokens' (a stop token included) come from the engine's step as they are drawn, streamed
  with their text. The prompt's (with `echo`; the first token's entries null: nothing precedes it) come from one
  full-context forward over the prompt (`omnijax.serve.prompt_scores`, run on the engine's thread between ticks,
  but a length bucket's first, which compiles, on a thread of its own; the streamed step returns the last logits
  only), so such a prompt may hold at most `--max-scored-tokens` tokens.
  A server with one fixed decoding strategy (not `RowSampling`) refuses `logprobs` with `max_tokens` > 0.

Refused by name: `suffix` (no fill-in-the-middle), `n` or `best_of` other than 1, every unknown field, bad values of
the sampling fields (`omnijax.serve.chat_params`, `omnijax.serve.chat_sampling`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from omnijax.chunks.chunk import split_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.conversation import Prompt
from omnijax.models.frontend import units_for
from omnijax.serve.answer_text import AnswerText
from omnijax.serve.chat_params import RequestError, check_keys, check_labels, json_payload, stream_options
from omnijax.serve.chat_request import check_decoding
from omnijax.serve.chat_sampling import request_sampling
from omnijax.serve.context import model_not_found
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.openai_wire import cancel_on_disconnect, error_body, usage
from omnijax.serve.prompt_scores import TOP_K, TokenScores
from omnijax.serve.refusal_log import refusals
from omnijax.stop_strings import check_stops

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

log = logging.getLogger("omnijax.serve")

MAX_PROMPTS = 32  # prompts of one request (each is served in turn)
DEFAULT_MAX_TOKENS = 16  # as the OpenAI API
SAMPLING = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k",
            "min_p", "logit_bias")  # as chat completions takes them (`omnijax.serve.chat_sampling`)
HONOURED = ("model", "prompt", "max_tokens", "echo", "logprobs", "stream", "stream_options", "stop", "user",
            *SAMPLING)


def _one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 1


FIELDS = {"suffix": (lambda v: False, "null", "fill-in-the-middle (a suffix after the completion) is not supported"),
          "n": (_one, "1", "one completion is generated per prompt; send the prompt again for another"),
          "best_of": (_one, "1", "one completion is generated per prompt, none is discarded")}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A parsed completions request: `prompts` as token ids, each with its text (the string given, or None for a
    token-id prompt)."""

    prompts: tuple[tuple[tuple[int, ...], str | None], ...]
    max_tokens: int
    echo: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    model: str
    stop: tuple[str, ...] = ()
    sampling: object = None
    seed: int | None = None
    user: str | None = None


def _ids(value: Any) -> bool:
    """Whether `value` is a non-empty list of integers (one token-id prompt)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _prompt_list(value: Any) -> list:
    """The request's `prompt` as a list of prompts (each a string or a list of ids), refused by name otherwise."""
    if isinstance(value, str) or _ids(value):
        prompts = [value]
    elif isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(map(_ids, value))):
        prompts = list(value)
    else:
        raise RequestError("'prompt' must be a string, a list of strings, a non-empty list of token ids or a list "
                           "of such lists", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"'prompt' holds {len(prompts)} prompts, over the {MAX_PROMPTS} one request may carry "
                           f"(MAX_PROMPTS); send them in several requests", param="prompt")
    return prompts


def _tokens(prompt: Any, i: int, tokenizer: Any, vocab_size: int) -> tuple[tuple[int, ...], str | None]:
    param = f"prompt[{i}]"
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"'{param}' is not valid Unicode text: a lone surrogate at character {e.start}",
                               param="prompt") from None
        ids = tuple(tokenizer.encode(prompt))
        if not ids:
            raise RequestError(f"'{param}' is empty: a completion continues a prompt of at least one token",
                               param="prompt")
        return ids, prompt
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        raise RequestError(f"'{param}' holds token ids outside the vocabulary [0, {vocab_size}): "
                           f"{low if low < 0 else high}", param="prompt")
    return tuple(prompt), None


def parse_completion_request(body: Any, *, model_name: str, decoding: Any, tokenizer: Any, vocab_size: int,
                             max_output_tokens: int, max_scored_tokens: int) -> CompletionRequest:
    """Validates a completions request body (a decoded JSON object) and tokenizes its prompts; raises
    `RequestError` naming the field.

    Args:
        body: the request's JSON.
        model_name: the served model's id (another is refused with 404 `model_not_found`).
        decoding: the engine's decoding strategy (sampling fields as `chat_completions` takes them).
        tokenizer: the checkpoint's tokenizer.
        vocab_size: the model's vocabulary size (token ids beyond it are refused).
        max_output_tokens: the most tokens one completion may generate (a larger `max_tokens` is cut to it).
        max_scored_tokens: the most tokens of a prompt whose `logprobs` are asked with `echo`.
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("model") != model_name:
        raise RequestError(model_not_found(body.get("model"), model_name), status=404, code="model_not_found",
                           param="model")
    check_keys(body, (*HONOURED, *FIELDS), "")
    for key, (neutral, accepted, why) in FIELDS.items():
        if body.get(key) is not None and not neutral(body[key]):
            shown = repr(body[key])[:60]
            raise RequestError(f"'{key}' = {shown} is not supported by this server: {why}; omit it or send "
                               f"{accepted}", code="unsupported", param=key)
    user = check_labels({"user": body.get("user")}).get("user")
    limit = body.get("max_tokens")
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise RequestError(f"'max_tokens' must be an integer >= 0, got {limit!r}", param="max_tokens")
    limit = min(limit, max_output_tokens)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError(f"'echo' must be a boolean, got {echo!r}", param="echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= TOP_K):
        raise RequestError(f"'logprobs' must be an integer in [0, {TOP_K}] (the legacy completions API's count of "
                           f"top alternatives per token), got {logprobs!r}", param="logprobs")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    stream = bool(stream)
    include_usage = stream_options(body.get("stream_options"), stream)
    asked = {k: body[k] for k in SAMPLING if k in body}
    if logprobs is not None and limit > 0:
        if not getattr(decoding, "per_row", False):
            raise RequestError("'logprobs' of generated tokens need a server decoding with per-request sampling "
                               "(omnijax serve's RowSampling); send 'max_tokens': 0 with 'echo' for the prompt's",
                               code="unsupported", param="logprobs")
        asked.update(logprobs=True, top_logprobs=logprobs)
    sampled = request_sampling(asked, decoding, vocab_size, check_decoding)
    try:
        stop = check_stops(body.get("stop"))
    except ValueError as e:
        raise RequestError(str(e), param="stop") from None
    prompts = tuple(_tokens(p, i, tokenizer, vocab_size) for i, p in enumerate(_prompt_list(body.get("prompt"))))
    if logprobs is not None and echo:
        for i, (ids, _) in enumerate(prompts):
            if len(ids) > max_scored_tokens:
                raise RequestError(f"'prompt[{i}]' holds {len(ids)} tokens, over the {max_scored_tokens} 'echo' with "
                                   f"'logprobs' may score (--max-scored-tokens)", param="prompt", code="too_long")
    return CompletionRequest(prompts, limit, bool(echo), logprobs, stream, include_usage, body["model"], stop,
                             sampled.row, sampled.seed, user)


Entry = tuple[int, float | None, list[tuple[int, float]] | None]  # token id, its logprob, the top alternatives


def prompt_entries(ids: tuple[int, ...], scores: TokenScores, top: int) -> list[Entry]:
    """The entries of a prompt's tokens from its `TokenScores` (the first token's: no logprob, no alternatives)."""
    out: list[Entry] = [(ids[0], None, None)]
    for i in range(1, len(ids)):
        out.append((ids[i], float(scores.logprobs[i]),
                    [(int(t), float(v)) for t, v in zip(scores.top_ids[i, :top], scores.top_logprobs[i, :top])]))
    return out


def logprobs_object(tokenizer: Any, entries: list[Entry], offsets: list[int]) -> dict:
    """The legacy `logprobs` object of `entries` (`offsets`: where each token starts in the choice's text): each
    token, its log-probability, and the alternatives with it keyed by their text (each id decoded alone, special
    tokens shown); an entry without a log-probability has null ones."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for token_id, value, alternatives in entries:
        token = tokenizer.decode([token_id])
        out["tokens"].append(token)
        out["token_logprobs"].append(value)
        if value is None:
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for t, v in [*(alternatives or ()), (token_id, value)]:  # ids that decode alike: the likeliest's value
            top.setdefault(tokenizer.decode([t]), v)
        out["top_logprobs"].append(top)
    return out


def _offsets(tokenizer: Any, ids: list[int]) -> list[int]:
    """Where each of a prompt's `ids` starts in its text (detokenised incrementally, so a token that ends inside a
    character starts where that character does)."""
    decoder, at, out = tokenizer.stream_decoder(), 0, []
    for token in ids:
        out.append(at)
        at += len(decoder.push([token]))
    return out


def _error(e: RequestError, request: Request, retry_after: int | None = None) -> Response:
    """The error response of `e` (a 429 with `Retry-After`); a refusal is logged, rate-limited per reason and client."""
    if e.status < 500 or e.code == "shutting_down":
        peer = request.client.host if request.client else "?"
        refusals.refuse(e.code, peer, "completions refuse peer=%s status=%d reason=%s: %s", peer, e.status, e.code,
                        e)
    headers = {"Retry-After": str(retry_after)} if e.status == 429 and retry_after is not None else None
    return JSONResponse(error_body(str(e), kind=e.kind, code=e.code, param=e.param), status_code=e.status,
                        headers=headers)


async def _open(context: ServeContext, client: str) -> tuple[Any, str]:
    """An engine session for one prompt (waiting in the bounded queue); `RequestError` 429 (503 when stopping)."""
    session = context.session(client, "cmpl", queue=True)
    try:
        return session, await session.__aenter__()
    except Overloaded as e:
        if context.worker.stopping:
            raise RequestError(str(e), status=503, code="shutting_down", kind="server_error") from None
        raise RequestError(str(e), status=429, code="overloaded", kind="rate_limit_error") from None


class _Decoding:
    """One prompt's completion decoding in an open engine session, its text cut at the request's stop strings;
    `start` where its text begins in the choice's text (after the echoed prompt)."""

    def __init__(self, context: ServeContext, req: CompletionRequest, sid: str, start: int = 0):
        self.context, self.req, self.sid = context, req, sid
        self.text_of = AnswerText(context.tokenizer.stream_decoder(skip_special_tokens=True), req.stop)
        self.answer: Any = None
        self.offsets: list[int] = []  # where each token read so far starts in the choice's text
        self._at, self._decoder = start, context.tokenizer.stream_decoder(skip_special_tokens=True)

    async def start(self, ids: tuple[int, ...]) -> None:
        worker = self.context.worker
        if self.req.seed is not None:
            await worker.in_engine(worker.engine.seed_session, self.sid, self.req.seed)
        units = units_for(self.context.model)
        chunk = units.text(list(ids), 0, SpanKind.TEXT, answer_tokens=min(worker.tau, self.req.max_tokens))
        prompt = Prompt(split_chunk(chunk, self.context.chunk_tokens), int(np.asarray(chunk.answer_unit)[0]))
        self.answer = worker.respond(self.sid, prompt, self.req.max_tokens, units.continuation, self.req.sampling)

    async def deltas(self) -> AsyncIterator[tuple[str, int]]:
        """`(text, tokens read)` as the completion decodes (ends early at a stop string, cancelling the rest);
        the tokens read are the last of `tokens`."""
        async for tokens in self.answer:
            before = self.text_of.tokens
            delta = self.text_of.push(tokens)
            for token in tokens[:self.text_of.tokens - before]:
                self.offsets.append(self._at)
                self._at += len(self._decoder.push([token]))
            yield delta, self.text_of.tokens - before
            if self.text_of.stopped:
                self.context.worker.cancel(self.sid)
                break
        await self.answer.done
        tail = self.text_of.flush()
        if tail:
            yield tail, 0
        if self.answer.status == "failed":
            stopping = self.context.worker.stopping
            raise RequestError(f"the completion failed: {self.answer.reason}", status=503 if stopping else 500,
                               code="shutting_down" if stopping else "server_error", kind="server_error")

    @property
    def tokens(self) -> list[int]:
        """The tokens the completion used (to its stop string's last token, else all decoded, a stop token too)."""
        return list(self.answer.tokens[:self.text_of.tokens])

    def entries(self, first: int, count: int) -> list[Entry]:
        """The log-probability entries of tokens `first` to `first + count` (the engine's, as they were drawn)."""
        scored = self.answer.logprobs
        return [(self.answer.tokens[i], scored[i][0], scored[i][1]) if i < len(scored) else
                (self.answer.tokens[i], None, None) for i in range(first, first + count)]

    @property
    def finish_reason(self) -> str:
        return self.text_of.finish_reason(self.answer)


def _parse_body(body: bytes, context: ServeContext) -> CompletionRequest:
    payload = json_payload(body)
    return parse_completion_request(payload, model_name=context.options.model_name,
                                    decoding=context.worker.engine.config.stream.decoding,
                                    tokenizer=context.tokenizer, vocab_size=int(context.model.config.vocab_size),
                                    max_output_tokens=context.options.max_output_tokens,
                                    max_scored_tokens=context.options.max_scored_tokens)


async def _echo(context: ServeContext, req: CompletionRequest, ids: tuple[int, ...],
                text: str | None) -> tuple[str, dict | None]:
    """A choice's prompt part: its text when `echo` (else ""), and its logprobs object when asked (with `echo`, the
    prompt's, scored on the engine's thread; else an empty one)."""
    tokenizer = context.tokenizer
    if not req.echo:
        return "", (None if req.logprobs is None else logprobs_object(tokenizer, [], []))
    echoed = tokenizer.decode(list(ids)) if text is None else text
    if req.logprobs is None:
        return echoed, None
    scorer = context.prompt_scorer  # a bucket's first scoring compiles: off the engine's thread, not holding ticks
    run = context.worker.in_engine if scorer.compiled(len(ids)) else asyncio.to_thread
    scores = await run(scorer.score, list(ids))
    return echoed, logprobs_object(tokenizer, prompt_entries(ids, scores, req.logprobs),
                                   _offsets(tokenizer, list(ids)))


def _joined(first: dict | None, more: dict | None) -> dict | None:
    """Two logprobs objects one after the other."""
    if first is None or more is None:
        return first or more
    return {key: first[key] + more[key] for key in first}


def _chunk(cid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None) -> str:
    out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return f"data: {json.dumps(out)}\n\n"


async def completions(request: Request, context: ServeContext) -> Response:
    """Serves one completions request (streamed or whole); each prompt is one engine session in turn."""
    body = await request.body()
    if len(body) > context.options.max_message_bytes:
        return _error(RequestError(f"the request body is {len(body)} bytes, over the server's cap of "
                                   f"{context.options.max_message_bytes}", status=413, code="too_large"), request)
    try:
        req = await asyncio.to_thread(_parse_body, body, context)
    except RequestError as e:
        return _error(e, request)
    client = request.client.host if request.client else "?"
    if req.user is not None:
        log.info("completion peer=%s user=%r", client, req.user)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        try:
            first = await _open(context, client) if req.max_tokens > 0 else None
        except RequestError as e:
            return _error(e, request, context.retry_after_s)
        return StreamingResponse(_events(context, req, client, cid, created, first), media_type="text/event-stream")

    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, (ids, text) in enumerate(req.prompts):
        try:
            echoed, logprobs = await _echo(context, req, ids, text)
            completion, finish, generated = "", "length", 0
            if req.max_tokens > 0:
                session, sid = await _open(context, client)
                watcher = asyncio.ensure_future(cancel_on_disconnect(request, context, sid))
                try:
                    decoding = _Decoding(context, req, sid, len(echoed))
                    await decoding.start(ids)
                    completion = "".join([delta async for delta, _ in decoding.deltas()])
                finally:
                    watcher.cancel()
                    await session.__aexit__(None, None, None)
                finish, generated = decoding.finish_reason, len(decoding.tokens)
                if req.logprobs is not None:
                    logprobs = _joined(logprobs, logprobs_object(context.tokenizer, decoding.entries(0, generated),
                                                                 decoding.offsets))
        except RequestError as e:
            return _error(e, request, context.retry_after_s)
        except ValueError as e:
            return _error(RequestError(str(e)), request)
        choices.append({"index": index, "text": echoed + completion, "logprobs": logprobs, "finish_reason": finish})
        prompt_tokens, completion_tokens = prompt_tokens + len(ids), completion_tokens + generated
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": req.model,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})


async def _events(context: ServeContext, req: CompletionRequest, client: str, cid: str, created: int,
                  first: tuple[Any, str] | None) -> AsyncIterator[str]:
    """The server-sent events of a streamed request: per prompt its echo, text deltas (with their tokens' logprobs
    when asked) and a last chunk with its `finish_reason`; then usage (when asked) and `[DONE]`. An error after the
    headers went is an error event."""
    prompt_tokens = completion_tokens = 0
    opened = first

    def chunk(index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> str:
        return _chunk(cid, created, req.model, [{"index": index, "text": text, "logprobs": logprobs,
                                                 "finish_reason": finish}])
    try:
        for index, (ids, text) in enumerate(req.prompts):
            echoed, logprobs = await _echo(context, req, ids, text)
            if req.echo:
                yield chunk(index, echoed, logprobs)
            finish = "length"
            if req.max_tokens > 0:
                session, sid = opened if opened is not None else await _open(context, client)
                opened = None
                decoding = _Decoding(context, req, sid, len(echoed))
                try:
                    await decoding.start(ids)
                    read = 0
                    async for delta, count in decoding.deltas():
                        scored = None
                        if req.logprobs is not None and count:
                            scored = logprobs_object(context.tokenizer, decoding.entries(read, count),
                                                     decoding.offsets[read:read + count])
                        read += count
                        if delta or scored is not None:
                            yield chunk(index, delta, scored)
                finally:
                    if decoding.answer is not None and decoding.answer.status is None:
                        context.worker.abandon(sid)
                    await session.__aexit__(None, None, None)
                finish, completion_tokens = decoding.finish_reason, completion_tokens + len(decoding.tokens)
            prompt_tokens += len(ids)
            yield chunk(index, "", None, finish)
        if req.include_usage:
            yield _chunk(cid, created, req.model, [], usage(prompt_tokens, completion_tokens))
    except (RequestError, ValueError) as e:
        code, kind = (e.code, e.kind) if isinstance(e, RequestError) else ("invalid_value", "invalid_request_error")
        yield f"data: {json.dumps(error_body(str(e), kind=kind, code=code))}\n\n"
    finally:
        if opened is not None:  # the first session, never used (the client left before its prompt)
            await opened[0].__aexit__(None, None, None)
    yield "data: [DONE]\n\n"
