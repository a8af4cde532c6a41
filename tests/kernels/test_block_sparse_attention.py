"""Block-sparse paged flash attention: interpret-mode kernel vs the dense reference (`dense_attention`, the oracle of
every attention implementation) vs `jax.nn.dot_product_attention`, the oracle's own semantics, and Triton lowering for
cuda on CPU."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kernels.block_sparse_attention import (
    DEAD_KEY,
    _validate,
    active_pages,
    block_sparse_attention,
    block_sparse_attention_reference,
    dense_attention,
    page_index,
)
from omnijax.kernels.lowering import has_triton_call, lower_for_cuda

# float32: kernel, reference and library attention differ only by summation order.
# bfloat16: inputs are exact in every path, but the kernel and the reference round probabilities to bfloat16 before
# the value product (relative error 2**-9 each) and round the output to bfloat16, so allow about 4 bf16 ulps.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}

N_PAGES, PAGE, M = 12, 16, 5


def make_case(seed, *, T, H, G, d=16, lengths=(37, 22), dtype=jnp.float32):
    """A paged cache for two sequences of different lengths, like the KV manager leaves it.

    Pages come from a random permutation of the pool; each sequence writes its tokens in order (order = position)
    into its pages in page-table order; the last page is partly filled. Eviction leaves random holes and empties one
    whole page of the first sequence (which stays in its page table). Every dead slot holds NaN. The chunk's queries
    are the last T tokens of each sequence.
    """
    rng = np.random.default_rng(seed)
    B = len(lengths)
    perm = rng.permutation(N_PAGES)
    table = np.full((B, M), -1, np.int32)
    valid = np.zeros((N_PAGES, PAGE), bool)
    order = rng.integers(-5, 100, (N_PAGES, PAGE)).astype(np.int32)  # garbage in slots never written
    q_order = np.zeros((B, T), np.int32)
    used = 0
    for b, L in enumerate(lengths):
        n = -(-L // PAGE)
        pages = perm[used:used + n]
        used += n
        table[b, :n] = pages
        for pos in range(L):
            p, s = pages[pos // PAGE], pos % PAGE
            valid[p, s] = True
            order[p, s] = pos
        q_order[b] = np.arange(L - T, L)
        # Holes from eviction among the tokens before the chunk.
        old = [(pages[pos // PAGE], pos % PAGE) for pos in range(L - T)]
        for i in rng.choice(len(old), size=len(old) // 4, replace=False):
            valid[old[i]] = False
    valid[table[0, 1]] = False  # a fully empty page still listed in the page table
    k = rng.standard_normal((N_PAGES, PAGE, G, d)).astype(np.float32)
    v = rng.standard_normal((N_PAGES, PAGE, G, d)).astype(np.float32)
    k[~valid] = np.nan
    v[~valid] = np.nan
    q = rng.standard_normal((B, T, H, d)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(valid), jnp.asarray(order), jnp.asarray(q_order))


# The oracles run compiled (one program per shape; eagerly every primitive is a program of its own).
dense = jax.jit(dense_attention, static_argnames=("precision", "return_probs"))
reference = jax.jit(block_sparse_attention_reference)
library_dot_product_attention = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla"))


def library_attention(q, k_pages, v_pages, page_table, slot_valid, slot_order, q_order):
    """An oracle independent of `dense_attention`: `jax.nn.dot_product_attention` (float32 inputs, HIGHEST precision)
    over each sequence's live keys, picked out of its pages with numpy. The library softmax would spread a query that
    sees no key uniformly over the masked keys, so such queries are set to the documented zeros here."""
    q, k_pages, v_pages = (np.asarray(x, np.float32) for x in (q, k_pages, v_pages))
    page_table, slot_valid, slot_order, q_order = map(np.asarray, (page_table, slot_valid, slot_order, q_order))
    out = np.zeros(q.shape, np.float32)
    for b in range(q.shape[0]):
        pages = page_table[b][page_table[b] >= 0]
        live = slot_valid[pages]  # [n_pages, P]
        keys, vals, orders = k_pages[pages][live], v_pages[pages][live], slot_order[pages][live]  # [n, G, d], [n]
        seen = orders[None, :] <= q_order[b][:, None]  # [T, n]
        if not seen.any():
            continue
        with jax.default_matmul_precision("highest"):
            got = library_dot_product_attention(q[None, b], keys[None], vals[None], mask=seen[None, None])[0]
        out[b] = np.where(seen.any(axis=1)[:, None, None], np.asarray(got), 0.0)
    return out


# The same suite runs the kernel interpreted on CPU and compiled (Triton) on a GPU.
INTERPRET = jax.default_backend() == "cpu"


@functools.partial(jax.jit, static_argnames=("block_q", "num_splits"))
def kernel(*args, block_q=16, num_splits=1):
    return block_sparse_attention(*args, block_q=block_q, num_splits=num_splits, interpret=INTERPRET)


def check(args, *, block_q=16, num_splits=1):
    dtype = jnp.dtype(args[0].dtype)
    tol = TOL[dtype]
    got = kernel(*args, block_q=block_q, num_splits=num_splits)
    ref = reference(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32))), "NaN from dead slots leaked"
    oracle = library_attention(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float32), oracle, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(ref, np.float32), oracle, rtol=tol, atol=tol)
    return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("H,G", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("T", [8, 1], ids=["prefill", "decode"])
def test_kernel_matches_reference_and_library(dtype, H, G, T):
    check(make_case(T * 10 + H, T=T, H=H, G=G, dtype=dtype))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["whole", "split"])
@pytest.mark.parametrize("T", [13, 1], ids=["prefill", "decode"])
def test_seven_query_heads_per_kv_head(T, num_splits):
    # Qwen2.5-Omni's grouping (R = 7, not a power of two): a 16-row block holds parts of up to three tokens, and each
    # row's write order is its token's, derived in the kernel; rows past T * R see nothing.
    check(make_case(70 + T, T=T, H=14, G=2), num_splits=num_splits)


def test_query_blocks_split_rows():
    # block_q smaller than T * R: several query blocks per (batch, kv head), with a partial last block.
    args = make_case(3, T=5, H=4, G=1, lengths=(40, 9))
    check(args, block_q=8)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_queries_that_see_nothing_return_zeros(num_splits):
    q, k, v, table, valid, order, q_order = make_case(4, T=4, H=4, G=2)
    table, q_order = np.array(table), np.array(q_order)
    table[1] = [table[0, 1], -1, -1, -1, -1]  # only the empty page
    q_order[0, 0] = -10  # before every write of sequence 0
    table, q_order = jnp.asarray(table), jnp.asarray(q_order)
    got = check((q, k, v, table, valid, order, q_order), num_splits=num_splits)
    assert np.all(np.asarray(got[1]) == 0) and np.all(np.asarray(got[0, 0]) == 0)


def test_dense_oracle_semantics():
    # The documented contract of the one oracle: GQA head mapping, validity and write-order masks (not key index),
    # NaN/inf in invalid slots never leaking, zeros for a query that sees nothing.
    rng = np.random.default_rng(11)
    B, T, S, G, R, d = 2, 6, 9, 2, 3, 8
    q = rng.standard_normal((B, T, G * R, d)).astype(np.float32)
    k = rng.standard_normal((B, S, G, d)).astype(np.float32)
    v = rng.standard_normal((B, S, G, d)).astype(np.float32)
    valid = rng.random((B, S)) < 0.7
    valid[:, :2] = True
    order = np.stack([rng.permutation(S) for _ in range(B)]).astype(np.int32)  # write order unrelated to index
    q_order = rng.integers(0, S, (B, T)).astype(np.int32)
    q_order[0, 0] = -1  # before every write: sees nothing
    q_order[1, 1] = order[1][valid[1]].min()  # sees exactly one key
    dirty_k = np.where(valid[..., None, None], k, np.nan)
    dirty_v = np.where(valid[..., None, None], v, np.inf)
    out, probs = dense(q, dirty_k, dirty_v, valid, order, q_order, return_probs=True)
    out, probs = np.asarray(out), np.asarray(probs)
    assert out.shape == q.shape and probs.shape == (B, G * R, T, S) and np.all(np.isfinite(out))
    visible = valid[:, None, :] & (order[:, None, :] <= q_order[:, :, None])  # [B, T, S]
    assert np.all(probs[np.broadcast_to(~visible[:, None], probs.shape)] == 0)
    np.testing.assert_allclose(probs.sum(-1), np.broadcast_to(visible.any(-1)[:, None], (B, G * R, T)), atol=1e-6)
    assert np.all(out[0, 0] == 0)
    only = np.flatnonzero(visible[1, 1])
    assert only.size == 1 and np.array_equal(out[1, 1], v[1, only[0]][np.arange(G * R) // R])
    # Grouped-query heads read kv head h // R: the same as multi-head attention over kv heads repeated R times.
    mha = dense(q, np.repeat(dirty_k, R, 2), np.repeat(dirty_v, R, 2), valid, order, q_order)
    np.testing.assert_allclose(np.asarray(mha), out, rtol=1e-6, atol=1e-6)
    # Masking follows write order, not the key axis: shuffling the key slots changes nothing.
    perm = rng.permutation(S)
    shuffled = dense(q, dirty_k[:, perm], dirty_v[:, perm], valid[:, perm], order[:, perm], q_order)
    np.testing.assert_allclose(np.asarray(shuffled), out, rtol=1e-5, atol=1e-6)
    # And the library's attention over the same masks, on the queries that see something.
    with jax.default_matmul_precision("highest"):
        lib = library_dot_product_attention(q, k, v, mask=visible[:, None])
    seen = visible.any(-1)
    np.testing.assert_allclose(out[seen], np.asarray(lib)[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("T", [8, 1], ids=["prefill", "decode"])
def test_split_pages_match_reference(num_splits, T):
    # Split-K: 4 and 1 active pages shared out over num_splits programs (uneven for 3, mostly empty for 8).
    args = make_case(20 + num_splits, T=T, H=4, G=2, lengths=(70, 9))
    got = check(args, num_splits=num_splits)
    # Same pages, other grouping of the online softmax: equal to the unsplit kernel up to summation order.
    np.testing.assert_allclose(np.asarray(got), np.asarray(kernel(*args)), rtol=1e-5, atol=1e-5)


def test_split_pages_bfloat16():
    check(make_case(31, T=1, H=4, G=2, lengths=(70, 9), dtype=jnp.bfloat16), num_splits=4)


def test_active_pages_compacts_in_table_order():
    table = np.array([[5, 2, -1, 7, 0], [-1, -1, -1, -1, -1]], np.int32)
    valid = np.zeros((8, 4), bool)
    valid[5, 1] = valid[7, 3] = valid[0, 0] = True
    ids, count = jax.jit(active_pages)(table, valid)
    assert np.asarray(count).tolist() == [3, 0]
    assert np.asarray(ids)[0, :3].tolist() == [5, 7, 0]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["whole", "split"])
def test_precomputed_index_gives_the_same_output(num_splits):
    args = make_case(41, T=8, H=4, G=2)
    index = jax.jit(page_index)(*args[3:6])
    got = jax.jit(lambda *a, index: block_sparse_attention(*a, index=index, num_splits=num_splits,
                                                           interpret=INTERPRET))(*args, index=index)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel(*args, num_splits=num_splits)))
    valid, order = np.asarray(args[4]), np.asarray(args[5])
    np.testing.assert_array_equal(np.asarray(index.slot_key), np.where(valid, order, DEAD_KEY))


def test_precomputed_index_of_another_shape_is_refused():
    args = make_case(42, T=2, H=4, G=2)
    index = jax.tree.map(np.asarray, jax.jit(page_index)(*args[3:6]))
    for field, bad in (("ids", index.ids[:, :3]), ("count", index.count.astype(np.int16)),
                       ("slot_key", index.slot_key[:4])):
        wrong = dataclasses.replace(index, **{field: bad})
        with pytest.raises(ValueError, match=f"index.{field}"):
            block_sparse_attention(*args, index=wrong, interpret=True)


def stacked(args, layer, num_layers=3, seed=7):
    """The case's K/V as layer `layer` of a `[num_layers, N, P, G, d]` stack whose other layers hold noise."""
    q, k, v = args[:3]
    noise = np.random.default_rng(seed).standard_normal((2, num_layers) + k.shape).astype(np.float32)
    noise[0, layer], noise[1, layer] = np.asarray(k, np.float32), np.asarray(v, np.float32)
    return (q, jnp.asarray(noise[0], k.dtype), jnp.asarray(noise[1], v.dtype)) + tuple(args[3:])


