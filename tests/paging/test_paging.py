"""Paging modes on real caches: a migration never changes what attention sees or any survivor's metadata; class-aware
placement and promotion; every mode streams exactly like native while shortening the layout. (Planner rules against
a plain-Python planner on random layouts: `test_omnipage_plans.py`.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import pad_chunk, stack_chunks, text_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.kept_executables import cached_jit
from omnijax.kv import attention, paged
from omnijax.kv.paged import PageClass
from omnijax.models.config import TINY_OMNI
from omnijax.paging import PAGING_MODES, Paging, eager, migration, omnipage
from omnijax.retention import OmniPick, TokenSliding, base
from tests._support import reference_paging as ref


@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


# The cache operations under test run here as one compiled program each, as they do inside the streaming step: run
# op by op they would compile hundreds of one-operation programs per test.
_view = cached_jit(base.sequence_view)
_compact = cached_jit(eager.compact)
_eager_plan = cached_jit(eager.plan)
_apply_plan = cached_jit(migration.apply_plan, static_argnames="chunk")
_plan_tile_skip = cached_jit(omnipage.plan_tile_skip, static_argnames="subblock")
_plan_ordered_suffix = cached_jit(omnipage.plan_ordered_suffix, static_argnames="min_pages")
_tile_skip = cached_jit(omnipage.tile_skip, static_argnames="subblock")
_ordered_suffix = cached_jit(omnipage.ordered_suffix, static_argnames="min_pages")
_layout_stats = cached_jit(omnijax.kv.layout_stats, static_argnames="subblock")
_reserve = jax.jit(lambda kv, token_valid, meta, placement: paged.reserve(kv, token_valid, paged.SlotMeta(*meta),
                                                                          placement=placement),
                   static_argnames="placement")


@cached_jit(static_argnames=("num_layers", "num_pages", "page_size", "position_axes"))
def _filled(free_stack, k, v, meta, keep, *, num_layers, num_pages, page_size, position_axes):
    """A cache on the pool order `free_stack` holding one sequence of `k`/`v` `[L, 1, n, G, d]` with slot metadata
    `meta` (the `SlotMeta` fields as a tuple), then only the slots of `keep [1, M * P]` (page-table order) that are
    live."""
    meta = paged.SlotMeta(*meta)
    kv = paged.init(num_layers=num_layers, num_kv_heads=k.shape[3], head_dim=k.shape[4], num_pages=num_pages,
                    page_size=page_size, batch=1, position_axes=position_axes)
    kv, _ = paged.append(kv.replace(free_stack=free_stack), k, v, jnp.ones(k.shape[1:3], bool), meta)
    kv, _, _ = base.apply(kv, base.sequence_view(kv).live & keep, jnp.asarray([k.shape[2]]), reindex=False,
                          rope=(1e4, None))
    return kv


@cached_jit(static_argnames="impl")
def _attend_all(q, cache, q_order, impl="xla"):
    """Layer 1's attention of `q [1, T, H, d]` at write order `q_order` over the whole cache."""
    view = attention.CacheView(write_slots=jnp.full(q.shape[:2], -1, jnp.int32), page_table=cache.page_table,
                               slot_valid=cache.valid, slot_order=cache.order,
                               q_order=jnp.full(q.shape[:2], q_order, jnp.int32))
    return attention.attend(q, cache.k[1], cache.v[1], view, impl=impl)


def _survivors(kv):
    """Each live slot's (order, positions, unit, span, offset) sorted by order: layout-independent content."""
    view = _view(kv)
    live = np.asarray(view.live[0])
    rows = [(int(view.order[0, s]), tuple(np.asarray(view.pos[:, 0, s]).tolist()), int(view.unit[0, s]),
             int(view.span[0, s]), int(view.offset[0, s])) for s in np.flatnonzero(live)]
    return sorted(rows)


