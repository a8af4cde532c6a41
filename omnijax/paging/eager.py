"""Eager compaction: after an eviction, pack every sequence's survivors into its first pages, in write order.

The attention-time oracle of the paging modes (DESIGN.md "Physical layout"): the physical span becomes the retained
count rounded up to a page, at the price of moving KV entries; the number moved is reported as the copy cost. A
migration is a `(src, dst)` slot list applied to every layer's K and V (and to the slot metadata) by
gather-then-scatter, so reads precede writes and no move clobbers another's source. It never changes a survivor's
position, unit, span, order or score, so attention outputs are unchanged. Emptied pages leave the page table and go
back to the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV, release_pages
from omnijax.retention.base import sequence_view


def _slot_fields(kv: PagedKV) -> dict[str, jax.Array]:
    return {"valid": kv.valid, "order": kv.order, "unit": kv.unit, "span": kv.span, "offset": kv.offset,
            "score": kv.score}


def compact(kv: PagedKV) -> tuple[PagedKV, jax.Array]:
    """Packs each sequence's live slots into its first page-table entries, oldest first.

    Returns `(kv, moved [B] int32)`: the new cache and how many slots each sequence copied.
    """
    B, M = kv.page_table.shape
    N, P = kv.num_pages, kv.page_size
    view = sequence_view(kv)
    live = view.live  # [B, S] in page-table order
    S = M * P
    flat = (jnp.clip(kv.page_table, 0, N - 1)[:, :, None] * P + jnp.arange(P)).reshape(B, S)
    # Survivors in write order take logical indices 0..n-1.
    key = jnp.where(live, view.order, jnp.iinfo(jnp.int32).max)
    by_age = jnp.argsort(key, axis=1)  # [B, S] logical index of the k-th oldest survivor
    count = view.retained  # [B]
    k = jnp.arange(S)[None, :]
    is_move = (k < count[:, None]) & (by_age != k)
    src = jnp.where(is_move, jnp.take_along_axis(flat, by_age, axis=1), N * P).reshape(-1)
    dst = jnp.where(is_move, flat, N * P).reshape(-1)
    moved = jnp.sum(is_move, axis=1).astype(jnp.int32)

    def migrate(field, axis):  # gather every source first, then scatter: no move reads a slot another move wrote
        shape = field.shape  # the page and slot axes sit at `axis`, `axis + 1`
        merged = field.reshape(shape[:axis] + (N * P,) + shape[axis + 2:])
        taken = jnp.take(merged, jnp.clip(src, 0, N * P - 1), axis=axis)
        return merged.at[(slice(None),) * axis + (dst,)].set(taken, mode="drop").reshape(shape)

    kv = kv.replace(k=migrate(kv.k, 1), v=migrate(kv.v, 1), pos=migrate(kv.pos, 1),
                    **{name: migrate(value, 0) for name, value in _slot_fields(kv).items()})
    # Slots at logical indices >= n no longer hold survivors: invalidate them; release the pages past the last one.
    tail = jnp.where((k >= count[:, None]) & (jnp.repeat(kv.page_table >= 0, P, axis=1)), flat, N * P)
    kv = kv.replace(valid=kv.valid.reshape(-1).at[tail.reshape(-1)].set(False, mode="drop").reshape(N, P))
    keep_pages = (count + P - 1) // P  # [B]
    entry = jnp.arange(M)[None, :]
    emptied = (entry >= keep_pages[:, None]) & (kv.page_table >= 0)
    kv = release_pages(kv, jnp.where(emptied, kv.page_table, -1).reshape(-1))
    kv = kv.replace(page_table=jnp.where(emptied, -1, kv.page_table), seq_slots=count.astype(jnp.int32))
    return kv, moved
