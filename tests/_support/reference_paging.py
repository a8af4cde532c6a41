"""Plain-Python reference planners for the OmniPage paging modes (`omnijax.paging.omnipage`), one sequence at a time.

Slots are numbered in table space: slot `e * P + o` is offset `o` of page-table entry `e`. A slot is live when its
entry holds a page and that page's `valid` bit at `o` is set. An entry is active when one of its slots is live and
full when all of them are; a subblock is a `subblock`-long run of an entry's slots, active when one is live.

tile_skip, class by class (MUST_KEEP, SELECTED, RECENT): the movers are the live slots of partly filled entries of
that class, taken from the back; the holes are the dead slots of the active entries of that class, taken from the
front. The i-th mover goes to the i-th hole as long as the hole comes first; at the first pair where it does not,
pairing stops. The plan is taken only when it leaves fewer active entries or fewer active subblocks.

ordered_suffix, blind to classes: the span is the number of entries up to and including the last live slot. For
every start s before the end, packing the live slots from s on into s, s + 1, ... (order kept) gives a new span; the
latest s whose packing saves at least `min_pages` entries wins, and only the survivors it shifts move. No such s: no
moves, rejected.

reserve (`omnijax.kv.paged.reserve`), sequence after sequence: a sequence holds the entries below ceil(seq_slots / P);
its open slots are the dead slots of held entries that have a page. Under first_fit every token takes the next open
slot. Under by_class a SYSTEM token takes the next open slot of a MUST_KEEP page, any other token the next open slot
of a RECENT page. The tokens left over get fresh entries after the held ones: first the system tokens' pages
(MUST_KEEP), then the others' (RECENT), P tokens a page, in chunk order. Fresh entries past the table's width, or
past what the pool still has, do not exist; their tokens are dropped and the sequence is exhausted.

The OmniPage invariant under tile_skip (`must_keep_violations`): every live slot of a MUST_KEEP page holds a SYSTEM
token, and every live SYSTEM token sits in a MUST_KEEP page.

Everything here is loops over Python ints; nothing is shared with the vectorised planners.
"""

from __future__ import annotations

from omnijax.chunks.spans import SpanKind
from omnijax.kv.paged import PageClass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def live_slots(page_table_row, valid, page_size: int) -> list[bool]:
    """Table-space live list of one sequence.

    Args:
        page_table_row: the sequence's `M` page ids, -1 = no entry.
        valid: `[N, P]` slot-valid bits of the pool.
        page_size: P.
    """
    live = []
    for page in page_table_row:
        page = int(page)
        for o in range(page_size):
            live.append(page >= 0 and bool(valid[page][o]))
    return live


def count_active(live: list[bool], width: int) -> int:
    """Number of `width`-long runs of `live` (entries for `width = P`, subblocks otherwise) with a live slot."""
    return sum(1 for start in range(0, len(live), width) if any(live[start:start + width]))


def span_pages(live: list[bool], page_size: int) -> int:
    """Page-rounded span in entries: the entry holding the last live slot, plus one (0 when nothing is live)."""
    last = -1
    for j, is_live in enumerate(live):
        if is_live:
            last = j
    return _ceil_div(last + 1, page_size)


def apply_moves(live: list[bool], moves: dict[int, int]) -> list[bool]:
    """The live list after every source is read, cleared, and its destination set."""
    after = list(live)
    for src in moves:
        after[src] = False
    for dst in moves.values():
        after[dst] = True
    return after


def tile_skip_plan(page_table_row, valid, page_class, page_size: int, subblock: int) -> tuple[dict[int, int], bool]:
    """`(moves {src: dst}, accepted)` of tile_skip for one sequence; moves are proposed even when rejected."""
    P = page_size
    live = live_slots(page_table_row, valid, P)
    moves = {}
    for cls in (PageClass.MUST_KEEP, PageClass.SELECTED, PageClass.RECENT):
        movers, holes = [], []
        for e, page in enumerate(page_table_row):
            page = int(page)
            if page < 0 or int(page_class[page]) != cls:
                continue
            n_live = sum(live[e * P:(e + 1) * P])
            if n_live == 0:
                continue
            for j in range(e * P, (e + 1) * P):
                if not live[j]:
                    holes.append(j)
                elif n_live < P:
                    movers.append(j)
        movers.sort(reverse=True)
        holes.sort()
        for src, dst in zip(movers, holes):
            if dst >= src:
                break
            moves[src] = dst
    after = apply_moves(live, moves)
    accepted = bool(moves) and (count_active(after, P) < count_active(live, P)
                                or count_active(after, subblock) < count_active(live, subblock))
    return moves, accepted


