"""Decoding strategies: how an answer's next token is chosen from the last position's logits.

A strategy is a tiny frozen dataclass of static settings (part of the compiled program, like a retention policy):
`warp(logits, history)` turns raw logits into the scores it draws from (`-inf` where a token is masked) and
`select(logits, history, key)` picks one token per sequence inside the jitted step. `StreamConfig.decoding` holds the
strategy of a session; `stream`, `Session`, `evaluate` and the engine all answer through it.

`RowSampling` is `Sampling` with the temperature and top-p chosen per sequence at run time (a server's sessions each
draw with their own request's settings in one compiled step).

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
from typing import Any, ClassVar, Iterable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from omnijax.registry import Registry


class DecodingStrategy(Protocol):
    """What a decoding strategy has (module docstring); `STRATEGIES` holds the ones omnijax ships. Optional
    attributes read through `seed_of`, `stop_ids_of`, `answer_stop_ids`: `seed`, `stop`, `free_running`, and
    `per_row` (then `select` takes each row's settings as `row=`)."""

    name: ClassVar[str]

    def warp(self, logits: jax.Array, history: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` -> float32 scores `[B, V]` (`-inf` where masked); `history [B, N]`, -1 = padding."""
        ...

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 next tokens."""
        ...


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


def seen_tokens(history: jax.Array, vocab_size: int) -> jax.Array:
    """`[B, V]` bool: the token ids in each row of `history [B, N]` (entries < 0 are padding; ids >= V ignored)."""
    B = history.shape[0]
    ids = jnp.where(history >= 0, history, vocab_size)  # padding scatters out of range and is dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], history.shape)
    return jnp.zeros((B, vocab_size), bool).at[rows, ids].set(True, mode="drop")


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 scores `x` (-inf lowest), for exact searches without a sort."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key(keys: jax.Array, holds) -> jax.Array:
    """`[B, 1]`: per row, the largest uint32 t for which `holds(t [B, 1]) -> [B, 1] bool` is true, for a predicate
    that is true up to some t and false after (t = 0 when it never holds): 32 rounds of one bit each."""
    t = jnp.zeros(keys.shape[:-1] + (1,), jnp.uint32)
    for bit in range(31, -1, -1):
        candidate = t | jnp.uint32(1 << bit)
        t = jnp.where(holds(candidate), candidate, t)
    return t


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
        x = _penalise(logits.astype(jnp.float32), history, self.repetition_penalty)
        if self.temperature != 1.0:
            x = x / self.temperature
        x = _top_k(x, self.top_k)
        if self.top_p < 1.0:
            x = _top_p(x, 1 - self.top_p)
        return _min_p(x, self.min_p)

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


def _penalise(x: jax.Array, history: jax.Array | None, penalty: float) -> jax.Array:
    """Repetition penalty on the scores of tokens in `history` (transformers' processor)."""
    if penalty == 1.0 or history is None:
        return x
    penalised = jnp.where(x < 0, x * penalty, x / penalty)
    return jnp.where(seen_tokens(history, x.shape[-1]), penalised, x)


def _top_k(x: jax.Array, k: int) -> jax.Array:
    """Keeps scores >= the k-th largest (ties with it too, as transformers); 0 keeps every token."""
    if not k or k >= x.shape[-1]:
        return x
    keys = _order_keys(x)
    kth = _largest_key(keys, lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k)
    return jnp.where(keys < kth, -jnp.inf, x)


def _top_p(x: jax.Array, tail) -> jax.Array:
    """Drops the lowest scores while their mass, counted from the bottom, is <= `tail` = 1 - top_p (a Python float,
    or float32 `[B, 1]` per row holding the float64 difference rounded, so both compare alike)."""
    keys, probs = _order_keys(x), jax.nn.softmax(x, axis=-1)

    def within(t):  # the mass of scores <= t stays within the tail
        return jnp.sum(jnp.where(keys <= t, probs, 0.0), axis=-1, keepdims=True) <= tail

    floor = _largest_key(keys, within)
    return jnp.where((keys <= floor) & within(floor), -jnp.inf, x)  # the top token's mass makes it stay


def _min_p(x: jax.Array, min_p: float) -> jax.Array:
    if min_p <= 0.0:
        return x
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs < min_p * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


@register
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling whose temperature and top-p are chosen per sequence at run time: each row of a batch (each session
    of a server) draws with its own, carried by the chunk that asks for answer tokens (`Chunk.sampling [B, 2]`, rows
    built by `sampling_row(temperature, top_p)`). A row with temperature 0 takes the most likely token (as `Greedy`);
    any other row draws exactly as `Sampling(temperature=t, top_p=p, ...)` with the same key. Top-k, min-p, the
    repetition penalty, the seed and the stop ids are static, as in `Sampling`.

    Attributes:
        temperature, top_p: the values of rows whose chunk carries none.
        top_k, min_p, repetition_penalty, seed, stop, free_running: as `Sampling`'s.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: tuple[int, ...] = ()
    free_running: bool = False
    per_row = True  # `select` takes the rows' settings (`row=`)
    name: ClassVar[str] = "row_sampling"

    def __post_init__(self):
        object.__setattr__(self, "stop", check_stop("RowSampling", self.stop))
        _flag("RowSampling", "free_running", self.free_running)
        _number("temperature", self.temperature, lambda x: x >= 0, ">= 0 (0: the most likely token)")
        _number("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1] (1 keeps every token)")
        Sampling(top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                 seed=self.seed)  # the shared settings, validated as Sampling validates them

    def rows(self, batch: int) -> jax.Array:
        """`[batch, 2]` float32: the default row (`sampling_row(temperature, top_p)`) of rows that carry none."""
        return jnp.broadcast_to(jnp.asarray(sampling_row(self.temperature, self.top_p)), (batch, 2))

    def warp(self, logits: jax.Array, history: jax.Array | None = None, row: jax.Array | None = None) -> jax.Array:
        """`logits [B, V]` -> float32 scores for rows drawing with `row [B, 2]` (`sampling_row`s; default
        `rows(B)`); rows with temperature 0 are only penalised."""
        row = self.rows(logits.shape[0]) if row is None else row.astype(jnp.float32)
        temperature, tail = row[:, :1], row[:, 1:]  # [B, 1] each
        x = _penalise(logits.astype(jnp.float32), history, self.repetition_penalty)
        x = jnp.where((temperature > 0) & (temperature != 1.0), x / jnp.where(temperature > 0, temperature, 1.0), x)
        x = _top_k(x, self.top_k)
        x = jax.lax.cond(jnp.any(tail > 0), lambda x: jnp.where(tail > 0, _top_p(x, tail), x), lambda x: x, x)
        return _min_p(x, self.min_p)

    def keys(self, batch: int) -> jax.Array:
        return jax.random.wrap_key_data(sampling_keys(self.seed, batch))

    def select(self, logits: jax.Array, history: jax.Array | None = None, key: jax.Array | None = None,
               row: jax.Array | None = None) -> jax.Array:
        """`[B]` int32 tokens: row b draws from its warped scores with `key[b]`, or takes the argmax (after the
        repetition penalty) when its temperature is 0."""
        if key is None:
            raise ValueError("RowSampling.select needs one PRNG key per sequence (key=strategy.keys(batch))")
        row = self.rows(logits.shape[0]) if row is None else row
        scores = self.warp(logits, history, row)
        greedy = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        sampled = row[:, 0] > 0  # [B]
        drawn = jax.lax.cond(jnp.any(sampled), lambda: jax.vmap(jax.random.categorical)(key, scores).astype(
            jnp.int32), lambda: greedy)  # a batch of greedy rows skips the draw (and warp's top-p search above)
        return jnp.where(sampled, drawn, greedy)


def sampling_row(temperature: float, top_p: float = 1.0) -> np.ndarray:
    """One row's `RowSampling` settings as float32 `[2]`: the temperature (>= 0; 0: the most likely token) and top-p's
    tail mass 1 - top_p, computed in float64 before rounding, so that the row compares exactly as `Sampling` does."""

    _number("temperature", temperature, lambda x: x >= 0, ">= 0 (0: the most likely token)")
    _number("top_p", top_p, lambda x: 0 < x <= 1, "in (0, 1] (1 keeps every token)")
    return np.asarray([float(temperature), 1.0 - float(top_p)], np.float32)


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
