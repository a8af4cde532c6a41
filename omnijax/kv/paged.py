"""`PagedKV`: the immutable paged KV cache pytree shared by every capability.

One pool of pages serves a batch of sequences (a single session is the batch-1 case). Keys are stored after RoPE.
Every update returns a new `PagedKV`; nothing is mutated. Slots of freed pages are dirty: they keep whatever they
held, and every reader masks by `valid`.

Shapes (L layers, N pages, P page size, G kv heads, d head dim, A position axes, B sequences, M max pages/sequence):

    k, v        [L, N, P, G, d]   keys (post-RoPE) and values: arrays in the model's dtype, or with
                                  `kv_dtype="int8"` `omnijax.kv.quant_kv.QuantPages` (int8 codes [L, N, P, G, d]
                                  plus float32 scales [L, N, P, G]); every writer and reader below takes both
    valid       [N, P] bool       slot holds a live token
    pos         [A, N, P] int32   logical position (A = 3 for mrope t/h/w, 1 for plain RoPE)
    order       [N, P] int32      per-sequence write order (causality inside a chunk; survives re-indexing)
    unit        [N, P] int32      unit id of the token
    span        [N, P] int8       span kind (`omnijax.chunks.spans.SpanKind`)
    offset      [N, P] int32      offset of the token within its span
    score       [N, P] float32    accumulated attention mass the slot received (H2O; zero unless tracked)
    page_table  [B, M] int32      physical pages of each sequence in span order, -1 = none
    page_class  [N] int8          `PageClass` of each page
    shares      [N] int32         references to the page beyond the first: rows whose page tables share it (n
                                  choices forked from one prompt, `omnijax.kv.page_sharing`); 0 for a private or free
                                  page, so every allocator that knows nothing of sharing keeps it right
    seq_slots   [B] int32         high-water mark in page-table space: the entries below it are held
    next_order  [B] int32         tokens ever written per sequence
    free_stack  [N] int32         free page ids; the top `num_free` entries are free
    num_free    [] int32
    exhausted   [B] bool          sticky: a write found no free page or no page-table room
    dropped     [B] int32         tokens not written because of exhaustion
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from omnijax._checks import check_power_of_two
from omnijax.chunks.spans import SpanKind
from omnijax.kv import quant_kv
from omnijax.kv.quant_kv import QuantPages


class PageClass(enum.IntEnum):
    FREE = 0
    MUST_KEEP = 1
    SELECTED = 2
    RECENT = 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    k: jax.Array | QuantPages
    v: jax.Array | QuantPages
    valid: jax.Array
    pos: jax.Array
    order: jax.Array
    unit: jax.Array
    span: jax.Array
    offset: jax.Array
    score: jax.Array
    page_table: jax.Array
    page_class: jax.Array
    shares: jax.Array
    seq_slots: jax.Array
    next_order: jax.Array
    free_stack: jax.Array
    num_free: jax.Array
    exhausted: jax.Array
    dropped: jax.Array

    @property
    def num_pages(self) -> int:
        return self.valid.shape[0]

    @property
    def page_size(self) -> int:
        return self.valid.shape[1]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def replace(self, **changes: Any) -> "PagedKV":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class SlotMeta:
    """Per-token metadata of a chunk being written, each `[B, T]` (pos `[A, B, T]`)."""

    pos: jax.Array
    unit: jax.Array
    span: jax.Array
    offset: jax.Array


def init(*, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, batch: int = 1,
         max_pages: int | None = None, position_axes: int = 3, dtype: jnp.dtype | type = jnp.float32,
         kv_dtype: str = "float") -> PagedKV:
    """An empty cache: every page free, every page-table entry -1.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        num_pages: pool size N.
        page_size: slots per page P (a power of two).
        batch: sequences B sharing the pool.
        max_pages: page-table width M per sequence (default: the whole pool).
        position_axes: 3 for mrope, 1 for plain RoPE.
        dtype: compute dtype of keys and values (and their storage dtype for a float pool).
        kv_dtype: "float" (store `dtype`) or "int8" (`QuantPages`: int8 codes and float32 scales per token and
            KV head, dequantised to `dtype` on read; `omnijax.kv.quant_kv`).
    """
    check_power_of_two("page_size", page_size)
    quant_kv.check_kv_dtype(kv_dtype)
    if num_pages <= 0 or batch <= 0:
        raise ValueError(f"num_pages and batch must be positive, got num_pages={num_pages}, batch={batch}")
    if min(num_layers, num_kv_heads, head_dim) <= 0:
        raise ValueError(f"num_layers, num_kv_heads and head_dim must be positive, got {num_layers}, {num_kv_heads}, "
                         f"{head_dim}")
    max_pages = num_pages if max_pages is None else max_pages
    if max_pages <= 0:
        raise ValueError(f"max_pages must be positive, got {max_pages}")
    return _empty(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages,
                  page_size=page_size, batch=batch, max_pages=max_pages, position_axes=position_axes,
                  dtype=jnp.dtype(dtype), kv_dtype=kv_dtype)


@functools.partial(jax.jit, static_argnames=("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size",
                                              "batch", "max_pages", "position_axes", "dtype", "kv_dtype"))
def _empty(*, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, batch: int,
           max_pages: int, position_axes: int, dtype: jnp.dtype, kv_dtype: str) -> PagedKV:
    """`init`'s cache, built by one compiled program (eagerly, each of its ~20 fills was a program of its own)."""
    shape = (num_pages, page_size)
    kv_shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)

    def pool() -> jax.Array | QuantPages:
        return quant_kv.zeros(kv_shape, dtype) if kv_dtype == "int8" else jnp.zeros(kv_shape, dtype)

    return PagedKV(
        k=pool(),
        v=pool(),
        valid=jnp.zeros(shape, bool),
        pos=jnp.zeros((position_axes,) + shape, jnp.int32),
        order=jnp.zeros(shape, jnp.int32),
        unit=jnp.full(shape, -1, jnp.int32),
        span=jnp.zeros(shape, jnp.int8),
        offset=jnp.zeros(shape, jnp.int32),
        score=jnp.zeros(shape, jnp.float32),
        page_table=jnp.full((batch, max_pages), -1, jnp.int32),
        page_class=jnp.full((num_pages,), PageClass.FREE, jnp.int8),
        shares=jnp.zeros((num_pages,), jnp.int32),
        seq_slots=jnp.zeros((batch,), jnp.int32),
        next_order=jnp.zeros((batch,), jnp.int32),
        # Pages are popped from the top of the stack, so page 0 is handed out first.
        free_stack=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.asarray(num_pages, jnp.int32),
        exhausted=jnp.zeros((batch,), bool),
        dropped=jnp.zeros((batch,), jnp.int32),
    )


