"""Eager compaction: after an eviction, pack every sequence's survivors into its first slots, in write order.

The attention-time oracle of the paging modes (docs/architecture.md, "Physical layout"): the physical span becomes the
retained count rounded up to a page, at the price of moving every survivor that is not already in place; the number
moved is reported as the copy cost. The moves go through `migration.apply_plan` (gather-then-scatter over every layer's
K and V and the slot metadata) and never change a survivor's position, unit, span, order or score, so attention outputs
are unchanged. Emptied pages leave the page table and go back to the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV, table_slots
from omnijax.paging import migration


def plan(kv: PagedKV) -> jax.Array:
    """`dst [B, S]`: the k-th oldest survivor of each sequence goes to table slot k (-1 where already there)."""
    live = migration.live_slots(kv)
    B, S = live.shape
    flat, _ = table_slots(kv)
    order = kv.order.reshape(-1)[flat]
    by_age = jnp.argsort(jnp.where(live, order, jnp.iinfo(jnp.int32).max), axis=1)  # [B, S] slot of k-th oldest
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
    rank = jnp.zeros((B, S), jnp.int32).at[rows, by_age].set(jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))
    return jnp.where(live & (rank != jnp.arange(S)[None, :]), rank, -1)


def compact(kv: PagedKV) -> tuple[PagedKV, jax.Array]:
    """Packs each sequence's live slots into its first page-table slots, oldest first.

    Returns `(kv, moved [B] int32)`: the new cache and how many slots each sequence copied.
    """
    kv, moved = migration.apply_plan(kv, plan(kv), jnp.ones((kv.batch,), bool))
    return migration.drop_empty_entries(kv), moved
