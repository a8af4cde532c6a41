"""Qwen2.5-Omni speech while the thinker still writes its answer: `AnswerSpeech` takes the answer's tokens as the
thinker decodes them (`push`, then `finish`) and returns PCM chunks as soon as the talker and Token2Wav have them.

Why the talker can start early: the reference's talker prefill holds the prompt's rows and the first answer
token's (`talker_forward` docstring), and its step k adds the row of answer token k + 1 (then `text_eos` once, then
`text_pad`). A row is the thinker's final-normed hidden state plus its embedding, and the thinker is causal: answer
token k's row depends on the prompt and answer tokens 0 .. k only. So talker step k needs answer token k + 1, or
the knowledge that the answer ended there, and nothing later. `AnswerSpeech` runs every step the tokens pushed so
far allow and leaves the rest for the next `push`; at `finish` it runs the talker to its end.

Where the rows come from: `speech.talker_input` of the prompt and the answer so far (the thinker's forward over
both, `talker_forward.thinker_rows`), the function the finish-first path (`Qwen25Speech.speak_chunks` on the
finished answer) calls once on the whole answer. The thinker's own decode does not keep these states (its fused
answer loop returns tokens only), so each `push` reruns the thinker over the prompt and the answer so far: one
forward per push, where the finish-first path runs one in all.

When it equals the finish-first path: that forward runs whole 64-token pages (the rest padding), so a prefix with as
many pages as the finished sequence runs the very program it runs, and a causal row cannot see what follows it: its
rows equalled the finished forward's bit for bit wherever measured (CPU). A prefix with fewer pages runs a smaller
program, and there the rows may differ in the last float bits: measured on the tiny release's thinker, rows of a
100-token prefix against its 129-token sequence differ by 3.3e-6 (2 pages against 3), while a prefix within the
first page equalled every longer sequence tried (up to 700 tokens) and 2 pages equalled 4. So the speech is the
finished answer's bit for bit while the prompt and the answer's first tokens read early lie in the finished
sequence's last page or in its first page, and otherwise may differ from it by what such rounding changes (not
measured on the speech itself).

Otherwise tokens, codes and PCM are those of `Qwen25Speech.speak_chunks` on the finished answer (the same talker
input, the same talker steps, each code pushed to the same `Token2WavStream` one at a time, as
`token2wav_stream.talker_pcm` does). What is spoken is the answer `omnijax.Chat` speaks: a final stop token dropped,
then a final `<|im_end|>`; until `finish`, a trailing token that might be dropped is held back (at most two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from omnijax.models.family import OmniModel
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStream, Token2WavStreaming
from omnijax.models.qwen2_5_omni.voices import Voice
from omnijax.models.speech import token_ids

__all__ = ["AnswerSpeech"]


class _Rows:
    """The talker's trailing rows as they become known (what `talker_forward.greedy_tokens` reads as `trailing`:
    `shape[0]` rows, indexed by step)."""

    def __init__(self) -> None:
        self.rows: list[Any] = []

    @property
    def shape(self) -> tuple[int]:
        return (len(self.rows),)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


class AnswerSpeech:
    """One Qwen2.5-Omni answer spoken while it is written (see the module's docstring); built by
    `Qwen25Speech.answer_stream`, which checks its arguments.

    Args:
        model: a loaded Qwen2.5-Omni checkpoint with speech output (`model.speech`).
        rows: `rows(answer_ids)` -> the talker input (`speech.TalkerInput`) of the prompt with that answer
            (`speech.talker_input` with the prompt, voice and media bound).
        voice: the voice (`voices.Voice`).
        max_new_tokens: talker tokens at most.
        streaming: Token2Wav's chunking and look-ahead (`speak_chunks`').
        stop: the thinker's stop ids: a final one is not spoken.
        policy: the talker's KV policy (None: unbounded).
        repetition_penalty: the talker's.
    """

    def __init__(self, model: OmniModel, rows: Callable[[np.ndarray], Any], *, voice: Voice, max_new_tokens: int,
                 streaming: Token2WavStreaming, stop: Sequence[int] = (), policy: Any = None,
                 repetition_penalty: float = 1.05):
        speech = model.speech
        self._model, self._speech, self._make, self._policy = model, speech, rows, policy
        self._max_new_tokens, self._penalty = int(max_new_tokens), float(repetition_penalty)
        self._stream = Token2WavStream(speech.token2wav, voice.conditioning, voice.reference_mel,  # type: ignore
                                       streaming=streaming)
        self._stop = frozenset(int(s) for s in stop)
        self._droppable = self._stop | {speech.im_end_token_id}  # type: ignore[union-attr]
        self.generated: list[int] = []  # every token pushed
        self.samples = 0  # PCM samples returned so far
        self.talker_tokens: list[int] = []  # the talker's tokens so far
        self._rows = _Rows()  # rows of answer tokens 1.. (then text_eos once finished)
        self._tokens: Iterator[int] | None = None
        self._eos_row: Any = None
        self._held: int | None = None  # the talker's last token (spoken once the next shows it was not the last)
        self._finished = self._flushed = self._talker_done = False

    def push(self, tokens: Sequence[int]) -> Iterator[np.ndarray]:
        """Adds answer tokens as the thinker decoded them (checked at the call); the iterator returned runs the
        talker steps they allow, yielding each PCM chunk (float32, 24 kHz) as soon as it is decoded. An iterator
        left unfinished loses nothing: the next `push` or `finish` carries on."""
        self._add(tokens)
        return self._run()

    def finish(self, tokens: Sequence[int] = ()) -> Iterator[np.ndarray]:
        """Adds the answer's last `tokens` and ends it; the iterator returned runs the talker (reading `text_eos`,
        then pads) to its end, yielding the remaining PCM chunks."""
        self._add(tokens)
        self._finished = True
        return self._run()

    def _add(self, tokens: Sequence[int]) -> None:
        if self._finished:
            raise ValueError("this answer has ended (finish was called): nothing more can be added")
        ids = token_ids("tokens", np.asarray(list(tokens), np.int64), self._model.config.vocab_size)
        self.generated += [int(t) for t in ids]

    def answer(self) -> list[int]:
        """The answer spoken once finished: the tokens pushed, a final stop token and then a final `<|im_end|>`
        dropped."""
        a = list(self.generated)
        if a and a[-1] in self._stop:
            a = a[:-1]
        if a and a[-1] == self._speech.im_end_token_id:  # type: ignore[union-attr]
            a = a[:-1]
        return a

    def _readable(self) -> list[int]:
        """The tokens certainly spoken whatever comes next: a trailing droppable token (at most two) held back."""
        held = 0
        while held < min(2, len(self.generated)) and self.generated[-1 - held] in self._droppable:
            held += 1
        return self.generated[:len(self.generated) - held]

    def _run(self) -> Iterator[np.ndarray]:
        answer = self.answer() if self._finished else self._readable()
        if not answer:
            return
        if self._tokens is None or len(answer) > 1 + len(self._rows.rows):  # rows of answer tokens 1.. to add
            made = self._make(np.asarray(answer, np.int64))
            if self._tokens is None:
                self._start(made)
            trailing = np.asarray(made.trailing)
            self._rows.rows += list(trailing[len(self._rows.rows):-1])  # its last row: text_eos
        if self._finished and len(self._rows.rows) == len(answer) - 1:
            self._rows.rows.append(self._eos_row)
        while not self._talker_done:
            step = len(self.talker_tokens) - 1  # the step the next token needs (its row: trailing[step])
            if not self._finished and step >= self._rows.shape[0]:
                return
            token = next(self._tokens, None)  # type: ignore[arg-type]
            if token is None:
                self._talker_done = True
                break
            self.talker_tokens.append(int(token))
            if self._held is not None:
                yield from self._sent(self._stream.push([self._held]))
            self._held = int(token)
        if not self._flushed:
            self._flushed = True
            yield from self._sent(self._stream.finish())

    def _sent(self, chunks: list[np.ndarray]) -> Iterator[np.ndarray]:
        for pcm in chunks:
            self.samples += int(pcm.shape[0])
            yield pcm

    def _start(self, made: Any) -> None:
        """The talker's prefill: the prompt with the answer's first token (as `speak` builds it)."""
        speech = self._speech
        config = speech.talker.config  # type: ignore[union-attr]
        self._eos_row = np.asarray(made.trailing[-1])
        self._tokens = talker_forward.greedy_tokens(
            config, speech.params, made.rows, made.positions, self._rows,  # type: ignore[union-attr]
            made.text_pad,
            prompt_ids=made.prompt_ids, max_new_tokens=self._max_new_tokens,
            repetition_penalty=self._penalty, suppress=[config.codec_bos_id], policy=self._policy)