def test_compaction_keeps_content_and_attention_and_releases_pages():
    rng = np.random.default_rng(0)
    free_stack = jnp.asarray(rng.permutation(10).astype(np.int32))
    n = 29
    k = jnp.asarray(rng.standard_normal((2, 1, n, 2, 8)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((2, 1, n, 2, 8)).astype(np.float32))
    z = np.zeros((1, n), np.int32)
    meta = (np.arange(n)[None, None], z + np.arange(n) // 5, z + 6, z)  # positions, units, spans, offsets
    keep = jnp.asarray(rng.random((1, 10 * 4)) < 0.35)
    kv = _filled(free_stack, k, v, meta, keep, num_layers=2, num_pages=10, page_size=4, position_axes=1)
    before = _survivors(kv)
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 8)).astype(np.float32))

    packed, moved = _compact(kv)
    assert _survivors(packed) == before  # positions, units, spans and offsets travel with their keys
    np.testing.assert_allclose(np.asarray(_attend_all(q, packed, n)), np.asarray(_attend_all(q, kv, n)), atol=1e-6)
    kept = len(before)
    stats_before, stats_after = _layout_stats(kv, 2), _layout_stats(packed, 2)
    assert int(stats_after.physical_span[0]) == -(-kept // 4) * 4 <= int(stats_before.physical_span[0])
    assert int(stats_after.free_pages) == 10 - -(-kept // 4) and int(moved[0]) > 0
    assert int(stats_after.retained_cells[0]) == kept
    # Packing an already packed cache moves nothing.
    _, again = _compact(packed)
    assert int(again[0]) == 0


def _fragmented_cache(seed, *, page_size=8, num_pages=12, keep=0.35, classes=True):
    """One sequence of 70 tokens (3 position axes, 2 layers) on a permuted pool, then random evictions; page classes
    random among MUST_KEEP / SELECTED / RECENT when `classes`."""
    rng = np.random.default_rng(seed)
    free_stack = jnp.asarray(rng.permutation(num_pages).astype(np.int32))
    n = 70
    k = jnp.asarray(rng.standard_normal((2, 1, n, 2, 8)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((2, 1, n, 2, 8)).astype(np.float32))
    z = np.zeros((1, n), np.int32)
    pos = rng.integers(0, 50, (3, 1, n)).astype(np.int32)
    meta = (pos, z + np.arange(n) // 9, z + np.arange(n) % 7, z + np.arange(n))  # positions, units, spans, offsets
    draw = jnp.asarray(rng.random((1, num_pages * page_size)) < keep)
    kv = _filled(free_stack, k, v, meta, draw, num_layers=2, num_pages=num_pages, page_size=page_size,
                 position_axes=3)
    if classes:  # pages in the table get random classes; free pages stay FREE
        held = np.asarray(kv.page_class) != PageClass.FREE
        cls = np.where(held, rng.integers(1, 4, num_pages), PageClass.FREE).astype(np.int8)
        kv = kv.replace(page_class=jnp.asarray(cls))
    return kv


def _survivor_classes(kv):
    """{order: class of the page holding it} for every live slot of sequence 0."""
    P = kv.page_size
    table, valid, order = map(np.asarray, (kv.page_table[0], kv.valid, kv.order))
    cls = np.asarray(kv.page_class)
    return {int(order[p, s]): int(cls[p]) for p in table if p >= 0 for s in range(P) if valid[p, s]}


@pytest.mark.parametrize("mode", ["tile_skip", "ordered_suffix"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_migration_keeps_attention_positions_units_and_classes(mode, seed):
    kv = _fragmented_cache(seed)
    plan = _plan_tile_skip(kv, 4) if mode == "tile_skip" else _plan_ordered_suffix(kv, 1)
    assert bool(plan.accepted[0])  # these layouts are fragmented enough for both modes
    moved_kv, moved = _apply_plan(kv, plan.dst, plan.accepted)
    assert int(moved[0]) == int(np.sum(np.asarray(plan.dst) >= 0)) > 0
    assert _survivors(moved_kv) == _survivors(kv)  # every survivor's positions, unit, span and offset travel with it
    if mode == "tile_skip":  # moves stay inside one class, so no survivor changes class
        assert _survivor_classes(moved_kv) == _survivor_classes(kv)
    rng = np.random.default_rng(seed + 100)
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 8)).astype(np.float32))
    for impl in ("reference", "xla"):
        np.testing.assert_allclose(np.asarray(_attend_all(q, moved_kv, 70, impl=impl)),
                                   np.asarray(_attend_all(q, kv, 70, impl=impl)), atol=1e-6, rtol=0)
    # The full mode (promotion, dropping emptied pages) keeps content and attention too, and gives pages back.
    run = _tile_skip(kv, 4) if mode == "tile_skip" else _ordered_suffix(kv, 1)
    after, _ = run
    assert _survivors(after) == _survivors(kv)
    table = np.asarray(after.page_table[0])
    held = table[table >= 0]
    assert len(set(held.tolist())) == len(held) and int(after.num_free) + len(held) == kv.num_pages
    free = np.asarray(after.free_stack)[:int(after.num_free)]
    assert not set(free.tolist()) & set(held.tolist())
    assert (np.asarray(after.page_class)[free] == PageClass.FREE).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_copy_equals_all_at_once_for_every_planner(seed):
    """K/V are copied a few moves per step; every planner's moves go backwards in table order, so stepping through
    them in ascending source order equals moving them all at once (checked here with 2-slot steps)."""
    kv = _fragmented_cache(seed, keep=0.6)
    S = kv.page_table.shape[1] * kv.page_size
    plans = {"tile_skip": _plan_tile_skip(kv, 4).dst, "ordered_suffix": _plan_ordered_suffix(kv, 1).dst,
             "eager": _eager_plan(kv)}
    for name, dst in plans.items():
        dst = np.asarray(dst)
        j = np.broadcast_to(np.arange(S), dst.shape)
        assert (dst >= 0).sum() > 2, name  # enough moves for several steps
        assert (dst[dst >= 0] < j[dst >= 0]).all(), f"{name}: a move goes forward in table order"
        accepted = jnp.ones((1,), bool)
        stepped, n_stepped = _apply_plan(kv, jnp.asarray(dst), accepted, chunk=2)
        at_once, n_once = _apply_plan(kv, jnp.asarray(dst), accepted, chunk=S)
        assert int(n_stepped[0]) == int(n_once[0]) == (dst >= 0).sum()
        for field in ("k", "v", "valid", "order"):
            np.testing.assert_array_equal(np.asarray(getattr(stepped, field)), np.asarray(getattr(at_once, field)))
        assert _survivors(stepped) == _survivors(kv)


def test_tile_skip_promotes_filled_pages_and_system_pages():
    P = 4
    n = 4 * P
    z = np.zeros((1, n), np.int32)
    span = np.where(np.arange(n) < P, SpanKind.SYSTEM, SpanKind.IMAGE)[None]
    meta = (np.arange(n)[None, None], z, span, z)  # positions, units, spans, offsets
    # Page 0: the whole system prompt. Page 1 loses two tokens, page 3 keeps two: those fill page 1's holes.
    keep = jnp.ones((1, 6 * P), bool).at[0, jnp.asarray([5, 6, 8, 9, 10, 11, 12, 13])].set(False)
    kv = _filled(jnp.arange(5, -1, -1, dtype=jnp.int32), jnp.zeros((1, 1, n, 1, 2)), jnp.zeros((1, 1, n, 1, 2)),
                 meta, keep, num_layers=1, num_pages=6, page_size=P, position_axes=1)
    out, moved = _tile_skip(kv, 2)
    assert int(moved[0]) == 2
    np.testing.assert_array_equal(np.asarray(out.page_table[0, :3]), [0, 1, -1])
    assert int(out.page_class[0]) == PageClass.MUST_KEEP and int(out.page_class[1]) == PageClass.SELECTED
    assert int(out.num_free) == 4 and int(out.seq_slots[0]) == 2 * P


def test_class_placement_never_writes_into_selected_pages():
    P = 4
    n = 3 * P
    z = np.zeros((1, n), np.int32)
    meta = (np.arange(n)[None, None], z, z + SpanKind.IMAGE, z)  # positions, units, spans, offsets
    keep = jnp.ones((1, 6 * P), bool).at[0, jnp.asarray([1, 2, 5, 6])].set(False)  # holes in pages 0 and 1
    kv = _filled(jnp.arange(5, -1, -1, dtype=jnp.int32), jnp.zeros((1, 1, n, 1, 2)), jnp.zeros((1, 1, n, 1, 2)),
                 meta, keep, num_layers=1, num_pages=6, page_size=P, position_axes=1)
    kv = kv.replace(page_class=kv.page_class.at[0].set(PageClass.SELECTED))
    new = (np.asarray([[[20, 21, 22]]]), np.ones((1, 3), np.int32), np.full((1, 3), SpanKind.TEXT, np.int32),
           np.zeros((1, 3), np.int32))  # positions, units, spans, offsets of three text tokens
    _, slots, _ = _reserve(kv, jnp.ones((1, 3), bool), new, placement="by_class")
    np.testing.assert_array_equal(np.asarray(slots[0]), [5, 6, 12])  # page 1's holes, then a fresh page
    _, slots, _ = _reserve(kv, jnp.ones((1, 3), bool), new, placement="first_fit")
    np.testing.assert_array_equal(np.asarray(slots[0]), [1, 2, 5])
    with pytest.raises(ValueError, match="unknown placement"):
        paged.reserve(kv, jnp.ones((1, 3), bool), paged.SlotMeta(*new), placement="best_fit")


def test_every_paging_mode_streams_like_native(model):
    # One policy keeps the module's compile count (and CI time) down; the planners are policy-independent and are
    # checked on random layouts in test_omnipage_plans.py.
    policy = OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6)
    rng = np.random.default_rng(1)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i) for i in range(14)])
    native = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, subblock=4)
    for mode in PAGING_MODES[1:]:
        other = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, subblock=4,
                               paging=Paging(mode))
        np.testing.assert_allclose(np.asarray(other.logits), np.asarray(native.logits), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(other.stats.layout.retained_cells),
                                      np.asarray(native.stats.layout.retained_cells))
        assert int(np.asarray(other.stats.moved).sum()) > 0, mode
        assert not bool(np.asarray(other.stats.layout.exhausted).any()), mode
        if mode == "eager":  # the oracle: never a longer span than native
            assert (np.asarray(other.stats.layout.physical_span)
                    <= np.asarray(native.stats.layout.physical_span)).all()
    assert int(np.asarray(native.stats.moved).sum()) == 0
    with pytest.raises(ValueError, match="unknown paging mode"):
        omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, paging="lazy")
    with pytest.raises(ValueError, match="min_pages"):
        Paging("ordered_suffix", min_pages=0)


