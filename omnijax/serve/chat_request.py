"""The chat-completions request: a JSON body parsed and checked into a `ChatRequest` (every refusal a `RequestError`
naming the field; nothing changed), and its messages fed to a conversation as chunks (`build_prompt`).

Pure but for `build_prompt`, which templates into the given `Conversation` (images, audio and video through its
encoders; a video is decoded there, by the reader `omnijax.Chat.video` uses, into the family's audiovisual units),
and `parse_body`, which compiles a `response_format` for the served tokenizer (`omnijax.serve.structured`; blocking:
the route runs it in a worker thread).
The routes that serve a request are `omnijax.serve.chat_completions` (one choice) and `omnijax.serve.chat_choices`
(`n` choices or log probabilities).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.conversation import ChatTemplateError, Conversation, check_template_tools
from omnijax.decoding import DecodingStrategy
from omnijax.media.audio import read_wav, resample
from omnijax.media.image import read_image
from omnijax.media.video import VideoError
from omnijax.models.frontend import require_encoder
from omnijax.serve.chat_params import (
    RequestError,
    check_detail,
    check_fields,
    check_keys,
    check_labels,
    check_message_fields,
    json_payload,
    stream_options,
)
from omnijax.serve.chat_sampling import request_sampling
from omnijax.serve.structured import FormatError, Grammar, ResponseFormat, compile_format, parse_response_format
from omnijax.serve.tool_calls import ToolError, Tools, chat_tools, message_extras
from omnijax.stop_strings import check_stops

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

__all__ = ["MAX_MESSAGES", "MAX_PARTS", "MAX_VIDEO_BYTES", "ROLES", "ChatRequest", "Part", "build_prompt",
           "check_decoding", "parse_body", "parse_chat_request", "parse_payload", "response_grammar"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


# What one request may hold, refused by name before any of it is parsed or templated (10,000 text parts once took
# 213 s of templating): messages in the conversation, and content parts across all of them.
MAX_MESSAGES = 1_000
MAX_PARTS = 256
# The largest video file one `video_url` part may carry, refused by name before anything decodes it (the body cap,
# `--max-message-mb`, bounds its base64 too); its length is capped after the header is read (`--max-request-video-s`).
MAX_VIDEO_BYTES = 8 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class Part:
    """One content part: `kind` "text" (`text`), "image" / "video" (`data`: file bytes) or "audio" (`pcm` 16 kHz
    float); `param` names it in the request (`messages[i].content[j]`) for a refusal after parsing."""

    kind: str
    text: str = ""
    data: bytes = b""
    pcm: np.ndarray | None = None
    param: str = ""


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A parsed chat-completions request."""

    messages: tuple  # ((role, (Part, ...)), ...)
    max_tokens: int | None
    stream: bool
    include_usage: bool
    model: str
    sampling: object = None  # `[2]` row (`omnijax.decoding.sampling_row`) when the request sets temperature/top_p
    seed: int | None = None
    labels: dict = dataclasses.field(default_factory=dict)  # `user`, `safety_identifier`, `metadata` as given
    stop: tuple[str, ...] = ()  # stop strings (`omnijax.stop_strings`)
    n: int = 1  # choices (`omnijax.serve.chat_choices`)
    top_logprobs: int | None = None  # None: no log probabilities; k: the chosen token's and k alternatives'
    tools: Tools | None = None  # the request's function tools (`omnijax.serve.tool_calls`)
    extras: tuple = ()  # per message: its tool fields as the chat template takes them (`tool_calls`, `tool_call_id`)
    response_format: ResponseFormat | None = None  # json_object / json_schema (`omnijax.serve.structured`); None: text
    grammar: Grammar | None = None  # `response_format` compiled for the served tokenizer (`parse_body`)
    max_video_s: float | None = None  # seconds of video all `video_url` parts may hold together (None: no cap)


class _AudioBudget:
    """The seconds of audio a request may still carry (`ServeOptions.max_request_audio_s`; None: no cap)."""

    def __init__(self, seconds: float | None):
        self.cap, self.used = seconds, 0.0

    def take(self, seconds: float, param: str) -> None:
        self.used += seconds
        if self.cap is not None and self.used > self.cap:
            raise RequestError(f"'{param}': the request's audio runs {self.used:.1f} s so far, over the "
                               f"{self.cap:g} s one request may carry (--max-request-audio-s); send less audio, or "
                               f"stream it over the Realtime API", param=param, code="audio_too_long")


