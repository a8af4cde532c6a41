"""`Answer`: a response being decoded by the `omnijax.serve.engine.worker.EngineWorker`, read as token deltas.

The worker pushes its tokens from the event loop: per tick, or per token when the engine runs per token (the engine
thread schedules each push with `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio

import numpy as np

from omnijax.serve.engine.constraint import TokenConstraint


class Answer:
    """A response being decoded; iterate it (`async for delta in answer`) for token-id deltas.

    Attributes:
        tokens: every token decoded so far.
        status: None while decoding, then "completed" (a stop token), "incomplete" (`max_tokens` reached, or the
            session was preempted), "cancelled" or "failed".
        reason: why it is not completed ("max_output_tokens", "cancelled", "preempted", or an error message).
        answer_unit: the unit id of the answer.
        kv_cells: the session's cached cells when it ended.
        recall: with `StreamConfig(recall=...)`, the session's recall figures when it ended
            (`omnijax.streaming.recall_session.RecallStats`: units and bytes stored, dropped and recalled); else None.
        logprobs: when its sampling row asks for them, one `(logprob, [(token id, logprob), ...])` per token of
            `tokens` (`omnijax.serve.engine.engine.FrameOutput.logprobs`); else an empty list.
        constraint: the `TokenConstraint` its tokens are drawn under, or None.
        rows: when the engine taps the answer's rows (`Engine.taps_answer`: a Qwen2.5-Omni speech pool that speaks
            answers while they are written), each token's final-normed last-layer row `[D]` float32, one per token
            of `tokens` (they arrive with the tick's result, after the tokens of a per-token tick); else empty.
    """

    def __init__(self, max_tokens: int, stop: frozenset, answer_unit: int, sampling: np.ndarray | None = None,
                 constraint: TokenConstraint | None = None):
        self.max_tokens, self.stop, self.answer_unit = int(max_tokens), stop, answer_unit
        self.sampling = sampling  # the row of a per-row strategy (`omnijax.decoding.sampling_row`), or None
        self.constraint = constraint
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.rows: list[np.ndarray] = []
        self.status: str | None = None
        self.reason: str | None = None
        self.kv_cells = 0
        self.recall = None
        self.cancelled = False
        self._ending: tuple | None = None  # (status, reason) once the worker decided, before kv_cells are read
        self._deltas: asyncio.Queue = asyncio.Queue()
        self.done = asyncio.get_running_loop().create_future()

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def _push(self, tokens: list[int], logprobs: list | None = None) -> None:
        self.tokens += tokens
        self.logprobs += (logprobs or [])[:len(tokens)]
        if tokens:
            self._deltas.put_nowait(tokens)

    def _push_rows(self, rows: np.ndarray) -> None:
        self.rows.extend(np.asarray(rows, np.float32))

    def _finish(self, status: str, reason: str | None = None) -> None:
        if self.status is None:
            self.status, self.reason = status, reason
            self._deltas.put_nowait(None)
            self.done.set_result(status)

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[int]:
        delta = await self._deltas.get()
        if delta is None:
            self._deltas.put_nowait(None)  # later iterations end too
            raise StopAsyncIteration
        return delta
