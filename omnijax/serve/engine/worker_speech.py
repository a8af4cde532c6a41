"""Spoken answers through the engine worker: `EngineWorker.speak` admits an utterance to the engine's speech pool
(`omnijax.serve.engine.speech`) and returns a `SpeechStream`, which yields the utterance's vocoder chunks as the
engine's ticks decode them (the talker steps of every speaking session batched in each tick).

Admission counts speech: an utterance is checked against the AIMD cap with the active sessions (each utterance in
the pool counts as one, `EngineWorker.active_sessions`), then by the pool (rows, reserved talker pages:
`Overloaded` naming them), all in the engine's thread between ticks. The worker ticks while any utterance is in the
pool, with or without thinker work, so the talker keeps its cadence; each tick's latency, what the AIMD controller
reads, includes the talker step and the vocoder chunks. A chunk past its playback deadline arrives flagged
(`SpeechChunk.late_s`) and is counted in `stats["late_chunks"]` and its stream's `late_chunks` / `max_late_s`; an
utterance that ends (or is cancelled) with late chunks is reported in the server log (a warning on the
`omnijax.serve` logger naming the utterance, how many chunks were late and by how much); a chunk is never dropped.
A failed tick or a
shutdown ends every stream with an error naming why; `cancel_speech` ends one (its pages return).

An answer can be spoken while the thinker still writes it: `speak(..., writing=True)` with its first tokens, then
`extend_speech` with the next ones as they are decoded and `end=True` once it is whole (the pool's talker steps as far
as the tokens allow: `SpeechPool.extend`). While every utterance waits for its answer's next tokens (no talker step
possible, no vocoder chunk due: `SpeechPool.has_work` False) and the thinker has no work, the loop waits instead of
ticking (`_speech_due`); `speak` and `extend_speech` wake it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any

from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.speech import SpeechChunk

__all__ = ["SpeakingWorker", "SpeechStream"]

log = logging.getLogger("omnijax.serve")


class SpeechStream:
    """One utterance's chunks (`SpeechChunk`: float32 PCM, codes, lateness) in order: `async for chunk in stream`.

    Iteration ends after the chunk marked `final`, or when the utterance is cancelled; it raises RuntimeError
    (naming why) when the utterance failed (a failed tick, the server shutting down).

    Attributes:
        speech_id: the utterance.
        chunks: chunks delivered so far.
        late_chunks: chunks so far that were sent past their playback deadline.
        max_late_s: the most seconds any of them was late (0.0 while none was).
        error: why the utterance failed, else None.
    """

    def __init__(self, speech_id: str):
        self.speech_id = speech_id
        self.chunks = 0
        self.late_chunks = 0
        self.max_late_s = 0.0
        self.error: str | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ended = False

    def _push(self, chunk: SpeechChunk) -> None:
        self.chunks += 1
        if chunk.late_s > 0:
            self.late_chunks += 1
            self.max_late_s = max(self.max_late_s, float(chunk.late_s))
        self._queue.put_nowait(chunk)
        if chunk.final:
            self._end(None)

    def _end(self, error: str | None) -> None:
        if not self._ended:
            self._ended, self.error = True, error
            self._queue.put_nowait(None)

    def ready(self) -> list[SpeechChunk]:
        """The chunks that arrived and were not read yet, without waiting (an ended or failed stream: what is left
        before its end; the end itself is left for `async for`)."""
        out = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is None:
                self._queue.put_nowait(None)
                break
            out.append(item)
        return out

    def __aiter__(self) -> "SpeechStream":
        return self

    async def __anext__(self) -> SpeechChunk:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # later reads end too
            if self.error is not None:
                raise RuntimeError(self.error)
            raise StopAsyncIteration
        return item


class SpeakingWorker:
    """The speech half of `omnijax.serve.engine.worker.EngineWorker` (a mixin: it reads the worker's `engine`,
    `admission`, `stats`, `stopping`, `in_engine` and `_work`)."""

    engine: Any
    admission: Any
    stats: dict
    _work: asyncio.Event | None

    def _init_speech(self) -> None:
        self.speaking: dict[str, SpeechStream] = {}
        self._closing: set[asyncio.Future] = set()  # utterances opened for a cancelled `speak`, leaving the pool
        self.stats.update(speech_opened=0, speech_refused=0, speech_chunks=0, late_chunks=0)

    async def speak(self, speech_id: str, prompt_ids: Any, answer_ids: Any, *, voice: str, max_new_tokens: int,
                    media: Sequence[MediaRows] = (), writing: bool = False,
                    sampling: TalkerSampling | None = None, prepared: Any = None) -> SpeechStream:
        """Admits an utterance (the thinker's prompt and answer ids, spoken with `voice`) and returns its stream.
        `writing`: the answer is still being written (`answer_ids` its first tokens; `extend_speech` adds the rest);
        `sampling`: drawn speech (None: greedy); both as `SpeechPool.open` takes them. `prepared`: a Qwen2.5-Omni
        pool's talker input built off the engine's thread (`Qwen25SpeechPool.prepare`).

        Raises (nothing admitted): `Overloaded` (shutting down, the AIMD cap, the pool's rows or talker pages),
        ValueError (no speech pool, or a refusal of `Engine.speak`: voice, ids, `max_new_tokens`), KeyError (an id
        already speaking).
        """
        current = self.active_sessions()  # type: ignore[attr-defined]
        try:
            if self.stopping:  # type: ignore[attr-defined]
                raise Overloaded("the server is shutting down", cap=0, current=current)
            if self.engine.speech is None:
                raise ValueError("this server's engine has no speech pool (EngineConfig.speech)")
            if speech_id in self.speaking:
                raise KeyError(f"speech {speech_id!r} is already speaking")
            if self.admission is not None:
                self.admission.check(current)
            stream = SpeechStream(speech_id)
            more = {} if prepared is None else {"prepared": prepared}
            opening = asyncio.ensure_future(self.in_engine(functools.partial(  # type: ignore[attr-defined]
                self.engine.speech.open, speech_id, prompt_ids, answer_ids, voice=voice,
                max_new_tokens=max_new_tokens, media=media, writing=writing, sampling=sampling, **more)))
            try:
                await asyncio.shield(opening)
            except asyncio.CancelledError:
                # cancelled (a client gone, `response.cancel`) while the engine's thread opens it: the open runs on,
                # and nobody would hold its stream, so the utterance leaves the pool once opened (one spoken while
                # written would otherwise wait for its answer's tokens for ever, holding its row and pages)
                opening.add_done_callback(functools.partial(self._drop_opened, speech_id))
                raise
        except Overloaded:
            self.stats["speech_refused"] += 1
            raise
        self.speaking[speech_id] = stream
        self.stats["speech_opened"] += 1
        if self._work is not None:
            self._work.set()
        return stream

    async def extend_speech(self, speech_id: str, answer_ids: Any, *, end: bool = False, rows: Any = None) -> bool:
        """Adds the next tokens of an answer spoken while written (`speak(writing=True)`); `end`: it is whole;
        `rows`: their thinker rows `[n, D]` (a Qwen2.5-Omni pool: `Qwen25SpeechPool.extend`; None for Qwen3-Omni's).
        Returns False when the utterance is no longer speaking (its talker ended, it was cancelled or failed): the
        tokens are not needed. Raises ValueError for what `SpeechPool.extend` refuses (ids, an answer whole already).
        """
        if speech_id not in self.speaking:
            return False
        spoken = await self.in_engine(self._extend, speech_id, answer_ids, end, rows)  # type: ignore[attr-defined]
        if self._work is not None:
            self._work.set()
        return spoken

    def _extend(self, speech_id: str, answer_ids: Any, end: bool, rows: Any = None) -> bool:
        try:
            self.engine.speech.extend(speech_id, answer_ids, end=end, **({} if rows is None else {"rows": rows}))
        except KeyError:  # it ended in the tick that ran meanwhile
            return False
        return True

    def _drop_opened(self, speech_id: str, opening: asyncio.Future) -> None:
        """(Event loop) An utterance opened for a `speak` cancelled meanwhile leaves the pool (its pages return)."""
        if not opening.cancelled() and opening.exception() is None:  # opened (a refusal opened nothing)
            closing = asyncio.ensure_future(self.in_engine(self._close_speech, speech_id))  # type: ignore[attr-defined]
            self._closing.add(closing)  # held until done
            closing.add_done_callback(self._closing.discard)

    def _speech_due(self) -> bool:
        """Whether the speech pool gives a tick work (read on the event loop between ticks: a stale False is woken
        by the `speak` / `extend_speech` that changed it)."""
        pool = self.engine.speech
        return bool(self.speaking) and pool is not None and pool.has_work

    async def cancel_speech(self, speech_id: str) -> bool:
        """Ends an utterance now (its stream stops after the chunks already delivered; its talker pages return);
        True when it was speaking."""
        stream = self.speaking.pop(speech_id, None)
        if stream is None:
            return False
        stream._end(None)
        _report_late(stream, "cancelled")
        await self.in_engine(self._close_speech, speech_id)  # type: ignore[attr-defined]
        return True

    def _close_speech(self, speech_id: str) -> None:
        try:
            self.engine.close_speech(speech_id)
        except KeyError:  # it ended in the tick that ran meanwhile
            pass

    def _deliver_speech(self, report: Any) -> None:
        """Hands a tick's vocoder chunks to their streams (on the event loop)."""
        for chunk in [] if report is None else report.speech:
            self.stats["speech_chunks"] += 1
            self.stats["late_chunks"] += chunk.late_s > 0
            stream = self.speaking.get(chunk.speech_id)
            if stream is None:  # cancelled meanwhile
                continue
            stream._push(chunk)
            if chunk.final:
                del self.speaking[chunk.speech_id]
                _report_late(stream, "ended")

    async def _fail_speech(self, reason: str) -> None:
        """Ends every stream with `reason` and drops their utterances from the pool."""
        failed, self.speaking = self.speaking, {}
        for speech_id, stream in failed.items():
            stream._end(reason)
            await self.in_engine(self._close_speech, speech_id)  # type: ignore[attr-defined]


def _report_late(stream: SpeechStream, how: str) -> None:
    """Logs a warning for an utterance that `how` ("ended", "cancelled") after sending chunks past their playback
    deadline: the listener heard gaps, so the operator is told (the chunks themselves were all sent)."""
    if stream.late_chunks:
        log.warning("speech %s %s with %d of its %d chunks sent past their playback deadline (the latest %.3f s late)",
                    stream.speech_id, how, stream.late_chunks, stream.chunks, stream.max_late_s)
