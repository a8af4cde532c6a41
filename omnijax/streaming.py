"""Streaming: a whole session is one `lax.scan` over chunks; `Session` runs the same jitted step chunk by chunk.

Per chunk: prefill the chunk into the paged cache (all layers), take the logits of its last valid token, let the
retention policy trim (inside the program, `lax.cond` on its own trigger), then answer with up to `max_answer_tokens`
tokens chosen by the decoding strategy when the chunk asks for it. Generated tokens are fed back, so the response is
part of the context. Every setting comes from one `omnijax.StreamConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax import attention as attention_lib
from omnijax import chunks as chunks_lib
from omnijax.chunks import Chunk
from omnijax.config import DEFAULT_SESSION_PAGES, StreamConfig
from omnijax.decoding import answer_stop_ids, sampling_keys, seed_of, split_keys
from omnijax.kv import layout as layout_lib
from omnijax.kv import paged as paged_lib
from omnijax.models.decoder import Decoder
from omnijax import paging as paging_lib
from omnijax.retention import base as retention_lib
from omnijax.units import SpanKind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamState:
    """Carried state: the cache, each sequence's next-position cursor `[B]`, its sampling key `key [B, 2]`
    (uint32 key data, `jax.random.key_data`; split at every sampled token, unused by greedy decoding) and
    `last_logits [B, V]` float32, the logits after the last token the sequence wrote (its last chunk token or answer
    token): a chunk with no valid token for a sequence continues that sequence's answer from them."""

    kv: paged_lib.PagedKV
    next_pos: jax.Array
    key: jax.Array
    last_logits: jax.Array


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
    """What one step returns: last-position logits `[B, V]` (float32), tokens `[B, tau]` (-1 = none), stats."""

    logits: jax.Array
    tokens: jax.Array
    stats: ChunkStats


@dataclasses.dataclass(frozen=True)
class StreamResult:
    """`logits [C, B, V]`, `tokens [C, B, tau]`, `stats` stacked over C chunks, and the final `StreamState`."""

    logits: jax.Array
    tokens: jax.Array
    stats: ChunkStats
    state: StreamState


def prefill(model: Decoder, kv: paged_lib.PagedKV, x: jax.Array, valid: jax.Array, positions: jax.Array,
            meta: paged_lib.SlotMeta, *, impl: str = "xla", track_scores: bool = False,
            placement: str = "first_fit", deepstack: jax.Array | None = None):
    """Writes a chunk `[B, T]` (embeddings `x [B, T, D]`, absolute `positions [A, B, T]`) through every layer.

    With `track_scores`, the attention mass each slot receives is added to `kv.score` (H2O); `placement` picks the
    free slots new tokens take (`omnijax.kv.paged.PLACEMENTS`; the paging mode decides it); `deepstack [n, B, T, D]`
    (Qwen3-Omni) is added after the first n layers (`Decoder.run_layers`).
    Returns `(kv, hidden [B, T, D])`.
    """
    kv, slots, q_order = paged_lib.reserve(kv, valid, meta, placement=placement)
    view = attention_lib.CacheView.of(kv, slots, q_order)
    hidden, k, v, mass = model.run_layers(x, positions, view, kv.k, kv.v, impl=impl, track_scores=track_scores,
                                          deepstack=deepstack)
    kv = kv.replace(k=k, v=v)
    if mass is not None:
        kv = kv.replace(score=kv.score + mass)
    return kv, hidden


