"""The server's spoken answers on the engine's speech pool (Qwen3-Omni, Qwen2.5-Omni; issue 39).

When the served engine has a speech pool (`omnijax.serve.engine.speech.SpeechPool` for Qwen3-Omni,
`omnijax.serve.engine.speech_qwen25.Qwen25SpeechPool` for Qwen2.5-Omni, built by `build_context` for a checkpoint
with speech output: `speech_config_for`), chat completions' audio output and Realtime's spoken responses speak
through `EngineWorker.speak`: each answer is an utterance of the pool, its talker steps batched with every other
speaking session's in the engine's ticks and its vocoder calls run in the ticks, so admission counts them (the AIMD
cap counts an utterance as an active session; the pool's rows and talker pages are reserved up front). Qwen3-Omni's
talker starts while the answer is written (`WrittenSpeech`); Qwen2.5-Omni's reads the thinker's final hidden state
of every answer token (recomputed with the media rows by `Qwen25SpeechPool.prepare`, in a worker thread before
admission), so it speaks the finished answer (`pool_pieces`), unless the server runs with
`ServeOptions(speak_early=True)` (`--speak-early`): its pool is then built with `SpeechConfig(early_start=True)`, the
engine's decode programs return each answer token's row (`Answer.rows`), and chat completions' audio output and
Realtime's spoken responses speak the answer while it is written (`WrittenSpeech` given the rows; `prepare` runs over
the prompt alone). Qwen2.5-Omni's talker draws nothing (`audio.sampling` is refused on it, `speech_sampling`), so
its speech is greedy on every path. An engine built without a pool speaks in worker threads beside it
(`speech_output.speak_pieces`' thread path).

Admission, for a route:
- before anything is fed (chat completions' prompt, Realtime's `response.create`), `pool_full` says whether every row
  of the pool speaks: the request is refused by name (HTTP 429 `overloaded`, a Realtime `error` event), the
  conversation unchanged;
- when the answer is decoded, `pool_pieces` admits it; a pool that filled meanwhile (or whose talker pages or AIMD
  cap refuse it) is retried each tick for up to `ServeOptions.queue_timeout_s` (as a chat completion waits for an
  engine row), then refused with `SpeechOverloaded` (HTTP 429, naming the cap).
An utterance whose stream is closed early (a client gone, `response.cancel`) is cancelled in the pool (its pages
return). The pool's chunks are float32 PCM; the routes send them as 16-bit PCM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.media.audio import pcm16
from omnijax.models.qwen2_5_omni.speech import Qwen25Speech
from omnijax.models.qwen3_omni.speech import Qwen3Speech
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows
from omnijax.serve.chat_params import RequestError
from omnijax.serve.context import CHUNK, FIRST_CHUNK
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.speech import SpeechConfig
from omnijax.serve.engine.speech_qwen25 import Qwen25SpeechPool

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

__all__ = ["SpeechOverloaded", "WrittenSpeech", "finish_speech", "pool_full", "pool_pieces", "speaks_on_pool",
           "speech_config_for", "warm_up_pool", "written_speech"]

WARM_PROMPTS = (16, 32, 64)  # talker prompt buckets warmed (the pool pads prompts to powers of two >= 16)

_ids = itertools.count()


class SpeechOverloaded(RequestError):
    """A spoken answer the speech pool cannot admit (HTTP 429 `overloaded`, naming the cap)."""

    def __init__(self, message: str, param: str | None = "modalities"):
        super().__init__(message, status=429, code="overloaded", kind="rate_limit_error", param=param)


def speech_config_for(model: Any, *, max_speech_tokens: int, context_tokens: int,
                      rows: Sequence[int] = (1, 2, 4, 8), page_size: int = 64,
                      talker_window: int | None = None, early_start: bool = False,
                      first_chunk: int = FIRST_CHUNK, chunk: int = CHUNK) -> SpeechConfig | None:
    """The engine's speech pool for a served model: None unless it has a speech output (Qwen3-Omni's, Qwen2.5-Omni's).

    A row holds a talker prompt of up to `context_tokens` tokens plus `max_speech_tokens` speech tokens
    (`max_pages`); the pool holds two such rows (`num_pages = 2 * max_pages`, allocated when the engine starts), so
    with the usual short talker prompts its rows fill before its pages (an utterance reserves its prompt plus
    `max_speech_tokens`); long conversations may fill the pages first, which a route waits on, then refuses naming
    them. The vocoder's chunks: `first_chunk` frames, then `chunk` (`ServeOptions.speech_first_chunk` /
    `speech_chunk`, 4 then 25 by default). `talker_window`: the talker rows'
    bounded KV (`SpeechConfig.talker_window`; an utterance then reserves its prompt or the window's pages).
    `early_start`: Qwen2.5-Omni's pool speaks answers while they are written (`SpeechConfig.early_start`; Qwen3-Omni's
    always can, the flag changes nothing there).
    """
    if not isinstance(getattr(model, "speech", None), (Qwen3Speech, Qwen25Speech)):
        return None
    max_pages = math.ceil((int(context_tokens) + int(max_speech_tokens)) / page_size)
    rows = tuple(rows)
    return SpeechConfig(rows=rows, num_pages=min(2, rows[-1]) * max_pages, page_size=page_size, max_pages=max_pages,
                        talker_window=talker_window, first_chunk=first_chunk, chunk=chunk,
                        early_start=bool(early_start) and isinstance(model.speech, Qwen25Speech))


def warm_up_pool(engine: Any, prompt_tokens: Sequence[int] = WARM_PROMPTS) -> list[int]:
    """Compiles the engine's speech pool for one speaking session, so that a first spoken request at the usual
    sizes compiles nothing: per talker prompt bucket in `prompt_tokens`, a throw-away one-row utterance of two
    frames (the prefill at that length, the talker step), then every one-row Code2Wav call
    (`SpeechPool.warm_vocoder`: first and later calls, full chunks and each shorter power-of-two tail). Several
    sessions speaking at once (larger row buckets) still compile when first met. A bucket a row cannot hold is
    skipped. Call it before serving: the pool must be empty, and it is left empty with its statistics as they were.

    Returns:
        The prompt buckets warmed (none without a pool).

    Raises:
        ValueError: the pool is speaking.
    """
    pool = getattr(engine, "speech", None)
    if pool is None:
        return []
    if pool.sessions:
        raise ValueError(f"warm_up_pool: the speech pool is speaking ({pool.sessions}); warm it up before serving")
    stats = dict(pool.stats)
    sizes = [int(n) for n in prompt_tokens if pool.pages_needed(n, 2) <= pool.max_pages]
    # the first bucket twice: the pool's fresh cache is not yet a jitted call's output (committed to its device),
    # and that compiles apart from what every later call gets
    for n in sizes[:1] + sizes:
        prompt, answer = pool.warm_ids(n) if isinstance(pool, Qwen25SpeechPool) else _warm_ids(pool, n)
        speech_id = f"warmup-speech-{n}"
        pool.open(speech_id, prompt, answer, voice=pool.speech.voices[0], max_new_tokens=2)
        while speech_id in pool.sessions:
            pool.tick()
    pool.warm_vocoder()
    pool.stats.clear()
    pool.stats.update(stats)
    return sizes


def _warm_ids(pool: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Omni's warm-up utterance: a user turn of n - 9 ids, then the assistant's opening: the talker's prompt is
    n rows (9 of the answer's)."""
    tokens = pool.speech.tokens
    text = tokens.tts_pad_token_id  # a plain text id of the thinker's vocabulary
    user = [tokens.im_start_token_id, tokens.user_token_id, *[text] * max(0, n - 12), tokens.im_end_token_id]
    return np.asarray([*user, tokens.im_start_token_id, tokens.assistant_token_id, text]), np.asarray([text])


