"""Applying a retention plan: invalidation, the re-indexing rule, key re-rotation, and attention after a trim."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kv import attention, paged
from omnijax.kv import rope as rope_lib
from omnijax.retention import base

G, D, H, P = 2, 16, 4, 4  # kv heads, head dim, query heads, page size
THETA = 1e4


def _python_freed(intervals, keep, next_pos):
    """Plain reading of the rule: values in [0, next_pos) covered by no survivor's [lo, hi] are freed."""
    covered = set()
    for (lo, hi), k in zip(intervals, keep):
        if k:
            covered.update(range(lo, hi + 1))
    freed = [v for v in range(next_pos) if v not in covered]
    deltas = [sum(1 for v in freed if v < lo) if k else 0 for (lo, _), k in zip(intervals, keep)]
    return deltas, len(freed)


def _fill(rng, tokens, axes, section, num_pages=8):
    """A one-sequence cache whose pages are permuted, holding `tokens` keys rotated at positions `[axes, n]`."""
    n = tokens.shape[1]
    kv = paged.init(num_layers=2, num_kv_heads=G, head_dim=D, num_pages=num_pages, page_size=P, batch=1,
                    position_axes=axes)
    kv = kv.replace(free_stack=jnp.asarray(rng.permutation(num_pages).astype(np.int32)))
    raw_k = rng.standard_normal((2, 1, n, G, D)).astype(np.float32)
    v = rng.standard_normal((2, 1, n, G, D)).astype(np.float32)
    angles = rope_lib.rope_angles(jnp.asarray(tokens)[:, None], D, THETA, section)  # [1, n, d/2]
    k = jax.vmap(lambda x: rope_lib.apply_rope(x, angles))(jnp.asarray(raw_k))
    z = jnp.zeros((1, n), jnp.int32)
    meta = paged.SlotMeta(pos=jnp.asarray(tokens)[:, None], unit=z, span=z + 6, offset=z)
    kv, _ = paged.append(kv, k, jnp.asarray(v), jnp.ones((1, n), bool), meta)
    return kv, raw_k, v


def _qwen_like_positions(rng, n):
    """3-axis positions as TMRoPE makes them: text runs, then a grid (t, base+r, base+c), then more text."""
    cols, rows = 3, 2
    head = rng.integers(1, 4)
    grid = [(head, head + r, head + c) for r in range(rows) for c in range(cols)]
    top = head + max(rows, cols) - 1
    pos = [(i, i, i) for i in range(head)] + grid
    pos += [(top + 1 + i,) * 3 for i in range(n - len(pos))]
    return np.asarray(pos, np.int32).T  # [3, n]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("axes", [1, 3])
def test_rerotated_keys_equal_fresh_keys_and_positions_follow_the_rule(seed, axes):
    rng = np.random.default_rng(seed)
    n = 17
    section = None if axes == 1 else (2, 3, 3)
    positions = np.arange(n, dtype=np.int32)[None] if axes == 1 else _qwen_like_positions(rng, n)
    kv, raw_k, _ = _fill(rng, positions, axes, section)
    next_pos = jnp.asarray([int(positions.max()) + 1], jnp.int32)
    view = base.sequence_view(kv)
    keep = view.live & jnp.asarray(rng.random(view.live.shape) < 0.5)
    new_kv, new_next, evicted = base.apply(kv, keep, next_pos, reindex=True, rope=(THETA, section))
    # Reference: the rule read plainly, token by token, in write order.
    order = np.asarray(view.order[0])
    live = np.asarray(view.live[0])
    kept_tokens = sorted(int(order[s]) for s in np.flatnonzero(np.asarray(keep[0])))
    intervals = [(int(positions[:, i].min()), int(positions[:, i].max())) for i in range(n)]
    deltas, total = _python_freed(intervals, [i in kept_tokens for i in range(n)], int(next_pos[0]))
    assert int(new_next[0]) == int(next_pos[0]) - total
    assert int(evicted[0]) == n - len(kept_tokens) == int(live.sum()) - int(base.sequence_view(new_kv).retained[0])
    new_view = base.sequence_view(new_kv)
    slot_of = {int(order[s]): s for s in np.flatnonzero(live)}
    for t in kept_tokens:
        s = slot_of[t]
        want_pos = positions[:, t] - deltas[t]
        np.testing.assert_array_equal(np.asarray(new_view.pos[:, 0, s]), want_pos)
        # The cached key equals the raw key rotated fresh at the new position.
        fresh = rope_lib.apply_rope(jnp.asarray(raw_k[:, 0, t]), rope_lib.rope_angles(
            jnp.asarray(want_pos)[:, None], D, THETA, section)[0])
        page, off = divmod(s, P)
        table_page = int(new_kv.page_table[0, page])
        np.testing.assert_allclose(np.asarray(new_kv.k[:, table_page, off]), np.asarray(fresh), atol=1e-5)
    if axes == 1:  # contiguous 1D positions: kept tokens end up at 0..k-1 in age order
        assert sorted(int(new_view.pos[0, 0, slot_of[t]]) for t in kept_tokens) == list(range(len(kept_tokens)))


