"""The input audio buffer of a `/v1/realtime` session: PCM appended in frames, server VAD, commits.

`input_audio_buffer.append`: 16-bit mono PCM at the session's rate (24 kHz, or 16 kHz) accumulates into frames of
B ms (`ServeOptions.frame_ms`); every complete frame is resampled to 16 kHz and fed as one audio unit as soon as it is
complete, so the cache follows the live stream. `.commit` feeds the rest, padded with silence to a whole frame, and
adds an `input_audio` user item (`.committed`, `conversation.item.added` / `.done`). With `server_vad`, a frame is
speech when its RMS reaches `threshold / 10` of full scale (default threshold 0.5); `silence_duration_ms` (default
500) of silence after speech stops the turn, commits it and, unless `create_response` is false, starts a response;
speech during a response cancels it unless `interrupt_response` is false. `prefix_padding_ms` (default 0) moves
`speech_started`'s `audio_start_ms` that much before the frame where speech was heard (the audio before it is in the
cache already: every frame is fed as it completes). `idle_timeout_ms` is refused (`client_events`).

`AudioInput` is a mixin of `omnijax.serve.realtime.session.RealtimeSession`, which owns the state it reads (declared
below) and the transport.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import numpy as np

from omnijax.media.audio import resample
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime import server_events as rse

if TYPE_CHECKING:
    from omnijax.serve.context import ServeOptions

VAD_DEFAULTS = {"threshold": 0.5, "silence_duration_ms": 500, "create_response": True, "interrupt_response": True,
                "prefix_padding_ms": 0}


class AudioInput:
    """The audio-buffer events of a Realtime session (module docstring); mixed into `RealtimeSession`."""

    # Owned by `RealtimeSession`.
    settings: rte.SessionSettings
    options: ServeOptions
    conversation: Any
    worker: Any
    sid: str
    audio: np.ndarray  # samples at the session rate not yet fed
    audio_fed_s: float  # seconds of audio fed since the last commit
    audio_ms: int  # all audio received, in ms (VAD times)
    speech: dict | None  # server VAD: {"item": id, "silent_ms": n}
    last_item: str | None
    item_ids: set[str]
    response: asyncio.Task | None
    send: Callable[[dict], None]
    _feed: Callable[..., None]
    _fail: Callable[..., rte.RealtimeEventError]
    _instructions: Callable[[Any], Coroutine[Any, Any, None]]
    _respond: Callable[[rte.ResponseCreate], Coroutine[Any, Any, None]]

    @property
    def _frame(self) -> int:
        return int(round(self.settings.input_audio_rate * self.options.frame_ms / 1000))

    async def _append(self, pcm: np.ndarray, eid) -> None:
        rate = self.settings.input_audio_rate
        if (self.audio.size + pcm.size) / rate > self.options.max_audio_buffer_s:
            raise rte.RealtimeEventError(
                "buffer_too_large", f"the input audio buffer would hold {(self.audio.size + pcm.size) / rate:.1f} s "
                f"not yet fed, over the server's cap of {self.options.max_audio_buffer_s:g} s", event_id=eid,
                param="audio")
        await self._instructions(eid)
        before, self.audio = self.audio, np.concatenate([self.audio, pcm])
        first = True
        while self.audio.size >= self._frame:
            try:
                await self._feed_frame(self.audio[:self._frame], eid)
            except rte.RealtimeEventError:
                if first:  # nothing was fed: the append changes nothing
                    self.audio = before
                raise  # else the frames from this one on stay in the buffer, unfed
            self.audio, first = self.audio[self._frame:], False

    async def _feed_frame(self, frame: np.ndarray, eid) -> None:
        """Feeds one frame of session-rate PCM (raises, feeding nothing, when the model cannot encode it)."""

        try:
            parts = await asyncio.to_thread(self._encode_frame, frame)
        except ValueError as e:
            raise self._fail(e, eid, "audio") from None
        self._feed(parts)
        ms = int(round(1000 * frame.size / self.settings.input_audio_rate))
        self.audio_fed_s += ms / 1000
        self.audio_ms += ms
        if self.settings.turn_detection is not None:
            await self._vad(frame, ms, eid)

    def _encode_frame(self, frame: np.ndarray) -> list:
        """One frame of session-rate int16 PCM -> its audio unit's parts (resampling and the audio encoder: run
        off the event loop)."""
        return self.conversation.audio(resample(frame.astype(np.float32) / 32768.0, self.settings.input_audio_rate))

    async def _vad(self, frame: np.ndarray, ms: int, eid) -> None:
        vad = {k: (v if v is not None else VAD_DEFAULTS.get(k)) for k, v in
               vars(self.settings.turn_detection).items()}
        rms = float(np.sqrt(np.mean((frame.astype(np.float64) / 32768.0) ** 2)))
        speech = rms >= vad["threshold"] / 10
        if self.speech is None and speech:
            self.speech = {"item": rte.new_id("item"), "silent_ms": 0}
            start = max(0, self.audio_ms - ms - vad["prefix_padding_ms"])
            self.send(rse.input_audio_buffer_speech_started(self.speech["item"], start))
            if vad["interrupt_response"] and self.response is not None and not self.response.done():
                self.worker.cancel(self.sid)
        elif self.speech is not None:
            self.speech["silent_ms"] = 0 if speech else self.speech["silent_ms"] + ms
            if self.speech["silent_ms"] >= vad["silence_duration_ms"]:
                item = self.speech["item"]
                self.speech = None
                self.send(rse.input_audio_buffer_speech_stopped(item, self.audio_ms))
                await self._commit(eid, item)
                if vad["create_response"]:
                    await self._respond(rte.ResponseCreate(None))

    async def _commit(self, eid, item_id: str | None = None) -> None:
        if self.audio.size == 0 and self.audio_fed_s == 0:
            raise rte.RealtimeEventError("input_audio_buffer_commit_empty", "the input audio buffer is empty: "
                                         "append audio before committing", event_id=eid)
        while self.audio.size:  # whole frames left by a refused append, then the tail padded with silence
            frame = np.zeros((self._frame,), np.int16)
            frame[:min(self.audio.size, self._frame)] = self.audio[:self._frame]
            await self._feed_frame(frame, eid)
            self.audio = self.audio[self._frame:]
        item_id = item_id or rte.new_id("item")
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": None}]}
        self.audio_fed_s = 0.0
        previous, self.last_item = self.last_item, item_id
        self.item_ids.add(item_id)
        self.send(rse.input_audio_buffer_committed(item_id, previous))
        self.send(rse.conversation_item_added(item, previous))
        self.send(rse.conversation_item_done(item, previous))

