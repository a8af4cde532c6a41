"""Which chat-completions request fields `omnijax serve` honours, and the refusal of every other one by name.

No field is accepted and ignored: each top-level field, message field and content-part field is in one of these
tables, and a field in none of them is refused as an unknown parameter (with "did you mean" when it is close to a
known one, e.g. `max_token` or `temprature`). The tables are the docs' "Parameters" table for the route
(docs/serving.md):

- `HONOURED`: parsed and applied by `omnijax.serve.chat_completions.parse_chat_request`.
- `NEUTRAL`: fields the server does not implement, accepted only at the value that asks for nothing (`modalities`
  ["text"], `store` false, ...; and the `SAMPLED` fields, the penalties at 0, `logit_bias` {}, on a server that does
  not sample per row): that value is honoured trivially. Real clients send
  some of these by default. Any other value is refused with code `unsupported`, naming the field and the value that is
  accepted.
- `LABELS`: fields with no effect on any answer that the server can honestly keep: `user` and `safety_identifier`
  are written to the server log with the request's session id; `metadata` is echoed back in the response.

The module is pure: it validates a decoded JSON body and raises `RequestError`.
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Any, Callable

__all__ = ["HONOURED", "LABELS", "MESSAGE_FIELDS", "NEUTRAL", "SAMPLED", "RequestError", "check_detail", "check_fields",
           "check_keys", "check_labels", "check_message_fields", "json_payload", "stream_options"]


class RequestError(ValueError):
    """A request the server refuses: `status` (HTTP), `code`, `param`."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_value", param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind


def json_payload(body: bytes) -> Any:
    """A request body decoded as JSON; `RequestError` (`invalid_json`) when it is not JSON or nests too deep."""
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the request body nests JSON deeper than the server parses", code="invalid_json") from None
    return payload


HONOURED = ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
            "temperature", "top_p", "seed", "stop", "response_format",
            "tools", "tool_choice", "parallel_tool_calls")  # the tools: `omnijax.serve.tool_calls`
LABELS = ("user", "safety_identifier", "metadata")
# Sampling fields a per-row server (`omnijax.decoding.RowSampling`, as `omnijax serve` runs) honours per request
# (`omnijax.serve.chat_sampling`); a server with one fixed strategy takes them only at their `NEUTRAL` value.
SAMPLED = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "top_k", "min_p", "logprobs",
           "top_logprobs")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is(*values: Any) -> Callable[[Any], bool]:
    """Neutral when the value equals one of `values` with the same JSON type (`0` is not `false`)."""
    return lambda v: any(type(v) is type(x) and v == x or (_number(v) and _number(x) and v == x) for x in values)


# field -> (is the value neutral, the neutral value(s) in words, what the server does not do)
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "frequency_penalty": (_is(0), "0", "no frequency penalty is applied"),
    "presence_penalty": (_is(0), "0", "no presence penalty is applied"),
    "repetition_penalty": (_is(1), "1", "no repetition penalty is applied"),
    "logit_bias": (_is({}), "{}", "logits are not biased"),
    "top_k": (_is(-1, 0), "-1 or 0 (off)", "there is no top-k cut (top_p is honoured)"),
    "min_p": (_is(0), "0", "there is no min-p cut (top_p is honoured)"),
    "logprobs": (_is(False), "false", "log probabilities are not returned"),
    "top_logprobs": (_is(0), "0", "log probabilities are not returned"),
    "functions": (_is([]), "[]", "functions are not supported"),
    "function_call": (_is("none"), '"none"', "functions are not supported"),
    "modalities": (_is(["text"]), '["text"]', "the output is text only"),
    "audio": (lambda v: False, "null", "the output is text only"),
    "prediction": (lambda v: False, "null", "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "null", "the server never searches the web"),
    "reasoning_effort": (lambda v: False, "null", "the served models are not asked to reason"),
    "verbosity": (lambda v: False, "null", "the answer's length is set by max_tokens only"),
    "store": (_is(False), "false", "completions are not stored"),
    "service_tier": (_is("auto", "default"), '"auto" or "default"', "every request is served the same way"),
    "moderation": (lambda v: False, "null", "the server runs no moderation"),
    "prompt_cache_key": (lambda v: False, "null", "the server keeps no prompt cache across requests"),
    "prompt_cache_options": (lambda v: False, "null", "the server keeps no prompt cache across requests"),
    "prompt_cache_retention": (lambda v: False, "null", "the server keeps no prompt cache across requests"),
}