@pytest.mark.parametrize("num_splits", [1, 3], ids=["whole", "split"])
@pytest.mark.parametrize("T", [8, 1], ids=["prefill", "decode"])
def test_layer_of_a_stack_equals_that_layer_alone(T, num_splits):
    # A model's layer loop passes its whole K/V stack and the layer number (traced) instead of slicing a layer.
    args = make_case(50 + T, T=T, H=4, G=2)
    want = np.asarray(kernel(*args, num_splits=num_splits))
    layered = jax.jit(lambda layer, *a: block_sparse_attention(*a, layer=layer, num_splits=num_splits,
                                                               interpret=INTERPRET))
    for layer in (0, 2):
        stack = stacked(args, layer)
        np.testing.assert_array_equal(np.asarray(layered(jnp.int32(layer), *stack)), want)
        ref = reference(*stack, layer=layer)
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(reference(*args)))


def test_layer_stack_validation():
    args = make_case(5, T=2, H=4, G=2)
    with pytest.raises(ValueError, match=r"\[L, N, P, G, d\]"):
        block_sparse_attention(*args, layer=0, interpret=True)  # one layer's pages given as a stack
    with pytest.raises(ValueError, match=r"\[N, P, G, d\]"):
        block_sparse_attention_reference(*stacked(args, 0))  # a stack without its layer
    with pytest.raises(ValueError, match="integer scalar"):
        block_sparse_attention(*stacked(args, 0), layer=jnp.zeros((1,), jnp.int32), interpret=True)