def test_attention_after_trim_equals_attention_from_scratch():
    rng = np.random.default_rng(7)
    n = 23
    positions = np.arange(n, dtype=np.int32)[None]
    kv, raw_k, v = _fill(rng, positions, 1, None)
    view = base.sequence_view(kv)
    keep = view.live & jnp.asarray(rng.random(view.live.shape) < 0.4)
    kv2, next_pos, _ = base.apply(kv, keep, jnp.asarray([n], jnp.int32), reindex=True, rope=(THETA, None))
    kept = sorted(int(o) for o in np.asarray(view.order[0])[np.asarray(keep[0])])
    # New queries at the cursor after the trim, attending over the trimmed cache (write order: all earlier).
    q_raw = rng.standard_normal((1, 2, H, D)).astype(np.float32)
    q_pos = np.asarray(next_pos)[0] + np.arange(2)
    q = rope_lib.apply_rope(jnp.asarray(q_raw), rope_lib.rope_angles(jnp.asarray(q_pos)[None, None], D, THETA, None))
    view_cache = attention.CacheView(write_slots=jnp.full((1, 2), -1, jnp.int32), page_table=kv2.page_table,
                                     slot_valid=kv2.valid, slot_order=kv2.order,
                                     q_order=jnp.full((1, 2), n + 5, jnp.int32))
    got = np.asarray(attention.attend(q, kv2.k[0], kv2.v[0], view_cache))[0]
    # From scratch: kept raw keys rotated at 0..k-1, dense softmax attention.
    k_new = rope_lib.apply_rope(jnp.asarray(raw_k[0, 0, kept]), rope_lib.rope_angles(
        jnp.arange(len(kept))[None], D, THETA, None))
    n_kept = len(kept)
    want = attention.dense_attention(q, k_new[None], jnp.asarray(v[0, 0, kept])[None], jnp.ones((1, n_kept), bool),
                                     jnp.zeros((1, n_kept), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                                     precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(got, np.asarray(want[0]), atol=1e-5)


def test_without_reindex_positions_and_keys_stay():
    rng = np.random.default_rng(3)
    kv, _, _ = _fill(rng, np.arange(9, dtype=np.int32)[None], 1, None)
    view = base.sequence_view(kv)
    keep = view.live & (view.order >= 4)
    kv2, next_pos, evicted = base.apply(kv, keep, jnp.asarray([9]), reindex=False, rope=(THETA, None))
    assert int(next_pos[0]) == 9 and int(evicted[0]) == 4
    np.testing.assert_array_equal(np.asarray(kv2.k), np.asarray(kv.k))
    np.testing.assert_array_equal(np.asarray(kv2.pos), np.asarray(kv.pos))
    assert int(base.sequence_view(kv2).retained[0]) == 5


def test_trim_runs_only_when_triggered():
    rng = np.random.default_rng(4)
    kv, _, _ = _fill(rng, np.arange(9, dtype=np.int32)[None], 1, None)
    kv2, next_pos, evicted = base.trim(base.NoSlide(), kv, jnp.asarray([9]), rope=(THETA, None))
    assert int(evicted[0]) == 0 and int(next_pos[0]) == 9
    np.testing.assert_array_equal(np.asarray(kv2.valid), np.asarray(kv.valid))
