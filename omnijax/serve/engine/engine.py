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
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.chunks import chunk as chunks_lib
from omnijax.chunks.chunk import Chunk
from omnijax.decoding import ROW_FIELDS, folded_keys, seed_of
from omnijax.kv import paged as paged_lib
from omnijax.paging import migration
from omnijax.retention.baselines import SinkWindow
from omnijax.serve.engine import snapshot as snapshot_lib
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.telemetry import StallEvent, Telemetry
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import StreamModel, bind_config, graphdef_config, model_parts
from omnijax.streaming.step import StreamState, chunk_step, init_state


class DuplicateSession(KeyError, ValueError):
    """`Engine.open` of a session id that is already open (both a `KeyError` and a `ValueError`)."""


def _default_stream() -> StreamConfig:
    return StreamConfig(policy=SinkWindow(sink=16, window=1024), impl="xla", num_pages=256, max_answer_tokens=4)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings.

    Attributes:
        stream: the sessions' settings (`omnijax.StreamConfig`): retention policy (`SinkWindow(sink, window)`
            bounds each session, `NoSlide()` is the unbounded baseline that walls when the pool saturates), paging,
            attention impl, page size, pages of the shared pool (`num_pages`, required), subblock, tau
            (`max_answer_tokens`, the most tokens a frame may ask for) and decoding. Default: `SinkWindow(16,
            1024)`, "xla", a 256-page pool of 64-slot pages, tau 4.
        max_pages: page-table width per session (default: the whole pool).
        chunk_tokens: padded per-tick prefill length T of every session.
        buckets: allowed batch sizes, ascending; the largest is the most sessions the engine holds.
        frame_budget_s: the frame budget B (telemetry counts overruns; AIMD targets a fraction of it).
        return_logits: copy each frame's last-position logits `[V]` to the host.
        fit_fraction: early share of the trace the telemetry's saturation fit uses.
    """

    stream: StreamConfig = dataclasses.field(default_factory=_default_stream)
    max_pages: int | None = None
    chunk_tokens: int = 64
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    frame_budget_s: float = 1.0
    return_logits: bool = True
    fit_fraction: float = 0.25

    def __post_init__(self):
        if not isinstance(self.stream, StreamConfig):
            raise TypeError(f"EngineConfig.stream must be an omnijax.StreamConfig, got {self.stream!r}")
        if self.stream.num_pages is None:
            raise ValueError("an engine's shared pool needs a size: give StreamConfig(num_pages=...)")
        buckets = tuple(int(b) for b in self.buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be distinct positive sizes in ascending order, got {self.buckets}")
        object.__setattr__(self, "buckets", buckets)
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.max_pages is not None and self.max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {self.max_pages}")
        if not self.frame_budget_s > 0:
            raise ValueError(f"frame_budget_s must be positive, got {self.frame_budget_s}")
        if not 0 < self.fit_fraction <= 1:
            raise ValueError(f"fit_fraction must lie in (0, 1], got {self.fit_fraction}")

    @property
    def num_pages(self) -> int:
        """Pages of the shared pool (`stream.num_pages`)."""
        return self.stream.num_pages

    @property
    def max_answer_tokens(self) -> int:
        """tau (`stream.max_answer_tokens`)."""
        return self.stream.max_answer_tokens


@dataclasses.dataclass
class FrameOutput:
    """One session's result of one tick.

    Attributes:
        session_id: the session.
        tokens: answer tokens, chosen by `StreamConfig.decoding` ([] when none were asked, or the session is
            preempted).
        logits: last-position logits `[V]` of the frame's chunk (None when preempted or not returned).
        dropped: tokens of this frame not written to the cache because the pool (or page table) was exhausted;
            for a preempted session, the whole chunk.
        preempted: the session is preempted (exhausted KV): this frame and all later ones are empty.
        asked: answer tokens the frame asked for.
        tick_s: wall latency of the tick the frame ran in.
        occupancy: pool pages in use / pool pages after that tick.
        logprobs: when the frame's sampling row asks for log probabilities (`top_logprobs` >= 0), one entry per
            token: `(logprob, [(token id, logprob), ...])`, the raw model distribution's log probability of the
            token and of the `top_logprobs` most likely tokens (`omnijax.decoding.row_logprobs`); else None.
    """

    session_id: str
    tokens: list[int]
    logits: np.ndarray | None
    dropped: int
    preempted: bool
    asked: int = 0
    tick_s: float = 0.0
    occupancy: float = 0.0
    logprobs: list | None = None


@dataclasses.dataclass
class TickReport:
    """What one tick did.

    Attributes:
        outputs: a `FrameOutput` per session that had a submitted chunk.
        latency_s: wall latency of the tick (host batching, the jitted step to `block_until_ready`, copy back).
        occupancy: pool pages in use / pool pages, after the tick.
        running: open sessions not preempted (vLLM's "running").
        waiting: open sessions preempted after exhaustion (parked, waiting for memory that never comes).
        tokens: answer tokens delivered this tick.
        events: stall events this tick raised.
        served: sessions whose chunk ran in the step.
        queued: chunks still pending after the tick.
        used_pages, free_pages: pool pages in use / free after the tick.
        bucket: batch size the step ran at.
        tick: tick index.
    """

    outputs: dict[str, FrameOutput]
    latency_s: float
    occupancy: float
    running: int
    waiting: int
    tokens: int
    events: list[StallEvent]
    served: int = 0
    queued: int = 0
    used_pages: int = 0
    free_pages: int = 0
    bucket: int = 0
    tick: int = 0


# ------------------------------------------------------------------------------------------------- pure helpers
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


def take_rows(state: StreamState, rows: Sequence[int] | np.ndarray) -> StreamState:
    """Re-arranges the per-row state: new row i takes old row `rows[i]`, or a fresh empty row where it is -1.

    Grows or shrinks the batch (`len(rows)` is the new batch). The pool is untouched, so old rows left out must
    own no pages (reset them first).
    """
    rows = np.asarray(rows, np.int32)  # [B_new]
    src, keep = jnp.asarray(np.maximum(rows, 0)), jnp.asarray(rows >= 0)
    kv = state.kv

    def pick(x, fill):
        return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x[src], jnp.asarray(fill, x.dtype))

    kv = kv.replace(page_table=pick(kv.page_table, -1), seq_slots=pick(kv.seq_slots, 0),
                    next_order=pick(kv.next_order, 0), exhausted=pick(kv.exhausted, False),
                    dropped=pick(kv.dropped, 0))
    return StreamState(kv=kv, next_pos=pick(state.next_pos, 0), key=pick(state.key, 0),
                       last_logits=pick(state.last_logits, 0), counts=pick(state.counts, 0),
                       seen=pick(state.seen, False))


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `n` sessions (None when none does)."""
    return next((b for b in buckets if b >= n), None)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("state",))