PLACEMENTS = ("first_fit", "by_class")


def reserve(kv: PagedKV, token_valid: jax.Array, meta: SlotMeta, *, placement: str = "first_fit"
            ) -> tuple[PagedKV, jax.Array, jax.Array]:
    """Assigns cache slots to a chunk's valid tokens and records their metadata.

    A sequence's held entries are its page-table entries below `ceil(seq_slots[b] / P)`; their open slots are the
    ones holding no live token (holes eviction left, and the rest of the last entry). Tokens fill open slots in
    table order; reusing holes keeps a trimmed session's memory bounded. Write order, not slot order, carries
    causality. The tokens that find no open slot get fresh pages appended to the table, popped from the free stack,
    sequences in batch order. A token with no slot (pool empty or page table full) is not written: it gets slot -1,
    `exhausted[b]` is set and `dropped[b]` counts it. Nothing is ever overwritten.

    Placements (which open slots a token may take, and the class of the fresh pages):
        first_fit: every open slot, token by token in chunk order; fresh pages are RECENT.
        by_class: OmniPage's retention-aware placement (OmniTide §6.1). SYSTEM tokens (the protected system
            prefix) take open slots of MUST_KEEP pages only, every other token those of RECENT pages only, each
            group first-fit in chunk order; SELECTED pages take nothing. The system tokens that do not fit get
            fresh MUST_KEEP pages, entered in the table first, then the others fresh RECENT pages, so no page ever
            mixes system and unit tokens and a partly filled MUST_KEEP page stays reserved for later system
            tokens. When the pool or the table runs short, the later fresh entries (the RECENT ones first) go
            without, and their tokens count as dropped.

    Args:
        kv: the cache.
        token_valid: `[B, T]` bool, tokens to write (padding is False).
        meta: the chunk's positions and span metadata.
        placement: one of `PLACEMENTS` (static).

    Returns:
        `(kv, write_slots [B, T] int32 flat slot index page * P + offset or -1, token_order [B, T] int32)`.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; available: {PLACEMENTS}")
    B, T = token_valid.shape
    P, M, N = kv.page_size, kv.max_pages, kv.num_pages
    S = M * P
    token_valid = token_valid.astype(bool)
    count = jnp.sum(token_valid, axis=1).astype(jnp.int32)  # [B]

    # Two groups of tokens, each with the open slots of held entries it may take: 0 = system tokens in MUST_KEEP
    # pages (by_class only), 1 = every other token (RECENT pages for by_class, any page for first_fit).
    j = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S] table slot
    table_pages = jnp.clip(kv.page_table, 0, N - 1)
    exists = jnp.repeat(kv.page_table >= 0, P, axis=1)  # [B, S]
    live = exists & kv.valid[table_pages].reshape(B, S)
    pages_held = (kv.seq_slots + P - 1) // P  # [B] page-table entries in use
    open_slot = exists & ~live & (j < pages_held[:, None] * P)
    if placement == "by_class":
        cls = jnp.repeat(kv.page_class[table_pages], P, axis=1)
        system = token_valid & (meta.span == SpanKind.SYSTEM)
        tokens = jnp.stack([system, token_valid & ~system])  # [2, B, T]
        slots = jnp.stack([open_slot & (cls == PageClass.MUST_KEEP), open_slot & (cls == PageClass.RECENT)])
    else:
        tokens = jnp.stack([jnp.zeros_like(token_valid), token_valid])
        slots = jnp.stack([jnp.zeros_like(open_slot), open_slot])
    rank = jnp.cumsum(tokens, axis=2) - 1  # [2, B, T] rank among the chunk's tokens of the group
    wanted = jnp.sum(tokens, axis=2)  # [2, B]
    n_open = jnp.sum(slots, axis=2)  # [2, B]
    # The k-th open slot of each group, listed by rank with one scatter (a binary search would be a loop: on a GPU,
    # a host read-back per step).
    open_rank = jnp.where(slots, jnp.cumsum(slots, axis=2) - 1, S)
    lanes = (jnp.arange(2)[:, None, None], jnp.arange(B)[None, :, None])
    kth_open = jnp.full((2, B, S), S, jnp.int32).at[lanes + (open_rank,)].set(
        jnp.broadcast_to(j, (2, B, S)), mode="drop")
    # Fresh pages: each group's overflow, the system group's pages entered first.
    fresh_pages = (jnp.maximum(wanted - n_open, 0) + P - 1) // P  # [2, B]
    first_fresh = pages_held[None] + jnp.stack([jnp.zeros_like(pages_held), fresh_pages[0]])  # [2, B] entry
    held_slot = jnp.take_along_axis(kth_open, jnp.clip(rank, 0, S - 1), axis=2)
    fresh_slot = first_fresh[..., None] * P + rank - n_open[..., None]
    slot = jnp.where(rank < n_open[..., None], held_slot, fresh_slot)  # [2, B, T] table slot per group
    logical = jnp.where(tokens[0], slot[0], slot[1])  # [B, T]

    need = jnp.minimum(fresh_pages[0] + fresh_pages[1], jnp.maximum(M - pages_held, 0))  # capped by the table
    need_before = jnp.cumsum(need) - need
    granted = jnp.clip(kv.num_free - need_before, 0, need)  # [B] pages actually available, batch order
    taken_before = jnp.cumsum(granted) - granted
    total_taken = jnp.sum(granted)

    # New page-table entries: entry e (pages_held <= e < pages_held + granted) gets the (taken_before + e -
    # pages_held)-th page popped from the stack top; MUST_KEEP for the system group's entries, RECENT after them.
    entry = jnp.arange(M)[None, :]  # [1, M]
    k_new = entry - pages_held[:, None]  # [B, M]
    is_new = (k_new >= 0) & (k_new < granted[:, None])
    stack_idx = kv.num_free - 1 - (taken_before[:, None] + k_new)
    popped = kv.free_stack[jnp.clip(stack_idx, 0, N - 1)]
    page_table = jnp.where(is_new, popped, kv.page_table)
    new_pages = jnp.where(is_new, popped, N)  # out of range = dropped update
    new_class = jnp.where(k_new < fresh_pages[0][:, None], PageClass.MUST_KEEP, PageClass.RECENT)
    page_class = kv.page_class.at[new_pages.reshape(-1)].set(new_class.reshape(-1).astype(kv.page_class.dtype),
                                                             mode="drop")

    # Slots: a token is written when its page-table entry exists after allocation.
    entry_of_token = logical // P
    page_of_token = jnp.take_along_axis(page_table, jnp.clip(entry_of_token, 0, M - 1), axis=1)
    writable = token_valid & (entry_of_token < M) & (page_of_token >= 0)
    writable = writable & (entry_of_token < pages_held[:, None] + granted[:, None])
    write_slots = jnp.where(writable, page_of_token * P + logical % P, -1)
    written = jnp.sum(writable, axis=1).astype(jnp.int32)
    lost = count - written
    high_water = jnp.maximum(kv.seq_slots, jnp.max(jnp.where(writable, logical + 1, 0), axis=1))

    token_order = kv.next_order[:, None] + jnp.cumsum(token_valid, axis=1) - 1
    flat = jnp.where(writable, write_slots, N * P).reshape(-1)  # out of range = dropped

    def put(field, values):
        return field.reshape(-1).at[flat].set(values.reshape(-1).astype(field.dtype), mode="drop").reshape(
            field.shape)

    A = kv.pos.shape[0]
    pos = meta.pos if meta.pos.shape[0] == A else jnp.broadcast_to(meta.pos[:1], (A,) + meta.pos.shape[1:])
    new_pos = jnp.stack([put(kv.pos[a], pos[a]) for a in range(A)])
    kv = kv.replace(
        valid=put(kv.valid, jnp.ones((B, T), bool)),
        pos=new_pos,
        order=put(kv.order, token_order),
        unit=put(kv.unit, meta.unit),
        span=put(kv.span, meta.span),
        offset=put(kv.offset, meta.offset),
        score=put(kv.score, jnp.zeros((B, T), jnp.float32)),
        page_table=page_table,
        page_class=page_class,
        seq_slots=high_water.astype(jnp.int32),
        next_order=kv.next_order + count,
        num_free=kv.num_free - total_taken,
        exhausted=kv.exhausted | (lost > 0),
        dropped=kv.dropped + lost,
    )
    return kv, write_slots, token_order


def table_slots(kv: PagedKV) -> tuple[jax.Array, jax.Array]:
    """Table space: `(flat slot index [B, S], entry exists [B, S])`, S = max_pages * page_size.

    Slot j = e * page_size + o of sequence b is offset o of page-table entry e; `flat` is its physical slot
    `page * page_size + o` (page 0 where the entry is -1, so always mask by `exists`).
    """
    P = kv.page_size
    table = kv.page_table
    exists = jnp.repeat(table >= 0, P, axis=1)
    flat = (jnp.clip(table, 0, kv.num_pages - 1)[:, :, None] * P + jnp.arange(P)).reshape(table.shape[0], -1)
    return flat, exists


def write_layer(pages: jax.Array | QuantPages, write_slots: jax.Array, values: jax.Array, *,
                layer: int | jax.Array | None = None) -> jax.Array | QuantPages:
    """Scatters one layer's chunk keys or values into its pages; slots of -1 are dropped.

    int8 pages (`QuantPages`) get the values quantised per token and KV head, codes and scales scattered alike.

    Args:
        pages: `[N, P, G, d]` one layer's cache, or with `layer` every layer's `[L, N, P, G, d]`.
        write_slots: `[B, T]` flat slot indices from `reserve`.
        values: `[B, T, G, d]`.
        layer: int32 scalar: the layer of the stack written (one scatter into the stack, in place inside a loop
            that carries it).
    """
    N, P, G, d = pages.shape[-4:]
    slots = write_slots.reshape(-1)
    page = jnp.where(slots >= 0, slots // P, N)  # out of range: dropped
    # Indexed in the pages' own shape: a reshaped view of a stack would give XLA two shapes of one buffer to keep apart.
    at = (page, slots % P) if layer is None else (layer, page, slots % P)
    if isinstance(pages, QuantPages):
        q, scale = quant_kv.quantize(values.reshape(-1, G, d))
        return QuantPages(pages.values.at[at].set(q, mode="drop"), pages.scale.at[at].set(scale, mode="drop"),
                          pages.dtype_name)
    return pages.at[at].set(values.reshape(-1, G, d).astype(pages.dtype), mode="drop")


def append(kv: PagedKV, k_new: jax.Array, v_new: jax.Array, token_valid: jax.Array,
           meta: SlotMeta) -> tuple[PagedKV, jax.Array]:
    """Appends a chunk's keys and values of every layer (`[L, B, T, G, d]`) to the sequences' pages.

    Returns `(kv, write_slots [B, T])`; see `reserve` for slot assignment and exhaustion.
    """
    kv, slots, _ = reserve(kv, token_valid, meta)
    k = jax.vmap(write_layer, in_axes=(0, None, 0))(kv.k, slots, k_new)
    v = jax.vmap(write_layer, in_axes=(0, None, 0))(kv.v, slots, v_new)
    return kv.replace(k=k, v=v), slots


def listed_first(member: jax.Array, values: jax.Array, none: int) -> tuple[jax.Array, jax.Array]:
    """`(list [..., K], count)`: `values [..., K]` of the entries where `member [K]` holds, first and in order,
    then `none` (one scatter for all leading rows)."""
    at = jnp.where(member, jnp.cumsum(member) - 1, member.size)
    listed = jnp.full(values.shape, none, jnp.int32).at[..., at].set(values.astype(jnp.int32), mode="drop")
    return listed, jnp.sum(member).astype(jnp.int32)


def copy_rows(arrays: tuple[Any, ...], src: jax.Array, dst: jax.Array, count: jax.Array, *, chunk: int = 256,
              transform: Callable[[jax.Array, jax.Array | None], jax.Array] | None = None,
              extra: jax.Array | None = None) -> tuple[Any, ...]:
    """Copies rows `src[:count]` to `dst[:count]` of every `[L, R, ...]` array (axis 1 is the row), in place.

    The list is walked `chunk` entries a step by a loop with `ceil(count / chunk)` steps, so the cost follows the
    rows copied, not the list's capacity. An entry whose `dst` is out of range (`R`) writes nothing, wherever it is;
    entries past `count` are not visited, but must be such entries when they share a visited step.
    `transform(rows [L, chunk, ...], extra [chunk, ...])` may rewrite each step's rows between the read and the write,
    given the step's entries of the per-entry array `extra [K, ...]`. Each step reads before it writes; the steps
    together equal one all-at-once copy when no destination is the source of a later entry. Inside the loop the
    scatter updates its buffer in place, where as straight-line code in a `lax.cond` branch XLA:GPU may copy the
    whole array. int8 pages (`QuantPages`) move codes and scales as they are; with a `transform` their rows are
    dequantised, transformed and requantised.
    """
    R = arrays[0].shape[1]
    pad = -src.shape[0] % chunk
    src_p = jnp.pad(jnp.clip(src, 0, R - 1), (0, pad))
    dst_p = jnp.pad(dst, (0, pad), constant_values=R)
    extra_p = None if extra is None else jnp.pad(extra, [(0, pad)] + [(0, 0)] * (extra.ndim - 1))

    def step(i, rows):
        take_at = jax.lax.dynamic_slice_in_dim(src_p, i * chunk, chunk)
        put_at = jax.lax.dynamic_slice_in_dim(dst_p, i * chunk, chunk)
        step_extra = None if extra_p is None else jax.lax.dynamic_slice_in_dim(extra_p, i * chunk, chunk)
        out = []
        for x in rows:
            got = quant_kv.take_rows(x, take_at)
            if transform is not None:
                got = transform(got.dense(jnp.float32) if isinstance(got, QuantPages) else got, step_extra)
            out.append(quant_kv.set_rows(x, put_at, got))
        return tuple(out)

    return jax.lax.fori_loop(0, (count + chunk - 1) // chunk, step, tuple(arrays))


def release_pages(kv: PagedKV, pages: jax.Array, *, holding_live: bool = True) -> PagedKV:
    """Drops one reference to each listed page (`[K]` ids, -1 entries ignored); a page whose last reference goes
    returns to the pool: pushed on the free stack once, class FREE, slots invalid.

    A page shared by several rows (`shares > 0`) stays while a reference is left: it loses one per occurrence in the
    list. Without sharing every listed page is freed, pushed in list order. The page table is not touched; callers
    remove the entries they release. `holding_live=False` promises that the pages hold no live slot (so there is
    nothing to invalidate, and one scatter less).
    """
    pages = pages.astype(jnp.int32)
    N = kv.num_pages
    ok = pages >= 0
    target = jnp.where(ok, pages, N)
    dropped = jnp.zeros((N,), jnp.int32).at[target].add(1, mode="drop")  # references dropped per page
    left = kv.shares + 1 - dropped
    gone = (dropped > 0) & (left <= 0)  # [N] pages freed now
    idx = jnp.arange(pages.shape[0], dtype=jnp.int32)
    first = jnp.full((N,), pages.shape[0], jnp.int32).at[target].min(idx, mode="drop")
    at = jnp.clip(pages, 0, N - 1)
    push = ok & gone[at] & (first[at] == idx)  # each freed page once, at its first listing
    rank = jnp.cumsum(push) - 1
    dst = jnp.where(push, kv.num_free + rank, N)
    free_stack = kv.free_stack.at[dst].set(pages, mode="drop")
    freed = jnp.where(push, pages, N)
    return kv.replace(
        free_stack=free_stack,
        num_free=kv.num_free + jnp.sum(push).astype(jnp.int32),
        page_class=kv.page_class.at[freed].set(PageClass.FREE, mode="drop"),
        valid=kv.valid.at[freed].set(False, mode="drop") if holding_live else kv.valid,
        shares=jnp.where(dropped > 0, jnp.maximum(left - 1, 0), kv.shares),
    )