def test_validation_is_shared():
    args = make_case(5, T=2, H=4, G=2)
    q, k, v, table, valid, order, q_order = map(np.asarray, args)  # sliced on the host: no eager programs
    bad = [
        ((q, k[:, :12], v[:, :12], table, valid[:, :12], order[:, :12], q_order), "page size"),
        ((q[..., :12], k[..., :12], v[..., :12], table, valid, order, q_order), "head_dim"),
        ((q.astype(jnp.float16), k, v, table, valid, order, q_order), "float32 or bfloat16"),
        ((q[:, :, :3], k, v, table, valid, order, q_order), "multiple of kv heads"),
        ((q, k, v, table, valid.astype(jnp.int32), order, q_order), "bool"),
    ]
    for bad_args, msg in bad:
        for fn in (_validate, block_sparse_attention, block_sparse_attention_reference):
            with pytest.raises(ValueError, match=msg):
                fn(*bad_args)
    with pytest.raises(ValueError, match="block_q"):
        block_sparse_attention(*args, block_q=24, interpret=True)
    with pytest.raises(ValueError, match="num_splits"):
        block_sparse_attention(*args, num_splits=0, interpret=True)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [8, 1], ids=["prefill", "decode"])
def test_lowers_to_triton_for_cuda(dtype, T, num_splits):
    args = make_case(6, T=T, H=4, G=2, d=32, dtype=dtype)
    text = lower_for_cuda(lambda *a: block_sparse_attention(*a, block_q=16, num_splits=num_splits, interpret=False),
                          *args)
    assert has_triton_call(text)
    interp = lower_for_cuda(lambda *a: block_sparse_attention(*a, interpret=True), *args)
    assert not has_triton_call(interp)