def _answer(model: Decoder, kv, next_pos, key, first_logits, count, unit, config: StreamConfig, track_scores: bool,
            sampling=None):
    """Decodes up to `count[b]` tokens with `config.decoding`; every generated token is fed back into the cache.

    `key [B, 2]` (key data) is split once per decoding step, row by row; a per-row strategy (`RowSampling`) draws
    each row with its `sampling [B, 2]` settings. Returns `(kv, next_pos, key, tokens, last_logits [B, V])`, the last
    being the logits after each row's last fed token."""
    B, max_tokens = next_pos.shape[0], config.max_answer_tokens
    placement = config.paging.placement
    eos = jnp.asarray(answer_stop_ids(config.decoding, model.config.eos_token_ids) or (-1,), jnp.int32)
    tokens0 = jnp.full((B, max_tokens), -1, jnp.int32)

    def cond(carry):
        i, _, _, _, _, active, _ = carry
        return (i < max_tokens) & jnp.any(active)

    def body(carry):
        i, kv, next_pos, key, logits, active, tokens = carry
        draw, following = split_keys(key)
        if getattr(config.decoding, "per_row", False):
            token = config.decoding.select(logits, tokens, draw, row=sampling)  # [B]
        else:
            token = config.decoding.select(logits, tokens, draw)  # [B]
        key = jnp.where(active[:, None], following, key)  # finished rows keep theirs
        tokens = tokens.at[:, i].set(jnp.where(active, token, -1))
        x = model.embed_tokens(token[:, None])
        pos = next_pos[None, :, None]  # [1, B, 1]
        meta = paged_lib.SlotMeta(pos=pos, unit=unit[:, None], span=jnp.full((B, 1), SpanKind.RESPONSE, jnp.int32),
                                  offset=jnp.full((B, 1), i, jnp.int32))
        kv, hidden = prefill(model, kv, x, active[:, None], pos, meta, impl=config.impl, track_scores=track_scores,
                             placement=placement)
        logits = jnp.where(active[:, None], model.logits(hidden[:, 0]), logits)  # finished rows keep theirs
        next_pos = next_pos + active.astype(jnp.int32)
        stop = jnp.any(token[:, None] == eos[None, :], axis=-1)
        active = active & ~stop & (i + 1 < count)
        return i + 1, kv, next_pos, key, logits, active, tokens

    carry = (jnp.asarray(0), kv, next_pos, key, first_logits, count > 0, tokens0)
    _, kv, next_pos, key, logits, _, tokens = jax.lax.while_loop(cond, body, carry)
    return kv, next_pos, key, tokens, logits


def chunk_step(model: Decoder, state: StreamState, chunk: Chunk, config: StreamConfig):
    """One streaming step (the `lax.scan` body): prefill, last logits, retention, paging, optional answer.

    `config.paging` places new tokens and, after an eviction, re-lays out the survivors (`omnijax.paging.relayout`);
    `config.subblock` is the subblock size it and the statistics use. `config` is static (part of the program).
    """
    policy, paging, impl, subblock = config.policy, config.paging, config.impl, config.subblock
    kv, next_pos, key = state.kv, state.next_pos, state.key
    x = model.embed_tokens(chunk.token_ids)
    if chunk.embeds is not None:
        x = jnp.where(chunk.embed_mask[..., None], chunk.embeds.astype(x.dtype), x)
    positions = chunk.positions + next_pos[None, :, None]
    meta = paged_lib.SlotMeta(pos=positions, unit=chunk.unit, span=chunk.span, offset=chunk.offset)
    track = getattr(policy, "needs_scores", False)
    kv, hidden = prefill(model, kv, x, chunk.valid, positions, meta, impl=impl, track_scores=track,
                         placement=paging.placement, deepstack=chunk.deepstack)
    attended = layout_lib.layout_stats(kv, subblock)
    T = chunk.valid.shape[1]
    last = jnp.max(jnp.where(chunk.valid, jnp.arange(T)[None], 0), axis=1)  # [B]
    logits = model.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])  # [B, V]
    # A sequence with no token in this chunk continues from where it stopped (e.g. the rest of a long answer).
    logits = jnp.where(jnp.any(chunk.valid, axis=1)[:, None], logits, state.last_logits)
    next_pos = next_pos + chunk.advance
    kv, next_pos, evicted = retention_lib.trim(
        policy, kv, next_pos, rope=(model.config.rope_base, model.config.mrope_section))
    kv, moved = paging_lib.relayout(paging, kv, evicted, subblock)
    if config.max_answer_tokens > 0:
        count = jnp.minimum(chunk.answer_tokens, config.max_answer_tokens)
        kv, next_pos, key, tokens, last_logits = jax.lax.cond(
            jnp.any(count > 0),
            lambda: _answer(model, kv, next_pos, key, logits, count, chunk.answer_unit, config, track,
                            chunk.sampling),
            lambda: (kv, next_pos, key, jnp.full((kv.batch, config.max_answer_tokens), -1, jnp.int32), logits))
    else:
        tokens, last_logits = jnp.zeros((kv.batch, 0), jnp.int32), logits
    stats = ChunkStats(layout=layout_lib.layout_stats(kv, subblock), attended=attended, evicted=evicted, moved=moved,
                       next_pos=next_pos)
    state = StreamState(kv=kv, next_pos=next_pos, key=key, last_logits=last_logits)
    return state, ChunkOutput(logits=logits, tokens=tokens, stats=stats)


