"""Paged KV pytree: allocation, exhaustion, page reuse, layout stats, and reference attention vs a dense cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind
from omnijax.kv import attention, paged
from omnijax.kv.paged import PageClass
from tests._support import kv_ops as ops

pytestmark = pytest.mark.fast  # the quick tier (`make test-fast`): the paged cache against its plain-Python twins

G, D, H = 2, 8, 4  # kv heads, head dim, query heads


# The package's operations run compiled (tests/_support/kv_ops.py: one program per operation and shape, not one per
# primitive), and the tests index results on the host: indexing a jax array eagerly compiles a program.
_meta = ops.meta


def _shuffled(kv, seed):
    """Permutes the free stack so sequences get pages in a random physical order."""
    perm = np.random.default_rng(seed).permutation(kv.num_pages).astype(np.int32)
    return kv.replace(free_stack=jnp.asarray(perm))


_contiguous_attention = ops.contiguous_attention  # the shared oracle attention.dense_attention, contiguous keys


def _write_sequence_chunks(kv, rng, lengths, B):
    """Appends chunks of the given lengths to B sequences; returns kv and the contiguous k/v per sequence."""
    ks = [[] for _ in range(B)]
    vs = [[] for _ in range(B)]
    q_chunks = []
    for T in lengths:
        k = rng.standard_normal((1, B, T, G, D)).astype(np.float32)
        v = rng.standard_normal((1, B, T, G, D)).astype(np.float32)
        kv, slots = ops.append(kv, k, v, np.ones((B, T), bool), _meta(B, T))
        for b in range(B):
            ks[b].append(k[0, b])
            vs[b].append(v[0, b])
        q_chunks.append(T)
    return kv, [np.concatenate(x) for x in ks], [np.concatenate(x) for x in vs]


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permuted_page_table_matches_dense_cache(seed, impl):
    rng = np.random.default_rng(seed)
    B, P = 2, 4
    kv = _shuffled(ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=16, page_size=P, batch=B,
                              max_pages=8, position_axes=1), seed)
    lengths = [5, 3, 6]  # totals 5, 8, 14: not page multiples
    kv, ks, vs = _write_sequence_chunks(kv, rng, lengths[:-1], B)
    # The last chunk: reserve slots for its queries, write keys, attend.
    T = lengths[-1]
    k_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    v_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv, slots, q_order = ops.reserve(kv, np.ones((B, T), bool), _meta(B, T))
    out = np.asarray(ops.write_and_attend(kv, slots, q_order, q, k_new, v_new, impl=impl))
    table = np.asarray(kv.page_table)
    assert len(set(table[table >= 0].tolist())) == (table >= 0).sum()  # no page shared
    prior = sum(lengths[:-1])
    for b in range(B):
        k_all = np.concatenate([ks[b], k_new[b]])
        v_all = np.concatenate([vs[b], v_new[b]])
        want = _contiguous_attention(q[b], k_all, v_all, prior + np.arange(T))
        np.testing.assert_allclose(out[b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_layer_of_a_stack_equals_the_layer_alone(impl):
    # A model's layer loop writes and reads layer `i` (traced) of the whole [L, N, P, G, d] stack it carries.
    rng = np.random.default_rng(9)
    B, P, L = 2, 4, 3
    kv = _shuffled(ops.init(num_layers=L, num_kv_heads=G, head_dim=D, num_pages=16, page_size=P, batch=B,
                              max_pages=8, position_axes=1), 9)
    k_old = rng.standard_normal((L, B, 7, G, D)).astype(np.float32)
    kv, _ = ops.append(kv, k_old, -k_old, np.ones((B, 7), bool), _meta(B, 7))
    T = 5
    k_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv, slots, q_order = ops.reserve(kv, np.ones((B, T), bool), _meta(B, T, start=7))
    view = attention.CacheView.of(kv, slots, q_order)
    k_host = np.asarray(kv.k)
    v_host = np.asarray(kv.v)

    @jax.jit
    def layered(layer, k_stack, v_stack):
        k_stack = paged.write_layer(k_stack, slots, k_new, layer=layer)
        v_stack = paged.write_layer(v_stack, slots, 2 * k_new, layer=layer)
        return k_stack, attention.attend(q, k_stack, v_stack, view, impl=impl, layer=layer)

    for layer in range(L):
        k_stack, got = layered(jnp.int32(layer), kv.k, kv.v)
        k_layer = ops.write_layer(k_host[layer], slots, k_new)
        want = ops.attend(q, k_layer, ops.write_layer(v_host[layer], slots, 2 * k_new), view, impl=impl)
        np.testing.assert_array_equal(np.asarray(k_stack)[layer], np.asarray(k_layer))
        others = [i for i in range(L) if i != layer]
        np.testing.assert_array_equal(np.asarray(k_stack)[others], k_host[others])  # untouched
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_reused_page_never_leaks_old_values(impl):
    rng = np.random.default_rng(3)
    B, P = 1, 4
    kv = ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=4, page_size=P, batch=B, position_axes=1)
    kv, _, _ = _write_sequence_chunks(kv, rng, [8], B)
    used = np.asarray(kv.page_table)[0, :2]
    # Poison the pages, release them and drop them from the sequence: the slots stay dirty.
    k_poison, v_poison = np.array(kv.k), np.array(kv.v)
    k_poison[:, used], v_poison[:, used] = np.nan, 1e6
    poisoned = kv.replace(k=jnp.asarray(k_poison), v=jnp.asarray(v_poison))
    kv2 = ops.release_pages(poisoned, used).replace(
        page_table=jnp.asarray(np.full(kv.page_table.shape, -1, np.int32)),
        seq_slots=jnp.asarray(np.zeros(kv.seq_slots.shape, np.int32)))
    assert int(kv2.num_free) == 4
    # A new 3-token sequence reuses a dirty page (the last released page is on top of the stack).
    T = 3
    k_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    v_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv3, slots, q_order = ops.reserve(kv2, np.ones((B, T), bool), _meta(B, T))
    assert int(np.asarray(kv3.page_table)[0, 0]) in used.tolist()
    out = np.asarray(ops.write_and_attend(kv3, slots, q_order, q, k_new, v_new, impl=impl))
    assert np.isfinite(out).all()
    want = _contiguous_attention(q[0], k_new[0], v_new[0], np.arange(T))
    np.testing.assert_allclose(out[0], want, atol=1e-5, rtol=1e-5)


def test_pool_exhaustion_is_reported_and_nothing_is_overwritten():
    rng = np.random.default_rng(4)
    B, P = 2, 4
    kv = ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=3, page_size=P, batch=B, position_axes=1)
    kv, _, _ = _write_sequence_chunks(kv, rng, [4], B)  # two pages used, one free
    before_k = np.asarray(kv.k)
    k = rng.standard_normal((1, B, 6, G, D)).astype(np.float32)
    kv2, slots = ops.append(kv, k, k, np.ones((B, 6), bool), _meta(B, 6, 4))
    # Sequence 0 gets the last free page (4 of its 6 tokens), sequence 1 gets nothing.
    assert np.asarray(kv2.exhausted).tolist() == [True, True]
    assert np.asarray(kv2.dropped).tolist() == [2, 6]
    assert int(kv2.num_free) == 0
    written = np.asarray(slots)
    assert (written[1] == -1).all() and (written[0, :4] >= 0).all() and (written[0, 4:] == -1).all()
    # The previously written slots are untouched.
    old_slots = [(int(np.asarray(kv.page_table)[b, 0]), s) for b in range(B) for s in range(P)]
    after_k = np.asarray(kv2.k)
    for page, s in old_slots:
        np.testing.assert_array_equal(after_k[:, page, s], before_k[:, page, s])
    stats = ops.layout_stats(kv2, subblock=2)
    assert np.asarray(stats.retained_cells).tolist() == [8, 4]


def test_page_table_width_limit_is_exhaustion():
    kv = ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=8, page_size=4, batch=1, max_pages=2,
                    position_axes=1)
    k = np.zeros((1, 1, 10, G, D), np.float32)
    kv, slots = ops.append(kv, k, k, np.ones((1, 10), bool), _meta(1, 10))
    assert bool(np.asarray(kv.exhausted)[0]) and int(np.asarray(kv.dropped)[0]) == 2 and int(kv.num_free) == 6
    assert (np.asarray(slots)[0, 8:] == -1).all()


def _spanned(spans, start=0):
    """Batch-1 metadata of tokens with the given span kinds."""
    T = len(spans)
    z = np.zeros((1, T), np.int32)
    return paged.SlotMeta(pos=np.arange(start, start + T, dtype=np.int32)[None, None], unit=z,
                          span=np.asarray([spans], np.int32), offset=z)


def test_by_class_placement_keeps_system_tokens_on_must_keep_pages():
    """System tokens get MUST_KEEP pages of their own; a partly filled MUST_KEEP page stays reserved for later system
    tokens, which fill it before a fresh one is taken; other tokens never take its slots."""
    SYS, TXT = int(SpanKind.SYSTEM), int(SpanKind.TEXT)
    P = 4
    kv = ops.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=8, page_size=P, position_axes=1)
    # 5 system tokens then 3 text tokens: MUST_KEEP entries 0, 1 (one token), a RECENT entry 2.
    kv, slots, _ = ops.reserve(kv, np.ones((1, 8), bool), _spanned([SYS] * 5 + [TXT] * 3), placement="by_class")
    assert np.asarray(slots)[0].tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert np.asarray(kv.page_class)[:3].tolist() == [PageClass.MUST_KEEP, PageClass.MUST_KEEP, PageClass.RECENT]
    # Text fills the RECENT page and opens another: page 1's three free slots stay empty.
    kv, slots, _ = ops.reserve(kv, np.ones((1, 3), bool), _spanned([TXT] * 3, 8), placement="by_class")
    assert np.asarray(slots)[0].tolist() == [11, 12, 13] and int(np.asarray(kv.page_class)[3]) == PageClass.RECENT
    # Later system tokens, mixed with text: page 1's slots first, then a fresh MUST_KEEP page.
    kv, slots, _ = ops.reserve(kv, np.ones((1, 6), bool), _spanned([SYS, TXT, SYS, SYS, SYS, SYS], 11),
                                 placement="by_class")
    assert np.asarray(slots)[0].tolist() == [5, 14, 6, 7, 16, 17]
    assert int(np.asarray(kv.page_class)[4]) == PageClass.MUST_KEEP
    assert np.asarray(kv.page_table)[0, :5].tolist() == [0, 1, 2, 3, 4]
    valid, span, cls = np.asarray(kv.valid), np.asarray(kv.span), np.asarray(kv.page_class)
    for page in range(5):
        system = span[page][valid[page]] == SYS
        assert (system.all() if cls[page] == PageClass.MUST_KEEP else not system.any()), page
    assert not bool(np.asarray(kv.exhausted)[0])


def test_by_class_placement_reports_a_system_token_with_no_page():
    """A system token may not take a free RECENT slot: with the pool empty it is dropped, and reported."""
    SYS, TXT = int(SpanKind.SYSTEM), int(SpanKind.TEXT)
    kv = ops.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=1, page_size=4, position_axes=1)
    kv, _, _ = ops.reserve(kv, np.ones((1, 2), bool), _spanned([TXT, TXT]), placement="by_class")
    kv, slots, _ = ops.reserve(kv, np.ones((1, 3), bool), _spanned([TXT, SYS, TXT], 2), placement="by_class")
    assert np.asarray(slots)[0].tolist() == [2, -1, 3]
    assert bool(np.asarray(kv.exhausted)[0]) and int(np.asarray(kv.dropped)[0]) == 1 and int(kv.num_free) == 0
    first_fit = ops.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=1, page_size=4, position_axes=1)
    first_fit, _, _ = ops.reserve(first_fit, np.ones((1, 2), bool), _spanned([TXT, TXT]))
    first_fit, slots, _ = ops.reserve(first_fit, np.ones((1, 2), bool), _spanned([TXT, SYS], 2))
    assert np.asarray(slots)[0].tolist() == [2, 3] and not bool(np.asarray(first_fit.exhausted)[0])


def _python_stats(valid, table, P, sub):
    out = []
    for row in table:
        pages = [p for p in row if p >= 0]
        cells = sum(int(valid[p].sum()) for p in pages)
        nonempty = [i for i, p in enumerate(row) if p >= 0 and valid[p].any()]
        span = (max(nonempty) + 1) * P if nonempty else 0
        subs = sum(int(valid[p, s:s + sub].any()) for p in pages for s in range(0, P, sub))
        out.append((cells, span, len(nonempty), subs))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_layout_stats_match_python(seed):
    rng = np.random.default_rng(seed)
    N, P, B, M = 12, 8, 3, 5
    valid = rng.random((N, P)) < 0.3
    valid[rng.random(N) < 0.3] = False  # some fully empty pages
    perm = rng.permutation(N)
    table = np.full((B, M), -1, np.int32)
    k = 0
    for b in range(B):
        n = rng.integers(0, M + 1)
        table[b, :n] = perm[k:k + n]
        k += n
    kv = ops.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=N, page_size=P, batch=B, max_pages=M)
    kv = kv.replace(valid=jnp.asarray(valid), page_table=jnp.asarray(table))
    stats = ops.layout_stats(kv, subblock=4)
    got = list(zip(*(np.asarray(x).tolist() for x in (stats.retained_cells, stats.physical_span,
                                                      stats.active_pages, stats.active_subblocks))))
    assert got == _python_stats(valid, table, P, 4)


def test_init_rejects_bad_page_size():
    with pytest.raises(ValueError, match="power of two"):
        paged.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=4, page_size=48)
    with pytest.raises(ValueError, match="head_dim must be positive, got 1, 1, 0"):
        paged.init(num_layers=1, num_kv_heads=1, head_dim=0, num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="max_pages must be positive, got 0"):
        paged.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=4, page_size=4, max_pages=0)


def test_unknown_attention_impl_is_an_error():
    kv = ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=2, page_size=4, position_axes=1)
    view = attention.CacheView(write_slots=np.zeros((1, 1), np.int32), page_table=kv.page_table,
                               slot_valid=kv.valid, slot_order=kv.order, q_order=np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="unknown attention impl"):
        attention.attend(np.zeros((1, 1, H, D), np.float32), np.asarray(kv.k)[0], np.asarray(kv.v)[0], view,
                         impl="fast")


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_every_impl_names_a_bad_shape(impl):
    # Through the compiled wrapper: the checks run while tracing, so a refused call compiles nothing.
    kv = ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=2, page_size=4, position_axes=1)
    view = attention.CacheView(write_slots=np.zeros((1, 1), np.int32), page_table=kv.page_table,
                               slot_valid=kv.valid, slot_order=kv.order, q_order=np.zeros((1, 1), np.int32))
    q = np.zeros((1, 1, H, D), np.float32)
    k0, v0 = np.asarray(kv.k)[0], np.asarray(kv.v)[0]
    bad = [
        ((q[..., :D // 2], k0, v0, view), "head_dim mismatch"),
        ((q[:, :, :3], k0, v0, view), "not a multiple of kv heads"),
        ((q, k0, v0[:, :2], view), "k/v pages"),
        ((q, k0, v0, dataclasses.replace(view, q_order=np.zeros((1, 2), np.int32))), "q_order"),
        ((q, k0, v0, dataclasses.replace(view, slot_valid=np.asarray(kv.valid)[:1])), "slot metadata"),
        ((np.zeros((2, 1, H, D), np.float32), k0, v0, view), "page_table"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ops.attend(*args, impl=impl)


def test_attention_mass_per_slot_matches_dense_probabilities():
    rng = np.random.default_rng(9)
    B, P = 1, 4
    kv = _shuffled(ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=8, page_size=P, batch=B,
                              position_axes=1), 9)
    kv, ks, vs = _write_sequence_chunks(kv, rng, [6], B)
    T = 3
    k_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    valid = np.array([[True, True, False]])  # the padded query must not vote
    kv, slots, q_order = ops.reserve(kv, valid, _meta(B, T))
    _, mass = ops.write_and_attend(kv, slots, q_order, q, k_new, k_new, impl="reference", with_mass=True)
    keys = np.concatenate([ks[0], k_new[0, :2]]).astype(np.float64)  # 8 live keys in write order
    want = np.zeros(8)
    for t in range(2):
        for h in range(H):
            s = keys[: 6 + t + 1, h // (H // G)] @ q[0, t, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            want[: 6 + t + 1] += p / p.sum() / H
    order = np.asarray(kv.order)
    live = np.asarray(kv.valid)
    got = np.zeros(8)
    for page, off in zip(*np.nonzero(live)):
        got[order[page, off]] = np.asarray(mass)[page, off]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.asarray(mass)[~live].max(initial=0) == 0


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_new_tokens_fill_holes_first_fit_and_attention_follows_write_order(impl):
    rng = np.random.default_rng(11)
    B, P = 1, 4
    kv = _shuffled(ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=6, page_size=P, batch=B,
                              max_pages=4, position_axes=1), 11)
    kv, ks, vs = _write_sequence_chunks(kv, rng, [10], B)
    table = np.asarray(kv.page_table)[0]
    holes = [(table[0], 1), (table[1], 0), (table[1], 3)]  # evict tokens 1, 4 and 7
    valid = np.asarray(kv.valid).copy()
    for page, off in holes:
        valid[page, off] = False
    kv = kv.replace(valid=jnp.asarray(valid))
    T = 5
    k_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    v_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv2, slots, q_order = ops.reserve(kv, np.ones((B, T), bool), _meta(B, T))
    # Three holes in page-table order, then the two free slots after the high-water mark (10, 11).
    want_slots = [page * P + off for page, off in holes] + [table[2] * P + 2, table[2] * P + 3]
    assert np.asarray(slots)[0].tolist() == want_slots
    assert int(kv2.seq_slots[0]) == 12 and int(kv2.num_free) == kv.num_free  # no new page needed
    out = np.asarray(ops.write_and_attend(kv2, slots, q_order, q, k_new, v_new, impl=impl))
    kept = [i for i in range(10) if i not in (1, 4, 7)]
    k_all = np.concatenate([ks[0][kept], k_new[0]])
    v_all = np.concatenate([vs[0][kept], v_new[0]])
    want = _contiguous_attention(q[0], k_all, v_all, len(kept) + np.arange(T))
    np.testing.assert_allclose(out[0], want, atol=1e-5, rtol=1e-5)
    # No hole left: the next tokens take a new page (the fourth and last page-table entry); nothing is overwritten.
    zeros = np.zeros((1, 1, 6, G, D), np.float32)
    kv3, slots3 = ops.append(kv2, zeros, zeros, np.ones((1, 6), bool), _meta(1, 6))
    assert int(kv3.num_free) == int(kv2.num_free) - 1
    assert bool(np.asarray(kv3.exhausted)[0]) and int(np.asarray(kv3.dropped)[0]) == 2  # 4 fit, the table is full
    used = {int(s) for s in (np.asarray(kv.page_table)[0, :3, None] * P + np.arange(P)).reshape(-1)}
    written = [s for s in np.asarray(slots3)[0].tolist() if s >= 0]
    assert len(written) == 4 and used.isdisjoint(written)


def test_xla_skips_inactive_pages_even_when_they_hold_nan():
    rng = np.random.default_rng(12)
    B, P = 2, 4
    kv = _shuffled(ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=12, page_size=P, batch=B,
                              max_pages=6, position_axes=1), 12)
    kv, _, _ = _write_sequence_chunks(kv, rng, [9, 7], B)
    valid = np.asarray(kv.valid).copy()
    empty = np.asarray(kv.page_table)[0, 1]
    valid[empty] = False  # a fully evicted page inside sequence 0's table
    k = np.asarray(kv.k).copy()
    k[:, empty] = np.nan
    k[:, ~np.isin(np.arange(12), np.asarray(kv.page_table))] = np.nan  # pages nobody holds
    kv = kv.replace(valid=jnp.asarray(valid), k=jnp.asarray(k))
    v = np.asarray(kv.v)
    ids, count = ops.active_pages(kv.page_table, kv.valid)
    table = np.asarray(kv.page_table)
    assert np.asarray(count).tolist() == [int((table[0] >= 0).sum()) - 1, int((table[1] >= 0).sum())]
    assert empty not in np.asarray(ids)[0][: int(np.asarray(count)[0])]
    q = rng.standard_normal((B, 3, H, D)).astype(np.float32)
    view = attention.CacheView(write_slots=np.full((B, 3), -1, np.int32), page_table=kv.page_table,
                               slot_valid=kv.valid, slot_order=kv.order, q_order=np.full((B, 3), 100, np.int32))
    ref = ops.attend(q, k[0], v[0], view, impl="reference")
    xla = ops.attend(q, k[0], v[0], view, impl="xla")
    assert np.isfinite(np.asarray(xla)).all()
    np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), atol=1e-5)
    with pytest.raises(ValueError, match="needs impl='reference'"):
        attention.attend(q, k[0], v[0], view, impl="xla", with_mass=True)


def _primitives(jaxpr) -> set[str]:
    """Primitive names in a jaxpr and every jaxpr nested in its equations."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if hasattr(sub, "jaxpr"):  # ClosedJaxpr
                    names |= _primitives(sub.jaxpr)
                elif hasattr(sub, "eqns"):
                    names |= _primitives(sub)
    return names