@pytest.mark.parametrize("T", [8, 1], ids=["prefill", "decode"])
def test_layer_of_a_stack_lowers_to_triton_for_cuda(T):
    # Inside a layer scan: the layer number is traced and the whole stack goes to the kernel, no slice before it.
    args = stacked(make_case(6, T=T, H=4, G=2, d=32), 1)

    def layers(*a):
        return jax.lax.fori_loop(0, 3, lambda i, q: block_sparse_attention(q, *a[1:], layer=i, interpret=False), a[0])

    text = lower_for_cuda(layers, *args)
    assert has_triton_call(text)


@pytest.mark.parametrize("T", [13, 1], ids=["prefill", "decode"])
def test_nothing_but_the_kernel_around_a_call(T):
    # With the page index precomputed (as a model's layer loop does), a call lowers to the Triton call alone: the
    # kernel gathers its query rows from q [B, T, H, d] and scatters its output rows back, so there is no transpose,
    # pad or slice of queries or outputs for the GPU to launch beside it in every layer.
    args = make_case(6, T=T, H=14, G=2, d=32, dtype=jnp.bfloat16)
    index = page_index(*args[3:6])
    text = lower_for_cuda(lambda *a: block_sparse_attention(*a[:7], index=a[7], interpret=False), *args, index)
    ops = set(re.findall(r"= (?:stablehlo|mhlo)\.([a-z_]+)", text))
    assert has_triton_call(text)
    assert not ops & {"transpose", "pad", "slice", "dynamic_slice", "gather", "scatter", "concatenate"}, ops
