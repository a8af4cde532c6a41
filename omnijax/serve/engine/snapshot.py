"""Session persistence: one sequence's KV pages, cursor, sampling key and last logits, copied out of a batched
`StreamState` (`export_row`) and written back into a row of another (or the same) state (`import_row`).

What a snapshot holds, its checks and its form on disk live in `omnijax.serve.engine.snapshot_format`; this module
re-exports them, so `SessionSnapshot`, `save_snapshot`, `load_snapshot` and the errors are read from here as well.

`import_row` takes the pages from the pool's free stack the way `omnijax.kv.paged.reserve` does (popped from the top,
in table order), so physical page ids may differ while everything a step reads stays the same: the next frame's
logits equal those of an uninterrupted run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.kv.quant_kv import QuantPages
from omnijax.serve.engine.snapshot_format import (
    ARRAY_FIELDS,
    ARRAYS_DIR,
    COUNTER_LIMIT,
    FORMAT,
    FORMAT_VERSION,
    KV_ROW_FIELDS,
    MANIFEST,
    PAGE_AXES,
    READABLE_VERSIONS,
    SCALE_FIELDS,
    STATE_ROW_FIELDS,
    NotEnoughPages,
    SessionSnapshot,
    SnapshotError,
    SnapshotFormatError,
    SnapshotMismatch,
    SnapshotSpec,
    load_snapshot,
    save_snapshot,
)
from omnijax.streaming.step import StreamState

__all__ = ["ARRAY_FIELDS", "ARRAYS_DIR", "COUNTER_LIMIT", "FORMAT", "FORMAT_VERSION", "KV_ROW_FIELDS", "MANIFEST",
           "PAGE_AXES", "READABLE_VERSIONS", "SCALE_FIELDS", "STATE_ROW_FIELDS", "NotEnoughPages", "SessionSnapshot",
           "SnapshotError", "SnapshotFormatError", "SnapshotMismatch", "SnapshotSpec", "check_importable", "export_row",
           "import_row", "load_snapshot", "save_snapshot"]


def _page_fields(kv) -> dict[str, tuple[jax.Array, int]]:
    """{snapshot field: (the pool's array, its page axis)}: `PAGE_AXES`, an int8 pool's k / v as their int8 codes
    and their scales as `k_scale` / `v_scale` (`omnijax.kv.quant_kv.QuantPages`)."""
    out = {name: (getattr(kv, name), axis) for name, axis in PAGE_AXES.items()}
    for scale, name in SCALE_FIELDS.items():
        pages = getattr(kv, name)
        if isinstance(pages, QuantPages):
            out[name], out[scale] = (pages.values, 1), (pages.scale, 1)
    return out


def _check_row(state: StreamState, row: int) -> int:
    B = state.kv.batch
    if isinstance(row, bool) or not 0 <= int(row) < B:
        raise IndexError(f"row {row!r} is out of range for a state of batch {B}")
    return int(row)


def _read_row(state: StreamState, row, pages) -> dict:
    """The arrays of row `row`'s snapshot: the pool's pages `pages [E']` along each page field's page axis, and the
    row's bookkeeping, cursor, key and last logits. One program per padded length `E'` (not one gather program per
    field and session length, as eager `jnp.take` calls compiled)."""
    kv = state.kv
    got = {name: jnp.take(field, pages, axis=axis) for name, (field, axis) in _page_fields(kv).items()}
    got.update({name: getattr(kv, name)[row] for name in KV_ROW_FIELDS})
    got.update({name: getattr(state, name)[row] for name in STATE_ROW_FIELDS})
    return got


_read = cached_jit(_read_row)


def export_row(state: StreamState, row: int, *, meta: dict | None = None) -> SessionSnapshot:
    """Copies sequence `row` of a batched state to the host (the state is not changed).

    Args:
        state: the batched state (e.g. `Engine.state` between ticks).
        row: the sequence.
        meta: JSON data stored with the snapshot.

    Returns:
        The `SessionSnapshot`: the pages of the row's page-table entries (-1 entries skipped, table positions kept),
        the row's bookkeeping, cursor, key and last logits.
    """
    row = _check_row(state, row)
    kv = state.kv
    table = np.asarray(jax.device_get(kv.page_table[row]))  # [M]
    entries = np.flatnonzero(table >= 0).astype(np.int32)  # [E]
    E = len(entries)
    pages = np.zeros(1 << max(E - 1, 0).bit_length(), np.int32)  # [E'] E padded to a power of two, as `import_row`
    pages[:E] = table[entries]  # physical ids, table order; the padding reads page 0, dropped below
    axes = {name: axis for name, (_, axis) in _page_fields(kv).items()}
    got = jax.device_get(_read(state, np.int32(row), pages))
    host = {name: np.array(x[(slice(None),) * axes[name] + (slice(0, E),)] if name in axes else x, copy=True)
            for name, x in got.items()}
    snapshot = SessionSnapshot(entries=entries, **host, spec=SnapshotSpec.of_state(state), meta=meta or {})
    snapshot.check()
    return snapshot


def check_importable(state: StreamState, snapshot: SessionSnapshot, row: int | None = None) -> None:
    """Refuses a snapshot that `import_row` could not write into `state` (into `row`, when given), changing nothing.

    Raises:
        SnapshotError: the snapshot is inconsistent.
        SnapshotMismatch: its spec, or the shape or dtype of a field, differs from the target's (all named).
        NotEnoughPages: the pool has fewer free pages than it holds, or the page-table rows are too narrow.
        ValueError: `row` is not empty (its page-table row names pages). IndexError: `row` is out of range.
    """
    snapshot.check()
    diff = snapshot.spec.mismatches(SnapshotSpec.of_state(state))
    if diff:
        raise SnapshotMismatch("the session snapshot was taken from another pool or model: " + ", ".join(diff))
    kv, E = state.kv, snapshot.num_pages
    bad = []
    for name, (field, axis) in _page_fields(kv).items():
        shape = field.shape[:axis] + (E,) + field.shape[axis + 1:]
        got = getattr(snapshot, name)
        if tuple(got.shape) != shape or got.dtype != field.dtype:
            bad.append(f"{name} {tuple(got.shape)} {got.dtype} (target: {shape} {field.dtype})")
    for name in KV_ROW_FIELDS + STATE_ROW_FIELDS:
        field = getattr(kv, name) if name in KV_ROW_FIELDS else getattr(state, name)
        got = getattr(snapshot, name)
        if tuple(got.shape) != field.shape[1:] or got.dtype != field.dtype:
            bad.append(f"{name} {tuple(got.shape)} {got.dtype} (target: {field.shape[1:]} {field.dtype})")
    if bad:
        raise SnapshotMismatch("the session snapshot does not fit the target state: " + "; ".join(bad))
    if snapshot.table_width > kv.max_pages:
        raise NotEnoughPages(f"the snapshot's pages sit at page-table entries up to {snapshot.table_width - 1}, but "
                             f"the target's page-table rows hold {kv.max_pages} entries")
    free = int(kv.num_free)
    if E > free:
        raise NotEnoughPages(f"the snapshot holds {E} pages but the pool has {free} free")
    if row is not None:
        row = _check_row(state, row)
        held = np.asarray(jax.device_get(kv.page_table[row]))
        if np.any(held >= 0):
            raise ValueError(f"row {row} is not empty: its page table names pages {held[held >= 0].tolist()}; "
                             f"import into an empty row")


def _write_row(state: StreamState, row, entries, live, pages: dict, values: dict) -> StreamState:
    """Pops `sum(live)` pages off the free stack, fills them and points row `row`'s table at them.

    `entries [E']`, `live [E']` bool (padding False, after the live ones) and `pages[name]` (page axis E') are
    padded to a power of two; padded entries write nothing.
    """
    kv = state.kv
    N, M = kv.num_pages, kv.max_pages
    n = entries.shape[0]
    popped = kv.free_stack[jnp.clip(kv.num_free - 1 - jnp.arange(n), 0, N - 1)]  # stack top first, as `reserve`
    ids = jnp.where(live, popped, N)  # [E'] new page of each entry; N (out of range) writes nothing
    new = {}
    for name, (field, axis) in _page_fields(kv).items():
        new[name] = field.at[(slice(None),) * axis + (ids,)].set(pages[name].astype(field.dtype), mode="drop")
    for scale, name in SCALE_FIELDS.items():  # an int8 pool: its codes and scales back into one QuantPages
        if scale in new:
            new[name] = QuantPages(new[name], new.pop(scale), getattr(kv, name).dtype_name)
    table_row = jnp.full((M,), -1, jnp.int32).at[jnp.where(live, entries, M)].set(ids, mode="drop")  # [M]
    new["page_table"] = kv.page_table.at[row].set(table_row)
    new.update({name: getattr(kv, name).at[row].set(values[name]) for name in KV_ROW_FIELDS})
    new["num_free"] = kv.num_free - jnp.sum(live).astype(kv.num_free.dtype)
    rows = {name: getattr(state, name).at[row].set(values[name]) for name in STATE_ROW_FIELDS}
    return StreamState(kv=kv.replace(**new), **rows)


_write = cached_jit(_write_row)
_write_donated = cached_jit(_write_row, donate_argnames="state")


def import_row(state: StreamState, row: int, snapshot: SessionSnapshot, *, donate: bool = False) -> StreamState:
    """Writes a snapshot into the empty row `row` of a batched state; returns the new state.

    The snapshot's pages are popped off the pool's free stack (top first, in table order, class and slots as
    saved) and the row's page-table entries point at them at the snapshot's table positions; the row's bookkeeping,
    cursor, sampling key and last logits are the snapshot's. Every check runs first: on an error nothing changes.

    Args:
        state: the batched state.
        row: the target row; its page-table row must be all -1.
        snapshot: the session.
        donate: donate `state` to the write (it is deleted; saves a copy of the pool).

    Raises:
        See `check_importable`.
    """
    check_importable(state, snapshot, row)
    E = snapshot.num_pages
    size = 1 << max(E - 1, 0).bit_length()  # E padded to a power of two: few compiled variants
    pad = size - E

    def padded(x, axis):
        return np.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])

    entries = padded(np.asarray(snapshot.entries, np.int32), 0)
    live = np.arange(size) < E
    pages = {name: padded(np.asarray(getattr(snapshot, name)), axis) for name, (_, axis) in
             _page_fields(state.kv).items()}
    values = {name: np.asarray(getattr(snapshot, name)) for name in KV_ROW_FIELDS + STATE_ROW_FIELDS}
    write = _write_donated if donate else _write
    return write(state, np.int32(row), entries, live, pages, values)