# Fields of one message: role and content are honoured, and an assistant's `tool_calls` and a tool message's
# `tool_call_id` (`omnijax.serve.tool_calls.message_extras`); name and the assistant's function / audio / refusal
# fields only at their empty values.
MESSAGE_FIELDS: dict[str, tuple[Callable[[Any], bool], str, str] | None] = {
    "role": None, "content": None,
    "name": (lambda v: False, "null", "the chat templates have no speaker names: put the name in the content"),
    "tool_calls": None,
    "function_call": (lambda v: False, "null", "functions are not supported"),
    "audio": (lambda v: False, "null", "audio answers are not supported"),
    "refusal": (lambda v: False, "null", "a refusal is not rendered into the prompt: put it in the content"),
    "tool_call_id": None,
}


def check_keys(obj: dict, known: Any, where: str) -> None:
    """Refuses the first key of `obj` not in `known`, by name (`param`: `where` + key), with the closest known key
    as a hint when there is one."""
    for key in obj:
        if key not in known:
            name = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.75)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise RequestError(f"unknown parameter '{name}'{hint}: this server refuses the fields it does not know "
                               f"rather than ignore them (docs/serving.md, Parameters)", code="unknown_parameter",
                               param=name)


def _check_neutral(table: dict, obj: dict, where: str) -> None:
    for key, rule in table.items():
        if rule is None or key not in obj or obj[key] is None:
            continue
        neutral, accepted, why = rule
        if not neutral(obj[key]):
            name = f"{where}.{key}" if where else key
            raise RequestError(f"'{name}' = {_shown(obj[key])} is not supported by this server: {why}; omit it or "
                               f"send {accepted}", code="unsupported", param=name)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(body: dict, per_row: bool = False) -> None:
    """Refuses an unknown top-level field, or a field of `NEUTRAL` at a value other than its neutral one (the
    `SAMPLED` ones are checked by `omnijax.serve.chat_sampling` instead when the server samples `per_row`)."""
    check_keys(body, (*HONOURED, *LABELS, *NEUTRAL), "")
    _check_neutral({k: v for k, v in NEUTRAL.items() if not (per_row and k in SAMPLED)}, body, "")


def check_message_fields(message: dict, param: str) -> None:
    """Refuses an unknown field of one message, or a `MESSAGE_FIELDS` one at a value other than its empty one."""
    check_keys(message, MESSAGE_FIELDS, param)
    _check_neutral(MESSAGE_FIELDS, message, param)


def check_labels(body: dict) -> dict:
    """Validates `user`, `safety_identifier` (strings of at most 256 characters) and `metadata` (at most 16 string
    keys of at most 64 characters with string values of at most 512, as OpenAI allows); returns those given."""
    labels: dict = {}
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > 256:
            raise RequestError(f"'{name}' must be a string of at most 256 characters", param=name)
        labels[name] = value
    metadata = body.get("metadata")
    if metadata is not None:
        if (not isinstance(metadata, dict) or len(metadata) > 16
                or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                           for k, v in metadata.items())):
            raise RequestError("'metadata' must be an object of at most 16 string values (keys up to 64 characters, "
                               "values up to 512)", param="metadata")
        labels["metadata"] = dict(metadata)
    return labels


def check_detail(image: dict, param: str) -> None:
    """`image_url` holds `url` and `detail`: "auto" (or null) is what the server does (the model's own image
    processing); "low", "high" and "original" are OpenAI's resolutions, which it does not apply."""
    check_keys(image, ("url", "detail"), param)
    detail = image.get("detail")
    if detail in (None, "auto"):
        return
    if detail in ("low", "high", "original"):
        raise RequestError(f"'{param}.detail' = {detail!r} is not supported: images are encoded at the model's own "
                           f"resolution; omit it or send \"auto\"", code="unsupported", param=param + ".detail")
    raise RequestError(f"'{param}.detail' must be \"auto\", \"low\", \"high\" or \"original\", got {detail!r}",
                       param=param + ".detail")


def stream_options(options: Any, stream: bool) -> bool:
    """`stream_options` (null, or an object allowed with `stream` true only, as OpenAI has it): whether the stream
    ends with a usage chunk. `include_obfuscation` is accepted false (the server pads no chunk)."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    check_keys(options, ("include_usage", "include_obfuscation"), "stream_options")
    for key in options:
        if options[key] is not None and not isinstance(options[key], bool):
            raise RequestError(f"'stream_options.{key}' must be a boolean, got {options[key]!r}",
                               param=f"stream_options.{key}")
    if options.get("include_obfuscation"):
        raise RequestError("'stream_options.include_obfuscation' = true is not supported: the server pads no chunk; "
                           "omit it or send false", code="unsupported", param="stream_options.include_obfuscation")
    return bool(options.get("include_usage"))