def ordered_suffix_plan(page_table_row, valid, page_size: int, min_pages: int) -> tuple[dict[int, int], bool]:
    """`(moves {src: dst}, accepted)` of ordered_suffix for one sequence."""
    P = page_size
    live = live_slots(page_table_row, valid, P)
    end = P * span_pages(live, P)
    old_pages = span_pages(live, P)
    start = None
    for s in range(end):
        remaining = sum(live[s:])  # > 0: s comes before the last live slot
        if old_pages - _ceil_div(s + remaining, P) >= min_pages:
            start = s
    if start is None:
        return {}, False
    moves = {}
    k = 0
    for j in range(start, len(live)):
        if live[j]:
            if start + k != j:
                moves[j] = start + k
            k += 1
    return moves, True


def _drop_empty(row: list[int], source: list, P: int) -> tuple[list[int], list, list[int]]:
    """Removes entries with no live slot: `(row, source, released pages)`; later entries shift left."""
    new_row, new_source, released = [], [], []
    for e, page in enumerate(row):
        if page < 0:
            continue
        slots = source[e * P:(e + 1) * P]
        if any(s is not None for s in slots):
            new_row.append(page)
            new_source.extend(slots)
        else:
            released.append(page)
    pad = len(row) - len(new_row)
    return new_row + [-1] * pad, new_source + [None] * (pad * P), released


def _move(source: list, moves: dict[int, int]) -> list:
    """Gather-then-scatter on a table-space content list."""
    after = list(source)
    for src in moves:
        after[src] = None
    for src, dst in moves.items():
        after[dst] = source[src]
    return after


