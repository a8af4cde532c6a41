"""Qwen2.5-Omni speech on the engine's ticks: the talkers of several sessions decode in one batched step per tick,
Token2Wav runs once an utterance's talker ended, and admission counts what speaking holds (issue 39 item 4). The
Qwen3-Omni pool is `omnijax.serve.engine.speech.SpeechPool`; `speech_pool` builds the one a model's speech output
takes, both with the same interface (`open`, `tick`, `close`, `has_work`, `sessions`, `capacity`, ...).

A `Qwen25SpeechPool` owns its own paged KV pool, separate from the thinker's: each speaking session is a row of one
batched talker cache (`talker_forward.talker_chunk` over the rows: only active rows write). The batch is a bucket
(`SpeechConfig.rows`), the smallest that holds the sessions speaking; rows are compacted when sessions end.

An utterance's talker input (`omnijax.models.qwen2_5_omni.speech.talker_input`: the thinker rerun over prompt and
answer, full attention, the media rows at their placeholders) is built by `prepare`, which the server runs in a worker
thread before admission, so the engine's thread only prefills and steps the talker. The talker reads the thinker's
final hidden state of every answer token, which the engine's batched ticks do not keep: a Qwen2.5-Omni answer is
spoken once it is whole (`open(writing=True)` is refused; Qwen3-Omni's talker reads embedding rows and starts while
the answer is written).

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
import functools
import time
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.kv import paged as paged_lib
from omnijax.models.qwen2_5_omni import speech as speech_lib
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.models.qwen2_5_omni.talker import TalkerConfig
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStream, Token2WavStreaming
from omnijax.models.qwen2_5_omni.voices import Voice
from omnijax.models.speech import MediaRows, token_ids
from omnijax.serve.engine import speech_steps as steps
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.rows import compact_rows
from omnijax.serve.engine.speech import SpeechPool
from omnijax.serve.engine.speech_config import SpeechChunk, SpeechConfig
from omnijax.serve.engine.speech_pages import TalkerPages

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
    """An utterance's checked talker input (`Qwen25SpeechPool.prepare`), ready for `open`."""

    prompt_ids: np.ndarray
    answer_ids: np.ndarray
    voice: Voice
    media: tuple[MediaRows, ...]
    talker: speech_lib.TalkerInput


@dataclasses.dataclass
class _Utterance:
    rows: np.ndarray  # [T, Dt] talker prefill rows
    positions: np.ndarray  # [3, T]
    trailing: np.ndarray  # [N, Dt] text rows of decoding steps 0 .. N-1
    seen: np.ndarray  # [V] bool: the talker's input ids so far (the repetition penalty's)
    voice: Voice
    max_new_tokens: int
    pages: int
    opened_s: float
    start: int  # position of the first decoding step
    stream: Token2WavStream  # its Token2Wav
    prefilled: bool = False
    done: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    pushed: int = 0  # codes handed to the stream
    reported: int = 0  # codes named by a sent chunk (`SpeechChunk.codes`; a push may complete no PCM)
    samples: int = 0  # PCM samples sent
    first_s: float | None = None  # when the first PCM was sent


def _pick(logits: jax.Array, seen: jax.Array, banned: jax.Array, penalty: jax.Array) -> jax.Array:
    """`[B]` int32: `talker_forward.generate_greedy`'s choice per row (traceable): the repetition penalty on the ids
    `seen` (negative logits multiplied, positive ones divided), the `banned` ids at -inf, then argmax."""
    scores = logits.astype(jnp.float32)
    scores = jnp.where(seen, jnp.where(scores < 0, scores * penalty, scores / penalty), scores)
    return jnp.argmax(jnp.where(banned, -jnp.inf, scores), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="config", donate_argnums=(2,))
def _prefill(config: TalkerConfig, params: Any, kv: paged_lib.PagedKV, rows: jax.Array, valid: jax.Array,
             positions: jax.Array, seen: jax.Array, banned: jax.Array, penalty: jax.Array
             ) -> tuple[paged_lib.PagedKV, jax.Array]:
    """The talker prompts of the rows where `valid [B, T]` (left-aligned `rows [B, T, Dt]`, `positions [3, B, T]`):
    `(kv, first token [B])`."""
    kv, logits = talker_forward.talker_chunk(config, params, kv, rows, valid, positions)
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return kv, _pick(logits, seen, banned, penalty)


