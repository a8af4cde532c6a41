"""Recall on the engine (issue 40): each session of an engine whose `StreamConfig` has `recall=Recall(...)` carries
its own host tier, as a batch-1 `omnijax.Session` does (`omnijax.streaming.recall_session`).

A session's row is worked on through a *row view*: the engine's state with its per-row fields (page table, slot
count, write-order cursor, exhaustion flags, position cursor, sampling key, last logits, penalty history) sliced to
that one row, the pool itself shared (`row_view`), and written back into the row afterwards (`put_row`). Every
batch-1 recall program (`RecallSession.recall`, `release`, the capture) reads the row's own pages only, through its
page table, so it runs on a view unchanged.

Per tick (`EngineRecall`, called by `omnijax.serve.engine.engine.Engine.tick` in the engine's thread):

- Before the batched step, for each recall session with a frame: a held recall ends where new content comes (as
  `Session.feed`); a frame with tokens asking for an answer is a question. Its queries are computed on the row
  (`RecallSession.queries`, dispatched, the pool donated and written in place), and the scoring of the stored units
  against them (`RecallSession.score`, host work: the tier's keys against the queries) is handed to the recall
  executor, a thread of its own. The question waits there (`EngineRecall.scoring`; the session is served nothing
  else meanwhile) while the engine keeps ticking the other sessions.
- A session whose recall is in progress (the continuations of a held answer) is served on its own: one batch-1
  `engine_step` on its row view under `NoSlide` (`RecallSession.step_config`: the step over a recall does not trim,
  so the policy cannot evict what was recalled before the answer is decoded), after which the recall is released
  unless held (`hold`), the policy trimming then (`RecallSession.release`). The batched step of the other rows stays
  the one compiled program every tick runs; the recall's steps are one more program, compiled once.
- After the batched step, each question whose scores are ready lands: its units are selected and written into its
  row (`RecallSession.recall` with the computed scores), and it is served on its own as above. A question whose
  scores are not ready yet stays for a later tick (`TickReport.recalling`). A question whose scoring raised fails
  alone: its frame comes back with `FrameOutput.error` naming the cause and `written=False` (the question is not
  written; the row and the tier are as before it), and the tick serves every other row as usual.
- The other recall sessions run in the batched step; each such row's evictions are captured into its tier
  afterwards (`omnijax.kv.host_tier.capture_evicted`, `shared_pool=True`; a token the step wrote and evicted is read
  from the step's record of its chunk, `ChunkOutput.written`, which an engine with recall compiles its batched step
  with: its slot may since hold a survivor the relayout moved, or another row's token on a page given back).

Nothing copies the pool. The steps update it in place; what a step evicts is read from its slot afterwards
(`capture_evicted(..., in_place=True)`: eviction leaves a slot's contents, and a copy of the slots' metadata taken
before the step tells which token each held), except where the row's answer tokens refilled holes the step's trim
left: a row asking for answer tokens has its live tokens gathered on device first (`host_tier.save_slots`, its own
slots only). Under a paging mode other than `native` (`tile_skip`, `ordered_suffix`, `eager`) the step's relayout
moves survivors into those holes and gives emptied pages back to the shared pool, where another row's answer may
take them in the same step: every served recall row's live tokens are gathered first (one device gather of the row's
tokens per tick), and the release's trim does the same (`RecallSession.release`). Every recall program reads and
writes the row's own pages: the question's forward writes its keys into the slots the step would use and leaves the
metadata as it was (`recall_ops.question_queries_in_place`), the re-laying shift gathers and scatters the row's
pages (`recall_ops.shift_row`), the recalled units are appended in place (`recall_into(..., donate=True)`) and the
release trims in place (`recall_ops.trim_now_in_place`).

A session's answers are therefore those of a batch-1 `Session` with the same config fed the same (padded) chunks,
with `hold_recall` where the engine's session is held (the worker holds each response's recall over its answer and
releases it when the answer ends, as `Chat` does). Snapshots carry the tier (`Engine.export_session` /
`import_session`; on disk beside the arrays, `omnijax.serve.engine.snapshot_tier`). A fork
(`Engine.fork_session`) takes the source's tier and shares no page with it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.kept_executables import cached_jit
from omnijax.kv import host_tier
from omnijax.kv import paged as paged_lib
from omnijax.serve.engine.decode_loop import OnToken, RowEnd, engine_step, frame_logprobs
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.recall_session import RecallSession, RecallSnapshot, RecallStats, new_recall_session
from omnijax.streaming.step import StreamState

KV_ROW = ("page_table", "seq_slots", "next_order", "exhausted", "dropped")
STATE_ROW = ("next_pos", "key", "last_logits", "counts", "seen")


def kv_row(kv: paged_lib.PagedKV, row: int) -> paged_lib.PagedKV:
    """The cache of one row: per-row fields sliced to batch 1, the pool shared (not copied)."""
    return kv.replace(**_slice({n: getattr(kv, n) for n in KV_ROW}, np.int32(row)))


def row_view(state: StreamState, row: int) -> StreamState:
    """The batch-1 state of one row of `state` (module docstring); the pool's arrays are the same arrays."""
    return dataclasses.replace(state, kv=kv_row(state.kv, row),
                               **_slice({n: getattr(state, n) for n in STATE_ROW}, np.int32(row)))


