"""Rows sharing cache pages: a fork that shares a row's full pages, and copy-on-write before a shared page changes.

`n` choices of one prompt (chat completions `n > 1`) decode in n rows of one batch. `fork_rows` gives each new row
the prompt row's page table: its FULL pages (every slot live) are shared, not copied, and counted in
`PagedKV.shares` (references beyond the first); its other pages (the partly filled last page, pages with holes) are
copied into fresh pages, so every later write of a row lands in a page of its own. A shared page is full, so no
write ever finds an open slot in it (`omnijax.kv.paged.reserve` fills only open slots).

What else changes a page goes through `unshare` first: a retention trim that drops slots of a shared page, or
re-rotates its surviving keys when re-indexing (`omnijax.retention.base.apply`), gets a private copy of the page for
the trimming row; a trim dropping every live slot of a shared page drops the row's reference and puts an empty
page in its table entry (nothing copied; the row's layout stays that of a row with its own copy, whose emptied
slots the next tokens refill). The last reference frees a page. Releasing a row (`omnijax.kv.paged.release_pages`)
drops its references the same way.

Not shared (a fork copies every page instead, see `shareable`): policies that accumulate attention scores in the
pages (H2O-like, `needs_scores`), whose every attention step writes every attended slot, and paging modes other than
"native", whose migrations move slots between pages.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV, copy_rows, listed_first, release_pages

_CHUNK = 4  # pages a step of the copy loop moves: a fork or a trim copies a few pages, each a whole page of every layer
_PAGE_FIELDS = ("valid", "order", "unit", "span", "offset", "score")  # [N, P] slot fields (pos is [A, N, P])


def shareable(policy: Any, paging_mode: str) -> str | None:
    """Why a fork under `policy` and `paging_mode` must copy every page instead of sharing (None: it may share)."""
    if getattr(policy, "needs_scores", False):
        return (f"policy {type(policy).__name__} accumulates attention scores in every attended slot, so a fork "
                f"copies every page")
    if paging_mode != "native":
        return f"paging mode {paging_mode!r} migrates slots between pages, so a fork copies every page"
    return None


def fork_plan(kv: PagedKV, src: jax.Array | int, *, share: bool = True) -> tuple[jax.Array, jax.Array]:
    """`(shared [M], copied [M])` bool: the entries of row `src`'s table a fork shares and those it copies."""
    table = kv.page_table[src]
    held = table >= 0
    full = held & jnp.all(kv.valid[jnp.clip(table, 0, kv.num_pages - 1)], axis=1)
    shared = full if share else jnp.zeros_like(full)
    return shared, held & ~shared


def _copy_pages(kv: PagedKV, src: jax.Array, dst: jax.Array, count: jax.Array) -> PagedKV:
    """Copies whole pages `src [K]` to `dst [K]` (N: unused entry; the `count` used ones listed first): keys, values
    (int8 codes and scales as they are), every slot field and the page class."""
    N = kv.num_pages
    k, v = copy_rows((kv.k, kv.v), src, dst, count, chunk=_CHUNK)
    take = jnp.clip(src, 0, N - 1)
    fields = {name: getattr(kv, name).at[dst].set(getattr(kv, name)[take], mode="drop") for name in _PAGE_FIELDS}
    return kv.replace(k=k, v=v, pos=kv.pos.at[:, dst].set(kv.pos[:, take], mode="drop"),
                      page_class=kv.page_class.at[dst].set(kv.page_class[take], mode="drop"), **fields)


