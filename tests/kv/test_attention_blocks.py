"""`impl="xla"` gathers active pages in blocks of many pages: every block size gives the dense oracle's output on
layouts with permuted tables, holes, fully evicted pages, NaN in dead slots, ragged counts and GQA, and the block
size follows the rule `block_pages` documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kv import attention

G, D = 2, 8


def _layout(rng, *, B=3, N=32, P=4, M=10, H=4, T=5):
    """A pool of N pages shared by B sequences with random page tables (permuted, some -1 entries), random holes,
    whole evicted pages, NaN/inf in every dead slot and pages nobody holds, and per-sequence write orders."""
    perm = rng.permutation(N).astype(np.int32)
    table = np.full((B, M), -1, np.int32)
    used = rng.integers(2, min(M, (N - M) // max(B - 1, 1)) + 1, size=B)
    used[0] = M  # one full table
    offset = 0
    for b in range(B):
        table[b, : used[b]] = perm[offset: offset + used[b]]
        offset += used[b]
        if used[b] > 3:
            table[b, 1] = -1  # a hole in the table itself
    valid = rng.random((N, P)) < 0.7
    valid[table[0, 2]] = False  # a fully evicted page inside sequence 0's table
    order = np.zeros((N, P), np.int32)
    for b in range(B):
        pages = table[b][table[b] >= 0]
        order[pages] = rng.permutation(pages.size * P).reshape(pages.size, P)  # write order, not slot order
    k = rng.standard_normal((N, P, G, D)).astype(np.float32)
    v = rng.standard_normal((N, P, G, D)).astype(np.float32)
    k[~valid] = np.nan
    v[~valid] = np.inf
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    q_order = np.sort(rng.integers(0, M * P + 2, size=(B, T)), axis=1).astype(np.int32)
    q_order[0, 0] = -1  # a query that sees nothing: zeros
    view = attention.CacheView(write_slots=jnp.full((B, T), -1, jnp.int32), page_table=jnp.asarray(table),
                               slot_valid=jnp.asarray(valid), slot_order=jnp.asarray(order),
                               q_order=jnp.asarray(q_order))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), view


@pytest.mark.parametrize("H", [2, 4, 8])  # GQA ratios 1, 2, 4
def test_every_block_size_matches_the_dense_oracle(H):
    rng = np.random.default_rng(H)
    q, k, v, view = _layout(rng, H=H)
    want = np.asarray(attention.attend(q, k, v, view, impl="reference"))
    assert np.isfinite(want).all() and np.abs(want[0, 0]).max() == 0
    run = jax.jit(lambda q, k, v, view, bp: attention.attend_xla(q, k, v, view, pages_per_block=bp),
                  static_argnums=4)
    for bp in (1, 2, 4, 8, 16):  # 16 > the 10 table entries: one padded block
        got = np.asarray(run(q, k, v, view, bp))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"pages_per_block={bp}")
    np.testing.assert_allclose(np.asarray(attention.attend(q, k, v, view, impl="xla")), want, atol=1e-5, rtol=1e-5)


def test_long_chunks_are_taken_in_row_blocks():
    # More queries than MAX_QUERY_ROWS: rows go block by block (the last one padded), same output as the oracle.
    rng = np.random.default_rng(5)
    T = attention.MAX_QUERY_ROWS + 37
    q, k, v, view = _layout(rng, T=T, M=10, N=32)
    want = np.asarray(attention.attend(q, k, v, view, impl="reference"))
    for bp in (2, None):
        got = np.asarray(attention.attend_xla(q, k, v, view, pages_per_block=bp))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_contiguous_prefix_attention_matches_the_dense_oracle():
    # TideKV's layer step: a chunk at absolute start over contiguous buffers; keys past the chunk are never read.
    rng = np.random.default_rng(6)
    B, S, H, T = 2, 64, 4, 12
    k = rng.standard_normal((B, S, G, D)).astype(np.float32)
    v = rng.standard_normal((B, S, G, D)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)).astype(np.float32))
    for start in (0, 20, S - T):
        index = np.arange(S, dtype=np.int32)[None].repeat(B, 0)
        want = attention.dense_attention(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(index < start + T),
                                         jnp.asarray(index), jnp.asarray(start + np.arange(T, dtype=np.int32))[None]
                                         .repeat(B, 0), precision=jax.lax.Precision.HIGHEST)
        k_future, v_future = k.copy(), v.copy()
        k_future[:, start + T:] = 1e4  # finite garbage past the chunk: never visible
        for bq, bk in ((None, None), (4, 8), (8, 16), (16, 64)):
            got = attention.attend_contiguous(q, jnp.asarray(k_future), jnp.asarray(v_future), jnp.int32(start),
                                              block_q=bq, block_k=bk)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5,
                                       err_msg=f"start={start} blocks={bq, bk}")
    assert attention.contiguous_blocks(2048, 8, 8192) == (512, 256)
    assert attention.contiguous_blocks(12, 4, 96) == (16, 32)  # key blocks tile the buffer exactly
    assert attention.contiguous_blocks(4096, 28, 1 << 16) == (512, 128)  # at least 128 keys per block
    with pytest.raises(ValueError, match="dividing S"):
        attention.attend_contiguous(q, jnp.asarray(k), jnp.asarray(v), 0, block_k=128)


def test_layer_stack_and_bfloat16_blocks():
    rng = np.random.default_rng(7)
    q, k, v, view = _layout(rng)
    L = 3
    k_stack = jnp.stack([k * (i + 1) for i in range(L)])
    v_stack = jnp.stack([v - i for i in range(L)])
    for layer in range(L):
        want = attention.attend(q, k_stack[layer], v_stack[layer], view, impl="reference")
        got = attention.attend_xla(q, k_stack, v_stack, view, layer=jnp.int32(layer), pages_per_block=2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    want = attention.attend(*bf, view, impl="reference").astype(jnp.float32)
    got = attention.attend_xla(*bf, view, pages_per_block=2).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_block_size_rule():
    # 256 queries over 8 heads of 32 (2 kv heads): 512-slot blocks; decode: the largest block the keys allow;
    # Qwen2.5-Omni-7B's 4 kv heads of 128: 256 slots whatever the chunk; small tables cap it.
    assert attention.block_pages(256, 8, 64, 1024, 2 * 32) * 64 == 512
    assert attention.block_pages(1, 8, 64, 1024, 2 * 32) * 64 == attention.MAX_BLOCK_SLOTS
    assert attention.block_pages(1, 28, 64, 1024, 4 * 128) * 64 == 256
    assert attention.block_pages(124, 28, 64, 1024, 4 * 128) * 64 == 256
    assert attention.block_pages(1, 8, 64, 3) == 4  # 3 table entries, rounded up to a power of two
    assert attention.block_pages(4096, 32, 16, 64) == 1  # never below one page
    for args in [(1, 1, 4, 1), (7, 3, 8, 5), (256, 28, 64, 130, 512)]:
        bp = attention.block_pages(*args)
        assert bp >= 1 and bp & (bp - 1) == 0
    q, k, v, view = _layout(np.random.default_rng(0))
    with pytest.raises(ValueError, match="power of two"):
        attention.attend_xla(q, k, v, view, pages_per_block=3)

