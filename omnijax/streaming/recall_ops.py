"""The device programs and cell arithmetic a `RecallSession` runs outside the step (issue 40;
`omnijax.streaming.recall_session` explains when and why): the question's queries against the current cache, the
re-laying shift of cached tokens (positions and keys), the release of recalled tokens and the policy's deferred trim,
the host form of the re-indexing rule, and the room a batch-1 cache has left."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax import paging as paging_lib
from omnijax.chunks.chunk import Chunk
from omnijax.kv import attention as attention_lib
from omnijax.kv import paged as paged_lib
from omnijax.kv import rope as rope_lib
from omnijax.models.decoder import chunk_rotation, layer_finish, layer_qkv, layer_scan_inputs
from omnijax.retention import base as retention_base


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def question_queries(graphdef: Any, params: Any, kv: paged_lib.PagedKV, next_pos: jax.Array, chunk: Chunk, *,
                     impl: str) -> jax.Array:
    """`[L, T, H, d]` float32: the rotated queries of every layer for each token of a batch-1 chunk fed at
    `next_pos` (padding tokens' rows are meaningless: take `chunk.valid`). The chunk runs through every layer as the
    step would write it (attending over the cache and itself), on a copy of the cache that is thrown away."""
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
    return jax.lax.scan(layer, carry, xs)[1]


@functools.partial(jax.jit, static_argnames=("reindex", "rope", "paging", "subblock"), donate_argnames=("kv",))
def release_range(kv: paged_lib.PagedKV, next_pos: jax.Array, lo: jax.Array, hi: jax.Array, *, reindex: bool,
                  rope: tuple, paging: Any, subblock: int) -> tuple[paged_lib.PagedKV, jax.Array]:
    """Invalidates the live tokens with write orders in `[lo, hi)`, as a trim would (re-indexing, relayout)."""
    view = retention_base.sequence_view(kv)
    keep = view.live & ~((view.order >= lo) & (view.order < hi))
    kv, next_pos, evicted = retention_base.apply(kv, keep, next_pos, reindex=reindex, rope=rope, view=view)
    kv, _ = paging_lib.relayout(paging, kv, evicted, subblock)
    return kv, next_pos


@functools.partial(jax.jit, static_argnames=("policy", "rope", "paging", "subblock"))
def trim_now(kv: paged_lib.PagedKV, next_pos: jax.Array, *, policy: Any, rope: tuple, paging: Any,
             subblock: int) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array]:
    """The policy's trim (and the paging mode's relayout) as a step runs it, outside a step; `kv` is kept."""
    kv, next_pos, evicted = retention_base.trim(policy, kv, next_pos, rope=rope)
    kv, _ = paging_lib.relayout(paging, kv, evicted, subblock)
    return kv, next_pos, evicted


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


@functools.partial(jax.jit, static_argnames=("rope",), donate_argnames=("kv",))
def shift_positions(kv: paged_lib.PagedKV, moves: jax.Array, *, rope: tuple) -> paged_lib.PagedKV:
    """Adds `moves [N, P]` to every slot's positions (all axes) and re-rotates its keys by the same delta (all
    layers; a zero move is an exact identity), as re-indexing does with the opposite sign."""
    theta, section, interleaved = rope
    L, N, P, G, d = kv.k.shape
    angles = rope_lib.rope_angles(moves.reshape(1, N * P), d, theta, section, interleaved)  # [N*P, d/2]
    k = rope_lib.apply_rope(kv.k.reshape(L, N * P, G, d), angles).reshape(kv.k.shape).astype(kv.k.dtype)
    return kv.replace(pos=kv.pos + moves[None].astype(kv.pos.dtype), k=k)


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