@pytest.fixture(scope="module")
def two_layer_decoder():
    """The tiny decoder cut to two layers (only its traced program is inspected)."""
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder

    return Decoder(TINY_OMNI.replace(num_layers=2))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_indexed_view_matches_and_the_layer_loop_derives_no_page_list(impl, two_layer_decoder):
    """An indexed view gives the same attention; a model indexes once per chunk, so its layer scan holds no cumsum
    (the active-page list) while an unindexed call does; nor does the scan rotate angles or scan layer numbers."""
    rng = np.random.default_rng(13)
    B, P = 2, 4
    kv = _shuffled(ops.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=12, page_size=P, batch=B,
                              max_pages=6, position_axes=1), 13)
    kv, _, _ = _write_sequence_chunks(kv, rng, [9, 7], B)
    valid = np.array(kv.valid)
    valid[np.asarray(kv.page_table)[0, 1], 1:] = False
    kv = kv.replace(valid=jnp.asarray(valid))
    view = attention.CacheView(write_slots=np.full((B, 3), -1, np.int32), page_table=kv.page_table,
                               slot_valid=kv.valid, slot_order=kv.order, q_order=np.full((B, 3), 100, np.int32))
    indexed = ops.index_pages(view)
    assert indexed.pages is not None and attention.index_pages(indexed) is indexed
    q = rng.standard_normal((B, 3, H, D)).astype(np.float32)
    k0, v0 = jnp.asarray(np.asarray(kv.k)[0]), jnp.asarray(np.asarray(kv.v)[0])  # traced below: jax arrays
    np.testing.assert_array_equal(np.asarray(ops.attend(q, k0, v0, indexed, impl=impl)),
                                  np.asarray(ops.attend(q, k0, v0, view, impl=impl)))
    per_call = jax.make_jaxpr(lambda v: attention.attend(q, k0, v0, v, impl=impl))
    assert "cumsum" in _primitives(per_call(view).jaxpr)
    assert "cumsum" not in _primitives(per_call(indexed).jaxpr)

    model = two_layer_decoder
    c = model.config
    big = ops.init(num_layers=2, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_pages=4, page_size=8,
                     position_axes=3)
    chunk_meta = _meta(1, 5, axes=3)
    pos = chunk_meta.pos
    big, slots, q_order = ops.reserve(big, np.ones((1, 5), bool), chunk_meta)
    chunk_view = attention.CacheView.of(big, slots, q_order)
    x = np.zeros((1, 5, c.hidden_size), np.dtype(c.jnp_dtype))
    jaxpr = jax.make_jaxpr(lambda v: model.run_layers(x, pos, v, big.k, big.v, impl=impl))(chunk_view).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    body = _primitives(scans[0].params["jaxpr"].jaxpr)
    assert "cumsum" not in body and "cumsum" in _primitives(jaxpr)  # the index is built once, before the scan
    # So is the RoPE rotation, and the layer number rides in the carry: XLA:GPU would launch the cosine, the sine
    # and a slice of a layer-number array again in every layer.
    assert not body & {"cos", "sin"} and {"cos", "sin"} <= _primitives(jaxpr)
    scanned = scans[0].invars[scans[0].params["num_consts"] + scans[0].params["num_carry"]:]
    assert all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in scanned)  # the layers' weights only


