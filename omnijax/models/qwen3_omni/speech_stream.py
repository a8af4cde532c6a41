"""Qwen3-Omni speech while the thinker still writes its answer: `AnswerSpeech` takes the answer's tokens as the
thinker decodes them (`push`, then `finish`) and returns PCM chunks as soon as the talker and Code2Wav have them.

Why the talker can start early: the reference's talker reads the answer one text row per decoding step (its prompt
holds the assistant prefix and the answer's first token; step t adds the projected embedding row of answer token
t + 1, then `tts_eos` once, then `tts_pad`). So talker step t needs answer token t + 1, or the knowledge that the
answer ended there, and nothing later. `AnswerSpeech` runs every step the tokens pushed so far allow and leaves the
rest for the next `push`; at `finish` it appends `tts_eos` and runs the talker to its end. Its tokens, codes and PCM
are those of `speech.speak_streamed` on the finished answer (the same prompt rows, positions and trailing rows, one
`talker_step` per frame; the trailing rows are projected in pieces as they arrive, equal to the one-shot projection
up to float rounding).

What is spoken is the answer `omnijax.Chat` speaks: a final stop token dropped, then a final `<|im_end|>` (as
`speak` drops it). Until `finish`, a trailing token that might be dropped is held back (at most two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from omnijax.models.family import OmniModel
from omnijax.models.qwen3_omni import talker_decode, talker_forward
from omnijax.models.qwen3_omni.code2wav import Code2Wav
from omnijax.models.qwen3_omni.code2wav_decode import FrameChunks
from omnijax.models.speech import token_ids

__all__ = ["AnswerSpeech"]


class AnswerSpeech:
    """One answer spoken while it is written (see the module's docstring).

    Args:
        model: a loaded Qwen3-Omni checkpoint with speech output (`model.speech`).
        talker: `talker(answer_ids)` -> the talker's frames of a `speak` call on this prompt, voice, limit, media
            and sampling with `answer_ids` as the answer (`speech._talker`'s `frames` partial of
            `talker_decode.greedy_frames`); it raises `speak`'s refusals.
        code2wav: the checkpoint's Code2Wav.
        im_end: the thinker's `<|im_end|>` id (a final one is not spoken).
        stand_in: a plain text id standing in for the first answer token while checking the prompt.
        first_chunk, chunk: Code2Wav's chunks in frames, as `speech.speak_streamed`.
        stop: the thinker's stop ids: a final one is not spoken.

    Raises:
        Every refusal of `speech.speak` about the prompt, voice, media rows and limits, at construction (checked
        with the stand-in first answer token), and ValueError for a `first_chunk` or `chunk` below 1.
    """

    def __init__(self, model: OmniModel, talker: Callable[[Sequence[int]], functools.partial], *,
                 code2wav: Code2Wav, im_end: int, stand_in: int, first_chunk: int = 4, chunk: int = 25,
                 stop: Sequence[int] = ()):
        talker([stand_in])  # checks the prompt, voice, media and limits now
        self._chunks = FrameChunks(code2wav, first_chunk, chunk)
        self._model, self._talker, self._im_end = model, talker, int(im_end)
        self._stop = frozenset(int(s) for s in stop)
        self._droppable = self._stop | {self._im_end}
        self.generated: list[int] = []  # every token pushed
        self.samples = 0  # PCM samples returned so far
        self._rows: list[Any] = []  # projected rows of answer tokens 1.. (then tts_eos once finished)
        self._decode: talker_decode.TalkerDecode | None = None
        self._pad_row: Any = None
        self._eos_row: Any = None
        self._finished = self._flushed = False

    @property
    def talker_tokens(self) -> list[int]:
        """The talker's tokens so far (empty before the first answer token)."""
        return [] if self._decode is None else list(self._decode.tokens)

    def push(self, tokens: Sequence[int]) -> Iterator[np.ndarray]:
        """Adds answer tokens as the thinker decoded them (checked at the call); the iterator returned runs the
        talker steps they allow, yielding each PCM chunk (float32, 24 kHz) as soon as it is decoded. An iterator
        left unfinished loses nothing: the next `push` or `finish` carries on."""
        self._add(tokens)
        return self._run()

    def finish(self, tokens: Sequence[int] = ()) -> Iterator[np.ndarray]:
        """Adds the answer's last `tokens` and ends it; the iterator returned runs the talker (reading `tts_eos`,
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
        if a and a[-1] == self._im_end:
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
        if self._decode is None:
            self._start(answer[0])
        decode = self._decode
        assert decode is not None
        new = answer[1 + len(self._rows):]
        if new:
            embeds = self._model.decoder.embed_tokens(jnp.asarray(new, jnp.int32)[None])[0]
            self._rows += list(talker_forward.project_text(decode.config, decode.params, embeds))
        if self._finished and len(self._rows) == len(answer) - 1:
            self._rows.append(self._eos_row)
        while not decode.done:
            if decode.step < len(self._rows):
                row = self._rows[decode.step]
            elif self._finished:
                row = self._pad_row
            else:
                return
            pcm = self._chunks.add(decode.advance(row))
            if pcm is not None:
                self.samples += int(pcm.shape[0])
                yield pcm
        if not self._flushed:
            self._flushed = True
            pcm = self._chunks.flush()
            if pcm is not None:
                self.samples += int(pcm.shape[0])
                yield pcm

    def _start(self, first: int) -> None:
        """The talker's prefill: the prompt with the answer's first token (as `speak` builds it)."""
        frames = self._talker([first])
        config, params, rows, positions, trailing, pad_row = frames.args
        self._eos_row, self._pad_row = trailing[-1], pad_row  # trailing of a one-token answer: tts_eos alone
        self._decode = talker_decode.TalkerDecode(config, params, rows, positions, **{
            k: frames.keywords[k] for k in ("max_new_tokens", "suppress", "sampling", "policy")})
