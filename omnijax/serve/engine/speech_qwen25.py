"""Qwen2.5-Omni speech on the engine's ticks: the talkers of several sessions decode in one batched step per tick
(`speech_qwen25_steps`), Token2Wav streams each utterance's codes, and admission counts what speaking holds (issue 39
item 4). The
Qwen3-Omni pool is `omnijax.serve.engine.speech.SpeechPool`; `speech_pool` builds the one a model's speech output
takes, both with the same interface (`open`, `tick`, `close`, `has_work`, `sessions`, `capacity`, ...).

A `Qwen25SpeechPool` owns its own paged KV pool, separate from the thinker's: each speaking session is a row of one
batched talker cache (`talker_forward.talker_chunk` over the rows: only active rows write). The batch is a bucket
(`SpeechConfig.rows`), the smallest that holds the sessions speaking; rows are compacted when sessions end.

An utterance's talker input (`omnijax.models.qwen2_5_omni.speech.talker_input`: the thinker rerun over prompt and
answer, full attention, the media rows at their placeholders) is built by `prepare`, which the server runs in a worker
thread before admission, so the engine's thread only prefills and steps the talker. The talker reads the thinker's
final-normed last-layer row of every answer token. By default the answer is spoken once it is whole (those rows
recomputed by `prepare`). With `SpeechConfig(early_start=True)` an answer is spoken while the thinker writes it: the
engine's decode programs return each answer token's row as they computed it (`FrameOutput.answer_rows`), `prepare(...,
writing=True)` runs the thinker over the prompt alone, `open(writing=True)` admits the utterance and `extend(ids,
rows=..., end=...)` hands it each tick's tokens and rows (`speech_stream.answer_talker_rows`, what
`speech_stream.AnswerSpeech` reads for `Chat`). Its prefill waits for the first answer token's row (it ends the
prefill), and its talker step k for answer row k + 1 (or the answer's end: then `text_eos`, then `text_pad`): a row
that has read every answer row so far waits, inactive in the batched step, as Qwen3-Omni's pool does.

Per `tick()`:
1. the utterances admitted since the last tick are prefilled together (their talker prompts, left-aligned and padded
   to a power-of-two length >= 16, in one call over the batch; the other rows write nothing) and pick their first
   token;
2. `SpeechConfig.steps_per_tick` batched talker steps at most, each over the rows still decoding: the codec
   embedding of the row's last token plus its next text row (the answer's rows, then `text_eos`, then `text_pad`),
   then the greedy pick of `talker_forward.generate_greedy` (the repetition penalty over the row's talker input ids
   and tokens, the codec bos suppressed); a row ends at a stop id (`TalkerConfig.stop_ids`) or at its
   `max_new_tokens`;
3. Token2Wav streamed per utterance (`token2wav_stream.Token2WavStream`, the stream `Qwen25Speech.speak_chunks`
   runs for `Chat`, with `first_chunk` / `chunk` codec tokens rounded up to DiT blocks and the speech output's
   look-ahead): a talker token is pushed as a code once the next one shows it was not the last (the reference drops
   the last), and the PCM chunks the push completes are sent; once the talker ended the stream's rest is sent, the
   last chunk final. So audio comes while the talker still decodes. A chunk's `codes` are those pushed since the
   previous chunk (a push may complete no PCM), so an utterance's chunks name every code once, in order. Chunks
   past their playback deadline (the first PCM's time plus the seconds sent) are sent all the same and counted late
   (`SpeechChunk.late_s`, `stats["late_chunks"]`).

Admission reserves each utterance's talker pages up front (its prompt plus `max_new_tokens`): `open` refuses
(`Overloaded`, naming the pages or rows) what the pool cannot hold, and the engine's tick latency, which the AIMD
controller reads, includes the talker steps and Token2Wav calls. Each session's tokens and PCM equal
`speech.speak_streamed` of the same answer with the same streaming (`Chat`'s; greedy talker, seed 0): the
batched step computes every row as the single-sequence step does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from omnijax.models.qwen2_5_omni import speech as speech_lib
from omnijax.models.qwen2_5_omni.speech_stream import answer_talker_rows
from omnijax.models.qwen2_5_omni.talker import TalkerConfig
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStream, Token2WavStreaming
from omnijax.models.qwen2_5_omni.voices import Voice
from omnijax.models.speech import MediaRows, token_ids
from omnijax.serve.engine import speech_qwen25_steps as talker_steps
from omnijax.serve.engine import speech_steps as steps
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.rows import compact_rows
from omnijax.serve.engine.speech import SpeechPool
from omnijax.serve.engine.speech_config import SpeechChunk, SpeechConfig
from omnijax.serve.engine.speech_pages import TalkerPages, given_ids

__all__ = ["AnyPool", "PreparedSpeech", "Qwen25SpeechPool", "REPETITION_PENALTY", "speech_pool"]

REPETITION_PENALTY = 1.05  # `speak`'s (transformers passes it to the talker even when greedy)


def speech_pool(model: Any, config: SpeechConfig) -> AnyPool:
    """The engine's speech pool for `model`'s speech output: Qwen3-Omni's (`SpeechPool`) or Qwen2.5-Omni's.

    Raises:
        SpeechUnavailableError: the model has no speech output the engine batches (Qwen3-Omni's error type).
    """
    if isinstance(getattr(model, "speech", None), speech_lib.Qwen25Speech):
        return Qwen25SpeechPool(model, config)
    return SpeechPool(model, config)


@dataclasses.dataclass(frozen=True)
class PreparedSpeech:
    """An utterance's checked talker input (`Qwen25SpeechPool.prepare`), ready for `open`. `writing`: an answer
    still being written (no answer ids; the prefill's last row, the first answer token's, a stand-in until `extend`
    gives it)."""

    prompt_ids: np.ndarray
    answer_ids: np.ndarray
    voice: Voice
    media: tuple[MediaRows, ...]
    talker: speech_lib.TalkerInput
    writing: bool = False


@dataclasses.dataclass
class _Utterance:
    rows: np.ndarray  # [T, Dt] talker prefill rows (an open answer's last one set by its first token)
    positions: np.ndarray  # [3, T]
    trailing: np.ndarray  # [N, Dt] answer rows 1 .. read by decoding steps 0 .. N-1 (an open answer's grow)
    eos_row: np.ndarray  # [Dt] text_eos: the step after the answer's rows
    pad_row: np.ndarray  # [Dt] text_pad: every later step
    seen: np.ndarray  # [V] bool: the talker's input ids so far (the repetition penalty's)
    voice: Voice
    max_new_tokens: int
    pages: int
    opened_s: float
    start: int  # position of the first decoding step
    stream: Token2WavStream  # its Token2Wav
    ended: bool = True  # the answer is whole (an open answer: once extend(end=True))
    started: bool = True  # the prefill's rows are known (an open answer: once its first token came)
    prefilled: bool = False
    done: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    pushed: int = 0  # codes handed to the stream
    reported: int = 0  # codes named by a sent chunk (`SpeechChunk.codes`; a push may complete no PCM)
    samples: int = 0  # PCM samples sent
    first_s: float | None = None  # when the first PCM was sent


class Qwen25SpeechPool(TalkerPages):
    """The speaking sessions of an engine serving Qwen2.5-Omni (see the module docstring).

    Args:
        model: a loaded Qwen2.5-Omni checkpoint with its speech output (`model.speech`).
        config: `SpeechConfig` (`first_chunk` / `chunk`: the stream's chunks in codec tokens, rounded up to DiT
            blocks; `vocoder_*` and `slack_s` are not read: each utterance's stream runs what its codes complete).
        clock: seconds, monotonic.

    Raises:
        SpeechUnavailableError: the model has no Qwen2.5-Omni speech output.
    """

    @property
    def reads_rows(self) -> bool:
        """Whether the engine's decode programs must return answer rows (`SpeechConfig.early_start`)."""
        return self.config.early_start

    writes_early = reads_rows  # an answer may be opened while it is written (with its rows)

    def __init__(self, model: Any, config: SpeechConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter):
        speech = getattr(model, "speech", None)
        if not isinstance(speech, speech_lib.Qwen25Speech):
            raise speech_lib.SpeechUnavailableError(
                f"this pool speaks with Qwen2.5-Omni's talker and Token2Wav; "
                f"{getattr(model, 'source', None) or 'this model'} has "
                f"{'no speech output' if speech is None else type(speech).__name__}")
        self.model, self.speech, self.config, self.clock = model, speech, config or SpeechConfig(), clock
        self.talker: TalkerConfig = speech.talker.config
        c = self.config
        self.max_pages = c.num_pages if c.max_pages is None else c.max_pages
        self.kv = self._empty(c.rows[0])
        vocab = self.talker.decoder.vocab_size
        banned = np.zeros((vocab,), bool)
        banned[self.talker.codec_bos_id] = True
        self._banned = jnp.asarray(banned)
        self._penalty = jnp.float32(REPETITION_PENALTY)
        look = speech.streaming  # the speech output's look-ahead (what `speak_chunks` streams with)
        self.streaming = Token2WavStreaming.for_tokens(speech.token2wav.config.dit, c.first_chunk, c.chunk,
                                                       right_blocks=look.right_blocks,
                                                       vocoder_right=look.vocoder_right)
        self._utterances: dict[str, _Utterance] = {}
        self._slots: dict[str, int] = {}
        self.reserved = 0
        self.stats = {"opened": 0, "refused": 0, "steps": 0, "frames": 0, "chunks": 0, "late_chunks": 0,
                      "late_s": 0.0, "talker_s": 0.0, "vocoder_s": 0.0, "deferred": 0, "vocoder_calls": 0,
                      "vocoder_rows": 0}

    # ------------------------------------------------------------------------------------------------ sessions
    @property
    def has_work(self) -> bool:
        """Whether a tick would do something: an utterance to prefill (its first answer row known) or whose rows
        allow a talker step, codes to vocode, or an ended one (not: every utterance waits for its answer's rows)."""
        return any((u.started or u.done) if not u.prefilled else
                   (u.done or self._steps(u) or u.pushed < len(u.tokens) - 1)
                   for u in list(self._utterances.values()))  # a copy: the worker reads it beside the engine thread

    @staticmethod
    def _steps(u: _Utterance) -> bool:
        """Whether the talker may step now: not ended, and its next text row known (or the answer whole)."""
        return not u.done and (u.ended or len(u.tokens) - 1 < u.trailing.shape[0])

    def prepare(self, prompt_ids: Any, answer_ids: Any, *, voice: str, media: Sequence[MediaRows] = (),
                writing: bool = False) -> PreparedSpeech:
        """Checks an utterance and builds its talker input (`speech.talker_input`: one thinker forward over prompt
        and answer). Pure and thread-safe: the server runs it in a worker thread, off the engine's. `writing`: an
        answer the thinker is still writing (`SpeechConfig.early_start`): `answer_ids` empty, the forward over the
        prompt alone (the answer's rows come with `extend`).

        Raises:
            UnknownVoiceError: a voice the checkpoint lacks (naming its voices).
            ValueError: what `speak` refuses (ids, an empty prompt or answer, video placeholders, media rows);
                `writing` without `SpeechConfig.early_start` or with answer ids.
        """
        vocab = self.model.config.vocab_size
        prompt, answer = token_ids("prompt_ids", prompt_ids, vocab), token_ids("answer_ids", given_ids(answer_ids),
                                                                               vocab)
        if writing:
            self._check_writing()
            if answer.size:
                raise ValueError("prepare(writing=True) takes the prompt alone (answer_ids empty): the answer's "
                                 "tokens and rows come with open / extend")
        elif answer.size and answer[-1] == self.speech.im_end_token_id:
            answer = answer[:-1]
        if not prompt.size or not (answer.size or writing):
            raise ValueError("answer_ids holds no text to speak (empty, or only <|im_end|>)" if prompt.size else
                             "prompt_ids is empty")
        found = self.speech.voice(voice)
        media = tuple(media)
        if not writing:
            return PreparedSpeech(prompt, answer, found, media,
                                  speech_lib.talker_input(self.model, prompt, answer, found, media))
        # the prompt's rows from one forward over it (as `AnswerSpeech`); the first answer token a stand-in (a plain
        # text id: the talker's positions are those of any text token there), its rows zeros until `extend`
        taken = {int(i) for i in self.speech.placeholders.values()} | {self.speech.im_end_token_id}
        stand_in = np.asarray([next(i for i in range(vocab) if i not in taken)])
        zeros = jnp.zeros((1, self.model.config.hidden_size), self.model.decoder.config.jnp_dtype)
        talker = speech_lib.talker_input(self.model, prompt, stand_in, found, media, answer_rows=(zeros, zeros))
        return PreparedSpeech(prompt, answer, found, media, talker, writing=True)

    def _check_writing(self) -> None:
        if not self.config.early_start:
            raise ValueError("Qwen2.5-Omni's talker reads the thinker's final-normed row of every answer token, which "
                             "the engine returns only with SpeechConfig(early_start=True): give it, or open the "
                             "finished answer (writing=False)")

    def open(self, speech_id: str, prompt_ids: Any, answer_ids: Any, *, voice: str, max_new_tokens: int,
             media: Sequence[MediaRows] = (), writing: bool = False, sampling: Any = None,
             prepared: PreparedSpeech | None = None, rows: Any = None) -> int:
        """Admits an utterance: the thinker's prompt and whole answer spoken with `voice` (as `speak`), between
        ticks; it starts decoding at the next tick. Returns the talker pages it reserved. `prepared`: its talker
        input built already by `prepare` with these ids, voice and media (else built here, on the caller's thread).

        `writing` (`SpeechConfig.early_start`): the thinker is still writing the answer: `answer_ids` are its tokens
        so far (none at all is fine) with their `rows` (`FrameOutput.answer_rows`; `prepared` by `prepare(...,
        writing=True)`), `extend` adds the rest and ends it. Its talker tokens, codes and PCM are those of
        `speech_stream.AnswerSpeech` fed the same rows.

        Raises (each before anything changes):
            KeyError: `speech_id` is already in the pool.
            Overloaded: every row is taken, or its pages are more than the pool has free now: retry later.
            ValueError: `writing` without `SpeechConfig.early_start`, `sampling` (the talker is greedy), the
                utterance needs more pages than a row holds, a `prepared` input of other ids, voice or media, or not
                prepared for `writing` as asked; every refusal of `prepare` and `extend`.
        """
        if speech_id in self._utterances:
            raise KeyError(f"speech {speech_id!r} is already in the pool")
        if writing:
            self._check_writing()
        if sampling is not None:
            raise ValueError("Qwen2.5-Omni's talker on the speech pool is greedy (as speak()): sampling must be None"
                             + (" (an answer spoken while written too)" if writing else ""))
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        first = token_ids("answer_ids", given_ids(answer_ids), self.model.config.vocab_size)
        if prepared is None:
            prepared = self.prepare(prompt_ids, () if writing else answer_ids, voice=voice, media=media,
                                    writing=writing)
        else:
            again = first if writing or not first.size or first[-1] != self.speech.im_end_token_id else first[:-1]
            if (not np.array_equal(prepared.prompt_ids, np.asarray(prompt_ids)) or prepared.writing != writing or
                    not np.array_equal(prepared.answer_ids, again[:0] if writing else again) or
                    prepared.voice is not self.speech.voice(voice) or len(prepared.media) != len(tuple(media))):
                raise ValueError("open: `prepared` was built for other ids, voice or media than these (or not for "
                                 f"writing={writing}: prepare(..., writing={writing}))")
        if writing and first.size:
            answer_talker_rows(self.model, first, rows, self.speech.placeholders.values())  # refused by name now
        talker = prepared.talker
        T = talker.rows.shape[0]
        pages = self.pages_needed(T, max_new_tokens)
        if pages > self.max_pages:
            raise ValueError(f"the utterance needs {pages} talker pages ({T} prompt + {max_new_tokens} speech "
                             f"tokens at {self.config.page_size} a page) but a row holds {self.max_pages}: lower "
                             f"max_new_tokens or raise SpeechConfig.max_pages")
        if len(self._utterances) >= self.capacity:
            self.stats["refused"] += 1
            raise Overloaded(f"overloaded: {len(self._utterances)} sessions are speaking, the speech pool holds at "
                             f"most {self.capacity} (SpeechConfig.rows); retry later", cap=self.capacity,
                             current=len(self._utterances))
        if pages > self.free_pages:
            self.stats["refused"] += 1
            raise Overloaded(f"overloaded: the utterance needs {pages} talker pages and {self.free_pages} of "
                             f"{self.config.num_pages} are free (the rest reserved by {len(self._utterances)} "
                             f"speaking sessions); retry later", cap=self.capacity, current=len(self._utterances))
        seen = np.zeros((self.talker.decoder.vocab_size,), bool)
        seen[np.asarray(talker.prompt_ids, np.int64)] = True
        trailing = np.asarray(talker.trailing, np.float32)  # answer rows 1 .., then text_eos
        self._utterances[speech_id] = _Utterance(
            rows=np.array(talker.rows, np.float32), positions=np.asarray(talker.positions, np.int32),
            trailing=trailing[:0] if writing else trailing[:-1], eos_row=trailing[-1],
            pad_row=np.asarray(talker.text_pad, np.float32), seen=seen, voice=prepared.voice,
            max_new_tokens=int(max_new_tokens), pages=pages, opened_s=self.clock(),
            start=int(np.max(talker.positions)) + 1,
            stream=Token2WavStream(self.speech.token2wav, prepared.voice.conditioning, prepared.voice.reference_mel,
                                   streaming=self.streaming), ended=not writing, started=not writing)
        used = set(self._slots.values())
        self._slots[speech_id] = next(r for r in range(self.capacity) if r not in used)
        self.reserved += pages
        self.stats["opened"] += 1
        if writing and first.size:
            self.extend(speech_id, first, rows=rows)
        return pages

    def extend(self, speech_id: str, answer_ids: Any, *, end: bool = False, rows: Any = None) -> None:
        """Adds the next tokens of an answer still being written (`open(writing=True)`) with their `rows`
        (`[n, hidden_size]`, `FrameOutput.answer_rows`), between ticks; `end`: the answer is whole (a final
        `<|im_end|>` is not spoken). The first token's row ends the talker's prefill; each later one is a talker
        step's text row. An utterance whose talker already ended takes them and changes nothing. Raises (changing
        nothing) KeyError for an unknown utterance, ValueError for an answer whole already (opened whole, or ended),
        ids outside the vocabulary or media placeholders, rows of another shape."""
        if speech_id not in self._utterances:
            raise KeyError(f"unknown speech {speech_id!r}; in the pool: {self.sessions}")
        u = self._utterances[speech_id]
        if u.ended:
            raise ValueError(f"speech {speech_id!r}: its answer is whole already (opened whole, or ended by "
                             "extend(end=True)): nothing more can be added")
        ids = token_ids("answer_ids", given_ids(answer_ids), self.model.config.vocab_size)
        if end and ids.size and ids[-1] == self.speech.im_end_token_id:
            ids, rows = ids[:-1], None if rows is None else np.asarray(rows)[:-1]
        if ids.size:
            _, _, _, text = answer_talker_rows(self.model, ids, rows, self.speech.placeholders.values())
            text = np.asarray(text)
            if not u.started:  # the prefill's last row: the first answer token's, with the codec bos
                bos = self.speech.params["codec_embedding"][self.talker.codec_bos_id].astype(jnp.float32)
                u.rows[-1] = np.asarray(jnp.asarray(text[0]) + bos)  # as talker_forward.talker_prompt adds it
                u.started, text = True, text[1:]
            u.trailing = np.concatenate([u.trailing, text])
        u.ended = bool(end)
        if end and not u.started:  # ended without a token: nothing to speak (its stream ends, silent)
            u.done = True

    def close(self, speech_id: str) -> None:
        """Drops an utterance (between ticks; what it had not sent is not sent); its pages return. KeyError if
        unknown."""
        if speech_id not in self._utterances:
            raise KeyError(f"unknown speech {speech_id!r}; in the pool: {self.sessions}")
        row = self._slots[speech_id]
        if row < self.kv.batch:
            self.kv = steps.reset_row(self.kv, np.int32(row))
        u = self._utterances.pop(speech_id)
        del self._slots[speech_id]
        self.reserved -= u.pages

    def warm_vocoder(self) -> int:
        """Nothing is compiled ahead here (the warm-up's utterances run the stream's first chunk). Returns 0."""
        return 0

    def warm_ids(self, prompt_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """`(prompt, answer)` ids whose talker prompt is `prompt_tokens` rows (the server's warm-up)."""
        text = self.talker.text_pad_id  # an id of the thinker's vocabulary
        return np.full((max(1, prompt_tokens - 2),), text, np.int64), np.asarray([text], np.int64)

    def talker_tokens(self, speech_id: str) -> list[int]:
        """The talker tokens an utterance in the pool has decoded so far."""
        return list(self._utterances[speech_id].tokens)

    # --------------------------------------------------------------------------------------------------- ticks
    def _arrange(self) -> None:
        bucket = next(b for b in self.config.rows if b >= max(1, len(self._slots)))
        moved = compact_rows(self._slots, bucket, self.kv.batch)
        if moved is not None:
            self._slots, rows = moved
            self.kv = steps.take_rows(self.kv, rows)

    def _seen(self, ids: list[str]) -> np.ndarray:
        seen = np.zeros((self.kv.batch, self.talker.decoder.vocab_size), bool)
        for s in ids:
            seen[self._slots[s]] = self._utterances[s].seen
        return seen

    def tick(self) -> list[SpeechChunk]:
        """Prefills the utterances admitted since the last tick, runs the batched talker steps, then Token2Wav for
        the utterances whose talker ended (see the module docstring). Returns the chunks sent, in order; utterances
        whose last chunk went out leave the pool."""
        if not self._utterances:
            return []
        self._arrange()
        t0 = self.clock()
        fresh = [s for s, u in self._utterances.items() if not u.prefilled and u.started]
        if fresh:
            self._prefill(fresh)
        for _ in range(self.config.steps_per_tick):  # each over the rows whose next text row is known
            live = [s for s, u in self._utterances.items() if u.prefilled and self._steps(u)]
            if not live:
                break
            self._step(live)
        self.stats["talker_s"] += self.clock() - t0
        return self._vocode()

    def _record(self, s: str, token: int) -> None:
        u = self._utterances[s]
        u.tokens.append(token)
        u.done = token in self.talker.stop_ids or len(u.tokens) >= u.max_new_tokens

    def _prefill(self, fresh: list[str]) -> None:
        B, D = self.kv.batch, self.talker.embedding_size
        longest = max(self._utterances[s].rows.shape[0] for s in fresh)
        T = 1 << max(4, (longest - 1).bit_length())  # a power of two >= 16: few compiled shapes
        rows, valid = np.zeros((B, T, D), np.float32), np.zeros((B, T), bool)
        positions = np.zeros((3, B, T), np.int32)
        for s in fresh:
            u, r = self._utterances[s], self._slots[s]
            n = u.rows.shape[0]
            rows[r, :n], valid[r, :n], positions[:, r, :n] = u.rows, True, u.positions
        self.kv, token = talker_steps.prefill(self.talker, self.speech.params, self.kv, rows, valid, positions,
                                  self._seen(fresh), self._banned, self._penalty)
        starts = np.zeros((B,), np.int32)
        for s in fresh:
            starts[self._slots[s]] = self._utterances[s].start
        self._trim(fresh, starts)
        token = np.asarray(token)
        for s in fresh:
            self._utterances[s].prefilled = True
            self._record(s, int(token[self._slots[s]]))

    def _step(self, live: list[str]) -> None:
        B, D = self.kv.batch, self.talker.embedding_size
        token, position = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        text, active = np.zeros((B, D), np.float32), np.zeros((B,), bool)
        for s in live:
            u, r = self._utterances[s], self._slots[s]
            u.seen[u.tokens[-1]] = True
            k = len(u.tokens) - 1  # the decoding step
            token[r], position[r], active[r] = u.tokens[-1], u.start + k, True
            n = u.trailing.shape[0]  # the answer's rows, text_eos, then text_pad
            text[r] = u.trailing[k] if k < n else u.eos_row if k == n else u.pad_row
        self.kv, new = talker_steps.step(self.talker, self.speech.params, self.kv, token, text, position, active,
                             self._seen(live), self._banned, self._penalty)
        self._trim(live, position + 1)
        if bool(np.any(np.asarray(self.kv.exhausted)[active])):  # admission reserves every page: cannot happen
            raise RuntimeError("the talker's KV pool ran out of pages inside a reserved utterance")
        new = np.asarray(new)
        for s in live:
            self._record(s, int(new[self._slots[s]]))
        self.stats["steps"] += 1
        self.stats["frames"] += len(live)

    def _vocode(self) -> list[SpeechChunk]:
        """Hands each utterance's new codes to its stream (a token is a code once the next one came; the last is
        dropped) and sends the PCM chunks that completes; an ended talker's stream is finished."""
        out: list[SpeechChunk] = []
        start = self.clock()
        for s, u in list(self._utterances.items()):
            codes = u.tokens[u.pushed:len(u.tokens) - 1]  # every token but the last is a code
            if not codes and not u.done:
                continue
            pcm = u.stream.push(codes) if codes else []
            u.pushed += len(codes)
            if u.done:
                pcm += u.stream.finish()
            self.stats["vocoder_calls"] += 1
            self.stats["vocoder_rows"] += 1
            now = self.clock()
            chunks = [p for p in pcm if p.size] or ([np.zeros((0,), np.float32)] if u.done else [])
            for i, p in enumerate(chunks):
                deadline = None if u.first_s is None else u.first_s + u.samples / self.speech.sample_rate
                late = 0.0 if deadline is None else max(0.0, now - deadline)
                first = None
                if u.first_s is None and p.size:
                    u.first_s, first = now, now - u.opened_s
                final = u.done and i == len(chunks) - 1
                # the codes handed to the stream since the last chunk sent (a push that completed no PCM included)
                step = np.asarray(u.tokens[u.reported:u.pushed], np.int32)[None]
                out.append(SpeechChunk(s, np.asarray(p, np.float32), step, u.reported, final, late, first))
                u.reported = u.pushed
                u.samples += p.size
                self.stats["chunks"] += 1
                if late > 0:
                    self.stats["late_chunks"] += 1
                    self.stats["late_s"] += late
            if u.done:
                self.close(s)
        self.stats["vocoder_s"] += self.clock() - start
        return out


AnyPool = SpeechPool | Qwen25SpeechPool  # an engine's speech pool, of either family
