"""Streaming: a whole session is one `lax.scan` over chunks; `Session` runs the same jitted step chunk by chunk.

Per chunk: prefill the chunk into the paged cache (all layers), take the logits of its last valid token, let the
retention policy trim (inside the program, `lax.cond` on its own trigger), then answer with up to `max_answer_tokens`
tokens chosen by the decoding strategy when the chunk asks for it. Generated tokens are fed back, so the response is
part of the context. Every setting comes from one `omnijax.StreamConfig`.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.chunks import chunk as chunks_lib
from omnijax.chunks.chunk import Chunk
from omnijax.compilation_cache import cached_jit
from omnijax.decoding import DecodingStrategy, seed_of
from omnijax.heap import trim_heap
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.models.family import OmniModel, family_of
from omnijax.models.layers import padded_one_row_products
from omnijax.retention.base import untrimmed_capacity
from omnijax.streaming.config import DEFAULT_SESSION_PAGES, StreamConfig
from omnijax.streaming.quick_start import QUICK_COMPILE, QuickStart
from omnijax.streaming.recall_session import RecallReport, RecallSnapshot, RecallStats, new_recall_session
from omnijax.streaming.step import (
    ChunkOutput,
    StreamResult,
    StreamState,
    check_state,
    chunk_step,
    init_state,
    pages_needed,
)

# What streams: a loaded model of any family (its `decoder` runs) or a bare `Decoder`.
StreamModel = OmniModel | Decoder


@dataclasses.dataclass(frozen=True)
class SessionSnapshot:
    """A `Session` copied to host (`Session.snapshot`, `Session.resume`).

    Attributes:
        state: the `StreamState` as numpy arrays.
        tier: the recall side (`RecallSnapshot`: host tier, full-context positions, figures); None with recall off.
    """

    state: StreamState
    tier: RecallSnapshot | None


def model_parts(model: StreamModel) -> tuple[Any, Any]:
    """`(graphdef, params)` of the decoder of an `omnijax.Model`, a `MiniCPMOModel` or a bare `Decoder`."""
    decoder = model if isinstance(model, Decoder) else model.decoder
    graphdef, params = nnx.split(decoder)
    return graphdef, params


def graphdef_config(model: StreamModel) -> DecoderConfig:
    """The `DecoderConfig` of a model or decoder."""
    decoder = model if isinstance(model, Decoder) else model.decoder
    return decoder.config


def bind_config(model: StreamModel, config: StreamConfig | None = None, *, allow_recall: bool = False,
                **fields: Any) -> StreamConfig:
    """`StreamConfig.of(config, **fields)` as it runs for `model`: settings a policy leaves to the model family are
    filled in from the model's type (`StreamConfig.for_model`). A config with `recall` is refused unless
    `allow_recall` (`Session`, `Chat`, `evaluate` and the engine carry a host tier; the others would ignore it)."""
    family = family_of(model)
    bound = StreamConfig.of(config, **fields).for_model(family is not None and family.whole_source_image)
    if bound.recall is not None and not allow_recall:
        raise ValueError("StreamConfig(recall=...) is wired into omnijax.Session, omnijax.Chat, omnijax.evaluate "
                         "and the serving engine only so far: stream would ignore it; use one of those, or "
                         "recall=None")
    return bound


_STATIC = ("graphdef", "config")


def _scan_chunks(graphdef, params, state, chunks, *, config):
    model = nnx.merge(graphdef, params)
    return jax.lax.scan(lambda state, chunk: chunk_step(model, state, chunk, config, shared_pages=False), state,
                        chunks)


# The cache is updated in place (the layers' K/V writes, the trim's re-rotation, a migration's copies) only where
# the step owns its input state: a state that is not donated is first copied whole. `stream` donates the state it
# creates and keeps one given to it; `Session` owns its state.
# `cached_jit`: kept as serialised executables beside the compilation cache, so a later process loads them without
# tracing the model again.
_scan = cached_jit(_scan_chunks, static_argnames=_STATIC)
_scan_owned = cached_jit(_scan_chunks, static_argnames=_STATIC, donate_argnames=("state",))


# A session's empty state as one program: built eagerly, its ~25 `jnp` constructors (zeros and fulls of every field,
# the page stack's arange, the sampling keys' split) each compiled a program of their own (one per shape and dtype)
# before a new process's first step; kept like the step, so a later process loads it untraced. The seed is an
# argument (an int32 array: the keys equal `sampling_keys(seed, batch)`'s, which also keeps the low 32 bits), so
# every seed runs the same program. Compiled quickly (`QUICK_COMPILE`: fills, an iota and the keys' integer hash, the
# same values at any optimisation level), as it is compiled before a new process's first step: 0.5 s of it before.
_empty_state = cached_jit(init_state, static_argnames=("config", "num_pages", "page_size", "batch", "max_pages",
                                                       "start_pos", "kv_dtype"), compiler_options=QUICK_COMPILE)


def _programs(function: Any) -> int:
    """The programs a `cached_jit` function holds in this process (grows when a call compiles or loads one)."""
    return function.programs()


def _seed_array(seed: int) -> np.ndarray:
    """`seed` as the int32 array `_empty_state` takes (its low 32 bits, as `jax.random.key` keeps them)."""
    return np.asarray(np.int64(seed)).astype(np.int32)


@cached_jit(static_argnames=(*_STATIC, "tap", "tap_answer", "keep_written"), donate_argnames=("state",))
def _step(graphdef, params, state, chunk, *, config, tap=None, tap_answer=False, keep_written=False):
    return chunk_step(nnx.merge(graphdef, params), state, chunk, config, tap=tap, shared_pages=False,
                      tap_answer=tap_answer, keep_written=keep_written)


# A session's first steps without the trim (`omnijax.streaming.quick_start`), its own function so that its compile
# never waits behind the full step's, which another thread compiles meanwhile; compiled quickly (`QUICK_COMPILE`:
# LLVM optimisation off, one-row products padded to the library matmul).
@cached_jit(static_argnames=(*_STATIC, "tap", "tap_answer"), donate_argnames=("state",), compiler_options=QUICK_COMPILE)
def _untrimmed_step(graphdef, params, state, chunk, *, config, tap=None, tap_answer=False):
    with padded_one_row_products():
        return chunk_step(nnx.merge(graphdef, params), state, chunk, config, tap=tap, shared_pages=False,
                          tap_answer=tap_answer, trim=False)


def stream(model: StreamModel, chunks: Chunk, config: StreamConfig | None = None, *,
           state: StreamState | None = None, **fields: Any) -> StreamResult:
    """Streams a stack of chunks (`[C, ...]` on every field) through the model as one compiled program.

    Args:
        model: an `omnijax.Model`, a `MiniCPMOModel` or a `Decoder`.
        chunks: stacked chunks (see `omnijax.chunks.chunk.stack_chunks`).
        config: the session's settings (`omnijax.StreamConfig`; default `StreamConfig()`). Its fields are also
            accepted as keywords (`policy=`, `paging=`, `impl=`, `page_size=`, `num_pages=`, `subblock=`,
            `max_answer_tokens=`, `decoding=`), applied on top of `config`.
        state: state to continue from (left intact: the program starts from a copy of it); default an empty cache
            of `config.num_pages` pages (None: enough for the whole session without eviction).

    Warns:
        RuntimeWarning: when the pool ran out in some sequence (its tokens past that point were not cached).
    """
    config = bind_config(model, config, **fields)
    graphdef, params = model_parts(model)
    decoder_config = graphdef_config(model)
    chunks_lib.validate(chunks, decoder_config, max_answer_tokens=config.max_answer_tokens, stacked=True,
                        decoding=config.decoding)
    chunks = jax.tree.map(jnp.asarray, chunks)
    run = _scan if state is not None else _scan_owned
    if state is None:
        num_pages = config.num_pages
        if num_pages is None:
            num_pages = max(1, pages_needed(chunks, config.max_answer_tokens, config.page_size)) + (
                chunks.token_ids.shape[1] * config.paging.extra_pages)
        state = init_state(decoder_config, num_pages=num_pages, page_size=config.page_size,
                           batch=chunks.token_ids.shape[1], seed=seed_of(config.decoding), kv_dtype=config.kv_dtype)
    else:
        check_state(state, decoder_config)
    if state.kv.batch != chunks.token_ids.shape[1]:
        raise ValueError(f"chunks have batch {chunks.token_ids.shape[1]}, the given state has {state.kv.batch}")
    final, out = run(graphdef, params, state, chunks, config=config)
    exhausted = np.asarray(final.kv.exhausted)  # waits for the program: a stream call returns a finished session
    if exhausted.any():
        warn_pool_ran_out(exhausted, np.asarray(final.kv.dropped), num_pages=final.kv.num_pages,
                          page_size=final.kv.page_size, session=False, stacklevel=2)
    return StreamResult(logits=out.logits, tokens=out.tokens, stats=out.stats, state=final)


def warn_pool_ran_out(exhausted: np.ndarray, dropped: np.ndarray, *, num_pages: int, page_size: int, session: bool,
                      stacklevel: int) -> None:
    """Warns that a pool dropped tokens, naming the sequences, the counts, the pool's size and the fix.

    The one message of `stream` and `Session` (which warns at its first drop only).

    Args:
        exhausted: per sequence, whether its pool ran out.
        dropped: per sequence, how many tokens were not cached.
        num_pages: pages in the pool.
        page_size: tokens per page.
        session: the warning comes from a `Session` (only its first drop is warned about).
        stacklevel: `warnings.warn`'s stacklevel as seen from the caller (1: the caller's own line).
    """
    rows = np.flatnonzero(exhausted)
    later = (" and later ones will not be either (only this first drop is warned about; see "
             "out.stats.layout.dropped)" if session else " (see stats.layout.exhausted and state.kv.dropped)")
    where = "StreamConfig(num_pages=...) or Session(model, num_pages=...)" if session else "StreamConfig(num_pages=...)"
    warnings.warn(f"the KV pool ran out in sequence(s) {rows.tolist()}: {dropped[rows].tolist()} token(s) were not "
                  f"cached{later}. The pool holds {num_pages} pages of {page_size} tokens: give a larger num_pages "
                  f"({where}) or a bounded retention policy", RuntimeWarning, stacklevel=stacklevel + 1)


class Session:
    """Step-wise streaming for real-time use: the same jitted step as `stream`, one chunk per call.

    Every `feed` donates `session.state` to the step, which updates the cache in place and replaces `session.state`;
    arrays of an earlier state are deleted then. To keep a state for later, copy it
    (`jax.tree.map(jnp.copy, session.state)`); a `state` given to the constructor is copied.

    The pool does not grow: a session that outlives it (a default `Session(model)` holds
    `DEFAULT_SESSION_PAGES` x `page_size` tokens under the default policy) drops the tokens that find no page. The
    first drop is warned about once per session (`RuntimeWarning` naming `num_pages` and `StreamConfig`), as
    `stream` and `evaluate` warn, without waiting for a step: a step's exhaustion flag is read by a later `feed`
    (or `check_pool`) once that step has finished. Growing the pool instead would change the step's shapes (a
    recompilation in the middle of a session) and let memory grow without a bound the caller chose.

    With `StreamConfig(recall=Recall(...))` (batch 1), what retention evicts is kept in a host tier and a chunk
    asking for an answer first brings the units most relevant to it back into the cache (`recall`, `recall_stats`;
    `omnijax.streaming.recall_session`). Each `feed` then copies the cache before its step and, when the step
    evicted something, waits for it to store what it evicted.

    Args:
        model: an `omnijax.Model`, a `MiniCPMOModel` or a `Decoder`.
        config: the session's settings (`omnijax.StreamConfig`); its fields are also accepted as keywords. The
            pool has `config.num_pages` pages (None: `omnijax.streaming.config.DEFAULT_SESSION_PAGES`).
        batch: sequences of the session's state.
        state: state to continue from (copied). With recall on, a state that holds tokens comes with its host
            tier: resume it with `Session.resume` (a `SessionSnapshot`), not `state=` alone.
        tier: the `RecallSnapshot` taken with `state` (`Session.resume` passes it).
        quick_start: run the first steps without the retention policy's trim while the full step compiles in
            another thread, as long as the cells fed fit what the policy holds untrimmed and the full step is not
            already compiled or kept, in a program compiled quickly (`omnijax.streaming.quick_start`: the same
            tokens, logits to float32 rounding; a new process's first token from an empty compilation cache ~2x
            sooner on SmolLM2). `Chat(quick_start=True)` passes it on. Refused with `state` or recall.
            The session's `quick_start` is then its `QuickStart` (`untrimmed_steps`; `wait()` joins the
            compiles), None without.

    Example:
        session = Session(model, StreamConfig(num_pages=64, max_answer_tokens=16))
        out = session.feed(text_chunk(ids, answer_tokens=8))
    """

    def __init__(self, model: StreamModel, config: StreamConfig | None = None, *, batch: int = 1,
                 state: StreamState | None = None, tier: RecallSnapshot | None = None, quick_start: bool = False,
                 **fields: Any):
        self.stream_config = bind_config(model, config, allow_recall=True, **fields)
        if quick_start and (state is not None or self.stream_config.recall is not None):
            raise ValueError("quick_start runs a new session's first steps untrimmed; it does not combine with "
                             f"{'state=' if state is not None else 'recall'} (leave quick_start False)")
        self._graphdef, self._params = model_parts(model)
        self.config = graphdef_config(model)
        if state is not None:
            check_state(state, self.config)
        num_pages = self.stream_config.num_pages or DEFAULT_SESSION_PAGES
        # The step runs without the recall setting (the same compiled program); recall is host-side around it.
        self._step_config = self.stream_config.replace(recall=None)
        self._recall = None if self.stream_config.recall is None else new_recall_session(
            self.stream_config, self.config, num_pages=num_pages, batch=batch)
        # Commit inputs to the device once: a step's outputs are committed, and feeding uncommitted arrays to the
        # first call would otherwise compile the step a second time on the second call.
        device = jax.devices()[0]
        self._params = jax.device_put(self._params, device)
        self._empty: dict[str, Any] | None = dict(
            num_pages=num_pages, page_size=self.stream_config.page_size, batch=batch,
            seed=_seed_array(seed_of(self.stream_config.decoding)), kv_dtype=self.stream_config.kv_dtype)
        self._state: StreamState | None = None
        if state is not None or self._recall is not None or quick_start:
            self.state = jax.device_put(jax.tree.map(jnp.copy, state), device) if state is not None \
                else self._new_state()
        else:  # the pool is allocated by the first `feed` once its step has compiled (`_compile_before_pool`), or by
            # the first read of `session.state`; its shapes are traced now (no program, no memory), so a pool
            # `init_state` refuses is refused here
            self._shapes = _empty_state.jitted.eval_shape(self.config, **self._empty)
        if self._recall is not None:
            self._recall.start(self.state)
            if tier is not None:
                self._recall.restore(tier, self.state)
            elif int(np.asarray(self.state.kv.next_order).max()) > 0:
                raise ValueError("the session's host tier is missing: a state that holds tokens resumes with recall "
                                 "on only together with its tier (Session.resume(model, session.snapshot()))")
        elif tier is not None:
            raise ValueError("tier= was given but recall is off: give StreamConfig(recall=Recall(...))")
        self._hold = False
        # the first steps without the trim while the full one compiles (a session that starts empty, no recall)
        self.quick_start = QuickStart(_step, untrimmed_capacity(self._step_config.policy),
                                      self._step_config.max_answer_tokens) if quick_start else None
        # the exhaustion flags (sticky) of steps not yet read, oldest first; None once a drop has been warned about
        self._unread: collections.deque | None = collections.deque()

    @property
    def state(self) -> StreamState:
        """The session's `StreamState` (its KV pool allocated on first use: see `feed`)."""
        if self._state is None:
            self._state = self._new_state()
        return self._state

    @state.setter
    def state(self, value: StreamState) -> None:
        self._state = value

    def _new_state(self) -> StreamState:
        """The empty state: its program's compile memory is given back before the pool is used."""
        assert self._empty is not None
        programs = _programs(_empty_state)
        state = _empty_state(self.config, **self._empty)
        if _programs(_empty_state) != programs:
            trim_heap()
        self._empty = None
        return jax.device_put(state, jax.devices()[0])

    def _compile_before_pool(self, step: Any, args: tuple, kwargs: dict) -> None:
        """A new session's first `feed`: compiles its step against the shapes of the state, gives the compiler's
        freed memory back to the system (`omnijax.heap.trim_heap`), then allocates the pool. The process's peak is
        the larger of the compile's and the pool's, not their sum (SmolLM2-135M: a 107 MB pool beside a compile
        that peaks ~140 MB above the weights). A step already compiled in this process is not traced again."""
        if _programs(step) == 0:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device,
                                                                   weak_type=a.weak_type), self._shapes)
            args = (*args[:2], abstract, *args[3:])
            if not step.precompile(*args, **kwargs):  # (no kept executables: jax's own cache holds it)
                step.jitted.lower(*args, **kwargs).compile()
            trim_heap()
        self._state = self._new_state()

    def __getattr__(self, name):
        # The settings read as attributes (`session.policy`, `session.max_answer_tokens`, ...).
        if name != "stream_config" and name in StreamConfig.__dataclass_fields__:
            return getattr(self.stream_config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def feed(self, chunk: Chunk, *, decoding: DecodingStrategy | None = None, tap: int | None = None,
             tap_answer: bool = False) -> ChunkOutput:
        """Runs one chunk (`[B, T]` fields, no leading chunk axis) and advances the session state.

        `decoding` decodes this chunk's answer with another strategy than the config's (one more compiled step per
        strategy). `tap` (an int: one more compiled step) also returns the chunk's `hidden_states[tap]` as
        `out.tapped` (`omnijax.streaming.step.chunk_step`); `tap_answer` (one more compiled step) the answer
        tokens' final-normed rows as `out.answer_rows`. Returns without waiting for the step. Pool exhaustion is
        reported in the output's `stats.layout.exhausted` and `stats.layout.dropped`, and warned about once per
        session by the first `feed` (or `check_pool`) that finds a finished step which dropped tokens.

        Warns:
            RuntimeWarning: the first time a finished step is found to have dropped tokens (see the class).
        """
        config = self._step_config if decoding is None else self._step_config.replace(decoding=decoding)
        chunk, quick = self._checked(chunk, config), self.quick_start
        self._read_flags(wait=False)
        recall = self._recall
        if recall is not None and recall.pending and self._hold and np.asarray(chunk.valid).any():
            self.state = recall.release(self.state)  # a held recall ends where new content comes
        if recall is not None and not recall.pending and recall.tier.units and np.asarray(chunk.answer_tokens).any() \
                and np.asarray(chunk.valid).any():
            self.state, _ = recall.recall(self.state, self._graphdef, self._params, chunk)
        if recall is not None:
            config = recall.step_config(config)
        before = None if recall is None else jax.tree.map(jnp.copy, self.state.kv)
        cursor = None if recall is None else jax.device_get((self.state.next_pos[0], self.state.kv.next_order[0]))
        more = {"tap_answer": True} if tap_answer else {}  # (the kept program's key unchanged without it)
        if recall is not None:  # what the step writes and evicts, as cached before its trim and relayout
            more["keep_written"] = True
        step = _step
        if self._state is None:
            self._compile_before_pool(step, (self._graphdef, self._params, None, chunk),
                                      dict(config=config, tap=tap, **more))
        programs = _programs(step)
        if quick is not None and quick.untrimmed_step(
                chunk, (self._graphdef, self._params, self.state, chunk), dict(config=config, tap=tap, **more)):
            step = _untrimmed_step
        self.state, out = step(self._graphdef, self._params, self.state, chunk, config=config, tap=tap, **more)
        if step is _untrimmed_step:
            quick.compile_after(out)  # the full step, once this step's outputs are computed
        elif _programs(step) != programs:
            trim_heap()  # this call compiled a step: the compiler's freed memory goes back to the system
        if recall is not None:
            recall.track(chunk, int(cursor[0]), int(cursor[1]), self.state)
            if np.asarray(out.stats.evicted).any():
                recall.capture(before, self.state.kv, written=out.written)
            if not self._hold:
                self.state = recall.release(self.state)
        if self._unread is not None:
            self._unread.append((out.stats.layout.exhausted, out.stats.layout.dropped))
        return out

    def _checked(self, chunk: Chunk, config: StreamConfig) -> Chunk:
        chunks_lib.validate(chunk, self.config, max_answer_tokens=self.stream_config.max_answer_tokens,
                            stacked=False, decoding=config.decoding)
        batch = self._empty["batch"] if self._state is None and self._empty is not None else self.state.kv.batch
        if chunk.token_ids.shape[0] != batch:
            raise ValueError(f"chunk batch {chunk.token_ids.shape[0]} != session batch {batch}")
        # on the device as it is (`jnp.asarray` of a numpy array compiles a program per shape and dtype)
        return jax.device_put(chunk)

    def recall(self, chunk: Chunk, *, scores: np.ndarray | None = None) -> RecallReport:
        """Brings stored units back for the question `chunk` before it is fed (`StreamConfig(recall=...)`;
        `omnijax.streaming.recall_session`). `feed` does this by itself for a chunk asking for an answer; call it
        to recall ahead, or with `scores` (`[U]`, one per stored unit, highest first) to force the ranking. The
        recalled units are released after the next `feed`.
        """
        if self._recall is None:
            raise ValueError("recall is off for this session: give StreamConfig(recall=Recall(...))")
        chunk = self._checked(chunk, self._step_config)
        self.state, report = self._recall.recall(self.state, self._graphdef, self._params, chunk, scores)
        return report

    def hold_recall(self) -> None:
        """Keeps the units the next question recalls cached until `release_recall` (or a later chunk with tokens):
        the answer's continuation chunks (no tokens, more answer tokens) read them too. `Chat` holds them over each
        answer. Nothing happens with recall off."""
        self._hold = self._recall is not None

    def release_recall(self) -> None:
        """Ends a held recall: the recalled tokens still cached are released (`Recall.keep=False`). Nothing happens
        with recall off or no recall in progress."""
        self._hold = False
        if self._recall is not None:
            self.state = self._recall.release(self.state)

    def snapshot(self) -> SessionSnapshot:
        """A host copy of the session to resume later (`Session.resume`): the state and, with recall on, the host
        tier and its bookkeeping (refused while a recall is in progress)."""
        tier = None if self._recall is None else self._recall.snapshot(self.state)
        return SessionSnapshot(state=jax.tree.map(lambda x: np.array(x, copy=True), self.state), tier=tier)

    @classmethod
    def resume(cls, model: StreamModel, snapshot: SessionSnapshot, config: StreamConfig | None = None,
               **fields: Any) -> Session:
        """A session going on from `snapshot` under `config` (the snapshot's own settings: same pool and policy;
        with recall on, the snapshot must carry its host tier, refused by name when missing or corrupt)."""
        if not isinstance(snapshot, SessionSnapshot):
            raise ValueError(f"Session.resume takes a Session.snapshot(), got {type(snapshot).__name__}")
        return cls(model, config, state=snapshot.state, tier=snapshot.tier, **fields)

    def recall_stats(self) -> RecallStats:
        """Stored / dropped / recalled units and bytes so far (`StreamConfig(recall=...)` only)."""
        if self._recall is None:
            raise ValueError("recall is off for this session: give StreamConfig(recall=Recall(...))")
        return self._recall.stats()

    def check_pool(self) -> bool:
        """Waits for the steps fed so far and warns (once per session) if the pool has dropped tokens.

        Returns:
            Whether any token of the session was dropped so far.
        """
        self._read_flags(wait=True)
        return bool(np.asarray(self.state.kv.exhausted).any())

    _MAX_UNREAD = 8  # steps in flight whose flags are not read yet; beyond it `feed` waits for the oldest

    def _read_flags(self, *, wait: bool) -> None:
        """Reads the exhaustion flags of finished steps (all of them with `wait`), warning at the first drop."""
        unread = self._unread
        if unread is None:
            return
        latest = None
        while unread and (wait or len(unread) > self._MAX_UNREAD or unread[0][0].is_ready()):
            latest = unread.popleft()  # the flags are sticky: the latest finished step speaks for the earlier ones
        if latest is None:
            return
        exhausted = np.asarray(latest[0])
        if exhausted.any():
            self._unread = None
            warn_pool_ran_out(exhausted, np.asarray(latest[1]), num_pages=self.state.kv.num_pages,
                              page_size=self.state.kv.page_size, session=True, stacklevel=3)