def _chunk(spans, units, seed, answer_tokens=0):
    """A batch-1 chunk of random token ids whose tokens have the given span kinds and unit ids."""
    rng = np.random.default_rng(seed)
    chunk = text_chunk(rng.integers(0, 300, len(spans)), answer_tokens=answer_tokens)
    return dataclasses.replace(chunk, span=np.asarray([spans], np.int32), unit=np.asarray([units], np.int32),
                               answer_unit=np.asarray([max(units) + 1], np.int32))


def _system_session(system, seed):
    """A batch-1 session with system-prefix tokens: a system chunk of `system` tokens, then a chunk that ends the
    system prompt and starts unit 1, text units (some asking for an answer), and a late system chunk."""
    spans = [[SpanKind.SYSTEM] * system, [SpanKind.SYSTEM] * 3 + [SpanKind.TEXT] * 7]
    units = [[0] * system, [0] * 3 + [1] * 7]
    for u in range(2, 12):
        spans.append([SpanKind.TEXT] * 10)
        units.append([u] * 10)
    spans.insert(7, [SpanKind.SYSTEM] * 4)  # a later system chunk: fills the partly filled MUST_KEEP page
    units.insert(7, [0] * 4)
    return [_chunk(s, u, seed * 100 + i, answer_tokens=2 if i % 4 == 3 else 0)
            for i, (s, u) in enumerate(zip(spans, units))]


