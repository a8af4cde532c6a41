"""Chat completions' audio output: `modalities: ["text", "audio"]` with `audio: {"voice", "format"}`.

On a checkpoint with speech output (`model.speech`: Qwen3-Omni converted from its full release) the answer is
decoded as text on the engine's ticks and spoken: the talker decodes codec frames over the answer's text and the
vocoder decodes them in chunks as they are ready (`ServeOptions.speech_first_chunk` frames, then `speech_chunk`:
`--speech-first-chunk` / `--speech-chunk`, by default `FIRST_CHUNK` then `CHUNK`). Qwen3-Omni speaks on the
engine's speech pool (`omnijax.serve.speech_engine`: `EngineWorker.speak`, its talker steps and vocoder chunks batched
with every other speaking session's on the engine's ticks, admission counting it; a full pool refuses the request by
name, HTTP 429, before anything is fed), and its talker starts with the answer's first token, reading each later one
as the thinker decodes it (`speech_engine.WrittenSpeech`), so audio comes while the text is still written;
Qwen2.5-Omni speaks the finished answer on its pool (`engine.speech_qwen25`; an engine without a pool: in worker
threads, `SpeechOutput.speak_chunks`). `audio.sampling` draws the speech (`omnijax.serve.speech_sampling`;
Qwen3-Omni only); without it the talker is greedy. Neither computes on the event loop. The
talker's prompt is the request's templated text as fed (every message's rendering and the generation prompt); the
answer spoken is the answer's tokens without the final end-of-turn token; the talker's tokens are capped by
`ServeOptions.max_speech_tokens`.

As OpenAI's API returns it, the message's `content` is null and the text is the audio's `transcript`:
- whole: `choices[0].message.audio = {id, data, expires_at, transcript}`, `data` the base64 of a WAV file (16-bit
  mono PCM at the model's rate, 24 kHz) for `format` "wav", of raw 16-bit little-endian PCM for "pcm16";
- streamed (`format` "pcm16" only, as OpenAI streams audio): `delta.audio = {id, transcript}` per text piece as it is
  decoded and `{id, data}` per vocoder chunk (base64 PCM16) as it is decoded (on Qwen3-Omni between the text pieces,
  the rest after them), then `{expires_at}` last.
The server keeps no audio: `expires_at` is the response's creation time, and an assistant message that refers to an
earlier audio answer (`messages[i].audio`) is refused.

Refused by name (HTTP 400) before anything is fed: audio asked of a checkpoint without speech output
(`modalities`), `audio` missing or given without the audio modality, a voice the checkpoint does not have
(`audio.voice`, naming its voices), a custom voice object, a format other than wav / pcm16 (`audio.format`: aac, mp3,
flac, opus are OpenAI's formats this server does not encode), wav with `stream` (`audio.format`); and what the
spoken path does not handle yet: `stop` strings (the spoken tokens would differ from the cut text), active `tools`,
several choices (`n`) and `logprobs`.

Media: Qwen3-Omni's talker reads the thinker's `hidden_states[accept_hidden_layer]` at the image / audio placeholders
of user turns (`omnijax.Chat` keeps them from its steps). The engine's batched ticks keep no hidden states, so the
server recomputes them: `MediaReplay` replays the request's parts through a side `Session` with the engine's stream
settings, tapping that layer at those units, in a worker thread that starts when the prompt is built and runs beside
the engine's decoding of the answer (the speech waits for it). The rows and the media queued for a replay are
capped at `SPEECH_MEDIA_BYTES` (64 MiB) a conversation, past which the request is refused naming `messages`. Media
outside user turns (before the first, in a system turn) are not read and need no replay. Qwen2.5-Omni's talker
reads every position: its `media_tap` keeps the input rows (tap 0, the encoder's features) of every audio unit and
`speak` reruns the thinker over the conversation with them (the same replay: `tests/serve/test_speech_media_qwen25.py`);
units a talker's positions are not built for (`media_kinds`: an image on Qwen2.5-Omni) make the conversation
unspeakable, refused naming `messages`; a talker without a media tap takes text-only messages (the part named).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import threading
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omnijax.chat import DEFAULT_SPEECH_MEDIA_BYTES
from omnijax.chunks.builders import concat
from omnijax.chunks.chunk import pad_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.media.audio import pcm16, wav_bytes
from omnijax.models.frontend import bucket
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows, media_rows
from omnijax.models.talker_kv import talker_policy
from omnijax.serve.chat_params import RequestError, check_keys, json_payload
from omnijax.serve.chat_request import ChatRequest, parse_payload
from omnijax.serve.context import CHUNK, FIRST_CHUNK  # ServeOptions' defaults, named here too
from omnijax.serve.speech_engine import (
    SpeechOverloaded,
    WrittenSpeech,
    finish_speech,
    pool_full,
    pool_pieces,
    speaks_on_pool,
)
from omnijax.serve.speech_sampling import parse_talker_sampling
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session

if TYPE_CHECKING:
    from omnijax.models.family import OmniModel
    from omnijax.serve.context import ServeContext

__all__ = ["CHUNK", "FIRST_CHUNK", "FORMATS", "AudioOutput", "audio_message", "check_spoken_request",
           "new_audio_id", "parse_audio_output", "parse_with_audio", "prompt_ids", "speak_pieces"]

FORMATS = ("wav", "pcm16")
OPENAI_FORMATS = ("wav", "aac", "mp3", "flac", "opus", "pcm16")


@dataclass(frozen=True)
class AudioOutput:
    """A request's audio output: the checkpoint's voice (as the checkpoint spells it), the format, and the talker's
    sampling (None: greedy)."""

    voice: str
    format: str
    sampling: TalkerSampling | None = None


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
    check_keys(audio, ("voice", "format", "sampling"), "audio")
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
    return AudioOutput(names[voice.lower()], fmt, parse_talker_sampling(audio.get("sampling"), "audio.sampling",
                                                                        speech))


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
        check_spoken_request(req, context.model)
    return req, audio


def check_spoken_request(req: ChatRequest, model: OmniModel | None = None) -> None:
    """Refuses, naming the field, what a spoken answer does not handle yet (see the module's docstring): media
    parts when the checkpoint's talker has no media tap (`model` None: media refused)."""
    tap = getattr(model.speech, "media_tap", None) if model is not None else None
    for i, (_, parts) in enumerate(req.messages):
        for j, part in enumerate(parts):
            if part.kind != "text" and tap is None:
                raise RequestError(f"'messages[{i}].content[{j}]': this checkpoint's talker has no media tap (a "
                                   "way to keep the thinker states it reads at media placeholders), so its audio "
                                   "output takes text-only messages; send [\"text\"] modalities with media",
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


@dataclass
class SpokenPrompt:
    """A chat completion's talker prompt: the ids fed and, when media lie in its user turns, the replay that
    recomputes their thinker rows (started at once in a worker thread, `spoken_prompt`, while the engine decodes the
    answer)."""

    ids: np.ndarray
    replay: MediaReplay | None = None
    rows: asyncio.Future | None = None

    async def media(self) -> tuple[MediaRows, ...]:
        """The kept rows (waits for the replay); raises ValueError naming why the prompt cannot be spoken."""
        if self.replay is None:
            return ()
        if self.rows is None:
            self.rows = asyncio.ensure_future(asyncio.to_thread(self.replay.rows))
        return await self.rows


async def spoken_prompt(context: ServeContext, chunks: Sequence[Any]) -> SpokenPrompt:
    """The talker prompt of a chat completion's chunks (`prompt_ids`); when media lie in its user turns, their rows'
    replay (`MediaReplay`) starts now in a worker thread, beside the engine's decoding of the answer.

    Raises:
        RequestError: the media cannot be spoken about (the rows would pass `SPEECH_MEDIA_BYTES`, or the talker
            reads what the server does not keep), naming `messages`; `SpeechOverloaded` (HTTP 429) when every row
            of the engine's speech pool speaks (`speech_engine.pool_full`), before anything is fed.
    """
    full = pool_full(context)
    if full is not None:
        raise SpeechOverloaded(f"'modalities': {full}")
    ids = prompt_ids(chunks)
    if not any(c.embed_mask is not None and np.asarray(c.embed_mask).any() for c in chunks):
        return SpokenPrompt(ids)  # text only
    replay = MediaReplay.of(context)
    await asyncio.to_thread(replay.fed, chunks)
    if replay.unspeakable is not None:
        raise RequestError(f"'messages': this conversation cannot be spoken: {replay.unspeakable}; send [\"text\"] "
                           "modalities", code="unsupported", param="messages")
    if not replay.needs_replay:
        return SpokenPrompt(ids)  # media outside user turns only: the talker reads no rows
    prompt = SpokenPrompt(ids, replay)
    prompt.rows = asyncio.ensure_future(asyncio.to_thread(replay.rows))
    prompt.rows.add_done_callback(retrieve_exception)  # a failed replay is reported where the rows are awaited
    return prompt


def retrieve_exception(future: asyncio.Future) -> None:
    """A done callback marking a background future's exception as seen (it is raised again where its result is
    read), so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


def _speak(model: OmniModel, prompt: np.ndarray, answer: Sequence[int], voice: str,
           max_speech_tokens: int, media: Sequence[MediaRows] = (), sampling: TalkerSampling | None = None,
           talker_window: int | None = None, first_chunk: int = FIRST_CHUNK,
           chunk: int = CHUNK) -> Iterator[np.ndarray]:
    if not len(answer):  # nothing to say (the answer was only its end-of-turn token)
        return iter(())
    speech = model.speech
    assert speech is not None  # checked when the request was parsed
    more: dict = {"media": tuple(media)} if media else {}  # only a talker with a media tap takes them (checked)
    if sampling is not None:  # only Qwen3-Omni's talker draws (`speech_sampling` refused it on any other)
        more["sampling"] = sampling
    if talker_window is not None:  # `ServeOptions.talker_window`
        more["talker_kv"] = talker_policy(talker_window)
    return speech.speak_chunks(model, prompt, np.asarray(answer, np.int64), voice=voice,
                               max_new_tokens=max_speech_tokens, first_chunk=first_chunk, chunk=chunk, **more)


async def speak_pieces(context: ServeContext, audio: AudioOutput, prompt: np.ndarray | SpokenPrompt,
                       answer: Sequence[int], media: Sequence[MediaRows] = ()) -> AsyncGenerator[np.ndarray, None]:
    """The answer spoken, int16 PCM chunk by chunk. On an engine with a speech pool it is an utterance of the pool
    (`speech_engine.pool_pieces`: batched on the engine's ticks, admission counted; `SpeechOverloaded` when no room
    comes within `queue_timeout_s`); otherwise the talker and each vocoder call run in a worker thread. The replay
    of media rows runs in a worker thread. `prompt`: the ids, or a `SpokenPrompt` (its media rows awaited first)."""
    if isinstance(prompt, SpokenPrompt):
        media = await prompt.media()
        prompt = prompt.ids
    if speaks_on_pool(context):  # an utterance of the engine's speech pool (`speech_engine`)
        if len(answer):
            async for pcm in pool_pieces(context, prompt, answer, audio.voice, media, sampling=audio.sampling):
                yield pcm16(pcm)
        return
    chunks = await asyncio.to_thread(_speak, context.model, prompt, answer, audio.voice,
                                     context.options.max_speech_tokens, media, audio.sampling,
                                     context.options.talker_window, context.options.speech_first_chunk,
                                     context.options.speech_chunk)
    done = object()
    while True:
        pcm = await asyncio.to_thread(next, chunks, done)
        if pcm is done:
            return
        yield pcm16(pcm)


async def audio_message(context: ServeContext, audio: AudioOutput, prompt: np.ndarray | SpokenPrompt,
                        answer: Sequence[int], transcript: str, created: int,
                        early: WrittenSpeech | None = None) -> dict:
    """The whole response's `message.audio` object (`early`: the answer spoken while written, its tokens pushed)."""
    if early is not None:
        pieces = [p async for p in finish_speech(early, answer)]
    else:
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


SPEECH_MEDIA_BYTES = DEFAULT_SPEECH_MEDIA_BYTES  # thinker rows and queued media kept per conversation (64 MiB)


class MediaReplay:
    """The thinker rows a Qwen3-Omni talker reads at the media placeholders of user turns, recomputed off the engine.

    The engine's batched ticks keep no hidden states, so the conversation's parts are queued as the engine is
    handed them (`fed`, `answered`: host work only) and, when a spoken answer needs rows (`rows`, blocking: run it
    in a worker thread), replayed in order through a side `omnijax.Session` with the engine's `StreamConfig` (its
    retention policy, paging, page size; a pool of one session's page-table width), one step per part as the
    engine ran them, the parts of media in user turns with the step's tap of `accept_hidden_layer`
    (`Session.feed(tap=)`, what `omnijax.Chat` keeps); a decoded answer is replayed as a response text unit. Nothing
    is replayed before the first media of a user turn; from then on each replay runs the whole queue, and the side
    session lives as long as the conversation, so a Realtime session's later media continue it. The rows are what
    the engine's step computed when both see the same cache: the same parts through the same policy, which holds
    while the policy evicts nothing before the last media unit (a replayed answer's span kinds and units match the
    decoded one's; float sums may differ in the last bits).

    Memory: the queued parts (their media embeddings) and the kept rows (hidden size x dtype bytes a placeholder)
    are capped at `cap` bytes. Past it, with rows needed (kept, or media of a user turn queued), the conversation
    cannot be spoken (`unspeakable` says why); with none needed yet, the queue is dropped and only media of a later
    user turn makes it unspeakable (`broken`). The side session's pool is one session's pages more.

    Args:
        model: the served model; only a talker with a `media_tap` (Qwen3-Omni) reads rows, any other with media in
            the conversation makes it unspeakable.
        stream: the engine's `StreamConfig`.
        pages: the side session's pool in pages.
        units: the family's unit builder (`Conversation.units`; replayed answers are its response text units).
        cap: the byte cap above.
    """

    def __init__(self, model: OmniModel, stream: StreamConfig, pages: int, units: Any = None,
                 cap: int = SPEECH_MEDIA_BYTES):
        self.model, self.stream, self.pages, self.units, self.cap = model, stream, int(pages), units, int(cap)
        self.tap = getattr(model.speech, "media_tap", None)
        self.omni = getattr(model, "omni", None)  # the family's token ids (placeholders)
        self.ids: list[int] = []  # every id fed, placeholders and answers included: the talker's prompt
        self.queued: list[tuple[Any, tuple | None, int | None, int]] = []  # not yet replayed: (part, `_compact`'s
        # shapes, tap, the index of its first id)
        self.kept: list[MediaRows] = []
        self.unspeakable: str | None = None  # why no answer of this conversation can be spoken
        self.broken: str | None = None  # why media of a later user turn could not be replayed
        self.session: Session | None = None
        self.answer_unit: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, context: ServeContext, units: Any = None) -> MediaReplay:
        """A replay with the served engine's settings and the cap `SPEECH_MEDIA_BYTES` (read now)."""
        config = context.worker.engine.config
        return cls(context.model, config.stream, config.max_pages or config.stream.num_pages, units,
                   cap=SPEECH_MEDIA_BYTES)

    @property
    def needs_replay(self) -> bool:
        """Whether a queued part is media of a user turn (`rows` then replays)."""
        return any(tap is not None for _, _, tap, _ in self.queued)

    def fed(self, parts: Sequence[Any]) -> None:
        """Records parts as the engine is handed them (host work only)."""
        for part in parts:
            valid = np.asarray(part.valid, bool)[0]
            ids = [int(t) for t in np.asarray(part.token_ids)[0][valid]]
            media = part.embed_mask is not None and bool(np.asarray(part.embed_mask)[0][valid].any())
            tap = self.tap(self.ids) if media and self.tap is not None else None
            if int(np.asarray(part.answer_tokens)[0]):
                self.answer_unit = int(np.asarray(part.answer_unit)[0])
            kinds = {k for k, name in (("image", "image_token_id"), ("audio", "audio_token_id"),
                                       ("video", "video_token_id")) if getattr(self.omni, name, -1) in ids}
            if media and self.tap is None:
                self._unspeakable("the conversation holds image or audio input, and this checkpoint's talker has no "
                                  "media tap: the server does not keep the thinker states it would read there")
            elif tap is not None and kinds - set(getattr(self.model.speech, "media_kinds", ("image", "audio"))):
                self._unspeakable(f"the conversation holds {' and '.join(sorted(kinds))} input the talker reads, "
                                  "whose talker positions are not built for this checkpoint")
            elif tap is not None and self.broken is not None:
                self._unspeakable(self.broken)
            self._queue(part, tap)
            self.ids += ids

    def answered(self, tokens: Sequence[int]) -> None:
        """Records a response's tokens as decoded (in the engine's cache, the end-of-turn token too)."""
        tokens = [int(t) for t in tokens]
        if tokens and self.units is not None and self.answer_unit is not None:
            self._queue(self.units.text(tokens, self.answer_unit, SpanKind.RESPONSE), None)
        elif tokens:
            self._lose("a response's tokens could not be replayed (no unit builder)")
        self.ids += tokens

    def restore(self, ids: Sequence[int], unspeakable: str | None) -> None:
        """Continues a resumed conversation of `ids` (a snapshot keeps the ids, not the parts): its rows and parts
        are gone, so media of a user turn among the ids make it unspeakable, and so do later ones (`broken`)."""
        self.ids, self.queued, self.kept, self.session = [int(t) for t in ids], [], [], None
        self.unspeakable, self.broken = unspeakable, None
        why = ("the session was resumed from a snapshot, which keeps the ids fed but not the media a replay of the "
               "talker's thinker rows needs")
        holes = set(getattr(self.omni, "placeholder_ids", ()))
        at = [i for i, t in enumerate(self.ids) if t in holes and (i == 0 or self.ids[i - 1] not in holes)]
        if any(self.tap is None or self.tap(self.ids[:i]) is not None for i in at):
            self._unspeakable(why)
        self._lose(why)

    def _queue(self, part: Any, tap: int | None) -> None:
        if self.unspeakable is not None or self.broken is not None:
            return
        self.queued.append((*_compact(part), tap, len(self.ids)))
        held = sum(r.nbytes for r in self.kept) + sum(_nbytes(p) for p, _, _, _ in self.queued)
        if held > self.cap:
            why = (f"the thinker rows and media kept to replay for the talker ({held} bytes) outgrew the server's "
                   f"cap of {self.cap} bytes (speech_output.SPEECH_MEDIA_BYTES)")
            if self.kept or self.needs_replay:
                self._unspeakable(why)
            else:
                self.queued, self.session = [], None
                self._lose(why)

    def _lose(self, why: str) -> None:
        self.broken = self.broken or why

    def _unspeakable(self, why: str) -> None:
        self.unspeakable = self.unspeakable or why
        self.queued, self.kept, self.session = [], [], None

    def rows(self, prompt_len: int | None = None) -> tuple[MediaRows, ...]:
        """Replays the queue (nothing while no part of it, nor before it, is media of a user turn); returns the rows
        kept whose positions lie before `prompt_len` (None: all). Blocking (device work): run it in a worker thread.

        Raises:
            ValueError: the conversation cannot be spoken (`unspeakable`), naming why.
        """
        with self._lock:
            todo = self.queued if self.session is not None or self.needs_replay else []
            self.queued = self.queued[len(todo):]
            if todo and self.session is None:
                self.session = Session(self.model, self.stream.replace(num_pages=self.pages))
            group: list[tuple[Any, np.ndarray, int, int]] = []  # the tapped parts of one media unit
            for part, shapes, tap, start in todo:
                if self.unspeakable is not None:
                    break
                assert self.session is not None
                part = _expand(part, shapes)
                quiet = dataclasses.replace(part, answer_tokens=np.zeros_like(np.asarray(part.answer_tokens)))
                out = self.session.feed(pad_chunk(quiet, bucket(quiet.length)), tap=tap)
                if group and (tap is None or _unit(part) != _unit(group[-1][0])):
                    self._keep(group)
                    group = []
                if tap is not None:
                    group.append((part, np.asarray(out.tapped)[0, :part.length], tap, start))
            if group and self.unspeakable is None:
                self._keep(group)
            if self.unspeakable is not None:
                raise ValueError(self.unspeakable)
            end = len(self.ids) if prompt_len is None else prompt_len
            return tuple(r for r in self.kept if len(r.positions) and int(np.max(r.positions)) < end)

    def _keep(self, group: list[tuple[Any, np.ndarray, int, int]]) -> None:
        """One media unit's rows from its parts (a unit longer than the engine's chunk comes in several)."""
        rows = np.concatenate([r[np.asarray(p.valid, bool)[0][:r.shape[0]]] for p, r, _, _ in group])
        whole = concat([p for p, _, _, _ in group])
        self.kept.append(media_rows(whole, rows[None], group[0][2], group[0][3], self.omni,
                                    getattr(self.model.speech, "spatial_merge_size", None)))
        held = sum(r.nbytes for r in self.kept) + sum(_nbytes(p) for p, _, _, _ in self.queued)
        if held > self.cap:
            self._unspeakable(f"the thinker rows kept for the talker ({held} bytes with the media queued) outgrew "
                              f"the server's cap of {self.cap} bytes (speech_output.SPEECH_MEDIA_BYTES)")


def _unit(part: Any) -> int:
    return int(np.asarray(part.unit)[0, 0])


def _nbytes(part: Any) -> int:
    """Bytes a queued part holds in arrays (a text part's zero embeddings are dropped while queued: `_compact`)."""
    return sum(int(np.asarray(x).nbytes) for x in (part.embeds, part.deepstack) if x is not None)


def _compact(part: Any) -> tuple[Any, tuple | None]:
    """A part to queue: a part whose embeddings and DeepStack levels are all zero (text) without them, and what
    `_expand` needs to put them back."""
    arrays = [x for x in (part.embeds, part.deepstack) if x is not None]
    if not arrays or any(np.asarray(x).any() for x in arrays):
        return part, None
    shapes = tuple(None if x is None else (np.shape(x), np.asarray(x).dtype) for x in (part.embeds, part.deepstack))
    return dataclasses.replace(part, embeds=None, deepstack=None), shapes


def _expand(part: Any, shapes: tuple | None) -> Any:
    if shapes is None:
        return part
    embeds, deepstack = (None if s is None else np.zeros(*s) for s in shapes)
    return dataclasses.replace(part, embeds=embeds, deepstack=deepstack)