def init_state(config, *, num_pages: int, page_size: int = 64, batch: int = 1, max_pages: int | None = None,
               start_pos: int = 0, seed: int = 0) -> StreamState:
    """An empty `StreamState` for a decoder config; `seed` seeds the sequences' sampling keys
    (`StreamConfig.decoding.seed` when it samples)."""
    kv = paged_lib.init(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                        num_pages=num_pages, page_size=page_size, batch=batch, max_pages=max_pages,
                        position_axes=config.position_axes, dtype=config.jnp_dtype)
    return StreamState(kv=kv, next_pos=jnp.full((batch,), start_pos, jnp.int32), key=sampling_keys(seed, batch),
                       last_logits=jnp.zeros((batch, config.vocab_size), jnp.float32))


def check_state(state: StreamState, config) -> None:
    """Refuses a state whose cache was not made for this decoder: layers, kv heads, head dim, position axes, dtype.

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


def pages_needed(chunks: Chunk, max_answer_tokens: int, page_size: int) -> int:
    """Pool pages that hold a whole stacked session (every chunk and answer) without eviction."""
    per_seq = jnp.sum(chunks.valid, axis=(0, 2)) + jnp.sum(jnp.minimum(chunks.answer_tokens, max_answer_tokens), 0)
    return int(jnp.sum(-(-per_seq // page_size)))


def model_parts(model) -> tuple[Any, Any]:
    """`(graphdef, params)` of the decoder of an `omnijax.Model`, a `MiniCPMOModel` or a bare `Decoder`."""
    decoder = getattr(model, "decoder", model)
    graphdef, params = nnx.split(decoder)
    return graphdef, params


def graphdef_config(model):
    """The `DecoderConfig` of a model or decoder."""
    decoder = getattr(model, "decoder", model)
    return decoder.config


def bind_config(model, config: StreamConfig | None = None, **fields) -> StreamConfig:
    """`StreamConfig.of(config, **fields)` as it runs for `model`: settings a policy leaves to the model family are
    filled in from the model's type (`StreamConfig.for_model`)."""
    return StreamConfig.of(config, **fields).for_model(getattr(model, "model_type", None))


_STATIC = ("graphdef", "config")


def _scan_chunks(graphdef, params, state, chunks, *, config):
    model = nnx.merge(graphdef, params)
    return jax.lax.scan(lambda state, chunk: chunk_step(model, state, chunk, config), state, chunks)


