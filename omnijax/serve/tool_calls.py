"""Function calling for `omnijax serve`: the request's tools checked, and the model's tool calls parsed out of its
answer, whole and as it streams. Pure (the standard library only); the chat-completions route and the Realtime
session put it on their wire formats.

Tools are rendered by the checkpoint's own chat template (`omnijax.conversation.Conversation.set_tools`, as
transformers' `apply_chat_template(..., tools=...)`); a template that does not render them is refused by name.

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

Tool schemas (`parameters`) are checked structurally (`check_schema`): `jsonschema` is not a dependency of omnijax, so
the check covers what a JSON Schema's keywords must be (types, `properties`, `required`, `items`, combinators,
`enum`, numeric and length bounds, `pattern` a regular expression), recursively, and leaves unknown keywords alone (as
JSON Schema does).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolCallParser", "ToolError", "Tools", "chat_tools", "check_function",
           "check_functions", "check_schema", "message_extras", "new_call_id", "parse_arguments", "parse_tool_calls",
           "parse_tool_choice"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
_HEADER_LIMIT = 256  # characters between <tool_call> and the arguments' "{" before the block is taken as text
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class ToolError(ValueError):
    """Tools, a tool choice or a tool message the server refuses: `param` names the field, `code` is
    `invalid_value` or `unsupported`."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def new_call_id() -> str:
    """A fresh tool-call id, `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


# ------------------------------------------------------------------------------------------------- schemas, tools
def check_schema(schema: Any, param: str, depth: int = 0) -> None:
    """Refuses what cannot be a JSON Schema (see the module docstring), naming the first bad keyword by its path.

    Raises:
        ToolError: naming `param` + the keyword's path.
    """
    if depth > 32:
        raise ToolError(f"'{param}' nests schemas deeper than 32 levels", param)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ToolError(f"'{param}' must be a JSON Schema (an object), got {type(schema).__name__}", param)

    def fail(key: str, want: str) -> None:
        raise ToolError(f"'{param}.{key}' is not a JSON Schema {key}: it must be {want}, got "
                        f"{json.dumps(schema[key])[:60]}", f"{param}.{key}")

    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or any(k not in _TYPES for k in kinds) or len(set(map(str, kinds))) != len(kinds):
            fail("type", f"one of {', '.join(_TYPES)} or a list of distinct ones")
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if key in schema:
            if not isinstance(schema[key], dict):
                fail(key, "an object of schemas")
            for name, sub in schema[key].items():
                check_schema(sub, f"{param}.{key}.{name}", depth + 1)
    for key in ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
        if key in schema:
            if key in ("items", "additionalItems") and isinstance(schema[key], list):
                for i, sub in enumerate(schema[key]):
                    check_schema(sub, f"{param}.{key}[{i}]", depth + 1)
            else:
                check_schema(schema[key], f"{param}.{key}", depth + 1)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                fail(key, "a non-empty list of schemas")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{param}.{key}[{i}]", depth + 1)
    if "required" in schema:
        req = schema["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req) or len(set(req)) != len(req):
            fail("required", "a list of distinct property names")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        fail("enum", "a non-empty list")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, (int, float))):
            fail(key, "a number")
    for key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            fail(key, "an integer >= 0")
    for key in ("title", "description", "format", "$ref", "$schema", "$id"):
        if key in schema and not isinstance(schema[key], str):
            fail(key, "a string")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except (re.error, TypeError):
            fail("pattern", "a regular expression")


def check_function(function: Any, param: str) -> dict:
    """One function's definition `{"name", "description"?, "parameters"?, "strict"?}` as the template renders it
    (`strict` is refused when true: nothing constrains decoding).

    Raises:
        ToolError: naming the field.
    """
    if not isinstance(function, dict):
        raise ToolError(f"'{param}' must be an object with a 'name'", param)
    for key in function:
        if key not in ("name", "description", "parameters", "strict"):
            raise ToolError(f"unknown parameter '{param}.{key}'", f"{param}.{key}", "unknown_parameter")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(f"'{param}.name' must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{param}.name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ToolError(f"'{param}.description' must be a string", f"{param}.description")
    if function.get("strict"):
        raise ToolError(f"'{param}.strict' = true is not supported: this server does not constrain decoding to the "
                        f"schema (the arguments are what the model writes); omit it or send false",
                        f"{param}.strict", "unsupported")
    out: dict = {"name": name}
    if function.get("description") is not None:
        out["description"] = function["description"]
    parameters = function.get("parameters")
    if parameters is not None:
        check_schema(parameters, f"{param}.parameters")
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"'{param}.parameters' must be an object schema (\"type\": \"object\")",
                            f"{param}.parameters")
        out["parameters"] = parameters
    return out


def parse_tool_choice(choice: Any, names: Collection[str], param: str, *, named: Callable[[Any], Any]) -> str:
    """`"none"`, `"auto"` (default), or refused: `"required"` and a named function (`named(choice)` returns the
    name, or None when `choice` is not of that form) are checked, then refused as `unsupported`: without constrained
    decoding the server could only ask the model in the prompt, not enforce it.

    Raises:
        ToolError: an unknown value, a name that is not one of `names`, or an unsupported choice.
    """
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    name = named(choice)
    if choice != "required" and name is None:
        raise ToolError(f"'{param}' must be \"none\", \"auto\", \"required\" or names a function, got "
                        f"{json.dumps(choice)[:80]}", param)
    if name is not None and name not in names:
        raise ToolError(f"'{param}' names the function {name!r}, which is not one of the tools "
                        f"({', '.join(sorted(names)) or 'none given'})", param)
    what = "\"required\"" if name is None else f"the function {name!r}"
    raise ToolError(f"'{param}' = {what} is not supported: without constrained decoding this server cannot make "
                    f"the model call a tool, only offer them; send \"auto\" (or \"none\")", param, "unsupported")


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's (or a Realtime session's) function tools.

    Attributes:
        functions: the functions' definitions (`check_function`).
        choice: "auto" (the tools are rendered and calls parsed) or "none" (neither).
        parallel: more than one call per answer (`parallel_tool_calls`); false keeps the first and ends the answer.
    """

    functions: tuple = ()
    choice: str = "auto"
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["name"] for f in self.functions)

    @property
    def active(self) -> bool:
        """Whether the tools are rendered into the prompt and calls parsed from the answer."""
        return bool(self.functions) and self.choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (`[{"type": "function", "function": {...}}]`), None when not
        active."""
        return [{"type": "function", "function": dict(f)} for f in self.functions] if self.active else None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.names, max_calls=None if self.parallel else 1)


def check_functions(functions: list[dict], param: str) -> tuple[dict, ...]:
    """Refuses more than `MAX_TOOLS` functions or two of the same name."""
    if len(functions) > MAX_TOOLS:
        raise ToolError(f"'{param}' holds {len(functions)} tools, over the {MAX_TOOLS} a request may have", param)
    seen: set[str] = set()
    for i, f in enumerate(functions):
        if f["name"] in seen:
            raise ToolError(f"'{param}[{i}]': two tools are named {f['name']!r}", f"{param}[{i}].name")
        seen.add(f["name"])
    return tuple(functions)


def parse_arguments(arguments: Any, param: str) -> dict:
    """A call's `arguments` JSON text as the object a chat template renders."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ToolError(f"'{param}' must be a JSON object as a string, got {str(arguments)[:60]!r}", param)
    return value


