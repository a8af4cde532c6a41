"""Tool calling on `/v1/chat/completions` through the official openai SDK (issue 37 item 2): the answers are scripted
(`tests.serve.tool_server`), so the calls, their streaming, the tool-result round trip and the refusals are checked
on the real serving path."""

import json

import pytest

openai = pytest.importorskip("openai")

from omnijax.serve import chat_completions as cc  # noqa: E402
from tests.serve.tool_server import WEATHER, tool_server  # noqa: E402

USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # One row per tick: the SDK's client sends one request at a time (streams are read to their end), so a second
    # row would only decode the 152K-wide lm_head for nothing.
    with tool_server(tmp_path_factory.mktemp("tools")) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _ask(client, messages=(USER,), **kwargs):
    kwargs.setdefault("tools", [WEATHER])
    return client.chat.completions.create(model="omnijax", messages=list(messages), max_tokens=200, **kwargs)


def test_a_call_whole(client):
    answer = _ask(client)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": [1, 2]}


def test_a_call_streamed_equals_the_whole_answer(client):
    chunks = list(_ask(client, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check."
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert len(deltas) >= 3  # a start, then the arguments in pieces, tick by tick (TAU tokens each)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris", "days": [1, 2]}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The SDK's stream helper assembles the same message as the whole answer.
    with client.chat.completions.stream(model="omnijax", messages=[USER], tools=[WEATHER], max_tokens=200) as s:
        final = s.get_final_completion().choices[0]
    whole = _ask(client).choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_parallel_calls_and_one_call_only(client):
    reply = _ask(client, temperature=2)
    both = reply.choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in both.message.tool_calls] == ["Paris", "Oslo"]
    assert both.message.content is None and both.finish_reason == "tool_calls"
    assert len({c.id for c in both.message.tool_calls}) == 2
    one = _ask(client, temperature=2, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < reply.usage.completion_tokens  # decoding stopped after the first call
    streamed = [d for c in _ask(client, temperature=2, stream=True) if c.choices
                for d in (c.choices[0].delta.tool_calls or [])]
    assert sorted({d.index for d in streamed}) == [0, 1]


def test_tool_result_round_trip(client):
    call = _ask(client).choices[0].message.tool_calls[0]
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}]

    def answer(result):
        return _ask(client, [*history, {"role": "tool", "tool_call_id": call.id, "content": result}], temperature=1)

    short, long = answer("sunny"), answer("sunny, 24 degrees, light wind from the west, no rain until Friday")
    for reply in (short, long):
        assert reply.choices[0].message.content == "It is sunny in Paris."
        assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    # The tool's result is in the prompt, rendered by the template (a longer result, more prompt tokens).
    assert long.usage.prompt_tokens > short.usage.prompt_tokens


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(client):
    offered, off = _ask(client), _ask(client, tool_choice="none")
    assert off.usage.prompt_tokens < offered.usage.prompt_tokens  # the tools section is not in the prompt
    assert off.choices[0].finish_reason == "stop" and not off.choices[0].message.tool_calls
    assert "<tool_call>" in off.choices[0].message.content  # the model's text, as it wrote it
    plain = _ask(client, tools=openai.NOT_GIVEN)
    assert plain.usage.prompt_tokens == off.usage.prompt_tokens and not plain.choices[0].message.tool_calls


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": {"a": {"type": 3}}}}}]},
     "tools[0].function.parameters.properties.a.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "required": [1]}}}]},
     "tools[0].function.parameters.required"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [USER, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [USER, {"role": "tool", "content": "sunny", "tool_call_id": "call_x"}]},
     "messages[1].tool_call_id"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_input_is_refused_naming_the_field(client, kwargs, param):
    messages = kwargs.pop("messages", [USER])
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, messages, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert _ask(client).choices[0].finish_reason == "tool_calls"  # the server serves on


def test_a_template_without_tools_refuses_them_naming_the_model():
    from omnijax.conversation import Conversation
    from omnijax.decoding import Greedy
    from tests._support.demo_server import demo_model

    model = demo_model()  # the demo checkpoint's ChatML template has no tools section
    for body, param in [({"tools": [WEATHER]}, "tools"),
                        ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{}"}}]}]}, "messages[1]")]:
        req = cc.parse_chat_request({"model": "m", "messages": [USER], **body}, model_name="m", decoding=Greedy())
        conversation = Conversation(model, model.tokenizer)
        with pytest.raises(cc.RequestError) as e:
            cc.build_prompt(conversation, req, 4, "tiny-demo")
        assert e.value.param == param and "'tiny-demo'" in str(e.value) and "does not render tools" in str(e.value)
        assert conversation.rendered == "" and conversation.tools is None  # nothing was recorded
    plain = cc.parse_chat_request({"model": "m", "messages": [USER], "tools": [WEATHER], "tool_choice": "none"},
                                  model_name="m", decoding=Greedy())
    parts, _ = cc.build_prompt(Conversation(model, model.tokenizer), plain, 4, "tiny-demo")
    assert parts  # "none" asks for no tools: the template need not render them
