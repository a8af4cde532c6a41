"""Host tier of evicted units (issue 40, first piece): bounded storage with reported drops, scoring and selection
against plain-Python twins, re-rotation against keys rotated fresh, and evict -> store -> recall at the kv level
against dense numpy attention over keys built directly at the final positions."""

import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind
from omnijax.kv import attention, host_tier, host_tier_scoring, paged
from omnijax.kv import rope as rope_lib
from omnijax.retention import UnitFIFO, base, recall

L, G, H, D, P = 2, 2, 4, 16, 4  # layers, kv heads, query heads, head dim, page size
THETA = 1e4
SECTIONS = {"rope": (1, None, False), "mrope": (3, (2, 3, 3), False), "mrope_interleaved": (3, (3, 3, 2), True)}


def _unit(rng, unit, n, axes=1):
    k = rng.standard_normal((L, G, n, D)).astype(np.float32)
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), (axes, n))
    return host_tier.make_unit(unit, k, -k, pos, np.full(n, SpanKind.TEXT), np.arange(n), np.arange(n))


def test_tier_drops_oldest_first_reports_every_drop_and_refuses_a_unit_over_budget():
    rng = np.random.default_rng(0)
    units = [_unit(rng, u, n) for u, n in enumerate([3, 5, 2, 4])]
    each = [u.nbytes for u in units]
    # k and v, pos/span/offset/order per token, the summary
    assert each[0] == 2 * L * G * 3 * D * 4 + 3 * (4 + 1 + 4 + 4) + L * G * D * 4
    tier = host_tier.HostTier(budget_bytes=each[0] + each[1] + each[2])
    tier, report = tier.add(*units[:3])
    assert report == host_tier.TierReport(added=(0, 1, 2), dropped=(), dropped_bytes=0)
    before = tier
    tier, report = tier.add(units[3])  # needs room: the oldest go until the rest fits
    need_drop = 0
    while sum(each[need_drop:]) > tier.budget_bytes:
        need_drop += 1
    assert need_drop == 2  # unit 0 alone (3 tokens) does not make room for unit 3 (4 tokens); 0 and 1 do
    assert report.dropped == tuple(range(need_drop)) and report.added == (3,)
    assert report.dropped_bytes == sum(each[:need_drop]) and tier.dropped_bytes == report.dropped_bytes
    assert [u.unit for u in tier.units] == list(range(need_drop, 4)) and tier.nbytes <= tier.budget_bytes
    assert [u.unit for u in before.units] == [0, 1, 2]  # the old tier is unchanged
    assert before.units[1] is units[1] and not units[1].k.flags.writeable  # shared, read-only, never copied
    with pytest.raises(ValueError, match="unit 9 needs .* budget_bytes"):
        tier.add(_unit(rng, 9, 40))
    with pytest.raises(ValueError, match="budget_bytes"):
        host_tier.HostTier(budget_bytes=0)
    at_once, report = host_tier.HostTier(budget_bytes=tier.budget_bytes).add(*units)  # one call, same budget
    assert report.added == (2, 3) and report.dropped == (0, 1) and at_once.dropped_units == 2
    with pytest.raises(ValueError, match="indices must lie"):
        tier.take([len(tier.units)])
    rest, taken = tier.take([len(tier.units) - 1])
    assert [u.unit for u in taken] == [3] and 3 not in [u.unit for u in rest.units]


@pytest.mark.parametrize("scoring", host_tier_scoring.SCORINGS)
@pytest.mark.parametrize("seed", range(4))
def test_scores_equal_the_attention_logits_over_every_stored_key(seed, scoring):
    rng = np.random.default_rng(seed)
    tier, _ = host_tier.HostTier(budget_bytes=1 << 24).add(*[_unit(rng, u, int(rng.integers(1, 7)))
                                                              for u in range(5)])
    query = rng.standard_normal((L, H, D)).astype(np.float32)
    got = host_tier_scoring.score_units(tier, query, scoring)
    np.testing.assert_allclose(got, host_tier_scoring.score_units_reference(tier, query, scoring), rtol=1e-5, atol=1e-6)
    shared = query[0]  # [Hq, d] used at every layer
    np.testing.assert_allclose(host_tier_scoring.score_units(tier, shared, scoring),
                               host_tier_scoring.score_units_reference(tier, shared, scoring), rtol=1e-5, atol=1e-6)
    other = host_tier_scoring.score_units(tier, query, "mean" if scoring == "max" else "max")
    assert np.abs(got - other).max() > 1e-3  # the two scorings differ
    with pytest.raises(ValueError, match="multiple of kv heads"):
        host_tier_scoring.score_units(tier, query[:, :3], scoring)
    with pytest.raises(ValueError, match="scoring must be one of"):
        host_tier_scoring.score_units(tier, query, "sum")