# The cache is updated in place (the layers' K/V writes, the trim's re-rotation, a migration's copies) only where
# the step owns its input state: a state that is not donated is first copied whole. `stream` donates the state it
# creates and keeps one given to it; `Session` owns its state.
_scan = jax.jit(_scan_chunks, static_argnames=_STATIC)
_scan_owned = jax.jit(_scan_chunks, static_argnames=_STATIC, donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _step(graphdef, params, state, chunk, *, config):
    return chunk_step(nnx.merge(graphdef, params), state, chunk, config)


def stream(model, chunks: Chunk, config: StreamConfig | None = None, *, state: StreamState | None = None,
           **fields) -> StreamResult:
    """Streams a stack of chunks (`[C, ...]` on every field) through the model as one compiled program.

    Args:
        model: an `omnijax.Model`, a `MiniCPMOModel` or a `Decoder`.
        chunks: stacked chunks (see `omnijax.chunks.stack_chunks`).
        config: the session's settings (`omnijax.StreamConfig`; default `StreamConfig()`). Its fields are also
            accepted as keywords (`policy=`, `paging=`, `impl=`, `page_size=`, `num_pages=`, `subblock=`,
            `max_answer_tokens=`, `decoding=`), applied on top of `config`.
        state: state to continue from (left intact: the program starts from a copy of it); default an empty cache
            of `config.num_pages` pages (None: enough for the whole session without eviction).

    Warns:
        RuntimeWarning: when the pool ran out in some sequence (its tokens past that point were not cached).
    """
    config = bind_config(model, config, **fields)
    graphdef, params = model_parts(model)
    decoder_config = graphdef_config(model)
    chunks_lib.validate(chunks, decoder_config, max_answer_tokens=config.max_answer_tokens, stacked=True,
                        decoding=config.decoding)
    chunks = jax.tree.map(jnp.asarray, chunks)
    run = _scan if state is not None else _scan_owned
    if state is None:
        num_pages = config.num_pages
        if num_pages is None:
            num_pages = max(1, pages_needed(chunks, config.max_answer_tokens, config.page_size)) + (
                chunks.token_ids.shape[1] * config.paging.extra_pages)
        state = init_state(decoder_config, num_pages=num_pages, page_size=config.page_size,
                           batch=chunks.token_ids.shape[1], seed=seed_of(config.decoding))
    else:
        check_state(state, decoder_config)
    if state.kv.batch != chunks.token_ids.shape[1]:
        raise ValueError(f"chunks have batch {chunks.token_ids.shape[1]}, the given state has {state.kv.batch}")
    final, out = run(graphdef, params, state, chunks, config=config)
    exhausted = np.asarray(final.kv.exhausted)  # waits for the program: a stream call returns a finished session
    if exhausted.any():
        warnings.warn(f"the KV pool ran out in sequence(s) {np.flatnonzero(exhausted).tolist()}: "
                      f"{np.asarray(final.kv.dropped)[exhausted].tolist()} token(s) were not cached (see "
                      f"stats.layout.exhausted and state.kv.dropped); give a larger num_pages or a bounded policy",
                      RuntimeWarning, stacklevel=2)
    return StreamResult(logits=out.logits, tokens=out.tokens, stats=out.stats, state=final)


class Session:
    """Step-wise streaming for real-time use: the same jitted step as `stream`, one chunk per call.

    Every `feed` donates `session.state` to the step, which updates the cache in place and replaces `session.state`;
    arrays of an earlier state are deleted then. To keep a state for later, copy it
    (`jax.tree.map(jnp.copy, session.state)`); a `state` given to the constructor is copied.

    Args:
        model: an `omnijax.Model`, a `MiniCPMOModel` or a `Decoder`.
        config: the session's settings (`omnijax.StreamConfig`); its fields are also accepted as keywords. The
            pool has `config.num_pages` pages (None: `omnijax.config.DEFAULT_SESSION_PAGES`).
        batch: sequences of the session's state.
        state: state to continue from (copied).

    Example:
        session = Session(model, StreamConfig(num_pages=64, max_answer_tokens=16))
        out = session.feed(text_chunk(ids, answer_tokens=8))
    """

    def __init__(self, model, config: StreamConfig | None = None, *, batch: int = 1,
                 state: StreamState | None = None, **fields):
        self.stream_config = bind_config(model, config, **fields)
        self._graphdef, self._params = model_parts(model)
        self.config = graphdef_config(model)
        if state is not None:
            check_state(state, self.config)
        num_pages = self.stream_config.num_pages or DEFAULT_SESSION_PAGES
        state = jax.tree.map(jnp.copy, state) if state is not None else init_state(
            self.config, num_pages=num_pages, page_size=self.stream_config.page_size, batch=batch,
            seed=seed_of(self.stream_config.decoding))
        # Commit inputs to the device once: a step's outputs are committed, and feeding uncommitted arrays to the
        # first call would otherwise compile the step a second time on the second call.
        device = jax.devices()[0]
        self._params = jax.device_put(self._params, device)
        self.state = jax.device_put(state, device)

    def __getattr__(self, name):
        # The settings read as attributes (`session.policy`, `session.max_answer_tokens`, ...).
        if name != "stream_config" and name in StreamConfig.__dataclass_fields__:
            return getattr(self.stream_config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def feed(self, chunk: Chunk, *, decoding=None) -> ChunkOutput:
        """Runs one chunk (`[B, T]` fields, no leading chunk axis) and advances the session state.

        `decoding` decodes this chunk's answer with another strategy than the config's (one more compiled step per
        strategy). Returns without waiting for the step. Pool exhaustion is reported in the output's
        `stats.layout.exhausted` and `stats.layout.dropped` (not warned about, which would wait for every step).
        """
        config = self.stream_config if decoding is None else self.stream_config.replace(decoding=decoding)
        chunks_lib.validate(chunk, self.config, max_answer_tokens=self.stream_config.max_answer_tokens,
                            stacked=False, decoding=config.decoding)
        if chunk.token_ids.shape[0] != self.state.kv.batch:
            raise ValueError(f"chunk batch {chunk.token_ids.shape[0]} != session batch {self.state.kv.batch}")
        chunk = jax.tree.map(jnp.asarray, chunk)
        self.state, out = _step(self._graphdef, self._params, self.state, chunk, config=config)
        return out
