"""The Realtime API's audio output: a session's spoken answers (`output_modalities: ["audio"]`).

On a checkpoint with speech output (`model.speech`: Qwen3-Omni or Qwen2.5-Omni converted from a full release with
its talker) `session.update` takes `output_modalities: ["audio"]`, `audio.output.voice` (one of the checkpoint's
voices, in any case; the session object echoes it as the checkpoint spells it; none given: the checkpoint's first)
and `audio.output.format` `{"type": "audio/pcm", "rate": 24000}`; `response.create` may ask for `["audio"]` or
`["text"]` for one response. A spoken response is one assistant message item whose part is `output_audio`: the text
as the engine decodes it, as `response.output_audio_transcript.delta`s, and the answer spoken (the vocoder in chunks
of `--speech-first-chunk` frames then `--speech-chunk`; never on the event loop) as `output_audio.delta`s (base64 16-bit
PCM at 24 kHz, one per vocoder chunk, as it is decoded): an utterance of the engine's speech pool, batched on its
ticks with every other speaking session and counted by admission; on Qwen3-Omni its talker starts with the answer's
first token (`speech_engine.WrittenSpeech`: audio deltas come between the transcript deltas, the rest after them),
and so does Qwen2.5-Omni's on a server run with `ServeOptions(speak_early=True)` (`--speak-early`: its talker reads
each answer token's thinker row as the engine's decode programs return it, `Answer.rows`, and the utterance is
admitted on the talker prompt alone when the response starts); otherwise Qwen2.5-Omni speaks the finished answer
(`speech_output.speak_pieces`). Then `response.output_audio.done`,
`response.output_audio_transcript.done`, `conversation.item.done` (the part `{"type": "output_audio", "transcript"}`:
the server keeps no audio) and `response.done` (`output_modalities` ["audio"], `audio.output` its voice and format).
`response.cancel` while it speaks stops after the vocoder chunk in progress (status "cancelled"; the utterance leaves
the pool). A `response.create` asking for audio while every row of the speech pool speaks is refused by name
(`overloaded`, the session unchanged); a pool that fills while the answer is decoded is waited on for up to
`ServeOptions.queue_timeout_s`, then the response ends "failed" with an `overloaded` error naming the cap.

The talker's prompt is the text the session fed, in order (every item's and instruction's template rendering, the
tool results, each response's generation prompt and earlier answers as decoded), through this response's generation
prompt; the answer spoken is its tokens without a final end-of-turn token; the talker's tokens are capped by
`ServeOptions.max_speech_tokens`.

Refused by name, the session unchanged: audio output on a checkpoint without a talker (`session.output_modalities`,
`response.output_modalities`, or `session.audio.output.voice` when only a voice is given), a voice the checkpoint does
not have (`session.audio.output.voice`, naming its voices), an output format on a checkpoint without a talker
(`session.audio.output.format`), a format other than 24 kHz `audio/pcm` (the codec), audio
output with duplex or with active tools (`session.output_modalities`); and at `response.create`, a conversation that
cannot be spoken (`SpokenIds.unspeakable`): media on a talker without a media tap, or of a kind its positions are
not built for (an image on Qwen2.5-Omni), media rows past `speech_output.SPEECH_MEDIA_BYTES`, media the talker reads
in a session resumed from a snapshot (snapshots keep the ids fed, not the media a replay needs), or a snapshot
written before snapshots kept the ids (`spoken` in its meta).

Media (Qwen3-Omni): the talker reads `hidden_states[accept_hidden_layer]` at the placeholders of media in user turns
(an image item after its text, input audio committed after a user item's text). `SpokenIds` queues what the
session feeds (`speech_output.MediaReplay`) and replays it through a side `Session` with the engine's settings in a
worker thread (the engine keeps no hidden states) as soon as media the talker reads are queued, so a spoken response
finds their rows ready (it replays what is left first); input audio after a system turn or an answer lies outside
user turns and needs no replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.media.audio import pcm16
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows
from omnijax.serve.chat_params import RequestError
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime import server_events as rse
from omnijax.serve.speech_engine import SpeechOverloaded, WrittenSpeech, finish_speech, pool_full, written_speech
from omnijax.serve.speech_output import AudioOutput, MediaReplay, retrieve_exception, speak_pieces
from omnijax.serve.speech_sampling import parse_talker_sampling

if TYPE_CHECKING:
    from omnijax.serve.context import ServeContext
    from omnijax.serve.realtime.session import RealtimeSession
    from omnijax.serve.realtime.tools import ResponseOutput

__all__ = ["SpokenIds", "answer_and_speech", "check_audio_output", "speak_answer"]

log = logging.getLogger("omnijax.serve")


class SpokenIds:
    """What a session fed, for its talker: the ids in order (the talker's prompt), the media rows' replay
    (`omnijax.serve.speech_output.MediaReplay`), or why it cannot be spoken."""

    def __init__(self, context: ServeContext | None = None, units: Any = None) -> None:
        speaks = context is not None and context.model.speech is not None
        self.replay = MediaReplay.of(context, units) if speaks else None  # type: ignore[arg-type]
        self._ids: list[int] = []  # without a context: text ids only
        self._unspeakable: str | None = None
        self.cancelled = False  # `response.cancel` while the current response speaks

    @property
    def ids(self) -> list[int]:
        """The ids fed, placeholders and answers included."""
        return self._ids if self.replay is None else self.replay.ids

    @property
    def unspeakable(self) -> str | None:
        """Why the talker cannot read this conversation (None: it can)."""
        return self._unspeakable if self.replay is None else self.replay.unspeakable

    def fed(self, parts: Sequence[Any], response: bool = False) -> None:
        """Records the chunks fed (host work only); `response`: they are a response's prompt (a new response: not
        cancelled)."""
        self.cancelled = self.cancelled and not response
        if self.replay is not None:
            self.replay.fed(parts)
            if self.replay.needs_replay and self.replay.unspeakable is None:
                self._replay_now()
            return
        for part in parts:
            if part.embed_mask is not None and np.asarray(part.embed_mask).any():
                self._unspeakable = "the conversation holds image or audio input, whose thinker rows are not kept"
            self._ids += [int(t) for t in np.asarray(part.token_ids)[0][np.asarray(part.valid, bool)[0]]]

    def _replay_now(self) -> None:
        """Media the talker reads were queued: replays them now in a worker thread (on the session's event loop), so
        a spoken response finds their rows ready; the replay's lock orders it before the response's own call."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop (a direct caller): the response's call replays
        task = asyncio.ensure_future(asyncio.to_thread(self.replay.rows))  # type: ignore[union-attr]
        task.add_done_callback(retrieve_exception)  # a failure is raised again where the rows are read

    def restore(self, saved: tuple | None) -> None:
        """Continues a snapshot's `(ids, unspeakable)` (`resume.meta_of` writes them); None: a snapshot written
        without them, whose talker prompt is unknown."""
        ids, why = (((), "the session was resumed from a snapshot that does not keep the text ids fed")
                    if saved is None else (saved[0], saved[1]))
        if self.replay is not None:
            self.replay.restore(ids, why)
        else:
            self._ids, self._unspeakable = [int(t) for t in ids], why

    def answered(self, tokens: Sequence[int]) -> None:
        """Records a response's tokens as decoded (they are in the cache, the end-of-turn token too)."""
        if self.replay is not None:
            self.replay.answered(tokens)
        else:
            self._ids += [int(t) for t in tokens]

    def media(self, prompt_len: int) -> tuple[MediaRows, ...]:
        """The media rows the talker reads in the first `prompt_len` ids (blocking: the replay's device work)."""
        return () if self.replay is None else self.replay.rows(prompt_len)


def check_audio_output(session: RealtimeSession, settings: rte.SessionSettings, eid: str | None,
                       changes: dict | None = None) -> rte.SessionSettings:
    """Checks an updated session's audio output against the checkpoint; returns the settings with the voice as the
    checkpoint spells it (its first voice when audio is asked for without one). Raises `RealtimeEventError`
    naming the field; changes nothing."""
    changes = changes or {}
    audio = "audio" in settings.output_modalities
    sampled = settings.output_sampling is not None
    if not audio and settings.output_voice is None and "output_format" not in changes and not sampled:
        return settings
    speech, name = session.context.model.speech, session.options.model_name
    if speech is None:
        param = ("session.output_modalities" if audio else "session.audio.output.voice"
                 if settings.output_voice is not None else "session.audio.output.sampling" if sampled
                 else "session.audio.output.format")
        raise rte.RealtimeEventError("unsupported", f"audio output is not supported: model {name!r} has no speech "
                                     "output (a talker and a vocoder), so it answers in text only; serve a "
                                     "checkpoint converted from a full release with its talker (Qwen3-Omni's or "
                                     "Qwen2.5-Omni's), or send output_modalities [\"text\"] and no audio.output",
                                     event_id=eid, param=param)
    voices = {v.lower(): v for v in speech.voices}
    voice = settings.output_voice or speech.voices[0]
    if voice.lower() not in voices:
        raise rte.RealtimeEventError("invalid_value", f"'session.audio.output.voice' {voice!r} is not a voice of "
                                     f"model {name!r}: its voices are {list(speech.voices)}", event_id=eid,
                                     param="session.audio.output.voice")
    if audio and settings.duplex:
        raise rte.RealtimeEventError("unsupported", "audio output is not supported in duplex sessions (their "
                                     "answers are text)", event_id=eid, param="session.output_modalities")
    if audio and settings.tools and settings.tool_choice != "none":
        raise rte.RealtimeEventError("unsupported", "audio output is not supported with active tools (a call "
                                     "cannot be spoken): send tool_choice \"none\", or no tools", event_id=eid,
                                     param="session.output_modalities")
    talker_sampling(settings, speech, eid)
    return dataclasses.replace(settings, output_voice=voices[voice.lower()])


def talker_sampling(settings: rte.SessionSettings, speech: Any, eid: str | None = None) -> TalkerSampling | None:
    """The talker's sampling of `session.audio.output.sampling` (None: greedy), checked against the checkpoint
    (`omnijax.serve.speech_sampling`); `RealtimeEventError` naming the field."""
    try:
        return parse_talker_sampling(None if settings.output_sampling is None else dict(settings.output_sampling),
                                     "session.audio.output.sampling", speech)
    except RequestError as e:
        raise rte.RealtimeEventError(e.code, str(e), event_id=eid, param=e.param) from None


def response_modalities(session: RealtimeSession, asked: tuple | None, eid: str | None
                        ) -> tuple[tuple, str | None]:
    """The modalities of a response (`response.output_modalities`, else the session's) and the voice it speaks in
    (None: text), checked: a spoken one needs a talker and a conversation the talker can read."""
    modalities = asked if asked is not None else session.settings.output_modalities
    if "audio" not in modalities:
        return modalities, None
    param = "response.output_modalities" if asked is not None else "session.output_modalities"
    settings = check_audio_output(session, dataclasses.replace(session.settings, output_modalities=modalities), eid)
    why = session.spoken.unspeakable
    if why is not None:
        raise rte.RealtimeEventError("unsupported", f"this response cannot be spoken: {why}; ask for "
                                     "output_modalities [\"text\"]", event_id=eid, param=param)
    full = pool_full(session.context)
    if full is not None:  # before anything is fed: the session unchanged
        raise rte.RealtimeEventError("overloaded", f"this response cannot be spoken now: {full}", event_id=eid,
                                     param=param)
    return modalities, settings.output_voice


async def answer_and_speech(session: RealtimeSession, answer: Any, output: ResponseOutput, decoder: Any,
                            voice: str | None, prompt: Sequence[int] | None, rid: str) -> tuple[str, Any, str]:
    """Streams a response's answer (its text deltas through `output`) and, when it is spoken (`voice`), its speech:
    on the engine's speech pool (Qwen3-Omni; Qwen2.5-Omni served with `speak_early`, reading the answer's rows)
    the talker starts with the answer's first token and each vocoder chunk goes out as it is decoded, between the
    transcript deltas (`speech_engine.WrittenSpeech`); otherwise (Qwen2.5-Omni) once the text is whole. Records
    the answer in the conversation and the talker's ids. Returns the response's `(status, reason, tail)` (`tail`:
    text still to send)."""
    early = None
    if voice is not None:
        early = written_speech(session.context, np.asarray(prompt or [], np.int64), voice,
                               functools.partial(asyncio.to_thread, session.spoken.media, len(prompt or [])),
                               stop=session.conversation.eos,
                               sampling=talker_sampling(session.settings, session.context.model.speech),
                               rows=answer.rows)
    try:
        async for tokens in answer:
            output.push(decoder.push(tokens))
            if early is not None and not session.spoken.cancelled:
                early.push(tokens)
                for pcm in early.ready():
                    _send_pcm(session, output, rid, pcm16(pcm))
        await answer.done
        session.conversation.answered(answer.tokens)
        session.spoken.answered(answer.tokens)
        status, reason, tail = answer.status, answer.reason, decoder.flush()
        if voice is not None and status != "cancelled":
            output.push(tail)
            tail, ended = "", await speak_answer(session, output, voice, prompt or [], answer.tokens, rid, early)
            if ended is not None:
                status, reason = ended, "cancelled" if ended == "cancelled" else None
        return status, reason, tail
    finally:
        if early is not None:
            await early.aclose()


def _send_pcm(session: RealtimeSession, output: ResponseOutput, rid: str, pcm: np.ndarray) -> None:
    message = output.message
    assert message is not None  # a spoken response's message item is opened at once
    session.send(rse.response_output_audio_delta(rid, message.item["id"], pcm.astype("<i2").tobytes(),
                                                 output_index=message.index))


async def speak_answer(session: RealtimeSession, output: ResponseOutput, voice: str, prompt: Sequence[int],
                       tokens: Sequence[int], rid: str, early: WrittenSpeech | None = None) -> str | None:
    """Speaks a response's answer `tokens` in `voice` after the talker prompt `prompt` (`early`: the rest of the
    answer spoken while written), sending each vocoder chunk as a `response.output_audio.delta` of the response's
    message item; returns "cancelled" when `response.cancel` stopped it, "failed" when the speech failed (an `error`
    event said why), else None."""
    eos = session.conversation.eos
    answer = list(tokens[:-1] if tokens and tokens[-1] in eos else tokens)
    audio = AudioOutput(voice, "pcm16", talker_sampling(session.settings, session.context.model.speech))
    try:
        if early is not None:
            pieces = finish_speech(early, answer)
        else:
            media = await asyncio.to_thread(session.spoken.media, len(prompt))
            pieces = speak_pieces(session.context, audio, np.asarray(prompt, np.int64), answer, media)
        async with contextlib.aclosing(pieces):  # closed at once on cancel: the pool frees
            async for pcm in pieces:
                if session.spoken.cancelled:
                    return "cancelled"
                _send_pcm(session, output, rid, pcm)
    except SpeechOverloaded as e:  # the pool stayed full for queue_timeout_s: named, not spoken
        session.send(rte.error_event("overloaded", str(e), error_type="server_error"))
        return "failed"
    except Exception as e:  # noqa: BLE001 - the response ends "failed" and the client is told why
        log.exception("realtime session=%s: speech failed", session.sid)
        session.send(rte.error_event("speech_failed", f"the answer could not be spoken: {type(e).__name__}: {e}",
                                     error_type="server_error"))
        return "failed"
    return "cancelled" if session.spoken.cancelled else None
