"""Attention over the paged KV cache, with explicit implementations and no silent fallback.

`attend(q, k_pages, v_pages, cache, impl=..., layer=None)`:
    impl="xla" (the default everywhere): visits only each sequence's active pages (pages holding a live slot), in
        page-table order, gathered many pages at a time (`block_pages`: blocks of 256-1,024 slots, chunks of more
        than 256 queries taken 256 rows at a time) with a dynamic trip count and an online softmax, so its cost
        follows active pages on any backend at close to dense-matmul speed.
    impl="pallas": the block-sparse flash-attention kernel of `omnijax.kernels.block_sparse_attention` (Triton on a
        GPU; the same kernel in Pallas interpret mode on CPU, chosen by the default backend).
    impl="reference": `dense_attention` over every page-table entry of each sequence, masked by slot validity and
        write order: the one dense oracle (in `omnijax.kernels.block_sparse_attention`, re-exported here) that the
        other implementations, the kernel's own reference and the tests are checked against. It is the oracle only:
        its cost and memory follow the page table's width (`[H, T, M * P]` scores), not what the table holds, so
        nothing defaults to it; the one thing only it computes is the attention mass of score-based retention
        (H2O, `with_mass=True`).

`attend_contiguous(q, k, v, start)` is the same blocked online softmax over contiguous per-sequence buffers (no page
table): TideKV's layer-major prefill attends each prompt chunk to the prefix with it.

`k_pages`/`v_pages` are one layer's `[N, P, G, d]`, or with `layer=` (an int32 scalar, traced inside a model's layer
loop) every layer's `[L, N, P, G, d]` stack, of which only that layer's pages are read. A model's layer loop carries
the whole stack, writes each layer's new rows in place and attends with `layer=`: slicing a layer out instead would
copy it (XLA:GPU turns a dynamic slice in a loop into a memcpy), and a stack scanned as loop input and output is
rewritten whole on every call, so a step would cost time in proportion to the pool rather than to what it holds.

int8 pages (`omnijax.kv.quant_kv.QuantPages`, a pool made with `kv_dtype="int8"`) are dequantised where they are
read: "xla" dequantises each gathered block of pages inside its loop (codes times per-token, per-head scales, in
the query's dtype), "reference" dequantises the page-table entries it gathers, and "pallas" hands the kernel the
int8 codes with their scales (`k_scales`/`v_scales`), which it dequantises page by page inside the kernel.

A key slot is visible to a query when the slot holds a live token of the query's sequence (`valid`, reached through
the page table) and was written no later than the query (`order <= q_order`), which is causal masking that survives
position re-indexing. A query that sees no key returns zeros.

What "xla" and "pallas" derive from the cache state (each sequence's active page list, one visibility key per slot:
a `PageIndex`) is the same for every layer of a chunk. `index_pages(view)` computes it once; a model indexes its view
before its layer loop, so a layer's attention call does no bookkeeping (on a GPU the layer loop would otherwise
launch those kernels once per layer: XLA:GPU does not hoist them out of the loop). A dead slot's key is INT32_MAX,
so query orders must stay below it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from omnijax.kernels.block_sparse_attention import (
    DEAD_KEY,
    PAD_ORDER,
    PageIndex,
    active_pages,  # noqa: F401 (re-exported: the one definition of active pages every page-skipping impl uses)
    block_sparse_attention,
    page_index,
    validate_index,
    validate_shapes,
)

# One definition of "active pages" for every implementation that skips pages (the kernel module imports jax only).
from omnijax.kernels.dense_attention import dense_attention, gather_pages
from omnijax.kv.paged import PagedKV
from omnijax.kv.quant_kv import QuantPages, dense

IMPLEMENTATIONS = ("reference", "xla", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
    """What a chunk's attention needs from the cache, shared by all layers.

    Attributes:
        write_slots: `[B, T]` int32 flat slot each token is written to (-1: not written).
        page_table: `[B, M]` int32 physical pages in span order, -1 = none.
        slot_valid: `[N, P]` bool live slots (after this chunk's reservation).
        slot_order: `[N, P]` int32 per-sequence write order of each slot.
        q_order: `[B, T]` int32 write order of each query token.
        pages: the `PageIndex` of `page_table`, `slot_valid` and `slot_order` (`index_pages`), or None for every
            attention call to derive it again.
    """

    write_slots: jax.Array
    page_table: jax.Array
    slot_valid: jax.Array
    slot_order: jax.Array
    q_order: jax.Array
    pages: PageIndex | None = None

    @classmethod
    def of(cls, kv: PagedKV, write_slots: jax.Array, q_order: jax.Array) -> "CacheView":
        """The view of a paged cache (`omnijax.kv.PagedKV`: its `page_table`, `valid`, `order`) for tokens written
        to `write_slots` with write orders `q_order`, both `[B, T]` as `omnijax.kv.paged.reserve` returns them."""
        return cls(write_slots=write_slots, page_table=kv.page_table, slot_valid=kv.valid, slot_order=kv.order,
                   q_order=q_order)


def index_pages(view: CacheView) -> CacheView:
    """The view with its `PageIndex` computed (unchanged if it has one): do it once per chunk, outside the layers."""
    if view.pages is not None:
        return view
    return dataclasses.replace(view, pages=page_index(view.page_table, view.slot_valid, view.slot_order))


def validate(q: jax.Array, k_pages: jax.Array | QuantPages, v_pages: jax.Array | QuantPages, cache: CacheView,
             layer: int | jax.Array | None = None) -> None:
    """Shape checks shared by every implementation (static shapes only, so it is free under jit)."""
    validate_shapes(q, k_pages, v_pages, cache.page_table, cache.slot_valid, cache.slot_order, cache.q_order, layer)
    if cache.pages is not None:
        validate_index(cache.pages, cache.page_table, cache.slot_valid)


def _read_pages(pages: jax.Array | QuantPages, layer, ids: jax.Array) -> jax.Array:
    """Pages `ids` of one layer (`pages [N, P, ...]`) or of layer `layer` of a stack (`[L, N, P, ...]`), one gather
    (of codes and scales for int8 pages, dequantised to their compute dtype)."""
    return dense(pages[ids] if layer is None else pages[layer, ids])


def attend_reference(q: jax.Array, k_pages: jax.Array | QuantPages, v_pages: jax.Array | QuantPages,
                     cache: CacheView, *,
                     with_mass: bool = False,
                     layer: int | jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`dense_attention` (the oracle, shared with the kernel's reference and the tests) over every page-table entry
    of each sequence (`gather_pages`). Returns `[B, T, H, d]` in `q.dtype`.

    With `with_mass`, also returns `[N, P]` float32: the attention probability each slot received, summed over the
    chunk's written queries and averaged over heads (the accumulated-attention signal of H2O).
    """
    validate(q, k_pages, v_pages, cache, layer)
    g = gather_pages(k_pages, v_pages, cache.page_table, cache.slot_valid, cache.slot_order, layer=layer)
    if isinstance(k_pages, QuantPages) or isinstance(v_pages, QuantPages):
        g = g._replace(k=dense(g.k), v=dense(g.v))
    if not with_mass:
        return dense_attention(q, g.k, g.v, g.live, g.order, cache.q_order)
    out, probs = dense_attention(q, g.k, g.v, g.live, g.order, cache.q_order, return_probs=True)  # [B, H, T, S]
    N, P = cache.slot_valid.shape
    written = (cache.write_slots >= 0)[:, None, :, None]  # padding queries do not vote
    per_slot = jnp.sum(jnp.where(written, probs.astype(jnp.float32), 0.0), axis=(1, 2)) / q.shape[2]  # [B, S]
    target = jnp.where(g.live, g.slot, N * P).reshape(-1)
    mass = jnp.zeros((N * P,), jnp.float32).at[target].add(per_slot.reshape(-1), mode="drop")
    return out, mass.reshape(N, P)


# Block size of impl="xla". One step holds a score tile of [H, T, K] float32 (T queries over K key slots) and the
# block's gathered keys and values, [K, G, d] each. Measured on CPU (2 cores; 8 heads with head_dim 32 and 128, and
# Qwen2.5-Omni-7B's 28 / 4 heads of 128; T = 1, 124, 256; 40 to 514 active pages): steps run fastest while the score
# tile stays within about 2**20 scores and one block's keys within about 2**17 values (512 KiB in float32); larger
# blocks spill out of cache, smaller ones pay the loop's per-step overhead (pages left over after the whole blocks
# are taken one at a time, so no block is padded).
SCORE_TILE = 1 << 20
KV_TILE = 1 << 17
MAX_BLOCK_SLOTS = 1024
MAX_QUERY_ROWS = 256  # longer chunks are taken this many query rows at a time


def _pow2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block_pages(num_queries: int, num_heads: int, page_size: int, table_pages: int, kv_width: int = 1) -> int:
    """Pages gathered per online-softmax step of `attend_xla` (a power of two, static).

    K = block_pages * page_size slots: the largest power of two with `num_heads * num_queries * K <= SCORE_TILE`
    and `kv_width * K <= KV_TILE` (`kv_width` = kv heads * head_dim), at most `MAX_BLOCK_SLOTS`, at least one page,
    and no more pages than the page table has entries (rounded up to a power of two).
    """
    slots = min(SCORE_TILE // max(1, num_heads * num_queries), KV_TILE // max(1, kv_width), MAX_BLOCK_SLOTS)
    pages = max(1, _pow2_floor(max(1, slots)) // page_size)
    return min(pages, _pow2_ceil(table_pages))


def attend_xla(q: jax.Array, k_pages: jax.Array | QuantPages, v_pages: jax.Array | QuantPages, cache: CacheView, *,
               layer: int | jax.Array | None = None,
               pages_per_block: int | None = None) -> jax.Array:
    """Online-softmax attention over active pages only, gathered in blocks of many pages.

    Each sequence's active page list (`PageIndex.ids[b, :count[b]]`, page-table order) is cut into blocks of
    `pages_per_block` pages (default `block_pages(...)`); a `fori_loop` with a dynamic trip count of
    count // pages_per_block gathers one block's keys and values (`[K, G, d]`, K = pages * page size), masks dead
    slots and slots written after the query, and folds the block into running float32 max / denominator / output
    accumulators with one score and one value matmul per KV head (`[R*T, d] x [d, K]`); a second loop takes the
    remaining count % pages_per_block pages one at a time. So cost follows the active pages exactly, with no
    padding. (One loop over padded blocks, with the entries past the count masked, compiles a decode step in half
    the time but ran a 256-query chunk over 132 active pages 20-50 % slower on this CPU.) A chunk of more than
    `MAX_QUERY_ROWS` queries is taken that many rows at a time (`lax.map`), which bounds the score tile.
    """
    validate(q, k_pages, v_pages, cache, layer)
    B, T, H, d = q.shape
    N, P, G, _ = k_pages.shape[-4:]
    R = H // G
    index = index_pages(cache).pages  # index.ids[b, :index.count[b]] are read
    M = index.ids.shape[1]
    bq = min(T, MAX_QUERY_ROWS)
    nq = -(-T // bq)
    bp = pages_per_block or block_pages(bq, H, P, M, G * d)
    if bp < 1 or bp & (bp - 1):
        raise ValueError(f"pages_per_block must be a power of two, got {bp}")
    ids = jnp.pad(index.ids, ((0, 0), (0, max(0, bp - M))))  # a block may be wider than the table
    q = jnp.pad(q, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0)))
    q_order = jnp.pad(cache.q_order, ((0, 0), (0, nq * bq - T)), constant_values=PAD_ORDER)  # padding sees nothing

    def rows(q_rows, q_order_rows, ids_b, count_b):  # [bq, H, d], [bq]
        qg = q_rows.reshape(bq, G, R, d).transpose(1, 2, 0, 3).reshape(G, R * bq, d)  # row r * bq + t
        qg = qg * jnp.asarray(d ** -0.5, q.dtype)  # the score scale, once per query instead of once per score

        def fold(start, carry, size: int):  # list entries [start, start + size) of the active pages
            pages = jax.lax.dynamic_slice_in_dim(ids_b, start, size)  # [size]
            key = index.slot_key[pages].reshape(size * P)  # write order where live, DEAD_KEY where dead
            live = (key != DEAD_KEY)[:, None, None]
            k = _read_pages(k_pages, layer, pages).reshape(size * P, G, d)  # dead slots' scores are replaced below
            v = jnp.where(live, _read_pages(v_pages, layer, pages).reshape(size * P, G, d), 0)  # dead: even NaN
            ok = jnp.tile(key[None, :] <= q_order_rows[:, None], (R, 1))  # [R*bq, size*P]
            s = jnp.einsum("gnd,kgd->gnk", qg, k, preferred_element_type=jnp.float32)
            return online_softmax_step(carry, jnp.where(ok, s, -jnp.inf), lambda p: jnp.einsum(
                "gnk,kgd->gnd", p.astype(q.dtype), v, preferred_element_type=jnp.float32))

        carry = (jnp.full((G, R * bq), -jnp.inf, jnp.float32), jnp.zeros((G, R * bq), jnp.float32),
                 jnp.zeros((G, R * bq, d), jnp.float32))
        whole = count_b // bp  # whole blocks of bp pages, then the remaining pages one at a time
        carry = jax.lax.fori_loop(0, whole, lambda i, c: fold(i * bp, c, bp), carry)
        if bp > 1:
            carry = jax.lax.fori_loop(whole * bp, count_b, lambda j, c: fold(j, c, 1), carry)
        out = online_softmax_result(carry)
        return out.reshape(G, R, bq, d).transpose(2, 0, 1, 3).reshape(bq, H, d)

    def one(q_b, q_order_b, ids_b, count_b):  # one sequence: [nq * bq, H, d]
        if nq == 1:
            return rows(q_b, q_order_b, ids_b, count_b)
        out = jax.lax.map(lambda a: rows(a[0], a[1], ids_b, count_b),
                          (q_b.reshape(nq, bq, H, d), q_order_b.reshape(nq, bq)))
        return out.reshape(nq * bq, H, d)

    return jax.vmap(one)(q, q_order, ids, index.count)[:, :T].astype(q.dtype)


def online_softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array,
                        pv: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds one key block into the running float32 `(m, l, acc)` of an online softmax (flash attention).

    Args:
        carry: `(m [..., n], l [..., n], acc [..., n, d])`: row maximum (-inf before any visible key), softmax
            denominator and unnormalised output.
        s: `[..., n, K]` float32 scores of the block, -inf where a key is not visible.
        pv: `p [..., n, K] -> [..., n, d]` float32, the probabilities times the block's values.
    """
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])  # invisible keys score -inf: exactly 0
    scale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    return m_new, l * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv(p)


def online_softmax_result(carry: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """The normalised output of an online softmax's final `(m, l, acc)`; a row that saw no key is zeros."""
    _, l, acc = carry
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def contiguous_blocks(num_queries: int, num_heads: int, num_keys: int) -> tuple[int, int]:
    """`(block_q, block_k)` of `attend_contiguous`: query rows per block (at most 512, a power of two) and key slots
    per block (the `SCORE_TILE` rule for that many rows, between 128 and `MAX_BLOCK_SLOTS`, capped by the largest
    power of two dividing `num_keys` so that blocks tile the buffer exactly). On CPU, 512 x 256 blocks of a 2,048-row
    chunk over 8K keys ran 20 % faster than 256 x 512 and than 128-row blocks (8 heads, head_dim 32)."""
    block_q = min(512, _pow2_ceil(num_queries))
    slots = min(MAX_BLOCK_SLOTS, max(128, _pow2_floor(SCORE_TILE // max(1, num_heads * block_q))))
    return block_q, max(1, min(slots, num_keys & -num_keys))


def attend_contiguous(q: jax.Array, k: jax.Array, v: jax.Array, start: int | jax.Array, *, block_q: int | None = None,
                      block_k: int | None = None) -> jax.Array:
    """Causal attention of a chunk over contiguous per-sequence key buffers, blocked, with no page table.

    Query t of the chunk has absolute index `start + t` and sees keys `j <= start + t` (keys past the chunk are
    never visible, so the buffers may hold anything finite there). Queries are taken `block_q` rows at a time
    (`lax.map`); each row block runs an online softmax in float32 over the key blocks of `block_k` slots it can see:
    first the blocks wholly before its first row, with no mask, then the blocks that cross the diagonal, masked
    (two `fori_loop`s with dynamic trip counts). Default blocks: `contiguous_blocks`.

    Args:
        q: `[B, T, H, d]` the chunk's queries.
        k, v: `[B, S, G, d]` the sequence's keys and values by absolute index (H a multiple of G).
        start: int32 scalar (may be traced), the absolute index of the chunk's first query.

    Returns:
        `[B, T, H, d]` in `q.dtype`.
    """
    B, T, H, d = q.shape
    S, G = k.shape[1], k.shape[2]
    if k.shape != (B, S, G, d) or v.shape != k.shape or G == 0 or H % G:
        raise ValueError(f"k and v must be [B, S, G, d] with H={H} a multiple of G, matching q {q.shape}; got "
                         f"{k.shape} and {v.shape}")
    bq, bk = contiguous_blocks(T, H, S)
    bq, bk = block_q or bq, block_k or bk
    if S % bk or bq & (bq - 1) or bk & (bk - 1):
        raise ValueError(f"block_q {bq} and block_k {bk} must be powers of two, block_k dividing S={S}")
    R, nq = H // G, -(-T // bq)
    q = q * jnp.asarray(d ** -0.5, q.dtype)  # the score scale, once per query instead of once per score
    qb = jnp.pad(q, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0))).reshape(B, nq, bq, G, R, d)
    qb = qb.transpose(1, 0, 3, 4, 2, 5).reshape(nq, B, G, R * bq, d)  # row r * bq + t

    def rows(args):
        i, qg = args  # qg [B, G, R*bq, d]
        first = start + i * bq  # absolute index of the block's first row: keys before it are visible to all rows
        row_index = jnp.tile(first + jnp.arange(bq), R)  # [R*bq]

        def fold(masked: bool):
            def body(j, carry):
                kb = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)  # [B, bk, G, d]
                vb = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
                s = jnp.einsum("bgnd,bkgd->bgnk", qg, kb, preferred_element_type=jnp.float32)
                if masked:
                    s = jnp.where(j * bk + jnp.arange(bk)[None, :] <= row_index[:, None], s, -jnp.inf)
                return online_softmax_step(carry, s, lambda p: jnp.einsum(
                    "bgnk,bkgd->bgnd", p.astype(q.dtype), vb, preferred_element_type=jnp.float32))
            return body

        carry = (jnp.full((B, G, R * bq), -jnp.inf, jnp.float32), jnp.zeros((B, G, R * bq), jnp.float32),
                 jnp.zeros((B, G, R * bq, d), jnp.float32))
        whole = jnp.minimum(first // bk, S // bk)  # key blocks entirely before the first row
        last = jnp.minimum(first + bq, S)  # keys [0, last) can be visible to this row block
        carry = jax.lax.fori_loop(0, whole, fold(False), carry)
        carry = jax.lax.fori_loop(whole, (last + bk - 1) // bk, fold(True), carry)
        return online_softmax_result(carry)

    out = jax.lax.map(rows, (jnp.arange(nq), qb))  # [nq, B, G, R*bq, d]
    out = out.reshape(nq, B, G, R, bq, d).transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * bq, H, d)
    return out[:, :T].astype(q.dtype)


def check_impl(impl: str) -> str:
    """Returns `impl` if it names an attention implementation (`IMPLEMENTATIONS`); refuses anything else."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; available: {IMPLEMENTATIONS}")
    return impl


def attend(q: jax.Array, k_pages: jax.Array | QuantPages, v_pages: jax.Array | QuantPages, cache: CacheView, *,
           impl: str = "xla", with_mass: bool = False,
           layer: int | jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of a chunk's queries `[B, T, H, d]` over the paged cache of one layer.

    `layer` (int32 scalar) reads that layer of `[L, N, P, G, d]` stacks; None takes one layer's `[N, P, G, d]`.
    With `with_mass`, returns `(out, mass [N, P])` (see `attend_reference`).
    """
    if check_impl(impl) == "reference":
        return attend_reference(q, k_pages, v_pages, cache, with_mass=with_mass, layer=layer)
    if with_mass:
        raise ValueError(f"attention mass (score-based retention such as H2O) needs impl='reference', not {impl!r}")
    if impl == "xla":
        return attend_xla(q, k_pages, v_pages, cache, layer=layer)
    validate(q, k_pages, v_pages, cache, layer)  # impl == "pallas"
    scales = {}
    if isinstance(k_pages, QuantPages) != isinstance(v_pages, QuantPages):
        raise ValueError("impl='pallas' needs keys and values both int8 (QuantPages) or both float, got "
                         f"{type(k_pages).__name__} and {type(v_pages).__name__}")
    if isinstance(k_pages, QuantPages) and isinstance(v_pages, QuantPages):  # codes + scales, dequantised in-kernel
        scales = dict(k_scales=k_pages.scale, v_scales=v_pages.scale)
        k_pages, v_pages = k_pages.values, v_pages.values
    return block_sparse_attention(q, k_pages, v_pages, cache.page_table, cache.slot_valid, cache.slot_order,
                                  cache.q_order, layer=layer, index=cache.pages,
                                  interpret=jax.default_backend() == "cpu", **scales)
