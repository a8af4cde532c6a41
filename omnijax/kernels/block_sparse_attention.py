"""Block-sparse flash attention over a paged KV cache (prefill chunks and decode).

`block_sparse_attention(q, k_pages, v_pages, page_table, slot_valid, slot_order, q_order)` computes, for every query
token of a chunk, softmax attention over the key slots it may see:

* the slot's page is listed in the query's sequence's page table (`page_table[b]`, -1 = no page),
* the slot is live (`slot_valid`),
* the slot was written no later than the query (`slot_order <= q_order`): causal masking by write order, which
  survives position re-indexing and holes left by eviction.

A query that sees no key returns zeros. Dead slots may hold anything, NaN included; they never reach the output.

Layout: `q [B, T, H, d]`, `k_pages`/`v_pages [N, P, G, d]` (N physical pages of P slots, G kv heads, H = G * R),
`page_table [B, M]` int32, `slot_valid [N, P]` bool, `slot_order [N, P]` int32, `q_order [B, T]` int32. With
`layer=` (an int32 scalar, traced or not), `k_pages`/`v_pages` are every layer's stack `[L, N, P, G, d]` and the call
reads layer `layer` only: a model's layer loop hands the kernel the whole cache it carries, so no layer is sliced out
(XLA:GPU copies a dynamic slice taken in a loop) and the cache can be updated in place.

The kernel's grid is (batch, kv head, query block). The R query heads that share a kv head are processed together:
query row `t * R + r` of kv head g is token t, query head g * R + r, so one block of rows mixes heads and tokens and
every key page is loaded once per block. A program gathers its rows straight from `q [B, T, H, d]` and scatters its
output rows into `[B, T, H, d]` (rows past the chunk masked): no transposes or padding around the call.

Inside, the kernel loops (`lax.fori_loop` with a dynamic trip count) over the sequence's ACTIVE pages only: a compact
per-sequence list of pages that hold at least one live slot, in page-table order, computed outside the kernel by
`active_pages`. Empty pages and -1 entries cost nothing. Within a page, slots are masked by liveness and
write order. Softmax is online (flash) with float32 accumulators.

With `num_splits > 1` the grid gains a fourth axis: split s of a sequence takes its share of the active list
(ceil(count / num_splits) pages each, the last ones possibly none) and writes an unnormalised partial output with its
row maximum and softmax denominator in float32; the partials are merged outside the kernel (split-K, as in flash
decoding). Decode has one query token, so (batch, kv head, query block) alone gives only B * G programs.

Slot liveness and order travel into the kernel as one int32 key per slot (`slot_order` where live, INT32_MAX where
dead), so `q_order` must be below INT32_MAX. The active page lists and the slot keys together are a `PageIndex`
(`page_index`); a caller that attends to the same cache many times (every layer of a model on one chunk) computes it
once and passes it as `index=`, so a call is left with the kernel alone (and, with splits, the merge).

`dense_attention` (module `dense_attention`) is the dense oracle of this masking (on keys already laid out
`[B, S, G, d]`, with `gather_pages` to lay out a paged cache); `block_sparse_attention_reference` is the two
together, and `omnijax.kv.attention`'s `impl="reference"` and the tests use the same function rather than copies.

int8 pages: with `k_scales=`/`v_scales=` (float32 `[N, P, G]`, or `[L, N, P, G]` beside stacks), the pages are int8
codes with one scale per token and kv head (`omnijax.kv.quant_kv`: value = code * scale). The kernel loads a page's
codes and `[P]` scales and dequantises them in float32, cast to `q.dtype` (`dequantize_pages`, as the reference does),
so only int8 codes and 4 bytes per token and kv head are read from memory.

On GPU the kernel lowers to Triton (`interpret=False`); on CPU run it with `interpret=True` under `jax.jit`. Triton
wants power-of-two block shapes, and its matrix units want `block_q`, the page size and head_dim of at least 16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.typing import DTypeLike

from omnijax.kernels.dense_attention import dense_attention, gather_pages

DEAD_KEY = jnp.iinfo(jnp.int32).max  # key of a dead slot: never <= a query's order
PAD_ORDER = jnp.iinfo(jnp.int32).min  # order of a padding query row: sees nothing
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def validate_shapes(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    slot_valid: jax.Array, slot_order: jax.Array, q_order: jax.Array,
                    layer: int | jax.Array | None = None) -> None:
    """Shape checks every paged-attention implementation needs (static, so free under jit).

    With `layer` (a scalar), `k_pages`/`v_pages` are layer stacks `[L, N, P, G, d]`, else one layer's `[N, P, G, d]`.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, d], got shape {q.shape}")
    want = "[N, P, G, d]" if layer is None else "[L, N, P, G, d] (layer= given)"
    if k_pages.ndim != (4 if layer is None else 5) or k_pages.shape != v_pages.shape:
        raise ValueError(f"k/v pages must both be {want}, got {k_pages.shape} and {v_pages.shape}")
    if layer is not None and (jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)} of shape {jnp.shape(layer)}")
    B, T, H, d = q.shape
    N, P, G, dk = k_pages.shape[-4:]
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, keys have {dk}")
    if G == 0 or H % G:
        raise ValueError(f"query heads {H} not a multiple of kv heads {G}")
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table must be [B={B}, M], got {page_table.shape}")
    if q_order.shape != (B, T):
        raise ValueError(f"q_order must be [B, T] = {(B, T)}, got {q_order.shape}")
    if slot_valid.shape != (N, P) or slot_order.shape != (N, P):
        raise ValueError(f"slot metadata must be [N, P] = {(N, P)}, got {slot_valid.shape} and {slot_order.shape}")


