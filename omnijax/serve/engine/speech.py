"""Speech on the engine's ticks: the talkers of several sessions decode in one batched step per tick, their vocoder
chunks are scheduled by playback deadline, and admission counts what speaking holds (issue 39 item 4).

A `SpeechPool` (Qwen3-Omni: talker + code predictor + Code2Wav) owns its own paged KV pool, separate from the
thinker's: each speaking session is a row of one batched talker cache (`talker_forward.rows_prefill` /
`rows_step`: only active rows write). The batch is a bucket (`SpeechConfig.rows`), the smallest that holds the
sessions speaking, as the engine's own rows; rows are compacted when sessions end (the pool never moves).

Per `tick()`:
1. the utterances admitted since the last tick are prefilled together (their talker prompts, left-aligned and padded
   to a power-of-two length, in one call over the batch; the other rows write nothing);
2. one batched talker step for every row still decoding (`SpeechConfig.steps_per_tick` steps at most, each over the
   rows that can step): the code predictor fills the previous token's frame (the frame's Q codes come back), the
   talker writes the frame and picks its next token (greedy, the control ids suppressed, as
   `omnijax.models.qwen3_omni.speech.speak`, or drawn: `TalkerSampling`, rows of one setting per call); a row ends at
   the end-of-speech token or at its `max_new_tokens`; a row whose answer is still being written (`open(writing=True)`)
   steps only as far as its text allows;
3. vocoder chunks: a session whose frames fill its next chunk (`first_chunk` frames, then `chunk`; what is left once
   the talker ended) is due. The due chunks run batched: one Code2Wav call over the sessions' rows, each row on its
   own carried state (`omnijax.models.qwen3_omni.code2wav_rows`), first chunks in one call and later chunks in
   another (a first call returns `lag` samples fewer, so it is compiled apart); a short final chunk joins a call of
   the next power-of-two frames, padded and its padding's samples cut (Code2Wav is causal). A call holds at most
   `vocoder_rows` sessions; its rows are padded to a `rows` bucket. Calls go in order of playback deadline: first
   chunks before any other (nothing is playing yet), then the call holding the chunk whose audio runs out soonest
   (the first PCM's time plus the seconds sent). `vocoder_budget_s` bounds the vocoder time of a tick: past it,
   chunks whose deadline is further than `slack_s` away wait for the next tick; urgent ones still run.

A chunk that leaves after its deadline is sent all the same and reported late (`SpeechChunk.late_s`, the pool's
`stats["late_chunks"]` / `["late_s"]`): speech is never dropped. Admission reserves each utterance's talker pages up
front (its prompt plus `max_new_tokens`), so a row can never run out of cache mid-utterance: `open` refuses
(`Overloaded`, naming the pages or rows) what the pool cannot hold, and the engine's tick latency, which the AIMD
controller reads, includes the talker steps and vocoder calls.

Each session's codes and PCM equal the same utterance spoken alone (`speak_streamed`): the batched step computes
every row as the single-session step does, and each vocoder row is its session's chunk decoded alone (equal up to
float rounding: within 3.2e-7 of the peak in tests/serve/engine/test_speech_ticks.py).

The talker pages both families' pools share (reservations, the bounded talker's trim) are `speech_pages.TalkerPages`;
step 3's chunk scheduling and batched Code2Wav calls are `speech_vocode.Code2WavChunks`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from omnijax.models.qwen3_omni import code2wav_rows, talker_forward
from omnijax.models.qwen3_omni import speech as speech_lib
from omnijax.models.qwen3_omni.code2wav_decode import Code2WavState, init_state, model_params
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows, token_ids
from omnijax.serve.engine import speech_steps as steps
from omnijax.serve.engine.admission import Overloaded
from omnijax.serve.engine.rows import compact_rows
from omnijax.serve.engine.speech_config import SpeechChunk, SpeechConfig
from omnijax.serve.engine.speech_pages import TalkerPages, given_ids
from omnijax.serve.engine.speech_vocode import Code2WavChunks

__all__ = ["SpeechChunk", "SpeechConfig", "SpeechPool", "TalkerPages"]


@dataclasses.dataclass
class _Utterance:
    rows: np.ndarray  # [T, D] talker prompt
    positions: np.ndarray  # [3, T]
    trailing: np.ndarray  # [N, D] text rows, one per step (an open answer's grow with `extend`)
    max_steps: int  # talker steps at most (max_new_tokens - 1)
    pages: int  # talker pages reserved
    state: Code2WavState  # the vocoder's carried state (batch of one)
    opened_s: float
    start: int  # position of the first decoded token
    ended: bool = True  # the answer's text is whole (an open answer's rows come with `extend`)
    spoken: int = 0  # answer tokens the trailing rows cover (an open answer)
    eos_row: np.ndarray | None = None  # the projected `tts_eos` an open answer appends when it ends
    sampling: TalkerSampling | None = None  # drawn speech (None: greedy)
    prefilled: bool = False
    done: bool = False
    steps: int = 0
    token: int = -1
    hidden: np.ndarray | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    ready: list[np.ndarray] = dataclasses.field(default_factory=list)  # frames not yet vocoded
    pushed: int = 0  # frames vocoded
    samples: int = 0  # samples sent
    first_s: float | None = None  # when the first PCM was sent


class SpeechPool(Code2WavChunks, TalkerPages):
    """The speaking sessions of an engine (see the module docstring).

    Args:
        model: a loaded Qwen3-Omni checkpoint with its speech output (`model.speech`).
        config: `SpeechConfig`.
        clock: seconds, monotonic (`time.perf_counter` by default; tests may pass their own).

    Raises:
        omnijax.models.qwen3_omni.speech.SpeechUnavailableError: the model has no Qwen3-Omni speech output.
    """

    def __init__(self, model: Any, config: SpeechConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter):
        speech = getattr(model, "speech", None)
        if not isinstance(speech, speech_lib.Qwen3Speech):
            raise speech_lib.SpeechUnavailableError(
                f"the engine speaks with Qwen3-Omni's talker, code predictor and Code2Wav; "
                f"{getattr(model, 'source', None) or 'this model'} has "
                f"{'no speech output' if speech is None else type(speech).__name__ + ' (not batched on the engine)'}")
        self.model, self.speech, self.config, self.clock = model, speech, config or SpeechConfig(), clock
        self.talker = speech.talker.config
        c = self.config
        self.max_pages = c.num_pages if c.max_pages is None else c.max_pages
        self.kv = self._empty(c.rows[0])
        vocab = self.talker.decoder.vocab_size
        banned = np.zeros((vocab,), bool)
        banned[[i for i in range(max(0, vocab - speech_lib.SUPPRESSED_TOP_IDS), vocab)
                if i != self.talker.codec_eos_token_id]] = True
        self._banned = jnp.asarray(banned)
        t = speech.tokens
        specials = model.decoder.embed_tokens(jnp.asarray([[t.tts_bos_token_id, t.tts_eos_token_id,
                                                            t.tts_pad_token_id]], jnp.int32))[0]
        self._pad_row = np.asarray(talker_forward.project_text(self.talker, speech.params, specials)[2])
        self._c2w = speech.code2wav.config
        self._c2w_params = model_params(speech.code2wav)
        self._fillers = {False: init_state(self._c2w), True: code2wav_rows.started_state(self._c2w)}
        self._vocoder_rows = min(self.capacity, self.config.vocoder_rows or self.capacity)
        self._utterances: dict[str, _Utterance] = {}
        self._slots: dict[str, int] = {}
        self.reserved = 0
        self.stats = {"opened": 0, "refused": 0, "steps": 0, "frames": 0, "chunks": 0, "late_chunks": 0,
                      "late_s": 0.0, "talker_s": 0.0, "vocoder_s": 0.0, "deferred": 0,
                      "vocoder_calls": 0, "vocoder_rows": 0}

    def open(self, speech_id: str, prompt_ids: Any, answer_ids: Any, *, voice: str, max_new_tokens: int,
             media: Sequence[MediaRows] = (), writing: bool = False, sampling: TalkerSampling | None = None) -> int:
        """Admits an utterance: the thinker's prompt and answer spoken with `voice` (as `speak_streamed`), between
        ticks; it starts decoding at the next tick. Returns the talker pages it reserved.

        `writing`: the thinker is still writing the answer: `answer_ids` are its tokens so far (the first at least,
        none that may yet be dropped: a final `<|im_end|>` is not spoken), `extend` adds the rest and ends it. The
        talker's step t reads answer token t + 1 (or, once the answer ended, `tts_eos` then `tts_pad`), so an open
        utterance steps as far as its tokens allow and waits (its row inactive) for more; its tokens, codes and PCM
        are those of the whole answer opened at once (the rows projected in pieces: equal up to float rounding).

        `sampling`: the talker and code predictor draw (`TalkerSampling`, seeded: the draws of `speak_streamed` with
        the same sampling); None: greedy.

        Raises (each before anything changes):
            KeyError: `speech_id` is already in the pool.
            Overloaded: every row is taken, or its pages are more than the pool has free now (both name the
                numbers): retry later.
            ValueError: the utterance needs more pages than a row holds at all; every refusal of `speak` (ids,
                media rows, `max_new_tokens`), `UnknownVoiceError` for a voice the checkpoint lacks.
        """
        if speech_id in self._utterances:
            raise KeyError(f"speech {speech_id!r} is already in the pool")
        if sampling is not None and not isinstance(sampling, TalkerSampling):
            raise ValueError(f"sampling must be a TalkerSampling or None (greedy), got {type(sampling).__name__}")
        answer = token_ids("answer_ids", given_ids(answer_ids), self.model.config.vocab_size)
        if writing and (not answer.size or answer[-1] == self.speech.tokens.im_end_token_id):
            raise ValueError("an answer still being written opens with its first token at least, and without a "
                             "final <|im_end|> (it is not spoken: extend(end=True) ends the answer)")
        talker_in = speech_lib.talker_input(self.model, prompt_ids, answer[:1] if writing else answer,
                                            speaker=voice, media=media)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        T = talker_in.rows.shape[0]
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
        trailing = np.asarray(talker_in.trailing)  # a one-token answer's: `tts_eos` alone
        u = self._utterances[speech_id] = _Utterance(
            rows=np.asarray(talker_in.rows), positions=np.asarray(talker_in.positions),
            trailing=trailing[:0] if writing else trailing, max_steps=int(max_new_tokens) - 1, pages=pages,
            state=init_state(self.speech.code2wav.config), opened_s=self.clock(),
            start=int(np.max(talker_in.positions)) + 1, ended=not writing, spoken=1, eos_row=trailing[-1],
            sampling=sampling)
        if writing and answer.size > 1:
            u.trailing = self._project(answer[1:])
            u.spoken = int(answer.size)
        used = set(self._slots.values())
        self._slots[speech_id] = next(r for r in range(self.capacity) if r not in used)
        self.reserved += pages
        self.stats["opened"] += 1
        return pages

    def extend(self, speech_id: str, answer_ids: Any, *, end: bool = False) -> None:
        """Adds the next tokens of an answer still being written (`open(writing=True)`), between ticks; `end`: the
        answer is whole (without its final `<|im_end|>`). An utterance whose talker already ended takes them and
        changes nothing. Raises (changing nothing) KeyError for an unknown utterance, ValueError for an answer whole
        already or ids outside the thinker's vocabulary."""
        if speech_id not in self._utterances:
            raise KeyError(f"unknown speech {speech_id!r}; in the pool: {self.sessions}")
        u = self._utterances[speech_id]
        if u.ended:
            raise ValueError(f"speech {speech_id!r}: its answer is whole already (opened whole, or ended by "
                             "extend(end=True)): nothing more can be added")
        answer = token_ids("answer_ids", given_ids(answer_ids), self.model.config.vocab_size)
        rows = [u.trailing]
        if answer.size:
            rows.append(self._project(answer))
        if end:
            assert u.eos_row is not None
            rows.append(u.eos_row[None])
        u.trailing = np.concatenate(rows)
        u.spoken += int(answer.size)
        u.ended = end

    def _project(self, ids: np.ndarray) -> np.ndarray:
        """The talker's text rows `[n, D]` of thinker ids (their embedding rows projected, as `talker_input`)."""
        embeds = self.model.decoder.embed_tokens(jnp.asarray(ids, jnp.int32)[None])[0]
        return np.asarray(talker_forward.project_text(self.talker, self.speech.params, embeds))

    @property
    def has_work(self) -> bool:
        """Whether a tick would do something: an utterance to prefill or whose tokens allow a talker step, or a
        vocoder chunk due (not: every utterance waits for its answer's next tokens)."""
        return any(not u.prefilled or self._steps(u) or self._due(u) or (u.done and not u.ready)
                   for u in list(self._utterances.values()))  # a copy: the worker reads it beside the engine thread

    @staticmethod
    def _steps(u: _Utterance) -> bool:
        """Whether the talker may step now: not ended, and its next text row known (or the answer whole)."""
        return not u.done and (u.ended or u.steps < u.trailing.shape[0])

    def close(self, speech_id: str) -> None:
        """Drops an utterance (between ticks; what it had not sent is not sent); its pages return. KeyError if
        unknown."""
        if speech_id not in self._utterances:
            raise KeyError(f"unknown speech {speech_id!r}; in the pool: {self.sessions}")
        row = self._slots[speech_id]
        if row < self.kv.batch:  # first: a reader that sees the utterance gone sees the cache it left
            self.kv = steps.reset_row(self.kv, np.int32(row))
        u = self._utterances.pop(speech_id)
        del self._slots[speech_id]
        self.reserved -= u.pages

    def talker_tokens(self, speech_id: str) -> list[int]:
        """The talker tokens an utterance in the pool has decoded so far."""
        return list(self._utterances[speech_id].tokens)

    # --------------------------------------------------------------------------------------------------- ticks
    def _arrange(self) -> None:
        old = self.kv.batch
        bucket = next(b for b in self.config.rows if b >= max(1, len(self._slots)))
        moved = compact_rows(self._slots, bucket, old)
        if moved is None:
            return
        self._slots, rows = moved
        self.kv = steps.take_rows(self.kv, rows)

    def tick(self) -> list[SpeechChunk]:
        """Prefills the utterances admitted since the last tick, runs one batched talker step, then the vocoder
        chunks that are due (see the module docstring). Returns the chunks sent, in the order they were decoded;
        utterances whose last chunk went out leave the pool."""
        if not self._utterances:
            return []
        self._arrange()
        t0 = self.clock()
        fresh = [s for s, u in self._utterances.items() if not u.prefilled]
        if fresh:
            self._prefill(fresh)
        for _ in range(self.config.steps_per_tick):  # `SpeechConfig.steps_per_tick` batched steps at most
            live = [s for s, u in self._utterances.items() if u.prefilled and self._steps(u)]
            if not live:
                break
            self._step(live)
        self.stats["talker_s"] += self.clock() - t0
        return self._vocode()

    def _prefill(self, fresh: list[str]) -> None:
        B, D = self.kv.batch, self._pad_row.shape[-1]
        longest = max(self._utterances[s].rows.shape[0] for s in fresh)
        T = 1 << max(4, (longest - 1).bit_length())  # a power of two >= 16: few compiled shapes
        embeds = np.zeros((B, T, D), self._pad_row.dtype)
        valid = np.zeros((B, T), bool)
        positions = np.zeros((3, B, T), np.float32)
        for s in fresh:
            u, r = self._utterances[s], self._slots[s]
            n = u.rows.shape[0]
            embeds[r, :n], valid[r, :n], positions[:, r, :n] = u.rows, True, u.positions
        self.kv, hidden, logits, token = steps.prefill(self.talker, self.speech.params, self.kv, embeds, valid,
                                                       positions, self._banned)
        starts = np.zeros((B,), np.int32)
        for s in fresh:
            starts[self._slots[s]] = self._utterances[s].start
        self._trim(fresh, starts)
        hidden, token = np.asarray(hidden), np.array(token)
        for warps, group in self._groups(fresh).items():  # drawn first tokens (token 0 of each row)
            if warps is not None:
                seeds, _, history = self._draw_inputs(group)
                drawn = np.asarray(steps.draw(logits, self._banned, history, seeds, np.zeros((B,), np.int32),
                                              warp=warps[0]))
                for s in group:
                    token[self._slots[s]] = drawn[self._slots[s]]
        for s in fresh:
            u, r = self._utterances[s], self._slots[s]
            u.prefilled, u.hidden, u.token = True, hidden[r], int(token[r])
            u.tokens.append(u.token)
            u.done = u.token == self.talker.codec_eos_token_id or u.max_steps == 0

    def _groups(self, ids: list[str]) -> dict[Any, list[str]]:
        """Utterances by their draw's static warps (None: greedy), in order: each group steps in its own call."""
        groups: dict[Any, list[str]] = {}
        for s in ids:
            sampling = self._utterances[s].sampling
            groups.setdefault(None if sampling is None else (sampling.talker, sampling.predictor), []).append(s)
        return groups

    def _draw_inputs(self, group: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(seeds [B], steps [B], history [B, N])` of a drawing group's rows (the history: each row's talker tokens
        so far, -1 padded to a power of two >= 16 holding its `max_new_tokens`)."""
        B = self.kv.batch
        width = 1 << max(4, max(self._utterances[s].max_steps for s in group).bit_length())
        seeds, counts = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        history = np.full((B, width), -1, np.int32)
        for s in group:
            u, r = self._utterances[s], self._slots[s]
            assert u.sampling is not None
            seeds[r], counts[r] = u.sampling.seed, u.steps
            history[r, :len(u.tokens)] = u.tokens
        return seeds, counts, history

    def _step(self, live: list[str]) -> None:
        for warps, group in self._groups(live).items():
            self._step_group(group, warps)
        self.stats["steps"] += 1

    def _step_group(self, live: list[str], warps: Any) -> None:
        B, D = self.kv.batch, self._pad_row.shape[-1]
        hidden = np.zeros((B, D), self._pad_row.dtype)
        token, position = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        text, active = np.zeros((B, D), self._pad_row.dtype), np.zeros((B,), bool)
        for s in live:
            u, r = self._utterances[s], self._slots[s]
            hidden[r], token[r], position[r], active[r] = u.hidden, u.token, u.start + u.steps, True
            text[r] = u.trailing[u.steps] if u.steps < u.trailing.shape[0] else self._pad_row
        seeds, counts, history = (self._draw_inputs(live) if warps is not None else
                                  (np.zeros((B,), np.int32), np.zeros((B,), np.int32), np.zeros((B, 1), np.int32)))
        self.kv, codes, new_hidden, new_token = steps.step(self.talker, self.speech.params, self.kv, hidden, token,
                                                           text, position, active, self._banned, seeds, counts,
                                                           history, warps=warps)
        self._trim(live, position + 1)
        codes, new_hidden, new_token = np.asarray(codes), np.asarray(new_hidden), np.asarray(new_token)
        if bool(np.any(np.asarray(self.kv.exhausted)[active])):  # admission reserves every page: cannot happen
            raise RuntimeError("the talker's KV pool ran out of pages inside a reserved utterance")
        for s in live:
            u, r = self._utterances[s], self._slots[s]
            u.ready.append(codes[r])
            u.steps += 1
            u.hidden, u.token = new_hidden[r], int(new_token[r])
            u.tokens.append(u.token)
            u.done = u.token == self.talker.codec_eos_token_id or u.steps >= u.max_steps
            self.stats["frames"] += 1
