"""OmniPage's paging modes and the pool's reservations on the random paged layouts of
tests/_support/omnipage_layouts.py: the mode functions move exactly the survivors the reference plans, reclassify,
drop emptied entries and conserve the pool; tile_skip keeps MUST_KEEP pages system-only; `paged.reserve` equals the
plain-Python reserve under every placement. The planners themselves: test_omnipage_plans.py."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind as K
from omnijax.kv import layout_stats, paged
from omnijax.kv.paged import PageClass
from omnijax.paging import omnipage
from tests._support import reference_paging as ref
from tests._support import soak
from tests._support.omnipage_layouts import SHAPES, build, describe, layouts

pytestmark = pytest.mark.fast  # the quick tier, as test_omnipage_plans.py (tests/conftest.py's FAST names that one)


def check_mode_result(layout, out, moved, expected, P, B):
    """The returned cache against the per-sequence reference results, plus the pool's and tables' invariants."""
    N, M = SHAPES[(P, B)]
    table, valid = np.asarray(out.page_table), np.asarray(out.valid)
    fields = {name: np.asarray(getattr(out, name)) for name in layout.fields}
    moved, seq_slots = np.asarray(moved), np.asarray(out.seq_slots)
    assert moved.shape == (B,) and moved.dtype == np.int32
    released = set()
    for b, exp in enumerate(expected):
        note = describe(layout, b, P)
        assert int(moved[b]) == exp["moved"], note
        assert table[b].tolist() == exp["row"], note
        exists = table[b] >= 0
        assert (exists[:-1] >= exists[1:]).all(), note  # no -1 before an entry
        live = ref.live_slots(table[b], valid, P)
        assert live == [s is not None for s in exp["source"]], note
        assert sum(live) == sum(ref.live_slots(layout.table[b], layout.valid, P)), note  # retained cells
        for j, s in enumerate(exp["source"]):  # every survivor carries its key, value and metadata
            if s is None:
                continue
            new, old = (int(table[b, j // P]), j % P), (int(layout.table[b, s // P]), s % P)
            for name, value in layout.fields.items():
                if name in ("k", "v", "pos"):
                    np.testing.assert_array_equal(fields[name][:, new[0], new[1]], value[:, old[0], old[1]],
                                                  err_msg=f"{name} {note}")
                else:
                    assert fields[name][new] == value[old], f"{name} {note}"
        # The high-water mark stays above every survivor and inside the entries (reserve relies on both).
        last = max([j for j, x in enumerate(live) if x], default=-1)
        assert last < seq_slots[b] and -(-int(seq_slots[b]) // P) == int(exists.sum()), note
        released |= set(exp["released"])
    num_free = int(out.num_free)
    free = np.asarray(out.free_stack)[:num_free]
    referenced = table[table >= 0]
    assert num_free + len(referenced) == N
    assert len(set(free.tolist()) | set(referenced.tolist())) == N  # no page twice, none lost
    assert set(free.tolist()) == set(layout.free.tolist()) | released
    page_class = np.asarray(out.page_class)
    assert (page_class[free] == PageClass.FREE).all() and not valid[free].any()
    assert (page_class[referenced] != PageClass.FREE).all()


MODE_CASES = [(4, 3, 2, 1), (8, 1, 8, 2), (8, 3, 4, 2)]  # (P, B, subblock, min_pages)
MODE_LAYOUTS = 10 * soak.factor()


@functools.partial(jax.jit, static_argnums=(1, 2))
def _modes(kv, subblock, min_pages):
    tiled, tile_moved = omnipage.tile_skip(kv, subblock)
    packed, pack_moved = omnipage.ordered_suffix(kv, min_pages)
    return ((tiled, tile_moved, layout_stats(kv, subblock), layout_stats(tiled, subblock)),
            (packed, pack_moved, layout_stats(packed, kv.page_size)))


@functools.cache
def mode_results(P, B, subblock, min_pages):
    """Per layout: `((tile_skip kv, moved, stats before, stats after), (ordered_suffix kv, moved, stats after))`."""
    return tuple(jax.device_get(_modes(layout.kv, subblock, min_pages)) for layout in layouts(P, B)[:MODE_LAYOUTS])


@pytest.mark.parametrize("P,B,subblock,min_pages", MODE_CASES)
def test_tile_skip_mode(P, B, subblock, min_pages):
    accepted_seen = 0
    for layout, (result, _) in zip(layouts(P, B), mode_results(P, B, subblock, min_pages)):
        out, moved, before, after = result
        expected = [ref.tile_skip_mode(layout.table[b], layout.valid, layout.page_class, layout.span, P, subblock)
                    for b in range(B)]
        check_mode_result(layout, out, moved, expected, P, B)
        page_class = np.asarray(out.page_class)
        for b, exp in enumerate(expected):
            note = describe(layout, b, P)
            assert {int(p): int(page_class[p]) for p in exp["row"] if p >= 0} == exp["classes"], note
            _, ok = ref.tile_skip_plan(layout.table[b], layout.valid, layout.page_class, P, subblock)
            if ok:
                accepted_seen += 1
                assert (after.active_pages[b] < before.active_pages[b]
                        or after.active_subblocks[b] < before.active_subblocks[b]), note
    assert accepted_seen


@pytest.mark.parametrize("P,B,subblock,min_pages", MODE_CASES)
def test_ordered_suffix_mode(P, B, subblock, min_pages):
    accepted_seen = 0
    for layout, (_, result) in zip(layouts(P, B), mode_results(P, B, subblock, min_pages)):
        out, moved, after = result
        expected = [ref.ordered_suffix_mode(layout.table[b], layout.valid, P, min_pages) for b in range(B)]
        check_mode_result(layout, out, moved, expected, P, B)
        for b, exp in enumerate(expected):
            note = describe(layout, b, P)
            packed = ref.span_pages(ref.live_slots(exp["compacted_row"], layout.valid, P), P) * P
            assert int(after.physical_span[b]) <= packed, note
            if ref.ordered_suffix_plan(exp["compacted_row"], layout.valid, P, min_pages)[1]:
                accepted_seen += 1
                assert int(after.physical_span[b]) <= packed - min_pages * P, note
    assert accepted_seen


RESERVE_T = 11  # chunk length: with P = 4 a chunk can need three fresh pages


@functools.partial(jax.jit, static_argnums=(3,))
def _reserve(kv, token_valid, span, placement):
    B, T = token_valid.shape
    z = jnp.zeros((B, T), jnp.int32)
    meta = paged.SlotMeta(pos=(z + jnp.arange(T))[None], unit=z + 7, span=span, offset=z + jnp.arange(T))
    return paged.reserve(kv, token_valid, meta, placement=placement)


def random_chunk(rng, B, T):
    """`(token_valid, span)` `[B, T]`: a random number of valid tokens (some sequences none), padding anywhere, spans
    SYSTEM or not, often in runs."""
    valid = np.zeros((B, T), bool)
    span = np.zeros((B, T), np.int8)
    for b in range(B):
        valid[b] = rng.random(T) < rng.choice([0.0, 0.5, 1.0], p=[0.1, 0.4, 0.5])
        style = rng.integers(3)
        if style == 0:  # a system run, then unit tokens
            cut = int(rng.integers(0, T + 1))
            span[b] = np.where(np.arange(T) < cut, K.SYSTEM, K.TEXT)
        elif style == 1:
            span[b] = rng.choice([K.SYSTEM, K.IMAGE, K.AUDIO], size=T)
        else:
            span[b] = K.SYSTEM if rng.random() < 0.5 else K.TEXT
    return valid, span


@pytest.mark.parametrize("placement", paged.PLACEMENTS)
@pytest.mark.parametrize("P,B", [(4, 1), (4, 3), (8, 1), (8, 3)])
def test_reserve_matches_reference(P, B, placement):
    """`paged.reserve` against the plain-Python reserve on the random layouts (holes, full and empty entries, every
    class, pools and tables that run out): slots, page tables, classes of the popped pages, marks, pool and
    exhaustion; under by_class no system token lands outside a MUST_KEEP page and no other token in one."""
    rng = np.random.default_rng(zlib.crc32(f"reserve-{P}-{B}-{placement}".encode()))
    seen = {"exhausted": 0, "fresh_must_keep": 0, "into_must_keep_holes": 0, "written": 0}
    for layout in layouts(P, B):
        valid_t, span_t = random_chunk(rng, B, RESERVE_T)
        kv = layout.kv
        if rng.random() < 0.3:  # a nearly drained pool (the pages left out are lent elsewhere)
            kv = kv.replace(num_free=jnp.minimum(kv.num_free, int(rng.integers(0, 3))))
        out, slots, order = jax.device_get(_reserve(kv, jnp.asarray(valid_t), jnp.asarray(span_t), placement))
        exp = ref.reserve(layout.table, layout.valid, layout.page_class, np.asarray(kv.seq_slots),
                          np.asarray(kv.free_stack), int(kv.num_free), valid_t, span_t, P, placement)
        note = " | ".join(describe(layout, b, P) for b in range(B))
        assert np.asarray(slots).tolist() == exp["slots"], note
        assert np.asarray(out.page_table).tolist() == exp["table"], note
        assert np.asarray(out.seq_slots).tolist() == exp["seq_slots"], note
        assert int(out.num_free) == exp["num_free"], note
        assert np.asarray(out.dropped).tolist() == exp["lost"], note
        assert np.asarray(out.exhausted).tolist() == [n > 0 for n in exp["lost"]], note
        page_class = np.asarray(out.page_class)
        expected_class = layout.page_class.copy()
        for page, cls in exp["classes"].items():
            expected_class[page] = cls
        np.testing.assert_array_equal(page_class, expected_class, err_msg=note)
        # Written tokens are valid with their metadata; nothing that was live is overwritten.
        slots = np.asarray(slots)
        written = slots[slots >= 0]
        assert len(set(written.tolist())) == len(written), note
        assert not layout.valid.reshape(-1)[written].any(), note
        assert np.asarray(out.valid).reshape(-1)[written].all(), note
        np.testing.assert_array_equal(np.asarray(out.span).reshape(-1)[written], span_t[slots >= 0])
        want_order = np.asarray(kv.next_order)[:, None] + np.cumsum(valid_t, axis=1) - 1
        np.testing.assert_array_equal(np.asarray(order)[valid_t], want_order[valid_t])
        np.testing.assert_array_equal(np.asarray(out.order).reshape(-1)[written], want_order[slots >= 0])
        if placement == "by_class":
            system = span_t == K.SYSTEM
            cls_of = page_class[np.maximum(slots, 0) // P]
            assert (cls_of[(slots >= 0) & system] == PageClass.MUST_KEEP).all(), note
            assert (cls_of[(slots >= 0) & ~system] == PageClass.RECENT).all(), note
            seen["fresh_must_keep"] += sum(c == PageClass.MUST_KEEP for c in exp["classes"].values())
            old_mk = (layout.page_class[np.maximum(slots, 0) // P] == PageClass.MUST_KEEP) & (slots >= 0)
            seen["into_must_keep_holes"] += int(old_mk.sum())
        else:
            assert all(c == PageClass.RECENT for c in exp["classes"].values()), note
        seen["exhausted"] += any(n > 0 for n in exp["lost"])
        seen["written"] += len(written)
    assert seen["exhausted"] and seen["written"], seen
    if placement == "by_class":
        assert seen["fresh_must_keep"] and seen["into_must_keep_holes"], seen


_tile_skip = jax.jit(omnipage.tile_skip, static_argnums=(1,))


@pytest.mark.parametrize("P,B,subblock,min_pages", MODE_CASES)
def test_tile_skip_mode_keeps_must_keep_pages_system_only(P, B, subblock, min_pages):
    """On layouts where MUST_KEEP pages hold exactly the system tokens (what by_class placement writes), tile_skip's
    moves and promotions keep it so, and still equal the reference."""
    rng = np.random.default_rng(zlib.crc32(f"must-keep-{P}-{B}".encode()))
    moves_into_must_keep = 0
    for layout in layouts(P, B)[:MODE_LAYOUTS]:
        must_keep = (layout.page_class == PageClass.MUST_KEEP)[:, None]
        span = np.where(must_keep, K.SYSTEM, rng.choice([K.TEXT, K.IMAGE, K.AUDIO], size=layout.span.shape))
        consistent = build(P, B, layout.table, layout.valid, layout.page_class, span.astype(np.int8), rng)
        for b in range(B):
            assert not ref.must_keep_violations(layout.table[b], layout.valid, layout.page_class, span)
        out, moved = jax.device_get(_tile_skip(consistent.kv, subblock))
        table, valid, page_class, out_span = map(np.asarray, (out.page_table, out.valid, out.page_class, out.span))
        for b in range(B):
            note = describe(consistent, b, P)
            assert not ref.must_keep_violations(table[b], valid, page_class, out_span), note
            exp = ref.tile_skip_mode(layout.table[b], layout.valid, layout.page_class, span, P, subblock)
            assert table[b].tolist() == exp["row"], note
            assert {int(p): int(page_class[p]) for p in exp["row"] if p >= 0} == exp["classes"], note
            moves, ok = ref.tile_skip_plan(layout.table[b], layout.valid, layout.page_class, P, subblock)
            if ok:
                moves_into_must_keep += sum(layout.page_class[layout.table[b][d // P]] == PageClass.MUST_KEEP
                                            for d in moves.values())
    assert moves_into_must_keep  # system tokens were packed into MUST_KEEP holes
