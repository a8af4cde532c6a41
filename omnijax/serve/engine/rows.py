"""The engine's per-row state moves and batching, pure: a leaving session's row reset (`reset_row`), rows re-arranged
into another bucket (`take_rows`, `pick_bucket`), rows forked from one row sharing its full pages (`fork_rows`,
checked by `check_fork`), and the served frames stacked into one `[B, T]` chunk (`batch_frames`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.kept_executables import cached_jit
from omnijax.kv import page_sharing
from omnijax.kv import paged as paged_lib
from omnijax.serve.engine.snapshot import NotEnoughPages
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.step import StreamState


def reset_row(state: StreamState, row: int | jax.Array) -> StreamState:
    """Frees every page of sequence `row` and resets its per-row state (a session leaving; pure, jittable).

    Its pages go back to the pool (`release_pages`: free stack, class FREE, slots invalid); its page-table row
    becomes -1 and `seq_slots`, `next_order`, `exhausted`, `dropped` and `next_pos` return to their initial values.
    Other rows are untouched.
    """
    kv = state.kv
    kv = paged_lib.release_pages(kv, kv.page_table[row])  # [M] ids, -1 ignored
    kv = kv.replace(page_table=kv.page_table.at[row].set(-1), seq_slots=kv.seq_slots.at[row].set(0),
                    next_order=kv.next_order.at[row].set(0), exhausted=kv.exhausted.at[row].set(False),
                    dropped=kv.dropped.at[row].set(0))
    return dataclasses.replace(state, kv=kv, next_pos=state.next_pos.at[row].set(0),
                               counts=state.counts.at[row].set(0), seen=state.seen.at[row].set(False))


def fork_rows(state: StreamState, src: int | jax.Array, dst: jax.Array, *, share: bool) -> StreamState:
    """Rows `dst [K]` (empty) become copies of row `src` (pure, jittable; `share` static): its cache through
    `omnijax.kv.page_sharing.fork_rows` (full pages shared when `share`, the others copied) and its cursor, sampling
    key, last logits and penalty history. A shared page's reference is dropped when its row is reset (`reset_row`).
    """
    kv = page_sharing.fork_rows(state.kv, src, dst, share=share)
    copy = lambda x: x.at[dst].set(x[src])  # noqa: E731
    return StreamState(kv=kv, next_pos=copy(state.next_pos), key=copy(state.key),
                       last_logits=copy(state.last_logits), counts=copy(state.counts), seen=copy(state.seen))


def check_fork(state: StreamState, src: int, dst: Sequence[int], stream: StreamConfig, share: bool
               ) -> tuple[bool, int, int]:
    """Checks a fork of row `src` into the rows `dst` before it runs; returns `(share, shared pages, copied pages
    per fork)`, `share` False where `omnijax.kv.page_sharing.shareable` refuses the policy or paging mode.

    Raises ValueError (a destination that is the source, repeated, or holds pages) or
    `omnijax.serve.engine.snapshot.NotEnoughPages` (the copies need more free pages than the pool has).
    """
    table = np.asarray(state.kv.page_table)
    if src in dst or len(set(dst)) != len(dst):
        raise ValueError(f"fork destinations {list(dst)} must be distinct rows other than the source row {src}")
    busy = [r for r in dst if np.any(table[r] >= 0)]
    if busy:
        raise ValueError(f"fork destination rows {busy} hold pages; fork into empty rows")
    share = share and page_sharing.shareable(stream.policy, stream.paging.mode) is None
    row = table[src][table[src] >= 0]  # as `page_sharing.fork_plan`, on the host: full pages shared, others copied
    shared = int(np.sum(np.all(np.asarray(state.kv.valid)[row], axis=1))) if share else 0
    copied = len(row) - shared
    free = int(state.kv.num_free)
    if copied * len(dst) > free:
        raise NotEnoughPages(f"{len(dst)} forks copy {copied} pages each ({shared} shared) but the pool has {free} "
                             f"free")
    return share, shared, copied


def take_rows(state: StreamState, rows: Sequence[int] | np.ndarray) -> StreamState:
    """Re-arranges the per-row state: new row i takes old row `rows[i]`, or a fresh empty row where it is -1.

    Grows or shrinks the batch (`len(rows)` is the new batch). The pool is untouched (its arrays pass through as
    they are), so old rows left out must own no pages (reset them first). The per-row fields move in one compiled
    program per pair of batch sizes (`_pick_rows`), not an eager gather per field.
    """
    rows = np.asarray(rows, np.int32)  # [B_new]
    kv = state.kv
    fields = (kv.page_table, kv.seq_slots, kv.next_order, kv.exhausted, kv.dropped, state.next_pos, state.key,
              state.last_logits, state.counts, state.seen)
    (page_table, seq_slots, next_order, exhausted, dropped, next_pos, key, last_logits, counts,
     seen) = _pick_rows(fields, rows)
    kv = kv.replace(page_table=page_table, seq_slots=seq_slots, next_order=next_order, exhausted=exhausted,
                    dropped=dropped)
    return StreamState(kv=kv, next_pos=next_pos, key=key, last_logits=last_logits, counts=counts, seen=seen)


# what a fresh row holds in each of `take_rows`' fields, in its order
_FRESH = (-1, 0, 0, False, 0, 0, 0, 0, 0, False)


@cached_jit
def _pick_rows(fields: tuple[jax.Array, ...], rows: jax.Array) -> tuple[jax.Array, ...]:
    """`fields` (each `[B_old, ...]`) re-arranged to `rows [B_new]`: row i takes old row `rows[i]`, or the field's
    fresh value (`_FRESH`) where `rows[i]` is -1."""
    src, keep = jnp.maximum(rows, 0), rows >= 0
    return tuple(jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x[src], jnp.asarray(fill, x.dtype))
                 for x, fill in zip(fields, _FRESH))


def compact_rows(slots: Mapping[str, int], bucket: int, old_batch: int) -> tuple[dict[str, int], np.ndarray] | None:
    """Rows for a state moving from `old_batch` rows to `bucket`: sessions already in a row below `bucket` keep it,
    the others (past the bucket, or opened since and not yet in the state) take the free rows in order. Returns the
    new slots (in `slots`' order) and, for `take_rows`, each new row's old row (-1: a fresh row), or None when
    nothing moves (same batch, every session in a row of it)."""
    if bucket == old_batch and all(r < bucket for r in slots.values()):
        return None
    placed = {s: r for s, r in slots.items() if r < bucket}
    free = iter(r for r in range(bucket) if r not in set(placed.values()))
    for s, r in slots.items():
        if r >= bucket:
            placed[s] = next(free)
    rows = np.full((bucket,), -1, np.int32)  # [bucket]
    for s, r in placed.items():
        rows[r] = slots[s] if slots[s] < old_batch else -1
    return {s: placed[s] for s in slots}, rows


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `n` sessions (None when none does)."""
    return next((b for b in buckets if b >= n), None)


def batch_frames(frames: Mapping[str, Chunk], slots: Mapping[str, int], B: int, T: int, A: int,
                 default_row: np.ndarray | None) -> Chunk:
    """Stacks the frames of the served sessions into their rows (`slots`) of a `[B, T]` chunk (A position axes);
    other rows are empty. `default_row` (`[1, ROW_WIDTH]`, a per-row strategy's default): every row carries
    sampling settings, the frame's own where it has them (one program for every mix)."""
    z = lambda dtype: np.zeros((B, T), dtype)  # noqa: E731
    out = dict(token_ids=z(np.int32), valid=z(bool), positions=np.zeros((A, B, T), np.int32), unit=z(np.int32),
               span=z(np.int32), offset=z(np.int32), answer_tokens=np.zeros((B,), np.int32),
               answer_unit=np.zeros((B,), np.int32), advance=np.zeros((B,), np.int32))
    with_embeds = [c for c in frames.values() if c.embeds is not None]
    if with_embeds:
        D = with_embeds[0].embeds.shape[-1]
        out["embeds"] = np.zeros((B, T, D), with_embeds[0].embeds.dtype)
        out["embed_mask"] = z(bool)
    if default_row is not None:
        out["sampling"] = np.array(np.broadcast_to(default_row, (B, default_row.shape[-1])), np.float32)
    with_levels = [c for c in frames.values() if c.deepstack is not None]
    if with_levels:
        n, D = with_levels[0].deepstack.shape[0], with_levels[0].deepstack.shape[-1]
        out["deepstack"] = np.zeros((n, B, T, D), with_levels[0].deepstack.dtype)
    for s, c in frames.items():
        r = slots[s]
        for name in ("token_ids", "valid", "unit", "span", "offset", "answer_tokens", "answer_unit", "advance"):
            out[name][r] = getattr(c, name)[0]
        out["positions"][:, r] = c.positions[:, 0]
        if c.embeds is not None:
            out["embeds"][r], out["embed_mask"][r] = c.embeds[0], c.embed_mask[0]
        if c.deepstack is not None:
            out["deepstack"][:, r] = c.deepstack[:, 0]
        if c.sampling is not None and "sampling" in out:
            out["sampling"][r] = c.sampling[0]
    return Chunk(**out)
