"""The compiled step every streamed path shares: `chunk_step` writes one chunk into the paged cache through all
layers, lets the retention policy trim (inside the program, `lax.cond` on its own trigger), then answers with up to
`max_answer_tokens` tokens chosen by the decoding strategy. `StreamState` is what it carries between chunks.
"""


from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from omnijax import paging as paging_lib
from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.decoding import (
    MAX_TOP_LOGPROBS,
    answer_stop_ids,
    row_logprobs,
    sampling_keys,
    split_keys,
)
from omnijax.kv import layout as layout_lib
from omnijax.kv import paged as paged_lib
from omnijax.kv import quant_kv
from omnijax.logits_processors import allowed_tokens
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.models.forward import write_chunk, write_chunk_tapped
from omnijax.models.layers import rms_norm
from omnijax.retention import base as retention_lib
from omnijax.streaming.config import StreamConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamState:
    """Carried state: the cache, each sequence's next-position cursor `[B]`, its sampling key `key [B, 2]`
    (uint32 key data, `jax.random.key_data`; split at every sampled token, unused by greedy decoding) and
    `last_logits [B, V]` float32, the logits after the last token the sequence wrote (its last chunk token or answer
    token): a chunk with no valid token for a sequence continues that sequence's answer from them.

    The history a per-row strategy's penalties read (`omnijax.decoding.RowSampling`): `counts [B, V]` int32, how
    often each token id occurs in the answer being decoded (reset to zero by a chunk that feeds the row a token: new
    input starts a new answer; a continuation chunk keeps it), and `seen [B, V]` bool, every token id the row has
    written (the text of its chunks, not media placeholders, and its answers). Both are bounded by the vocabulary,
    whatever the session's length: `B * V * 5` bytes (152K vocabulary, 64 rows: 49 MB, beside `last_logits`' 39 MB).
    """

    kv: paged_lib.PagedKV
    next_pos: jax.Array
    key: jax.Array
    last_logits: jax.Array
    counts: jax.Array
    seen: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkStats:
    """Per-chunk statistics (each `[B]`, pool figures scalar) after the chunk and its answer.

    `layout` describes the cache after retention and paging (what the next chunk is written into); `attended` the
    cache the chunk's own prefill attended over: the history before this chunk's trim, with the chunk written in.
    """

    layout: layout_lib.LayoutStats
    attended: layout_lib.LayoutStats
    evicted: jax.Array
    moved: jax.Array  # [B] slots copied by the paging mode after the eviction (its copy cost)
    next_pos: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkOutput:
    """What one step returns: last-position logits `[B, V]` (float32), tokens `[B, tau]` (-1 = none), stats.

    With a per-row strategy, also the raw log probabilities of the answer tokens of rows that ask for them
    (`omnijax.decoding.row_logprobs`): `logprobs [B, tau]` of each chosen token, `top_ids` / `top_logprobs`
    `[B, tau, MAX_TOP_LOGPROBS]` the most likely alternatives (zeros where not asked); None otherwise.

    `tapped [B, T, D]`: transformers' `hidden_states[tap]` of the chunk's tokens when the step was asked for a tap
    (`chunk_step(..., tap=k)`; Qwen3-Omni's talker reads layer `accept_hidden_layer` at media placeholders); None
    otherwise.

    `answer_rows [B, tau, D]` (model dtype): the final-normed last-layer row of each answer token as the answer loop
    fed it (row i: the token at `tokens[:, i]`; zeros where none), when the step was asked for them
    (`chunk_step(..., tap_answer=True)`; Qwen2.5-Omni's talker reads them); None otherwise.

    `written`: the chunk's tokens as the prefill cached them, before the trim (`chunk_step(..., keep_written=True)`,
    `written_tokens`: what a recall capture reads the tokens the step wrote and evicted from); None otherwise."""

    logits: jax.Array
    tokens: jax.Array
    stats: ChunkStats
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None
    tapped: jax.Array | None = None
    answer_rows: jax.Array | None = None
    written: dict | None = None


@dataclasses.dataclass(frozen=True)
class StreamResult:
    """`logits [C, B, V]`, `tokens [C, B, tau]`, `stats` stacked over C chunks, and the final `StreamState`."""

    logits: jax.Array
    tokens: jax.Array
    stats: ChunkStats
    state: StreamState


