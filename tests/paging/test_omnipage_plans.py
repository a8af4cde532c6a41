"""OmniPage paging modes: the jitted planners equal plain-Python reference planners on random paged layouts (shared
pools, full, empty and single-survivor pages, mixed classes), no accepted plan fails its mode's criterion, and the
mode functions move exactly the planned survivors, reclassify, drop emptied entries and conserve the pool."""

from __future__ import annotations

import dataclasses
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

# (page size, batch) -> (pool pages N, page-table width M). With B = 3 the sequences compete for the pool.
SHAPES = {(4, 1): (10, 8), (4, 3): (16, 8), (8, 1): (8, 6), (8, 3): (12, 6)}
LAYOUTS = 60 * soak.factor()  # per shape: 240 layouts, 480 sequences (OMNIJAX_SOAK multiplies them)
CLASSES = (PageClass.MUST_KEEP, PageClass.SELECTED, PageClass.RECENT)
PAGE_KINDS = ("full", "empty", "single", "all_but_one", "random")
PAGE_KIND_P = (0.2, 0.15, 0.2, 0.1, 0.35)

SUBBLOCKS = {4: (2, 4), 8: (2, 4, 8)}  # {2, P / 2, P}
MIN_PAGES = (1, 2)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A random cache as numpy arrays (for the references) and as a `PagedKV` (for the jitted code)."""

    table: np.ndarray  # [B, M]
    valid: np.ndarray  # [N, P]
    page_class: np.ndarray  # [N]
    span: np.ndarray  # [N, P]
    free: np.ndarray  # pages on the free stack
    fields: dict  # every slot field of the pool, for content checks
    kv: paged.PagedKV


@functools.cache
def _empty(P, B):
    N, M = SHAPES[(P, B)]
    return jax.jit(lambda: paged.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=N, page_size=P, batch=B,
                                      max_pages=M, position_axes=1))()


def _page_valid(rng, P, kind):
    if kind == "full":
        return np.ones(P, bool)
    if kind == "empty":
        return np.zeros(P, bool)
    if kind in ("single", "all_but_one"):
        out = np.full(P, kind == "all_but_one")
        out[rng.integers(P)] = kind == "single"
        return out
    return rng.random(P) < rng.uniform(0.1, 0.9)


def build(P, B, table, valid, page_class, span, rng):
    """A `PagedKV` whose tables, validity, classes and spans are given; the other slot fields are random and
    distinct, the free stack holds the pages in no table, each sequence's high-water mark lies in its last entry."""
    N, M = SHAPES[(P, B)]
    used = table[table >= 0]
    free = rng.permutation(np.setdiff1d(np.arange(N), used)).astype(np.int32)
    seq_slots = np.zeros(B, np.int32)
    for b in range(B):
        n = int(np.sum(table[b] >= 0))
        if n:
            last = max([j for j, x in enumerate(ref.live_slots(table[b], valid, P)) if x], default=-1)
            seq_slots[b] = rng.integers(max(last + 1, (n - 1) * P + 1), n * P + 1)
    fields = {
        "k": rng.standard_normal((1, N, P, 1, 2)).astype(np.float32),
        "v": rng.standard_normal((1, N, P, 1, 2)).astype(np.float32),
        "pos": rng.integers(0, 1000, (1, N, P)).astype(np.int32),
        "order": rng.permutation(N * P).reshape(N, P).astype(np.int32),
        "unit": rng.integers(0, 50, (N, P)).astype(np.int32),
        "span": span.astype(np.int8),
        "offset": rng.integers(0, 50, (N, P)).astype(np.int32),
        "score": rng.random((N, P)).astype(np.float32),
    }
    kv = _empty(P, B).replace(
        **{name: jnp.asarray(value) for name, value in fields.items()},
        valid=jnp.asarray(valid), page_table=jnp.asarray(table, jnp.int32),
        page_class=jnp.asarray(page_class, jnp.int8), seq_slots=jnp.asarray(seq_slots),
        next_order=jnp.full((B,), N * P, jnp.int32),
        free_stack=jnp.asarray(np.concatenate([free, rng.permutation(used)]).astype(np.int32)),
        num_free=jnp.asarray(len(free), jnp.int32))
    return Layout(table=table, valid=valid, page_class=page_class, span=span, free=free, fields=fields, kv=kv)