def _batched(sessions):
    """Chunk by chunk, the sessions side by side as one batch (positions `[A, B, T]`, the rest `[B, ...]`), stacked."""
    def side_by_side(*row):
        return dataclasses.replace(row[0], **{
            f.name: np.concatenate([np.asarray(getattr(c, f.name)) for c in row], axis=int(f.name == "positions"))
            for f in dataclasses.fields(row[0]) if getattr(row[0], f.name) is not None})
    return stack_chunks([side_by_side(*row) for row in zip(*[[pad_chunk(c, 10) for c in s] for s in sessions])])


def check_must_keep_invariant(kv, note=""):
    """Every live slot of a MUST_KEEP page is SYSTEM and every live SYSTEM slot sits in a MUST_KEEP page, in every
    sequence; MUST_KEEP pages are only ever in one table."""
    table, valid, page_class, span = map(np.asarray, (kv.page_table, kv.valid, kv.page_class, kv.span))
    for b in range(table.shape[0]):
        bad = ref.must_keep_violations(table[b], valid, page_class, span)
        assert not bad, f"{note} sequence {b}: {bad}"


@pytest.mark.parametrize("policy", [OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6),
                                    TokenSliding(window=24, high_watermark=40)])
def test_tile_skip_keeps_system_tokens_and_only_them_in_must_keep_pages(model, policy):
    """After every chunk of two sessions with system prefixes sharing a pool under tile_skip (OmniPick keeps the
    prefix, TokenSliding evicts it too): MUST_KEEP pages hold the system tokens and nothing else, the layout
    statistics equal a slot-by-slot count, and the logits equal native's (placement and migration change the
    physical layout only)."""
    P, sub, pages = 8, 4, 24
    chunks = _batched([_system_session(5, 0), _system_session(9, 1)])
    tau = 2
    native = omnijax.stream(model, chunks, policy=policy, page_size=P, num_pages=pages, subblock=sub, impl="xla",
                            max_answer_tokens=tau)
    # The tile_skip session runs chunk by chunk from the carried state (the same chunk step as a whole-session scan,
    # compiled once for a one-chunk call instead of a second time for the scan): the invariant and the page counts
    # after every chunk (and its answer), then the whole session against native's.
    state = omnijax.init_state(model.config, num_pages=pages, page_size=P, batch=2)
    moved = 0
    per_chunk = []
    for c in range(chunks.token_ids.shape[0]):
        one = jax.tree.map(lambda x: x[c:c + 1], chunks)
        out = omnijax.stream(model, one, policy=policy, impl="xla", state=state, subblock=sub, paging="tile_skip",
                             max_answer_tokens=tau)
        state, stats = out.state, out.stats
        kv = state.kv
        check_must_keep_invariant(kv, f"chunk {c}")
        table, valid = np.asarray(kv.page_table), np.asarray(kv.valid)
        for b in range(2):
            counts = ref.page_counts(table[b], valid, P, sub)
            for name, value in counts.items():
                assert int(np.asarray(getattr(stats.layout, name))[0, b]) == value, (c, b, name)
        held = table[table >= 0]
        assert len(set(held.tolist())) == len(held) and int(kv.num_free) + len(held) == pages
        np.testing.assert_allclose(np.asarray(out.logits)[0], np.asarray(native.logits)[c], atol=1e-5, rtol=0)
        per_chunk.append(jax.tree.map(np.asarray, (out.logits, out.tokens, stats.layout.retained_cells, stats.evicted,
                                                   stats.layout.exhausted)))
        moved += int(np.asarray(stats.moved).sum())
        system = (valid & (np.asarray(kv.span) == SpanKind.SYSTEM)).sum()
        if c == 1:
            assert system == 5 + 3 + 9 + 3  # the whole system prompt so far, each sequence's in MUST_KEEP pages
    assert moved > 0
    logits, tokens, retained, evicted, exhausted = (np.concatenate(parts) for parts in zip(*per_chunk))
    np.testing.assert_allclose(logits, np.asarray(native.logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(tokens, np.asarray(native.tokens))
    np.testing.assert_array_equal(retained, np.asarray(native.stats.layout.retained_cells))
    assert int(evicted.sum()) > 0
    assert not bool(exhausted.any())


def test_must_keep_placement_exhaustion_is_reported(model):
    """A chunk of 4 system and 4 text tokens fits one page first-fit, but tile_skip keeps them on two pages: with a
    one-page pool the text tokens are not cached, and the stream says so."""
    chunks = stack_chunks([_chunk([SpanKind.SYSTEM] * 4 + [SpanKind.TEXT] * 4, [0] * 4 + [1] * 4, 0)])
    native = omnijax.stream(model, chunks, page_size=8, num_pages=1)
    assert not bool(native.state.kv.exhausted[0])
    with pytest.warns(RuntimeWarning, match="ran out"):
        tiled = omnijax.stream(model, chunks, page_size=8, num_pages=1, paging="tile_skip")
    kv = tiled.state.kv
    assert bool(kv.exhausted[0]) and int(kv.dropped[0]) == 4
    assert bool(tiled.stats.layout.exhausted[0, 0]) and int(tiled.stats.layout.dropped[0, 0]) == 4
    assert int(kv.page_class[0]) == PageClass.MUST_KEEP and int(np.asarray(kv.valid).sum()) == 4
    check_must_keep_invariant(kv)
    # The one page more a tile_skip session may need is what `Paging.extra_pages` says.
    assert [Paging(mode).extra_pages for mode in PAGING_MODES] == [0, 1, 0, 0]
    roomy = omnijax.stream(model, chunks, page_size=8, num_pages=1 + Paging("tile_skip").extra_pages,
                           paging="tile_skip")
    assert not bool(roomy.state.kv.exhausted[0]) and int(np.asarray(roomy.state.kv.valid).sum()) == 8
    check_must_keep_invariant(roomy.state.kv)