def _empty_logprobs(B: int, tau: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    K = MAX_TOP_LOGPROBS
    return (jnp.zeros((B, tau), jnp.float32), jnp.zeros((B, tau, K), jnp.int32), jnp.zeros((B, tau, K), jnp.float32))


def decode_token(model: Decoder, kv: paged_lib.PagedKV, next_pos: jax.Array, key: jax.Array, logits: jax.Array,
                 active: jax.Array, i: jax.Array | int, history: jax.Array, unit: jax.Array, config: StreamConfig,
                 track_scores: bool, sampling: jax.Array | None = None, counts: jax.Array | None = None,
                 seen: jax.Array | None = None, mask: jax.Array | None = None, tap_answer: bool = False
                 ) -> tuple:
    """One answer token for every row (the body of the fused answer loop, and the host-driven engine's step).

    Rows draw from `logits [B, V]` (the logits after each row's last fed token) with `config.decoding`; `active [B]`
    rows write their token into the cache at `next_pos` (offset `i` of the answer's `unit [B]`) and advance, the
    others keep their cursor, key, logits and history. `history [B, tau]` holds the answer's tokens so far (-1 =
    none; a non-per-row strategy's repetition penalty reads it). `key [B, 2]` (key data) is split once. A per-row
    strategy draws with `sampling [B, ROW_WIDTH]` and the history `counts [B, V]` int32 / `seen [B, V]` bool, both
    updated with the token. `mask [B, ceil(V / 32)]` int32 (optional; `omnijax.logits_processors.allowed_tokens`):
    disallowed tokens' logits become -inf before the strategy's processors, so a masked token is never drawn; the
    log probabilities stay those of the raw `logits`.

    Returns `(kv, next_pos, key, logits, token [B], counts, seen, logprobs)`, `logprobs` the `(chosen [B], top ids,
    top logprobs [B, K])` of rows that ask for them (`omnijax.decoding.row_logprobs`; zeros unless per-row).
    `tap_answer` (static): a ninth element, the token's final-normed last-layer row `[B, D]` (what
    `chunk_step(..., tap_answer=True)` keeps per answer token); False: the program without it.
    """
    out = _decode(model, kv, next_pos, key, logits, active, i, history, unit, config, track_scores, sampling, counts,
                  seen, mask)
    return out[:8] if not tap_answer else (*out[:8], _final_normed(model, out[8]))


def _decode(model: Decoder, kv: paged_lib.PagedKV, next_pos: jax.Array, key: jax.Array, logits: jax.Array,
            active: jax.Array, i: jax.Array | int, history: jax.Array, unit: jax.Array, config: StreamConfig,
            track_scores: bool, sampling: jax.Array | None, counts: jax.Array | None, seen: jax.Array | None,
            mask: jax.Array | None = None) -> tuple:
    """`decode_token`, also returning the token's last-layer hidden state `[B, D]` before the final norm (the row
    its logits were computed from; the answer loop's `tap_answer` keeps it final-normed)."""
    if counts is None or seen is None:
        raise ValueError("decode_token needs the token history: counts [B, V] int32 and seen [B, V] bool")
    B, V = logits.shape
    batch_rows = jnp.arange(B)
    draw, following = split_keys(key)
    scores = logits if mask is None else jnp.where(allowed_tokens(mask, V), logits, -jnp.inf)
    if getattr(config.decoding, "per_row", False):
        token = config.decoding.select(scores, history, draw, row=sampling, counts=counts, seen=seen)  # [B]
        lps = row_logprobs(logits, token, sampling)
    else:
        token = config.decoding.select(scores, history, draw)  # [B]
        K = MAX_TOP_LOGPROBS
        lps = (jnp.zeros((B,), jnp.float32), jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), jnp.float32))
    written = jnp.where(active, token, V)  # finished rows count nothing (out of range: dropped)
    counts = counts.at[batch_rows, written].add(1, mode="drop")
    seen = seen.at[batch_rows, written].set(True, mode="drop")
    key = jnp.where(active[:, None], following, key)  # finished rows keep theirs
    x = model.embed_tokens(token[:, None])
    pos = next_pos[None, :, None]  # [1, B, 1]
    meta = paged_lib.SlotMeta(pos=pos, unit=unit[:, None], span=jnp.full((B, 1), SpanKind.RESPONSE, jnp.int32),
                              offset=jnp.broadcast_to(jnp.asarray(i, jnp.int32), (B, 1)))
    kv, hidden = write_chunk(model, kv, x, active[:, None], pos, meta, impl=config.impl, track_scores=track_scores,
                             placement=config.paging.placement)
    keep, last = active[:, None], hidden[:, 0]  # (in this order: the program without the tap is unchanged)
    logits = jnp.where(keep, model.logits(last), logits)  # finished rows keep theirs
    next_pos = next_pos + active.astype(jnp.int32)
    return kv, next_pos, key, logits, token, counts, seen, lps, last