def _engine_step(graphdef, params, state, chunk, *, config: StreamConfig):
    """chunk_step + drop_empty_entries. Returns `(state, (logits [B, V], tokens [B, tau], exhausted [B],
    dropped [B], num_free [], table_full [B], logprobs))`, `logprobs` the step's `(chosen, top ids, top logprobs)`
    (None unless the strategy is per-row)."""
    model = nnx.merge(graphdef, params)
    state, out = chunk_step(model, state, chunk, config)
    table_full = jnp.all(state.kv.page_table >= 0, axis=1)  # [B] before empty entries leave the table
    kv = migration.drop_empty_entries(state.kv)
    logprobs = None if out.logprobs is None else (out.logprobs, out.top_ids, out.top_logprobs)
    outputs = (out.logits, out.tokens, kv.exhausted, kv.dropped, kv.num_free, table_full, logprobs)
    return dataclasses.replace(state, kv=kv), outputs


_reset_row = jax.jit(reset_row, donate_argnums=0)


def _frame_logprobs(chunk: Chunk, logprobs, row: int, n: int) -> list | None:
    """The log probabilities of a frame's `n` tokens when its sampling row asks for them (`FrameOutput.logprobs`)."""
    if logprobs is None or chunk.sampling is None:
        return None
    k = int(np.asarray(chunk.sampling)[0, ROW_FIELDS.index("top_logprobs")])
    if k < 0:
        return None
    chosen, ids, values = (np.asarray(x[row]) for x in logprobs)
    return [(float(chosen[i]), [(int(ids[i, j]), float(values[i, j])) for j in range(k)]) for i in range(n)]


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
        self._stream = bind_config(model, config.stream)
        self._graphdef, params = model_parts(model)
        self.model_config = graphdef_config(model)
        self._device = jax.devices()[0]
        self._params = jax.device_put(params, self._device)
        state = init_state(self.model_config, num_pages=config.num_pages, page_size=config.stream.page_size,
                           batch=config.buckets[0], max_pages=config.max_pages)
        self.state: StreamState = jax.device_put(state, self._device)
        self.telemetry = Telemetry(config.num_pages, frame_budget_s=config.frame_budget_s,
                                   fit_fraction=config.fit_fraction)
        self._slots: dict[str, int] = {}  # session -> row, in opening order
        self._queue: dict[str, collections.deque] = {}
        self._preempted: set[str] = set()
        self._seen_dropped: dict[str, int] = {}
        self._opened = 0  # sessions opened so far: the n-th samples with keys folded from the seed and n
        self._unkeyed: dict[str, np.ndarray] = {}  # sessions whose row has not received its sampling key yet

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

    def seed_session(self, session_id: str, seed: int, index: int = 0) -> None:
        """Gives an open session the sampling keys of `seed` (folded as the `index`-th session of that seed: the
        `index`-th choice of a request), between ticks: the same seed and the same requests give the same samples."""
        self._check_open(session_id)
        key = np.asarray(folded_keys(int(seed), [int(index)])[0])
        row = self._slots[session_id]
        if session_id in self._unkeyed or row >= self.state.kv.batch:
            self._unkeyed[session_id] = key
        else:
            self.state = dataclasses.replace(self.state, key=self.state.key.at[row].set(key))

    def close(self, session_id: str) -> None:
        """Removes a session (between ticks); all of its pages return to the pool. KeyError if unknown."""
        self._check_open(session_id)
        row = self._slots.pop(session_id)
        del self._queue[session_id], self._seen_dropped[session_id]
        self._unkeyed.pop(session_id, None)
        self._preempted.discard(session_id)
        if row < self.state.kv.batch:  # a session opened since the last tick has no row yet
            self.state = _reset_row(self.state, np.int32(row))

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
        if bucket == old and all(r < bucket for r in self._slots.values()):
            return
        placed = {s: r for s, r in self._slots.items() if r < bucket}
        free = iter(r for r in range(bucket) if r not in set(placed.values()))
        for s, r in self._slots.items():
            if r >= bucket:
                placed[s] = next(free)
        rows = np.full((bucket,), -1, np.int32)
        for s, r in placed.items():
            src = self._slots[s]
            rows[r] = src if src < old else -1
        self._slots = {s: placed[s] for s in self._slots}
        self.state = jax.device_put(take_rows(self.state, rows), self._device)

    def _install_keys(self) -> None:
        """Gives the rows of newly opened sessions their sampling keys (their rows exist after `_arrange`)."""
        if not self._unkeyed:
            return
        rows = np.asarray([self._slots[s] for s in self._unkeyed], np.int32)
        keys = np.stack(list(self._unkeyed.values()))
        self.state = dataclasses.replace(self.state, key=self.state.key.at[rows].set(keys))
        self._unkeyed.clear()

    def _batch(self, frames: dict[str, Chunk]) -> Chunk:
        """Stacks the frames of the served sessions into their rows of a `[B, T]` chunk; other rows are empty."""
        B, T, A = self.state.kv.batch, self.config.chunk_tokens, self.model_config.position_axes
        z = lambda dtype: np.zeros((B, T), dtype)  # noqa: E731
        out = dict(token_ids=z(np.int32), valid=z(bool), positions=np.zeros((A, B, T), np.int32), unit=z(np.int32),
                   span=z(np.int32), offset=z(np.int32), answer_tokens=np.zeros((B,), np.int32),
                   answer_unit=np.zeros((B,), np.int32), advance=np.zeros((B,), np.int32))
        with_embeds = [c for c in frames.values() if c.embeds is not None]
        if with_embeds:
            D = with_embeds[0].embeds.shape[-1]
            out["embeds"] = np.zeros((B, T, D), with_embeds[0].embeds.dtype)
            out["embed_mask"] = z(bool)
        if getattr(self._stream.decoding, "per_row", False):  # every row carries its settings: one program
            default = np.asarray(self._stream.decoding.rows(1))
            out["sampling"] = np.array(np.broadcast_to(default, (B, default.shape[-1])), np.float32)
        with_levels = [c for c in frames.values() if c.deepstack is not None]
        if with_levels:
            n, D = with_levels[0].deepstack.shape[0], with_levels[0].deepstack.shape[-1]
            out["deepstack"] = np.zeros((n, B, T, D), with_levels[0].deepstack.dtype)
        for s, c in frames.items():
            r = self._slots[s]
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

    def tick(self) -> TickReport:
        """Serves every session with a submitted chunk in one jitted batched step; returns the `TickReport`."""
        start_s = self.telemetry.now()
        t0 = time.perf_counter()
        self._arrange()
        self._install_keys()
        frames, parked = {}, {}
        for s, q in self._queue.items():
            if q:
                (parked if s in self._preempted else frames)[s] = q.popleft()
        outputs: dict[str, FrameOutput] = {}
        for s, c in parked.items():  # preempted: the frame comes back empty, its chunk is not written
            outputs[s] = FrameOutput(s, [], None, int(np.sum(c.valid)), True, int(c.answer_tokens[0]))
        newly, dropped = [], {}  # dropped: tokens this tick's writes lost
        table_only = True  # every write drop of this tick hit a full page-table row, none an empty pool
        if frames:
            batch = self._batch(frames)
            self.state, result = _engine_step(self._graphdef, self._params, self.state, batch, config=self._stream)
            result = jax.device_get(jax.block_until_ready(result))
            logits, tokens, exhausted, cum_dropped, num_free, table_full, logprobs = result
            for s, c in frames.items():
                r, asked = self._slots[s], int(c.answer_tokens[0])
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
                outputs[s] = FrameOutput(s, toks, np.asarray(logits[r]) if self.config.return_logits else None,
                                         lost, False, asked, logprobs=_frame_logprobs(c, logprobs, r, len(toks)))
            free = int(num_free)
        else:
            free = self.free_pages
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
                          bucket=self.state.kv.batch, tick=len(self.telemetry.records) - 1)

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
        return snapshot_lib.export_row(self.state, self._slots[session_id], meta=meta)

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
        opened = self._opened
        self.open(session_id)
        try:
            self._arrange()
            self._install_keys()
            self.state = snapshot_lib.import_row(self.state, self._slots[session_id], snapshot, donate=True)
        except BaseException:
            self.close(session_id)
            self._opened = opened
            raise
        self._unkeyed.pop(session_id, None)  # the snapshot's key replaces the freshly folded one
        self._seen_dropped[session_id] = int(snapshot.dropped)
