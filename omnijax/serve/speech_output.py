"""Chat completions' audio output: `modalities: ["text", "audio"]` with `audio: {"voice", "format"}`.

On a checkpoint with speech output (`model.speech`: Qwen3-Omni converted from its full release) the answer is
decoded as text on the engine's ticks, then spoken: the talker decodes codec frames over the whole answer's text and
the vocoder decodes them in chunks as they are ready (`FIRST_CHUNK` frames, then `CHUNK`; `SpeechOutput.speak_chunks`),
each chunk's work in a worker thread (`asyncio.to_thread`), never on the event loop. The talker's prompt is the
request's templated text as fed (every message's rendering and the generation prompt); the answer spoken is the
answer's tokens without the final end-of-turn token; the talker's tokens are capped by
`ServeOptions.max_speech_tokens`.

As OpenAI's API returns it, the message's `content` is null and the text is the audio's `transcript`:
- whole: `choices[0].message.audio = {id, data, expires_at, transcript}`, `data` the base64 of a WAV file (16-bit
  mono PCM at the model's rate, 24 kHz) for `format` "wav", of raw 16-bit little-endian PCM for "pcm16";
- streamed (`format` "pcm16" only, as OpenAI streams audio): `delta.audio = {id, transcript}` per text piece as it is
  decoded, then `{id, data}` per vocoder chunk (base64 PCM16) as it is decoded, then `{expires_at}` last.
The server keeps no audio: `expires_at` is the response's creation time, and an assistant message that refers to an
earlier audio answer (`messages[i].audio`) is refused.

Refused by name (HTTP 400) before anything is fed: audio asked of a checkpoint without speech output
(`modalities`), `audio` missing or given without the audio modality, a voice the checkpoint does not have
(`audio.voice`, naming its voices), a custom voice object, a format other than wav / pcm16 (`audio.format`: aac, mp3,
flac, opus are OpenAI's formats this server does not encode), wav with `stream` (`audio.format`); and what the
spoken path does not handle yet: image / audio parts in the messages (the talker reads the thinker's hidden states at
media placeholders), `stop` strings (the spoken tokens would differ from the cut text), active `tools`, several
choices (`n`) and `logprobs`.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.media.audio import pcm16, wav_bytes
from omnijax.serve.chat_params import RequestError, check_keys, json_payload
from omnijax.serve.chat_request import ChatRequest, parse_payload

if TYPE_CHECKING:
    from omnijax.models.family import OmniModel
    from omnijax.serve.context import ServeContext

__all__ = ["CHUNK", "FIRST_CHUNK", "FORMATS", "AudioOutput", "audio_message", "check_spoken_request",
           "new_audio_id", "parse_audio_output", "parse_with_audio", "prompt_ids", "speak_pieces"]

FORMATS = ("wav", "pcm16")
OPENAI_FORMATS = ("wav", "aac", "mp3", "flac", "opus", "pcm16")
FIRST_CHUNK = 4  # codec frames of the vocoder's first call (320 ms of speech for Qwen3-Omni)
CHUNK = 25  # codec frames of each later call (2 s)


@dataclass(frozen=True)
class AudioOutput:
    """A request's audio output: the checkpoint's voice (as the checkpoint spells it) and the format."""

    voice: str
    format: str


def parse_audio_output(body: Any, model: OmniModel, model_name: str) -> AudioOutput | None:
    """The audio output a request body asks for (None: text only); `RequestError` naming the field."""
    if not isinstance(body, dict):
        return None  # the chat request's own parse refuses it
    modalities, audio = body.get("modalities"), body.get("audio")
    if modalities is None or modalities == ["text"]:
        if audio is not None:
            raise RequestError("'audio' is given but 'modalities' does not ask for audio: send modalities "
                               "[\"text\", \"audio\"] with it, or omit it", param="audio")
        return None
    if (not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities)
            or len(set(modalities)) != len(modalities) or set(modalities) - {"text", "audio"}):
        raise RequestError(f"'modalities' must be [\"text\"] or [\"text\", \"audio\"], got {modalities!r}",
                           param="modalities")
    if "text" not in modalities:
        raise RequestError("'modalities' [\"audio\"]: the answer is text and its speech; send [\"text\", \"audio\"]",
                           param="modalities")
    speech = model.speech
    if speech is None:
        raise RequestError(f"'modalities' = {modalities!r} is not supported: model {model_name!r} has no speech "
                           "output (a talker and a vocoder), so its output is text only; serve a checkpoint "
                           "converted from a full release with its talker (e.g. Qwen3-Omni's), or send [\"text\"]",
                           code="unsupported", param="modalities")
    if not isinstance(audio, dict):
        raise RequestError("'audio' must be an object {\"voice\", \"format\"} when 'modalities' asks for audio",
                           param="audio")
    check_keys(audio, ("voice", "format"), "audio")
    voice, fmt = audio.get("voice"), audio.get("format")
    if isinstance(voice, dict):
        raise RequestError("'audio.voice': custom voices are not supported; send one of the checkpoint's voices "
                           f"{list(speech.voices)}", code="unsupported", param="audio.voice")
    names = {v.lower(): v for v in speech.voices}
    if not isinstance(voice, str) or voice.lower() not in names:
        raise RequestError(f"'audio.voice' {voice!r} is not a voice of model {model_name!r}: its voices are "
                           f"{list(speech.voices)}", param="audio.voice")
    if fmt not in FORMATS:
        known = isinstance(fmt, str) and fmt in OPENAI_FORMATS
        others = "" if known else f" (OpenAI's formats: {list(OPENAI_FORMATS)})"
        raise RequestError(f"'audio.format' {fmt!r} is not supported: this server sends {' or '.join(FORMATS)}"
                           + others,
                           code="unsupported" if known else "invalid_value", param="audio.format")
    if body.get("stream") is True and fmt != "pcm16":
        raise RequestError(f"'audio.format' {fmt!r} cannot be streamed: streamed audio is \"pcm16\" (as OpenAI's API "
                           "streams it)", code="unsupported", param="audio.format")
    return AudioOutput(names[voice.lower()], fmt)


def parse_with_audio(body: bytes, context: ServeContext) -> tuple[ChatRequest, AudioOutput | None]:
    """The chat request of a body and its audio output (blocking: run it in a worker thread). The request is
    checked first (`parse_payload`: the model, then every other field), without `modalities` and `audio`, which are
    read here (`parse_payload` alone refuses them as text-only fields)."""
    payload = json_payload(body)
    if not isinstance(payload, dict):
        return parse_payload(payload, context), None  # refused there, naming the problem
    req = parse_payload({k: v for k, v in payload.items() if k not in ("modalities", "audio")}, context)
    audio = parse_audio_output(payload, context.model, context.options.model_name)
    if audio is not None:
        check_spoken_request(req)
    return req, audio


def check_spoken_request(req: ChatRequest) -> None:
    """Refuses, naming the field, what a spoken answer does not handle yet (see the module's docstring)."""
    for i, (_, parts) in enumerate(req.messages):
        for j, part in enumerate(parts):
            if part.kind != "text":
                raise RequestError(f"'messages[{i}].content[{j}]': audio output takes text-only messages for now "
                                   "(the talker reads the thinker's hidden states at media placeholders, which the "
                                   "session does not keep); send [\"text\"] modalities with media",
                                   code="unsupported", param=f"messages[{i}].content[{j}]")
    if req.n > 1 or req.top_logprobs is not None:
        name = "n" if req.n > 1 else "logprobs"
        raise RequestError(f"'{name}' is not supported with audio output (one spoken answer per request)",
                           code="unsupported", param=name)
    if req.stop:
        raise RequestError("'stop' is not supported with audio output: the speech would not end where the text is "
                           "cut", code="unsupported", param="stop")
    if req.tools is not None and req.tools.active:
        raise RequestError("'tools' are not supported with audio output (send tool_choice \"none\", or no tools)",
                           code="unsupported", param="tools")


def prompt_ids(chunks: Sequence[Any]) -> np.ndarray:
    """The token ids the chunks feed (their valid positions, batch row 0, in order): the talker's prompt."""
    ids = [np.asarray(c.token_ids)[0][np.asarray(c.valid, bool)[0]] for c in chunks]
    return np.concatenate(ids).astype(np.int64) if ids else np.zeros((0,), np.int64)


def _speak(model: OmniModel, prompt: np.ndarray, answer: Sequence[int], voice: str,
           max_speech_tokens: int) -> Iterator[np.ndarray]:
    if not len(answer):  # nothing to say (the answer was only its end-of-turn token)
        return iter(())
    speech = model.speech
    assert speech is not None  # checked when the request was parsed
    return speech.speak_chunks(model, prompt, np.asarray(answer, np.int64), voice=voice,
                               max_new_tokens=max_speech_tokens, first_chunk=FIRST_CHUNK, chunk=CHUNK)


async def speak_pieces(context: ServeContext, audio: AudioOutput, prompt: np.ndarray,
                       answer: Sequence[int]) -> AsyncIterator[np.ndarray]:
    """The answer spoken, int16 PCM chunk by chunk; the talker and each vocoder call run in a worker thread."""
    chunks = await asyncio.to_thread(_speak, context.model, prompt, answer, audio.voice,
                                     context.options.max_speech_tokens)
    done = object()
    while True:
        pcm = await asyncio.to_thread(next, chunks, done)
        if pcm is done:
            return
        yield pcm16(pcm)


async def audio_message(context: ServeContext, audio: AudioOutput, prompt: np.ndarray, answer: Sequence[int],
                        transcript: str, created: int) -> dict:
    """The whole response's `message.audio` object."""
    pieces = [p async for p in speak_pieces(context, audio, prompt, answer)]
    samples = np.concatenate(pieces) if pieces else np.zeros((0,), "<i2")
    speech = context.model.speech
    assert speech is not None
    data = wav_bytes(samples, speech.sample_rate) if audio.format == "wav" else samples.tobytes()
    return {"id": new_audio_id(), "data": base64.b64encode(data).decode("ascii"), "expires_at": created,
            "transcript": transcript}


def new_audio_id() -> str:
    """An id for an audio answer (`audio_...`, as OpenAI names them)."""
    return f"audio_{uuid.uuid4().hex}"
