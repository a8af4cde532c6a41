"""A conversation as chunks, shared by `omnijax.Chat` and `omnijax serve`: chat-template text turns, media units,
answer prompts. It knows no session, no engine and no transport.

A `Conversation` turns messages and media into chunks in the order they are to be fed, each cut to at most
`chunk_tokens` (T) tokens when T is given (the Metronome engine takes one chunk of at most T tokens per session per
tick; `Chat` feeds whole chunks):

- text messages (system, user, assistant, and tool results) are the checkpoint's chat-template rendering of the
  conversation past what was fed (`template_delta`); an assistant message may carry `tool_calls` and a tool message
  its `tool_call_id`, as transformers' chat templates take them;
- tools (`set_tools`, function definitions as transformers' `apply_chat_template(..., tools=...)` takes them) are
  rendered by the template in every rendering, so they must be set before anything is fed;
- images and audio are the model family's streaming units (`omnijax.models.frontend`), between text turns;
- a response starts with the template's generation prompt, whose last part asks for the first answer tokens;
- every chunk longer than T is cut by `omnijax.chunks.chunk.split_chunk` into parts that stream exactly as the whole.

Every method checks and builds before it records anything: a refused message (`ValueError`, `ChatTemplateError`)
leaves the conversation as it was. The conversation knows no engine and no transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omnijax.chunks.chunk import Chunk, split_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.family import OmniModel, family_of
from omnijax.models.frontend import units_for
from omnijax.models.tokenizer import Tokenizer

ROLES = {"system": SpanKind.SYSTEM, "user": SpanKind.TEXT, "assistant": SpanKind.RESPONSE, "tool": SpanKind.TEXT}
# Keys a message may carry besides role and content: an assistant's tool calls, a tool result's call id.
MESSAGE_EXTRAS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}
_PROBE_TOOL = {"type": "function", "function": {"name": "omnijax_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class ChatTemplateError(ValueError):
    """The chat template cannot render the conversation as one that only grows (see `template_delta`)."""


class ToolsUnsupported(ChatTemplateError):
    """The chat template does not render tools (`check_template_tools`)."""


def check_template_tools(tokenizer: Tokenizer) -> None:
    """Refuses a chat template that does not render tools: one that fails with them, or whose rendering of a user
    message with a probe tool does not show the tool's name (a template without a tools section ignores them).

    Raises:
        ToolsUnsupported: naming the tokenizer's source.
    """
    message = [{"role": "user", "content": "?"}]
    where = tokenizer.source or "this tokenizer"
    try:
        rendered = tokenizer.render(message, add_generation_prompt=True, tools=[_PROBE_TOOL])
    except ValueError as e:  # TokenizerError too
        raise ToolsUnsupported(f"the chat template of {where} does not render tools ({e})") from None
    if _PROBE_TOOL["function"]["name"] not in rendered:
        raise ToolsUnsupported(f"the chat template of {where} does not render tools (it has no tools section: "
                               f"a tool's name does not appear in its prompt)")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A response's generation prompt: its parts (the last asks for the answer) and the answer's unit id."""

    parts: list[Chunk]
    answer_unit: int


@dataclasses.dataclass(frozen=True)
class PreparedAsk:
    """A question built but not yet recorded: its prompt, the user message, the rendering after it, its unit."""

    prompt: Prompt
    message: dict
    rendered: str
    unit: int


