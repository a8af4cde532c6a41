"""The engine's compiled steps: the fused tick (`engine_step`: prefill, retention and a `lax.while_loop` answer of up
to tau tokens in one program) and the host-driven tick (`host_tick`: the same prefill and retention with no answer,
then one jitted `decode_token` step per answer token, called from the engine thread).

The host-driven tick hands each token to a callback as soon as it is decoded (per-token streaming) and lets a row's
`omnijax.serve.engine.constraint.TokenConstraint` choose the tokens it may draw, one bitmask per token. It draws the
same tokens as the fused tick: the same `decode_token` with the same keys, split once per step, the same active
rows; a row also ends at once when its callback says so (its answer was cancelled) or its constraint is finished.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.chunks.chunk import Chunk
from omnijax.compilation_cache import cached_jit
from omnijax.decoding import MAX_TOP_LOGPROBS, ROW_FIELDS, answer_stop_ids
from omnijax.paging import migration
from omnijax.serve.engine.constraint import TokenConstraint, mask_words
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.step import StreamState, chunk_step, decode_token

if TYPE_CHECKING:
    from omnijax.serve.engine.engine import Engine

# on_token(session id, token, logprob entry or None) -> True to end the row now. Runs in the engine thread.
OnToken = Callable[[str, int, "tuple | None"], bool]


@cached_jit(static_argnames=("graphdef", "config", "answer", "tap_answer", "keep_written"),
            donate_argnames=("state",))
def engine_step(graphdef: nnx.GraphDef, params: nnx.State, state: StreamState, chunk: Chunk, *,
                config: StreamConfig, answer: bool = True, tap_answer: bool = False, keep_written: bool = False
                ) -> tuple[StreamState, tuple]:
    """chunk_step + drop_empty_entries. Returns `(state, (logits [B, V], tokens [B, tau], exhausted [B],
    dropped [B], num_free [], table_full [B], logprobs))`, `logprobs` the step's `(chosen, top ids, top logprobs)`
    (None unless the strategy is per-row). `answer=False`: the prefill of a host-driven tick (no answer tokens).
    `tap_answer` (static): an eighth output, `answer_rows [B, tau, D]`, each answer token's final-normed
    last-layer row (`chunk_step(..., tap_answer=True)`: what Qwen2.5-Omni's talker reads); False: the program
    without it (pass it only when True: the kept program's key is then unchanged). `keep_written` (static; the
    same): a last output, the chunk's tokens as cached before the trim (`chunk_step(..., keep_written=True)`: what
    a recall session's capture reads the tokens the tick wrote and evicted from)."""
    model = nnx.merge(graphdef, params)
    more = {"tap_answer": True} if tap_answer else {}
    if keep_written:
        more["keep_written"] = True
    state, out = chunk_step(model, state, chunk, config, answer=answer, **more)
    table_full = jnp.all(state.kv.page_table >= 0, axis=1)  # [B] before empty entries leave the table
    kv = migration.drop_empty_entries(state.kv)
    logprobs = None if out.logprobs is None else (out.logprobs, out.top_ids, out.top_logprobs)
    outputs = (out.logits, out.tokens, kv.exhausted, kv.dropped, kv.num_free, table_full, logprobs)
    if tap_answer:
        outputs += (out.answer_rows,)
    if keep_written:
        outputs += (out.written,)
    return dataclasses.replace(state, kv=kv), outputs


@cached_jit(static_argnames=("graphdef", "config", "tap_answer"), donate_argnames=("state",))
def token_step(graphdef: nnx.GraphDef, params: nnx.State, state: StreamState, history: jax.Array | np.ndarray,
               i: jax.Array | np.integer, active: jax.Array | np.ndarray, unit: jax.Array,
               sampling: jax.Array | None, mask: jax.Array | np.ndarray | None, *,
               config: StreamConfig, tap_answer: bool = False) -> tuple[StreamState, tuple]:
    """One answer token for every row of the bucket (`decode_token`; only `active [B]` rows advance), in place.

    `history [B, tau]` int32: the tick's answer tokens so far (-1 = none); `i`: the token's index in the tick;
    `unit [B]`: the answer units; `sampling [B, ROW_WIDTH]` (None unless per-row); `mask [B, ceil(V / 32)]` int32
    or None (a program without it). Returns `(state, (token [B], logprobs, exhausted [B], dropped [B], num_free []))`,
    `logprobs` `(chosen [B], top ids, top logprobs [B, K])`; `tap_answer` (static): a sixth output, the token's
    final-normed last-layer row `[B, D]` (`decode_token(..., tap_answer=True)`; pass it only when True).
    """
    model = nnx.merge(graphdef, params)
    if sampling is None and getattr(config.decoding, "per_row", False):
        sampling = config.decoding.rows(active.shape[0])
    track = getattr(config.policy, "needs_scores", False)
    kv, next_pos, key, logits, token, counts, seen, lps, *row = decode_token(
        model, state.kv, state.next_pos, state.key, state.last_logits, active, i, history, unit, config, track,
        sampling, state.counts, state.seen, mask, **({"tap_answer": True} if tap_answer else {}))
    state = StreamState(kv=kv, next_pos=next_pos, key=key, last_logits=logits, counts=counts, seen=seen)
    return state, (token, lps, kv.exhausted, kv.dropped, kv.num_free, *row)


def frame_logprobs(chunk: Chunk, logprobs: tuple | None, row: int, n: int) -> list | None:
    """The log probabilities of a frame's `n` tokens when its sampling row asks for them (`FrameOutput.logprobs`)."""
    k = _asked_logprobs(chunk)
    if logprobs is None or k is None:
        return None
    chosen, ids, values = (np.asarray(x[row]) for x in logprobs)
    return [(float(chosen[i]), [(int(ids[i, j]), float(values[i, j])) for j in range(k)]) for i in range(n)]


def _asked_logprobs(chunk: Chunk) -> int | None:
    """The `top_logprobs` a frame's sampling row asks for (None: no log probabilities)."""
    if chunk.sampling is None:
        return None
    k = int(np.asarray(chunk.sampling)[0, ROW_FIELDS.index("top_logprobs")])
    return None if k < 0 else k


@dataclasses.dataclass
class RowEnd:
    """How a row of a host-driven tick ended early: its constraint is finished (`complete`), or it failed
    (`error`: the constraint raised or gave a bad mask)."""

    complete: bool = False
    error: str | None = None


def _mask_of(constraint: TokenConstraint, words: int) -> np.ndarray:
    mask = np.asarray(constraint.bitmask())
    if mask.shape != (words,) or mask.dtype != np.int32:
        raise ValueError(f"a token constraint's bitmask must be int32 [{words}] (ceil(vocab_size / 32)), got "
                         f"{mask.dtype} {mask.shape}")
    if not mask.any():
        raise ValueError("the token constraint allows no token (an all-zero bitmask)")
    return mask


def host_tick(engine: Engine, batch: Chunk, frames: Mapping[str, Chunk], on_token: OnToken | None,
              constraints: Mapping[str, TokenConstraint], keep_written: bool = False
              ) -> tuple[tuple, dict[str, RowEnd]]:
    """Runs one tick host-driven on `engine` (its state is replaced): the prefill program, then `token_step` once
    per answer token while any row is active. After each token every active served row's token goes to
    `on_token(sid, token, logprob entry)` (a row whose callback returns True ends now); a row with a constraint
    draws under its `bitmask()`, then `accept`s the token (a stop token too), and ends once `finished()`.

    Returns `(result, ends)`: `result` as the fused step's host copy (`engine_step`'s outputs; with
    `engine.taps_answer`, its eighth, each token's final-normed row `[B, tau, D]`), `ends` the rows that ended early
    by their constraint ({sid: `RowEnd`}). `keep_written`: `result` ends with the prefill's record of the chunk's
    tokens (`engine_step(..., keep_written=True)`).
    """
    graphdef, params, config = engine._graphdef, engine._params, engine._stream
    tap = {"tap_answer": True} if engine.taps_answer else {}  # (static; the programs without it unchanged)
    keep = {"keep_written": True} if keep_written else {}  # (static; the program without it unchanged)
    engine.state, pre = engine_step(graphdef, params, engine.state, batch, config=config, answer=False, **keep)
    written = pre[7] if keep_written else None
    logits, _, exhausted, dropped, num_free, table_full, _ = jax.device_get(jax.block_until_ready(pre[:7]))
    B, tau = batch.answer_tokens.shape[0], config.max_answer_tokens
    rows = {engine._slots[s]: s for s in frames}
    count = np.minimum(np.asarray(batch.answer_tokens), tau)
    active = count > 0
    tokens = np.full((B, tau), -1, np.int32)
    per_row = bool(getattr(config.decoding, "per_row", False))
    K = MAX_TOP_LOGPROBS
    logprobs = ((np.zeros((B, tau), np.float32), np.zeros((B, tau, K), np.int32), np.zeros((B, tau, K), np.float32))
                if per_row else None)
    asked = {r: _asked_logprobs(frames[s]) for r, s in rows.items()}
    stops = set(answer_stop_ids(config.decoding, engine.model_config.eos_token_ids))
    constrained = {engine._slots[s]: c for s, c in constraints.items() if s in frames}
    words = mask_words(engine.model_config.vocab_size)
    ends: dict[str, RowEnd] = {}
    # copied to the device once per tick, not once per token
    sampling = None if batch.sampling is None else jax.device_put(np.asarray(batch.sampling, np.float32))
    unit = jax.device_put(np.asarray(batch.answer_unit, np.int32))
    answer_rows = np.zeros((B, tau, engine.model_config.hidden_size), np.float32) if tap else None
    stepped = False
    for i in range(tau):
        mask = None
        if constrained:
            mask = np.full((B, words), -1, np.int32)
            for r, c in constrained.items():
                if active[r]:
                    try:
                        mask[r] = _mask_of(c, words)
                    except Exception as e:  # noqa: BLE001 - the row fails, the tick goes on
                        ends[rows[r]] = RowEnd(error=f"the token constraint failed: {type(e).__name__}: {e}")
                        active[r] = False
        if not active.any():
            break
        engine.state, out = token_step(graphdef, params, engine.state, tokens, np.int32(i), active, unit, sampling,
                                       mask, config=config, **tap)
        token, lps, exhausted, dropped, num_free, *row = jax.device_get(out)
        for r in np.flatnonzero(active):
            t = int(token[r])
            tokens[r, i] = t
            if answer_rows is not None:
                answer_rows[r, i] = row[0][r]
            entry = None
            if logprobs is not None:
                for whole, one in zip(logprobs, lps):
                    whole[r, i] = one[r]
                k = asked.get(r)
                if k is not None:
                    entry = (float(lps[0][r]), [(int(lps[1][r, j]), float(lps[2][r, j])) for j in range(k)])
            end = t in stops or i + 1 >= count[r] or bool(exhausted[r])
            if r in constrained:
                try:
                    constrained[r].accept(t)
                    if constrained[r].finished():
                        ends[rows[r]] = RowEnd(complete=True)
                        end = True
                except Exception as e:  # noqa: BLE001 - the row fails, the tick goes on
                    ends[rows[r]] = RowEnd(error=f"the token constraint failed: {type(e).__name__}: {e}")
                    end = True
            if r in rows and not bool(exhausted[r]) and on_token is not None and on_token(rows[r], t, entry):
                end = True
            if end:
                active[r] = False
        stepped = True
    if stepped:  # [B] after the last write (the fused step reads it after its answer too)
        table_full = np.all(np.asarray(engine.state.kv.page_table) >= 0, axis=1)
    result = (logits, tokens, exhausted, dropped, num_free, table_full, logprobs)
    result = result if answer_rows is None else (*result, answer_rows)
    return (result if written is None else (*result, written)), ends