def _wav(data: bytes, param: str, budget: _AudioBudget | None = None) -> np.ndarray:
    """WAV bytes (16-bit PCM) -> 16 kHz mono float32; its duration is taken from `budget` before any resampling."""

    try:
        pcm, rate = read_wav(io.BytesIO(data), widths=(2,))
    except ValueError as e:
        raise RequestError(f"'{param}': {e}", param=param) from None
    if pcm.size == 0:
        raise RequestError(f"'{param}': the WAV file holds no samples", param=param)
    if budget is not None:
        budget.take(pcm.size / rate, param)
    return resample(pcm, int(rate))


def _b64(value, param: str) -> bytes:
    if not isinstance(value, str):
        raise RequestError(f"'{param}' must be a base64 string", param=param)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"'{param}' is not valid base64", param=param) from None


def _text(text: str, param: str) -> Part:
    """A text part; text that UTF-8 cannot encode (a lone surrogate escaped in the JSON) is refused by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"'{param}' is not valid Unicode text: a lone surrogate {text[e.start]!r} at character "
                           f"{e.start}", param=param) from None
    return Part("text", text=text)


def _part(part, param: str, budget: _AudioBudget | None = None) -> Part:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise RequestError(f"'{param}' must be a content part object with a 'type'", param=param)
    kind = part["type"]
    if kind in ("text", "image_url", "input_audio", "video_url"):
        check_keys(part, ("type", kind), param)
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"'{param}.text' must be a string", param=param + ".text")
        return _text(part["text"], param + ".text")
    if kind == "image_url":
        image = part.get("image_url")
        if isinstance(image, dict):
            check_detail(image, param + ".image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
            raise RequestError(f"'{param}.image_url.url' must be a base64 data:image/... URL (the server never "
                               f"fetches from the network)", param=param + ".image_url.url", code="unsupported")
        return Part("image", data=_b64(url.split(";base64,", 1)[1], param + ".image_url.url"))
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise RequestError(f"'{param}.input_audio' must be an object with 'data' and 'format'", param=param)
        check_keys(audio, ("data", "format"), param + ".input_audio")
        if audio.get("format") != "wav":
            raise RequestError(f"'{param}.input_audio.format' must be \"wav\" (16-bit PCM), got "
                               f"{audio.get('format')!r}", param=param + ".input_audio.format", code="unsupported")
        return Part("audio", pcm=_wav(_b64(audio.get("data"), param + ".input_audio.data"), param, budget))
    if kind == "video_url":
        video = part.get("video_url")
        if isinstance(video, dict):
            check_keys(video, ("url",), param + ".video_url")
        url = video.get("url") if isinstance(video, dict) else video
        where = param + ".video_url.url"
        if not isinstance(url, str) or not url.startswith("data:video/") or ";base64," not in url:
            raise RequestError(f"'{where}' must be a base64 data:video/... URL (the server never fetches from the "
                               f"network)", param=where, code="unsupported")
        encoded = url.split(";base64,", 1)[1]
        if len(encoded) * 3 // 4 > MAX_VIDEO_BYTES + 2:  # refused before the base64 is decoded
            raise RequestError(f"'{where}': the video file is about {len(encoded) * 3 // 4} bytes, over the "
                               f"{MAX_VIDEO_BYTES} bytes one video part may carry (MAX_VIDEO_BYTES); send a shorter "
                               f"or smaller clip", param=where, code="video_too_large")
        data = _b64(encoded, where)
        if len(data) > MAX_VIDEO_BYTES:
            raise RequestError(f"'{where}': the video file is {len(data)} bytes, over the {MAX_VIDEO_BYTES} bytes "
                               f"one video part may carry (MAX_VIDEO_BYTES); send a shorter or smaller clip",
                               param=where, code="video_too_large")
        if not data:
            raise RequestError(f"'{where}': the video file is empty", param=where)
        return Part("video", data=data, param=where)
    raise RequestError(f"'{param}.type' {kind!r} is not supported (text, image_url, input_audio, video_url)",
                       param=param + ".type", code="unsupported")


def parse_chat_request(body: Any, *, model_name: str, decoding: DecodingStrategy,
                       max_audio_s: float | None = None, vocab_size: int | None = None,
                       max_video_s: float | None = None) -> ChatRequest:
    """Validates a chat-completions request body (a dict) against what the server runs; raises `RequestError`.
    `max_audio_s` caps the seconds of audio of all its `input_audio` parts together (None: no cap); `vocab_size`
    bounds the `logit_bias` token ids (None: no vocabulary given, ids below 2**24); `max_video_s` caps the seconds of
    all its `video_url` parts together, checked when `build_prompt` opens them (None: no cap)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model != model_name:
        raise RequestError(f"model {model!r} does not exist: this server serves {model_name!r}", status=404,
                           code="model_not_found", param="model")
    check_fields(body, per_row=bool(getattr(decoding, "per_row", False)))
    labels = check_labels(body)
    try:
        response_format = parse_response_format(body.get("response_format"))
    except FormatError as e:
        raise RequestError(str(e), param=e.param, code=e.code) from None
    sampled = request_sampling(body, decoding, vocab_size or 2 ** 24, check_decoding)
    sampling, seed, n, top_logprobs = sampled.row, sampled.seed, sampled.n, sampled.top_logprobs
    try:
        stop = check_stops(body.get("stop"))
    except ValueError as e:
        raise RequestError(str(e), param="stop") from None
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(limit_name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError(f"'{limit_name}' must be an integer >= 1, got {limit!r}", param=limit_name)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    include_usage = stream_options(body.get("stream_options"), stream)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"'messages' holds {len(messages)} messages, over the {MAX_MESSAGES} accepted "
                           f"(MAX_MESSAGES)", param="messages")
    total = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if total > MAX_PARTS:
        raise RequestError(f"the messages hold {total} content parts, over the {MAX_PARTS} accepted (MAX_PARTS)",
                           param="messages")
    parsed, extras, call_ids = [], [], set()
    budget = _AudioBudget(max_audio_s)
    tools = _tool_fields(chat_tools, body)
    if response_format is not None and tools is not None and tools.active:
        raise RequestError(f"'response_format' {response_format.type!r} is not supported together with 'tools' (the "
                           f"output is either a JSON document or tool calls): omit one, or send tool_choice \"none\"",
                           param="response_format", code="unsupported")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"'{param}.role' must be one of {', '.join(ROLES)}", param=param + ".role")
        check_message_fields(message, param)
        content = message.get("content")
        if content is None and message["role"] == "assistant":
            content = ""
        if isinstance(content, str):
            parts = (_text(content, param + ".content"),)
        elif isinstance(content, list) and content:
            parts = tuple(_part(p, f"{param}.content[{j}]", budget) for j, p in enumerate(content))
        else:
            raise RequestError(f"'{param}.content' must be a string or a non-empty list of parts",
                               param=param + ".content")
        role = ROLES[message["role"]]
        if role != "user" and any(p.kind != "text" for p in parts):
            raise RequestError(f"'{param}': images, audio and video go in user messages", param=param + ".content")
        extras.append(_tool_fields(message_extras, message, role, param, call_ids))
        parsed.append((role, parts))
    return ChatRequest(tuple(parsed), limit, stream, include_usage, model, sampling, seed, labels, stop,
                       n=n, top_logprobs=top_logprobs,
                       tools=tools, extras=tuple(extras), response_format=response_format, max_video_s=max_video_s)