def fork_rows(kv: PagedKV, src: jax.Array | int, dst: jax.Array, *, share: bool = True) -> PagedKV:
    """Rows `dst [K]` (empty rows) become forks of row `src`: its page table, with its full pages shared
    (`share=True`) and every other page copied into fresh pages; its high-water mark, write count and drop count.

    Fresh pages are popped from the free stack top, destination by destination in table order. A destination that
    finds too few free pages is flagged `exhausted` (the caller checks `fork_plan`'s copies times K against
    `num_free` first). Pure and jittable; `share` is static.
    """
    N = kv.num_pages
    dst = jnp.asarray(dst, jnp.int32)
    K = dst.shape[0]
    table = kv.page_table[src]  # [M]
    shared, copied = fork_plan(kv, src, share=share)
    rank = jnp.cumsum(copied) - 1
    idx = jnp.arange(K, dtype=jnp.int32)[:, None] * jnp.sum(copied) + rank[None]  # [K, M] fresh page index
    room = copied[None] & (idx < kv.num_free)
    fresh = kv.free_stack[jnp.clip(kv.num_free - 1 - idx, 0, N - 1)]
    new_table = jnp.where(shared[None], table[None], jnp.where(room, fresh, -1))
    short = jnp.any(copied[None] & ~room, axis=1)  # [K]
    pairs, count = listed_first(room.reshape(-1), jnp.stack([jnp.where(room, table[None], N).reshape(-1),
                                                             jnp.where(room, fresh, N).reshape(-1)]), N)
    kv = _copy_pages(kv, pairs[0], pairs[1], count)
    return kv.replace(
        page_table=kv.page_table.at[dst].set(new_table),
        shares=kv.shares.at[jnp.where(shared, table, N)].add(K, mode="drop"),
        seq_slots=kv.seq_slots.at[dst].set(kv.seq_slots[src]),
        next_order=kv.next_order.at[dst].set(kv.next_order[src]),
        dropped=kv.dropped.at[dst].set(kv.dropped[src]),
        exhausted=kv.exhausted.at[dst].set(kv.exhausted[src] | short),
        num_free=kv.num_free - jnp.sum(room).astype(jnp.int32),
    )


def unshare(kv: PagedKV, touched: jax.Array, evicts: jax.Array | None = None) -> tuple[PagedKV, jax.Array]:
    """Copy-on-write before an operation writes the table-space slots `touched [B, S]`.

    Every page-table entry with a touched slot whose page is shared (`shares > 0`) drops its reference to the shared
    page and gets a private page in its place (fresh pages popped from the free stack, rows in batch order, table
    order): a copy of the shared page, or, where `evicts [B, S]` covers every live slot of the entry (a trim
    dropping the whole page), an empty page, no copy needed. Either way the row's table keeps its layout, so the
    row goes on exactly as one that held its own copy (later tokens refill the emptied slots first, as there). A
    row that finds too few free pages is flagged `exhausted` and its unserved entries are not writable. Without
    shared pages nothing changes.

    Returns `(kv, writable [B, S])`: the slots the operation may write (in the new table's pages).
    """
    B, M = kv.page_table.shape
    N, P = kv.num_pages, kv.page_size
    table = kv.page_table
    at = jnp.clip(table, 0, N - 1)
    hit = jnp.any(touched.reshape(B, M, P), axis=2) & (table >= 0) & (kv.shares[at] > 0)  # [B, M]
    if evicts is None:
        whole = jnp.zeros_like(hit)
    else:
        whole = hit & ~jnp.any(kv.valid[at] & ~evicts.reshape(B, M, P), axis=2)
    need = jnp.sum(hit, axis=1)
    idx = (jnp.cumsum(need) - need)[:, None] + jnp.cumsum(hit, axis=1) - 1  # [B, M] fresh page index
    room = hit & (idx < kv.num_free)
    fresh = kv.free_stack[jnp.clip(kv.num_free - 1 - idx, 0, N - 1)]
    short = hit & ~room
    copy = room & ~whole  # a free page holds no live slot: an emptied entry needs nothing copied but its class
    pairs, count = listed_first(copy.reshape(-1), jnp.stack([jnp.where(copy, table, N).reshape(-1),
                                                             jnp.where(copy, fresh, N).reshape(-1)]), N)
    kv = _copy_pages(kv, pairs[0], pairs[1], count)
    kv = kv.replace(page_table=jnp.where(room, fresh, table),
                    page_class=kv.page_class.at[jnp.where(room & whole, fresh, N)].set(kv.page_class[at],
                                                                                          mode="drop"),
                    num_free=kv.num_free - jnp.sum(room).astype(jnp.int32),
                    exhausted=kv.exhausted | jnp.any(short, axis=1))
    kv = release_pages(kv, jnp.where(room, table, -1).reshape(-1))
    return kv, ~jnp.repeat(short, P, axis=1)
