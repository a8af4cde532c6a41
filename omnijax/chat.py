"""`Chat`: a conversation with a loaded model over a streamed `Session`: text in, text out, media as units.

    model = omnijax.load("/path/to/omni-jax")
    chat = omnijax.Chat(model, omnijax.StreamConfig(policy=OmniPick(), paging="tile_skip", num_pages=96))
    chat.system("You are a helpful assistant.")
    chat.video("clip.mp4")                       # 2 s audiovisual units, each its own unit in the stream
    for delta in chat.ask("What happens in the clip?", max_tokens=64):
        print(delta, end="", flush=True)
    print(omnijax.chat.format_kept(chat.kept()))  # what the bounded cache holds now, per unit and span kind

Text turns are what the checkpoint's own chat template renders. `Chat` keeps the conversation's text messages and
what it has fed of their rendering; each `system` / `user` / `ask` renders the conversation with the new message
(`ask` with the generation prompt) and feeds exactly the part not yet fed, so the text in the cache is the
template's rendering of the whole conversation, the answers included as the template renders assistant turns. A
template that renders earlier turns differently once a message follows (Qwen3's, MiniCPM-o 4.5's: earlier answers
lose their reasoning block) gets the new message as the template renders it at the end of the conversation, the
earlier turns staying as the model saw them; a template whose rendering cannot be followed so is refused at that
call (the cache cannot be rewritten).

Media (`image`, `audio`, `av`, `video`) are fed as units of their own between text turns, laid out as the model's
streaming units (`omnijax.models.frontend`), which is how a live stream reaches the model; they are not part of the
template's text.

Answers are decoded inside the jitted step in blocks of `config.max_answer_tokens` tokens (default
`DEFAULT_ANSWER_BLOCK` when the config has 0); `ask` yields the text of each block as soon as it is decoded, only
whole UTF-8 characters. A later block continues from the logits after the previous block's last token (a chunk with
no token, `StreamState.last_logits`), so a long answer is the same as one decoded in one block. The repetition
penalty of `Sampling` sees the tokens of the current block only.

Spoken answers: `ask(text, speak=True)` (or `speak=SpeakOptions(voice="Chelsie")`) on a checkpoint with speech
output (`model.speech`: Qwen3-Omni converted from its full release) yields the text deltas as above and the answer
spoken, as float32 PCM chunks (`np.ndarray [samples]` in [-1, 1] at `model.speech.sample_rate`, 24 kHz). On
Qwen3-Omni the talker starts while the thinker still writes (`speech_stream.AnswerSpeech`): its step t reads answer
token t + 1, so after each decoded block it runs every step the answer so far allows, and PCM chunks come between
text deltas; the rest runs once the answer ends. It decodes codec frames one by one and the vocoder (Code2Wav, its
streamed decode) turns them into PCM in chunks of `first_chunk` frames, then `chunk`, each yielded as soon as its
frames are ready (the first after `first_chunk` talker steps). Qwen2.5-Omni's talker reads every answer token's last
layer: by default it speaks once the text is done (one thinker forward over prompt and answer, equal to
transformers); with `SpeakOptions(early_start=True)` the step returns each answer token's row as it decodes it and
the talker starts after the first block (`omnijax.models.qwen2_5_omni.speech_stream`). The talker's prompt is
what the session was fed (every turn's template rendering, earlier answers included, and the media units' ids;
the talker reads the user turns and this answer); the answer spoken is the decoded tokens without a final
end-of-turn token. What was spoken last is `Chat.last_spoken`.

Media and speech (Qwen3-Omni): a media unit lies in the turn whose `<|im_start|>` precedes it; the talker reads
`hidden_states[accept_hidden_layer]` at the placeholders of media in user turns (`chat.user(...)` then
`chat.image(...)`), so the step feeding such a unit taps that layer and the chat keeps those rows (`MediaRows`:
hidden size x dtype bytes a placeholder, 4 KiB for the 30B release in bfloat16) up to `speech_media_bytes`; cache
retention does not touch them. Media after a system turn or an answer are not read and keep nothing. Refused by name
at a spoken `ask`: kept rows past `speech_media_bytes` (then all dropped: one missing unit makes the conversation
unspeakable), an audiovisual unit in a user turn. Qwen2.5-Omni's talker reads every position's last layer: the chat
keeps each audio, image and audiovisual unit's input rows (tap 0, the encoders' features, an image's with its patch
grid, an audiovisual unit's with the positions it was fed at; in any turn) and `speak` recomputes the thinker over the
conversation with them.

A call refused for bad input (an unknown role, media the checkpoint has no encoder for, a bad video file, a
template that cannot be followed) raises before anything is fed: the session is unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, overload

import numpy as np
import numpy.typing as npt

from omnijax.chat_records import KeptRow, StepRecord, UnitRecord, clock, format_kept, kept_by_kind
from omnijax.chat_speech import DEFAULT_SPEECH_MEDIA_BYTES, MEDIA_KINDS, SpeakOptions, SpokenAnswer, check_speak
from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.conversation import ChatTemplateError, Conversation, template_delta
from omnijax.decoding import DecodingStrategy, answer_stop_ids, sampling_keys, seed_of
from omnijax.media.audio import resample
from omnijax.media.image import read_image
from omnijax.models.family import OmniModel
from omnijax.models.speech import MediaRows, media_rows
from omnijax.models.tokenizer import Tokenizer
from omnijax.plot import SessionTrace
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session, bind_config

DEFAULT_ANSWER_BLOCK = 16


class Chat:
    """A conversation over one streamed session (batch 1) of an `omnijax.Model` or a MiniCPM-o model.

    Args:
        model: a loaded model with a tokenizer (`model.tokenizer`), or any model with `tokenizer=` given.
        config: the session's settings (`omnijax.StreamConfig`): retention policy, paging, impl, pool size; its
            `max_answer_tokens` is the answer block size (0: `DEFAULT_ANSWER_BLOCK`); `decoding` the default
            strategy of `ask`.
        tokenizer: overrides `model.tokenizer`.
        video_kwargs: Qwen2.5-Omni frame preprocessing settings for `av` / `video` (`min_pixels`, `max_pixels`;
            see `omnijax.models.qwen2_5_omni.frontend.audiovisual_chunk`).
        template_variables: chat-template variables of every text turn, over the family's defaults (MiniCPM-o 4.5
            renders its prompts without thinking, `enable_thinking=False`, as its release does; pass
            `{"enable_thinking": True}` for thinking).
        speech_media_bytes: the most bytes of thinker rows kept for the talker at media placeholders of user turns
            (see the module's docstring); beyond it spoken answers are refused.
        quick_start: the session's first steps run without the retention policy's trim, in a program compiled
            quickly (LLVM optimisation off), while the full step compiles in another thread
            (`Session(quick_start=True)`: the same answers, logits to float32 rounding), started once the first
            answer block is out. For a new process with an empty compilation cache: SmolLM2's first token ~2x
            sooner (`bench/peers/RESULTS.md`, first_token). On in `omnijax chat`; off by default here: two programs
            compiled instead of one where the full step is not kept yet, and the process exits once the worker's
            compile has ended (`omnijax.streaming.quick_start` gives the measured reasons). Refused with recall.
    """

    def __init__(self, model: OmniModel, config: StreamConfig | None = None, *, tokenizer: Tokenizer | None = None,
                 video_kwargs: Mapping[str, Any] | None = None, template_variables: Mapping[str, Any] | None = None,
                 speech_media_bytes: int = DEFAULT_SPEECH_MEDIA_BYTES, quick_start: bool = False):
        if isinstance(speech_media_bytes, bool) or not isinstance(speech_media_bytes, int) or speech_media_bytes < 0:
            raise ValueError(f"speech_media_bytes must be an int >= 0, got {speech_media_bytes!r}")
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        if self.tokenizer is None:
            raise ValueError("Chat needs a tokenizer: this checkpoint has no tokenizer files (copy tokenizer.json "
                             "and tokenizer_config.json of the release into it) or pass tokenizer=; without one, "
                             "feed token ids with omnijax.Session")
        config = StreamConfig() if config is None else config
        if config.max_answer_tokens == 0:
            config = config.replace(max_answer_tokens=DEFAULT_ANSWER_BLOCK)
        self.model, self.video_kwargs = model, dict(video_kwargs or {})
        # messages -> templated deltas -> chunks; checks the template variables before anything is built
        self.conversation = Conversation(model, self.tokenizer, template_variables=template_variables)
        self.config = bind_config(model, config, allow_recall=True)  # recall: the session holds it over each answer
        self.units_builder = self.conversation.units
        self.session = Session(model, self.config, quick_start=quick_start)
        self.units: list[UnitRecord] = []
        self.steps: list[StepRecord] = []
        self._pending = None  # the iterator of an answer being streamed
        self._eos = tuple(model.config.eos_token_ids)
        self.text_ids: list[int] = []  # the thinker ids of every text chunk fed and every answer, in order
        self.last_spoken: SpokenAnswer | None = None
        # what the talker reads: the ids of everything fed (text, media units, answers), the kept media rows
        self.speech_media_bytes = speech_media_bytes
        self._speech_ids: list[int] = []
        self._media_rows: list[MediaRows] = []
        self._unspeakable: str | None = None

    @property
    def messages(self) -> list[dict]:
        """The conversation's messages so far (system, user and assistant; media are units of their own)."""
        return self.conversation.messages

    # ------------------------------------------------------------------------------------------------ text turns
    def system(self, text: str) -> None:
        """Adds the system message (it must come first)."""
        if self.messages:
            raise ChatTemplateError("the system message comes first; this conversation already has "
                                    f"{len(self.messages)} message(s)")
        self._turn("system", text)

    def user(self, text: str) -> None:
        """Adds a user message without asking for an answer."""
        self._turn("user", text)

    def add(self, message: dict) -> None:
        """Adds a message `{"role": ..., "content": ...}` (system, user or assistant); an assistant message is fed
        as the template renders it, as though the model had answered so."""
        Conversation.check_message(message)
        self._turn(message["role"], message["content"])

    @overload
    def ask(self, text: str, *, max_tokens: int = 128, decoding: DecodingStrategy | None = None,
            speak: Literal[False] = False) -> Iterator[str]: ...

    @overload
    def ask(self, text: str, *, max_tokens: int = 128, decoding: DecodingStrategy | None = None,
            speak: bool | SpeakOptions) -> Iterator[str | np.ndarray]: ...

    def ask(self, text: str, *, max_tokens: int = 128, decoding: DecodingStrategy | None = None,
            speak: bool | SpeakOptions = False) -> Iterator[str] | Iterator[str | np.ndarray]:
        """Adds a user message and streams the answer's text (and, with `speak`, the answer spoken).

        Everything is checked before this returns; the answer is decoded as the iterator is consumed, and stays in
        the context as an assistant turn (a partly consumed answer stays as far as it was decoded).

        Args:
            text: the user's message.
            max_tokens: most tokens of the answer (its end-of-turn token included).
            decoding: a strategy for this answer (`omnijax.decoding.Greedy()`, `Sampling(...)`); default the
                config's. A strategy with a seed draws from keys seeded anew by it, so an answer reproduces.
            speak: True (default `SpeakOptions`) or `SpeakOptions`: after the text, yield the answer spoken as
                float32 PCM chunks at `model.speech.sample_rate` (see the module's docstring).

        Returns:
            An iterator of text deltas (`str`, whole UTF-8 characters), then with `speak` the PCM chunks
            (`np.ndarray`, float32 `[samples]`).

        Raises:
            ValueError: a bad argument; with `speak`, a checkpoint without speech output, a voice it does not have,
                or a conversation holding media units (each before anything is fed).
        """
        self._idle()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        options = self.check_speak(speak)
        config = self.config if decoding is None else self.config.replace(decoding=decoding)  # validates it
        prepared = self.conversation.prepare_ask(text, min(config.max_answer_tokens, max_tokens))
        self._pending = self._answer(prepared, config, max_tokens, reseed=decoding is not None, speak=options)
        return self._pending

    def check_speak(self, speak: bool | SpeakOptions) -> SpeakOptions | None:
        """The options `ask(speak=speak)` would speak with (None: not spoken); ValueError naming the problem when
        this chat cannot speak them now (no speech output, an unknown voice, media units in the conversation)."""
        return check_speak(self.model, speak, (u.kind for u in self.units), self._unspeakable)

    def _answer(self, prepared, config, max_tokens, reseed, speak=None):
        units, block = self.units_builder, config.max_answer_tokens
        stop = tuple(answer_stop_ids(config.decoding, self._eos))
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        (chunk,), answer_unit = prepared.prompt.parts, prepared.prompt.answer_unit
        generated: list[int] = []
        try:
            if reseed:
                self.session.state = dataclasses.replace(self.session.state,
                                                         key=sampling_keys(seed_of(config.decoding), 1))
            self._record_unit(prepared.unit, "user", text_label(prepared.message["content"]), chunk)
            self.conversation.record(prepared)
            self.text_ids += chunk_ids(chunk)
            self._speech_ids += chunk_ids(chunk)
            self.session.hold_recall()  # with StreamConfig(recall=...): the question's recall lasts the whole answer
            # Qwen2.5-Omni's early start reads each answer token's row as the step computed it
            rows = speak is not None and speak.early_start and hasattr(self.model.speech, "tapped_answer_stream")
            out = self._feed(chunk, config, "user", tap_answer=rows)
            prompt_ids = tuple(self._speech_ids)
            early = None if speak is None else self._answer_speech(prompt_ids, stop, speak)
            while True:
                tokens = [int(t) for t in np.asarray(out.tokens)[0] if t >= 0]
                more = (np.asarray(out.answer_rows)[0][:len(tokens)],) if rows else ()
                generated += tokens
                delta = decoder.push(tokens)
                if delta:
                    yield delta
                if not tokens or tokens[-1] in stop or len(generated) >= max_tokens:
                    break
                if early is not None:  # the talker's steps this much of the answer allows, then the next block
                    yield from early.push(tokens, *more)
                out = self._feed(units.continuation(answer_unit, min(block, max_tokens - len(generated))), config,
                                 "answer", tap_answer=rows)
            tail = decoder.flush()
            if tail:
                yield tail
            if speak is not None:
                yield from self._spoken(prompt_ids, generated, stop, speak, early, *more)
        finally:
            self.session.release_recall()
            if generated:
                self.text_ids += generated
                self._speech_ids += generated
                content = self.conversation.answered(generated, stop)
                self.units.append(UnitRecord(answer_unit, "answer", text_label(content),
                                             {int(SpanKind.RESPONSE): len(generated)}))

    def _answer_speech(self, prompt_ids: tuple[int, ...], stop: tuple[int, ...], options: SpeakOptions):
        """The talker that speaks while the answer is written (None where the speech output has none, or
        Qwen2.5-Omni's without `options.early_start`)."""
        opened = getattr(self.model.speech, "answer_stream", None)
        if opened is None and options.early_start:
            opened = getattr(self.model.speech, "tapped_answer_stream", None)
        if opened is None:
            return None
        media = tuple(self._media_rows)
        return opened(self.model, np.asarray(prompt_ids), voice=options.voice,
                      max_new_tokens=options.max_speech_tokens, first_chunk=options.first_chunk,
                      chunk=options.chunk, stop=stop, sampling=options.sampling,
                      **({"media": media} if media else {}), **_bounded(options))

    def _spoken(self, prompt_ids: tuple[int, ...], generated: list[int], stop: tuple[int, ...],
                options: SpeakOptions, early=None, *rows) -> Iterator[np.ndarray]:
        """The answer `generated` (without a final stop token) spoken: PCM chunks as the vocoder decodes them (the
        rest of `early`'s, when the talker ran while the answer was written; `rows`: the last block's answer rows,
        which a talker reading the step's rows takes)."""
        answer = tuple(generated[:-1] if generated and generated[-1] in stop else generated)
        samples = 0
        media = tuple(self._media_rows)
        if early is not None:
            yield from early.finish(generated[len(early.generated):], *rows)
            samples = early.samples
        elif answer:
            speech = self.model.speech
            assert speech is not None  # checked at ask()
            more = {"media": media} if media else {}  # only a talker with a media tap takes them (checked at ask)
            more.update(_bounded(options))
            for pcm in speech.speak_chunks(self.model, np.asarray(prompt_ids), np.asarray(answer),
                                           voice=options.voice, max_new_tokens=options.max_speech_tokens,
                                           first_chunk=options.first_chunk, chunk=options.chunk, **more):
                samples += int(pcm.shape[0])
                yield pcm
        self.last_spoken = SpokenAnswer(prompt_ids, answer, options.voice, samples, media)

    # ------------------------------------------------------------------------------------------------ media units
    def image(self, image: np.ndarray | str | Path) -> None:
        """Feeds one image (`[H, W, 3]` uint8 array, or a path PIL can read) as a unit."""
        self._idle()
        if isinstance(image, (str, Path)):
            image = read_image(image)
        self._media("image", "image", lambda: self.conversation.image(image))

    def audio(self, pcm: npt.ArrayLike, sample_rate: int = 16_000) -> None:
        """Feeds one audio clip (`[samples]` float mono at `sample_rate`, resampled to 16 kHz) as a unit."""
        self._idle()
        pcm = resample(np.asarray(pcm, np.float32), sample_rate)
        self._media("audio", f"audio {pcm.shape[0] / 16_000:.1f} s",
                    lambda: self.conversation.audio(pcm, 16_000))

    def av(self, frames: np.ndarray, pcm: np.ndarray, *, label: str | None = None) -> None:
        """Feeds one audiovisual unit: `frames [n, H, W, 3]` sampled at the family's fps and the 16 kHz mono PCM of
        the same stretch of time (Qwen2.5-Omni: 2 s at 2 fps; MiniCPM-o: 1 s with one frame); `label` names it in
        `kept()`."""
        self._idle()
        self._media("av", label or f"av {np.shape(pcm)[0] / 16_000:.1f} s",
                    lambda: self.conversation.av(frames, pcm, **self.video_kwargs))

    def video(self, path: str | Path, *, start: float = 0.0, end: float | None = None,
              progress: Callable[[int, int], object] | None = None, need_audio: bool = True) -> int:
        """Feeds a video file (PyAV) as audiovisual units, from `start` to `end` seconds; returns the units fed.

        `progress(done, total)` is called after each unit. The file is opened and checked before the first unit: a
        file without an audio track is refused unless `need_audio=False` (its units then carry silence).
        """
        self._idle()
        units = self.units_builder
        source = units.open_video(path, need_audio=need_audio)
        first = int(start // units.unit_seconds)
        total = source.num_units if end is None else min(source.num_units, int(np.ceil(end / units.unit_seconds)))
        if first >= total:
            raise ValueError(f"{path}: nothing to feed between {start:g} s and "
                             f"{'the end' if end is None else f'{end:g} s'} (the video has {source.num_units} units "
                             f"of {units.unit_seconds:g} s)")
        fed = 0
        for index, (frames, pcm) in enumerate(source.units()):
            if index < first:
                continue
            if index >= total:
                break
            at = index * units.unit_seconds
            self.av(frames, pcm, label=f"{Path(path).name} {clock(at)}-{clock(at + units.unit_seconds)}")
            fed += 1
            if progress is not None:
                progress(fed, total - first)
        return fed

    # ------------------------------------------------------------------------------------------------ inspection
    def kept(self) -> list[KeptRow]:
        """What the cache holds now: one row per (unit, span kind) fed, with the tokens fed and kept."""
        kv = self.session.state.kv
        valid = np.asarray(kv.valid).reshape(-1)
        unit = np.asarray(kv.unit).reshape(-1)[valid]
        span = np.asarray(kv.span).reshape(-1)[valid]
        kept = {}
        for u, s in zip(unit.tolist(), span.tolist()):
            kept[(u, s)] = kept.get((u, s), 0) + 1
        rows = []
        for record in self.units:
            for s, count in sorted(record.fed.items()):
                rows.append(KeptRow(record.unit, record.kind, record.label, SpanKind(s).name.lower(), count,
                                    kept.get((record.unit, int(s)), 0)))
        return rows

    def trace(self) -> SessionTrace:
        """The session's steps as an `omnijax.plot.SessionTrace` (for `omnijax.plot.session`)."""
        steps = self.steps
        return SessionTrace(retained=np.asarray([s.retained for s in steps]),
                            physical_span=np.asarray([s.physical_span for s in steps]),
                            active_pages=np.asarray([s.active_pages for s in steps]),
                            latency_ms=np.asarray([s.latency_ms for s in steps], np.float64),
                            labels=tuple(s.label for s in steps), page_size=self.config.page_size)

    # ------------------------------------------------------------------------------------------------ internals
    def _idle(self) -> None:
        if self._pending is not None and inspect.getgeneratorstate(self._pending) != inspect.GEN_CLOSED:
            raise RuntimeError("an answer is still being streamed: consume or close the iterator ask() returned "
                               "before adding to the conversation")

    def _turn(self, role: str, text: str) -> None:
        self._idle()
        unit = self.conversation.next_unit
        (chunk,) = self.conversation.message(role, text)  # checks and builds before anything is recorded
        self._record_unit(unit, role, text_label(text), chunk)
        self.text_ids += chunk_ids(chunk)
        self._speech_ids += chunk_ids(chunk)
        self._feed(chunk, self.config, role)

    def _media(self, kind: str, label: str, build) -> None:
        unit = self.conversation.next_unit
        (chunk,) = build()  # raises (bad input, missing encoder) before anything is recorded or fed
        self._record_unit(unit, kind, label, chunk)
        media_tap = getattr(self.model.speech, "media_tap", None)
        tap = None if media_tap is None or self._unspeakable is not None else media_tap(self._speech_ids)
        if tap is not None and kind not in getattr(self.model.speech, "media_kinds", ("image", "audio")):
            what = "an audiovisual unit in a user turn" if kind == "av" else f"an {kind} the talker reads"
            self._unspeakable = (f"unit {unit} ({label}) is {what}: the talker's positions for it are not built "
                                 "(the Qwen3-Omni reference does not pass use_audio_in_video to its talker)")
            tap = None
        out = self._feed(chunk, self.config, kind, tap=tap)
        if tap is not None:
            self._keep_media_rows(chunk, out.tapped, tap, unit, label)
        self._speech_ids += chunk_ids(chunk)

    def _keep_media_rows(self, chunk: Chunk, tapped, tap: int, unit: int, label: str) -> None:
        """Keeps the tapped rows at a media unit's placeholders for the talker, within `speech_media_bytes`."""
        kept = media_rows(chunk, tapped, tap, len(self._speech_ids), self.model.omni,  # type: ignore[attr-defined]
                          getattr(self.model.speech, "spatial_merge_size", None))
        total = kept.nbytes + sum(r.nbytes for r in self._media_rows)
        if total > self.speech_media_bytes:
            self._media_rows = []
            self._unspeakable = (f"the talker's thinker rows at media placeholders of user turns outgrew "
                                 f"speech_media_bytes={self.speech_media_bytes} at unit {unit} ({label}: {total} "
                                 "bytes); they were dropped, so this conversation can no longer be spoken (give "
                                 "Chat a larger speech_media_bytes)")
            return
        self._media_rows.append(kept)

    def _record_unit(self, unit: int, kind: str, label: str, chunk) -> None:
        span = np.asarray(chunk.span)[np.asarray(chunk.valid, bool)]
        kinds, counts = np.unique(span, return_counts=True)
        self.units.append(UnitRecord(unit, kind, label, {int(k): int(c) for k, c in zip(kinds, counts)}))

    def _feed(self, chunk, config: StreamConfig, label: str, tap: int | None = None, tap_answer: bool = False):
        started = time.perf_counter()
        out = self.session.feed(self.units_builder.pad(chunk), decoding=config.decoding, tap=tap,
                                **({"tap_answer": True} if tap_answer else {}))
        layout = out.stats.layout
        retained = int(np.asarray(layout.retained_cells)[0])  # waits for the step
        self.steps.append(StepRecord(label, retained, int(np.asarray(layout.physical_span)[0]),
                                     int(np.asarray(layout.active_pages)[0]),
                                     (time.perf_counter() - started) * 1e3))
        if bool(np.asarray(layout.exhausted)[0]):
            warnings.warn(f"the chat's KV pool ran out: {int(np.asarray(layout.dropped)[0])} token(s) were not "
                          f"cached; give a larger num_pages (now {self.session.state.kv.num_pages}) or a bounded "
                          f"policy", RuntimeWarning, stacklevel=3)
        return out


def _bounded(options: SpeakOptions) -> dict:
    """The talker KV keyword of `options` (none when unbounded, the speech output's own default)."""
    return {} if options.talker_kv is None else {"talker_kv": options.talker_kv}


def chunk_ids(chunk: Chunk) -> list[int]:
    """The token ids of a text chunk's valid positions (batch row 0), in order."""
    return [int(t) for t in np.asarray(chunk.token_ids)[0][np.asarray(chunk.valid, bool)[0]]]


def text_label(text: str, width: int = 32) -> str:
    """A one-line label of a message: its first `width` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[:width - 1] + "…"


__all__ = ["Chat", "ChatTemplateError", "DEFAULT_ANSWER_BLOCK", "DEFAULT_SPEECH_MEDIA_BYTES", "KeptRow",
           "MEDIA_KINDS", "SpeakOptions", "SpokenAnswer", "StepRecord", "UnitRecord", "check_speak", "chunk_ids",
           "clock", "format_kept", "kept_by_kind", "template_delta", "text_label"]
