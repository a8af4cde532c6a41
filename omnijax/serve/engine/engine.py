"""Metronome engine: many real-time sessions share one paged KV pool and are served in one jitted step per tick.

Sessions are rows ("slots") of one batched `StreamState`. The batch size is a bucket: the smallest entry of
`EngineConfig.buckets` that holds every open session, so joins and leaves recompile nothing but the first visit of a
bucket (shapes are otherwise static: `chunk_tokens` T and `max_answer_tokens` tau are fixed). Growing to a larger
bucket pads the per-row state with empty rows; when sessions leave, the next tick compacts the rows into the smallest
bucket that holds them (rows carry only page-table and cursor state; the pool itself never moves).

Each tick takes at most one submitted chunk per session, pads it to T, and runs `omnijax.streaming.session.chunk_step`
(prefill, last-position logits, retention, greedy answer of up to tau tokens) followed, in the same program, by
`omnijax.paging.migration.drop_empty_entries`, which returns pages that fell wholly behind the window to the pool
(vLLM-style block freeing). Rows without a chunk have all-False `valid` and ask for no answer tokens, so they write
nothing. Every row continues its own position cursor (`StreamState.next_pos`).

Policies (`EngineConfig.stream.policy`): `SinkWindow(sink, window)` (the oldest `sink` and newest `window` tokens
stay; positions keep growing) and `NoSlide()` (the unbounded baseline that walls when the pool saturates); any
other retention policy runs too.

Exhaustion is never silent. When a write finds no free page, `PagedKV` drops the token and flags the row; the engine
then preempts the session (the paper's stall): that frame and every later one come back empty (`tokens == []`,
`preempted=True`), the tokens not written are counted in `FrameOutput.dropped`, and the telemetry raises
`pool_exhausted` and `session_preempted` events. A preempted session stays parked, holding its pages, until it is
closed (closing frees them); its context is incomplete, so it is never resumed.

Speech (`EngineConfig.speech`): `speak` admits an utterance (a thinker prompt and answer) to the speech pool
(`speech_qwen25.speech_pool`: Qwen3-Omni's or Qwen2.5-Omni's; own talker KV pool, pages reserved up front); each tick
runs one batched talker step over the speaking sessions and their due vocoder chunks after the thinker's step, so
the tick latency (what AIMD admission reads) includes them; the chunks come back in `TickReport.speech`.

Recall (`EngineConfig.stream.recall`, issue 40): every session keeps its own host tier, worked on between the
batched steps through a batch-1 view of its row, in place (`omnijax.serve.engine.recall_rows`); a question is scored
off the engine thread while the other sessions tick on (`TickReport.recalling`); `hold_recall`, `release_recall`,
`recall_stats`; snapshots and forks carry the tier.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Mapping, Sequence

import jax
import numpy as np

from omnijax.chunks import chunk as chunks_lib
from omnijax.chunks.chunk import Chunk
from omnijax.decoding import folded_keys, seed_of
from omnijax.kept_executables import cached_jit
from omnijax.models.speech import MediaRows
from omnijax.serve.engine import snapshot as snapshot_lib
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.constraint import TokenConstraint
from omnijax.serve.engine.decode_loop import OnToken, RowEnd, engine_step, frame_logprobs, host_tick
from omnijax.serve.engine.engine_config import DuplicateSession, EngineConfig, FrameOutput, TickReport
from omnijax.serve.engine.recall_rows import EngineRecall, SideEnd, side_tokens
from omnijax.serve.engine.rows import (
    batch_frames,
    check_fork,
    compact_rows,
    fork_rows,
    pick_bucket,
    reset_row,
    take_rows,
)
from omnijax.serve.engine.speech_qwen25 import AnyPool, speech_pool
from omnijax.serve.engine.telemetry import Telemetry
from omnijax.streaming.recall_session import RecallStats
from omnijax.streaming.session import StreamModel, bind_config, graphdef_config, model_parts
from omnijax.streaming.step import StreamState, init_state

# Re-exported: the settings and reports (engine_config) and the row moves were defined here, and the fused step under
# this name.
__all__ = ["DuplicateSession", "Engine", "EngineConfig", "FrameOutput", "TickReport", "pick_bucket", "reset_row",
           "take_rows"]
_engine_step = engine_step


# ------------------------------------------------------------------------------------------------- pure helpers
# kept programs (`cached_jit`): a later process (or a test module after `jax.clear_caches()`) loads them untraced
_reset_row = cached_jit(reset_row, donate_argnames="state")
_fork_rows = cached_jit(fork_rows, static_argnames=("share",), donate_argnames="state")


# ------------------------------------------------------------------------------------------------------- engine
class Engine:
    """Serves many sessions from one shared KV pool, one jitted batched step per `tick()`.

    Args:
        model: an `omnijax.Model` or a `Decoder`.
        config: `EngineConfig`.

    Example:
        engine = Engine(model, EngineConfig(StreamConfig(policy=SinkWindow(16, 1024), num_pages=256,
                                                         max_answer_tokens=4)))
        engine.open("a")
        engine.submit("a", text_chunk(ids), answer_tokens=4)
        report = engine.tick()          # report.outputs["a"].tokens

    `engine.state` is donated to every step: read it between ticks, do not keep references across ticks. Under
    pool pressure pages are granted in row order (`PagedKV` allocation), so lower rows exhaust last.
    """

    def __init__(self, model: StreamModel, config: EngineConfig | None = None):
        config = EngineConfig() if config is None else config
        self.config = config
        bound = bind_config(model, config.stream, allow_recall=True)
        self._stream = bound.replace(recall=None)  # the steps run without it (recall is host-side around them)
        self._graphdef, params = model_parts(model)
        self.model_config = graphdef_config(model)
        # recall (issue 40): each session's host tier, worked on between the batched steps
        self.recall: EngineRecall | None = None if bound.recall is None else EngineRecall(
            bound, self.model_config, num_pages=config.num_pages, max_pages=config.max_pages)
        self._device = jax.devices()[0]
        self._params = jax.device_put(params, self._device)
        state = init_state(self.model_config, num_pages=config.num_pages, page_size=config.stream.page_size,
                           batch=config.buckets[0], max_pages=config.max_pages, kv_dtype=config.stream.kv_dtype)
        self.state: StreamState = jax.device_put(state, self._device)
        self.telemetry = Telemetry(config.num_pages, frame_budget_s=config.frame_budget_s,
                                   fit_fraction=config.fit_fraction)
        self._slots: dict[str, int] = {}  # session -> row, in opening order
        self._queue: dict[str, collections.deque] = {}
        self._preempted: set[str] = set()
        self._seen_dropped: dict[str, int] = {}
        self._opened = 0  # sessions opened so far: the n-th samples with keys folded from the seed and n
        self._unkeyed: dict[str, np.ndarray] = {}  # sessions whose row has not received its sampling key yet
        # the speaking sessions' talkers and vocoders (`omnijax.serve.engine.speech`), run on every tick
        self.speech: AnyPool | None = None if config.speech is None else speech_pool(model, config.speech)
        # the decode programs return each answer token's final-normed row (`FrameOutput.answer_rows`): the rows
        # a Qwen2.5-Omni talker reads to speak an answer still being written (`SpeechConfig.early_start`)
        self.taps_answer = bool(getattr(self.speech, "reads_rows", False))
        if self.taps_answer and self.recall is not None:
            raise ValueError("SpeechConfig(early_start=True) (`omnijax serve --speak-early`: answer rows for "
                             "Qwen2.5-Omni's early speech) is not supported with StreamConfig(recall=...) "
                             "(`--recall`) yet: serve without one of the two")

    # ------------------------------------------------------------------------------------------ sessions
    @property
    def sessions(self) -> list[str]:
        """Open sessions, in opening order."""
        return list(self._slots)

    @property
    def preempted(self) -> list[str]:
        """Open sessions preempted after KV exhaustion."""
        return [s for s in self._slots if s in self._preempted]

    @property
    def bucket(self) -> int:
        """Batch size of the current state."""
        return self.state.kv.batch

    @property
    def free_pages(self) -> int:
        return int(self.state.kv.num_free)

    @property
    def occupancy(self) -> float:
        """Pool pages in use / pool pages."""
        return 1.0 - self.free_pages / self.config.num_pages

    def slot(self, session_id: str) -> int:
        """The state row of an open session (valid after the next tick's re-arrangement)."""
        self._check_open(session_id)
        return self._slots[session_id]

    def _check_open(self, session_id: str) -> None:
        if session_id not in self._slots:
            raise KeyError(f"unknown session {session_id!r}; open sessions: {self.sessions}")

    def open(self, session_id: str) -> None:
        """Adds a session (between ticks). Raises `DuplicateSession` or `Overloaded` (no slot left)."""
        if session_id in self._slots:
            raise DuplicateSession(f"session {session_id!r} is already open")
        limit = self.config.buckets[-1]
        if len(self._slots) >= limit:
            raise Overloaded(f"overloaded: the engine holds at most {limit} sessions (largest batch bucket) and "
                             f"{len(self._slots)} are open", cap=limit, current=len(self._slots))
        used = set(self._slots.values())
        self._slots[session_id] = next(r for r in range(limit) if r not in used)
        self._queue[session_id] = collections.deque()
        self._seen_dropped[session_id] = 0
        self._unkeyed[session_id] = np.asarray(folded_keys(seed_of(self._stream.decoding), [self._opened])[0])
        self._opened += 1
        if self.recall is not None:
            self.recall.open(session_id)

    def seed_session(self, session_id: str, seed: int, index: int = 0) -> None:
        """Gives an open session the sampling keys of `seed` (folded as the `index`-th session of that seed: the
        `index`-th choice of a request), between ticks: the same seed and the same requests give the same samples."""
        self._check_open(session_id)
        key = np.asarray(folded_keys(int(seed), [int(index)])[0])
        row = self._slots[session_id]
        if session_id in self._unkeyed or row >= self.state.kv.batch:
            self._unkeyed[session_id] = key
        else:
            self._set_keys(np.asarray([row], np.int32), key[None])

    def close(self, session_id: str) -> None:
        """Removes a session (between ticks); all of its pages return to the pool. KeyError if unknown."""
        self._check_open(session_id)
        row = self._slots.pop(session_id)
        del self._queue[session_id], self._seen_dropped[session_id]
        self._unkeyed.pop(session_id, None)
        self._preempted.discard(session_id)
        if self.recall is not None:
            self.recall.close(session_id)
        if row < self.state.kv.batch:  # a session opened since the last tick has no row yet
            self.state = _reset_row(self.state, np.int32(row))

    def speak(self, speech_id: str, prompt_ids: Sequence[int], answer_ids: Sequence[int], *, voice: str,
              max_new_tokens: int, media: Sequence[MediaRows] = ()) -> int:
        """Admits an utterance to the speech pool between ticks: the thinker's prompt and answer ids spoken with
        `voice`; its talker steps and vocoder chunks run on the next ticks (`TickReport.speech`). Returns the talker
        pages reserved. Raises ValueError (no `EngineConfig.speech`), `Overloaded` and the refusals of
        `omnijax.serve.engine.speech.SpeechPool.open`, changing nothing."""
        if self.speech is None:
            raise ValueError("this engine has no speech pool: give EngineConfig(speech=SpeechConfig(...)) with a "
                             "model that speaks")
        return self.speech.open(speech_id, prompt_ids, answer_ids, voice=voice, max_new_tokens=max_new_tokens,
                                media=media)

    def close_speech(self, speech_id: str) -> None:
        """Drops an utterance from the speech pool (between ticks); its talker pages return. KeyError if unknown."""
        if self.speech is None:
            raise KeyError(f"unknown speech {speech_id!r}: this engine has no speech pool")
        self.speech.close(speech_id)

    def submit(self, session_id: str, chunk: Chunk, answer_tokens: int) -> None:
        """Queues one frame's chunk (`[1, T']`, T' <= chunk_tokens) asking for `answer_tokens` answer tokens.

        One queued chunk per session is served per tick, oldest first.
        """
        self._check_open(session_id)
        tau, T = self.config.max_answer_tokens, self.config.chunk_tokens
        if isinstance(answer_tokens, bool) or not 0 <= int(answer_tokens) <= tau:
            raise ValueError(f"answer_tokens must lie in [0, max_answer_tokens={tau}], got {answer_tokens!r}")
        ids = np.asarray(chunk.token_ids)
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"submit one session's chunk with token_ids [1, T'], got shape {ids.shape}")
        if ids.shape[1] > T:
            raise ValueError(f"chunk of {ids.shape[1]} tokens exceeds the engine's chunk_tokens={T}")
        chunk = dataclasses.replace(chunk, answer_tokens=np.asarray([int(answer_tokens)], np.int32))
        chunks_lib.validate(chunk, self.model_config, max_answer_tokens=tau, stacked=False,
                            decoding=self._stream.decoding)
        chunk = jax.tree.map(np.asarray, chunks_lib.pad_chunk(chunk, T))
        A = self.model_config.position_axes
        if chunk.positions.shape[0] != A:
            chunk = dataclasses.replace(chunk, positions=np.broadcast_to(chunk.positions, (A,) + ids.shape[:1] + (T,)))
        self._queue[session_id].append(chunk)

    # ---------------------------------------------------------------------------------------------- ticks
    def _arrange(self) -> None:
        """Moves the state to the smallest bucket that holds the open sessions, compacting rows: every open session
        ends in a row of the state (one opened since the last tick may hold a row past the batch even when the bucket
        stays, e.g. after another session closed: it moves into a free row)."""
        old = self.state.kv.batch
        bucket = pick_bucket(max(1, len(self._slots)), self.config.buckets)
        assert bucket is not None, "open() admits no more sessions than the largest bucket holds"
        moved = compact_rows(self._slots, bucket, old)
        if moved is None:
            return
        self._slots, rows = moved
        self.state = jax.device_put(take_rows(self.state, rows), self._device)

    def _install_keys(self) -> None:
        """Gives the rows of newly opened sessions their sampling keys (their rows exist after `_arrange`)."""
        if not self._unkeyed:
            return
        rows = np.asarray([self._slots[s] for s in self._unkeyed], np.int32)
        self._set_keys(rows, np.stack(list(self._unkeyed.values())))
        self._unkeyed.clear()

    def _set_keys(self, rows: np.ndarray, keys: np.ndarray) -> None:
        """Writes sampling keys into rows of the state through a host copy of `key [B, 2]` (a few bytes): an eager
        `.at[rows].set` would compile small programs for every new count of rows, on a request's first token."""
        key = np.array(self.state.key)
        key[rows] = keys
        self.state = dataclasses.replace(self.state, key=jax.device_put(key, self._device))

    def _batch(self, frames: dict[str, Chunk], rows: Mapping[str, int] | None = None, B: int | None = None
               ) -> Chunk:
        """Stacks the frames of the served sessions into their rows of a `[B, T]` chunk; other rows are empty
        (`rows`, `B`: other rows and batch than the state's, e.g. one session's frame alone)."""
        per_row = getattr(self._stream.decoding, "per_row", False)
        return batch_frames(frames, self._slots if rows is None else rows, self.state.kv.batch if B is None else B,
                            self.config.chunk_tokens,
                            self.model_config.position_axes,
                            np.asarray(self._stream.decoding.rows(1)) if per_row else None)

    def tick(self, *, per_token: bool | None = None, on_token: OnToken | None = None,
             constraints: Mapping[str, TokenConstraint] | None = None) -> TickReport:
        """Serves every session with a submitted chunk in one batched step, then the speech pool's talker step and due
        vocoder chunks (when the engine speaks); returns the `TickReport`.

        Args:
            per_token: run this tick host-driven (None: `EngineConfig.per_token`); see `EngineConfig.per_token`.
            on_token: host-driven ticks call `on_token(session id, token, logprob entry or None)` in this thread
                after every token a served row decodes (the entry as in `FrameOutput.logprobs`); a True return ends
                that row now (its answer was cancelled).
            constraints: {session id: `omnijax.serve.engine.constraint.TokenConstraint`}: those rows draw only the
                tokens their `bitmask()` allows; the tick runs host-driven.
        """
        constraints = dict(constraints or {})
        if self.recall is not None and constraints:
            raise ValueError("constrained decoding (tick(constraints=...)) is not supported with StreamConfig(recall="
                             "...) yet: a question's steps run on their own, fused; serve without one of the two")
        host = bool(constraints) or (self.config.per_token if per_token is None else bool(per_token))
        start_s = self.telemetry.now()
        t0 = time.perf_counter()
        self._arrange()
        self._install_keys()
        frames, parked = {}, {}
        scoring = {} if self.recall is None else self.recall.scoring  # questions being scored wait at their queue
        for s, q in self._queue.items():
            if q and s not in scoring:
                (parked if s in self._preempted else frames)[s] = q.popleft()
        outputs: dict[str, FrameOutput] = {}
        for s, c in parked.items():  # preempted: the frame comes back empty, its chunk is not written
            outputs[s] = FrameOutput(s, [], None, int(np.sum(c.valid)), True, int(c.answer_tokens[0]))
        newly, dropped = [], {}  # dropped: tokens this tick's writes lost
        table_only = True  # every write drop of this tick hit a full page-table row, none an empty pool
        served: list[tuple[dict, tuple, Mapping[str, int], dict]] = []  # (frames, result, rows, ends)
        # recall (issue 40): questions recall between the steps; a session whose recall is in progress runs alone
        def alone(side: dict[str, Chunk]) -> None:
            for s, c in side.items():
                result = self.recall.serve(self, s, c, self._batch({s: c}, {s: 0}, 1))
                served.append(({s: c}, result, {s: 0}, side_tokens(s, c, result, on_token if host else None)))

        alone({} if self.recall is None else self.recall.prepare(self, frames))  # questions go to their scoring
        if frames:
            batch = self._batch(frames)
            ends: dict[str, RowEnd] = {}
            before = None if self.recall is None else self.recall.before_batch(self, frames)
            keep = self.recall is not None  # the step keeps its chunk's record for the capture (static)
            if host:
                result, ends = host_tick(self, batch, frames, on_token, constraints, keep_written=keep)
            else:
                more = {"tap_answer": True} if self.taps_answer else {}
                if keep:
                    more["keep_written"] = True
                self.state, result = engine_step(self._graphdef, self._params, self.state, batch,
                                                 config=self._stream, **more)
                result = jax.device_get(jax.block_until_ready(result))
            if self.recall is not None:
                result, written = result[:-1], jax.device_get(result[-1])
                self.recall.after_batch(self, frames, before, result[2], written)
            served.append((frames, result, self._slots, ends))
        alone({} if self.recall is None else self.recall.land(self))  # questions whose scores are ready
        for s, (c, why) in ({} if self.recall is None else self.recall.take_failures()).items():
            outputs[s] = FrameOutput(s, [], None, 0, False, int(c.answer_tokens[0]), error=why, written=False)
        for group, result, rows, ends in served:
            logits, tokens, exhausted, cum_dropped, num_free, table_full, logprobs = result[:7]
            tapped = result[7] if len(result) > 7 else None  # `taps_answer`: [B, tau, D]
            for s, c in group.items():
                r, asked = rows[s], int(c.answer_tokens[0])
                lost = int(cum_dropped[r]) - self._seen_dropped[s]
                self._seen_dropped[s] = int(cum_dropped[r])
                dropped[s] = lost
                table_only = table_only and (lost == 0 or bool(table_full[r]))
                if bool(exhausted[r]):
                    self._preempted.add(s)
                    newly.append(s)
                    outputs[s] = FrameOutput(s, [], None, lost, True, asked)
                    continue
                toks = [int(t) for t in tokens[r, :asked] if t >= 0]
                end = ends.get(s, RowEnd())
                toks = toks[:end.cut] if isinstance(end, SideEnd) else toks
                outputs[s] = FrameOutput(s, toks, np.asarray(logits[r]) if self.config.return_logits else None,
                                         lost, False, asked, logprobs=frame_logprobs(c, logprobs, r, len(toks)),
                                         complete=end.complete, error=end.error,
                                         answer_rows=None if tapped is None else np.asarray(
                                             tapped[r, :len(toks)], np.float32))
        free = int(served[-1][1][4]) if served else self.free_pages
        speech = self.speech.tick() if self.speech is not None else []  # talker step + due vocoder chunks
        latency = time.perf_counter() - t0
        used = self.config.num_pages - free
        empty = [s for s, o in outputs.items() if o.asked > 0 and not o.tokens]
        waiting = len(self._preempted)
        running = len(self._slots) - waiting
        n_tokens = sum(len(o.tokens) for o in outputs.values())
        for o in outputs.values():
            o.tick_s, o.occupancy = latency, used / self.config.num_pages
        events = self.telemetry.record(
            start_s=start_s, latency_s=latency, used_pages=used, running=running, waiting=waiting,
            served=len(frames), tokens=n_tokens, bucket=self.state.kv.batch, dropped=dropped,
            pool_empty=not table_only, preempted=newly, empty=empty, parked=list(parked))
        return TickReport(outputs=outputs, latency_s=latency, occupancy=used / self.config.num_pages,
                          running=running, waiting=waiting, tokens=n_tokens, events=events, served=len(frames),
                          queued=sum(len(q) for q in self._queue.values()), used_pages=used, free_pages=free,
                          bucket=self.state.kv.batch, tick=len(self.telemetry.records) - 1, per_token=host,
                          speech=speech, recalling=tuple(scoring))

    # ------------------------------------------------------------------------------------------------ recall
    def hold_recall(self, session_id: str) -> None:
        """Keeps the units the session's next question recalls until `release_recall` (or its next chunk with
        tokens), so the answer's continuation frames read them too (`Session.hold_recall`). Nothing happens without
        recall. KeyError if unknown."""
        self._check_open(session_id)
        if self.recall is not None:
            self.recall.held.add(session_id)

    def release_recall(self, *session_ids: str) -> None:
        """Ends the sessions' held recalls (between ticks): their recalled tokens leave the cache, the policy trims
        (`Session.release_recall`). Unknown sessions and sessions with nothing recalled are skipped."""
        if self.recall is not None:
            for sid in session_ids:
                self.recall.release(self, sid)

    def end_recalls(self, session_ids: list[str]) -> dict[str, RecallStats]:
        """Ends the sessions' answers for recall (`release_recall`) and returns the recall figures of those still
        open (none without recall)."""
        self.release_recall(*session_ids)
        if self.recall is None:
            return {}
        return {s: self.recall.stats(s) for s in session_ids if s in self._slots and s in self.recall.sessions}

    def recall_stats(self, session_id: str) -> RecallStats:
        """The session's recall figures (`omnijax.streaming.recall_session.RecallStats`: units and bytes stored,
        dropped and recalled). Raises KeyError (unknown session) or ValueError (recall off)."""
        self._check_open(session_id)
        if self.recall is None:
            raise ValueError("recall is off for this engine: give StreamConfig(recall=Recall(...))")
        return self.recall.stats(session_id)

    # -------------------------------------------------------------------------------------------- persistence
    def export_session(self, session_id: str, *, meta: dict | None = None) -> snapshot_lib.SessionSnapshot:
        """A host copy of an open session's state (`omnijax.serve.engine.snapshot.SessionSnapshot`), between ticks.

        Chunks queued but not yet served are not part of it. The session stays open and unchanged. `meta`: JSON
        data stored with the snapshot. Raises KeyError (unknown session) or ValueError (preempted: its context is
        incomplete, so it is never resumed).
        """
        self._check_open(session_id)
        if session_id in self._preempted:
            raise ValueError(f"session {session_id!r} is preempted (its KV is incomplete); it cannot be exported")
        self._arrange()  # a session opened since the last tick gets its row and key here
        self._install_keys()
        tier = None if self.recall is None else self.recall.snapshot(self, session_id)
        snapshot = snapshot_lib.export_row(self.state, self._slots[session_id], meta=meta)
        return snapshot if tier is None else dataclasses.replace(snapshot, tier=tier)

    def import_session(self, session_id: str, snapshot: snapshot_lib.SessionSnapshot) -> None:
        """Opens `session_id` (like `open`) holding a snapshot's state: its pages, cursor, sampling key and logits.

        Every check runs before the session opens; on any refusal the engine is unchanged. Raises
        `DuplicateSession`, `Overloaded`, `omnijax.serve.engine.snapshot.SnapshotMismatch` (another page size or model
        shape), `NotEnoughPages` (too few free pages, or page-table rows too narrow) or ValueError (a snapshot of
        an exhausted session).
        """
        if session_id in self._slots:
            raise DuplicateSession(f"session {session_id!r} is already open")
        snapshot_lib.check_importable(self.state, snapshot)
        if bool(snapshot.exhausted):
            raise ValueError("the snapshot is of an exhausted (preempted) session; its KV is incomplete")
        if self.recall is None and snapshot.tier is not None:
            raise ValueError("the snapshot carries a recall host tier but this engine's StreamConfig has no recall: "
                             "import it into an engine with StreamConfig(recall=Recall(...))")
        if self.recall is not None and snapshot.tier is None and int(snapshot.next_order) > 0:
            raise ValueError("the snapshot's host tier is missing: an engine with StreamConfig(recall=...) imports "
                             "a session holding tokens only with its tier (Engine.export_session of such an engine)")
        opened = self._opened
        self.open(session_id)
        try:
            self._arrange()
            self._install_keys()
            self.state = snapshot_lib.import_row(self.state, self._slots[session_id], snapshot, donate=True)
            if self.recall is not None and snapshot.tier is not None:
                self.recall.restore(self, session_id, snapshot.tier)  # a corrupt tier is refused by name here
        except BaseException:
            self.close(session_id)
            self._opened = opened
            raise
        self._unkeyed.pop(session_id, None)  # the snapshot's key replaces the freshly folded one
        self._seen_dropped[session_id] = int(snapshot.dropped)

    def fork_session(self, source: str, targets: list[str], *, share: bool = True) -> tuple[bool, int, int]:
        """Makes the open, empty sessions `targets` forks of the open session `source` (n choices of one prompt),
        between ticks: each continues from its cache, cursor, key, logits and penalty history, sharing its full pages
        when `share` (`omnijax.serve.engine.rows.check_fork`, `omnijax.kv.page_sharing`). Returns `(shared, shared
        pages, pages copied per target)`. Raises KeyError, ValueError or `NotEnoughPages`, changing nothing.

        With recall, every fork takes a copy of the source's host tier (immutable: shared, not copied) and no page
        is shared (recall re-lays and releases a row's cached tokens in place, outside the step's copy-on-write)."""
        for s in (source, *targets):
            self._check_open(s)
        if source in self._preempted:
            raise ValueError(f"session {source!r} is preempted (its KV is incomplete); it cannot be forked")
        self._arrange()
        self._install_keys()
        rows = [self._slots[t] for t in targets]
        tier = None if self.recall is None else self.recall.snapshot(self, source)  # refused while recalling
        share, shared, copied = check_fork(self.state, self._slots[source], rows, self._stream,
                                           share and tier is None)
        self.state = _fork_rows(self.state, np.int32(self._slots[source]), np.asarray(rows, np.int32), share=share)
        if self.recall is not None:
            for t in targets:
                self.recall.restore(self, t, tier)
        self._seen_dropped.update({t: self._seen_dropped[source] for t in targets})
        return share, shared, copied
