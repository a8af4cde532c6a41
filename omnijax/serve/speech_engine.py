"""The server's spoken answers on the engine's speech pool (Qwen3-Omni; issue 39).

When the served engine has a speech pool (`omnijax.serve.engine.speech.SpeechPool`, built by `build_context` for a
checkpoint whose speech output is Qwen3-Omni's: `speech_config_for`), chat completions' audio output and Realtime's
spoken responses speak through `EngineWorker.speak`: each answer is an utterance of the pool, its talker and code
predictor steps batched with every other speaking session's in the engine's ticks and its vocoder chunks batched
per tick, so admission counts them (the AIMD cap counts an utterance as an active session; the pool's rows and
talker pages are reserved up front). Qwen2.5-Omni (Token2Wav) has no pool: its answers are spoken in worker threads
beside the engine (`speech_output.speak_pieces`' thread path).

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
import itertools
import math
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.models.qwen3_omni.speech import Qwen3Speech
from omnijax.models.speech import MediaRows
from omnijax.serve.chat_params import RequestError
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.speech import SpeechConfig

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext

__all__ = ["SpeechOverloaded", "pool_full", "pool_pieces", "speaks_on_pool", "speech_config_for", "warm_up_pool"]

WARM_PROMPTS = (16, 32, 64)  # talker prompt buckets warmed (the pool pads prompts to powers of two >= 16)

_ids = itertools.count()


class SpeechOverloaded(RequestError):
    """A spoken answer the speech pool cannot admit (HTTP 429 `overloaded`, naming the cap)."""

    def __init__(self, message: str, param: str | None = "modalities"):
        super().__init__(message, status=429, code="overloaded", kind="rate_limit_error", param=param)


def speech_config_for(model: Any, *, max_speech_tokens: int, context_tokens: int,
                      rows: Sequence[int] = (1, 2, 4, 8), page_size: int = 64) -> SpeechConfig | None:
    """The engine's speech pool for a served model: None unless its speech output is Qwen3-Omni's.

    A row holds a talker prompt of up to `context_tokens` tokens plus `max_speech_tokens` speech tokens
    (`max_pages`); the pool holds two such rows (`num_pages = 2 * max_pages`, allocated when the engine starts), so
    with the usual short talker prompts its rows fill before its pages (an utterance reserves its prompt plus
    `max_speech_tokens`); long conversations may fill the pages first, which a route waits on, then refuses naming
    them. The vocoder's chunks are the routes' (`first_chunk` 4 frames, then 25).
    """
    if not isinstance(getattr(model, "speech", None), Qwen3Speech):
        return None
    max_pages = math.ceil((int(context_tokens) + int(max_speech_tokens)) / page_size)
    rows = tuple(rows)
    return SpeechConfig(rows=rows, num_pages=min(2, rows[-1]) * max_pages, page_size=page_size, max_pages=max_pages)


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
    tokens, stats = pool.speech.tokens, dict(pool.stats)
    text = tokens.tts_pad_token_id  # a plain text id of the thinker's vocabulary
    sizes = [int(n) for n in prompt_tokens if pool.pages_needed(n, 2) <= pool.max_pages]
    # the first bucket twice: the pool's fresh cache is not yet a jitted call's output (committed to its device),
    # and that compiles apart from what every later call gets
    for n in sizes[:1] + sizes:
        # a user turn of n - 9 ids, then the assistant's opening: the talker's prompt is n rows (9 of the answer's)
        user = [tokens.im_start_token_id, tokens.user_token_id, *[text] * max(0, n - 12), tokens.im_end_token_id]
        prompt = np.asarray([*user, tokens.im_start_token_id, tokens.assistant_token_id, text])
        speech_id = f"warmup-speech-{n}"
        pool.open(speech_id, prompt, np.asarray([text]), voice=pool.speech.voices[0], max_new_tokens=2)
        while speech_id in pool.sessions:
            pool.tick()
    pool.warm_vocoder()
    pool.stats.clear()
    pool.stats.update(stats)
    return sizes


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
                 media: Sequence[MediaRows]) -> Any:
    worker = context.worker
    deadline = time.monotonic() + context.options.queue_timeout_s
    while True:
        try:
            return await worker.speak(speech_id, prompt, np.asarray(answer, np.int64), voice=voice,
                                      max_new_tokens=context.options.max_speech_tokens, media=tuple(media))
        except Overloaded as e:
            if worker.stopping or time.monotonic() >= deadline:
                raise SpeechOverloaded(f"the answer could not be spoken: {e} (waited "
                                       f"{context.options.queue_timeout_s:g} s for room)") from None
        await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


async def pool_pieces(context: ServeContext, prompt: np.ndarray, answer: Sequence[int], voice: str,
                      media: Sequence[MediaRows] = ()) -> AsyncGenerator[np.ndarray, None]:
    """The answer spoken on the engine's speech pool: float32 PCM per vocoder chunk, as the ticks decode them.

    Raises:
        SpeechOverloaded: no room within `queue_timeout_s` (nothing was spoken).
        ValueError: a refusal of the pool (a talker prompt longer than a row holds, a voice the checkpoint lacks),
            or the utterance failed (a failed tick, the server shutting down), naming why.
    """
    speech_id = f"speech-{next(_ids)}"
    stream = await _admit(context, speech_id, prompt, answer, voice, media)
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
