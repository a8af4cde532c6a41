"""Reading tool calls out of a model's answer, whole and as it streams (`omnijax.serve.tool_calls` checks the tools
themselves). Pure: the standard library only.

The calls are parsed in the layout the Qwen2/2.5/3 templates ask for (and Hermes-style models emit)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` reads the answer's text as it arrives:

- text before the first `<tool_call>` is content (streamed at once, except trailing whitespace and what may be the
  start of the tag, which wait for the next text; content ending where a call starts loses its trailing whitespace);
- a call starts once `{"name": "<one of the request's tools>", "arguments": ` and the `{` opening the arguments are
  read (keys in that order, as the templates ask); its `arguments` are the model's JSON object text as generated,
  streamed as it arrives, ended by the brace that balances the first (strings and escapes respected), and then
  `</tool_call>` closes the call. As with OpenAI's models, the arguments are what the model wrote: a client should
  validate them against the schema;
- a `<tool_call>` that is not followed by that header (another layout, an unknown function name, more than 256
  characters before the arguments) is text;
- text after the first call is dropped (OpenAI's messages hold content before calls only), and with
  `parallel_tool_calls` false everything after the first call is (`done`: the server stops decoding);
- an answer that ends inside a call's arguments leaves that call `truncated` (the finish reason stays the engine's,
  "length"); a whole answer with complete calls finishes with "tool_calls".

Pushing the text in any pieces gives the same deltas concatenated as pushing it whole (`parse_tool_calls`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Collection

__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolCallParser", "new_call_id", "parse_tool_calls"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER_LIMIT = 256  # characters between <tool_call> and the arguments' "{" before the block is taken as text


def new_call_id() -> str:
    """A fresh tool-call id, `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass
class ToolCall:
    """One call read from the answer: `id`, `name`, `arguments` (the JSON text so far), `complete` once its
    arguments' object is closed."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def openai(self) -> dict:
        """As a chat-completions `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _header(text: str) -> tuple[str, str | None, int]:
    """Reads `{"name": "<name>", "arguments": {` at the start of `text` (whitespace between tokens): ("match", name,
    index of the arguments' `{`), ("partial", None, 0) when `text` may still become one, or ("no", None, 0)."""
    i, name = 0, None
    for step in ("{", '"name"', ":", None, ",", '"arguments"', ":", "{"):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return "partial", None, 0
        if step is None:  # the function's name in quotes
            if text[i] != '"':
                return "no", None, 0
            j = i + 1
            while j < len(text) and text[j] != '"':
                if not (text[j].isascii() and (text[j].isalnum() or text[j] in "_-")) or j - i > 64:
                    return "no", None, 0
                j += 1
            if j >= len(text):
                return "partial", None, 0
            name, i = text[i + 1:j], j + 1
            continue
        piece = text[i:i + len(step)]
        if piece != step[:len(piece)]:
            return "no", None, 0
        if len(piece) < len(step):
            return "partial", None, 0
        i += len(step)
    return ("match", name, i - 1) if name else ("no", None, 0)


