"""The engine worker: asyncio sessions over the Metronome engine's batched ticks.

Every front end (`/v1/realtime`, `/v1/chat/completions`) drives sessions through one `EngineWorker`:

- `open(sid)` admits a session (AIMD cap, then an engine slot) or raises `Overloaded`; `close(sid)` frees it.
- `feed(sid, parts)` queues chunks (at most `chunk_tokens` each, see `omnijax.conversation`); the returned
  future resolves once the last one has been written.
- `respond(sid, prompt, max_tokens)` queues a response: its prompt parts, then continuation chunks asking for up to
  tau tokens per tick until a stop token, `max_tokens`, or `cancel(sid)`. Its `Answer` yields token deltas: one per
  token when the engine runs per token (`EngineConfig.per_token`: a tick in which an answer decodes runs host-driven,
  and the engine thread hands each token to the event loop as it is decoded, `loop.call_soon_threadsafe`), else one
  per tick. A response may carry a token constraint (`omnijax.serve.engine.constraint.TokenConstraint`): its ticks
  run host-driven whatever `per_token` says, each token drawn under its mask; the answer completes when it is
  finished.
- `speak(speech_id, prompt_ids, answer_ids, voice=..., max_new_tokens=...)` admits an utterance to the engine's
  speech pool (`omnijax.serve.engine.worker_speech`); its `SpeechStream` yields the vocoder chunks as the ticks
  decode them, and the loop ticks while anything speaks.

A session's chunks are served in the order queued, one per tick; a response holds its session's lane until it ends,
so what is queued behind it (the next message, audio frames that kept arriving) follows the answer in the cache.

Ticks are work-conserving: the loop runs one `Engine.tick()` as soon as any session has a chunk to serve, and
otherwise sleeps until one arrives. The engine runs in a one-thread executor, so sockets are served while a tick
runs, and `open`/`close` run in the same executor, always between ticks. Each tick's wall latency feeds the AIMD
controller. A failed tick fails the answers and feeds of the sessions in it, says so, and the loop goes on.

Admission counts work, not sockets: the AIMD cap is checked against the *active* sessions (those with work queued or
decoding, or whose last chunk was served within `idle_after_s`), so idle connections cannot starve new work; the
session cap (`max_sessions`, the engine's slots) still counts every open session. When no tick has run for an idle
interval the AIMD cap takes a recovery step (`AIMD.recover`). `wait_capacity` lets a caller wait (bounded) for a
session to close or the cap to move instead of failing at once. `begin_shutdown` refuses new sessions and ends every
response at once (failed, "the server is shutting down"), so a stopping server is not held by answers in flight.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.decoding import answer_stop_ids
from omnijax.serve.engine.admission import AIMD, Overloaded
from omnijax.serve.engine.answer import Answer
from omnijax.serve.engine.constraint import TokenConstraint
from omnijax.serve.engine.deliver import deliver, end_recalling, keep_recalling, kv_cells, watch_scoring
from omnijax.serve.engine.engine import Engine
from omnijax.serve.engine.snapshot import SessionSnapshot
from omnijax.serve.engine.worker_speech import SpeakingWorker, SpeechStream

if TYPE_CHECKING:
    from omnijax.conversation import Prompt

__all__ = ["Answer", "EngineWorker", "SpeechStream"]  # defined in omnijax.serve.engine.answer / worker_speech

T = TypeVar("T")

log = logging.getLogger("omnijax.serve")


@dataclasses.dataclass
class _Item:
    chunk: object
    answer: Answer | None = None  # the prompt part that starts this answer
    fed: asyncio.Future | None = None  # resolved when this (last) part has been written
    frame: asyncio.Future | None = None  # resolved with the tick's `FrameOutput` (a `frame()` chunk)
    asked: int = 0  # answer tokens a `frame()` chunk asks for


@dataclasses.dataclass
class _Lane:
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    answer: Answer | None = None  # decoding: continuation chunks until it ends
    continuation: object = None  # builds a continuation chunk: (answer_unit, tokens) -> Chunk


class EngineWorker(SpeakingWorker):
    """Serves sessions from an `Engine` (see the module docstring).

    Args:
        engine: `omnijax.serve.engine.engine.Engine`.
        admission: optional `omnijax.serve.engine.admission.AIMD` (fed each tick's latency; asked on every `open`).
        max_sessions: the most sessions open at once (None: the engine's largest bucket).
        idle_after_s: a session with nothing queued counts as active for admission this long after its last chunk
            (None: four frame budgets, at least 2 s).
        recovery_s: an idle interval: with no tick for this long the AIMD cap takes one recovery step (None: the
            frame budget, at least 1 s).
    """

    def __init__(self, engine: Engine, *, admission: AIMD | None = None, max_sessions: int | None = None,
                 idle_after_s: float | None = None, recovery_s: float | None = None):
        self.engine, self.admission = engine, admission
        self.max_sessions = engine.config.buckets[-1] if max_sessions is None else int(max_sessions)
        budget = engine.config.frame_budget_s
        self.idle_after_s = max(2.0, 4 * budget) if idle_after_s is None else float(idle_after_s)
        self.recovery_s = max(1.0, budget) if recovery_s is None else float(recovery_s)
        if not self.idle_after_s >= 0 or not self.recovery_s > 0:
            raise ValueError(f"idle_after_s must be >= 0 and recovery_s > 0, got {idle_after_s}, {recovery_s}")
        self.tau = engine.config.max_answer_tokens
        self.per_row = bool(getattr(engine.config.stream.decoding, "per_row", False))
        self.stop_ids = frozenset(answer_stop_ids(engine.config.stream.decoding, engine.model_config.eos_token_ids))
        self.lanes: dict[str, _Lane] = {}
        self.stats = {"ticks": 0, "tick_errors": 0, "opened": 0, "refused": 0, "tokens": 0}
        self._init_speech()  # utterances on the engine's speech pool (`speak`: omnijax.serve.engine.worker_speech)
        self.latencies: collections.deque = collections.deque(maxlen=4096)  # per tick, seen from the event loop
        # per tick, the engine thread's own time (submits and the step): a latency far above it is time the tick's
        # result waited for the event loop
        self.compute_s: collections.deque = collections.deque(maxlen=4096)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omnijax-tick")
        self._work: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._draining = False  # begin_shutdown: no new sessions or responses; ticks go on for what is queued
        self._joining = 0
        self._last_work: dict[str, float] = {}  # sid -> monotonic time its last chunk was served
        self._capacity_waiters: set[asyncio.Future] = set()
        self._cancelled: list = []  # (sid, answer) cancelled between ticks, to end with their cells
        self._recalling: dict[str, tuple] = {}  # questions the engine scores (`deliver.keep_recalling`)
        self._watched: set = set()  # their scoring jobs, whose end wakes the loop (`deliver.watch_scoring`)

    async def start(self) -> None:
        self._work = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Finishes the tick in flight, fails what is still queued, stops the loop and the executor."""
        self._stopping = True
        if self._work is not None:
            self._work.set()
        if self._task is not None:
            await self._task
        for lane in self.lanes.values():
            self._fail(lane, "server shutting down")
        await self._fail_speech("server shutting down")
        self._pool.shutdown(wait=True)

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Refuses new sessions and ends every queued or decoding response now (failed with `reason`); queued feeds
        fail too. Sessions stay open until their handlers close them. Idempotent."""
        if self._draining:
            return
        self._draining = True
        for lane in self.lanes.values():
            self._fail(lane, reason)
        if self.speaking:
            asyncio.ensure_future(self._fail_speech(reason))
        self._notify_capacity()
        if self._work is not None:
            self._work.set()

    @property
    def stopping(self) -> bool:
        """Whether `begin_shutdown` or `stop` was called."""
        return self._draining or self._stopping

    def active_sessions(self, now: float | None = None) -> int:
        """Sessions that count against the AIMD cap: busy, joining, or served within `idle_after_s`; and each
        utterance in the speech pool."""
        now = time.monotonic() if now is None else now
        recent = sum(1 for sid in self.lanes
                     if self.busy(sid) or now - self._last_work.get(sid, -float("inf")) < self.idle_after_s)
        return recent + self._joining + len(self.speaking)

    async def wait_capacity(self, timeout_s: float) -> bool:
        """Waits until a session closes, the AIMD cap moves or a session turns idle (True), or `timeout_s` passes
        (False)."""
        future = asyncio.get_running_loop().create_future()
        self._capacity_waiters.add(future)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._capacity_waiters.discard(future)

    def _notify_capacity(self) -> None:
        for future in self._capacity_waiters:
            if not future.done():
                future.set_result(None)

    async def in_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` in the engine's thread, between ticks."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------------------------------------ sessions
    async def open(self, sid: str, snapshot: SessionSnapshot | None = None) -> None:
        """Admits a session; raises `Overloaded` (AIMD cap, session cap or no engine slot). With a `snapshot`
        (`omnijax.serve.engine.snapshot.SessionSnapshot`) the session resumes its state (`Engine.import_session`, whose
        refusals leave the engine unchanged)."""

        current = len(self.lanes) + self._joining
        try:
            if self.stopping:
                raise Overloaded("the server is shutting down", cap=0, current=current)
            if current >= self.max_sessions:
                raise Overloaded(f"overloaded: {current} sessions open, the server holds at most "
                                 f"{self.max_sessions}; retry later", cap=self.max_sessions, current=current)
            if self.admission is not None:
                self.admission.check(self.active_sessions())
            self._joining += 1
            opening = asyncio.ensure_future(self.in_engine(self.engine.open, sid) if snapshot is None
                                            else self.in_engine(self.engine.import_session, sid, snapshot))
            try:
                await asyncio.shield(opening)
            except asyncio.CancelledError:
                # The caller went away (a client disconnect cancels its handler): the engine may open the session
                # all the same, so close it there once the open is done; no slot is left behind.
                opening.add_done_callback(lambda done: done.cancelled() or done.exception() is not None or
                                          asyncio.ensure_future(self.in_engine(self._close_engine, sid)))
                raise
            finally:
                self._joining -= 1
        except Overloaded:
            self.stats["refused"] += 1
            raise
        self.lanes[sid] = _Lane()
        self.stats["opened"] += 1

    async def close(self, sid: str) -> None:
        """Closes a session: its queued chunks are dropped (their futures fail), its pages return to the pool."""
        lane = self.lanes.pop(sid, None)
        self._last_work.pop(sid, None)
        if lane is None:
            return
        self._fail(lane, "session closed")
        end_recalling(self, sid, "session closed")
        self._notify_capacity()
        # Shielded: a caller cancelled meanwhile (a client disconnect) must not leave the engine's slot taken.
        await asyncio.shield(asyncio.ensure_future(self.in_engine(self._close_engine, sid)))

    async def export(self, sid: str, meta: dict, timeout_s: float = 30.0) -> SessionSnapshot:
        """A snapshot of the session once its queued chunks are written and its answer has ended (waits up to
        `timeout_s`; an answer still decoding is cancelled first). Raises TimeoutError or ValueError (preempted)."""
        self.cancel(sid)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.busy(sid):
            if loop.time() > deadline:
                raise TimeoutError(f"session {sid!r} did not become idle within {timeout_s:g} s")
            await asyncio.sleep(0.01)
        return await self.in_engine(lambda: self.engine.export_session(sid, meta=meta))

    def _close_engine(self, sid: str) -> None:
        try:
            self.engine.close(sid)
        except KeyError:
            pass

    def feed(self, sid: str, parts: list) -> asyncio.Future:
        """Queues chunks; the future resolves (to None) when the last has been written, or fails."""
        lane = self._lane(sid)
        fed = asyncio.get_running_loop().create_future()
        if not parts:
            fed.set_result(None)
            return fed
        for chunk in parts[:-1]:
            lane.pending.append(_Item(chunk))
        lane.pending.append(_Item(parts[-1], fed=fed))
        self._work.set()
        return fed

    def frame(self, sid: str, chunk: Chunk, answer_tokens: int = 0) -> asyncio.Future:
        """Queues one chunk asking for `answer_tokens` (<= tau) tokens; the future resolves with its tick's
        `FrameOutput` (tokens, logits when the engine returns them, dropped, preempted): the per-frame path of the
        native protocol and of duplex sessions, which decide on the host."""
        lane = self._lane(sid)
        if isinstance(answer_tokens, bool) or not 0 <= int(answer_tokens) <= self.tau:
            raise ValueError(f"answer_tokens must lie in [0, {self.tau}], got {answer_tokens!r}")
        future = asyncio.get_running_loop().create_future()
        lane.pending.append(_Item(chunk, frame=future, asked=int(answer_tokens)))
        self._work.set()
        return future

    def respond(self, sid: str, prompt: Prompt, max_tokens: int, continuation: Callable[[int, int], Chunk],
                sampling: np.ndarray | None = None, constraint: TokenConstraint | None = None) -> Answer:
        """Queues a response: `prompt` (`conversation.Prompt`), then continuations (`continuation(unit, n)`);
        `sampling` (`omnijax.decoding.sampling_row`) draws it with its own settings (a per-row engine only);
        `constraint` (`omnijax.serve.engine.constraint.TokenConstraint`, one object per response: it keeps the
        response's state) masks every token it draws (its methods run in the engine's thread); the answer
        completes when the constraint is finished."""
        lane = self._lane(sid)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if sampling is not None and not self.per_row:
            raise ValueError(f"per-response sampling needs an engine decoding with omnijax.decoding.RowSampling, "
                             f"not {self.engine.config.stream.decoding!r}")
        if constraint is not None and self.engine.recall is not None:
            raise ValueError("constrained decoding is not supported with StreamConfig(recall=...) yet; serve "
                             "without one of the two")
        if constraint is not None and not isinstance(constraint, TokenConstraint):
            raise ValueError(f"constraint must be an omnijax.serve.engine.constraint.TokenConstraint (bitmask, "
                             f"accept, finished), got {type(constraint).__name__}")
        answer = Answer(max_tokens, self.stop_ids, prompt.answer_unit, sampling, constraint)
        if self.stopping:
            answer._finish("failed", "the server is shutting down")
            return answer
        if self.tau < 1:  # every frame would ask for 0 tokens and the answer would wait for ever
            answer._finish("failed", "this server decodes no answers: its StreamConfig has max_answer_tokens=0 "
                                     "(tau, set for full-duplex serving); serve with --answer-tokens >= 1 (or "
                                     "StreamConfig(max_answer_tokens >= 1) in build_context)")
            return answer
        for chunk in prompt.parts[:-1]:
            lane.pending.append(_Item(chunk))
        lane.pending.append(_Item(prompt.parts[-1], answer=answer))
        lane.continuation = continuation
        self._work.set()
        return answer

    def cancel(self, sid: str) -> bool:
        """Cancels the session's response being decoded or queued; True when there was one."""
        lane = self._lane(sid)
        answers = [item.answer for item in lane.pending if item.answer is not None]
        answers += [lane.answer] if lane.answer is not None else []
        answers += [self._recalling[sid][3]] if sid in self._recalling and self._recalling[sid][3] else []
        for answer in answers:
            answer.cancelled = True
        self._work.set()
        return bool(answers)

    def abandon(self, sid: str, reason: str = "the client went away") -> None:
        """Drops everything the session has queued (a long prompt's chunks too) and cancels its answer: the request
        of a client that left ends at the next tick, not after its whole prompt is fed."""
        lane = self.lanes.get(sid)
        if lane is None:
            return
        for item in lane.pending:
            for future in (item.fed, item.frame):
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(reason))
            if item.answer is not None:
                item.answer.cancelled = True
                item.answer._finish("cancelled", "cancelled")
        lane.pending.clear()
        if lane.answer is not None:
            lane.answer.cancelled = True
        self._work.set()

    def busy(self, sid: str) -> bool:
        """Whether the session has chunks queued or a response decoding."""
        lane = self.lanes.get(sid)
        return lane is not None and (bool(lane.pending) or lane.answer is not None or sid in self._recalling)

    def _lane(self, sid: str) -> _Lane:
        if sid not in self.lanes:
            raise KeyError(f"session {sid!r} is not open")
        return self.lanes[sid]

    def _fail(self, lane: _Lane, reason: str) -> None:
        for item in lane.pending:
            for future in (item.fed, item.frame):
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(reason))
            if item.answer is not None:
                item.answer._finish("failed", reason)
        lane.pending.clear()
        if lane.answer is not None:
            lane.answer._finish("failed", reason)
            lane.answer = None

    # ---------------------------------------------------------------------------------------------------- ticks
    def _plan(self) -> dict:
        """Takes each session's next chunk: {sid: (chunk, asked, item or None, answer or None)}."""
        plan = {}

        def drawn(chunk, answer):  # an answer's chunks carry its sampling row
            if answer is None or answer.sampling is None:
                return chunk
            return dataclasses.replace(chunk, sampling=np.asarray(answer.sampling, np.float32)[None])

        for sid, lane in self.lanes.items():
            if sid in self._recalling:  # submitted already: the engine serves it once its scores are ready
                plan[sid] = self._recalling[sid]
                continue
            if lane.answer is not None and lane.answer.cancelled:  # between ticks: ends once its cells are read
                lane.answer._ending = ("cancelled", "cancelled")
                self._cancelled.append((sid, lane.answer))
                lane.answer = None
            if lane.answer is not None:
                answer = lane.answer
                asked = min(self.tau, answer.remaining)
                plan[sid] = (drawn(lane.continuation(answer.answer_unit, asked), answer), asked, None, answer)
            elif lane.pending:
                item = lane.pending.popleft()
                answer = item.answer
                asked = item.asked
                if answer is not None and not answer.cancelled:
                    asked = min(self.tau, answer.max_tokens)
                plan[sid] = (drawn(item.chunk, answer), asked, item, answer)
        return plan

    def _tick_sync(self, plan: dict, loop: asyncio.AbstractEventLoop):
        """In the engine thread: submit each planned chunk, then one tick. Returns (report, failures).

        A tick in which an answer decodes runs per token when the engine is configured so (or an answer carries a
        constraint): each token is handed to its answer on the event loop as soon as it is decoded
        (`call_soon_threadsafe`, so every token's push runs before the tick's own result reaches the loop), and a
        cancelled answer's row ends at once."""
        start, failed = time.perf_counter(), {}
        for sid, (chunk, asked, _, answer) in plan.items():
            if sid in self._recalling:
                continue
            try:
                if answer is not None:  # recall (issue 40): a question's recall is held over its answer, as Chat's
                    self.engine.hold_recall(sid)
                self.engine.submit(sid, chunk, asked)
            except Exception as e:  # noqa: BLE001 - one session's chunk must not stop the tick
                failed[sid] = f"{type(e).__name__}: {e}"
        answers = {sid: answer for sid, (_, asked, _, answer) in plan.items()
                   if answer is not None and asked > 0 and sid not in failed}
        constraints = {sid: a.constraint for sid, a in answers.items() if a.constraint is not None}

        def on_token(sid: str, token: int, entry) -> bool:
            answer = answers.get(sid)
            if answer is None:  # a native frame's tokens come back with its tick
                return False
            if answer.cancelled:
                return True
            loop.call_soon_threadsafe(answer._push, [token], None if entry is None else [entry])
            return False

        try:
            report = None
            if len(failed) < len(plan):
                if constraints or (answers and self.engine.config.per_token):
                    report = self.engine.tick(per_token=True, on_token=on_token, constraints=constraints)
                elif self.engine.config.per_token:  # no answer decodes: one fused program serves the frames
                    report = self.engine.tick(per_token=False)
                else:
                    report = self.engine.tick()
            elif self._speech_due():  # no thinker work: the tick runs the talkers and vocoders (speech: worker_speech)
                report = self.engine.tick()
        finally:
            self.compute_s.append(time.perf_counter() - start)
        return report, failed

    async def _loop(self) -> None:
        while not self._stopping:
            plan = self._plan()
            if self._cancelled:  # answers cancelled between ticks report the cells their session holds, too
                cancelled, self._cancelled = self._cancelled, []
                await self._finish_with_cells(cancelled)
            idle = all(sid in self._recalling for sid in plan) and not watch_scoring(self)
            if idle and not self._speech_due():  # an answer spoken while written may wait for text (worker_speech)
                self._work.clear()
                try:
                    await asyncio.wait_for(self._work.wait(), self.recovery_s)
                except TimeoutError:  # an idle interval: no tick, so nothing was measured
                    if self.admission is not None:
                        self.admission.recover()
                    self._notify_capacity()
                continue
            start = time.perf_counter()
            try:
                report, failed = await self.in_engine(self._tick_sync, plan, asyncio.get_running_loop())
            except Exception as e:  # noqa: BLE001 - keep serving; these sessions' work is lost, and said so
                self.stats["tick_errors"] += 1
                log.exception("tick failed")
                report, failed = None, {sid: f"tick failed: {type(e).__name__}: {e}" for sid in plan}
                await self._fail_speech(f"tick failed: {type(e).__name__}: {e}")
            latency = time.perf_counter() - start
            self.stats["ticks"] += 1
            self.latencies.append(latency)
            served = time.monotonic()
            for sid in plan:
                if sid in self.lanes:
                    self._last_work[sid] = served
            if self.admission is not None:
                self.admission.observe(latency, self.active_sessions(served))
            ended = self._deliver(plan, report, failed)
            self._deliver_speech(report)
            self._notify_capacity()
            if ended:
                await self._finish_with_cells(ended)
            await asyncio.sleep(0)  # let the sockets run between back-to-back ticks

    async def _finish_with_cells(self, ended: list) -> None:
        """Ends `(sid, answer)` pairs with their `_ending`, each reporting the KV cells its session holds."""
        sids = [sid for sid, _ in ended]
        figures, cells = await self.in_engine(lambda: (self.engine.end_recalls(sids), self.kv_cells(sids)))
        for sid, answer in ended:
            answer.kv_cells, answer.recall = cells.get(sid, 0), figures.get(sid)
            answer._finish(*answer._ending)

    def _deliver(self, plan: dict, report, failed: dict) -> list:
        """Hands each served chunk's result to its feed or answer; returns the answers that ended
        (`omnijax.serve.engine.deliver.deliver`). A question the engine is still scoring is kept for a later tick."""
        return deliver(self, keep_recalling(self, plan, report, failed), report, failed)

    def kv_cells(self, sids: list[str]) -> dict[str, int]:
        """In the engine thread: the KV cells each session holds (`omnijax.serve.engine.deliver.kv_cells`)."""
        return kv_cells(self.engine, sids)
