"""One served session's conversation as engine-sized chunks: chat-template text turns, media units, answer prompts.

The Metronome engine takes one chunk of at most `chunk_tokens` (T) tokens per session per tick. A `Conversation`
turns what a client sends into such chunks, in the order they are to be fed:

- text messages (system, user, assistant) are the checkpoint's chat-template rendering of the conversation past
  what was fed (`omnijax.chat.template_delta`, as `omnijax.Chat` feeds them);
- images and audio are the model family's streaming units (`omnijax.models.frontend`), between text turns;
- a response starts with the template's generation prompt, whose last part asks for the first answer tokens;
- every chunk longer than T is cut by `omnijax.chunks.chunk.split_chunk` into parts that stream exactly as the whole.

Every method checks and builds before it records anything: a refused message (`ValueError`, `ChatTemplateError`)
leaves the conversation as it was. The conversation knows no engine and no transport.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.chat import template_delta
from omnijax.models.frontend import units_for
from omnijax.chunks.chunk import Chunk, split_chunk
from omnijax.chunks.spans import SpanKind

ROLES = {"system": SpanKind.SYSTEM, "user": SpanKind.TEXT, "assistant": SpanKind.RESPONSE}


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A response's generation prompt: its parts (the last asks for the answer) and the answer's unit id."""

    parts: list[Chunk]
    answer_unit: int


class Conversation:
    """The chunks of one session's conversation (see the module docstring).

    Args:
        model: the served `omnijax.Model` (its family picks the unit builder).
        tokenizer: the checkpoint's `omnijax.models.tokenizer.Tokenizer` (its chat template renders text turns).
        chunk_tokens: T, the most tokens of one part.
    """

    def __init__(self, model, tokenizer, chunk_tokens: int):
        if tokenizer is None:
            raise ValueError("serving conversations needs the checkpoint's tokenizer: copy tokenizer.json and "
                             "tokenizer_config.json of the release into the converted checkpoint")
        self.units, self.tokenizer, self.chunk_tokens = units_for(model), tokenizer, int(chunk_tokens)
        self.eos = tuple(int(t) for t in model.config.eos_token_ids)
        self.messages: list[dict] = []
        self.rendered = ""  # the template text fed so far
        self.next_unit = 0
        self.tokens_fed = 0

    def state(self) -> dict:
        """What resumes this conversation (JSON data): messages, the rendering fed, the unit counter."""
        return {"messages": self.messages, "rendered": self.rendered, "next_unit": self.next_unit,
                "tokens_fed": self.tokens_fed}

    def restore(self, state: dict) -> None:
        """Continues from `state()` of a snapshotted conversation (of the same model and template)."""
        self.messages = [dict(m) for m in state["messages"]]
        self.rendered, self.next_unit = str(state["rendered"]), int(state["next_unit"])
        self.tokens_fed = int(state["tokens_fed"])

    def _parts(self, chunk: Chunk) -> list[Chunk]:
        parts = split_chunk(chunk, self.chunk_tokens)
        self.tokens_fed += int(np.asarray(chunk.valid).sum())
        return parts

    def message(self, role: str, text: str) -> list[Chunk]:
        """A system, user or assistant message (an assistant message is fed as though the model had said it)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; a served conversation takes {', '.join(ROLES)}")
        if not isinstance(text, str):
            raise ValueError(f"message content must be text, got {type(text).__name__}")
        message = {"role": role, "content": text}
        ids, rendered = template_delta(self.tokenizer, self.rendered, self.messages + [message],
                                       generation_prompt=False)
        if not ids:
            raise ValueError(f"the chat template renders this {role} message as nothing new")
        chunk = self.units.text(ids, self.next_unit, ROLES[role])
        self.messages.append(message)
        self.rendered, self.next_unit = rendered, self.next_unit + 1
        return self._parts(chunk)

    def image(self, image: np.ndarray) -> list[Chunk]:
        """One `[H, W, 3]` uint8 image (a video frame too) as the family's image unit."""
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"an image is [H, W, 3] (RGB), got shape {image.shape}")
        chunk = self.units.image(image, self.next_unit)
        self.next_unit += 1
        return self._parts(chunk)

    def audio(self, pcm: np.ndarray, sample_rate: int = 16_000) -> list[Chunk]:
        """Mono float PCM as the family's audio unit."""
        pcm = np.asarray(pcm, np.float32)
        if pcm.ndim != 1 or pcm.size == 0:
            raise ValueError(f"audio is mono PCM [samples] with at least one sample, got shape {pcm.shape}")
        chunk = self.units.audio(pcm, sample_rate, self.next_unit)
        self.next_unit += 1
        return self._parts(chunk)

    def prompt(self, answer_tokens: int) -> Prompt:
        """The generation prompt of a response; its last part asks for `answer_tokens` (>= 1) answer tokens.

        A template that adds nothing (the prompt already ends the text fed) gives one empty part that continues
        from the logits after the last token fed.
        """
        ids, rendered = template_delta(self.tokenizer, self.rendered, self.messages, generation_prompt=True)
        unit = self.next_unit
        if ids:
            chunk = self.units.text(ids, unit, SpanKind.TEXT, answer_tokens=answer_tokens)
            answer_unit = int(np.asarray(chunk.answer_unit)[0])
            parts = self._parts(chunk)
        else:
            answer_unit = unit
            parts = [self.units.continuation(unit, answer_tokens)]
        self.rendered, self.next_unit = rendered, answer_unit + 1
        return Prompt(parts, answer_unit)

    def continuation(self, answer_unit: int, answer_tokens: int) -> Chunk:
        """An empty chunk asking for `answer_tokens` more tokens of the answer `answer_unit`."""
        return self.units.continuation(answer_unit, answer_tokens)

    def answered(self, tokens: list[int]) -> str:
        """Records a response's tokens (possibly none, possibly cut short) as an assistant message; returns its
        text. What was decoded stays in the cache, so the next message follows it."""
        ended = bool(tokens) and tokens[-1] in self.eos
        content = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": content})
        self.rendered += self.tokenizer.decode(tokens)
        return content