class ToolCallParser:
    """Reads tool calls out of an answer's text as it arrives (the module docstring has the rules).

    `push(text)` and `finish()` return the deltas to send, in order, each either `{"content": str}` or one call's
    `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}` (its start) or
    `{"tool_calls": [{"index", "function": {"arguments": str}}]}` (more of its arguments).

    Args:
        names: the functions the request offers (a call of another is text).
        max_calls: the most calls to read (None: any); once read, `done` is true and the rest is dropped.
        new_id: makes each call's id (default `new_call_id`).

    Attributes:
        calls: the `ToolCall`s read so far.
        content: the content sent so far.
    """

    def __init__(self, names: Collection[str], *, max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id):
        self.names, self.max_calls, self.new_id = frozenset(names), max_calls, new_id
        self.calls: list[ToolCall] = []
        self.content = ""
        self._state, self._buffer, self._gap = "text", "", ""
        self._depth, self._string, self._escape = 0, False, False

    @property
    def done(self) -> bool:
        """`max_calls` calls were read and closed: the rest of the answer is not wanted."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls and self._state == "text" \
            and bool(self.calls) and self.calls[-1].complete

    @property
    def truncated(self) -> bool:
        """The answer ended (or stands) inside a call's arguments."""
        return bool(self.calls) and not self.calls[-1].complete

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" when the answer holds complete calls, else `reason` (the answer's own)."""
        return "tool_calls" if self.calls and not self.truncated else reason

    def message_content(self) -> str | None:
        """The content of the whole answer's message: None when it is calls only."""
        return None if self.calls and not self.content else self.content

    def push(self, text: str) -> list[dict]:
        """The deltas `text` (the answer's next text) completes."""
        out: list[dict] = []
        self._buffer += text
        while self._buffer and not self.done:
            if not getattr(self, "_" + self._state)(out):
                break
        if self.done:
            self._buffer = ""
        return out

    def finish(self) -> list[dict]:
        """The deltas left when the answer has ended: held text, or a `<tool_call>` that never became a call."""
        out: list[dict] = []
        if self._state == "header":  # a header cut short (it holds no "<"): the tag and it are text
            self._say(out, self._gap + OPEN)
            self._state = "text"
        if self._state == "text":
            self._text(out, final=True)
        self._buffer = ""
        return out

    def _say(self, out: list[dict], text: str) -> None:
        if text and not self.calls:
            self.content += text
            out.append({"content": text})

    def _text(self, out: list[dict], final: bool = False) -> bool:
        buf = self._buffer
        at = buf.find(OPEN)
        if at >= 0:
            before = buf[:at].rstrip()
            self._say(out, before)
            self._gap = buf[len(before):at]  # whitespace before the tag: dropped if a call starts, else text
            self._state, self._buffer = "header", buf[at + len(OPEN):]
            return True
        if final:
            self._say(out, buf)
            self._buffer = ""
            return False
        keep = next((k for k in range(min(len(OPEN) - 1, len(buf)), 0, -1) if OPEN.startswith(buf[-k:])), 0)
        head = buf[:len(buf) - keep]
        sent = head.rstrip()
        self._say(out, sent)
        self._buffer = buf[len(sent):]
        return False

    def _header(self, out: list[dict]) -> bool:
        status, name, end = _header(self._buffer)
        if status == "partial" and len(self._buffer) <= _HEADER_LIMIT:
            return False
        allowed = self.max_calls is None or len(self.calls) < self.max_calls
        if status != "match" or name not in self.names or not allowed:
            # Not a call: the tag is text, and what follows is read as text again.
            self._say(out, self._gap + OPEN)
            self._state = "text"
            return True
        call = ToolCall(len(self.calls), self.new_id(), str(name))
        self.calls.append(call)
        out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})
        self._state, self._buffer = "arguments", self._buffer[end:]
        self._depth, self._string, self._escape = 0, False, False
        return True

    def _arguments(self, out: list[dict]) -> bool:
        buf, i = self._buffer, 0
        while i < len(buf):
            c = buf[i]
            i += 1
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    break
        call = self.calls[-1]
        call.arguments += buf[:i]
        out.append({"tool_calls": [{"index": call.index, "function": {"arguments": buf[:i]}}]})
        self._buffer = buf[i:]
        if self._depth == 0:
            call.complete = True
            self._state = "after"
            return True
        return False

    def _after(self, out: list[dict]) -> bool:
        at = self._buffer.find(CLOSE)
        if at < 0:
            self._buffer = self._buffer[-(len(CLOSE) - 1):]
            return False
        self._state, self._buffer = "text", self._buffer[at + len(CLOSE):]
        return True


def parse_tool_calls(text: str, names: Collection[str], *, max_calls: int | None = None,
                     new_id: Callable[[], str] = new_call_id) -> ToolCallParser:
    """The whole answer `text` read by a `ToolCallParser` (its `calls`, `message_content()`, `finish_reason`)."""
    parser = ToolCallParser(names, max_calls=max_calls, new_id=new_id)
    parser.push(text)
    parser.finish()
    return parser