def _validate(q, k_pages, v_pages, page_table, slot_valid, slot_order, q_order, *, layer=None, block_q=None,
              num_splits=1, index=None, k_scales=None, v_scales=None) -> None:
    """Static checks shared by the kernel and the reference: shapes, then dtypes and power-of-two sizes."""
    validate_shapes(q, k_pages, v_pages, page_table, slot_valid, slot_order, q_order, layer)
    if index is not None:
        validate_index(index, page_table, slot_valid)
    P, d = k_pages.shape[-3], q.shape[3]
    if not _is_pow2(P):
        raise ValueError(f"page size must be a power of two, got {P}")
    if not _is_pow2(d):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if block_q is not None and not _is_pow2(block_q):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if jnp.dtype(q.dtype) not in _DTYPES:
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales go together (int8 pages), got only "
                         f"{'k_scales' if v_scales is None else 'v_scales'}")
    if k_scales is not None:
        _validate_scales(k_pages, v_pages, k_scales, v_scales)
    else:
        for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
            if x.dtype == jnp.int8:
                raise ValueError(f"{name} is int8: pass its per-token scales as k_scales= and v_scales=")
            if jnp.dtype(x.dtype) not in _DTYPES:
                raise ValueError(f"{name} must be float32 or bfloat16 (or int8 with scales), got {x.dtype}")
        if not (q.dtype == k_pages.dtype == v_pages.dtype):
            raise ValueError(f"q, k_pages, v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, "
                             f"{v_pages.dtype}")
    if slot_valid.dtype != jnp.bool_:
        raise ValueError(f"slot_valid must be bool, got {slot_valid.dtype}")
    for name, x in (("page_table", page_table), ("slot_order", slot_order), ("q_order", q_order)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


def _validate_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """int8 pages: codes int8, scales float32 of the pages' shape without the head dim."""
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.dtype != jnp.int8:
            raise ValueError(f"{name} must be int8 codes when scales are given, got {x.dtype}")
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if x.shape != k_pages.shape[:-1] or x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 {tuple(k_pages.shape[:-1])} (the pages' shape without the head "
                             f"dim), got {x.dtype} {tuple(x.shape)}")


def dequantize_pages(codes: jax.Array, scales: jax.Array, dtype: DTypeLike) -> jax.Array:
    """int8 `codes [..., d]` times float32 `scales [...]`, in float32, cast to `dtype`: what the kernel attends to
    (`omnijax.kv.quant_kv.dequantize` computes the same)."""
    return (codes.astype(jnp.float32) * scales[..., None].astype(jnp.float32)).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageIndex:
    """What every attention call over one cache state derives from its page table and slot metadata.

    Attributes:
        ids: `[B, M]` int32 active pages of each sequence in page-table order, padded with page 0 (`active_pages`).
        count: `[B]` int32 active pages per sequence.
        slot_key: `[N, P]` int32 `slot_order` of live slots, INT32_MAX for dead ones (visible iff <= a query's order).
    """

    ids: jax.Array
    count: jax.Array
    slot_key: jax.Array


def page_index(page_table: jax.Array, slot_valid: jax.Array, slot_order: jax.Array) -> PageIndex:
    """The `PageIndex` of a cache state: compute it once per chunk and pass it to every layer's attention."""
    ids, count = active_pages(page_table, slot_valid)
    return PageIndex(ids=ids, count=count, slot_key=jnp.where(slot_valid, slot_order, DEAD_KEY).astype(jnp.int32))


def validate_index(index: PageIndex, page_table: jax.Array, slot_valid: jax.Array) -> None:
    """Shape and dtype checks of a precomputed `PageIndex` against the cache it claims to index."""
    B, M = page_table.shape
    want = {"ids": (B, M), "count": (B,), "slot_key": slot_valid.shape}
    for name, shape in want.items():
        x = getattr(index, name)
        if x.shape != shape or x.dtype != jnp.int32:
            raise ValueError(f"index.{name} must be int32 {shape}, got {x.dtype} {x.shape}")


def active_pages(page_table: jax.Array, slot_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compact list of each sequence's pages that hold at least one live slot.

    Returns `(ids [B, M] int32, count [B] int32)`: `ids[b, :count[b]]` are the active pages of sequence b in
    page-table order; the tail is padded with page 0 (never read by the kernel's loop).
    """
    B, M = page_table.shape
    N = slot_valid.shape[0]
    has_page = page_table >= 0
    pages = jnp.clip(page_table, 0, N - 1)
    active = has_page & jnp.any(slot_valid, axis=1)[pages]  # [B, M]
    pos = jnp.cumsum(active.astype(jnp.int32), axis=1) - 1
    dest = jnp.where(active, pos, M)  # inactive entries scatter out of bounds and are dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, M))
    ids = jnp.zeros((B, M), jnp.int32).at[rows, dest].set(pages.astype(jnp.int32), mode="drop")
    count = jnp.sum(active, axis=1, dtype=jnp.int32)
    return ids, count


def _attend_pages(ids_ref, b, start, stop, q, qo, layer, k_ref, v_ref, key_ref, scale: float, ks_ref=None,
                  vs_ref=None):
    """Online softmax of query rows `q [block_q, d]` over active pages `ids_ref[b, start:stop]` of layer `layer`.

    With `ks_ref`/`vs_ref` (`[L, N, P]` float32 scales of this kv head), `k_ref`/`v_ref` hold int8 codes, dequantised
    page by page (`dequantize_pages`, to `q.dtype`).

    Returns float32 `(acc [block_q, d], m [block_q], l [block_q])`: the unnormalised output, the running row maximum
    (-inf for a row that saw nothing) and the softmax denominator.
    """
    block_q, d = q.shape
    exact = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32 for float32 inputs

    def body(i, carry):
        acc, m_prev, l_prev = carry
        page = ids_ref[b, i]
        key = key_ref[page, :]  # [P]
        live = key != DEAD_KEY
        k = k_ref[layer, page, :, :]  # [P, d]
        v = v_ref[layer, page, :, :]
        if ks_ref is not None:  # int8 codes: dequantised here, one float32 scale per slot
            k = dequantize_pages(k, ks_ref[layer, page, :], q.dtype)
            v = dequantize_pages(v, vs_ref[layer, page, :], q.dtype)
        v = jnp.where(live[:, None], v, jnp.zeros_like(v))  # dead slots may hold NaN
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=exact,
                            preferred_element_type=jnp.float32) * scale  # [block_q, P]
        visible = key[None, :] <= qo[:, None]
        s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet
        p = jnp.where(visible, jnp.exp(s - m_safe[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_safe)
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=exact,
                             preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_next, l_next

    init = (jnp.zeros((block_q, d), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    return lax.fori_loop(start, stop, body, init)


def _program_inputs(layer_ref, qo_ref, q_ref, k_ref, *, block_q: int, heads_per_kv: int):
    """What a (batch b, kv head g, query block i) program derives from its ids and whole-array inputs.

    Returns `(layer, q [block_q, d], orders [block_q], store_at)`: the layer clamped into the stack (as jnp's dynamic
    indexing and the reference clamp); this block's query rows, gathered straight from `q [T, H, d]` (row
    t * R + r is token t, query head g * R + r); each row's write order (rows past the chunk's T * R get an order
    that sees nothing); and the index arrays (token `[block_q, 1]`, head `[block_q, 1]`, column `[1, d]`) of the
    rows' places in a `[T, H, d]` output, whose token index is T or more for rows past the chunk: `_store_rows` drops
    those. Gathering and scattering rows in the kernel spares the two XLA transposes that would otherwise lay
    queries and outputs out around every call.
    """
    layer = jnp.clip(layer_ref[0], 0, k_ref.shape[0] - 1)
    T, _, d = q_ref.shape
    rows = pl.program_id(2) * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    token = rows // heads_per_kv
    head = pl.program_id(1) * heads_per_kv + rows % heads_per_kv
    kept = jnp.minimum(token, T - 1)  # a row past the chunk reads the last token and sees nothing
    col = lax.broadcasted_iota(jnp.int32, (1, d), 1)
    q = q_ref[kept[:, None], head[:, None], col]
    orders = jnp.where(token < T, qo_ref[pl.program_id(0), kept], PAD_ORDER)
    return layer, q, orders, (token[:, None], head[:, None], col)


def _store_rows(o_ref, store_at, value) -> None:
    """Writes `value [block_q, d]` (or `[block_q]` into a `[T, H]` ref) to the rows' places; rows past the chunk are
    masked on the GPU and, their token index being out of range, dropped by the interpreter's scatter."""
    token, head, col = store_at
    index = (token, head, col) if value.ndim == 2 else (token[:, 0], head[:, 0])
    plgpu.store(o_ref.at[index], value.astype(o_ref.dtype), mask=index[0] < o_ref.shape[0])


def _kernel(layer_ref, ids_ref, count_ref, qo_ref, q_ref, k_ref, v_ref, key_ref, *refs, scale: float,
            heads_per_kv: int, block_q: int, quantized: bool):
    """One (batch, kv head, query block) program over all of the sequence's active pages.

    layer_ref [1]: the layer to read. ids_ref [B, M], count_ref [B]: active page lists (whole arrays).
    qo_ref [B, T]: each query token's write order (whole array). q_ref [T, H, d]: this sequence's queries.
    k_ref, v_ref [L, N, P, d]: this kv head's pages of every layer. key_ref [N, P]: slot keys. `refs`: with
    `quantized`, ks_ref, vs_ref [L, N, P] (this kv head's scales) first; then o_ref [T, H, d]: this sequence's
    output, of which the program writes its rows.
    """
    ks_ref, vs_ref, o_ref = refs if quantized else (None, None, *refs)
    b = pl.program_id(0)
    layer, q, qo, store_at = _program_inputs(layer_ref, qo_ref, q_ref, k_ref, block_q=block_q,
                                             heads_per_kv=heads_per_kv)
    acc, _, l = _attend_pages(ids_ref, b, 0, count_ref[b], q, qo, layer, k_ref, v_ref, key_ref, scale, ks_ref,
                              vs_ref)
    _store_rows(o_ref, store_at, acc / jnp.where(l > 0, l, 1.0)[:, None])  # a row that saw nothing stays zero


def _split_kernel(layer_ref, ids_ref, count_ref, qo_ref, q_ref, k_ref, v_ref, key_ref, *refs, scale: float,
                  heads_per_kv: int, block_q: int, num_splits: int, quantized: bool):
    """One (batch, kv head, query block, split) program over split s of the active pages (split-K).

    Split s takes pages [s * c, min((s + 1) * c, count)) of the active list, c = ceil(count / num_splits), and
    writes its rows' unnormalised partial into `acc_ref [T, H, d]`, their row maximum into `m_ref` and their
    denominator into `l_ref [T, H]` (float32, split s of sequence b); `_merge_splits` combines them. With
    `quantized`, `refs` start with the scales, as in `_kernel`.
    """
    ks_ref, vs_ref, acc_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    b, split = pl.program_id(0), pl.program_id(3)
    layer, q, qo, store_at = _program_inputs(layer_ref, qo_ref, q_ref, k_ref, block_q=block_q,
                                             heads_per_kv=heads_per_kv)
    count = count_ref[b]
    per = (count + num_splits - 1) // num_splits
    start = jnp.minimum(split * per, count)
    acc, m, l = _attend_pages(ids_ref, b, start, jnp.minimum(start + per, count), q, qo, layer, k_ref, v_ref,
                              key_ref, scale, ks_ref, vs_ref)
    _store_rows(acc_ref, store_at, acc)
    _store_rows(m_ref, store_at, m)
    _store_rows(l_ref, store_at, l)


def _merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Combines split partials `acc [B, S, T, H, d]`, `m`, `l [B, S, T, H]` into the normalised `[B, T, H, d]`."""
    m_max = jnp.max(m, axis=1, keepdims=True)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)  # rows no split saw
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_max), 0.0)  # [B, S, T, H]
    total = jnp.sum(w * l, axis=1)
    out = jnp.sum(w[..., None] * acc, axis=1)
    return out / jnp.where(total > 0, total, 1.0)[..., None]  # a row that saw nothing stays zero


@functools.partial(jax.jit, static_argnames=("block_q", "num_splits", "interpret", "num_warps", "num_stages"))
def block_sparse_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           slot_valid: jax.Array, slot_order: jax.Array, q_order: jax.Array, *,
                           layer: int | jax.Array | None = None,
                           index: PageIndex | None = None, block_q: int = 16, num_splits: int = 1,
                           interpret: bool = False, num_warps: int = 4, num_stages: int = 2,
                           k_scales: jax.Array | None = None, v_scales: jax.Array | None = None) -> jax.Array:
    """Block-sparse paged flash attention. Returns `[B, T, H, d]` in `q.dtype` (see the module docstring).

    `k_scales`/`v_scales` (float32, the pages' shape without `d`): the pages are int8 codes with one scale per token
    and kv head, dequantised in the kernel to `q.dtype`.

    `layer` (int32 scalar) reads that layer of `[L, N, P, G, d]` stacks; None takes `[N, P, G, d]` pages. `index` is
    `page_index(page_table, slot_valid, slot_order)` when the caller computed it once for many calls (every layer of
    a chunk); None computes it here. `num_splits > 1` also splits each sequence's active pages over
    that many programs (split-K, for decode and short chunks, where (batch, kv head, query block) alone gives the GPU
    too few programs) and merges their partial softmax results outside the kernel.
    """
    _validate(q, k_pages, v_pages, page_table, slot_valid, slot_order, q_order, layer=layer, block_q=block_q,
              num_splits=num_splits, index=index, k_scales=k_scales, v_scales=v_scales)
    quantized = k_scales is not None
    scales = () if k_scales is None or v_scales is None else (k_scales, v_scales)
    if layer is None:  # one layer: a stack of one (a free reshape)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        scales = tuple(x[None] for x in scales)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))  # clamped into the stack by the kernel
    B, T, H, d = q.shape
    L, N, P, G, _ = k_pages.shape
    R = H // G
    if index is None:
        index = page_index(page_table, slot_valid, slot_order)
    ids, count, key = index.ids, index.count, index.slot_key
    M = ids.shape[1]

    # Query rows of kv head g: row t * R + r is token t, query head g * R + r, gathered from q in the kernel.
    grid = (B, G, pl.cdiv(T * R, block_q))
    in_specs = [
        pl.BlockSpec((1,), lambda b, g, i, *_: (0,)),  # the layer to read
        pl.BlockSpec((B, M), lambda b, g, i, *_: (0, 0)),  # active page ids
        pl.BlockSpec((B,), lambda b, g, i, *_: (0,)),  # active page counts
        pl.BlockSpec((B, T), lambda b, g, i, *_: (0, 0)),  # query token orders (rows derive theirs)
        pl.BlockSpec((None, T, H, d), lambda b, g, i, *_: (b, 0, 0, 0)),  # the sequence's queries
        pl.BlockSpec((L, N, P, None, d), lambda b, g, i, *_: (0, 0, 0, g, 0)),  # keys of kv head g, every layer
        pl.BlockSpec((L, N, P, None, d), lambda b, g, i, *_: (0, 0, 0, g, 0)),  # values of kv head g
        pl.BlockSpec((N, P), lambda b, g, i, *_: (0, 0)),  # slot keys
    ] + [pl.BlockSpec((L, N, P, None), lambda b, g, i, *_: (0, 0, 0, g))] * len(scales)  # int8: kv head g's scales
    params = dict(interpret=interpret, name="block_sparse_attention",
                  compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    kernel_args = dict(scale=float(d) ** -0.5, heads_per_kv=R, block_q=block_q, quantized=quantized)
    if num_splits == 1:
        return pl.pallas_call(
            functools.partial(_kernel, **kernel_args),
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, T, H, d), lambda b, g, i: (b, 0, 0, 0)),  # each program its rows
            out_shape=jax.ShapeDtypeStruct((B, T, H, d), q.dtype),
            **params,
        )(layer, ids, count, q_order, q, k_pages, v_pages, key, *scales)
    acc, m, l = pl.pallas_call(
        functools.partial(_split_kernel, num_splits=num_splits, **kernel_args),
        grid=(*grid, num_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, T, H, d), lambda b, g, i, s: (b, s, 0, 0, 0)),
                   pl.BlockSpec((None, None, T, H), lambda b, g, i, s: (b, s, 0, 0)),
                   pl.BlockSpec((None, None, T, H), lambda b, g, i, s: (b, s, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, num_splits, T, H, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, num_splits, T, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, num_splits, T, H), jnp.float32)],
        **params,
    )(layer, ids, count, q_order, q, k_pages, v_pages, key, *scales)
    return _merge_splits(acc, m, l).astype(q.dtype)


@jax.jit
def block_sparse_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                                     slot_valid: jax.Array, slot_order: jax.Array, q_order: jax.Array, *,
                                     layer: int | jax.Array | None = None, k_scales: jax.Array | None = None,
                                     v_scales: jax.Array | None = None) -> jax.Array:
    """`dense_attention` over every page-table entry of each sequence (`gather_pages`), float32 dots at HIGHEST
    precision: the oracle the kernel is tested against. Returns `[B, T, H, d]` in `q.dtype`.

    With `k_scales`/`v_scales`, the pages are int8 codes: the gathered entries are dequantised (`dequantize_pages`,
    to `q.dtype`) before the same `dense_attention`."""
    _validate(q, k_pages, v_pages, page_table, slot_valid, slot_order, q_order, layer=layer, k_scales=k_scales,
              v_scales=v_scales)
    g = gather_pages(k_pages, v_pages, page_table, slot_valid, slot_order, layer=layer)
    if k_scales is not None and v_scales is not None:
        sg = gather_pages(k_scales[..., None], v_scales[..., None], page_table, slot_valid, slot_order, layer=layer)
        g = g._replace(k=dequantize_pages(g.k, sg.k[..., 0], q.dtype), v=dequantize_pages(g.v, sg.v[..., 0], q.dtype))
    return dense_attention(q, g.k, g.v, g.live, g.order, q_order, precision=lax.Precision.HIGHEST)
