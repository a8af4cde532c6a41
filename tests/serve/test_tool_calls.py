"""The tool-call parser and the tool field checks (`omnijax.serve.tool_calls`): many answers parsed whole, then
pushed in every split (the streamed deltas put together equal the whole parse), and bad tools refused by field."""

import itertools
import json

import pytest

from omnijax.serve import tool_calls as tc

NAMES = ("get_weather", "lookup", "f")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# text -> (message content, [(name, arguments)], whether the last call is cut short)
CASES = [
    ("Hello there.", "Hello there.", [], False),
    ("", "", [], False),
    ("  spaced  \n", "  spaced  \n", [], False),
    (CALL, None, [("get_weather", '{"city": "Paris"}')], False),
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", '{"city": "Paris"}')], False),
    ("Sure \n\n " + CALL + "\nand after", "Sure", [("get_weather", '{"city": "Paris"}')], False),
    (CALL + "\n" + CALL.replace("Paris", "Oslo"), None,
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')], False),
    ('<tool_call>{"name":"f","arguments":{}}</tool_call>', None, [("f", "{}")], False),
    ('<tool_call>{"name": "lookup", "arguments": {"q": "a } b { \\" ] [", "n": [1, {"x": [2]}]}}</tool_call>', None,
     [("lookup", '{"q": "a } b { \\" ] [", "n": [1, {"x": [2]}]}')], False),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>', None,
     [("f", '{"s": "</tool_call>"}')], False),
    ('<tool_call>{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')], True),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')], False),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', [], False),
    ('x <tool_call>{"arguments": {}, "name": "f"}</tool_call>',
     'x <tool_call>{"arguments": {}, "name": "f"}</tool_call>', [], False),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', [], False),
    ("a <tool_cal", "a <tool_cal", [], False),
    ("a\n<tool_call>\n{\"name\": \"get_", "a\n<tool_call>\n{\"name\": \"get_", [], False),
    ("<tool_call>" + " " * 300 + "{}", "<tool_call>" + " " * 300 + "{}", [], False),
    ("héllo ✓ <tool_callx> ok", "héllo ✓ <tool_callx> ok", [], False),
]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _assemble(deltas):
    """The content and calls a client builds from the deltas (as the openai SDK's stream helper does)."""
    content, calls = "", {}
    for delta in deltas:
        assert len(delta) == 1, delta
        if "content" in delta:
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in call:
            assert entry["id"] is None and call["type"] == "function", "a call starts once"
            entry["id"], entry["name"] = call["id"], call["function"]["name"]
        entry["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _stream(pieces, **kwargs):
    parser = tc.ToolCallParser(NAMES, new_id=_ids(), **kwargs)
    deltas = [d for piece in pieces for d in parser.push(piece)] + parser.finish()
    return parser, deltas


@pytest.mark.parametrize("text, content, calls, truncated", CASES)
def test_whole_parse(text, content, calls, truncated):
    parser = tc.parse_tool_calls(text, NAMES, new_id=_ids())
    assert parser.message_content() == content
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    assert parser.truncated == truncated
    assert parser.finish_reason("stop") == ("tool_calls" if calls and not truncated else "stop")
    for call in parser.calls:
        if call.complete:
            assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("text, content, calls, truncated", CASES)
def test_every_split_streams_the_whole_parse(text, content, calls, truncated):
    whole = tc.parse_tool_calls(text, NAMES, new_id=_ids())
    expected = (whole.content, [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [list(text), [text[i:i + 3] for i in range(0, len(text), 3)]]
    for pieces in splits:
        parser, deltas = _stream(pieces)
        assert _assemble(deltas) == expected, pieces
        assert [(c.name, c.arguments, c.complete) for c in parser.calls] == \
            [(c.name, c.arguments, c.complete) for c in whole.calls]


def test_text_streams_before_the_call_and_arguments_as_they_arrive():
    parser = tc.ToolCallParser(NAMES, new_id=_ids())
    assert parser.push("Let me ") == [{"content": "Let me"}]  # the trailing space waits for what follows
    assert parser.push("check. <tool") == [{"content": " check."}]
    assert parser.push('_call>{"name": "f", "argu') == []
    start = parser.push('ments": {"a": ')
    assert start == [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]},
                     {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}]
    assert parser.push("1}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    assert parser.push("}</tool_call>") == [] and parser.finish() == []
    assert parser.finish_reason("stop") == "tool_calls" and parser.message_content() == "Let me check."


def test_one_call_when_parallel_calls_are_off():
    text = CALL + CALL.replace("Paris", "Oslo") + "more"
    parser, deltas = _stream([text], max_calls=1)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}')] and parser.done
    tools = tc.Tools(({"name": "get_weather"},), "auto", parallel=False)
    assert tools.parser().max_calls == 1


@pytest.mark.parametrize("body, param, code", [
    ({"tools": {"type": "function"}}, "tools", "invalid_value"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "dict"}}}]},
     "tools[0].function.parameters.type", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": -1}}}}}]},
     "tools[0].function.parameters.properties.a.minLength", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "a"}}}]}, "tools[0].function.parameters.required", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"pattern": "("}}}}}]},
     "tools[0].function.parameters.properties.a.pattern", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict", "unsupported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools[0].function.x",
     "unknown_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "invalid_value"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice",
     "unsupported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "unsupported"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_value"),
])
def test_bad_tools_are_refused_by_field(body, param, code):
    with pytest.raises(tc.ToolError) as e:
        tc.chat_tools(body)
    assert (e.value.param, e.value.code) == (param, code), str(e.value)


def test_tools_and_choices_that_are_accepted():
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                               "days": {"type": ["integer", "null"], "minimum": 1}},
              "required": ["city"], "additionalProperties": False, "$defs": {"x": True}, "x-extension": 1}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": schema,
                                             "strict": False}}
    tools = tc.chat_tools({"tools": [tool], "parallel_tool_calls": False})
    assert tools.active and not tools.parallel and tools.names == ("get_weather",)
    assert tools.template_tools() == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": schema}}]
    off = tc.chat_tools({"tools": [tool], "tool_choice": "none"})
    assert not off.active and off.template_tools() is None
    assert tc.chat_tools({}) is None and tc.chat_tools({"tools": [], "tool_choice": "none"}) is None


def test_message_tool_fields():
    ids: set[str] = set()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    extras = tc.message_extras({"role": "assistant", "tool_calls": [call]}, "assistant", "messages[1]", ids)
    assert extras == {"tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": {"a": 1}}}]} and ids == {"call_1"}
    assert tc.message_extras({"role": "tool", "tool_call_id": "call_1"}, "tool", "messages[2]", ids) == \
        {"tool_call_id": "call_1"}
    for message, role, param in [
        ({"role": "tool"}, "tool", "messages[2].tool_call_id"),
        ({"role": "tool", "tool_call_id": "call_9"}, "tool", "messages[2].tool_call_id"),
        ({"role": "user", "tool_call_id": "call_1"}, "user", "messages[2].tool_call_id"),
        ({"role": "user", "tool_calls": [call]}, "user", "messages[2].tool_calls"),
        ({"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}]},
         "assistant", "messages[2].tool_calls[0].function.arguments"),
        ({"role": "assistant", "tool_calls": [{**call, "id": ""}]}, "assistant", "messages[2].tool_calls[0].id"),
        ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "assistant", "messages[2].tool_calls[0]"),
    ]:
        with pytest.raises(tc.ToolError) as e:
            tc.message_extras(message, role, "messages[2]", set(ids))
        assert e.value.param == param, (message, str(e.value))
