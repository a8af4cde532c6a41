"""Recall on the engine (issue 40): each session of an engine whose `StreamConfig` has `recall=Recall(...)` carries
its own host tier, as a batch-1 `omnijax.Session` does (`omnijax.streaming.recall_session`).

A session's row is worked on through a *row view*: the engine's state with its per-row fields (page table, slot
count, write-order cursor, exhaustion flags, position cursor, sampling key, last logits, penalty history) sliced to
that one row, the pool itself shared (`row_view`), and written back into the row afterwards (`put_row`). Every
batch-1 recall program (`RecallSession.recall`, `release`, the capture) reads the row's own pages only, through its
page table, so it runs on a view unchanged.

Per tick (`EngineRecall`, called by `omnijax.serve.engine.engine.Engine.tick` in the engine's thread, between the
batched steps):

- Before the batched step, for each recall session with a frame: a held recall ends where new content comes (as
  `Session.feed`); a frame with tokens asking for an answer is a question, and the session's top units are scored
  and recalled into its row (`RecallSession.recall` on the row view).
- A session whose recall is in progress (its question, and the continuations of a held answer) is served on its own:
  one batch-1 `engine_step` on its row view under `NoSlide` (`RecallSession.step_config`: the step over a recall does
  not trim, so the policy cannot evict what was recalled before the answer is decoded), after which the recall is
  released unless held (`hold`), the policy trimming then (`RecallSession.release`). The batched step of the other
  rows stays the one compiled program every tick runs; the recall's steps are one more program, compiled once.
- The other recall sessions run in the batched step; the engine copies the pool before it (one device copy per
  tick in which a recall session is served) and each such row's evictions are captured into its tier afterwards
  (`omnijax.kv.host_tier.capture_evicted` with `shared_pool=True`: a token a step wrote and evicted on a page the
  step also gave back is counted in `lost_cells`, never read from another row's slot).

A session's answers are therefore those of a batch-1 `Session` with the same config fed the same (padded) chunks,
with `hold_recall` where the engine's session is held (the worker holds each response's recall over its answer and
releases it when the answer ends, as `Chat` does). Snapshots carry the tier (`Engine.export_session` /
`import_session`; on disk beside the arrays, `omnijax.serve.engine.snapshot_tier`). A fork
(`Engine.fork_session`) takes the source's tier and shares no page with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.kv import paged as paged_lib
from omnijax.serve.engine.decode_loop import engine_step
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.recall_session import RecallSession, RecallSnapshot, RecallStats, new_recall_session
from omnijax.streaming.step import StreamState

KV_ROW = ("page_table", "seq_slots", "next_order", "exhausted", "dropped")
STATE_ROW = ("next_pos", "key", "last_logits", "counts", "seen")


def kv_row(kv: paged_lib.PagedKV, row: int) -> paged_lib.PagedKV:
    """The cache of one row: per-row fields sliced to batch 1, the pool shared (not copied)."""
    return kv.replace(**{n: getattr(kv, n)[row:row + 1] for n in KV_ROW})


def row_view(state: StreamState, row: int) -> StreamState:
    """The batch-1 state of one row of `state` (module docstring); the pool's arrays are the same arrays."""
    return dataclasses.replace(state, kv=kv_row(state.kv, row),
                               **{n: getattr(state, n)[row:row + 1] for n in STATE_ROW})


def put_row(state: StreamState, row: int, view: StreamState) -> StreamState:
    """`state` with row `row` taken from the batch-1 `view` and the pool from the view. Reads only the per-row
    fields of `state` (its pool arrays may have been donated by the programs that ran on the view); a batch-1
    `state` is the view's row itself (its fields may be the view's very arrays, donated too), so the view is it."""
    if state.kv.batch == 1:
        return view
    kv = view.kv.replace(**{n: getattr(state.kv, n).at[row].set(getattr(view.kv, n)[0]) for n in KV_ROW})
    return dataclasses.replace(view, kv=kv,
                               **{n: getattr(state, n).at[row].set(getattr(view, n)[0]) for n in STATE_ROW})


