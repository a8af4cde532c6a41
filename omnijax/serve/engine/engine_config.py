"""The engine's settings and what its ticks return: `EngineConfig`, `FrameOutput`, `TickReport` (re-exported by
`omnijax.serve.engine.engine`, where they were defined)."""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.retention.baselines import SinkWindow
from omnijax.serve.engine.speech import SpeechChunk, SpeechConfig
from omnijax.serve.engine.telemetry import StallEvent
from omnijax.streaming.config import StreamConfig

__all__ = ["DuplicateSession", "EngineConfig", "FrameOutput", "TickReport"]


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
        per_token: run ticks host-driven (`omnijax.serve.engine.decode_loop.host_tick`): the answer is decoded one
            jitted token step at a time from the engine thread, each token handed to `tick(on_token=...)` as soon
            as it is decoded (per-token streaming). The tokens are those of the fused tick (one program decoding
            up to tau tokens); a tick costs one dispatch and one copy back per token more. Default False (fused);
            `tick(per_token=...)` decides per tick, and a tick with a constrained row is always host-driven.
        speech: the speech pool's settings (`omnijax.serve.engine.speech.SpeechConfig`): the talkers and vocoders
            of speaking sessions run on every tick (`Engine.speak`); None (default): the engine does not speak.
    """

    stream: StreamConfig = dataclasses.field(default_factory=_default_stream)
    max_pages: int | None = None
    chunk_tokens: int = 64
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    frame_budget_s: float = 1.0
    return_logits: bool = True
    fit_fraction: float = 0.25
    per_token: bool = False
    speech: SpeechConfig | None = None

    def __post_init__(self):
        if not isinstance(self.per_token, bool):
            raise ValueError(f"per_token must be True or False, got {self.per_token!r}")
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
        if self.speech is not None and not isinstance(self.speech, SpeechConfig):
            raise TypeError(f"EngineConfig.speech must be an omnijax.serve.engine.speech.SpeechConfig or None, got "
                            f"{self.speech!r}")

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
        complete: the row's token constraint reported `finished()` after its last token (host-driven ticks).
        error: why the frame failed: the row's token constraint (its `bitmask()` or `accept` raised, or a bad mask;
            the tokens before are kept), or the scoring of a question's recall raised (`written` is False).
        written: the frame's chunk was written to the session's cache (False: a question whose recall failed, the
            session left as it was before it; a preempted frame says so by `preempted`).
        answer_rows: `[len(tokens), D]` float32, each token's final-normed last-layer row, when the engine taps them
            (`Engine.taps_answer`: a Qwen2.5-Omni speech pool with `SpeechConfig(early_start=True)`); else None.
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
    complete: bool = False
    error: str | None = None
    written: bool = True
    answer_rows: np.ndarray | None = None


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
        per_token: the tick ran host-driven (its tokens went to `on_token` as they were decoded).
        speech: the speech pool's vocoder chunks this tick sent (`SpeechChunk`, in the order decoded).
        recalling: sessions whose question waits for its recall's scores after this tick (no output yet: it is
            served in a later tick, and nothing else of the session before it; `StreamConfig(recall=...)`).
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
    per_token: bool = False
    speech: list[SpeechChunk] = dataclasses.field(default_factory=list)
    recalling: tuple[str, ...] = ()