def _scale_rows(got, factor):
    """A step's transform for `copy_rows`: each copied row times its list entry's factor."""
    return got * factor[None, :, None]


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_copy_rows_walks_the_list_in_steps_and_transforms_each(chunk):
    """`copy_rows` equals a numpy copy of the first `count` listed rows, each rewritten by the step's transform (which
    receives the step's entries of a per-entry array), whatever the step size; entries past `count` are not applied."""
    rng = np.random.default_rng(7)
    L, R = 2, 10
    x = rng.standard_normal((L, R, 3)).astype(np.float32)
    y = rng.standard_normal((L, R, 3)).astype(np.float32)
    member = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1, 0], bool)
    rows = np.arange(R)
    listed, count = ops.listed_first(member, np.stack([rows, rows[::-1]]), R)
    assert int(count) == member.sum()
    assert np.asarray(listed)[0, : int(count)].tolist() == rows[member].tolist()
    assert (np.asarray(listed)[:, int(count):] == R).all()
    src = np.asarray(listed)[0]
    dst = np.where(src < R, (src + 1) % R, R).astype(np.int32)  # each listed row to the next row
    scale = np.arange(R, dtype=np.float32)  # per list entry: its position, the factor its row is scaled by
    got_x, got_y = ops.copy_rows((x, y), src, dst, count, chunk=chunk, transform=_scale_rows, extra=scale)
    want_x, want_y = x.copy(), y.copy()
    # Reference: the same stepping, each step reading all its sources before writing (row r goes to r + 1, so a
    # later step may read what an earlier one wrote).
    for start in range(0, int(count), chunk):
        entries = list(range(start, min(start + chunk, int(count))))
        read = [(want_x[:, int(src[e])].copy(), want_y[:, int(src[e])].copy(), e) for e in entries]
        for vx, vy, e in read:
            want_x[:, int(dst[e])] = vx * e
            want_y[:, int(dst[e])] = vy * e
    np.testing.assert_allclose(np.asarray(got_x), want_x, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_y), want_y, rtol=1e-6)
