"""Qwen2.5-Omni speech that starts while the thinker still writes the answer, from the rows the stream computed.

The talker reads, per thinker token, the thinker's final-normed last-layer row plus its embedding (`talker_forward`'s
module docstring); its step k adds answer token k + 1's row. `omnijax.Chat` decodes the answer in blocks through the
streamed step with `tap_answer=True` (`omnijax.streaming.step.chunk_step`), which returns each fed answer token's
final-normed row as the answer loop computed it (`ChunkOutput.answer_rows`); `AnswerSpeech.push(tokens, rows)` hands a
block's tokens and rows to the talker, which runs every step they allow, and Token2Wav (`token2wav_stream`) turns its
codes into PCM chunks. So speech begins after the answer's first block, and the thinker never runs again over the
answer. The embedding rows are recomputed here from the token ids (`Decoder.embed_tokens`, a row lookup: the same
values the step fed, and half the rows the step would otherwise return).

The prompt's rows come from one thinker forward over the prompt (`talker_forward.thinker_rows`, full attention, the
media units' rows at their placeholders), run at the first block. Rows are read as they are computed, so nothing the
thinker's retention evicts later is needed by the talker; under a policy that trims during the answer, the answer's
rows are those of the bounded cache the text was written from (not the reference's full-attention rows).

Exact by construction: the talker is `talker_forward.TalkerDecode`, stepped with the same rows in the same order
whether they arrive block by block (`push`, then `finish`) or all at once (`finish` alone): the codes and the PCM are
bit-for-bit equal (tests/chat/test_chat_speak_early_qwen25.py). Against the finish-first path of `speak` (one
forward over prompt and answer, equal to transformers): the answer's rows differ by float rounding (the chunked paged
stream against one full forward: 5.6e-6 on rows reaching 3.4 in that test, an answer crossing a 64-token page), so
the codes agree unless a talker logit is that close to a tie.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.models.family import OmniModel
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStream
from omnijax.models.speech import token_ids

__all__ = ["AnswerSpeech", "answer_talker_rows"]


def answer_talker_rows(model: OmniModel, tokens: Any, rows: Any, placeholders: Sequence[int] = ()
                       ) -> tuple[np.ndarray, jax.Array, jax.Array, jax.Array]:
    """Answer tokens and their final-normed thinker rows (`ChunkOutput.answer_rows`, `FrameOutput.answer_rows`),
    checked, as the talker reads them: `(ids [n], embeds [n, Dt], hidden [n, Dt], talker rows [n, Dt] float32)`, the
    talker row of a token its final-normed row plus its embedding (`talker_forward.talker_prompt`'s sum; the
    embedding recomputed from the id, `Decoder.embed_tokens`). `AnswerSpeech` and the engine's speech pool
    (`omnijax.serve.engine.speech_qwen25`) both compute them here, so their talkers read the same values.

    Raises:
        ValueError: ids outside the vocabulary, rows not `[n, hidden_size]`, a media placeholder id (`placeholders`)
            in the answer.
    """
    ids = token_ids("tokens", np.asarray(list(tokens), np.int64), model.config.vocab_size)
    width = model.config.hidden_size
    if rows is None or len(np.shape(rows)) != 2 or np.shape(rows) != (ids.size, width):
        raise ValueError(f"rows must be [{ids.size}, {width}] (each token's final-normed row, "
                         f"ChunkOutput.answer_rows), got {None if rows is None else np.shape(rows)}")
    held = {int(i) for i in placeholders} & {int(t) for t in ids}
    if held:
        raise ValueError(f"the answer holds multimodal placeholder ids {sorted(held)}; an answer is text")
    decoder = model.decoder
    embeds = decoder.embed_tokens(jnp.asarray(ids[None], jnp.int32))[0]
    hidden = jnp.asarray(rows, decoder.config.jnp_dtype)
    return ids, embeds, hidden, (hidden + embeds).astype(jnp.float32)  # as talker_forward.talker_prompt sums them


class AnswerSpeech:
    """One answer spoken while it is written, from the stream's rows (module docstring); built, its arguments
    checked, by `Qwen25Speech.tapped_answer_stream`.

    Args:
        model: a loaded Qwen2.5-Omni checkpoint with speech output (`model.speech`).
        prepare: `prepare(first_answer_id [1], (embeds [1, Dt], hidden [1, Dt]))` -> the talker's input
            (`speech.talker_input` of the prompt, voice and media with those answer rows): the prefill rows and
            positions, `trailing[-1]` the `text_eos` row, `text_pad`, the talker's prompt ids. It raises `speak`'s
            refusals of the media rows.
        stream: the utterance's `Token2WavStream`.
        max_new_tokens: talker tokens at most.
        policy: the talker's KV policy (None: unbounded).
        droppable: thinker ids not spoken when they end the answer (its stop ids and `<|im_end|>`).
        placeholders: the media placeholder ids (refused in an answer).
    """

    def __init__(self, model: OmniModel, prepare: Callable[..., Any], stream: Token2WavStream, *,
                 max_new_tokens: int, policy: Any = None, droppable: Sequence[int] = (),
                 placeholders: Sequence[int] = ()):
        speech = model.speech
        self._model, self._prepare, self._stream, self._policy = model, prepare, stream, policy
        self._talker, self._params = speech.talker.config, speech.params  # type: ignore[union-attr]
        self._max_new_tokens = int(max_new_tokens)
        self._droppable = frozenset(int(s) for s in droppable)
        self._placeholders = frozenset(int(i) for i in placeholders)
        self.generated: list[int] = []  # every token pushed
        self.samples = 0  # PCM samples returned so far
        self._first: tuple[jax.Array, jax.Array] | None = None  # answer token 0's embedding and final-normed rows
        self._rows: list[jax.Array] = []  # talker rows of every pushed token (hidden + embedding, float32)
        self._input: Any = None  # the talker's input (`speech.TalkerInput`) once the first row is known
        self._decode: talker_forward.TalkerDecode | None = None
        self._held: int | None = None  # the talker's last token: spoken once the next shows it was not the last
        self._finished = self._flushed = False

    @property
    def talker_tokens(self) -> list[int]:
        """The talker's tokens so far (empty before the first answer token)."""
        return [] if self._decode is None else list(self._decode.tokens)

    def answer(self) -> list[int]:
        """The answer spoken: every token pushed, without a final stop id or `<|im_end|>`."""
        ids = self.generated
        return ids[:-1] if self._finished and ids and ids[-1] in self._droppable else list(ids)

    def push(self, tokens: Sequence[int], rows: Any) -> Iterator[np.ndarray]:
        """Adds answer tokens and their final-normed rows `[len(tokens), Dt]` as the stream computed them
        (`ChunkOutput.answer_rows`, checked at the call); the iterator returned runs the talker steps they allow,
        yielding each PCM chunk (float32, 24 kHz) as soon as Token2Wav decodes it. An iterator left unfinished
        loses nothing: the next `push` or `finish` carries on."""
        self._add(tokens, rows)
        return self._run()

    def finish(self, tokens: Sequence[int] = (), rows: Any = None) -> Iterator[np.ndarray]:
        """Adds the answer's last `tokens` (and their rows) and ends it; the iterator returned runs the talker to its
        end (reading `text_eos`, then `text_pad`), yielding the remaining PCM chunks."""
        self._add(tokens, rows)
        self._finished = True
        return self._run()

    def _add(self, tokens: Sequence[int], rows: Any) -> None:
        if self._finished:
            raise ValueError("this answer has ended (finish was called): nothing more can be added")
        if not len(tokens):
            return
        ids, embeds, hidden, talker_rows = answer_talker_rows(self._model, tokens, rows, self._placeholders)
        if self._first is None:
            self._first = (embeds[:1], hidden[:1])
        self._rows += list(talker_rows)
        self.generated += [int(t) for t in ids]

    def _run(self) -> Iterator[np.ndarray]:
        n = len(self.answer())  # the answer rows the talker may read now
        if self._decode is None:
            if not n:
                if self._finished:  # nothing to speak
                    yield from self._flush()
                return
            yield from self._start()
        decode = self._decode
        assert decode is not None and self._input is not None
        while not decode.done:
            k = len(decode.tokens) - 1  # this step adds answer row k + 1, then text_eos, then text_pad
            if k + 1 < n:
                row = self._rows[k + 1]
            elif not self._finished:
                return  # waits for the next block
            else:
                row = self._input.trailing[-1] if k + 1 == n else self._input.text_pad
            yield from self._spoken(decode.step(row))
        yield from self._flush()

    def _start(self) -> Iterator[np.ndarray]:
        """The talker's prefill once the first answer token's row is known."""
        assert self._first is not None
        self._input = self._prepare(np.asarray(self.generated[:1]), self._first)
        config = self._talker
        self._decode = talker_forward.TalkerDecode(
            config, self._params, self._input.rows, self._input.positions, prompt_ids=self._input.prompt_ids,
            max_new_tokens=self._max_new_tokens, repetition_penalty=1.05, suppress=[config.codec_bos_id],
            policy=self._policy)
        yield from self._spoken(self._decode.tokens[0])

    def _spoken(self, token: int) -> Iterator[np.ndarray]:
        """A new talker token: the one before it is a code to speak (the last one, a stop id or cut by the limit,
        is not: `token2wav_stream.talker_pcm`)."""
        held, self._held = self._held, int(token)
        if held is not None:
            yield from self._counted(self._stream.push([held]))

    def _flush(self) -> Iterator[np.ndarray]:
        if not self._flushed and (self._finished or (self._decode is not None and self._decode.done)):
            self._flushed = True
            yield from self._counted(self._stream.finish())

    def _counted(self, chunks: list[np.ndarray]) -> Iterator[np.ndarray]:
        for pcm in chunks:
            self.samples += int(pcm.shape[0])
            yield pcm