def answer_stops(model: Decoder, config: StreamConfig) -> jax.Array:
    """`[S]` int32: the ids that end an answer (`omnijax.decoding.answer_stop_ids`; `[-1]` when none)."""
    return jnp.asarray(answer_stop_ids(config.decoding, model.config.eos_token_ids) or (-1,), jnp.int32)


def _answer(model: Decoder, kv, next_pos, key, first_logits, count, unit, config: StreamConfig, track_scores: bool,
            sampling=None, counts=None, seen=None, tap_answer: bool = False):
    """Decodes up to `count[b]` tokens with `config.decoding` (a `lax.while_loop` of `decode_token`); every
    generated token is fed back into the cache.

    `key [B, 2]` (key data) is split once per decoding step, row by row; a per-row strategy (`RowSampling`) draws
    each row with its `sampling [B, ROW_WIDTH]` settings and its history (`counts`, `seen` `[B, V]`, updated with
    every token decoded) and returns the raw log probabilities rows ask for. Returns `(kv, next_pos, key, tokens,
    last_logits [B, V], counts, seen, logprobs)`, `last_logits` being the logits after each row's last fed token and
    `logprobs` `(chosen [B, tau], top ids, top logprobs [B, tau, K])` (zeros unless per-row).

    `tap_answer` (static): also returns `rows [B, tau, D]`, each fed token's final-normed last-layer row (zeros where
    no token), as a ninth element."""
    B, max_tokens = next_pos.shape[0], config.max_answer_tokens
    eos = answer_stops(model, config)
    tokens0 = jnp.full((B, max_tokens), -1, jnp.int32)

    def cond(carry):
        i, active = carry[0], carry[5]
        return (i < max_tokens) & jnp.any(active)

    def body(carry):
        i, kv, next_pos, key, logits, active, tokens, counts, seen, lps = carry[:10]
        kv, next_pos, key, logits, token, counts, seen, lp, hidden = _decode(
            model, kv, next_pos, key, logits, active, i, tokens, unit, config, track_scores, sampling, counts, seen)
        lps = tuple(whole.at[:, i].set(one) for whole, one in zip(lps, lp))
        tokens = tokens.at[:, i].set(jnp.where(active, token, -1))
        rows = () if not tap_answer else (
            carry[10].at[:, i].set(jnp.where(active[:, None], _final_normed(model, hidden), 0)),)
        stop = jnp.any(token[:, None] == eos[None, :], axis=-1)
        active = active & ~stop & (i + 1 < count)
        return i + 1, kv, next_pos, key, logits, active, tokens, counts, seen, lps, *rows

    if sampling is None and getattr(config.decoding, "per_row", False):
        sampling = config.decoding.rows(B)
    carry = (jnp.asarray(0), kv, next_pos, key, first_logits, count > 0, tokens0, counts, seen,
             _empty_logprobs(B, max_tokens), *((_empty_rows(model, B, max_tokens),) if tap_answer else ()))
    _, kv, next_pos, key, logits, _, tokens, counts, seen, lps, *rows = jax.lax.while_loop(cond, body, carry)
    return (kv, next_pos, key, tokens, logits, counts, seen, lps, *rows)


def _final_normed(model: Decoder, hidden: jax.Array) -> jax.Array:
    """`hidden [..., D]` after the decoder's final norm (transformers' last `hidden_states` entry)."""
    return rms_norm(hidden, model.final_norm[...], model.config.rms_norm_eps)


def _empty_rows(model: Decoder, B: int, tau: int) -> jax.Array:
    return jnp.zeros((B, tau, model.config.hidden_size), model.config.jnp_dtype)


