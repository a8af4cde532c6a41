"""Logits processors: pure functions from scores `[B, V]` to scores, run inside the compiled step.

`Sampling`'s processors (transformers' semantics, settings static: `penalise`, `keep_top_k`, `keep_top_p`,
`keep_min_p`) and `RowSampling`'s per-row ones (vLLM's semantics, settings read from each row at run time: `row_warp`,
`penalties`, `row_logprobs`), with the row layout they read (`ROW_FIELDS`, then the logit bias), and the per-row
token mask of constrained decoding (`allowed_tokens`). Top-k and top-p find their cut by a 32-round search over the
scores' bit patterns instead of a sort (on CPU a sort or `lax.top_k` over a 32K vocabulary took 6-7 ms per token,
more than a decode step). `omnijax.decoding` holds the strategies that use them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def penalise(x: jax.Array, history: jax.Array | None, penalty: float) -> jax.Array:
    """Repetition penalty on the scores of tokens in `history` (transformers' processor)."""
    if penalty == 1.0 or history is None:
        return x
    penalised = jnp.where(x < 0, x * penalty, x / penalty)
    return jnp.where(seen_tokens(history, x.shape[-1]), penalised, x)


def keep_top_k(x: jax.Array, k: int) -> jax.Array:
    """Keeps scores >= the k-th largest (ties with it too, as transformers); 0 keeps every token."""
    if not k or k >= x.shape[-1]:
        return x
    keys = _order_keys(x)
    kth = _largest_key(keys, lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k)
    return jnp.where(keys < kth, -jnp.inf, x)


def keep_top_p(x: jax.Array, tail: jax.Array | float) -> jax.Array:
    """Drops the lowest scores while their mass, counted from the bottom, is <= `tail` = 1 - top_p (a Python float,
    or float32 `[B, 1]` per row holding the float64 difference rounded, so both compare alike)."""
    keys, probs = _order_keys(x), jax.nn.softmax(x, axis=-1)

    def within(t):  # the mass of scores <= t stays within the tail
        return jnp.sum(jnp.where(keys <= t, probs, 0.0), axis=-1, keepdims=True) <= tail

    floor = _largest_key(keys, within)
    return jnp.where((keys <= floor) & within(floor), -jnp.inf, x)  # the top token's mass makes it stay


def keep_min_p(x: jax.Array, min_p: float) -> jax.Array:
    if min_p <= 0.0:
        return x
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs < min_p * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


# The per-row settings of `RowSampling`: one float32 row per sequence (`sampling_row`), columns in this order, then
# MAX_LOGIT_BIAS logit-bias token ids (-1: none; ids are exact in float32 below 2**24) and as many biases.
ROW_FIELDS = ("temperature", "top_p_tail", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "top_logprobs")
MAX_LOGIT_BIAS = 128  # logit-bias entries one row carries (a fixed width: the row is part of every batch)
MAX_TOP_LOGPROBS = 20  # the most alternatives a row's log probabilities list (OpenAI's and vLLM's cap)
ROW_SETTINGS = len(ROW_FIELDS)
ROW_WIDTH = ROW_SETTINGS + 2 * MAX_LOGIT_BIAS
_COL = {name: i for i, name in enumerate(ROW_FIELDS)}


def row_history(logits: jax.Array, history: jax.Array | None, counts: jax.Array | None,
             seen: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """`(counts [B, V] int32, seen [B, V] bool)`: the given ones, else both from `history [B, N]` (-1 = padding)."""
    B, V = logits.shape
    if counts is None:
        if history is None:
            counts = jnp.zeros((B, V), jnp.int32)
        else:
            ids = jnp.where(history >= 0, history, V)
            rows = jnp.broadcast_to(jnp.arange(B)[:, None], history.shape)
            counts = jnp.zeros((B, V), jnp.int32).at[rows, ids].add(1, mode="drop")
    return counts, (counts > 0) if seen is None else seen


def row_warp(logits: jax.Array, row: jax.Array, counts: jax.Array, seen: jax.Array) -> jax.Array:
    """`RowSampling`'s processors on `logits [B, V]` for rows `row [B, ROW_WIDTH]`, in vLLM's order (logit bias,
    repetition, frequency and presence penalties, temperature, min-p, top-k, top-p). `counts [B, V]` int32: this
    answer's token counts; `seen [B, V]` bool: every token the session wrote. Each processor runs only when some row
    of the batch uses it (`lax.cond`; a batch that uses none of bias, penalties, min-p and top-k pays one test for
    them together); a row that does not use a processor is unchanged by it."""
    x = logits.astype(jnp.float32)
    col = lambda name: row[:, _COL[name]][:, None]  # noqa: E731  [B, 1]
    ids, bias = row[:, ROW_SETTINGS:ROW_SETTINGS + MAX_LOGIT_BIAS], row[:, ROW_SETTINGS + MAX_LOGIT_BIAS:]
    presence, frequency, repetition = col("presence_penalty"), col("frequency_penalty"), col("repetition_penalty")
    temperature, tail, top_k, min_p = col("temperature"), col("top_p_tail"), col("top_k"), col("min_p")
    use = {"bias": jnp.any(ids >= 0), "penalties": jnp.any((presence != 0) | (frequency != 0) | (repetition != 1)),
           "min_p": jnp.any(min_p > 0), "top_k": jnp.any(top_k > 0)}

    def scale(x):
        return jnp.where((temperature > 0) & (temperature != 1.0), x / jnp.where(temperature > 0, temperature, 1.0), x)

    def every(x):
        x = jax.lax.cond(use["bias"], lambda x: _bias(x, ids, bias), lambda x: x, x)
        x = jax.lax.cond(use["penalties"], lambda x: penalties(x, counts, seen, presence, frequency, repetition),
                         lambda x: x, x)
        x = jax.lax.cond(use["min_p"], lambda x: _min_p_rows(scale(x), min_p), scale, x)
        return jax.lax.cond(use["top_k"], lambda x: _top_k_rows(x, top_k.astype(jnp.int32)), lambda x: x, x)

    x = jax.lax.cond(use["bias"] | use["penalties"] | use["min_p"] | use["top_k"], every, scale, x)
    return jax.lax.cond(jnp.any(tail > 0), lambda x: jnp.where(tail > 0, keep_top_p(x, tail), x), lambda x: x, x)


def _bias(x: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """Adds `bias [B, N]` to the scores of token `ids [B, N]` (float; < 0: no entry) of each row."""
    B, V = x.shape
    cols = jnp.where(ids >= 0, ids, V).astype(jnp.int32)  # no entry: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], cols.shape)
    return x.at[rows, cols].add(bias, mode="drop")


def penalties(x: jax.Array, counts: jax.Array, seen: jax.Array, presence: jax.Array | float,
              frequency: jax.Array | float, repetition: jax.Array | float) -> jax.Array:
    """vLLM's penalties: scores of `seen` tokens divided by `repetition` when positive, multiplied when not; then
    `frequency` times each token's count in the answer and `presence` once per token present in it are
    subtracted. The settings are `[B, 1]` (or scalars)."""
    factor = jnp.where(seen, repetition, 1.0)
    x = jnp.where(x > 0, x / factor, x * factor)
    x = x - frequency * counts.astype(jnp.float32)
    return x - presence * (counts > 0).astype(jnp.float32)


def _top_k_rows(x: jax.Array, k: jax.Array) -> jax.Array:
    """Per-row top-k (`k [B, 1]`; <= 0 or >= V: off): keeps scores >= the row's k-th largest (ties too)."""
    V = x.shape[-1]
    keys = _order_keys(x)
    kth = _largest_key(keys, lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k)
    return jnp.where((k > 0) & (k < V) & (keys < kth), -jnp.inf, x)


def _min_p_rows(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """Per-row min-p (`min_p [B, 1]`; 0: off): drops tokens less likely than min_p times the row's top token."""
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs < min_p * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


def allowed_tokens(mask: jax.Array, vocab_size: int) -> jax.Array:
    """`[B, vocab_size]` bool: the tokens a per-row bitmask `mask [B, ceil(V / 32)]` int32 allows (bit `j % 32` of
    word `j // 32` set: token j allowed; `omnijax.serve.engine.constraint.TokenConstraint.bitmask`)."""
    words = jax.lax.bitcast_convert_type(mask.astype(jnp.int32), jnp.uint32)  # [B, W]
    bits = jax.lax.shift_right_logical(words[:, :, None], jnp.arange(32, dtype=jnp.uint32)[None, None]) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].astype(bool)


def wants_logprobs(row: jax.Array) -> jax.Array:
    """`[]` bool: whether any row of `row [B, ROW_WIDTH]` asks for log probabilities."""
    return jnp.any(row[:, _COL["top_logprobs"]] >= 0)


def row_logprobs(logits: jax.Array, token: jax.Array, row: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log probabilities of the raw model distribution (the log-softmax of `logits [B, V]` before any processor,
    as vLLM returns them by default) for rows whose `top_logprobs` column is >= 0: `(chosen [B] float32 of `token
    [B]`, top ids [B, MAX_TOP_LOGPROBS] int32, their logprobs)`, highest first. Computed only when some row asks
    (and the top list only when some row asks for alternatives); rows that do not ask get zeros."""
    B = logits.shape[0]
    want = row[:, _COL["top_logprobs"]]
    zeros = (jnp.zeros((B,), jnp.float32), jnp.zeros((B, MAX_TOP_LOGPROBS), jnp.int32),
             jnp.zeros((B, MAX_TOP_LOGPROBS), jnp.float32))

    def compute():
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
        def top():  # a vocabulary under MAX_TOP_LOGPROBS is padded with id 0 at -inf
            values, ids = jax.lax.top_k(logp, min(MAX_TOP_LOGPROBS, logp.shape[-1]))
            pad = ((0, 0), (0, MAX_TOP_LOGPROBS - values.shape[-1]))
            return jnp.pad(values, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)

        top_lp, top_ids = jax.lax.cond(jnp.any(want > 0), top, lambda: (zeros[2], zeros[1]))
        listed = (want > 0)[:, None]
        return (jnp.where(want >= 0, chosen, 0.0), jnp.where(listed, top_ids, 0).astype(jnp.int32),
                jnp.where(listed, top_lp, 0.0))

    return jax.lax.cond(jnp.any(want >= 0), compute, lambda: zeros)
