"""What `omnijax.Session` does with `StreamConfig(recall=Recall(...))` (issue 40): capture what retention evicts into
a host tier, and bring the relevant units back when a question comes.

Capture. The compiled step stays the one `chunk_step` every path runs (compiled with `recall=None` and
`keep_written=True`: the program without recall plus a record of the chunk's tokens as the prefill cached them,
`ChunkOutput.written`). Before each step the session copies the cache (the step's input is donated and updated in
place); after it, `omnijax.kv.host_tier.capture_evicted` compares the two by write order and stores every evicted
token, exactly as it was cached, in the tier (one `UnitKV` record per unit, or per piece of a unit a policy evicted
in several steps; with `Recall(block=B)` each record is cut into blocks of the write-order grid,
`omnijax.kv.host_tier.split_blocks`, stored, scored and recalled on their own). A token the step wrote and evicted
is read from the step's record: its slot may since hold a survivor the relayout moved there, or an answer token.
The copy is one device copy of the cache per chunk; a step that evicted nothing is not read back.

Question time. A chunk with tokens that asks for an answer (`answer_tokens > 0`) is a question: before its step,
the question's queries are computed against the current cache (a forward of the chunk through a throwaway copy of
the cache, every layer's queries of every token), the stored units are scored (`Recall.scoring`: by default
`omnijax.kv.host_tier_scoring.score_units_mass` on the queries and keys before RoPE; "max" and "mean" read the queries
averaged over the question's tokens, `omnijax.kv.host_tier_scoring.score_units`), the best ones within `Recall.budget`
cells and `Recall.top_units` units are selected and written back as cache pages
(`omnijax.retention.recall.recall_into`), and the step answers over them. The programs this runs outside the step
(the question's queries, the re-laying shift, the release and the deferred trim) are in
`omnijax.streaming.recall_ops`.
`Session.recall(chunk, scores=...)` does the same ahead of `feed`, optionally with forced scores.

Placement. A policy that never re-indexes (`reindex = False`: SinkWindow) leaves every evicted unit's own positions
free, so with `Recall(placement="own")` (the default) its units come back there with their keys as stored: a
question that recalls everything attends over exactly the keys and values a full-context (`NoSlide`) cache holds,
when no token was written after an eviction. With `placement="compact"` (`Recall.preset`'s) it is re-laid as a
re-indexing policy is (next paragraph).

A re-indexing policy (StreamingLLM, OmniPick, UnitFIFO, ...) has since closed the freed positions up, so a recalled
unit has no free place of its own, and OmniPick makes it worse: it evicts a unit in pieces (its sinks and text budget
stay, the rest goes; later the rest goes too), so a recalled piece laid after the cursor is cut off from, and out of
order with, the part of its unit still cached. Recall therefore re-lays the whole sequence: every token's
full-context position (`UnitKV.vpos`, and the same for every cached token, tracked per write order by `track` from
each chunk's positions and advance, which no trim changes) is known; the cached tokens and the recalled ones are
placed where re-indexing would have put them had the policy never evicted the recalled ones (the re-indexing rule
of `omnijax.retention.base.freed_below` applied to their full-context positions: values covered by none of them are
closed up), keys of every token that moves re-rotated by its delta exactly as that rule's re-indexing rotates them.
A recalled piece thus rejoins the cached part of its unit, at its own offset; recalling everything restores the
full-context positions exactly (logits equal `NoSlide`'s up to the float32 re-rotation of the moved keys). The
alternative, recalling the whole unit after the cursor and hiding the cached copy, keeps the unit in one piece but
still moves it after newer units, so the question would read it at a distance it never had; re-laying costs one
rotation pass over the cache's keys per question and is undone by the release (the release's own re-indexing).

What recall cannot restore. The recalled keys and values are exactly those cached before the eviction, but a token
written while its context was evicted was computed without it: from the second layer on, its keys and values are
not a full-context session's (the first layer's are, as they depend on the token and its position alone). Recalling
everything therefore equals `NoSlide` only at a question whose cached tokens were all written over their whole
context: the first question after the step that first evicted, or every chunk when everything is recalled ahead of
each one (`Session.recall(chunk, scores=...)`). A later question reads the intervening tokens as they were computed
(on the synthetic audiovisual sessions, 0.01-0.05 in the logits at the second question; with one layer, or with
recall ahead of every chunk, every question equals `NoSlide` to float32 rounding:
`tests/streaming/test_recall_questions.py`).

After the answer (`Recall.keep=False`) the recalled tokens still cached are invalidated (the policy's own re-indexing
and the paging mode's relayout apply, as after a trim) and their records stay in the tier; with `keep=True` they stay
cached as ordinary content and leave the tier (a later eviction stores them again). Batch 1 only so far.

Paging and int8. Capture, re-laying and release go by write order and page table, never by slot place, so every
paging mode composes: a relayout (`tile_skip`, `ordered_suffix`, `eager`) that moves survivors and gives emptied
pages back changes where tokens sit, not what is stored or restored (`tests/streaming/test_recall_paging.py`). With
`kv_dtype="int8"` the tier holds the evicted tokens dequantised and recall writes them back through the pool's
quantising write (`omnijax.kv.host_tier`, "int8 pools"; `tests/streaming/test_recall_int8.py`).

Disk. With `Recall(disk_dir=...)` the tier spills instead of dropping when its host budget is full
(`omnijax.kv.host_tier_disk`): spilled units are scored and recalled from their files, transparently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.kv import host_tier, host_tier_disk, host_tier_scoring
from omnijax.kv import paged as paged_lib
from omnijax.kv.host_tier_two_stage import score_units_two_stage
from omnijax.retention.base import NoSlide
from omnijax.retention.recall import Recall, recall_into
from omnijax.streaming import recall_ops
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.recall_ops import freed_below_1d, question_queries, room
from omnijax.streaming.step import StreamState


@dataclasses.dataclass(frozen=True)
class RecallReport:
    """One question's recall.

    Attributes:
        scores: `[U]` float32 scores of the stored units (forced or computed).
        units: unit ids recalled, in the order they were laid.
        indices: their indices in the tier, ascending.
        cells: cache cells recalled.
        budget: the cell budget used: `Recall.budget`, less where the pool had less room left for the units and
            the question with its answer.
        forced: whether the scores were given rather than computed.
    """

    scores: np.ndarray
    units: tuple[int, ...]
    indices: tuple[int, ...]
    cells: int
    budget: int
    forced: bool


@dataclasses.dataclass(frozen=True)
class RecallSnapshot:
    """What a `Session` snapshot (`Session.snapshot`) carries of its recall beside the state: everything
    `RecallSession` needs to go on as though never interrupted.

    Attributes:
        tier: the host tier (immutable; its arrays are read-only and shared, never copied).
        vpos: `[next_order]` int64 full-context position of every token written so far (read-only).
        cursor: the full-context position cursor.
        counts: the running figures of `RecallStats` (name, value).
    """

    tier: host_tier.HostTier
    vpos: np.ndarray
    cursor: int
    counts: tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class RecallStats:
    """A session's recall figures.

    Attributes:
        stored_units, stored_bytes: records held by the tier now, and their host bytes.
        captured_units, captured_bytes: records ever captured: stored, or dropped at once when one is larger than
            the whole host budget (counted in `dropped_units` too).
        dropped_units, dropped_bytes: records the host budget forced out (oldest first).
        lost_cells: evicted tokens no copy held any more (`omnijax.kv.host_tier.Evicted.lost`).
        questions: recalls run.
        recalled_units, recalled_cells, recalled_bytes: brought back into the cache, all questions together.
        disk_units, disk_bytes: records whose keys and values are spilled to disk now, and those bytes
            (`Recall(disk_dir=...)`; `stored_bytes` counts their host part only).
        spilled_units, spilled_bytes: records ever spilled to disk.
    """

    stored_units: int
    stored_bytes: int
    captured_units: int
    captured_bytes: int
    dropped_units: int
    dropped_bytes: int
    lost_cells: int
    questions: int
    recalled_units: int
    recalled_cells: int
    recalled_bytes: int
    disk_units: int = 0
    disk_bytes: int = 0
    spilled_units: int = 0
    spilled_bytes: int = 0


def _read_only(x: np.ndarray) -> np.ndarray:
    x = np.array(x, copy=True)
    x.flags.writeable = False
    return x


class RecallSession:
    """The recall side of a batch-1 `Session` (module docstring): the host tier, the pending release, the figures.

    Args:
        config: the session's settings (`config.recall` set).
        rope: `(theta, mrope_section, interleaved)` of the model.
    """

    def __init__(self, config: StreamConfig, rope: tuple[Any, Any, bool]):
        if config.recall is None:
            raise ValueError("RecallSession needs StreamConfig(recall=Recall(...))")
        self.recall_config: Recall = config.recall
        self.policy, self.paging, self.subblock = config.policy, config.paging, config.subblock
        self.impl = config.impl
        self.rope = rope
        self.at_original = self.recall_config.at_own_positions(config.policy)
        self.tier = host_tier.HostTier(budget_bytes=int(self.recall_config.host_bytes))
        self.disk = None if self.recall_config.disk_dir is None else host_tier_disk.open_disk(
            self.recall_config.disk_dir, self.recall_config.disk_bytes)
        self.shared_pool = False  # a row of the engine's shared pool (`omnijax.kv.host_tier.capture_evicted`)
        # the engine's: every program runs on the donated cache in place, reading the row's pages only
        self.in_place = False
        self._pending: tuple[int, int] | None = None  # write orders [lo, hi) of recalled tokens awaiting release
        self._counts = dict(captured_units=0, captured_bytes=0, lost_cells=0, questions=0, recalled_units=0,
                            recalled_cells=0, recalled_bytes=0)
        self.last: RecallReport | None = None
        # Full-context positions (axis 0) of every token ever written, by write order, and the full-context cursor.
        self._vpos = np.zeros(0, np.int64)
        self._cursor = 0

    def start(self, state: StreamState) -> None:
        """Takes the session's initial state: its cached tokens' positions are their full-context ones."""
        m = jax.device_get({"valid": state.kv.valid, "order": state.kv.order, "pos": state.kv.pos[0],
                            "next_order": state.kv.next_order[0], "next_pos": state.next_pos[0]})
        self._vpos = np.zeros(max(64, int(m["next_order"])), np.int64)
        self._vpos[m["order"][m["valid"]]] = m["pos"][m["valid"]]
        self._cursor = int(m["next_pos"])

    def snapshot(self, state: StreamState) -> RecallSnapshot:
        """The recall side of a snapshot of `state` (refused while a recall awaits its release: the recalled tokens
        are no part of the session's own content)."""
        if self._pending is not None:
            raise ValueError("a recall is in progress (recalled units are cached for a question or a held answer): "
                             "feed the question, or release_recall(), before a snapshot")
        end = int(jax.device_get(state.kv.next_order[0]))
        return RecallSnapshot(tier=self.tier, vpos=_read_only(self._vpos[:end]), cursor=self._cursor,
                              counts=tuple(self._counts.items()))

    def restore(self, snapshot: RecallSnapshot, state: StreamState) -> None:
        """Goes on from `snapshot`, taken together with `state`. A missing or corrupt host tier is refused by name
        (ValueError) and nothing changes."""
        if not isinstance(snapshot, RecallSnapshot):
            raise ValueError(f"the snapshot's host tier is missing: a session with StreamConfig(recall=...) resumes "
                             f"from Session.snapshot() (its RecallSnapshot), got {type(snapshot).__name__}")
        tier, what = snapshot.tier, "the snapshot's host tier is corrupt"
        m = jax.device_get({"valid": state.kv.valid, "order": state.kv.order, "end": state.kv.next_order[0]})
        L, _, _, G, d = state.kv.k.shape
        A = state.kv.pos.shape[0]
        if not isinstance(tier, host_tier.HostTier) or not all(isinstance(u, host_tier.UnitKV) for u in tier.units):
            raise ValueError(f"{what}: tier must be a HostTier of UnitKV records")
        vpos = np.asarray(snapshot.vpos)
        if vpos.dtype != np.int64 or vpos.shape != (int(m["end"]),):
            raise ValueError(f"{what}: vpos must be int64 [{int(m['end'])}] (one per token the state wrote), got "
                             f"{vpos.dtype} {vpos.shape}")
        names = set(self._counts)
        if {k for k, _ in snapshot.counts} != names or not isinstance(snapshot.cursor, int):
            raise ValueError(f"{what}: counts must name {sorted(names)} and cursor be an int")
        for u in tier.units:
            n = u.size
            shapes_ok = (u.k.shape == u.v.shape == (L, G, n, d) and u.pos.shape == (A, n) and u.vpos is not None
                         and u.vpos.shape == (n,) and u.order.shape == (n,) and u.summary.shape == (L, G, d))
            if not shapes_ok:
                raise ValueError(f"{what}: unit {u.unit}'s arrays do not fit this model's cache "
                                 f"(k [L={L}, G={G}, n, d={d}], pos [A={A}, n], vpos, order [n])")
            if not np.array_equal(u.summary, host_tier.summarize(u.k)):
                raise ValueError(f"{what}: unit {u.unit}'s summary is not the mean of its keys")
            if (u.order < 0).any() or (u.order >= int(m["end"])).any():
                raise ValueError(f"{what}: unit {u.unit} holds write orders the state never wrote")
        budget = int(self.recall_config.host_bytes)
        if tier.nbytes > budget:
            raise ValueError(f"the snapshot's host tier holds {tier.nbytes} bytes, more than Recall(host_bytes="
                             f"{budget}); resume with a host budget at least that large")
        if tier.disk_nbytes > self.recall_config.disk_bytes:
            raise ValueError(f"the snapshot's host tier has {tier.disk_nbytes} bytes spilled to disk, more than "
                             f"Recall(disk_bytes={self.recall_config.disk_bytes}); resume with a disk tier at least "
                             f"that large")
        self.tier = dataclasses.replace(tier, budget_bytes=budget)
        self._vpos = np.array(vpos, np.int64)
        self._cursor = snapshot.cursor
        self._counts = dict(snapshot.counts)

    def _set_vpos(self, lo: int, values: np.ndarray) -> None:
        end = lo + len(values)
        if end > self._vpos.size:
            self._vpos = np.concatenate([self._vpos, np.zeros(max(end, 2 * self._vpos.size) - self._vpos.size,
                                                              np.int64)])
        self._vpos[lo:end] = values

    def track(self, chunk: Chunk, next_pos: int, next_order: int, after: StreamState) -> None:
        """Records the full-context positions of what one step (from cursor `next_pos` and write order
        `next_order`) wrote: the chunk's tokens at their positions plus the full-context shift the step started
        from, its answer's tokens one after the other past the chunk's advance."""
        end = int(jax.device_get(after.kv.next_order)[0])
        valid = np.asarray(chunk.valid)[0]
        shift = self._cursor - next_pos
        self._set_vpos(next_order, np.asarray(chunk.positions)[0, 0][valid].astype(np.int64) + next_pos + shift)
        self._cursor += int(np.asarray(chunk.advance)[0])
        answers = end - next_order - int(valid.sum())
        self._set_vpos(next_order + int(valid.sum()), self._cursor + np.arange(answers, dtype=np.int64))
        self._cursor += answers

    @property
    def pending(self) -> bool:
        """Whether recalled tokens await their question's step."""
        return self._pending is not None

    def stats(self) -> RecallStats:
        """The figures so far."""
        return RecallStats(stored_units=len(self.tier.units), stored_bytes=self.tier.nbytes,
                           dropped_units=self.tier.dropped_units, dropped_bytes=self.tier.dropped_bytes,
                           disk_units=sum(u.on_disk for u in self.tier.units), disk_bytes=self.tier.disk_nbytes,
                           spilled_units=self.tier.spilled_units, spilled_bytes=self.tier.spilled_bytes,
                           **self._counts)

    def capture(self, before: paged_lib.PagedKV, after: paged_lib.PagedKV, *, in_place: bool = False,
                saved: host_tier.Saved | None = None, written: dict | None = None, row: int = 0) -> None:
        """Stores what the step from `before` (a copy; with `in_place` its metadata only, and `saved`:
        `omnijax.kv.host_tier.capture_evicted`) to `after` evicted (recalled tokens awaiting release, which the tier
        still holds, are left out; `written`, `row`: the step's record of its chunk's tokens and this row of it)."""
        skip = self._pending if self._pending is not None and not self.recall_config.keep else (0, 0)
        got = host_tier.capture_evicted(before, after, skip=skip, shared_pool=self.shared_pool, in_place=in_place,
                                        saved=saved, written=written, row=row)
        self._counts["lost_cells"] += len(got.lost)
        block = self.recall_config.block
        records = [b for u in got.units for b in host_tier.split_blocks(u, block)] if block else list(got.units)
        records = [u.with_vpos(self._vpos[u.order]) for u in records]  # sized as stored (vpos included)
        self._counts["captured_units"] += len(records)
        self._counts["captured_bytes"] += sum(u.nbytes for u in records)
        # A record larger than the whole host budget cannot be stored: captured, then dropped at once (reported as
        # the budget's other drops are), unless it can spill.
        fits = [u for u in records if self.disk is not None or u.nbytes <= self.tier.budget_bytes]
        for u in records:
            if self.disk is None and u.nbytes > self.tier.budget_bytes:
                self.tier = dataclasses.replace(self.tier, dropped_units=self.tier.dropped_units + 1,
                                                dropped_bytes=self.tier.dropped_bytes + u.nbytes)
        if fits:
            self.tier, report = self.tier.add(*fits) if self.disk is None else \
                host_tier_disk.add_spilling(self.tier, self.disk, *fits)
            del report  # its drops are in the tier's running totals

    def queries(self, state: StreamState, graphdef: Any, params: Any, chunk: Chunk
                ) -> tuple[StreamState, jax.Array]:
        """The question's device part: `(state, queries [L, T, H, d])` of `chunk` against the cache (dispatched, not
        waited for; with `in_place` the cache is donated and comes back holding what it held, no copy made)."""
        if not np.asarray(chunk.valid)[0].any():
            raise ValueError("recall needs a question with tokens (chunk.valid is all False)")
        if not self.in_place:
            return state, question_queries(graphdef, params, state.kv, state.next_pos, chunk, impl=self.impl)
        q, kv = recall_ops.question_queries_in_place(graphdef, params, state.kv, state.next_pos, chunk,
                                                     impl=self.impl)
        return dataclasses.replace(state, kv=kv), q

    def score(self, q: np.ndarray, chunk: Chunk, next_pos: int, tier: host_tier.HostTier | None = None
              ) -> np.ndarray:
        """The question's host part: `[U]` scores of the stored units (`tier`, default the session's) from the
        question's queries `q [L, T, H, d]` (`queries`) fed at cursor `next_pos`. Reads nothing else of the session
        (the engine runs it off its thread, `omnijax.serve.engine.recall_rows`)."""
        tier = self.tier if tier is None else tier
        if not tier.units:
            return np.zeros((0,), np.float32)
        valid = np.asarray(chunk.valid)[0]
        q = np.asarray(q)[:, valid]  # [L, T, H, d]
        scoring = self.recall_config.scoring
        if scoring in ("mass", "peak", "two_stage"):  # queries turned back to before RoPE, as the stored keys
            pos = np.asarray(chunk.positions)[:, 0][:, valid] + int(next_pos)
            raw = np.swapaxes(host_tier_scoring.unrotated(np.swapaxes(q, 1, 2), pos, self.rope), 1, 2)
            if scoring == "two_stage":
                return score_units_two_stage(tier, raw, q.mean(axis=1), self.rope, self.recall_config.shortlist)
            if self.recall_config.window > 1:  # windows ranked by what each adds (`rank_windows_marginal`)
                return host_tier_scoring.score_windows_marginal(tier, raw, self.rope, self.recall_config.window,
                                                                scoring)
            score = host_tier_scoring.score_units_mass if scoring == "mass" else host_tier_scoring.score_units_peak
            return score(tier, raw, self.rope)
        return host_tier_scoring.score_units(tier, q.mean(axis=1), self.recall_config.scoring)

    def recall(self, state: StreamState, graphdef: Any, params: Any, chunk: Chunk,
               scores: np.ndarray | None = None, *, computed: np.ndarray | None = None
               ) -> tuple[StreamState, RecallReport]:
        """Scores the stored units against `chunk` (or takes `scores [U]`, forced, or `computed`, what `score`
        gave for this question and the tier as it is), selects within the budgets and writes the chosen units into
        the cache. Returns the new state and the report."""
        if self._pending is not None:
            raise ValueError("a recall is already waiting for its question: feed the question first")
        U = len(self.tier.units)
        forced = scores is not None
        if computed is not None:
            scores = np.asarray(computed, np.float32)
            if scores.shape != (U,):
                raise ValueError(f"computed scores must be [{U}] (the tier changed since they were computed?), got "
                                 f"{scores.shape}")
        elif forced:
            scores = np.asarray(scores, np.float32)
            if scores.shape != (U,) or not np.all(np.isfinite(scores)):
                raise ValueError(f"scores must be {U} finite numbers, one per stored unit (session.recall_stats()"
                                 f".stored_units), got shape {scores.shape}")
        elif U:
            next_pos = int(jax.device_get(state.next_pos[0]))
            state, q = self.queries(state, graphdef, params, chunk)
            scores = self.score(q, chunk, next_pos)
        else:
            scores = np.zeros((0,), np.float32)
        need = int(np.asarray(chunk.valid).sum()) + int(np.asarray(chunk.answer_tokens).max(initial=0))
        budget = max(0, min(self.recall_config.budget, room(state.kv) - need))
        ranked = np.flatnonzero(np.isfinite(scores))  # "two_stage" scores units off its shortlist -inf
        if self.recall_config.window > 1 and not forced:  # scores rank windows of records (Recall.window)
            chosen = host_tier_scoring.select_windows(
                scores, self.tier.sizes, host_tier_scoring.window_members(self.tier, self.recall_config.window),
                budget, self.recall_config.top_units)
        else:
            chosen = ranked[host_tier_scoring.select_units(scores[ranked], self.tier.sizes[ranked], budget,
                                                           self.recall_config.top_units)]
        units = tuple(self.tier.units[i] for i in chosen)
        kv, next_pos = state.kv, state.next_pos
        if units:
            lo = int(kv.next_order[0])
            theta, section, interleaved = self.rope
            if self.at_original:
                kv, next_pos = recall_into(kv, units, next_pos, rope=(theta, section), interleaved=interleaved,
                                           at_original=True, donate=self.in_place)
            else:
                kv, positions, cursor = self._relay(kv, units)
                kv, next_pos = recall_into(kv, units, next_pos, rope=(theta, section), interleaved=interleaved,
                                           positions=positions, cursor=cursor, donate=self.in_place)
            self._set_vpos(lo, np.concatenate([u.vpos for u in units]))
            self._pending = (lo, lo + sum(u.size for u in units))
            if self.recall_config.keep:
                self.tier, taken = self.tier.take(chosen)
                for u in taken:  # cached as content now: a spilled one's files go (a later eviction stores it anew)
                    host_tier_disk.remove_files(u)
        cells = sum(u.size for u in units)
        self._counts["questions"] += 1
        self._counts["recalled_units"] += len(units)
        self._counts["recalled_cells"] += cells
        self._counts["recalled_bytes"] += sum(u.nbytes for u in units)
        self.last = RecallReport(scores=scores, units=tuple(u.unit for u in units),
                                 indices=tuple(int(i) for i in chosen), cells=cells, budget=budget, forced=forced)
        return dataclasses.replace(state, kv=kv, next_pos=next_pos), self.last

    def _relay(self, kv: paged_lib.PagedKV, units: tuple[host_tier.UnitKV, ...]
               ) -> tuple[paged_lib.PagedKV, list[np.ndarray], int]:
        """Re-lays the cached tokens for `units` (module docstring, Placement): shifts the cached tokens that move
        (positions and keys) and returns `(kv, positions of each unit [A, n], cursor)`."""
        m = jax.device_get({"valid": kv.valid, "order": kv.order, "pos": kv.pos, "table": kv.page_table[0]})
        N, P = kv.num_pages, kv.page_size
        owned = np.zeros((N, P), bool)
        owned[m["table"][m["table"] >= 0]] = True
        live = np.flatnonzero((m["valid"] & owned).reshape(-1))
        pos = m["pos"].reshape(m["pos"].shape[0], -1)[:, live].astype(np.int64)  # [A, n] current
        shift = self._vpos[m["order"].reshape(-1)[live]] - pos[0]  # current -> full-context, uniform over axes
        parts = [(pos, shift)] + [(u.pos.astype(np.int64), u.vpos - u.pos[0].astype(np.int64)) for u in units]
        lo = np.concatenate([p.min(axis=0) + s for p, s in parts])
        hi = np.concatenate([p.max(axis=0) + s for p, s in parts])
        freed, total = freed_below_1d(lo, hi, self._cursor)
        delta = np.concatenate([s for _, s in parts]) - freed  # what each token's positions move by
        n = live.size
        moves = np.zeros(N * P, np.int32)
        moves[live] = delta[:n]
        if moves.any():
            theta, section, interleaved = self.rope
            shift = recall_ops.shift_row if self.in_place else recall_ops.shift_positions
            kv = shift(kv, jnp.asarray(moves.reshape(N, P)), rope=(theta, section, interleaved))
        positions, at = [], n
        for u in units:
            positions.append((u.pos.astype(np.int64) + delta[at:at + u.size][None]).astype(np.int32))
            at += u.size
        return kv, positions, self._cursor - total

    def release(self, state: StreamState) -> StreamState:
        """After the question's step: invalidates the recalled tokens still cached (`keep=False`), or lets them stay
        (`keep=True`). Either way the recall is over."""
        pending, self._pending = self._pending, None
        if pending is None:
            return state
        theta, section, _ = self.rope
        if not self.recall_config.keep:
            kv, next_pos = recall_ops.release_range(
                state.kv, state.next_pos, jnp.int32(pending[0]), jnp.int32(pending[1]), reindex=not self.at_original,
                rope=(theta, section), paging=self.paging, subblock=self.subblock)
            state = dataclasses.replace(state, kv=kv, next_pos=next_pos)
        # The steps over the recall ran without trimming (`step_config`): the policy trims now, what it evicts is
        # stored as after any step.
        before = host_tier.metadata_copy(state.kv) if self.in_place else state.kv
        # In place, a relayout other than native's moves survivors into the trim's holes: the live tokens are
        # gathered first, so what it overwrites is read from there (`host_tier.capture_evicted`'s `saved`).
        saved = host_tier.save_slots(state.kv, 0) if self.in_place and self.paging.mode != "native" else None
        trim = recall_ops.trim_now_in_place if self.in_place else recall_ops.trim_now
        kv, next_pos, evicted = trim(state.kv, state.next_pos, policy=self.policy, rope=(theta, section),
                                     paging=self.paging, subblock=self.subblock)
        if np.asarray(evicted).any():
            self.capture(before, kv, in_place=self.in_place, saved=saved)
        return dataclasses.replace(state, kv=kv, next_pos=next_pos)

    def step_config(self, config: StreamConfig) -> StreamConfig:
        """The config a step runs with: while a recall is in progress (a question, a held answer) the step does not
        trim (`NoSlide`; one more compiled step), so the policy cannot evict the recalled units, nor the cached
        part of their units, before the answer is decoded (OmniPick would: its text budget goes oldest token
        first, and a recalled piece is younger than the rest of its unit); `release` trims afterwards."""
        return config.replace(policy=NoSlide()) if self._pending is not None else config


def new_recall_session(config: StreamConfig, model_config: Any, *, num_pages: int, batch: int) -> RecallSession:
    """The `RecallSession` of a `Session` with `config.recall` set, refusing what it does not do yet by name."""
    if config.recall is None:
        raise ValueError("new_recall_session needs StreamConfig(recall=Recall(...))")
    if batch != 1:
        raise ValueError(f"StreamConfig(recall=...) runs batch-1 sessions only so far, got batch={batch}")
    config.recall.check_pool(num_pages * config.page_size)
    return RecallSession(config, (model_config.rope_base, model_config.mrope_section, model_config.mrope_interleaved))