def chunk_step(model: Decoder, state: StreamState, chunk: Chunk, config: StreamConfig,
               answer: bool = True, tap: int | None = None,
               shared_pages: bool = True, tap_answer: bool = False, trim: bool = True, skip_empty: bool = True,
               keep_written: bool = False) -> tuple[StreamState, ChunkOutput]:
    """One streaming step (the `lax.scan` body): prefill, last logits, retention, paging, optional answer.

    With `answer=False` (static) the step stops before the answer: its tokens are all -1 and `last_logits` are the
    chunk's, from which a host-driven loop decodes the `chunk.answer_tokens` one `decode_token` at a time
    (`omnijax.serve.engine.decode_loop`); rows asking for tokens still count as fed for retention, as in the fused
    step.

    `config.paging` places new tokens and, after an eviction, re-lays out the survivors (`omnijax.paging.relayout`);
    `config.subblock` is the subblock size it and the statistics use. `config` is static (part of the program).

    `tap` (static; `Decoder.run_layers_tapped`): the output also carries `tapped [B, T, D]`, transformers'
    `hidden_states[tap]` of the chunk's tokens as the prefill computed them. None (default): the program without it.

    `shared_pages` (static; `omnijax.retention.base.apply`): the state's rows may share pages (the engine forks
    rows), so a trim copies a shared page before it changes; `Session`, `stream` and `evaluate`, which never fork
    rows, pass False and compile no copy-on-write (they refuse a given state that shares pages).

    `trim` (static): False compiles the step without the retention policy's trim and the paging mode's relayout
    (`evicted` and `moved` are zero). It computes what the full step does only while the policy cannot trigger:
    retained cells within `omnijax.retention.base.untrimmed_capacity(policy)` after the chunk is written
    (`omnijax.streaming.quick_start`: a session's first step, while the full step compiles).

    `tap_answer` (static): the output also carries `answer_rows [B, tau, D]`, each answer token's final-normed
    last-layer row as the answer loop computed it (what Qwen2.5-Omni's talker reads per answer token, so speech can
    start before the answer ends without running the thinker again). False (default): the program without it.

    `skip_empty` (static): a chunk with no valid token in any row (a continuation chunk) skips the prefill (the pass
    through every layer and the lm_head, which would write nothing: its logits are the state's) under a
    `lax.cond`; it computes exactly what the pass does. False: the pass always runs, with no conditional, for a
    caller that vmaps the step (`omnijax.evaluate`), where the conditional would become a select over the whole
    cache. Ignored with `tap` (the pass then always runs).

    `keep_written` (static): the output also carries `written`, the chunk's tokens as the prefill cached them, before
    the trim and the relayout (`written_tokens`). A recall session (`omnijax.streaming.recall_session`) reads the
    tokens the step wrote and evicted from it: after the step their slots may hold survivors a relayout moved there,
    or answer tokens. False (default): the program without it.
    """
    policy, paging, impl, subblock = config.policy, config.paging, config.impl, config.subblock
    kv, next_pos, key = state.kv, state.next_pos, state.key
    counts, seen = _history(state, chunk)
    track = getattr(policy, "needs_scores", False)

    def prefill(kv):
        x = model.embed_tokens(chunk.token_ids)
        if chunk.embeds is not None:
            x = jnp.where(chunk.embed_mask[..., None], chunk.embeds.astype(x.dtype), x)
        positions = chunk.positions + next_pos[None, :, None]
        meta = paged_lib.SlotMeta(pos=positions, unit=chunk.unit, span=chunk.span, offset=chunk.offset)
        kv, hidden, tapped = write_chunk_tapped(model, kv, x, chunk.valid, positions, meta, impl=impl,
                                                track_scores=track, placement=paging.placement,
                                                deepstack=chunk.deepstack, tap=tap)
        T = chunk.valid.shape[1]
        last = jnp.max(jnp.where(chunk.valid, jnp.arange(T)[None], 0), axis=1)  # [B]
        logits = model.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])  # [B, V]
        # A sequence with no token in this chunk continues from where it stopped (e.g. the rest of a long answer).
        return kv, jnp.where(jnp.any(chunk.valid, axis=1)[:, None], logits, state.last_logits), tapped

    if skip_empty and tap is None:
        # A chunk with no token at all (a continuation: the rest of a long answer) writes nothing and keeps the
        # state's logits: skip its pass through every layer and the lm_head, a token's worth of weight reads.
        kv, logits, tapped = jax.lax.cond(jnp.any(chunk.valid), prefill, lambda kv: (kv, state.last_logits, None), kv)
    else:
        kv, logits, tapped = prefill(kv)
    attended = layout_lib.layout_stats(kv, subblock)
    written = written_tokens(kv, state.kv.next_order, chunk.valid.shape[1]) if keep_written else None
    next_pos = next_pos + chunk.advance
    # A row this chunk feeds nothing (no token, no answer, no advance: a server's idle session) is not trimmed.
    fed = jnp.any(chunk.valid, axis=1) | (chunk.answer_tokens > 0) | (chunk.advance != 0)  # [B]
    if trim:
        kv, next_pos, evicted = retention_lib.trim(
            policy, kv, next_pos, rope=(model.config.rope_base, model.config.mrope_section), active=fed,
            shared_pages=shared_pages)
        kv, moved = paging_lib.relayout(paging, kv, evicted, subblock)
    else:  # what both do when the policy does not trigger (the caller knows it cannot: see `trim` above)
        evicted = moved = jnp.zeros(next_pos.shape, jnp.int32)
    tau = config.max_answer_tokens
    lps = _empty_logprobs(kv.batch, tau)
    answer_rows = None
    if tau > 0 and answer:
        count = jnp.minimum(chunk.answer_tokens, tau)
        none = (_empty_rows(model, kv.batch, tau),) if tap_answer else ()
        kv, next_pos, key, tokens, last_logits, counts, seen, lps, *rows = jax.lax.cond(
            jnp.any(count > 0),
            lambda: _answer(model, kv, next_pos, key, logits, count, chunk.answer_unit, config, track,
                            chunk.sampling, counts, seen, tap_answer),
            lambda: (kv, next_pos, key, jnp.full((kv.batch, tau), -1, jnp.int32), logits, counts, seen, lps, *none))
        answer_rows = rows[0] if tap_answer else None
    else:
        tokens, last_logits = jnp.full((kv.batch, tau), -1, jnp.int32), logits
        if tap_answer:
            answer_rows = _empty_rows(model, kv.batch, tau)
    stats = ChunkStats(layout=layout_lib.layout_stats(kv, subblock), attended=attended, evicted=evicted, moved=moved,
                       next_pos=next_pos)
    state = StreamState(kv=kv, next_pos=next_pos, key=key, last_logits=last_logits, counts=counts, seen=seen)
    if not getattr(config.decoding, "per_row", False):
        return state, ChunkOutput(logits=logits, tokens=tokens, stats=stats, tapped=tapped, answer_rows=answer_rows,
                                  written=written)
    return state, ChunkOutput(logits=logits, tokens=tokens, stats=stats, logprobs=lps[0], top_ids=lps[1],
                              top_logprobs=lps[2], tapped=tapped, answer_rows=answer_rows, written=written)