def random_layout(rng, P, B):
    N, M = SHAPES[(P, B)]
    pages = rng.permutation(N)
    table = np.full((B, M), -1, np.int32)
    used = 0
    for b in range(B):
        n = min(int(rng.integers(0, M + 1)), N - used)
        table[b, :n] = pages[used:used + n]
        used += n
    valid = np.zeros((N, P), bool)
    page_class = np.full(N, PageClass.FREE, np.int8)
    span = rng.choice([K.SYSTEM, K.TEXT, K.IMAGE], size=(N, P)).astype(np.int8)
    for b in range(B):
        one_class = CLASSES[rng.integers(3)] if rng.random() < 0.4 else None  # more same-class neighbours
        for page in table[b][table[b] >= 0]:
            valid[page] = _page_valid(rng, P, PAGE_KINDS[rng.choice(len(PAGE_KINDS), p=PAGE_KIND_P)])
            page_class[page] = one_class if one_class is not None else CLASSES[rng.integers(3)]
            if rng.random() < 0.3:
                span[page] = K.SYSTEM
    return build(P, B, table, valid, page_class, span, rng)


@functools.cache
def layouts(P, B):
    rng = np.random.default_rng(zlib.crc32(f"omnipage-{P}-{B}".encode()))
    return tuple(random_layout(rng, P, B) for _ in range(LAYOUTS))


# Compiles dominate the module's time, so each shape compiles every planner setting together, once.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _plans(kv, subblocks, min_pages):
    return ({sb: omnipage.plan_tile_skip(kv, sb) for sb in subblocks},
            {m: omnipage.plan_ordered_suffix(kv, m) for m in min_pages})


TILE_SKIP, ORDERED_SUFFIX = 0, 1  # positions of each planner's plans in `all_plans(kv)`


def all_plans(kv):
    """`({subblock: MigrationPlan}, {min_pages: MigrationPlan})` as numpy."""
    return jax.device_get(_plans(kv, SUBBLOCKS[kv.page_size], MIN_PAGES))


@functools.cache
def plans(P, B):
    return tuple(all_plans(layout.kv) for layout in layouts(P, B))


def moves_of(dst_row) -> dict[int, int]:
    return {int(j): int(d) for j, d in enumerate(dst_row) if d >= 0}


def describe(layout, b, P) -> str:
    """One sequence's entries as `page:class:live bits`, for failure messages."""
    rows = []
    for page in layout.table[b]:
        if page < 0:
            break
        bits = "".join("1" if x else "0" for x in layout.valid[page])
        rows.append(f"{page}:{PageClass(int(layout.page_class[page])).name}:{bits}")
    return f"P={P} seq {b}: " + " ".join(rows)


def check_plan_shape(plan, P, B):
    M = SHAPES[(P, B)][1]
    assert plan.dst.shape == (B, M * P) and plan.dst.dtype == jnp.int32
    assert plan.accepted.shape == (B,) and plan.accepted.dtype == jnp.bool_


TILE_CASES = [(P, B, sb) for P in (4, 8) for B in (1, 3) for sb in SUBBLOCKS[P]]
SUFFIX_CASES = [(P, B, m) for P in (4, 8) for B in (1, 3) for m in MIN_PAGES]


@dataclasses.dataclass(frozen=True)
class SequencePlan:
    """One sequence of a random layout with the jitted planner's plan for it."""

    layout: Layout
    b: int  # the sequence
    row: np.ndarray  # its page-table row
    moves: dict[int, int]  # planned {source slot: destination slot}
    accepted: bool
    live: list[bool]  # its live slots before the plan
    note: str  # `describe(layout, b, P)`, for failure messages


def sequence_plans(P, B, planner, setting):
    """Every sequence of every random layout of shape (P, B), with its plan under one planner setting.

    Args:
        P, B: the shape (page size, batch).
        planner: `TILE_SKIP` or `ORDERED_SUFFIX`.
        setting: the planner's subblock or min_pages.

    Yields:
        A `SequencePlan` per sequence.
    """
    for layout, planned in zip(layouts(P, B), plans(P, B)):
        plan = planned[planner][setting]
        dst, accepted = np.asarray(plan.dst), np.asarray(plan.accepted)
        for b in range(B):
            row = layout.table[b]
            yield SequencePlan(layout=layout, b=b, row=row, moves=moves_of(dst[b]), accepted=bool(accepted[b]),
                               live=ref.live_slots(row, layout.valid, P), note=describe(layout, b, P))


