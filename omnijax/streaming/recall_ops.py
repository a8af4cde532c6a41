"""The device programs and cell arithmetic a `RecallSession` runs outside the step (issue 40;
`omnijax.streaming.recall_session` explains when and why): the question's queries against the current cache, the
re-laying shift of cached tokens (positions and keys), the release of recalled tokens and the policy's deferred trim,
the host form of the re-indexing rule, and the room a batch-1 cache has left."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax import paging as paging_lib
from omnijax.chunks.chunk import Chunk
from omnijax.kept_executables import cached_jit
from omnijax.kv import attention as attention_lib
from omnijax.kv import paged as paged_lib
from omnijax.kv import quant_kv
from omnijax.kv import rope as rope_lib
from omnijax.kv.quant_kv import QuantPages
from omnijax.models.decoder import chunk_rotation, layer_finish, layer_qkv, layer_scan_inputs
from omnijax.retention import base as retention_base


@cached_jit(static_argnames=("graphdef", "impl"))
def question_queries(graphdef: Any, params: Any, kv: paged_lib.PagedKV, next_pos: jax.Array, chunk: Chunk, *,
                     impl: str) -> jax.Array:
    """`[L, T, H, d]` float32: the rotated queries of every layer for each token of a batch-1 chunk fed at
    `next_pos` (padding tokens' rows are meaningless: take `chunk.valid`). The chunk runs through every layer as the
    step would write it (attending over the cache and itself), on a copy of the cache that is thrown away."""
    return _question(graphdef, params, kv, next_pos, chunk, impl)[0]


@cached_jit(static_argnames=("graphdef", "impl"), donate_argnames=("kv",))
def question_queries_in_place(graphdef: Any, params: Any, kv: paged_lib.PagedKV, next_pos: jax.Array,
                              chunk: Chunk, *, impl: str) -> tuple[jax.Array, paged_lib.PagedKV]:
    """`question_queries` without a copy of the cache: `(queries, kv)`. The chunk's keys and values are written
    into the donated cache in place, in the slots the step would write them to (open slots of the sequence's pages
    and free pages, none of which holds a live token), and every other field is returned as it came, so the cache
    holds what it held (a freed slot's contents are dirty by contract: every reader masks by `valid`). The
    engine's recall (`omnijax.serve.engine.recall_rows`) runs this on a row of its shared pool."""
    q, k, v = _question(graphdef, params, kv, next_pos, chunk, impl)
    return q, kv.replace(k=k, v=v)


def _question(graphdef: Any, params: Any, kv: paged_lib.PagedKV, next_pos: jax.Array, chunk: Chunk,
              impl: str) -> tuple[jax.Array, Any, Any]:
    """The question's forward: `(queries [L, T, H, d], k pages, v pages)` with the chunk written into the pages."""
    model = nnx.merge(graphdef, params)
    c = model.config
    x = model.embed_tokens(chunk.token_ids)
    if chunk.embeds is not None:
        x = jnp.where(chunk.embed_mask[..., None], chunk.embeds.astype(x.dtype), x)
    positions = chunk.positions + next_pos[None, :, None]
    meta = paged_lib.SlotMeta(pos=positions, unit=chunk.unit, span=chunk.span, offset=chunk.offset)
    kv, slots, q_order = paged_lib.reserve(kv, chunk.valid, meta)
    view = attention_lib.index_pages(attention_lib.CacheView.of(kv, slots, q_order))
    rot = chunk_rotation(c, positions)
    xs, ffn_of = layer_scan_inputs(c, model.layers.stacked())
    deepstack = chunk.deepstack

    def layer(carry, p):
        h, k_pages, v_pages, i = carry
        q, k, v = layer_qkv(c, p, h, rot)
        k_pages = paged_lib.write_layer(k_pages, view.write_slots, k, layer=i)
        v_pages = paged_lib.write_layer(v_pages, view.write_slots, v, layer=i)
        h = layer_finish(c, p, h, attention_lib.attend(q, k_pages, v_pages, view, impl=impl, layer=i), ffn_of(p))
        if deepstack is not None:
            level = jax.lax.dynamic_index_in_dim(deepstack, jnp.minimum(i, deepstack.shape[0] - 1), keepdims=False)
            h = jnp.where(i < deepstack.shape[0], h + level.astype(h.dtype), h)
        return (h, k_pages, v_pages, i + 1), q[0].astype(jnp.float32)

    carry = (x.astype(c.jnp_dtype), kv.k, kv.v, jnp.int32(0))
    (_, k_pages, v_pages, _), q = jax.lax.scan(layer, carry, xs)
    return q, k_pages, v_pages


@cached_jit(static_argnames=("reindex", "rope", "paging", "subblock"), donate_argnames=("kv",))
def release_range(kv: paged_lib.PagedKV, next_pos: jax.Array, lo: jax.Array, hi: jax.Array, *, reindex: bool,
                  rope: tuple, paging: Any, subblock: int) -> tuple[paged_lib.PagedKV, jax.Array]:
    """Invalidates the live tokens with write orders in `[lo, hi)`, as a trim would (re-indexing, relayout)."""
    view = retention_base.sequence_view(kv)
    keep = view.live & ~((view.order >= lo) & (view.order < hi))
    kv, next_pos, evicted = retention_base.apply(kv, keep, next_pos, reindex=reindex, rope=rope, view=view)
    kv, _ = paging_lib.relayout(paging, kv, evicted, subblock)
    return kv, next_pos


def _trim_now(kv: paged_lib.PagedKV, next_pos: jax.Array, *, policy: Any, rope: tuple, paging: Any,
              subblock: int) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array]:
    """The policy's trim (and the paging mode's relayout) as a step runs it, outside a step."""
    kv, next_pos, evicted = retention_base.trim(policy, kv, next_pos, rope=rope)
    kv, _ = paging_lib.relayout(paging, kv, evicted, subblock)
    return kv, next_pos, evicted


trim_now = cached_jit(_trim_now, static_argnames=("policy", "rope", "paging", "subblock"))
"""`_trim_now` with `kv` kept (a batch-1 `Session` reads the evicted tokens from it)."""
trim_now_in_place = cached_jit(_trim_now, static_argnames=("policy", "rope", "paging", "subblock"),
                            donate_argnames=("kv",))
"""`_trim_now` on a donated `kv`, updated in place (the engine: the evicted tokens stay in their slots, read from
the result, `omnijax.kv.host_tier.capture_evicted(..., in_place=True)`)."""


def freed_below_1d(lo: np.ndarray, hi: np.ndarray, cursor: int) -> tuple[np.ndarray, int]:
    """`omnijax.retention.base.freed_below` for one sequence of tokens spanning `[lo, hi]` (int arrays `[n]`) below
    `cursor`, on host: `(freed values below each token's lo [n], all freed values below the cursor)`."""
    if lo.size == 0:
        return np.zeros(0, np.int64), int(cursor)
    idx = np.argsort(lo, kind="stable")
    reach = np.maximum.accumulate(hi[idx])
    before = np.concatenate([[-1], reach[:-1]])
    freed_sorted = np.cumsum(np.maximum(lo[idx] - before - 1, 0))
    freed = np.zeros(lo.size, np.int64)
    freed[idx] = freed_sorted
    return freed, int(freed_sorted[-1] + max(cursor - int(reach[-1]) - 1, 0))


@cached_jit(static_argnames=("rope",), donate_argnames=("kv",))
def shift_positions(kv: paged_lib.PagedKV, moves: jax.Array, *, rope: tuple) -> paged_lib.PagedKV:
    """Adds `moves [N, P]` to every slot's positions (all axes) and re-rotates its keys by the same delta (all
    layers; a zero move is an exact identity), as re-indexing does with the opposite sign."""
    theta, section, interleaved = rope
    L, N, P, G, d = kv.k.shape
    angles = rope_lib.rope_angles(moves.reshape(1, N * P), d, theta, section, interleaved)  # [N*P, d/2]
    k = _turn(kv.k.reshape(L, N * P, G, d), angles, moves.reshape(N * P) != 0).reshape(kv.k.shape)
    return kv.replace(pos=kv.pos + moves[None].astype(kv.pos.dtype), k=k)


def _turn(k: jax.Array | QuantPages, angles: jax.Array, moved: jax.Array) -> jax.Array | QuantPages:
    """Keys `[L, S, G, d]` rotated by `angles [S, d/2]` where `moved [S]`. Float keys: every slot turned (a zero
    angle is an exact identity). int8 keys (`QuantPages`): the moved slots dequantised, turned in float32 and
    requantised with fresh scales, as re-indexing does; the others keep their codes and scales bit for bit."""
    if not isinstance(k, QuantPages):
        return rope_lib.apply_rope(k, angles).astype(k.dtype)
    turned = QuantPages.of(rope_lib.apply_rope(k.dense(jnp.float32), angles), k.dtype)
    return QuantPages(jnp.where(moved[None, :, None, None], turned.values, k.values),
                      jnp.where(moved[None, :, None], turned.scale, k.scale), k.dtype_name)


@cached_jit(static_argnames=("rope",), donate_argnames=("kv",))
def shift_row(kv: paged_lib.PagedKV, moves: jax.Array, *, rope: tuple) -> paged_lib.PagedKV:
    """`shift_positions` on the pages of row 0's page table only (`moves [N, P]` must be zero elsewhere), in place:
    the row's pages are gathered, shifted and scattered back, so a row of a shared pool costs its own pages, not
    the pool's (the engine's recall, `omnijax.serve.engine.recall_rows`)."""
    theta, section, interleaved = rope
    L, N, P, G, d = kv.k.shape
    table = kv.page_table[0]
    at = jnp.where(table >= 0, table, N)  # [M]; a missing entry reads page N-1 (clipped) and writes nowhere
    row_moves = moves[jnp.minimum(at, N - 1)] * (table >= 0)[:, None]  # [M, P]
    M = table.shape[0]
    angles = rope_lib.rope_angles(row_moves.reshape(1, M * P), d, theta, section, interleaved)  # [M*P, d/2]
    rows = kv.k[:, jnp.minimum(at, N - 1)].reshape(L, M * P, G, d)
    k = _turn(rows, angles, row_moves.reshape(M * P) != 0).reshape(L, M, P, G, d)
    pos = kv.pos.at[:, at].add(row_moves[None].astype(kv.pos.dtype), mode="drop")
    return kv.replace(pos=pos, k=quant_kv.set_rows(kv.k, at, k))


def room(kv: paged_lib.PagedKV) -> int:
    """Cells a batch-1 cache can still take: open slots of its held pages and the fresh pages its table can list
    (as `omnijax.kv.paged.reserve` finds them)."""
    m = jax.device_get({"table": kv.page_table[0], "valid": kv.valid, "seq_slots": kv.seq_slots[0],
                        "free": kv.num_free})
    P, M = kv.page_size, kv.max_pages
    held = -(-int(m["seq_slots"]) // P)
    pages = m["table"][:held]
    open_slots = int((~m["valid"][pages[pages >= 0]]).sum())
    return open_slots + min(int(m["free"]), M - held) * P
