"""The sampling fields of a chat-completions request (issue 37 item 1), checked and turned into one per-row setting.

A server decoding with `omnijax.decoding.RowSampling` (as `omnijax serve` does) honours, per request and inside its
one compiled step: `temperature` [0, 2], `top_p` (0, 1], `seed`, `presence_penalty` / `frequency_penalty` [-2, 2],
`repetition_penalty` (0, 2] and `top_k` (>= -1; -1 and 0: off), `min_p` [0, 1] (vLLM's extra parameters),
`logit_bias` (token id -> bias in [-100, 100], at most `MAX_LOGIT_BIAS` ids of the vocabulary), `logprobs` /
`top_logprobs` [0, 20] (the raw model distribution, as vLLM returns by default) and `n` in [1, `MAX_N`]. A bad value
is a 400 naming the field. A server with one fixed strategy refuses every one of them but at its neutral value
(`omnijax.serve.chat_params.NEUTRAL`), and `temperature` / `top_p` / `seed` that differ from what it decodes with.

The module is pure: it validates a decoded JSON body and raises `RequestError`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from omnijax.decoding import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SEED_RANGE, DecodingStrategy, sampling_row
from omnijax.serve.chat_params import RequestError

__all__ = ["MAX_N", "Sampled", "request_sampling"]

# The most choices one request may ask for (`n`): each is a row of the engine's batch for the answer's length.
MAX_N = 8


@dataclasses.dataclass(frozen=True)
class Sampled:
    """A request's sampling: `row` (`omnijax.decoding.sampling_row`; None: the server's default row), `seed`,
    `n` choices and `top_logprobs` (None: no log probabilities; k: the chosen token's and k alternatives')."""

    row: np.ndarray | None = None
    seed: int | None = None
    n: int = 1
    top_logprobs: int | None = None


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(body: dict, name: str, ok: Callable[[Any], bool], want: str) -> Any:
    value = body.get(name)
    if value is not None and not ok(value):
        raise RequestError(f"'{name}' must be {want}, got {value!r}", param=name)
    return value


def _choices(body: dict) -> tuple[int, int | None]:
    """`(n, top_logprobs or None)` of a request."""
    n = _field(body, "n", lambda v: _int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}] (MAX_N)")
    logprobs = _field(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    top = _field(body, "top_logprobs", lambda v: _int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                 f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (1 if n is None else n), ((top or 0) if logprobs else None)


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' holds {len(bias)} token ids, over the {MAX_LOGIT_BIAS} a request may bias",
                           param="logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not _int(token) or not 0 <= token < vocab_size:
            raise RequestError(f"'logit_bias' key {key!r} is not a token id of the vocabulary (0 to "
                               f"{vocab_size - 1})", param="logit_bias")
        if not _real(value) or not -100 <= value <= 100:
            raise RequestError(f"'logit_bias' of token {key} must be a number in [-100, 100], got {value!r}",
                               param="logit_bias")
        out[token] = float(value)
    return out


def request_sampling(body: dict, decoding: DecodingStrategy, vocab_size: int,
                     check_decoding: Callable[[dict, Any], None]) -> Sampled:
    """The request's `Sampled`; `RequestError` naming the first bad field. A per-row server (`RowSampling`) builds
    the row when any setting is given (or log probabilities are asked); any other runs `check_decoding(body,
    decoding)` (its refusals of what differs from its one strategy) and takes `n` only."""
    n, top_logprobs = _choices(body)
    if not getattr(decoding, "per_row", False):
        check_decoding(body, decoding)
        return Sampled(n=n)
    temperature = _field(body, "temperature", lambda v: _real(v) and 0 <= v <= 2, "a number in [0, 2]")
    top_p = _field(body, "top_p", lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]")
    seed = _field(body, "seed", lambda v: _int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1],
                  f"a signed 64-bit integer (in [{SEED_RANGE[0]}, {SEED_RANGE[1]}])")
    settings = {
        "presence_penalty": _field(body, "presence_penalty", lambda v: _real(v) and -2 <= v <= 2,
                                   "a number in [-2, 2]"),
        "frequency_penalty": _field(body, "frequency_penalty", lambda v: _real(v) and -2 <= v <= 2,
                                    "a number in [-2, 2]"),
        "repetition_penalty": _field(body, "repetition_penalty", lambda v: _real(v) and 0 < v <= 2,
                                     "a number in (0, 2] (1: no penalty)"),
        "top_k": _field(body, "top_k", lambda v: _int(v) and v >= -1, "an integer >= -1 (-1 or 0: off)"),
        "min_p": _field(body, "min_p", lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    }
    bias = _logit_bias(body, vocab_size)
    given = {k: v for k, v in settings.items() if v is not None}
    if temperature is None and top_p is None and not given and not bias and top_logprobs is None:
        return Sampled(seed=seed, n=n)
    defaults = {name: getattr(decoding, name) for name in ("top_k", "min_p", "repetition_penalty")
                if hasattr(decoding, name)}
    temperature = getattr(decoding, "temperature", 0.0) if temperature is None else float(temperature)
    row = sampling_row(temperature, getattr(decoding, "top_p", 1.0) if top_p is None else float(top_p),
                       **{**defaults, **given},
                       logit_bias=bias, top_logprobs=top_logprobs, vocab_size=vocab_size)
    return Sampled(row, seed, n, top_logprobs)