@pytest.mark.parametrize("seed", range(20))
def test_selection_equals_the_plain_walk_respects_budgets_and_breaks_ties_by_age(seed):
    rng = np.random.default_rng(seed)
    U = int(rng.integers(0, 12))
    scores = rng.integers(0, 4, U).astype(np.float32)  # few values: many ties
    sizes = rng.integers(1, 9, U)
    budget, top = int(rng.integers(0, 40)), int(rng.integers(0, 6))
    got = host_tier_scoring.select_units(scores, sizes, budget, top)
    np.testing.assert_array_equal(got, host_tier_scoring.select_units_reference(scores, sizes, budget, top))
    assert sizes[got].sum() <= budget and len(got) <= top
    if len(got):  # every unit ranked above a chosen one is chosen too
        worst = max((-scores[i], i) for i in got)  # ranking key: higher score first, then lower index
        assert all(i in got for i in range(U) if (-scores[i], i) < worst)
    np.testing.assert_array_equal(host_tier_scoring.select_units(np.zeros(3), np.ones(3, int), 2, 5), [0, 1])
    with pytest.raises(ValueError, match="recall_budget_cells"):
        host_tier_scoring.select_units(scores, sizes, -1, top)


@pytest.mark.parametrize("scheme", list(SECTIONS))
@pytest.mark.parametrize("seed", range(3))
def test_rerotation_equals_keys_rotated_at_the_new_positions(scheme, seed):
    axes, section, interleaved = SECTIONS[scheme]
    rng = np.random.default_rng(seed)
    n = 9
    raw = rng.standard_normal((L, G, n, D)).astype(np.float32)
    p = rng.integers(0, 3000, (axes, n)).astype(np.int32)
    q = rng.integers(0, 3000, (axes, n)).astype(np.int32)  # per-axis, not only uniform shifts

    def at(pos):
        angles = rope_lib.rope_angles(jnp.asarray(pos), D, THETA, section, interleaved)  # [n, d/2]
        return np.swapaxes(np.asarray(rope_lib.apply_rope(jnp.swapaxes(jnp.asarray(raw), 1, 2), angles)), 1, 2)

    got = recall.rerotate(at(p), p, q, theta=THETA, mrope_section=section, interleaved=interleaved)
    # Angles are float32 (as the model rotates): an angle near 3000 rad carries ~3000 * eps of rounding, on both sides.
    tolerance = 4 * 3000 * np.finfo(np.float32).eps * np.abs(raw).max()
    np.testing.assert_allclose(np.asarray(got), at(q), atol=tolerance)
    small = rng.integers(0, 40, (2, axes, n)).astype(np.int32)  # small positions: tight
    got = recall.rerotate(at(small[0]), small[0], small[1], theta=THETA, mrope_section=section,
                          interleaved=interleaved)
    np.testing.assert_allclose(np.asarray(got), at(small[1]), atol=2e-6)
    assert np.abs(at(p) - at(q)).max() > 0.1  # the check can fail