def _tool_fields(check, *args):
    """`check(*args)` (`omnijax.serve.tool_calls`), its `ToolError` as the `RequestError` naming the same field."""
    try:
        return check(*args)
    except ToolError as e:
        raise RequestError(str(e), param=e.param, code=e.code) from None


def check_decoding(body: dict, decoding: Any) -> None:
    """Refuses sampling fields that differ from the server's one decoding strategy."""
    sampled = type(decoding).__name__ == "Sampling"
    served = {"temperature": decoding.temperature if sampled else 0.0,
              "top_p": decoding.top_p if sampled else 1.0,
              "seed": getattr(decoding, "seed", None) if sampled else None}
    for name, value in served.items():
        asked = body.get(name)
        if asked is None or asked == value or (name == "top_p" and not sampled):
            continue
        how = (f"samples with temperature {decoding.temperature}, top_p {decoding.top_p}, seed {decoding.seed}"
               if sampled else "decodes greedily (temperature 0)")
        raise RequestError(f"'{name}' = {asked!r}: this server {how} for every session (one compiled program); "
                           f"omit the field, or start the server with --temperature / --top-p / --seed",
                           code="unsupported", param=name)


def parse_body(body: bytes, context: ServeContext) -> ChatRequest:
    """The request of a body (JSON, media decoded and resampled); `RequestError` naming the field."""
    return parse_payload(json_payload(body), context)


def parse_payload(payload: Any, context: ServeContext) -> ChatRequest:
    """`parse_body` of a body already decoded from JSON."""
    req = parse_chat_request(payload, model_name=context.options.model_name,
                             decoding=context.worker.engine.config.stream.decoding,
                             vocab_size=context.worker.engine.model_config.vocab_size,
                             max_audio_s=context.options.max_request_audio_s,
                             max_video_s=context.options.max_request_video_s)
    if req.response_format is None:
        return req
    return dataclasses.replace(req, grammar=response_grammar(req.response_format, context))