def check_plans_match_reference(P, B, planner, setting, reference_plan):
    """Every random layout's jitted plans of one planner setting against the reference, sequence by sequence.

    Args:
        P, B: the shape (page size, batch).
        planner: `TILE_SKIP` or `ORDERED_SUFFIX`.
        setting: the planner's subblock or min_pages.
        reference_plan: `(layout, b) -> (moves, accepted)` of sequence `b`.
    """
    for planned in plans(P, B):
        check_plan_shape(planned[planner][setting], P, B)
    for seq in sequence_plans(P, B, planner, setting):
        assert (seq.moves, seq.accepted) == reference_plan(seq.layout, seq.b), seq.note


@pytest.mark.parametrize("P,B,subblock", TILE_CASES)
def test_plan_tile_skip_matches_reference(P, B, subblock):
    check_plans_match_reference(P, B, TILE_SKIP, subblock, lambda layout, b: ref.tile_skip_plan(
        layout.table[b], layout.valid, layout.page_class, P, subblock))


@pytest.mark.parametrize("P,B,min_pages", SUFFIX_CASES)
def test_plan_ordered_suffix_matches_reference(P, B, min_pages):
    check_plans_match_reference(P, B, ORDERED_SUFFIX, min_pages, lambda layout, b: ref.ordered_suffix_plan(
        layout.table[b], layout.valid, P, min_pages))


