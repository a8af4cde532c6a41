"""Layout statistics of a `PagedKV`: retained cells, physical span, active pages and subblocks.

Definitions (per sequence):
    retained cells: live slots reached through the sequence's page table.
    physical span: page-rounded extent attention traverses, i.e. (index of the last page-table entry whose page
        holds a live slot + 1) * page_size.
    active pages / subblocks: pages (or `subblock`-sized slices of pages) holding at least one live slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayoutStats:
    """Per-sequence layout statistics, each `[B]` int32 (pool figures are scalars)."""

    retained_cells: jax.Array
    physical_span: jax.Array
    active_pages: jax.Array
    active_subblocks: jax.Array
    table_pages: jax.Array  # page-table entries in use
    free_pages: jax.Array  # [] pool
    exhausted: jax.Array  # [B] bool
    dropped: jax.Array  # [B]


def layout_stats(kv: PagedKV, subblock: int = 32) -> LayoutStats:
    """Computes `LayoutStats`; `subblock` must divide the page size (it is clipped to the page size)."""
    P = kv.page_size
    subblock = min(subblock, P)
    if P % subblock:
        raise ValueError(f"subblock {subblock} must divide page_size {P}")
    table = kv.page_table
    has_page = table >= 0
    pages = jnp.clip(table, 0, kv.num_pages - 1)
    live = kv.valid[pages] & has_page[..., None]  # [B, M, P]
    per_page = jnp.sum(live, axis=-1)  # [B, M]
    nonempty = per_page > 0
    entry = jnp.arange(table.shape[1])[None, :]
    last = jnp.max(jnp.where(nonempty, entry, -1), axis=1)  # [B]
    sub_live = jnp.any(live.reshape(live.shape[0], live.shape[1], P // subblock, subblock), axis=-1)
    return LayoutStats(
        retained_cells=jnp.sum(per_page, axis=1).astype(jnp.int32),
        physical_span=((last + 1) * P).astype(jnp.int32),
        active_pages=jnp.sum(nonempty, axis=1).astype(jnp.int32),
        active_subblocks=jnp.sum(sub_live, axis=(1, 2)).astype(jnp.int32),
        table_pages=jnp.sum(has_page, axis=1).astype(jnp.int32),
        free_pages=kv.num_free,
        exhausted=kv.exhausted,
        dropped=kv.dropped,
    )