def put_row(state: StreamState, row: int, view: StreamState) -> StreamState:
    """`state` with row `row` taken from the batch-1 `view` and the pool from the view. Reads only the per-row
    fields of `state` (its pool arrays may have been donated by the programs that ran on the view); a batch-1
    `state` is the view's row itself (its fields may be the view's very arrays, donated too), so the view is it."""
    if state.kv.batch == 1:
        return view
    kv = _put({n: getattr(state.kv, n) for n in KV_ROW}, {n: getattr(view.kv, n) for n in KV_ROW}, np.int32(row))
    rest = _put({n: getattr(state, n) for n in STATE_ROW}, {n: getattr(view, n) for n in STATE_ROW}, np.int32(row))
    return dataclasses.replace(view, kv=view.kv.replace(**kv), **rest)


# The row moves as programs of the row index (one per batch bucket, whichever row), not eager slices (one per row).
@cached_jit
def _slice(fields: dict, row: jax.Array) -> dict:
    return {n: jax.lax.dynamic_slice_in_dim(x, row, 1) for n, x in fields.items()}


@cached_jit
def _put(fields: dict, rows: dict, row: jax.Array) -> dict:
    return {n: jax.lax.dynamic_update_slice_in_dim(x, rows[n].astype(x.dtype), row, 0) for n, x in fields.items()}


@dataclasses.dataclass
class SideEnd(RowEnd):
    """How a recall session's frame served on its own ended: `cut` tokens kept (its callback ended it there)."""

    cut: int | None = None


def side_tokens(sid: str, chunk: Chunk, result: tuple, on_token: OnToken | None) -> dict:
    """Hands the tokens of a frame served on its own (fused, batch 1) to `on_token` one by one after its step, as a
    host-driven tick would while decoding; a True return ends the frame's answer there."""
    if on_token is None:
        return {}
    asked = int(chunk.answer_tokens[0])
    toks = [int(t) for t in result[1][0, :asked] if t >= 0]
    entries = frame_logprobs(chunk, result[6], 0, len(toks)) or [None] * len(toks)
    for i, (token, entry) in enumerate(zip(toks, entries)):
        if on_token(sid, token, entry):
            return {sid: SideEnd(cut=i + 1)}
    return {}


