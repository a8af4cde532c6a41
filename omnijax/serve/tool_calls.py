"""Function calling for `omnijax serve`: the request's tools checked, and the model's tool calls parsed out of its
answer, whole and as it streams. Pure (the standard library only); the chat-completions route and the Realtime
session put it on their wire formats.

Tools are rendered by the checkpoint's own chat template (`omnijax.conversation.Conversation.set_tools`, as
transformers' `apply_chat_template(..., tools=...)`); a template that does not render them is refused by name.

The model's calls are read from its answer by `omnijax.serve.tool_parser.ToolCallParser` (re-exported here), whole
and as the answer streams.

Tool schemas (`parameters`) are checked structurally (`check_schema`): `jsonschema` is not a dependency of omnijax, so
the check covers what a JSON Schema's keywords must be (types, `properties`, `required`, `items`, combinators,
`enum`, numeric and length bounds, `pattern` a regular expression), recursively, and leaves unknown keywords alone (as
JSON Schema does).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Collection
from typing import Any

from omnijax.serve.tool_parser import CLOSE, OPEN, ToolCall, ToolCallParser, new_call_id, parse_tool_calls

__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolCallParser", "ToolError", "Tools", "chat_tools", "check_function",
           "check_functions", "check_schema", "message_extras", "new_call_id", "parse_arguments", "parse_tool_calls",
           "parse_tool_choice"]

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class ToolError(ValueError):
    """Tools, a tool choice or a tool message the server refuses: `param` names the field, `code` is
    `invalid_value` or `unsupported`."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


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
