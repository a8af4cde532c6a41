"""Eager compaction: a migration never changes what attention sees, shortens the span and returns pages."""

import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax import attention
from omnijax.chunks import stack_chunks, text_chunk
from omnijax.config import TINY_OMNI
from omnijax.kv import paged
from omnijax.paging import eager
from omnijax.retention import OmniPick, StreamingLLM, base


@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


def _survivors(kv):
    """Each live slot's (order, positions, unit, span, offset) sorted by order: layout-independent content."""
    view = base.sequence_view(kv)
    live = np.asarray(view.live[0])
    rows = [(int(view.order[0, s]), tuple(np.asarray(view.pos[:, 0, s]).tolist()), int(view.unit[0, s]),
             int(view.span[0, s]), int(view.offset[0, s])) for s in np.flatnonzero(live)]
    return sorted(rows)


def test_compaction_keeps_content_and_attention_and_releases_pages():
    rng = np.random.default_rng(0)
    kv = paged.init(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=10, page_size=4, batch=1, position_axes=1)
    kv = kv.replace(free_stack=jnp.asarray(rng.permutation(10).astype(np.int32)))
    n = 29
    k = jnp.asarray(rng.standard_normal((2, 1, n, 2, 8)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((2, 1, n, 2, 8)).astype(np.float32))
    z = jnp.zeros((1, n), jnp.int32)
    meta = paged.SlotMeta(pos=jnp.arange(n)[None, None], unit=z + jnp.arange(n) // 5, span=z + 6, offset=z)
    kv, _ = paged.append(kv, k, v, jnp.ones((1, n), bool), meta)
    view = base.sequence_view(kv)
    keep = view.live & jnp.asarray(rng.random(view.live.shape) < 0.35)
    kv, _, _ = base.apply(kv, keep, jnp.asarray([n]), reindex=False, rope=(1e4, None))
    before = _survivors(kv)
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 8)).astype(np.float32))

    def attend(cache):
        view = attention.CacheView(write_slots=jnp.full((1, 3), -1, jnp.int32), page_table=cache.page_table,
                                   slot_valid=cache.valid, slot_order=cache.order,
                                   q_order=jnp.full((1, 3), n, jnp.int32))
        return np.asarray(attention.attend(q, cache.k[1], cache.v[1], view))

    packed, moved = eager.compact(kv)
    assert _survivors(packed) == before  # positions, units, spans and offsets travel with their keys
    np.testing.assert_allclose(attend(packed), attend(kv), atol=1e-6)
    kept = len(before)
    stats_before, stats_after = omnijax.kv.layout_stats(kv, 2), omnijax.kv.layout_stats(packed, 2)
    assert int(stats_after.physical_span[0]) == -(-kept // 4) * 4 <= int(stats_before.physical_span[0])
    assert int(stats_after.free_pages) == 10 - -(-kept // 4) and int(moved[0]) > 0
    assert int(stats_after.retained_cells[0]) == kept
    # Packing an already packed cache moves nothing.
    _, again = eager.compact(packed)
    assert int(again[0]) == 0


@pytest.mark.parametrize("policy", [StreamingLLM(sink_tokens=2, window=22, high_watermark=40),
                                    OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6)])
def test_eager_paging_streams_like_native(model, policy):
    rng = np.random.default_rng(1)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i) for i in range(14)])
    native = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16)
    packed = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, paging="eager")
    np.testing.assert_allclose(np.asarray(packed.logits), np.asarray(native.logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(packed.stats.layout.retained_cells),
                                  np.asarray(native.stats.layout.retained_cells))
    assert (np.asarray(packed.stats.layout.physical_span) <= np.asarray(native.stats.layout.physical_span)).all()
    assert int(np.asarray(packed.stats.moved).sum()) > 0 and int(np.asarray(native.stats.moved).sum()) == 0
    with pytest.raises(ValueError, match="unknown paging mode"):
        omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, paging="lazy")