def _common_move_checks(live, row, moves, P):
    """Sources live, destinations distinct, in existing entries and before their sources."""
    destinations = list(moves.values())
    assert len(set(destinations)) == len(destinations)
    for src, dst in moves.items():
        assert live[src] and 0 <= dst < src and row[dst // P] >= 0


@pytest.mark.parametrize("P,B,subblock", TILE_CASES)
def test_tile_skip_plans_meet_criterion(P, B, subblock):
    counts = {"accepted": 0, "rejected": 0, "rejected_with_moves": 0}
    for seq in sequence_plans(P, B, TILE_SKIP, subblock):
        layout, row, moves, ok, live, note = seq.layout, seq.row, seq.moves, seq.accepted, seq.live, seq.note
        _common_move_checks(live, row, moves, P)
        for src, dst_j in moves.items():
            src_entry, dst_entry = live[src // P * P:][:P], live[dst_j // P * P:][:P]
            assert not live[dst_j], note
            assert layout.page_class[row[src // P]] == layout.page_class[row[dst_j // P]], note
            assert not all(src_entry), note  # sources come from partly filled entries
            assert any(dst_entry), note  # holes are in active entries
        after = ref.apply_moves(live, moves)
        better = (ref.count_active(after, P) < ref.count_active(live, P)
                  or ref.count_active(after, subblock) < ref.count_active(live, subblock))
        assert ok == (bool(moves) and better), note
        counts["accepted" if ok else "rejected"] += 1
        counts["rejected_with_moves"] += (not ok) and bool(moves)
    assert counts["accepted"] and counts["rejected"], counts
    if subblock == P:
        assert counts["rejected_with_moves"], counts  # proposals that free no page are turned down


@pytest.mark.parametrize("P,B,min_pages", SUFFIX_CASES)
def test_ordered_suffix_plans_meet_criterion(P, B, min_pages):
    counts = {"accepted": 0, "rejected": 0}
    for seq in sequence_plans(P, B, ORDERED_SUFFIX, min_pages):
        row, moves, ok, live, note = seq.row, seq.moves, seq.accepted, seq.live, seq.note
        counts["accepted" if ok else "rejected"] += 1
        if not ok:
            assert moves == {}, note
            continue
        assert moves, note
        _common_move_checks(live, row, moves, P)
        for dst_j in moves.values():  # a destination is a hole or a slot its own survivor leaves
            assert not live[dst_j] or dst_j in moves, note
        # Gather-then-scatter on slot identities: survivors keep their relative order, the moved ones end up
        # as one contiguous run to the end, and the span shrinks by at least min_pages pages.
        content = [j if x else None for j, x in enumerate(live)]
        moved_content = list(content)
        for src in moves:
            moved_content[src] = None
        for src, dst_j in moves.items():
            moved_content[dst_j] = content[src]
        survivors = [s for s in moved_content if s is not None]
        assert survivors == sorted(survivors) and len(survivors) == sum(live), note
        start = min(moves.values())
        tail = [s is not None for s in moved_content[start:]]
        assert tail == sorted(tail, reverse=True), note
        after = ref.apply_moves(live, moves)
        assert ref.span_pages(live, P) - ref.span_pages(after, P) >= min_pages, note
    assert counts["accepted"] and counts["rejected"], counts


# Worked examples of the spec, P = 4 (M = MUST_KEEP, S = SELECTED, R = RECENT).
HAND_TILE = [
    # Same class: 5 -> 1, 4 -> 3, then hole 6 is past mover 2; entry 1 empties.
    (("S", "1010"), ("S", "1100"), 2, {5: 1, 4: 3}, True),
    # Different classes: only the SELECTED page packs (2 -> 1); one subblock fewer, no page fewer.
    (("S", "1010"), ("R", "1100"), 2, {2: 1}, True),
    (("S", "1010"), ("R", "1100"), 4, {2: 1}, False),
    # Full pages give no movers; the single RECENT survivor at 9 fills hole 5 of the other RECENT page.
    (("R", "1111"), ("R", "1011"), ("R", "0100"), 2, {9: 5}, True),
    # Empty entries offer no holes; packing within entry 1 frees no subblock, so the proposal is turned down.
    (("S", "0000"), ("S", "0011"), 2, {7: 4, 6: 5}, False),
]
HAND_SUFFIX = [
    # Span 3 pages; min_pages 1: the shortest suffix that saves a page starts at 7 (8 -> 7).
    (("R", "1000"), ("R", "0100"), ("R", "1000"), 1, {8: 7}, True),
    # min_pages 2: everything from 2 on packs into the first page.
    (("R", "1000"), ("R", "0100"), ("R", "1000"), 2, {5: 2, 8: 3}, True),
    # Already packed: nothing to gain.
    (("S", "1111"), ("M", "1100"), 1, {}, False),
    # Classes are ignored; the empty middle entry counts in the span.
    (("M", "1000"), ("S", "0000"), ("R", "0010"), 1, {10: 7}, True),
]
_CODES = {"M": PageClass.MUST_KEEP, "S": PageClass.SELECTED, "R": PageClass.RECENT}


def _hand_layout(entries, P=4, B=1):
    N, M = SHAPES[(P, B)]
    table = np.full((B, M), -1, np.int32)
    valid = np.zeros((N, P), bool)
    page_class = np.full(N, PageClass.FREE, np.int8)
    for e, (code, bits) in enumerate(entries):
        page = N - 1 - 2 * e  # not in table order
        table[0, e] = page
        valid[page] = [c == "1" for c in bits]
        page_class[page] = _CODES[code]
    return build(P, B, table, valid, page_class, np.full((N, P), K.TEXT, np.int8), np.random.default_rng(0))


def check_worked_example(case, planner, reference_plan):
    """One hand-written case `(*entries, setting, moves, accepted)`: the reference and the jitted planner both give
    the spec's plan.

    Args:
        case: an entry of `HAND_TILE` or `HAND_SUFFIX`.
        planner: `TILE_SKIP` or `ORDERED_SUFFIX`.
        reference_plan: `(layout, setting) -> (moves, accepted)` of the layout's one sequence.
    """
    *entries, setting, moves, accepted = case
    layout = _hand_layout(entries)
    assert reference_plan(layout, setting) == (moves, accepted)
    plan = all_plans(layout.kv)[planner][setting]
    assert (moves_of(np.asarray(plan.dst)[0]), bool(plan.accepted[0])) == (moves, accepted)


@pytest.mark.parametrize("case", HAND_TILE)
def test_tile_skip_worked_examples(case):
    check_worked_example(case, TILE_SKIP, lambda layout, subblock: ref.tile_skip_plan(
        layout.table[0], layout.valid, layout.page_class, 4, subblock))


@pytest.mark.parametrize("case", HAND_SUFFIX)
def test_ordered_suffix_worked_examples(case):
    check_worked_example(case, ORDERED_SUFFIX, lambda layout, min_pages: ref.ordered_suffix_plan(
        layout.table[0], layout.valid, 4, min_pages))


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