# -------------------------------------------------------------------------------------- chat-completions fields
def _named_chat(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return choice["function"].get("name")
    return None


def chat_tools(body: dict) -> Tools | None:
    """A chat-completions request's `tools`, `tool_choice` and `parallel_tool_calls` (`[{"type": "function",
    "function": {...}}]`); None when it has no tools (a `tool_choice` other than "none" or "auto" is then refused).

    Raises:
        ToolError: naming the field.
    """
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise ToolError(f"'tools' must be a list of tools, got {type(tools).__name__}", "tools")
    functions = []
    for i, tool in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"'{param}.type' must be \"function\" (the only kind of tool this server runs)",
                            f"{param}.type")
        for key in tool:
            if key not in ("type", "function"):
                raise ToolError(f"unknown parameter '{param}.{key}'", f"{param}.{key}", "unknown_parameter")
        functions.append(check_function(tool.get("function"), f"{param}.function"))
    functions_ = check_functions(functions, "tools")
    choice = parse_tool_choice(choice, {f["name"] for f in functions_}, "tool_choice", named=_named_chat)
    if not functions_:
        return None
    return Tools(functions_, choice, True if parallel is None else parallel)


def message_extras(message: dict, role: str, param: str, call_ids: set[str]) -> dict:
    """The tool fields of one chat message as a chat template takes them: an assistant's `tool_calls` (their ids
    are added to `call_ids`) as `[{"id", "type": "function", "function": {"name", "arguments": object}}]`, a tool
    message's `tool_call_id` (which must answer an earlier call, as OpenAI requires). Empty for other messages.

    Raises:
        ToolError: naming the field.
    """
    calls, call_id = message.get("tool_calls"), message.get("tool_call_id")
    if calls is not None and role != "assistant":
        raise ToolError(f"'{param}.tool_calls' is only allowed in assistant messages", f"{param}.tool_calls")
    if call_id is not None and role != "tool":
        raise ToolError(f"'{param}.tool_call_id' is only allowed in tool messages", f"{param}.tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise ToolError(f"'{param}.tool_call_id' is required in a tool message: the id of the call it answers",
                            f"{param}.tool_call_id")
        if call_id not in call_ids:
            raise ToolError(f"'{param}.tool_call_id' {call_id!r} answers no tool call of an earlier assistant "
                            f"message", f"{param}.tool_call_id")
        return {"tool_call_id": call_id}
    if not calls:
        if calls is not None and not isinstance(calls, list):
            raise ToolError(f"'{param}.tool_calls' must be a list", f"{param}.tool_calls")
        return {}
    if not isinstance(calls, list):
        raise ToolError(f"'{param}.tool_calls' must be a list", f"{param}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        p = f"{param}.tool_calls[{j}]"
        if not isinstance(call, dict) or call.get("type") != "function" or not isinstance(call.get("function"), dict):
            raise ToolError(f"'{p}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                            f"\"arguments\"}}}}", p)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise ToolError(f"'{p}.id' must be a non-empty string", f"{p}.id")
        for key in call:
            if key not in ("id", "type", "function"):
                raise ToolError(f"unknown parameter '{p}.{key}'", f"{p}.{key}", "unknown_parameter")
        function = call["function"]
        for key in function:
            if key not in ("name", "arguments"):
                raise ToolError(f"unknown parameter '{p}.function.{key}'", f"{p}.function.{key}",
                                "unknown_parameter")
        if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
            raise ToolError(f"'{p}.function.name' must be 1-64 letters, digits, '_' or '-'", f"{p}.function.name")
        arguments = parse_arguments(function.get("arguments"), f"{p}.function.arguments")
        call_ids.add(call["id"])
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return {"tool_calls": out}


# ------------------------------------------------------------------------------------------------------- parsing
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
