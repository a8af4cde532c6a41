"""`POST /v1/chat/completions` and `GET /v1/models`: the OpenAI HTTP API's chat subset on the Metronome engine.

The codec (`omnijax.serve.chat_request`: `parse_chat_request`; `omnijax.serve.openai_wire`: `completion`,
`completion_chunk`, `error_body`, `models_list`) is pure; the handlers (`chat_completions`, `models`) put it on a
`ServeContext`. Each request is one engine session: its messages
are fed as the conversation's units (text turns through the chat template; `image_url` parts as image units;
`input_audio` parts as audio units, in the order given), then the answer decodes over the engine's ticks;
`stream: true` sends it as server-sent events (`chat.completion.chunk`s, then `data: [DONE]`): one chunk per
detokenised piece as each token is decoded when the engine runs per token (`EngineConfig.per_token`, `omnijax
serve`'s default: the worker hands every token over as the engine thread decodes it), else one per tick of tau
tokens (`--no-per-token`). A request the engine
cannot admit waits in a short bounded queue (`ServeOptions.queue_timeout_s`, `max_queued`), then gets HTTP 429 with
`Retry-After`; a client that disconnects before its answer is whole cancels it; a stopping server answers 503.

Accepted: roles system (developer too), user, assistant (with `tool_calls`), tool (with `tool_call_id`); text content or
parts `text`, `image_url` (base64 `data:` URLs only: the server never fetches; `detail` "auto"), `input_audio` (`wav`,
16-bit PCM at 1-384 kHz, mono or channels averaged; at most `--max-request-audio-s` seconds in all, checked before any
is resampled); `max_tokens` / `max_completion_tokens`; `stream`, `stream_options.include_usage` (with `stream` only);
`n` choices (up to 8) and `logprobs` / `top_logprobs`, served by `omnijax.serve.chat_choices`; `stop` (a string or up to
4: the answer ends before the first to complete, `omnijax.serve.answer_text`); `tools`, `tool_choice` ("auto" or "none")
and `parallel_tool_calls`: the tools rendered by the chat template, the model's calls read into `tool_calls` whole and
streamed (`omnijax.serve.tool_calls`). Sampling fields (`temperature` in [0, 2], `top_p`, `seed`, the penalties,
`logit_bias`, `top_k`, `min_p`: `omnijax.serve.chat_sampling`) are per request when the server decodes with
`RowSampling` (as `omnijax serve` does: each row of the batched step draws with its own settings; a seed makes a request
reproduce); with any other strategy they are accepted when they are what it decodes with, else refused with a 400 naming
the field. `user` / `safety_identifier` are written to the server log with the request's session, `metadata` is echoed
back. Every other field is refused by name unless it has its neutral value (`omnijax.serve.chat_params`: `functions` [],
`modalities` ["text"], `store` false, ...), and an unknown field is refused as one (with "did you mean"). Every refusal
(4xx) is logged, rate-limited per reason and client (`omnijax.serve.refusal_log`). On a checkpoint with speech output,
`modalities` ["text", "audio"] with `audio: {voice, format}` speaks the answer (`omnijax.serve.speech_output`): the
message's `audio` whole, `delta.audio` streamed.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from omnijax.media.audio import pcm16
from omnijax.serve.answer_text import AnswerText
from omnijax.serve.chat_choices import serve_choices
from omnijax.serve.chat_params import RequestError
from omnijax.serve.chat_request import (
    MAX_MESSAGES,
    MAX_PARTS,
    ChatRequest,
    Part,
    build_prompt,
    parse_body,
    parse_chat_request,
)
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.openai_wire import (
    cancel_on_disconnect,
    completion,
    completion_chunk,
    error_body,
    json_error,
    model_object,
    models_list,
    sse,
    usage,
)
from omnijax.serve.speech_engine import SpeechOverloaded, finish_speech, written_speech
from omnijax.serve.speech_output import (
    AudioOutput,
    audio_message,
    new_audio_id,
    parse_with_audio,
    speak_pieces,
)
from omnijax.serve.speech_output import spoken_prompt as spoken_prompt_of

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

# The routes, and the request and response codecs re-exported beside them.
__all__ = ["MAX_MESSAGES", "MAX_PARTS", "ChatRequest", "Part", "chat_completions", "completion", "completion_chunk",
           "error_body", "model", "model_object", "models", "models_list", "parse_body", "parse_chat_request",
           "usage"]

log = logging.getLogger("omnijax.serve")


async def models(request: Request, context: ServeContext) -> Response:
    return JSONResponse(models_list(context.options.model_name, context.started))


async def model(request: Request, context: ServeContext) -> Response:
    """`GET /v1/models/{model}`: the served model, or 404 `model_not_found` for any other name."""
    name = request.path_params["model"]
    if name != context.options.model_name:
        return json_error(RequestError(f"model {name!r} does not exist: this server serves "
                                        f"{context.options.model_name!r}", status=404, code="model_not_found",
                                        param="model"), request=request)
    return JSONResponse(model_object(name, context.started))


async def chat_completions(request: Request, context: ServeContext) -> Response:
    """Serves one chat completion (streamed or whole) as one engine session. Decoding the body's media,
    templating and the encoders run in a worker thread: the event loop serves every other client meanwhile."""
    body = await request.body()
    if len(body) > context.options.max_message_bytes:
        return json_error(RequestError(f"the request body is {len(body)} bytes, over the server's cap of "
                                        f"{context.options.max_message_bytes}", status=413, code="too_large"),
                           request=request)
    try:
        req, audio = await asyncio.to_thread(parse_with_audio, body, context)
    except RequestError as e:
        return json_error(e, request=request)
    if req.grammar is not None and context.worker.engine.recall is not None:  # refused before anything is fed
        return json_error(RequestError("response_format (constrained decoding) is not supported by a server with "
                                       "--recall yet", param="response_format"), request=request)
    if req.n > 1 or req.top_logprobs is not None:  # several choices, or log probabilities
        return await serve_choices(request, context, req)
    client = request.client.host if request.client else "?"
    session = context.session(client, "cc", queue=True)
    try:
        sid = await session.__aenter__()
    except Overloaded as e:
        if context.worker.stopping:
            return json_error(RequestError(str(e), status=503, code="shutting_down", kind="server_error"),
                               request=request)
        return json_error(RequestError(str(e), status=429, code="overloaded", kind="rate_limit_error"),
                           headers={"Retry-After": str(context.retry_after_s)}, request=request)
    if "user" in req.labels or "safety_identifier" in req.labels:
        log.info("chat completion session=%s peer=%s user=%r safety_identifier=%r", sid, client,
                 req.labels.get("user"), req.labels.get("safety_identifier"))
    try:
        conversation = context.conversation()
        max_tokens = min(req.max_tokens or context.options.max_output_tokens, context.options.max_output_tokens)
        parts, prompt = await asyncio.to_thread(build_prompt, conversation, req, min(context.worker.tau, max_tokens),
                                                context.options.model_name)
        prompt_tokens = conversation.tokens_fed
        # the talker's prompt (media rows of user turns: their replay starts in a worker thread)
        spoken_prompt = await spoken_prompt_of(context, [*parts, *prompt.parts]) if audio is not None else None
        if req.seed is not None:
            await context.worker.in_engine(context.worker.engine.seed_session, sid, req.seed)
        context.worker.feed(sid, parts)
        answer = context.worker.respond(sid, prompt, max_tokens, conversation.continuation, req.sampling,
                                        constraint=req.grammar.constraint() if req.grammar is not None else None)
    except ValueError as e:
        await session.__aexit__(None, None, None)
        return json_error(e if isinstance(e, RequestError) else RequestError(str(e)), request=request)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    decoder = context.tokenizer.stream_decoder(skip_special_tokens=True)
    text_of = AnswerText(decoder, req.stop)
    calls = req.tools.parser() if req.tools is not None and req.tools.active else None  # reads the tool calls
    # Qwen3-Omni (Qwen2.5-Omni served with speak_early: reading the answer's rows): the talker starts on the
    # engine's speech pool while the answer is still decoded
    early = None if audio is None or spoken_prompt is None else written_speech(
        context, spoken_prompt.ids, audio.voice, spoken_prompt.media, stop=answer.stop, sampling=audio.sampling,
        rows=answer.rows)
    if not req.stream:
        # A client that goes away before the whole answer is ready cancels it (its decoding would hold a batch row
        # and a stopping server for nothing).
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, context, sid))
        pieces = []
        try:
            async for tokens in answer:
                pieces.append(text_of.push(tokens))
                if early is not None:
                    early.push(tokens)
                if calls is not None:
                    calls.push(pieces[-1])
                if text_of.stopped or calls is not None and calls.done:  # the rest of the answer is not wanted
                    context.worker.cancel(sid)
                    break
            await answer.done
        except BaseException:
            if early is not None:
                await early.aclose()
            raise
        finally:
            watcher.cancel()
            await session.__aexit__(None, None, None)
        if answer.status == "failed":
            if early is not None:
                await early.aclose()
            shutting_down = context.worker.stopping
            return json_error(RequestError(f"the answer failed: {answer.reason}", status=503 if shutting_down
                                            else 500, code="shutting_down" if shutting_down else "server_error",
                                            kind="server_error"))
        if req.stop:
            text = "".join(pieces) + text_of.flush()
        else:
            text = conversation.tokenizer.decode(_content_tokens(answer), skip_special_tokens=True)
        content: str | None = text
        reason, tool_calls = text_of.finish_reason(answer), None
        if calls is not None and req.tools is not None:  # the whole text read again (the parse is the same)
            whole = req.tools.parser()
            whole.push(text)
            whole.finish()
            content, reason = whole.message_content(), whole.finish_reason(reason)
            tool_calls = [c.openai() for c in whole.calls]
        spoken = None
        if audio is not None and spoken_prompt is not None:
            try:
                spoken = await audio_message(context, audio, spoken_prompt, _content_tokens(answer), text, created,
                                             early=early)
            except ValueError as e:  # a full speech pool is 429 naming its cap (`speech_engine.SpeechOverloaded`)
                if early is not None:
                    await early.aclose()
                return json_error(e if isinstance(e, SpeechOverloaded) else RequestError(
                    f"the answer could not be spoken: {e}", status=500, code="server_error", kind="server_error"),
                    request=request)
            content = None  # as OpenAI's API answers with audio: the text is the audio's transcript
        out = completion(cid, created, req.model, content, reason, prompt_tokens, text_of.completion_tokens(answer),
                         answer.kv_cells, req.labels.get("metadata"), tool_calls, recall=answer.recall)
        if spoken is not None:
            out["choices"][0]["message"]["audio"] = spoken
        return JSONResponse(out)

    aid = new_audio_id() if audio is not None else None

    async def events():
        released = False
        try:
            first = {"role": "assistant", "content": "" if audio is None else None}
            yield sse(completion_chunk(cid, created, req.model, first, metadata=req.labels.get("metadata")))
            async for tokens in answer:
                for delta in _deltas(calls, text_of.push(tokens), audio_id=aid):
                    yield sse(completion_chunk(cid, created, req.model, delta))
                if early is not None:  # the speech decoded so far, between the text deltas
                    early.push(tokens)
                    for pcm in early.ready():
                        yield sse(completion_chunk(cid, created, req.model, _audio_delta(aid, pcm16(pcm))))
                if text_of.stopped or calls is not None and calls.done:  # the rest of the answer is not wanted
                    context.worker.cancel(sid)
                    break
            await answer.done
            for delta in _deltas(calls, text_of.flush(), end=True, audio_id=aid):
                yield sse(completion_chunk(cid, created, req.model, delta))
            if audio is not None and spoken_prompt is not None and answer.status != "failed":
                released = True  # the engine session is not needed to speak: let its row go first
                await session.__aexit__(None, None, None)
                try:
                    async for chunk in _spoken_deltas(context, audio, spoken_prompt, _content_tokens(answer), aid,
                                                      created, early):
                        yield sse(completion_chunk(cid, created, req.model, chunk))
                except ValueError as e:
                    yield sse(error_body(f"the answer could not be spoken: {e}", kind="server_error"))
                    return
            if answer.status == "failed":
                yield sse(error_body(f"the answer failed: {answer.reason}", kind="server_error"))
            else:
                reason = text_of.finish_reason(answer)
                yield sse(completion_chunk(cid, created, req.model, {},
                                            reason if calls is None else calls.finish_reason(reason)))
            if req.include_usage:
                yield sse(completion_chunk(cid, created, req.model, None,
                                            usage_=usage(prompt_tokens, text_of.completion_tokens(answer))))
            yield "data: [DONE]\n\n"
        finally:
            if early is not None:
                await early.aclose()
            if answer.status is None:
                context.worker.abandon(sid)
            if not released:
                await session.__aexit__(None, None, None)

    return StreamingResponse(events(), media_type="text/event-stream")


def _deltas(calls, text: str, end: bool = False, audio_id: str | None = None) -> list[dict]:
    """The chunk deltas of the answer's next `text`: its content (the audio's transcript when `audio_id` is given),
    or what the tool-call parser `calls` reads from it (at the `end`, what it still held)."""
    if audio_id is not None:
        return [{"audio": {"id": audio_id, "transcript": text}}] if text else []
    if calls is None:
        return [{"content": text}] if text else []
    return calls.push(text) + (calls.finish() if end else [])


async def _spoken_deltas(context, audio: AudioOutput, prompt, answer_ids, audio_id, created, early=None):
    """The streamed audio deltas: `{id, data}` per vocoder chunk (base64 PCM16) as it is decoded, then
    `{expires_at}`; `early`: the answer spoken while written (its rest)."""
    pieces = finish_speech(early, answer_ids) if early is not None else speak_pieces(context, audio, prompt,
                                                                                       answer_ids)
    async for pcm in pieces:
        yield _audio_delta(audio_id, pcm)
    yield {"audio": {"expires_at": created}}


def _audio_delta(audio_id: str, pcm) -> dict:
    """A streamed `{id, data}` audio delta of int16 PCM."""
    return {"audio": {"id": audio_id, "data": base64.b64encode(pcm.tobytes()).decode("ascii")}}


def _content_tokens(answer) -> list[int]:
    tokens = answer.tokens
    return tokens[:-1] if tokens and tokens[-1] in answer.stop else tokens