class EngineRecall:
    """The host tiers of an engine's sessions (module docstring).

    Args:
        config: the engine's bound settings, `recall` set.
        model_config: the decoder's config (RoPE settings).
        num_pages: the engine's pool size.
        max_pages: the page-table width.
    """

    def __init__(self, config: StreamConfig, model_config: Any, *, num_pages: int, max_pages: int | None):
        if config.recall is None:
            raise ValueError("EngineRecall needs StreamConfig(recall=Recall(...))")
        if config.paging.mode != "native":
            raise ValueError(f"StreamConfig(recall=...) on the engine runs with paging mode 'native' only so far "
                             f"(the other modes move a row's slots in the shared pool, untested with a row's tier), "
                             f"got paging mode {config.paging.mode!r}")
        # A session recalls into its own page-table row: the budget is checked against what one row can list.
        new_recall_session(config, model_config, num_pages=min(num_pages, max_pages or num_pages), batch=1)
        self.config, self.model_config = config, model_config
        self.num_pages = min(num_pages, max_pages or num_pages)
        self.sessions: dict[str, RecallSession] = {}
        self.held: set[str] = set()

    def open(self, sid: str) -> RecallSession:
        """A fresh tier for a new (empty) session."""
        session = new_recall_session(self.config, self.model_config, num_pages=self.num_pages, batch=1)
        session.shared_pool = True
        self.sessions[sid] = session
        return session

    def close(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.held.discard(sid)

    def stats(self, sid: str) -> RecallStats:
        return self._session(sid).stats()

    def _session(self, sid: str) -> RecallSession:
        if sid not in self.sessions:
            raise KeyError(f"unknown session {sid!r}")
        return self.sessions[sid]

    @staticmethod
    def apply(engine: Any, sid: str, fn: Callable[[StreamState], StreamState]) -> None:
        """Runs `fn` on the session's row view and writes the row back into the engine's state."""
        row = engine._slots[sid]
        engine.state = put_row(engine.state, row, fn(row_view(engine.state, row)))

    def release(self, engine: Any, sid: str) -> None:
        """Ends the session's recall in progress (held or not); nothing happens when there is none."""
        self.held.discard(sid)
        session = self.sessions.get(sid)
        if session is not None and session.pending and engine._slots.get(sid, engine.state.kv.batch) < \
                engine.state.kv.batch:
            self.apply(engine, sid, session.release)

    def snapshot(self, engine: Any, sid: str) -> RecallSnapshot:
        """The session's tier for a snapshot (refused by name while a recall is in progress)."""
        session = self._session(sid)
        return session.snapshot(row_view(engine.state, engine._slots[sid]))

    def restore(self, engine: Any, sid: str, tier: Any) -> None:
        """Gives the imported session `sid` the snapshot's tier (refused by name when missing or corrupt)."""
        session = self.open(sid)
        session.restore(tier, row_view(engine.state, engine._slots[sid]))

    # ------------------------------------------------------------------------------------------------ ticks
    def prepare(self, engine: Any, frames: dict[str, Chunk]) -> dict[str, Chunk]:
        """Before the batched step: ends held recalls where new content comes, recalls for questions. Returns the
        frames of the sessions whose recall is in progress, taken out of `frames` (they run on their own)."""
        side = {}
        for sid in [s for s in frames if s in self.sessions]:
            session, chunk = self.sessions[sid], frames[sid]
            content = bool(np.asarray(chunk.valid).any())
            if session.pending and sid in self.held and content:
                self.apply(engine, sid, session.release)
            if not session.pending and session.tier.units and content and np.asarray(chunk.answer_tokens).any():
                question = jax.tree.map(jnp.asarray, chunk)
                self.apply(engine, sid, lambda view: session.recall(view, engine._graphdef, engine._params,
                                                                   question)[0])
            if session.pending:
                side[sid] = frames.pop(sid)
        return side

    def serve(self, engine: Any, sid: str, chunk: Chunk, batch: Chunk) -> tuple:
        """Serves one session whose recall is in progress on its row view (`batch`: its frame as a `[1, T]`
        chunk); returns the step's outputs (row 0), as the batched step's."""
        session, row = self.sessions[sid], engine._slots[sid]
        view = row_view(engine.state, row)
        cursor = jax.device_get((view.next_pos[0], view.kv.next_order[0]))
        before = jax.tree.map(jnp.copy, view.kv)
        view, result = engine_step(engine._graphdef, engine._params, view, batch,
                                   config=session.step_config(engine._stream))
        result = jax.device_get(jax.block_until_ready(result))
        session.track(chunk, int(cursor[0]), int(cursor[1]), view)
        session.capture(before, view.kv)  # NoSlide evicts nothing; kept so a step that did is never lost silently
        if sid not in self.held:
            view = session.release(view)
        engine.state = put_row(engine.state, row, view)
        return result

    def before_batch(self, engine: Any, frames: dict[str, Chunk]) -> tuple | None:
        """Before the batched step: a copy of the pool and the served recall rows' cursors (None when no recall
        session is served in it)."""
        sids = [s for s in frames if s in self.sessions]
        if not sids:
            return None
        rows = np.asarray([engine._slots[s] for s in sids])
        cursors = jax.device_get((engine.state.next_pos[rows], engine.state.kv.next_order[rows]))
        return sids, jax.tree.map(jnp.copy, engine.state.kv), cursors

    def after_batch(self, engine: Any, frames: dict[str, Chunk], before: tuple | None, exhausted: np.ndarray) -> None:
        """After the batched step: tracks each served recall row's positions and stores what the step evicted."""
        if before is None:
            return
        sids, kv, (next_pos, next_order) = before
        for i, sid in enumerate(sids):
            row = engine._slots[sid]
            if bool(exhausted[row]):  # preempted: parked until closed, never served again
                continue
            session = self.sessions[sid]
            after = row_view(engine.state, row)
            session.track(frames[sid], int(next_pos[i]), int(next_order[i]), after)
            session.capture(kv_row(kv, row), after.kv)