@functools.partial(jax.jit, static_argnames="config", donate_argnums=(2,))
def _step(config: TalkerConfig, params: Any, kv: paged_lib.PagedKV, token: jax.Array, text_row: jax.Array,
          position: jax.Array, active: jax.Array, seen: jax.Array, banned: jax.Array, penalty: jax.Array
          ) -> tuple[paged_lib.PagedKV, jax.Array]:
    """One talker token of the `active [B]` rows (`token [B]` the last one, `text_row [B, Dt]`, `position [B]`):
    `(kv, next token [B])` (meaningless for inactive rows, which write nothing)."""
    x = params["codec_embedding"][token].astype(jnp.float32) + text_row.astype(jnp.float32)
    B = token.shape[0]
    pos = jnp.broadcast_to(position.astype(jnp.int32)[None, :, None], (3, B, 1))
    kv, logits = talker_forward.talker_chunk(config, params, kv, x[:, None], active[:, None], pos)
    return kv, _pick(logits[:, 0], seen, banned, penalty)


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

    writes_early = False  # the talker reads the thinker's hidden state of each answer token: finished answers only

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
        """Whether a tick would do something (an utterance in the pool: finished answers always step)."""
        return bool(self._utterances)

    def prepare(self, prompt_ids: Any, answer_ids: Any, *, voice: str, media: Sequence[MediaRows] = ()
                ) -> PreparedSpeech:
        """Checks an utterance and builds its talker input (`speech.talker_input`: one thinker forward over prompt
        and answer). Pure and thread-safe: the server runs it in a worker thread, off the engine's.

        Raises:
            UnknownVoiceError: a voice the checkpoint lacks (naming its voices).
            ValueError: what `speak` refuses (ids, an empty prompt or answer, video placeholders, media rows).
        """
        vocab = self.model.config.vocab_size
        prompt, answer = token_ids("prompt_ids", prompt_ids, vocab), token_ids("answer_ids", answer_ids, vocab)
        if answer.size and answer[-1] == self.speech.im_end_token_id:
            answer = answer[:-1]
        if not answer.size or not prompt.size:
            raise ValueError("answer_ids holds no text to speak (empty, or only <|im_end|>)" if prompt.size else
                             "prompt_ids is empty")
        found = self.speech.voice(voice)
        media = tuple(media)
        return PreparedSpeech(prompt, answer, found, media,
                              speech_lib.talker_input(self.model, prompt, answer, found, media))

    def open(self, speech_id: str, prompt_ids: Any, answer_ids: Any, *, voice: str, max_new_tokens: int,
             media: Sequence[MediaRows] = (), writing: bool = False, sampling: Any = None,
             prepared: PreparedSpeech | None = None) -> int:
        """Admits an utterance: the thinker's prompt and whole answer spoken with `voice` (as `speak`), between
        ticks; it starts decoding at the next tick. Returns the talker pages it reserved. `prepared`: its talker
        input built already by `prepare` with these ids, voice and media (else built here, on the caller's thread).

        Raises (each before anything changes):
            KeyError: `speech_id` is already in the pool.
            Overloaded: every row is taken, or its pages are more than the pool has free now: retry later.
            ValueError: `writing` (the talker reads each answer token's thinker hidden state: speak the finished
                answer), `sampling` (the talker is greedy), the utterance needs more pages than a row holds, a
                `prepared` input of other ids, voice or media; every refusal of `prepare`.
        """
        if speech_id in self._utterances:
            raise KeyError(f"speech {speech_id!r} is already in the pool")
        if writing:
            raise ValueError("Qwen2.5-Omni's talker reads the thinker's final hidden state of every answer token, "
                             "which the engine does not keep while it writes: open the finished answer "
                             "(writing=False)")
        if sampling is not None:
            raise ValueError("Qwen2.5-Omni's talker on the speech pool is greedy (as speak()): sampling must be None")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if prepared is None:
            prepared = self.prepare(prompt_ids, answer_ids, voice=voice, media=media)
        else:
            again = token_ids("answer_ids", answer_ids, self.model.config.vocab_size)
            again = again[:-1] if again.size and again[-1] == self.speech.im_end_token_id else again
            if (not np.array_equal(prepared.prompt_ids, np.asarray(prompt_ids)) or
                    not np.array_equal(prepared.answer_ids, again) or prepared.voice is not self.speech.voice(voice)
                    or len(prepared.media) != len(tuple(media))):
                raise ValueError("open: `prepared` was built for other ids, voice or media than these")
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
        trailing = np.concatenate([np.asarray(talker.trailing, np.float32),
                                   np.asarray(talker.text_pad, np.float32)[None]])
        self._utterances[speech_id] = _Utterance(
            rows=np.asarray(talker.rows, np.float32), positions=np.asarray(talker.positions, np.int32),
            trailing=trailing, seen=seen, voice=prepared.voice, max_new_tokens=int(max_new_tokens), pages=pages,
            opened_s=self.clock(), start=int(np.max(talker.positions)) + 1,
            stream=Token2WavStream(self.speech.token2wav, prepared.voice.conditioning, prepared.voice.reference_mel,
                                   streaming=self.streaming))
        used = set(self._slots.values())
        self._slots[speech_id] = next(r for r in range(self.capacity) if r not in used)
        self.reserved += pages
        self.stats["opened"] += 1
        return pages

    def extend(self, speech_id: str, answer_ids: Any, *, end: bool = False) -> None:
        """Refused: a Qwen2.5-Omni utterance is opened with its whole answer (ValueError; KeyError if unknown)."""
        if speech_id not in self._utterances:
            raise KeyError(f"unknown speech {speech_id!r}; in the pool: {self.sessions}")
        raise ValueError(f"speech {speech_id!r}: its answer is whole already (Qwen2.5-Omni speaks finished answers)")

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
        fresh = [s for s, u in self._utterances.items() if not u.prefilled]
        if fresh:
            self._prefill(fresh)
        for _ in range(self.config.steps_per_tick):
            live = [s for s, u in self._utterances.items() if u.prefilled and not u.done]
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
        self.kv, token = _prefill(self.talker, self.speech.params, self.kv, rows, valid, positions,
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
            text[r] = u.trailing[min(k, u.trailing.shape[0] - 1)]  # the answer's rows, text_eos, then text_pad
        self.kv, new = _step(self.talker, self.speech.params, self.kv, token, text, position, active,
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