def written_tokens(kv: paged_lib.PagedKV, first_order: jax.Array, T: int) -> dict[str, jax.Array]:
    """The tokens each row wrote from write order `first_order [B]` on (at most `T`: a chunk's), as cached in `kv`:
    `k`, `v` `[L, B, T, G, d]` (int8 pages dequantised), `pos [A, B, T]`, `unit`, `span`, `offset`, `order [B, T]`,
    entry t holding the token of order `first_order + t` (`order` -1 where none is live). Found by write order
    through each row's page table, so a row reads its own pages only (the engine's rows share a pool)."""
    N, P = kv.num_pages, kv.page_size
    flat, exists = paged_lib.table_slots(kv)  # [B, S]
    B = flat.shape[0]
    rank = kv.order.reshape(-1)[flat] - first_order[:, None]
    mine = exists & kv.valid.reshape(-1)[flat] & (rank >= 0) & (rank < T)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], flat.shape)
    at = jnp.full((B, T), -1, jnp.int32).at[rows, jnp.where(mine, rank, T)].set(flat, mode="drop")  # [B, T]
    take = jnp.maximum(at, 0).reshape(-1)

    def pages(x):  # [L, N, P, G, d] -> [L, B, T, G, d]
        L, G, d = x.shape[0], x.shape[3], x.shape[4]
        return quant_kv.dense(quant_kv.take_rows(x.reshape(L, N * P, G, d), take)).reshape(L, B, T, G, d)

    out = {"k": pages(kv.k), "v": pages(kv.v), "pos": kv.pos.reshape(kv.pos.shape[0], -1)[:, take].reshape(-1, B, T)}
    for f in ("unit", "span", "offset", "order"):
        out[f] = getattr(kv, f).reshape(-1)[take].reshape(B, T)
    out["order"] = jnp.where(at >= 0, out["order"], -1)
    return out