def speaks_on_pool(context: ServeContext) -> bool:
    """Whether the served engine speaks on its speech pool (else: worker threads)."""
    return getattr(context.worker.engine, "speech", None) is not None


def pool_full(context: ServeContext) -> str | None:
    """Why a new spoken answer cannot be admitted now (every row of the pool speaks), naming the cap; None: room
    (or no pool). Read on the event loop: the worker's count of speaking utterances."""
    pool = getattr(context.worker.engine, "speech", None)
    if pool is None:
        return None
    speaking = len(context.worker.speaking)
    if speaking < pool.capacity:
        return None
    return (f"overloaded: {speaking} answers are being spoken and the engine's speech pool holds at most "
            f"{pool.capacity} (SpeechConfig.rows); retry later")


async def _admit(context: ServeContext, speech_id: str, prompt: np.ndarray, answer: Sequence[int], voice: str,
                 media: Sequence[MediaRows], writing: bool = False, sampling: TalkerSampling | None = None) -> Any:
    worker = context.worker
    pool = worker.engine.speech
    more = {}
    if isinstance(pool, Qwen25SpeechPool):  # its talker input (a thinker forward) built here, off the engine's thread
        more["prepared"] = await asyncio.to_thread(pool.prepare, prompt, np.asarray(answer, np.int64), voice=voice,
                                                   media=tuple(media), writing=writing)
    deadline = time.monotonic() + context.options.queue_timeout_s
    while True:
        try:
            return await worker.speak(speech_id, prompt, np.asarray(answer, np.int64), voice=voice,
                                      max_new_tokens=context.options.max_speech_tokens, media=tuple(media),
                                      writing=writing, sampling=sampling, **more)
        except Overloaded as e:
            if worker.stopping or time.monotonic() >= deadline:
                raise SpeechOverloaded(f"the answer could not be spoken: {e} (waited "
                                       f"{context.options.queue_timeout_s:g} s for room)") from None
        await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


