"""MiniCPM-o 4.5 full duplex on the serving path: `DuplexStream`, the duplex loop served by an `EngineWorker`.

The loop itself (what to feed, the decisions) is `omnijax.models.minicpmo.duplex_loop.DuplexLoop`, the sans-IO core
that `omnijax.streaming.duplex.DuplexSession` drives over its own `omnijax.Session`. A `DuplexStream` drives the same
loop on one session of an `omnijax.serve.engine.worker.EngineWorker`: the media are encoded in a helper thread, every
feed goes through `worker.frame(sid, chunk)` (one tick per chunk of the engine's `chunk_tokens` rows) and the decision
logits come back in the tick's `FrameOutput.logits`, so many duplex streams share the engine's batched ticks (the
engine needs `return_logits=True`).

Penalties (`AnswerPenalties`, a Realtime session's `presence_penalty` / `frequency_penalty`): OpenAI's, over the
answer so far, which in duplex spans units: every token decided since the last unit that ended by listening (a
response of the Realtime API runs from its first spoken unit to that listening unit). They are subtracted from each
decision's logits before the release's rule (`DuplexDecodeRule`, whose own repetition penalty looks at its window of
the whole session's decisions), and kept from one unit to the next, not reset by the unit's new input.

Positions are session indices: every chunk's offsets are 0..n-1 and its `advance` is n, so the engine's per-row
cursor of a freshly opened session walks the same positions as `DuplexSession`. Once a feed has failed (pool
exhausted, session closed, a failed tick, cancellation), the stream's context is incomplete and every later call
raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens, UnitResult
from omnijax.models.minicpmo.duplex_loop import (
    UNIT_SAMPLES,
    DuplexDriver,
    DuplexFeed,
    DuplexLoop,
    rows_chunks,
    speak_ids,
    unit_pcm,
)

if TYPE_CHECKING:
    from PIL import Image

    from omnijax.models.minicpmo.model import MiniCPMOModel
    from omnijax.models.tokenizer import StreamDecoder, Tokenizer
    from omnijax.serve.engine.worker import EngineWorker

__all__ = ["AnswerPenalties", "DuplexStream", "PenalisedLoop", "UNIT_SAMPLES", "UnitResult", "rows_chunks",
           "speak_ids", "speak_text", "unit_pcm"]


@dataclasses.dataclass(frozen=True)
class AnswerPenalties:
    """OpenAI's presence and frequency penalties of a duplex session's decisions (each in [-2, 2]; 0: none).

    A token's logit loses `frequency * count + presence * (count > 0)`, `count` its occurrences in the answer so far.
    """

    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self):
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"AnswerPenalties: {name} must be a number in [-2, 2], got {value!r}")

    @property
    def neutral(self) -> bool:
        return self.presence == 0 and self.frequency == 0

    def apply(self, logits: np.ndarray, answer: Sequence[int]) -> np.ndarray:
        """float32 `logits [V]` less the penalties of the ids in `answer` (the answer's tokens so far; a copy)."""
        z = np.array(logits, np.float32)
        counts = collections.Counter(int(t) for t in answer if 0 <= int(t) < z.shape[-1])
        if counts and not self.neutral:
            ids = np.fromiter(counts, np.int64, len(counts))
            n = np.fromiter(counts.values(), np.float32, len(counts))
            z[ids] -= np.float32(self.frequency) * n + np.float32(self.presence)
        return z


class PenalisedLoop(DuplexLoop):
    """A `DuplexLoop` whose decisions take `penalties` over the answer so far: `decoded[answer_start:]`, the tokens
    decided since the last unit that listened (`end_unit` moves the start). `penalties` may change between units."""

    def __init__(self, model: MiniCPMOModel, *, penalties: AnswerPenalties | None = None, **kwargs: Any):
        super().__init__(model, **kwargs)
        self.penalties = AnswerPenalties() if penalties is None else penalties
        self.answer_start = 0

    @property
    def answer(self) -> list[int]:
        """The answer so far (tokens decided since the last unit that listened)."""
        return self.decoded[self.answer_start:]

    def decide(self, logits: np.ndarray) -> int:
        if self.penalties.neutral:
            return super().decide(logits)
        return super().decide(self.penalties.apply(logits, self.answer))

    def end_unit(self, result: UnitResult) -> None:
        """After each unit: one that listened ends the answer (the next spoken token starts a new one)."""
        if result.listened:
            self.answer_start = len(self.decoded)


def speak_text(result: UnitResult, tokenizer: Tokenizer, markers: Sequence[int] = (), *,
               decoder: StreamDecoder | None = None) -> str:
    """The unit's spoken text: its tokens without the duplex markers and the tokenizer's special tokens.

    Args:
        result: a unit's `UnitResult`.
        tokenizer: `omnijax.models.tokenizer.Tokenizer` (anything with `decode(ids, skip_special_tokens=...)`).
        markers: ids to drop besides the tokenizer's special ones (`DuplexStream.markers`).
        decoder: a `tokenizer.stream_decoder(skip_special_tokens=True)` that carries an incomplete character from
            one unit to the next (then the text it completes is returned; `decoder.flush()` ends the stream).
    """
    ids = speak_ids(result, markers)
    if decoder is not None:
        return decoder.push(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


class DuplexStream(DuplexDriver):
    """The 4.5 full-duplex loop (`DuplexLoop`) on one session of an `EngineWorker` (module docstring).

    Args:
        model: a `MiniCPMOModel` with its audio encoder (and vision encoder for video frames); the worker's engine
            must serve its decoder.
        worker: the `EngineWorker` (its engine built with `EngineConfig(return_logits=True)`).
        sid: the worker's session id; open it first (`await worker.open(sid)`, or use `DuplexStream.open`). A
            freshly opened session, so that positions start at 0.
        rule, tokens, max_speak_tokens, force_listen, max_slice_nums: the loop's (`DuplexLoop`).
        penalties: presence / frequency penalties over the answer so far (`AnswerPenalties`; None: none). Set
            `stream.penalties` between units to change them.

    Attributes:
        loop: the `PenalisedLoop` (`decoded`, the repetition history; `units`, units answered so far; `answer`).
        position: rows fed so far (the engine cursor of the session).
        failed: why the stream stopped (None while it can go on).
    """

    loop: PenalisedLoop

    def __init__(self, model: MiniCPMOModel, worker: EngineWorker, sid: str, *, rule: DuplexDecodeRule,
                 tokens: DuplexTokens | None = None, max_speak_tokens: int = 4, force_listen: int = 1,
                 max_slice_nums: int = 1, penalties: AnswerPenalties | None = None):
        self.loop = PenalisedLoop(model, rule=rule, tokens=tokens, max_speak_tokens=max_speak_tokens,
                                  force_listen=force_listen, max_slice_nums=max_slice_nums, penalties=penalties)
        engine = worker.engine
        if not engine.config.return_logits:
            raise ValueError("duplex streams decide on the host: build the engine with EngineConfig(return_logits="
                             "True)")
        self.model, self.worker, self.sid, self.rule = model, worker, sid, rule
        self.width = engine.config.chunk_tokens
        self.hidden_size = model.config.hidden_size
        self.position = 0
        self.failed: str | None = None
        self._busy = False

    @classmethod
    async def open(cls, model: MiniCPMOModel, worker: EngineWorker, sid: str, **kwargs: Any) -> "DuplexStream":
        """Opens `sid` on the worker (may raise `Overloaded`); returns its stream (`kwargs`: the constructor's)."""
        stream = cls(model, worker, sid, **kwargs)  # refuses bad settings before a session is taken
        await worker.open(sid)
        return stream

    async def close(self) -> None:
        """Closes the worker session (its pages return to the pool); the stream cannot go on."""
        self.failed = self.failed or "closed"
        await self.worker.close(self.sid)

    async def prepare(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int],
                      ref_audio: npt.ArrayLike | None = None) -> None:
        """The system part, once, before any unit: `prefix_ids`, the reference clip's offline audio embeddings,
        `suffix_ids` (as `DuplexSession.prepare`). Token ids must lie in the vocabulary."""
        self._check_ready()
        if self.loop.prepared or self.loop.units:
            raise RuntimeError("the duplex stream is already prepared")
        self._busy = True
        try:
            self.loop.check_prepare(prefix_ids, suffix_ids)  # before anything is encoded
            reference = None
            if ref_audio is not None:
                reference = await asyncio.to_thread(self.loop.encode_reference, ref_audio)  # [n, D]
            await self._run(self.loop.prepare(prefix_ids, suffix_ids, reference))
        finally:
            self._busy = False

    async def step(self, pcm: npt.ArrayLike, frame: np.ndarray | Image.Image | None = None) -> UnitResult:
        """One unit: `<unit>` [`<image>` frame `</image>`] audio, then the listen/speak decision and its tokens.

        Args:
            pcm: `[16000]` float samples (1 s at 16 kHz, nominally in [-1, 1]).
            frame: an optional video frame (`[H, W, 3]` uint8 RGB, or what `vision.encode_image` takes).

        Returns:
            `UnitResult`: the spoken tokens, whether the unit listened, and the decision logits (the unit's, then
            one per spoken token), as `DuplexSession.step` returns them.

        Raises:
            ValueError: bad audio or frame, or a frame without a vision encoder; nothing was fed.
            RuntimeError: the stream is not prepared, busy, or stopped (`failed`), or a feed failed now.
        """
        self._check_ready()
        if not self.loop.prepared:
            raise RuntimeError("prepare the duplex stream (its system prompt) before its first unit")
        self._busy = True
        try:
            # encode checks the audio and frame first (ValueError, nothing fed) and changes nothing
            encoded = await asyncio.to_thread(self.loop.encode, pcm, frame)
            try:
                result = await self._run(self.loop.unit(encoded))
                self.loop.end_unit(result)
                return result
            except BaseException as e:  # a unit cut short leaves the cache without its end
                self.failed = self.failed or f"a unit was interrupted: {type(e).__name__}: {e}"
                raise
        finally:
            self._busy = False

    @property
    def penalties(self) -> AnswerPenalties:
        """The presence / frequency penalties of the next decisions."""
        return self.loop.penalties

    @penalties.setter
    def penalties(self, value: AnswerPenalties) -> None:
        if not isinstance(value, AnswerPenalties):
            raise TypeError(f"penalties must be AnswerPenalties, got {type(value).__name__}")
        self.loop.penalties = value

    # ------------------------------------------------------------------------------------------------- internals
    def _check_ready(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the duplex stream {self.sid!r} has stopped: {self.failed}")
        if self._busy:
            raise RuntimeError(f"the duplex stream {self.sid!r} is busy: await one prepare/step at a time")

    async def _run(self, program):
        """Runs a loop program to its end, feeding each request; returns its result."""
        try:
            request = next(program)
            while True:
                request = program.send(await self._feed(request))
        except StopIteration as done:
            return done.value

    async def _feed(self, feed: DuplexFeed) -> np.ndarray:
        """Feeds one request (one chunk per tick, in order); returns the last chunk's last-position logits `[V]`."""
        chunks = rows_chunks(feed.items, feed.unit, self.hidden_size, self.width)
        futures, outs = [], []
        try:
            for chunk in chunks:
                futures.append(self.worker.frame(self.sid, chunk))
            # Awaited one by one, not gathered: a task waiting on the future itself resumes in the loop turn the
            # worker yields between ticks, so its next chunk makes the next tick (a gather resumes a turn later).
            for future in futures:
                outs.append(await future)
        except BaseException as e:  # failed, cancelled or not open: the cache may lack some of the rows
            for future in futures:  # retrieve the other failures (no "exception was never retrieved")
                future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.failed = f"a feed did not complete: {type(e).__name__}: {e}"
            if isinstance(e, Exception) and not isinstance(e, RuntimeError):
                raise RuntimeError(f"the duplex stream {self.sid!r} could not feed: {e}") from e
            raise
        for out in outs:
            if out is None or out.preempted or out.logits is None:
                dropped = 0 if out is None else out.dropped
                self.failed = "the KV pool ran out"
                raise RuntimeError(f"the duplex stream {self.sid!r} was preempted: the KV pool ran out "
                                   f"({dropped} token(s) were not cached)")
        self.position += sum(int(c.advance[0]) for c in chunks)
        return np.asarray(outs[-1].logits, np.float32)