class Conversation:
    """The chunks of one session's conversation (see the module docstring).

    Args:
        model: the loaded model (its family picks the unit builder and the template defaults).
        tokenizer: the checkpoint's `omnijax.models.tokenizer.Tokenizer` (its chat template renders text turns).
        chunk_tokens: T, the most tokens of one part; None feeds every chunk whole.
        template_variables: chat-template variables for every rendering, over the family's `template_defaults`
            (MiniCPM-o 4.5 renders with `enable_thinking=False`, as its release does; `{"enable_thinking": True}`
            asks for thinking).

    Attributes:
        tokenizer: `tokenizer` rendering with the family's defaults and `template_variables`.
    """

    def __init__(self, model: OmniModel, tokenizer: Tokenizer | None, chunk_tokens: int | None = None, *,
                 template_variables: Mapping[str, Any] | None = None):
        if tokenizer is None:
            raise ValueError("a conversation needs the checkpoint's tokenizer: copy tokenizer.json and "
                             "tokenizer_config.json of the release into the converted checkpoint")
        self.units = units_for(model)
        family = family_of(model)
        defaults = {**(family.template_defaults if family is not None else {}), **(template_variables or {})}
        self.tokenizer = tokenizer.with_template_defaults(defaults) if defaults else tokenizer
        self.chunk_tokens = None if chunk_tokens is None else int(chunk_tokens)
        self.eos = tuple(int(t) for t in model.config.eos_token_ids)
        self.messages: list[dict] = []
        self.rendered = ""  # the template text fed so far
        self.next_unit = 0
        self.tokens_fed = 0
        self.tools: list[dict] | None = None  # rendered by the template in every rendering (`set_tools`)

    def state(self) -> dict:
        """What resumes this conversation (JSON data): messages, the rendering fed, the unit counter."""
        state = {"messages": self.messages, "rendered": self.rendered, "next_unit": self.next_unit,
                 "tokens_fed": self.tokens_fed}
        if self.tools is not None:
            state["tools"] = self.tools
        return state

    def restore(self, state: dict) -> None:
        """Continues from `state()` of a snapshotted conversation (of the same model and template)."""
        self.messages = [dict(m) for m in state["messages"]]
        self.rendered, self.next_unit = str(state["rendered"]), int(state["next_unit"])
        self.tokens_fed = int(state["tokens_fed"])
        self.tools = [dict(t) for t in state["tools"]] if state.get("tools") else None

    def set_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        """Renders `tools` (`[{"type": "function", "function": {"name", "description", "parameters"}}, ...]`; None
        or empty: none) in every later rendering. The templates render tools at the conversation's start, so they can
        only be set (or changed) before anything was rendered; the same tools again change nothing.

        Raises:
            ToolsUnsupported: the template does not render tools.
            ChatTemplateError: the tools would change a conversation already fed.
        """
        new = [dict(t) for t in tools] if tools else None
        if new == self.tools:
            return
        if self.rendered:
            raise ChatTemplateError("the tools cannot change once the conversation has started: the chat template "
                                    "renders them at its start and the cache only grows; set them before the first "
                                    "message")
        if new is not None:
            check_template_tools(self.tokenizer)
        self.tools = new
    def _split(self, chunk: Chunk) -> list[Chunk]:
        return [chunk] if self.chunk_tokens is None else split_chunk(chunk, self.chunk_tokens)

    def _parts(self, chunk: Chunk) -> list[Chunk]:
        parts = self._split(chunk)
        self.tokens_fed += int(np.asarray(chunk.valid).sum())
        return parts

    @staticmethod
    def check_message(message: dict) -> None:
        """Refuses what is not `{"role": system|user|assistant|tool, "content": text}` (an assistant message may
        carry a list of `tool_calls`, a tool message must carry a string `tool_call_id`)."""
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"a message is a dict with 'role' and 'content', got {message!r}")
        if message["role"] not in ROLES:
            raise ValueError(f"unknown chat role {message['role']!r}; a conversation takes {', '.join(ROLES)}")
        extra = set(message) - {"role", "content", *MESSAGE_EXTRAS.get(message["role"], ())}
        if extra:
            raise ValueError(f"a {message['role']} message takes no {', '.join(sorted(extra))}")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ValueError("a tool message needs the 'tool_call_id' (a string) of the call it answers")
        if "tool_calls" in message and not isinstance(message["tool_calls"], list):
            raise ValueError(f"'tool_calls' must be a list, got {type(message['tool_calls']).__name__}")
        if not isinstance(message["content"], str):
            raise ValueError(f"message content must be text (media are units of their own), got "
                             f"{type(message['content']).__name__}")

    def message(self, role: str, text: str, **extras: Any) -> list[Chunk]:
        """A system, user, assistant or tool message (an assistant message is fed as though the model had said it).
        `extras`: an assistant's `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments":
        dict}}]`), a tool message's `tool_call_id`."""
        message = {"role": role, "content": text, **extras}
        self.check_message(message)
        ids, rendered = template_delta(self.tokenizer, self.rendered, self.messages + [message],
                                       generation_prompt=False, tools=self.tools)
        if not ids:
            raise ChatTemplateError(f"the chat template renders this {role} message as nothing new")
        chunk = self.units.text(ids, self.next_unit, ROLES[role])
        self.messages.append(message)
        self.rendered, self.next_unit = rendered, self.next_unit + 1
        return self._parts(chunk)

    def prepare_ask(self, text: str, answer_tokens: int) -> "PreparedAsk":
        """Checks and builds a question without recording it: a user message and the generation prompt after it,
        in one unit whose last part asks for `answer_tokens` (>= 1) answer tokens (how `Chat.ask` feeds a
        question). `record(prepared)` records it once it is fed."""
        message = {"role": "user", "content": text}
        self.check_message(message)
        ids, rendered = template_delta(self.tokenizer, self.rendered, self.messages + [message],
                                       generation_prompt=True, tools=self.tools)
        chunk = self.units.text(ids, self.next_unit, SpanKind.TEXT, answer_tokens=answer_tokens)
        answer_unit = int(np.asarray(chunk.answer_unit)[0])
        return PreparedAsk(Prompt(self._split(chunk), answer_unit), message, rendered, self.next_unit)

    def record(self, prepared: "PreparedAsk") -> None:
        """Records a question `prepare_ask` built, once its chunks are fed."""
        self.messages.append(prepared.message)
        self.rendered, self.next_unit = prepared.rendered, prepared.prompt.answer_unit + 1
        self.tokens_fed += sum(int(np.asarray(part.valid).sum()) for part in prepared.prompt.parts)

    def ask(self, text: str, answer_tokens: int) -> Prompt:
        """`prepare_ask`, recorded at once."""
        prepared = self.prepare_ask(text, answer_tokens)
        self.record(prepared)
        return prepared.prompt

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

    def av(self, frames: np.ndarray, pcm: np.ndarray, **video_kwargs: Any) -> list[Chunk]:
        """Video frames `[n, H, W, 3]` and the 16 kHz mono PCM of the same stretch of time as the family's
        audiovisual unit."""
        chunk = self.units.av(frames, pcm, self.next_unit, **video_kwargs)
        self.next_unit += 1
        return self._parts(chunk)

    def prompt(self, answer_tokens: int) -> Prompt:
        """The generation prompt of a response; its last part asks for `answer_tokens` (>= 1) answer tokens.

        A template that adds nothing (the prompt already ends the text fed) gives one empty part that continues
        from the logits after the last token fed.
        """
        ids, rendered = template_delta(self.tokenizer, self.rendered, self.messages, generation_prompt=True,
                                       tools=self.tools)
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

    def answered(self, tokens: list[int], stop_ids: tuple[int, ...] | None = None) -> str:
        """Records a response's tokens (possibly none, possibly cut short) as an assistant message; returns its
        text. A last token in `stop_ids` (default the model's end-of-sequence ids) ends the answer and is not part
        of its text. What was decoded stays in the cache, so the next message follows it."""
        ended = bool(tokens) and tokens[-1] in (self.eos if stop_ids is None else stop_ids)
        content = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": content})
        self.rendered += self.tokenizer.decode(tokens)
        return content


