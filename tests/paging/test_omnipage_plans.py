"""OmniPage's planners: the jitted planners equal plain-Python reference planners on random paged layouts (shared
pools, full, empty and single-survivor pages, mixed classes, tests/_support/omnipage_layouts.py), no accepted plan
fails its mode's criterion, and hand-worked layouts plan as worked out. The mode functions that carry the plans out,
and `paged.reserve`, are tested in test_omnipage_modes.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind as K
from omnijax.kv.paged import PageClass
from omnijax.paging import omnipage
from tests._support import reference_paging as ref
from tests._support.omnipage_layouts import SHAPES, Layout, build, describe, layouts, moves_of

SUBBLOCKS = {4: (2, 4), 8: (2, 4, 8)}  # {2, P / 2, P}
MIN_PAGES = (1, 2)


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
