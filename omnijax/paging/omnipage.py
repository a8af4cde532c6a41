"""OmniPage: retention-aware paging with selective migration (OmniTide §6).

Two modes, both run after an eviction inside the streaming scan:

`tile_skip` — for kernels that skip empty pages or subblocks. Class-aware placement (`reserve(placement="by_class")`):
system-prefix tokens go to MUST_KEEP pages only, every other new token to RECENT pages only, so a MUST_KEEP page
holds system tokens and nothing else. After an eviction, survivors in partially filled pages are candidates; each
class (MUST_KEEP, SELECTED, RECENT) is planned on its own, so a destination page always holds entries of the
candidate's class and the MUST_KEEP pages keep exactly the system tokens: candidates sorted by table slot descending
are paired with the same class's holes in active pages sorted ascending, the k-th with the k-th, while the hole lies
before the candidate (the latest survivors fill the earliest holes, so a full pack costs the fewest copies). The plan
is simulated and accepted only if the sequence's active pages or active subblocks decrease. Pages the plan filled
are promoted to SELECTED; full pages of only system tokens become MUST_KEEP (already so when the class-aware placement
wrote them); emptied pages leave the page table and return to the pool.

`ordered_suffix` — for kernels that traverse the physical span. Classes are ignored. Empty pages are dropped from
the table first (no copy); then the shortest suffix of table slots whose packing shortens the page-rounded span by
at least `min_pages` pages is packed toward its start, order preserved; slots before it stay. No such suffix, no
move.

Planning is vectorised over sequences and classes (cumulative sums over table space, one scatter that lists the holes by
rank and a gather that pairs them; no sort and no Python branching on values); a plan is a `MigrationPlan`, applied with
`migration.apply_plan` (gather-then-scatter over all layers, the K/V copy looping over the moves only, so a rejected
plan copies nothing; no `lax.cond`, whose predicate a GPU would have to read back on the host). Exact rules, mirrored by
the plain-Python planner in the tests: see `plan_tile_skip` and `plan_ordered_suffix`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from omnijax.chunks.spans import SpanKind
from omnijax.kv.paged import PageClass, PagedKV, table_slots
from omnijax.paging import migration


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MigrationPlan:
    """Proposed moves `dst [B, S]` (table-space destination per slot, -1 = stays) and `accepted [B]` bool.

    Moves are reported even for rejected sequences; only accepted ones are applied.
    """

    dst: jax.Array
    accepted: jax.Array


def _entry_stats(live: jax.Array, page_size: int, subblock: int) -> tuple[jax.Array, jax.Array]:
    """`(active entries [B], active subblocks [B])` of a table-space live mask `[B, S]`."""
    B, S = live.shape
    per_sub = jnp.any(live.reshape(B, S // subblock, subblock), axis=-1)  # [B, S/subblock]
    per_page = jnp.any(live.reshape(B, S // page_size, page_size), axis=-1)
    return jnp.sum(per_page, axis=1), jnp.sum(per_sub, axis=1)


def _check_subblock(page_size: int, subblock: int) -> int:
    subblock = min(subblock, page_size)
    if subblock <= 0 or subblock & (subblock - 1) or page_size % subblock:
        raise ValueError(f"subblock must be a power of two dividing page_size {page_size}, got {subblock}")
    return subblock


def _listed(member: jax.Array, rank: jax.Array, value: jax.Array, none: int) -> jax.Array:
    """`[B, S]` list whose entry r holds `value` of the member of rank r (ranks distinct); `none` past the members."""
    B, S = member.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
    at = jnp.where(member, rank, S)
    return jnp.full((B, S), none, jnp.int32).at[rows, at].set(jnp.broadcast_to(value, (B, S)), mode="drop")


def plan_tile_skip(kv: PagedKV, subblock: int = 32) -> MigrationPlan:
    """Class-aware selective migration plan.

    Per sequence and per class c in (MUST_KEEP, SELECTED, RECENT): candidates are live slots of class-c entries
    that are active but not full, sorted by table slot descending (c_0 > c_1 > ...); destinations are the non-live
    slots of active class-c entries, sorted ascending (h_0 < h_1 < ...); c_k moves to h_k while h_k < c_k. Accepted
    iff, after the simulated moves, active entries or active `subblock`-sized subblocks are fewer than before.
    """
    P = kv.page_size
    subblock = _check_subblock(P, subblock)
    B, M = kv.page_table.shape
    S = M * P
    live = migration.live_slots(kv)  # [B, S]
    _, exists = table_slots(kv)
    count = jnp.sum(live.reshape(B, M, P), axis=-1)  # [B, M]
    partial = jnp.repeat((count > 0) & (count < P), P, axis=1)  # [B, S] slot's entry is active, not full
    active = jnp.repeat(count > 0, P, axis=1)
    cls = jnp.repeat(kv.page_class[jnp.clip(kv.page_table, 0, kv.num_pages - 1)], P, axis=1)  # [B, S]
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    classes = jnp.asarray([PageClass.MUST_KEEP, PageClass.SELECTED, PageClass.RECENT], cls.dtype)
    of_class = (exists & (cls[None] == classes[:, None, None])).reshape(3 * B, S)  # [3B, S]: each class on its own
    live3, partial3, active3 = (jnp.tile(x, (3, 1)) for x in (live, partial, active))
    cand = live3 & partial3 & of_class
    gap = ~live3 & active3 & of_class
    # One scan ranks both: candidates latest-first (on the flipped rows), holes earliest-first.
    ranks = jnp.cumsum(jnp.concatenate([jnp.flip(cand, axis=1), gap]), axis=1) - 1  # [6B, S]
    cand_rank, hole_rank = jnp.flip(ranks[:3 * B], axis=1), ranks[3 * B:]
    hole = _listed(gap, hole_rank, j, S)  # [3B, S]: k-th hole of each class; S = none
    # c_k goes to h_k while h_k < c_k; as c_k falls and h_k rises, that holds for a prefix of k, so per candidate.
    target = jnp.take_along_axis(hole, jnp.clip(cand_rank, 0, S - 1), axis=1)
    moving3 = cand & (target < j)
    # A slot has one class, so at most one class gives it a destination.
    dst = jnp.max(jnp.where(moving3, target, -1).reshape(3, B, S), axis=0)
    # The holes filled are each class's first (number of its moves).
    arrived = jnp.any((gap & (hole_rank < jnp.sum(moving3, axis=1, keepdims=True))).reshape(3, B, S), axis=0)
    pages_before, subs_before = _entry_stats(live, P, subblock)
    pages_after, subs_after = _entry_stats((live & (dst < 0)) | arrived, P, subblock)
    accepted = (pages_after < pages_before) | (subs_after < subs_before)
    return MigrationPlan(dst=dst, accepted=accepted)


def plan_ordered_suffix(kv: PagedKV, min_pages: int = 1) -> MigrationPlan:
    """Ordered-suffix packing plan (classes ignored).

    Per sequence: E = last live table slot + 1; for each start s < E, packing the r(s) survivors at or after s into
    s, s + 1, ... makes the span ceil((s + r(s)) / P) pages. The largest s that shortens the span by at least
    `min_pages` pages is chosen (the shortest suffix, fewest copies); its k-th survivor moves to s + k. Accepted iff
    such an s exists.
    """
    if min_pages < 1:
        raise ValueError(f"min_pages must be >= 1, got {min_pages}")
    P = kv.page_size
    live = migration.live_slots(kv)
    B, S = live.shape
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    extent = jnp.max(jnp.where(live, j + 1, 0), axis=1)  # [B]
    old_pages = (extent + P - 1) // P
    after = jnp.flip(jnp.cumsum(jnp.flip(live, axis=1), axis=1), axis=1)  # [B, S] live slots at or after s
    new_pages = (j + after + P - 1) // P
    ok = (j < extent[:, None]) & (old_pages[:, None] - new_pages >= min_pages)
    start = jnp.max(jnp.where(ok, j, -1), axis=1)  # [B]; -1 = no suffix qualifies
    accepted = start >= 0
    in_suffix = live & (j >= start[:, None]) & accepted[:, None]
    target = start[:, None] + jnp.cumsum(in_suffix, axis=1) - 1
    dst = jnp.where(in_suffix & (target != j), target, -1).astype(jnp.int32)
    return MigrationPlan(dst=dst, accepted=accepted)


def promote(kv: PagedKV, filled: jax.Array) -> PagedKV:
    """Reclassifies pages after a migration.

    Entries marked in `filled [B, M]` (they received moves) that are now full become SELECTED, unless MUST_KEEP;
    any full entry whose live slots are all system tokens becomes MUST_KEEP.
    """
    B, M = kv.page_table.shape
    N, P = kv.num_pages, kv.page_size
    flat, exists = table_slots(kv)
    live = (kv.valid.reshape(-1)[flat] & exists).reshape(B, M, P)
    full = jnp.all(live, axis=-1) & (kv.page_table >= 0)  # [B, M]
    system = jnp.all(kv.span.reshape(-1)[flat].reshape(B, M, P) == SpanKind.SYSTEM, axis=-1)
    pages = jnp.where(kv.page_table >= 0, kv.page_table, N)
    current = kv.page_class[jnp.clip(pages, 0, N - 1)]
    to_selected = filled & full & (current != PageClass.MUST_KEEP)
    new_class = jnp.where(full & system, PageClass.MUST_KEEP,
                          jnp.where(to_selected, PageClass.SELECTED, current)).astype(kv.page_class.dtype)
    return kv.replace(page_class=kv.page_class.at[pages.reshape(-1)].set(new_class.reshape(-1), mode="drop"))


def tile_skip(kv: PagedKV, subblock: int = 32) -> tuple[PagedKV, jax.Array]:
    """Runs `plan_tile_skip`, applies the accepted moves, promotes filled pages, drops emptied pages.

    Returns `(kv, moved [B] int32)`.
    """
    plan = plan_tile_skip(kv, subblock)
    live_before = migration.live_slots(kv)  # [B, S]
    kv, moved = migration.apply_plan(kv, plan.dst, plan.accepted)
    # Entries that received a move: only a move makes a table slot live here.
    arrived = migration.live_slots(kv) & ~live_before
    filled = jnp.any(arrived.reshape(kv.batch, kv.max_pages, kv.page_size), axis=-1)  # [B, M]
    kv = promote(kv, filled)
    return migration.drop_empty_entries(kv), moved


def ordered_suffix(kv: PagedKV, min_pages: int = 1) -> tuple[PagedKV, jax.Array]:
    """Drops empty pages, runs `plan_ordered_suffix`, applies the accepted moves, drops emptied pages.

    Returns `(kv, moved [B] int32)`.
    """
    kv = migration.drop_empty_entries(kv)
    plan = plan_ordered_suffix(kv, min_pages)
    kv, moved = migration.apply_plan(kv, plan.dst, plan.accepted)
    return migration.drop_empty_entries(kv), moved