def template_delta(tokenizer: Tokenizer, fed: str, messages: Sequence[Mapping[str, Any]], *,
                   generation_prompt: bool, tools: Sequence[Mapping[str, Any]] | None = None
                   ) -> tuple[list[int], str]:
    """Token ids of the chat template's rendering of `messages` (with `tools`, when given) past what was fed, and
    the whole rendering.

    When the rendering fed so far (`fed`) is a prefix of the new one, the new part is the rest. A template that
    re-renders earlier turns once a message follows (Qwen3's drops the reasoning block of earlier answers) gets the
    last message's own rendering, provided the whole conversation's rendering ends with it: the earlier turns stay
    in the cache as the model saw them when it answered. Otherwise `ChatTemplateError`.
    """
    rendered = tokenizer.render(messages, add_generation_prompt=generation_prompt, tools=tools)
    if rendered.startswith(fed):
        delta = rendered[len(fed):]
    else:
        delta = tokenizer.render(messages[-1:], add_generation_prompt=generation_prompt, tools=tools)
        if not rendered.endswith(delta):
            at = next((i for i, (a, b) in enumerate(zip(rendered, fed)) if a != b), 0)
            raise ChatTemplateError(
                f"the chat template renders the earlier conversation differently once this message is added "
                f"(they part at character {at}: fed {fed[at:at + 40]!r}, now {rendered[at:at + 40]!r}), and the "
                f"message's own rendering is not how the conversation's ends; only what is new is fed, and one "
                f"cannot rewrite the cache")
    return (tokenizer.encode(delta) if delta else []), rendered