def tile_skip_mode(page_table_row, valid, page_class, span, page_size: int, subblock: int) -> dict:
    """What `omnipage.tile_skip` leaves for one sequence.

    Returns a dict: `row` (new page-table row), `source` (per new table slot, the input table slot whose token it
    holds, None if dead), `classes` ({page: class} of the pages left in the row), `released` (pages returned to the
    pool) and `moved` (moves applied).
    """
    P = page_size
    row = [int(p) for p in page_table_row]
    live = live_slots(row, valid, P)
    moves, accepted = tile_skip_plan(row, valid, page_class, P, subblock)
    moves = moves if accepted else {}
    source = _move([j if is_live else None for j, is_live in enumerate(live)], moves)
    classes = {page: int(page_class[page]) for page in row if page >= 0}
    receivers = {dst // P for dst in moves.values()}
    for e, page in enumerate(row):
        if page < 0:
            continue
        slots = source[e * P:(e + 1) * P]
        full = all(s is not None for s in slots)
        if full and e in receivers and classes[page] != PageClass.MUST_KEEP:
            classes[page] = int(PageClass.SELECTED)
        if full and all(int(span[row[s // P]][s % P]) == SpanKind.SYSTEM for s in slots):
            classes[page] = int(PageClass.MUST_KEEP)
    new_row, new_source, released = _drop_empty(row, source, P)
    return {"row": new_row, "source": new_source, "released": released, "moved": len(moves),
            "classes": {page: classes[page] for page in new_row if page >= 0}}


def ordered_suffix_mode(page_table_row, valid, page_size: int, min_pages: int) -> dict:
    """What `omnipage.ordered_suffix` leaves for one sequence: as `tile_skip_mode`, without `classes`.

    The plan is made after the empty entries are removed, so `source` refers to the input's table slots.
    """
    P = page_size
    row = [int(p) for p in page_table_row]
    live = live_slots(row, valid, P)
    row1, source1, released1 = _drop_empty(row, [j if is_live else None for j, is_live in enumerate(live)], P)
    moves, accepted = ordered_suffix_plan(row1, valid, P, min_pages)
    moves = moves if accepted else {}
    new_row, new_source, released2 = _drop_empty(row1, _move(source1, moves), P)
    return {"row": new_row, "source": new_source, "released": released1 + released2, "moved": len(moves),
            "compacted_row": row1}


def reserve(table, valid, page_class, seq_slots, free_stack, num_free: int, token_valid, token_span, page_size: int,
            placement: str) -> dict:
    """What `paged.reserve` does to a pool, sequence by sequence.

    Args:
        table: `[B][M]` page-table rows, -1 = no entry.
        valid: `[N][P]` slot-valid bits of the pool.
        page_class: `[N]` page classes.
        seq_slots: `[B]` high-water marks.
        free_stack: the free stack; its top `num_free` entries are free, the top one popped first.
        num_free: free pages.
        token_valid, token_span: `[B][T]` the chunk's tokens to write and their span kinds.
        page_size: P.
        placement: "first_fit" or "by_class".

    Returns:
        A dict: `slots` (`[B][T]` flat slot `page * P + offset`, -1 = not written), `table` (new rows),
        `classes` ({page: class} of the pages popped), `seq_slots`, `num_free` and `lost` (`[B]` tokens dropped).
    """
    P = page_size
    top = int(num_free)
    out = {"slots": [], "table": [], "classes": {}, "seq_slots": [], "lost": []}
    for b, row in enumerate(table):
        row = [int(p) for p in row]
        M = len(row)
        held = _ceil_div(int(seq_slots[b]), P)
        live = live_slots(row, valid, P)

        def group(t):
            return 0 if placement == "by_class" and int(token_span[b][t]) == SpanKind.SYSTEM else 1

        def may_take(j, g):
            page = row[j // P]
            if page < 0 or live[j]:
                return False
            if placement == "first_fit":
                return g == 1
            return int(page_class[page]) == (PageClass.MUST_KEEP if g == 0 else PageClass.RECENT)

        open_slots = {g: [j for j in range(held * P) if may_take(j, g)] for g in (0, 1)}
        tokens = {g: [t for t in range(len(token_valid[b])) if token_valid[b][t] and group(t) == g] for g in (0, 1)}
        overflow = {g: max(len(tokens[g]) - len(open_slots[g]), 0) for g in (0, 1)}
        fresh = {0: _ceil_div(overflow[0], P), 1: _ceil_div(overflow[1], P)}
        first_fresh = {0: held, 1: held + fresh[0]}
        want = {}  # token -> table slot
        for g in (0, 1):
            for k, t in enumerate(tokens[g]):
                if k < len(open_slots[g]):
                    want[t] = open_slots[g][k]
                else:
                    want[t] = first_fresh[g] * P + k - len(open_slots[g])
        granted = min(fresh[0] + fresh[1], max(M - held, 0), top)
        for k in range(granted):
            page = int(free_stack[top - 1])
            top -= 1
            row[held + k] = page
            out["classes"][page] = int(PageClass.MUST_KEEP if k < fresh[0] else PageClass.RECENT)
        slots, lost, mark = [], 0, int(seq_slots[b])
        for t in range(len(token_valid[b])):
            if not token_valid[b][t]:
                slots.append(-1)
                continue
            j = want[t]
            e = j // P
            if e < held + granted and e < M and row[e] >= 0:
                slots.append(row[e] * P + j % P)
                mark = max(mark, j + 1)
            else:
                slots.append(-1)
                lost += 1
        out["slots"].append(slots)
        out["table"].append(row)
        out["seq_slots"].append(mark)
        out["lost"].append(lost)
    out["num_free"] = top
    return out


def must_keep_violations(page_table_row, valid, page_class, span) -> list[str]:
    """Breaches of the tile_skip invariant in one sequence: a live non-SYSTEM slot in a MUST_KEEP page, or a live
    SYSTEM slot in a page of another class (empty when it holds)."""
    bad = []
    for e, page in enumerate(page_table_row):
        page = int(page)
        if page < 0:
            continue
        must_keep = int(page_class[page]) == PageClass.MUST_KEEP
        for o in range(len(valid[page])):
            if not valid[page][o]:
                continue
            system = int(span[page][o]) == SpanKind.SYSTEM
            if must_keep and not system:
                bad.append(f"entry {e} (page {page}, MUST_KEEP) slot {o}: span {int(span[page][o])}")
            elif system and not must_keep:
                bad.append(f"entry {e} (page {page}, {PageClass(int(page_class[page])).name}) slot {o}: SYSTEM")
    return bad


def page_counts(page_table_row, valid, page_size: int, subblock: int) -> dict:
    """One sequence's layout statistics (`omnijax.kv.layout_stats`) counted slot by slot."""
    live = live_slots(page_table_row, valid, page_size)
    return {"retained_cells": sum(live), "physical_span": span_pages(live, page_size) * page_size,
            "active_pages": count_active(live, page_size), "active_subblocks": count_active(live, subblock),
            "table_pages": sum(1 for p in page_table_row if int(p) >= 0)}