@dataclasses.dataclass(frozen=True)
class Scoring:
    """A question waiting for its scores (`EngineRecall.scoring`).

    Attributes:
        future: the recall executor's job: `[U]` scores of the stored units.
        chunk: the question's frame (served once the scores land).
        tier: the tier the scores are of (the session's, unchanged until they land: nothing else of it is served).
    """

    future: concurrent.futures.Future
    chunk: Chunk
    tier: host_tier.HostTier


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
        # A session recalls into its own page-table row: the budget is checked against what one row can list.
        new_recall_session(config, model_config, num_pages=min(num_pages, max_pages or num_pages), batch=1)
        self.config, self.model_config = config, model_config
        self.num_pages = min(num_pages, max_pages or num_pages)
        self.sessions: dict[str, RecallSession] = {}
        self.held: set[str] = set()
        self.scoring: dict[str, Scoring] = {}  # questions whose scores are being computed off the engine thread
        self.failures: dict[str, tuple[Chunk, str]] = {}  # questions whose scoring raised (`land`), until reported
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread questions are scored on (one, made at the first question)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omnijax-recall")
        return self._executor

    def open(self, sid: str) -> RecallSession:
        """A fresh tier for a new (empty) session."""
        session = new_recall_session(self.config, self.model_config, num_pages=self.num_pages, batch=1)
        session.shared_pool = session.in_place = True
        self.sessions[sid] = session
        return session

    def take_failures(self) -> dict[str, tuple[Chunk, str]]:
        """The questions whose scoring raised since the last call: {session id: (frame, why)} (`land`)."""
        failures, self.failures = self.failures, {}
        return failures

    def close(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.failures.pop(sid, None)
        self.held.discard(sid)
        job = self.scoring.pop(sid, None)
        if job is not None:
            job.future.cancel()  # a job already running ends unread

    def futures(self) -> list[concurrent.futures.Future]:
        """The scoring jobs in flight (a caller may wait for one before the next tick)."""
        return [job.future for job in self.scoring.values()]

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
        """Before the batched step: ends held recalls where new content comes, hands questions to the recall
        executor (taken out of `frames`: they wait in `scoring`). Returns the frames of the sessions whose recall is
        in progress, taken out of `frames` (they run on their own)."""
        side = {}
        for sid in [s for s in frames if s in self.sessions]:
            session, chunk = self.sessions[sid], frames[sid]
            content = bool(np.asarray(chunk.valid).any())
            if session.pending and sid in self.held and content:
                self.apply(engine, sid, session.release)
            if not session.pending and session.tier.units and content and np.asarray(chunk.answer_tokens).any():
                self.ask(engine, sid, frames.pop(sid))
            elif session.pending:
                side[sid] = frames.pop(sid)
        return side

    def ask(self, engine: Any, sid: str, chunk: Chunk) -> None:
        """Computes the question's queries on the session's row (dispatched on the engine thread, in place) and
        hands their scoring to the recall executor."""
        session, row = self.sessions[sid], engine._slots[sid]
        question = jax.tree.map(jnp.asarray, chunk)
        view = row_view(engine.state, row)
        next_pos = int(jax.device_get(view.next_pos[0]))
        view, q = session.queries(view, engine._graphdef, engine._params, question)
        engine.state = put_row(engine.state, row, view)
        tier = session.tier
        self.scoring[sid] = Scoring(self.executor.submit(session.score, q, chunk, next_pos, tier), chunk, tier)

    def land(self, engine: Any) -> dict[str, Chunk]:
        """Between the steps: recalls for each question whose scores are ready (into its row, as `Session.feed`
        does before the question's step). Returns their frames, to be served on their own.

        A question whose scoring raised fails alone (`failures`): its frame is not written, its row and tier stay
        as they were before it (the queries' forward wrote no slot metadata), and the other sessions are served."""
        ready = {}
        for sid, job in list(self.scoring.items()):
            if not job.future.done():
                continue
            del self.scoring[sid]
            session = self.sessions[sid]
            if session.tier is not job.tier:
                raise RuntimeError(f"session {sid!r}: its host tier changed while its question was scored")
            error = job.future.exception()
            if error is not None:
                self.failures[sid] = (job.chunk, f"recall failed: scoring the question against the session's host "
                                                 f"tier ({len(job.tier.units)} stored records) raised "
                                                 f"{type(error).__name__}: {error}; the question was not written "
                                                 f"and the session is as it was before it")
                continue
            scores = job.future.result()
            question = jax.tree.map(jnp.asarray, job.chunk)
            self.apply(engine, sid, lambda view: session.recall(view, engine._graphdef, engine._params, question,
                                                               computed=scores)[0])
            ready[sid] = job.chunk
        return ready

    def serve(self, engine: Any, sid: str, chunk: Chunk, batch: Chunk) -> tuple:
        """Serves one session whose recall is in progress on its row view (`batch`: its frame as a `[1, T]`
        chunk); returns the step's outputs (row 0), as the batched step's."""
        session, row = self.sessions[sid], engine._slots[sid]
        view = row_view(engine.state, row)
        cursor = jax.device_get((view.next_pos[0], view.kv.next_order[0]))
        before = host_tier.metadata_copy(view.kv)
        view, result = engine_step(engine._graphdef, engine._params, view, batch,
                                   config=session.step_config(engine._stream))
        result = jax.device_get(jax.block_until_ready(result))
        session.track(chunk, int(cursor[0]), int(cursor[1]), view)
        # NoSlide evicts nothing; kept so a step that did is never lost silently
        session.capture(before, view.kv, in_place=True)
        if sid not in self.held:
            view = session.release(view)
        engine.state = put_row(engine.state, row, view)
        return result

    def before_batch(self, engine: Any, frames: dict[str, Chunk]) -> tuple | None:
        """Before the batched step: the pool's slot metadata (not its pages), the served recall rows' cursors, and
        the live tokens of those asking for answer tokens (`host_tier.save_slots`: their answer may refill the holes
        their trim leaves). None when no recall session is served in it."""
        sids = [s for s in frames if s in self.sessions]
        if not sids:
            return None
        rows = np.asarray([engine._slots[s] for s in sids])
        next_pos, next_order = jax.device_get((engine.state.next_pos, engine.state.kv.next_order))
        cursors = (next_pos[rows], next_order[rows])  # indexed on host: no gather program dispatched
        relays = self.config.paging.mode != "native"  # its relayout moves survivors into the holes of a trim
        saved = {s: host_tier.save_slots(engine.state.kv, engine._slots[s]) for s in sids
                 if relays or np.asarray(frames[s].answer_tokens).any()}
        return sids, host_tier.metadata_copy(engine.state.kv), cursors, saved

    def after_batch(self, engine: Any, frames: dict[str, Chunk], before: tuple | None, exhausted: np.ndarray,
                    written: dict | None = None) -> None:
        """After the batched step: tracks each served recall row's positions and stores what the step evicted
        (`written`: the step's record of its chunk's tokens, `ChunkOutput.written`, host arrays; a token the step
        wrote and evicted is read from there)."""
        if before is None:
            return
        sids, kv, (next_pos, next_order), saved = before
        for i, sid in enumerate(sids):
            row = engine._slots[sid]
            if bool(exhausted[row]):  # preempted: parked until closed, never served again
                continue
            session = self.sessions[sid]
            after = row_view(engine.state, row)
            session.track(frames[sid], int(next_pos[i]), int(next_order[i]), after)
            session.capture(kv_row(kv, row), after.kv, in_place=True, saved=saved.get(sid), written=written, row=row)
