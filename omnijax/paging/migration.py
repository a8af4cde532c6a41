"""Moving survivors between slots and dropping empty pages: the two physical operations every paging mode uses.

A migration plan is a `dst [B, S]` table-space map (see `omnijax.kv.paged.table_slots`): `dst[b, j]` is where the
survivor now at slot j of sequence b goes, -1 where it stays. `apply_plan` turns the accepted sequences' moves into
one fixed-capacity `(src, dst)` list of physical slots, moves first, and applies it by gather-then-scatter: to every
slot field at once, and to every layer's K and V by a loop over the listed moves only (`chunk` slots a step), so the
copy costs what moves. A move reads its source before its destination is written, so a slot may be the source of
one move and the destination of another. A move carries the slot's key (already rotated for its position), value,
positions, write order, unit, span, offset and score unchanged, so attention outputs do not change.

`drop_empty_entries` removes page-table entries whose page holds no live slot (later entries shift left, order
kept) and returns those pages to the pool. It copies nothing: attention follows the page table, so an emptied page
simply leaves the span.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV, copy_rows, listed_first, release_pages, table_slots


def live_slots(kv: PagedKV) -> jax.Array:
    """`[B, S]` bool: table-space slots holding a live token."""
    flat, exists = table_slots(kv)
    return kv.valid.reshape(-1)[flat] & exists


def apply_moves(kv: PagedKV, src: jax.Array, dst: jax.Array, count: jax.Array | None = None,
                chunk: int = 256) -> PagedKV:
    """Moves physical slots `src [K]` to `dst [K]` (flat `page * P + offset`; `N * P` marks an unused entry).

    Sources are read before destinations are written, and destinations win where a slot is both. Destinations must
    be distinct. The slot fields move all at once. K and V, the fields whose size matters, are copied `chunk` list
    entries at a time by a loop over the first `count` entries (a scalar; the whole list when None; entries past it
    must be unused), so the copy costs what moves rather than what the list could hold. Each step reads before it
    writes; the steps together equal the all-at-once move when no destination is the source of a later move in the
    list, which holds for every plan of this package: each destination lies before its source in table order and
    `apply_plan` lists the moves first, in ascending source order.
    """
    N, P = kv.num_pages, kv.page_size
    gather_at = jnp.clip(src, 0, N * P - 1)

    def move_columns(merged):  # [..., N * P] -> the same with every move applied at once
        return merged.at[..., dst].set(jnp.take(merged, gather_at, axis=-1), mode="drop")

    if count is None:
        count = src.shape[0]
    k, v = copy_rows(tuple(x.reshape((x.shape[0], N * P) + x.shape[3:]) for x in (kv.k, kv.v)), src, dst, count,
                     chunk=chunk)  # [L, N * P, G, d]
    # Every slot field travels in one gather and one scatter: stacked as int32 rows of the flat slot axis.
    fields = {name: getattr(kv, name) for name in _SLOT_FIELDS}
    rows = jnp.concatenate([_as_int32(f).reshape(-1, N * P) for f in fields.values()])  # [R, N * P]
    rows = move_columns(rows)
    moved, at = {}, 0
    for name, f in fields.items():
        n = f.size // (N * P)
        moved[name] = _from_int32(rows[at:at + n], f.dtype).reshape(f.shape)
        at += n
    valid = kv.valid.reshape(-1).at[src].set(False, mode="drop").at[dst].set(True, mode="drop").reshape(N, P)
    return kv.replace(k=k.reshape(kv.k.shape), v=v.reshape(kv.v.shape), valid=valid, **moved)


_SLOT_FIELDS = ("pos", "order", "unit", "span", "offset", "score")  # per-slot metadata that moves with a token


def _as_int32(x: jax.Array) -> jax.Array:
    """Lossless int32 view of a slot field (float32 bit pattern; narrower integers widened)."""
    return jax.lax.bitcast_convert_type(x, jnp.int32) if x.dtype == jnp.float32 else x.astype(jnp.int32)


def _from_int32(x: jax.Array, dtype) -> jax.Array:
    """Inverse of `_as_int32`."""
    return jax.lax.bitcast_convert_type(x, jnp.float32) if dtype == jnp.float32 else x.astype(dtype)


def apply_plan(kv: PagedKV, dst: jax.Array, accepted: jax.Array, chunk: int = 256) -> tuple[PagedKV, jax.Array]:
    """Applies the moves `dst [B, S]` of the sequences where `accepted [B]` holds.

    The moves are listed first (sequence by sequence, ascending table slot) and K/V are copied `chunk` moves at a
    time, so the copy follows the number of moved slots (see `apply_moves`).

    Returns `(kv, moved [B] int32)`: the new cache and the number of slots each sequence copied (its copy cost in
    slots; every move copies one key and one value row per layer).
    """
    N, P = kv.num_pages, kv.page_size
    flat, _ = table_slots(kv)
    move = (dst >= 0) & accepted[:, None]
    src_flat = jnp.where(move, flat, N * P).reshape(-1)
    dst_flat = jnp.where(move, jnp.take_along_axis(flat, jnp.clip(dst, 0, flat.shape[1] - 1), axis=1),
                         N * P).reshape(-1)
    src_dst, count = listed_first(move.reshape(-1), jnp.stack([src_flat, dst_flat]), N * P)  # moves first
    kv = apply_moves(kv, src_dst[0], src_dst[1], count=count, chunk=chunk)
    return kv, jnp.sum(move, axis=1).astype(jnp.int32)


def drop_empty_entries(kv: PagedKV) -> PagedKV:
    """Removes page-table entries whose page holds no live slot and returns their pages to the pool.

    The remaining entries keep their order and shift left; each sequence's high-water mark moves with them (to the
    end of its last entry when the entry holding the mark was dropped).
    """
    B, M = kv.page_table.shape
    P = kv.page_size
    table = kv.page_table
    has_page = table >= 0
    active = has_page & jnp.any(kv.valid, axis=1)[jnp.clip(table, 0, kv.num_pages - 1)]  # [B, M]
    dropped = has_page & ~active
    new_entry = jnp.where(active, jnp.cumsum(active, axis=1) - 1, M)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, M))
    new_table = jnp.full_like(table, -1).at[rows, new_entry].set(table, mode="drop")
    mark_entry = jnp.clip((kv.seq_slots - 1) // P, 0, M - 1)
    mark_kept = (kv.seq_slots > 0) & jnp.take_along_axis(active, mark_entry[:, None], axis=1)[:, 0]
    kept = jnp.sum(active, axis=1)
    seq_slots = jnp.where(mark_kept, kv.seq_slots - P * jnp.sum(dropped, axis=1), kept * P)
    kv = release_pages(kv, jnp.where(dropped, table, -1).reshape(-1), holding_live=False)  # none live
    return kv.replace(page_table=new_table, seq_slots=seq_slots.astype(jnp.int32))