async def pool_pieces(context: ServeContext, prompt: np.ndarray, answer: Sequence[int], voice: str,
                      media: Sequence[MediaRows] = (), *, sampling: TalkerSampling | None = None
                      ) -> AsyncGenerator[np.ndarray, None]:
    """The answer spoken on the engine's speech pool: float32 PCM per vocoder chunk, as the ticks decode them
    (`sampling`: drawn speech; None: greedy).

    Raises:
        SpeechOverloaded: no room within `queue_timeout_s` (nothing was spoken).
        ValueError: a refusal of the pool (a talker prompt longer than a row holds, a voice the checkpoint lacks),
            or the utterance failed (a failed tick, the server shutting down), naming why.
    """
    speech_id = f"speech-{next(_ids)}"
    stream = await _admit(context, speech_id, prompt, answer, voice, media, sampling=sampling)
    done = False
    try:
        while True:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                break
            except RuntimeError as e:  # the utterance failed (a failed tick, shutdown): named as the routes name it
                done = True
                raise ValueError(str(e)) from None
            if chunk.pcm.size:
                yield chunk.pcm
        done = True
    finally:
        if not done:  # closed early (client gone, cancelled): the utterance leaves the pool, its pages return;
            # shielded: a cancelled caller (a cancel scope cancels every later await) must not leave it unticked there
            await asyncio.shield(asyncio.ensure_future(context.worker.cancel_speech(speech_id)))


def written_speech(context: ServeContext, prompt: np.ndarray, voice: str,
                   media: Callable[[], Awaitable[Sequence[MediaRows]]] | None = None, *, stop: Collection[int] = (),
                   sampling: TalkerSampling | None = None, rows: Sequence[np.ndarray] | None = None
                   ) -> WrittenSpeech | None:
    """The answer spoken while the thinker writes it (`WrittenSpeech`, arguments as there) when the engine speaks on
    its speech pool and the talker can start early: Qwen3-Omni's always; Qwen2.5-Omni's when its pool reads the
    engine's rows (`SpeechConfig(early_start=True)`, `ServeOptions.speak_early`), the route hands them over (`rows`:
    the answer's `Answer.rows`) and the speech is greedy (`sampling` None). None otherwise: the finished answer is
    spoken (on the pool, `pool_pieces`, or in worker threads without one)."""
    if not speaks_on_pool(context):
        return None
    if isinstance(context.model.speech, Qwen3Speech):
        return WrittenSpeech(context, np.asarray(prompt, np.int64), voice, media, stop=stop, sampling=sampling)
    pool = context.worker.engine.speech
    if not getattr(pool, "reads_rows", False) or rows is None or sampling is not None:
        return None
    return WrittenSpeech(context, np.asarray(prompt, np.int64), voice, media, stop=stop, rows=rows)