def _positions(axes):
    """Per (unit, offset): positions of a system prefix (unit 0, 2 tokens) and units 1..4 of 6 tokens each; with 3
    axes unit 2 is a 2 x 3 image grid (t fixed, h = t + row, w = t + col) as TMRoPE lays one out."""
    pos, spans, c = {}, {}, 0
    for u, n in [(0, 2), (1, 6), (2, 6), (3, 6), (4, 6)]:
        for o in range(n):
            grid = axes == 3 and u == 2
            pos[u, o] = (c, c + o // 3, c + o % 3) if grid else (c + o,) * axes
            spans[u, o] = SpanKind.SYSTEM if u == 0 else SpanKind.IMAGE if grid else SpanKind.TEXT
        c += 3 if axes == 3 and u == 2 else n
    return pos, spans, c


@pytest.mark.parametrize("scheme", ["rope", "mrope"])
@pytest.mark.parametrize("take", ["top1", "all"])
def test_evict_store_recall_attends_like_a_cache_built_at_the_final_positions(scheme, take):
    axes, section, interleaved = SECTIONS[scheme]
    rng = np.random.default_rng(11)
    pos, spans, next_pos = _positions(axes)
    tokens = list(pos)
    raw_k = {t: rng.standard_normal((L, G, D)).astype(np.float32) for t in tokens}
    raw_v = {t: rng.standard_normal((L, G, D)).astype(np.float32) for t in tokens}

    def rotated(t, p):  # the raw key of token t rotated at positions p, [L, G, D]
        angles = rope_lib.rope_angles(jnp.asarray(p, jnp.int32)[:, None], D, THETA, section)[0]
        return np.asarray(rope_lib.apply_rope(jnp.asarray(raw_k[t]), angles))

    kv = paged.init(num_layers=L, num_kv_heads=G, head_dim=D, num_pages=16, page_size=P, position_axes=axes)
    kv = kv.replace(free_stack=jnp.asarray(rng.permutation(16).astype(np.int32)))
    col = lambda f: jnp.asarray(np.asarray([f(t) for t in tokens]))[None]  # noqa: E731
    meta = paged.SlotMeta(pos=jnp.asarray(np.asarray([pos[t] for t in tokens]).T)[:, None], unit=col(lambda t: t[0]),
                          span=col(lambda t: spans[t]), offset=col(lambda t: t[1]))
    k = np.stack([rotated(t, pos[t]) for t in tokens], axis=1)[:, None]  # [L, 1, T, G, D]
    v = np.stack([raw_v[t] for t in tokens], axis=1)[:, None]
    kv, _ = paged.append(kv, jnp.asarray(k), jnp.asarray(v), jnp.ones((1, len(tokens)), bool), meta)

    # Evict: UnitFIFO over 26 cells (high 20, low 14) drops units 1 and 2, re-indexing the rest.
    trimmed, cursor, evicted = base.trim(UnitFIFO(high_watermark=20, low_watermark=14), kv,
                                         jnp.asarray([next_pos], jnp.int32), rope=(THETA, section))
    assert int(evicted[0]) == 12
    stored = host_tier.gather_units(kv, host_tier.evicted_slots(kv, trimmed))
    assert [u.unit for u in stored] == [1, 2] and [u.size for u in stored] == [6, 6]
    tier, report = host_tier.HostTier(budget_bytes=1 << 20).add(*stored)
    assert report.dropped == ()

    # Question time: score, select, recall.
    query = rng.standard_normal((L, H, D)).astype(np.float32)
    scores = host_tier_scoring.score_units(tier, query)
    chosen = host_tier_scoring.select_units(scores, tier.sizes, 12, 1 if take == "top1" else 2)
    assert list(chosen) == ([int(np.argmax(scores))] if take == "top1" else [0, 1])
    tier, units = tier.take(chosen)
    recalled, cursor2 = recall.recall_into(trimmed, units, cursor, rope=(THETA, section))

    # Independent expectations: survivors close the gaps the evicted units left (values covered by nobody);
    # recalled units follow the cursor in storage order, each shifted uniformly so its lowest value lands on it.
    survivors = [t for t in tokens if t[0] in (0, 3, 4)]
    covered = {x for t in survivors for x in range(min(pos[t]), max(pos[t]) + 1)}
    freed = [x for x in range(next_pos) if x not in covered]
    want = {t: tuple(x - sum(f < min(pos[t]) for f in freed) for x in pos[t]) for t in survivors}
    at = next_pos - len(freed)
    assert int(cursor[0]) == at
    for u in units:
        mine = [t for t in tokens if t[0] == u.unit]
        lo, hi = min(min(pos[t]) for t in mine), max(max(pos[t]) for t in mine)
        want.update({t: tuple(x - lo + at for x in pos[t]) for t in mine})
        at += hi - lo + 1
    assert int(cursor2[0]) == at and not bool(recalled.exhausted[0])

    # The recalled cache holds exactly those tokens at those positions.
    valid = np.asarray(recalled.valid)
    held = {(int(recalled.unit[p_, s]), int(recalled.offset[p_, s])): tuple(np.asarray(recalled.pos[:, p_, s]))
            for p_, s in zip(*np.nonzero(valid))}
    assert held == want

    # Attention of two question tokens over the recalled cache equals dense attention over keys built at `want`.
    q_raw = rng.standard_normal((1, 2, H, D)).astype(np.float32)
    q_pos = np.broadcast_to(at + np.arange(2), (axes, 2))
    q = rope_lib.apply_rope(jnp.asarray(q_raw), rope_lib.rope_angles(jnp.asarray(q_pos)[:, None], D, THETA,
                                                                      section))
    view = attention.CacheView(write_slots=jnp.full((1, 2), -1, jnp.int32), page_table=recalled.page_table,
                               slot_valid=recalled.valid, slot_order=recalled.order,
                               q_order=jnp.full((1, 2), 10_000, jnp.int32))
    order = sorted(want)
    keys = np.stack([rotated(t, want[t]) for t in order], axis=1)  # [L, S, G, D]
    vals = np.stack([raw_v[t] for t in order], axis=1)
    qn = np.asarray(q, np.float64)[0]  # [2, H, D]
    for layer in range(L):
        got = np.asarray(attention.attend(q, recalled.k[layer], recalled.v[layer], view, impl="reference"))[0]
        kh = np.repeat(keys[layer], H // G, axis=1).astype(np.float64)  # [S, H, D]
        logits = np.einsum("thd,shd->hts", qn, kh) / np.sqrt(D)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        dense = np.einsum("hts,shd->thd", w, np.repeat(vals[layer], H // G, axis=1))
        np.testing.assert_allclose(got, dense, atol=1e-5)


def test_gather_and_recall_touch_only_their_sequence():
    rng = np.random.default_rng(5)
    kv = paged.init(num_layers=L, num_kv_heads=G, head_dim=D, num_pages=8, page_size=P, batch=2, position_axes=1)
    n = 5
    k = jnp.asarray(rng.standard_normal((L, 2, n, G, D)).astype(np.float32))
    unit = jnp.asarray([[7] * n, [8] * n], jnp.int32)
    meta = paged.SlotMeta(pos=jnp.broadcast_to(jnp.arange(n), (1, 2, n)), unit=unit,
                          span=jnp.full((2, n), SpanKind.TEXT, jnp.int8),
                          offset=jnp.broadcast_to(jnp.arange(n), (2, n)))
    kv, _ = paged.append(kv, k, -k, jnp.ones((2, n), bool), meta)
    everything = np.ones((8, P), bool)
    (mine,) = host_tier.gather_units(kv, everything, seq=1)
    assert mine.unit == 8 and mine.size == n
    np.testing.assert_array_equal(mine.k.transpose(0, 2, 1, 3), np.asarray(k[:, 1]))
    np.testing.assert_array_equal(mine.pos, np.arange(n)[None])
    with pytest.raises(ValueError, match="seq must lie"):
        host_tier.gather_units(kv, everything, seq=2)
    after, cursor = recall.recall_into(kv, [mine], jnp.asarray([n, n], jnp.int32), seq=1, rope=(THETA, None))
    assert cursor.tolist() == [n, 2 * n]
    assert int(after.next_order[0]) == n and int(after.next_order[1]) == 2 * n  # sequence 0 got nothing
    (back,) = host_tier.gather_units(after, np.asarray(after.valid) & ~np.asarray(kv.valid), seq=1)
    np.testing.assert_array_equal(back.pos, n + np.arange(n)[None])
    np.testing.assert_allclose(back.k, np.asarray(recall.rerotate(mine.k, mine.pos, back.pos, theta=THETA,
                                                                   mrope_section=None)), atol=0)
