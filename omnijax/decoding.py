"""Decoding strategies: how an answer's next token is chosen from the last position's logits.

A strategy is a tiny frozen dataclass of static settings (part of the compiled program, like a retention policy):
`warp(logits, history)` turns raw logits into the scores it draws from (`-inf` where a token is masked) and
`select(logits, history, key)` picks one token per sequence inside the jitted step. `StreamConfig.decoding` holds the
strategy of a session; `stream`, `Session`, `evaluate` and the engine all answer through it.

`RowSampling` chooses every setting per sequence at run time (a server's sessions each draw with their own request's
settings in one compiled step): temperature, top-p, top-k, min-p, presence / frequency / repetition penalties, a
logit bias and the log probabilities to return, in vLLM's order, with the penalties reading a per-row history carried
in the stream state (`StreamState.counts`, `seen`).

`Sampling` warps as transformers' `generate` does, processor by processor and in its order: repetition penalty,
temperature, top-k, top-p, min-p; then draws from the softmax of the warped scores with one PRNG key per sequence.
The keys live in the stream state (`StreamState.key`, seeded from `Sampling.seed`), so sampling runs inside the
jitted step and a session reproduces from its seed (the engine's n-th opened session from the seed folded with n).
In a streamed answer the repetition penalty sees the answer's own tokens.

Any frozen dataclass with such `warp` and `select` (and optionally `stop`) is a strategy too: MiniCPM-o's release
duplex rule is one (`omnijax.models.minicpmo.duplex.DuplexDecodeRule`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, ClassVar, Iterable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from omnijax.logits_processors import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    ROW_FIELDS,
    ROW_SETTINGS,
    ROW_WIDTH,
    keep_min_p,
    keep_top_k,
    keep_top_p,
    penalise,
    penalties,
    row_history,
    row_logprobs,
    row_warp,
    seen_tokens,
    wants_logprobs,
)
from omnijax.registry import Registry


class DecodingStrategy(Protocol):
    """What a decoding strategy has (module docstring); `STRATEGIES` holds the ones omnijax ships. Optional
    attributes read through `seed_of`, `stop_ids_of`, `answer_stop_ids`: `seed`, `stop`, `free_running`, and
    `per_row` (then `select` takes each row's settings as `row=` and its history as `counts=`, `seen=`, and the
    strategy has `rows(batch)`, the default rows)."""

    name: ClassVar[str]

    def warp(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` -> float32 scores `[B, V]` (`-inf` where masked); `history [B, N]`, -1 = padding."""
        ...

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 next tokens."""
        ...


# Re-exported: the per-row layout and processors are part of this module's interface.
__all__ = ["DecodingStrategy", "Greedy", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "ROW_FIELDS", "ROW_WIDTH", "RowSampling",
           "SEED_RANGE", "STRATEGIES", "Sampling", "answer_stop_ids", "check_decoding", "check_rows", "check_stop",
           "folded_keys", "penalties", "register", "row_logprobs", "row_warp", "sampling_keys", "sampling_row",
           "seed_of", "seen_tokens", "split_keys", "stop_ids_of", "wants_logprobs"]

# The decoding strategies by name (`omnijax.registry.Registry`): `register` adds a class under its `name`.
STRATEGIES: Registry[DecodingStrategy] = Registry("decoding strategy", DecodingStrategy,
                                                  hint="omnijax.decoding.STRATEGIES.create")
register = STRATEGIES.register


def check_stop(owner: str, stop: Any) -> tuple[int, ...]:
    """`stop` as a tuple of token ids (ints >= 0); refuses anything else, naming `owner`."""
    if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
        raise ValueError(f"{owner}: stop must be a sequence of token ids, got {stop!r}")
    ids = tuple(stop)
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in ids):
        raise ValueError(f"{owner}: stop token ids must be ints >= 0, got {stop!r}")
    return tuple(int(i) for i in ids)


@register
@dataclasses.dataclass(frozen=True)
class Greedy:
    """The most likely token (argmax over the vocabulary; ties go to the lowest id).

    Attributes:
        stop: token ids that end an answer, besides the checkpoint's end-of-sequence ids (the stop token is kept
            as the answer's last token, as transformers' `generate` keeps its eos).
        free_running: decode through the checkpoint's end-of-sequence ids (Metronome's continuous forced decoding:
            every frame decodes its tokens whatever they are); `stop` still ends an answer.
    """

    stop: tuple[int, ...] = ()
    free_running: bool = False
    name: ClassVar[str] = "greedy"

    def __post_init__(self):
        object.__setattr__(self, "stop", check_stop("Greedy", self.stop))
        _flag("Greedy", "free_running", self.free_running)

    def warp(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` as float32 scores; greedy masks nothing. `history [B, N]` (-1 = padding) is unused."""
        del history
        return logits.astype(jnp.float32)

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 next tokens for `logits [B, V]` (`key` is unused: greedy draws nothing)."""
        del key
        return jnp.argmax(self.warp(logits, history), axis=-1).astype(jnp.int32)


def _flag(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be True or False, got {value!r}")


def _number(name: str, value, ok, want: str):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"Sampling: {name} must be {want}, got {value!r}")


@register
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling from the warped distribution, with transformers' `generate` semantics for each setting.

    Attributes:
        temperature: divides the scores (> 0; use `Greedy()` for argmax).
        top_k: keep the k highest scores (0: off); ties with the k-th are kept.
        top_p: keep the smallest set of highest-probability tokens whose mass exceeds `top_p`, in (0, 1] (1: off);
            tokens tied at the cut are kept or dropped together (transformers drops those its sort puts first).

    Top-k and top-p find their cut by a 32-round search over the scores' bit patterns instead of a sort: on CPU a
    sort or `lax.top_k` over a 32K vocabulary took 6-7 ms per token, more than a decode step.
        min_p: drop tokens whose probability is below `min_p` times the top token's, in [0, 1) (0: off).
        repetition_penalty: scores of tokens in the history are divided by it when positive and multiplied by it
            when negative, once per token (> 0; 1: off).
        seed: the session's sampling seed (sequences of a batch draw from keys split off it).
        stop: token ids that end an answer, besides the checkpoint's end-of-sequence ids.
        free_running: decode through the checkpoint's end-of-sequence ids (as `Greedy`'s).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: tuple[int, ...] = ()
    free_running: bool = False
    name: ClassVar[str] = "sampling"

    def __post_init__(self):
        object.__setattr__(self, "stop", check_stop("Sampling", self.stop))
        _flag("Sampling", "free_running", self.free_running)
        _number("temperature", self.temperature, lambda x: x > 0,
                "> 0 (for the most likely token use omnijax.decoding.Greedy())")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"Sampling: top_k must be an int >= 0 (0 keeps every token), got {self.top_k!r}")
        _number("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1] (1 keeps every token)")
        _number("min_p", self.min_p, lambda x: 0 <= x < 1, "in [0, 1) (0 keeps every token)")
        _number("repetition_penalty", self.repetition_penalty, lambda x: x > 0, "> 0 (1 is no penalty)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"Sampling: seed must be an int, got {self.seed!r}")

    def warp(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` -> float32 scores, `-inf` where masked; `history [B, N]` (-1 = padding) are the tokens
        the repetition penalty applies to."""
        x = penalise(logits.astype(jnp.float32), history, self.repetition_penalty)
        if self.temperature != 1.0:
            x = x / self.temperature
        x = keep_top_k(x, self.top_k)
        if self.top_p < 1.0:
            x = keep_top_p(x, 1 - self.top_p)
        return keep_min_p(x, self.min_p)

    def keys(self, batch: int) -> jax.Array:
        """`[B]` PRNG keys of a batch's sequences, split off `seed` (the keys `sampling_keys` holds as data)."""
        return jax.random.wrap_key_data(sampling_keys(self.seed, batch))

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 tokens drawn from the warped distribution of `logits [B, V]`, row b with `key[b]`
        (`key`: `[B]` PRNG keys, e.g. `keys(B)`; required)."""
        if key is None:
            raise ValueError("Sampling.select needs one PRNG key per sequence (key=strategy.keys(batch))")
        scores = self.warp(logits, history)
        return jax.vmap(jax.random.categorical)(key, scores).astype(jnp.int32)


@register
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling whose settings are chosen per sequence at run time: each row of a batch (each session of a server)
    draws with its own, carried by the chunk that asks for answer tokens (`Chunk.sampling [B, ROW_WIDTH]`, rows built
    by `sampling_row`): temperature, top-p, top-k, min-p, presence / frequency / repetition penalties, a logit bias
    and how many log probabilities to return. One compiled program serves every value; a processor that no row of a
    batch uses is skipped (`lax.cond`), so rows asking for none of them cost what a plain temperature / top-p draw
    costs. A row with temperature 0 takes the most likely token after the bias and the penalties (as vLLM's greedy
    rows); any other row with only temperature / top-p set draws exactly as `Sampling(temperature=t, top_p=p, ...)`
    with the same key.

    The processors run in vLLM's order (its V1 sampler): logit bias, then the penalties (repetition, then
    frequency, then presence), temperature, min-p, top-k, top-p, then the draw. The penalties read the carried
    per-row history (`StreamState.counts`, `StreamState.seen`): frequency and presence count the tokens of the
    answer being decoded (OpenAI's "so far"), the repetition penalty every token id the session has written (its
    prompt and its answers, as vLLM's prompt + output). Called without them, `history [B, N]` stands for both.

    Attributes:
        temperature, top_p, top_k, min_p, repetition_penalty: the settings of rows whose chunk carries none.
        seed, stop, free_running: as `Sampling`'s.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: tuple[int, ...] = ()
    free_running: bool = False
    per_row = True  # `select` takes the rows' settings (`row=`) and history (`counts=`, `seen=`)
    name: ClassVar[str] = "row_sampling"

    def __post_init__(self):
        object.__setattr__(self, "stop", check_stop("RowSampling", self.stop))
        _flag("RowSampling", "free_running", self.free_running)
        _number("temperature", self.temperature, lambda x: x >= 0, ">= 0 (0: the most likely token)")
        _number("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1] (1 keeps every token)")
        Sampling(top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                 seed=self.seed)  # the shared settings, validated as Sampling validates them

    def rows(self, batch: int) -> jax.Array:
        """`[batch, ROW_WIDTH]` float32: the default row of rows that carry none."""
        row = sampling_row(self.temperature, self.top_p, top_k=self.top_k, min_p=self.min_p,
                           repetition_penalty=self.repetition_penalty)
        return jnp.broadcast_to(jnp.asarray(row), (batch, ROW_WIDTH))

    def warp(self, logits: jax.Array, history: jax.Array | None = None, row: jax.Array | None = None,
             counts: jax.Array | None = None, seen: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` -> float32 scores for rows drawing with `row [B, ROW_WIDTH]` (`sampling_row`s; default
        `rows(B)`); rows with temperature 0 are only biased and penalised. `counts [B, V]` int32 (this answer's
        tokens) and `seen [B, V]` bool (the session's tokens) feed the penalties; without them `history [B, N]`
        (-1 = padding) stands for both."""
        row = self.rows(logits.shape[0]) if row is None else row.astype(jnp.float32)
        return row_warp(logits, row, *row_history(logits, history, counts, seen))

    def keys(self, batch: int) -> jax.Array:
        return jax.random.wrap_key_data(sampling_keys(self.seed, batch))

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None,
               row: jax.Array | None = None, counts: jax.Array | None = None,
               seen: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 tokens: row b draws from its warped scores with `key[b]`, or takes the argmax (after the
        bias and the penalties) when its temperature is 0."""
        if key is None:
            raise ValueError("RowSampling.select needs one PRNG key per sequence (key=strategy.keys(batch))")
        row = self.rows(logits.shape[0]) if row is None else row.astype(jnp.float32)
        scores = self.warp(logits, history, row, counts, seen)
        greedy = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        sampled = row[:, 0] > 0  # [B]
        drawn = jax.lax.cond(jnp.any(sampled), lambda: jax.vmap(jax.random.categorical)(key, scores).astype(
            jnp.int32), lambda: greedy)  # a batch of greedy rows skips the draw
        return jnp.where(sampled, drawn, greedy)


def sampling_row(temperature: float, top_p: float = 1.0, *, top_k: int = 0, min_p: float = 0.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 top_logprobs: int | None = None, logit_bias: Mapping[int, float] | None = None,
                 vocab_size: int | None = None) -> np.ndarray:
    """One row's `RowSampling` settings as float32 `[ROW_WIDTH]` (columns `ROW_FIELDS`, then the logit bias).

    Args:
        temperature: >= 0 (0: the most likely token).
        top_p: in (0, 1]; stored as the tail mass 1 - top_p, computed in float64 before rounding, so that the row
            compares exactly as `Sampling` does.
        top_k: keep the k highest scores; 0 or -1: off.
        min_p: in [0, 1]; drop tokens less likely than min_p times the top token (0: off).
        presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's), over the tokens of the answer so far.
        repetition_penalty: > 0 (1: off), over every token the session has written (prompt and answers).
        top_logprobs: None: no log probabilities; k in [0, MAX_TOP_LOGPROBS]: the chosen token's and the k most
            likely alternatives'.
        logit_bias: token id -> bias in [-100, 100], at most MAX_LOGIT_BIAS entries.
        vocab_size: when given, logit-bias ids must lie below it.

    Raises:
        ValueError: naming the setting and its range.
    """
    _number("temperature", temperature, lambda x: x >= 0, ">= 0 (0: the most likely token)")
    _number("top_p", top_p, lambda x: 0 < x <= 1, "in (0, 1] (1 keeps every token)")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < -1:
        raise ValueError(f"Sampling: top_k must be an int >= -1 (0 or -1 keeps every token), got {top_k!r}")
    _number("min_p", min_p, lambda x: 0 <= x <= 1, "in [0, 1] (0 keeps every token)")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        _number(name, value, lambda x: -2 <= x <= 2, "in [-2, 2] (0 is no penalty)")
    _number("repetition_penalty", repetition_penalty, lambda x: 0 < x <= 1e6, "> 0 (1 is no penalty)")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, numbers.Integral)
                                     or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"Sampling: top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}] or None, got "
                         f"{top_logprobs!r}")
    bias = dict(logit_bias or {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"Sampling: logit_bias holds {len(bias)} entries, over the {MAX_LOGIT_BIAS} a row carries")
    limit = min(vocab_size, 2 ** 24) if vocab_size is not None else 2 ** 24
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < limit:
            raise ValueError(f"Sampling: logit_bias token id {token!r} is not a token id in [0, {limit})")
        _number(f"logit_bias[{token}]", value, lambda x: -100 <= x <= 100, "in [-100, 100]")
    row = np.zeros((ROW_WIDTH,), np.float32)
    row[:ROW_SETTINGS] = [float(temperature), 1.0 - float(top_p), float(max(int(top_k), 0)), float(min_p),
                float(presence_penalty), float(frequency_penalty), float(repetition_penalty),
                -1.0 if top_logprobs is None else float(top_logprobs)]
    row[ROW_SETTINGS:ROW_SETTINGS + MAX_LOGIT_BIAS] = -1.0
    row[ROW_SETTINGS:ROW_SETTINGS + len(bias)] = [int(t) for t in bias]
    row[ROW_SETTINGS + MAX_LOGIT_BIAS:ROW_SETTINGS + MAX_LOGIT_BIAS + len(bias)] = [float(v) for v in bias.values()]
    return row


def check_rows(rows: np.ndarray) -> str | None:
    """What is wrong with `rows [..., ROW_WIDTH]` of `sampling_row`s (None when nothing is)."""
    rows = np.asarray(rows, np.float32)
    if rows.shape[-1:] != (ROW_WIDTH,):
        return f"the last axis must hold {ROW_WIDTH} settings, got shape {rows.shape}"
    s = {name: rows[..., i] for i, name in enumerate(ROW_FIELDS)}
    ids = rows[..., ROW_SETTINGS:ROW_SETTINGS + MAX_LOGIT_BIAS]
    checks = [(np.isfinite(rows).all(), "finite"), ((s["temperature"] >= 0).all(), "temperature >= 0"),
              (((s["top_p_tail"] >= 0) & (s["top_p_tail"] < 1)).all(), "1 - top_p in [0, 1)"),
              ((s["top_k"] >= 0).all() and (s["top_k"] == np.round(s["top_k"])).all(), "top_k an int >= 0"),
              (((s["min_p"] >= 0) & (s["min_p"] <= 1)).all(), "min_p in [0, 1]"),
              ((np.abs(s["presence_penalty"]) <= 2).all() and (np.abs(s["frequency_penalty"]) <= 2).all(),
               "presence and frequency penalties in [-2, 2]"),
              ((s["repetition_penalty"] > 0).all(), "repetition_penalty > 0"),
              (((s["top_logprobs"] >= -1) & (s["top_logprobs"] <= MAX_TOP_LOGPROBS)).all(),
               f"top_logprobs in [-1, {MAX_TOP_LOGPROBS}]"),
              (((ids == -1) | ((ids >= 0) & (ids == np.round(ids)))).all(), "logit-bias ids ints >= 0 or -1"),
              ((np.abs(rows[..., ROW_SETTINGS + MAX_LOGIT_BIAS:]) <= 100).all(), "biases in [-100, 100]")]
    bad = [what for ok, what in checks if not ok]
    return "; ".join(bad) if bad else None


# The seeds a request may give (OpenAI's `seed` is a signed 64-bit integer; jax keys take no wider value).
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def seed_of(strategy: DecodingStrategy) -> int:
    """The sampling seed of a decoding strategy (0 for one that draws nothing)."""
    return int(getattr(strategy, "seed", 0))


def stop_ids_of(strategy: DecodingStrategy) -> tuple[int, ...]:
    """The stop token ids of a decoding strategy (none for one without `stop`)."""
    return tuple(getattr(strategy, "stop", ()))


def answer_stop_ids(strategy: DecodingStrategy, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
    """The ids that end an answer decoded with `strategy`: the checkpoint's `eos_token_ids` (unless the strategy is
    `free_running`) and the strategy's own `stop` ids."""
    eos = () if getattr(strategy, "free_running", False) else tuple(int(t) for t in eos_token_ids)
    return eos + stop_ids_of(strategy)


def sampling_keys(seed: int, batch: int) -> jax.Array:
    """`[batch, 2]` uint32 key data: the sampling keys of a batch's sequences, split off `seed`."""
    return jax.random.key_data(jax.random.split(jax.random.key(seed), batch))


def folded_keys(seed: int, indices: ArrayLike) -> jax.Array:
    """`[n, 2]` uint32 key data: one key per session index in `indices [n]`, folded from `seed` (the n-th session
    of an engine or of `evaluate` draws with `folded_keys(seed, [n])`)."""
    base = jax.random.key(seed)
    return jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(indices)))


def split_keys(key_data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`key_data [B, 2]` -> `(draw [B] keys, next [B, 2] key data)`: one key per row to draw with now, one to keep."""
    pair = jax.vmap(jax.random.split)(jax.random.wrap_key_data(key_data))
    return pair[:, 0], jax.random.key_data(pair[:, 1])


def check_decoding(strategy: Any) -> DecodingStrategy:
    """Returns `strategy` if it is a decoding strategy object (with `warp` and `select`); refuses a name, a class or
    anything else, naming the registered strategies."""
    return STRATEGIES.check(strategy, "decoding")