def response_grammar(fmt: ResponseFormat, context: ServeContext) -> Grammar:
    """`fmt` compiled for the served model (`omnijax.serve.structured.compile_format`: cached per schema, blocking);
    a schema llguidance cannot compile, or a tokenizer it cannot read, is a `RequestError` naming the field."""
    try:
        return compile_format(fmt, context.tokenizer, context.worker.engine.model_config.vocab_size,
                              context.worker.stop_ids)
    except FormatError as e:
        raise RequestError(str(e), param=e.param, code=e.code) from None
    except ValueError as e:
        raise RequestError(f"'response_format' {fmt.type!r} is not supported for model "
                           f"{context.options.model_name!r}: {e}", param="response_format",
                           code="unsupported") from None


def build_prompt(conversation: Conversation, req: ChatRequest, answer_tokens: int,
                 model_name: str = "") -> tuple[list, Any]:
    """The request's messages as chunks (templates; images, audio and video through the encoders), then the response's
    generation prompt asking for `answer_tokens`. Tools, tool calls and tool results need a template that renders
    tools (else a `RequestError` naming `tools` or the message, and the model). Tool results in a row are fed
    together: Qwen's templates put them in one user turn, so one's rendering changes once the next follows."""
    _set_tools(conversation, req, model_name)
    parts, video_s = [], [0.0]
    messages = list(zip(req.messages, req.extras or ({},) * len(req.messages)))
    for m, ((role, content), extras) in enumerate(messages):
        last = max((i for i, p in enumerate(content) if p.kind == "text"), default=-1)
        for i, p in enumerate(content):
            if p.kind == "text":  # a message's tool calls go with its last text part, its call id with each
                more = {k: v for k, v in extras.items() if k != "tool_calls" or i == last}
                if role == "tool" and (i < last or (m + 1 < len(messages) and messages[m + 1][0][0] == "tool")):
                    held = {"role": role, "content": p.text, **more}  # fed with the next tool result's rendering
                    conversation.check_message(held)
                    conversation.messages.append(held)
                    continue
                parts += conversation.message(role, p.text, **more)
            elif p.kind == "image":
                parts += conversation.image(read_image(p.data))
            elif p.kind == "video":
                parts += _video(conversation, p, req.max_video_s, video_s)
            else:
                parts += conversation.audio(p.pcm)
    return parts, conversation.prompt(answer_tokens)


def _video(conversation: Conversation, part: Part, cap_s: float | None, used_s: list) -> list:
    """A video file's audiovisual units as `omnijax.Chat.video` feeds them (the family's unit length, frame rate and
    frames per unit; the sound recorded with the frames, required), their seconds added to `used_s[0]` and checked
    against `cap_s` before any unit is decoded. Anything unreadable is a `RequestError` naming the part."""
    require_encoder(conversation.units.model, "vision")  # before any decoding: the same refusal as an image's

    units = conversation.units
    with tempfile.TemporaryDirectory(prefix="omnijax-video-") as folder:
        path = os.path.join(folder, "video")
        with open(path, "wb") as f:
            f.write(part.data)
        try:
            source = units.open_video(path)
            seconds = source.num_units * units.unit_seconds
            used_s[0] += seconds
            if cap_s is not None and used_s[0] > cap_s:
                raise RequestError(f"'{part.param}': the request's video runs {used_s[0]:g} s so far "
                                   f"({source.num_units} units of {units.unit_seconds:g} s at {units.fps:g} frames "
                                   f"a second), over the "
                                   f"{cap_s:g} s one request may carry (--max-request-video-s); send a shorter clip",
                                   param=part.param, code="video_too_long")
            chunks = []
            for frames, pcm in source.units():
                chunks += conversation.av(frames, pcm)
            return chunks
        except (VideoError, ImportError) as e:
            reason = str(e).replace(path, "the video").split("; an audiovisual unit needs")[0]
            if "no audio track" in reason:
                reason += ("; an audiovisual unit needs the sound recorded with the frames (as omnijax.Chat.video "
                           "does by default): send the clip with its audio track")
            raise RequestError(f"'{part.param}' could not be decoded as a video: {reason}", param=part.param,
                               code="invalid_video") from None


def _set_tools(conversation, req: ChatRequest, model_name: str) -> None:
    """Gives the conversation the request's tools (none with `tool_choice` "none"); refuses tools, tool calls or
    tool results when the template does not render tools."""
    used = next((i for i, e in enumerate(req.extras) if e), None)
    if (req.tools is None or not req.tools.active) and used is None:
        return
    try:
        conversation.set_tools(req.tools.template_tools() if req.tools is not None else None)
        check_template_tools(conversation.tokenizer)
    except ChatTemplateError as e:
        param = "tools" if req.tools is not None else f"messages[{used}]"
        raise RequestError(f"'{param}': model {model_name!r} cannot take tools: {e}", param=param,
                           code="unsupported") from None