def _history(state: StreamState, chunk: Chunk) -> tuple[jax.Array, jax.Array]:
    """The penalties' history after the chunk's input: a row fed a token starts a new answer (its counts are
    zeroed), and the text tokens it feeds are seen (media placeholders, under `embed_mask`, are not)."""
    fed = chunk.valid if chunk.embed_mask is None else chunk.valid & ~chunk.embed_mask  # [B, T]
    B, V = state.counts.shape
    counts = jnp.where(jnp.any(chunk.valid, axis=1)[:, None], 0, state.counts)
    ids = jnp.where(fed, chunk.token_ids, V)
    seen = state.seen.at[jnp.broadcast_to(jnp.arange(B)[:, None], ids.shape), ids].set(True, mode="drop")
    return counts, seen


def init_state(config: DecoderConfig, *, num_pages: int, page_size: int = 64, batch: int = 1,
               max_pages: int | None = None, start_pos: int = 0, seed: int = 0, kv_dtype: str = "float") -> StreamState:
    """An empty `StreamState` for a decoder config; `seed` seeds the sequences' sampling keys
    (`StreamConfig.decoding.seed` when it samples); `kv_dtype` is the pool's storage (`StreamConfig.kv_dtype`)."""
    kv = paged_lib.init(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                        num_pages=num_pages, page_size=page_size, batch=batch, max_pages=max_pages,
                        position_axes=config.position_axes, dtype=config.jnp_dtype, kv_dtype=kv_dtype)
    V = config.vocab_size
    return StreamState(kv=kv, next_pos=jnp.full((batch,), start_pos, jnp.int32), key=sampling_keys(seed, batch),
                       last_logits=jnp.zeros((batch, V), jnp.float32), counts=jnp.zeros((batch, V), jnp.int32),
                       seen=jnp.zeros((batch, V), bool))


def check_state(state: StreamState, config: DecoderConfig) -> None:
    """Refuses a state whose cache was not made for this decoder (layers, kv heads, head dim, position axes, dtype),
    and one whose rows share pages (`omnijax.kv.page_sharing`: an engine's forked rows), which `stream` and `Session`
    trim without copying a shared page first (`chunk_step`'s `shared_pages=False`).

    A wrong layer count would not fail by itself: the layer loop clamps its index into the cache.
    """
    kv = state.kv
    want = (config.num_layers, config.num_kv_heads, config.head_dim, config.position_axes,
            jnp.dtype(config.jnp_dtype).name)
    got = (kv.k.shape[0], kv.k.shape[3], kv.k.shape[4], kv.pos.shape[0], jnp.dtype(kv.k.dtype).name)
    if got != want:
        names = ("layers", "kv heads", "head dim", "position axes", "dtype")
        diff = ", ".join(f"{n} {g} (model: {w})" for n, g, w in zip(names, got, want) if g != w)
        raise ValueError(f"the given state's cache was not made for this model: {diff}; build it with "
                         f"omnijax.init_state(model.config, ...)")
    shared = int(np.count_nonzero(np.asarray(jax.device_get(kv.shares))))  # on the host: no program compiled
    if shared:
        raise ValueError(f"the given state's rows share {shared} page(s) (forked rows of a serving engine); a stream "
                         f"or Session trims without copying shared pages: take one row out first (the engine's "
                         f"export_row copies a row's own pages)")


def pages_needed(chunks: Chunk, max_answer_tokens: int, page_size: int) -> int:
    """Pool pages that hold a whole stacked session (every chunk and answer) without eviction."""
    per_seq = jnp.sum(chunks.valid, axis=(0, 2)) + jnp.sum(jnp.minimum(chunks.answer_tokens, max_answer_tokens), 0)
    return int(jnp.sum(-(-per_seq // page_size)))