async def finish_speech(early: WrittenSpeech, answer: Sequence[int]) -> AsyncGenerator[np.ndarray, None]:
    """The rest of an answer spoken while written, once it is whole (`answer`: as `WrittenSpeech.finish` takes
    it): int16 PCM chunk by chunk, those already decoded first. Raises as `WrittenSpeech.rest`."""
    early.finish(answer)
    for pcm in early.ready():
        yield pcm16(pcm)
    async for pcm in early.rest():
        yield pcm16(pcm)


class WrittenSpeech:
    """An answer spoken on the engine's speech pool while the thinker still writes it: the talker starts with the
    answer's first token and reads each later one as the route hands it over, so PCM comes while the text is still
    being decoded (`SpeechPool.open(writing=True)` / `extend`). Qwen2.5-Omni's talker reads each token's thinker row
    too (`rows`, `Qwen25SpeechPool.extend(..., rows=)`): a token is handed over once its row has arrived, and the
    utterance is admitted on the prompt alone (`prepare(writing=True)`) when this object is made, so that it is in
    the pool by the answer's first token (an answer ended without a token ends it silent).

    On the event loop, computing nothing: `push(tokens)` as the answer's tokens arrive, `ready()` for the PCM chunks
    decoded so far (without waiting), `finish(answer)` with the whole answer spoken (what the finished-answer path
    speaks: the answer without its final stop token), then `async for pcm in rest()` for the remaining chunks, and
    `aclose()` always (an utterance left unfinished is cancelled in the pool, its pages return). A task admits the
    utterance (after the media rows, if any: `media`) and hands the tokens to the engine thread in order; a trailing
    stop token or `<|im_end|>` (at most two) is held back until the next token shows it was not the end, as it is
    not spoken at the end. The PCM equals the finished answer spoken on the pool (`pool_pieces`) up to float
    rounding (the text rows are projected in pieces).

    Args:
        context: the server's context (its worker's engine has a speech pool).
        prompt: the talker's prompt ids.
        voice: a voice of the checkpoint.
        media: awaited before admission: the thinker rows the talker reads at media placeholders (None: none).
        stop: the thinker's stop ids (a final one is not spoken).
        sampling: drawn speech (`TalkerSampling`); None: greedy.
        rows: Qwen2.5-Omni: the answer's rows as they arrive (`Answer.rows`, one `[D]` row per token, read as it
            grows); None for Qwen3-Omni.

    Errors (admission: `SpeechOverloaded` after `queue_timeout_s`; a refusal of the pool or a failed utterance:
    ValueError naming why) are raised by `rest()`; `ready()` returns nothing meanwhile.
    """

    def __init__(self, context: ServeContext, prompt: np.ndarray, voice: str,
                 media: Callable[[], Awaitable[Sequence[MediaRows]]] | None = None, *, stop: Collection[int] = (),
                 sampling: TalkerSampling | None = None, rows: Sequence[np.ndarray] | None = None):
        speech = context.model.speech
        assert isinstance(speech, Qwen3Speech) or rows is not None and isinstance(speech, Qwen25Speech)
        self.context, self.prompt, self.voice, self.media, self.sampling = context, prompt, voice, media, sampling
        self.speech_id = f"speech-{next(_ids)}"
        self._rows, self._given = rows, 0  # (Qwen2.5-Omni) the answer's rows; how many went to the pool
        self._im_end = int(speech.tokens.im_end_token_id if isinstance(speech, Qwen3Speech)
                           else speech.im_end_token_id)
        self._droppable = frozenset(int(t) for t in stop) | {self._im_end}
        self._generated: list[int] = []
        self._sent: list[int] = []  # the tokens handed over (to `_pending` and on to the pool)
        self._pending: list[int] = []
        self._ended = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stream: Any = None
        self._error: BaseException | None = None
        if rows is not None:  # Qwen2.5-Omni: admitted on the prompt alone at once, beside the answer's first tick
            self._task = asyncio.ensure_future(self._feed())

    def push(self, tokens: Sequence[int]) -> None:
        """The answer's next tokens as decoded (event loop; no compute): those certainly spoken go to the talker."""
        self._generated += [int(t) for t in tokens]
        held = 0
        while held < min(2, len(self._generated)) and self._generated[-1 - held] in self._droppable:
            held += 1
        readable = len(self._generated) - held
        if self._rows is not None:  # a token waits for its row (a per-token tick sends rows after its tokens)
            readable = min(readable, len(self._rows))
        self._hand(self._generated[:readable])

    def finish(self, answer: Sequence[int]) -> None:
        """The whole answer spoken (a final `<|im_end|>` dropped here); it must extend what was handed over."""
        whole = [int(t) for t in answer]
        if whole and whole[-1] == self._im_end:
            whole = whole[:-1]
        if self._rows is not None and len(self._rows) < len(whole):
            raise ValueError(f"WrittenSpeech.finish: the rows of {len(whole) - len(self._rows)} of the answer's "
                             f"{len(whole)} tokens have not arrived (the answer was cut mid-tick)")
        self._ended = True
        self._hand(whole)

    def _hand(self, readable: list[int]) -> None:
        if readable[:len(self._sent)] != self._sent:
            raise ValueError("WrittenSpeech: the answer given does not continue the tokens already spoken")
        self._pending += readable[len(self._sent):]
        self._sent = readable
        if self._task is None and (self._pending or self._ended) and self._sent:
            self._task = asyncio.ensure_future(self._feed())
        self._wake.set()

    async def _feed(self) -> None:
        try:
            media = tuple(await self.media()) if self.media is not None else ()
            # Qwen2.5-Omni: opened on the prompt alone, every token (with its row) handed over by `extend`
            first: list[int] = []
            if self._rows is None:
                first, self._pending = self._pending, []
            writing = self._rows is not None or not self._ended
            self._stream = await _admit(self.context, self.speech_id, self.prompt, first, self.voice, media,
                                        writing=writing, sampling=self.sampling)
            while writing:
                while not self._pending and not self._ended:
                    self._wake.clear()
                    await self._wake.wait()
                tokens, self._pending, end = self._pending, [], self._ended
                more = {}
                if self._rows is not None and tokens:
                    more["rows"] = np.stack(self._rows[self._given:self._given + len(tokens)])
                    self._given += len(tokens)
                if not await self.context.worker.extend_speech(self.speech_id, tokens, end=end, **more):
                    return  # the talker ended (its max tokens) or the utterance stopped: the rest is not needed
                writing = not end
        except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - raised again by `rest`
            self._error = e
            if isinstance(e, asyncio.CancelledError):
                raise

    def ready(self) -> list[np.ndarray]:
        """The PCM chunks (float32) decoded and not yet returned, without waiting."""
        if self._stream is None or self._error is not None:
            return []
        return [c.pcm for c in self._stream.ready() if c.pcm.size]

    async def rest(self) -> AsyncIterator[np.ndarray]:
        """After `finish`: the remaining PCM chunks as the ticks decode them (nothing when the answer was empty).

        Raises:
            SpeechOverloaded: no room in the pool within `queue_timeout_s`.
            ValueError: a refusal of the pool, or the utterance failed (a failed tick, shutdown), naming why.
        """
        if not self._ended:
            raise ValueError("WrittenSpeech.rest: call finish(answer) first")
        if self._task is not None:
            await self._task
        if self._error is not None:
            raise self._error
        if self._stream is None:
            return  # nothing to say
        while True:
            try:
                chunk = await self._stream.__anext__()
            except StopAsyncIteration:
                return
            except RuntimeError as e:  # the utterance failed: named as the routes name it
                raise ValueError(str(e)) from None
            if chunk.pcm.size:
                yield chunk.pcm

    async def aclose(self) -> None:
        """Ends the feeding task and, if the utterance is still in the pool, cancels it (its pages return)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.speech_id in self.context.worker.speaking:
            await asyncio.shield(asyncio.ensure_future(self.context.worker.cancel_speech(self.speech_id)))
