"""Function calling on the Realtime API through the openai SDK (issue 37 item 2): session tools, the model's call as a
`function_call` item with its arguments streamed, the tool's result fed back as a `function_call_output` item and
answered, and bad tools refused with an `error` naming the field while the session stays as it was. The answers are
scripted (`tests.serve.tool_server`)."""

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")

from tests.serve.tool_server import WEATHER, tool_server  # noqa: E402

TOOL = {"type": "function", **WEATHER["function"]}
ASK = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tool_server(tmp_path_factory.mktemp("realtime-tools")) as running:
        yield running


async def _until(conn, kind):
    events = []
    async for event in conn:
        events.append(event)
        if event.type == kind:
            return events
    raise AssertionError(f"the connection closed before {kind}")


async def _call_then_answer(server, result, bad=True):
    """One session: tools set (after refused updates when `bad`), a call, the tool's `result`, an answer."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    out = {}
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        if bad:
            out["errors"] = []
            for session in ({"tools": [{**TOOL, "parameters": {"type": "object",
                                                                 "properties": {"city": {"type": "town"}}}}]},
                            {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
                            {"tools": [TOOL], "tool_choice": "required"}):
                await conn.session.update(session={"type": "realtime", **session})
                out["errors"].append((await _until(conn, "error"))[-1].error)
        await conn.session.update(session={"type": "realtime", "tools": [TOOL], "tool_choice": "auto"})
        out["updated"] = (await _until(conn, "session.updated"))[-1]
        await conn.conversation.item.create(item=ASK)
        await conn.response.create()
        out["call"] = await _until(conn, "response.done")
        done = out["call"][-1].response
        call = next(item for item in done.output if item.type == "function_call")
        if bad:
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_nope",
                                                      "output": "x"})
            out["errors"].append((await _until(conn, "error"))[-1].error)
            await conn.session.update(session={"type": "realtime", "tools": []})
            out["errors"].append((await _until(conn, "error"))[-1].error)
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                  "output": result})
        out["output"] = await _until(conn, "conversation.item.done")
        await conn.session.update(session={"type": "realtime", "omnijax": {"temperature": 1}})  # the answer's script
        await _until(conn, "session.updated")
        await conn.response.create()
        out["answer"] = await _until(conn, "response.done")
    return out


def test_a_call_its_result_and_the_answer(server):
    out = asyncio.run(_call_then_answer(server, "sunny"))
    assert [t.name for t in out["updated"].session.tools] == ["get_weather"]
    assert out["updated"].session.tool_choice == "auto"
    events = out["call"]
    done = events[-1].response
    assert done.status == "completed" and [item.type for item in done.output] == ["message", "function_call"]
    message, call = done.output
    assert message.content[0].text == "Let me check." and call.name == "get_weather"
    assert call.status == "completed" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": [1, 2]}
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and "".join(e.delta for e in deltas) == call.arguments  # streamed tick by tick
    assert all(e.item_id == call.id and e.call_id == call.call_id and e.output_index == 1 for e in deltas)
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (args_done.name, args_done.arguments, args_done.call_id) == (call.name, call.arguments, call.call_id)
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta") < \
        kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me check."

    added = out["output"][0]
    assert added.type == "conversation.item.added" and added.item.type == "function_call_output"
    assert added.item.call_id == call.call_id and added.item.output == "sunny"
    answer = out["answer"][-1].response
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output[0].content[0].text == "It is sunny in Paris."
    assert not [e for e in out["answer"] if e.type.startswith("response.function_call")]


def test_bad_tools_are_refused_by_name_and_change_nothing(server):
    out = asyncio.run(_call_then_answer(server, "sunny"))
    params = [(e.code, e.param) for e in out["errors"]]
    assert params == [("invalid_value", "session.tools[0].parameters.properties.city.type"),
                      ("invalid_value", "session.tool_choice"), ("unsupported", "session.tool_choice"),
                      ("invalid_value", "item.call_id"), ("unsupported", "session.tools")], params
    assert "'get_time'" in out["errors"][1].message and "started" in out["errors"][4].message
    # the session kept its tools: the call was still read, and the answer followed the tool's result
    assert out["call"][-1].response.output[1].type == "function_call"
    assert out["answer"][-1].response.output[0].content[0].text == "It is sunny in Paris."


def test_the_result_is_fed_through_the_template(server):
    short = asyncio.run(_call_then_answer(server, "sunny", bad=False))
    long = asyncio.run(_call_then_answer(server, "sunny, 24 degrees, light wind from the west", bad=False))
    tokens = [out["answer"][-1].response.usage.input_tokens for out in (short, long)]
    assert tokens[1] > tokens[0]  # the tool message (and nothing else) differs


def test_a_template_without_tools_refuses_them_naming_the_model():
    from types import SimpleNamespace

    from omnijax.conversation import Conversation
    from omnijax.serve.realtime import client_events as rte
    from omnijax.serve.realtime.tools import apply_tools
    from tests._support.demo_server import demo_model

    model = demo_model()  # its ChatML template has no tools section
    session = SimpleNamespace(conversation=Conversation(model, model.tokenizer),
                              options=SimpleNamespace(model_name="tiny-demo"))
    with pytest.raises(rte.RealtimeEventError) as e:
        apply_tools(session, rte.SessionSettings(tools=(dict(WEATHER["function"]),)), "evt_1")
    event = e.value.to_event()
    assert event["error"]["param"] == "session.tools" and "'tiny-demo'" in event["error"]["message"]
    assert "does not render tools" in event["error"]["message"] and session.conversation.tools is None


def test_session_tools_and_call_ids_survive_a_snapshot():
    import dataclasses

    from omnijax.serve.realtime import client_events as rte
    from omnijax.serve.realtime.resume import ResumeRefused, settings_of

    settings = rte.SessionSettings(tools=(dict(WEATHER["function"]),), tool_choice="none")
    saved = json.loads(json.dumps(dataclasses.asdict(settings)))
    assert settings_of(saved) == settings
    for bad in ({"tools": [{"name": "two words"}]}, {"tool_choice": "required"}):
        with pytest.raises(ResumeRefused):
            settings_of({**saved, **bad})


async def _two_calls_two_outputs(server):
    """One session: a response with two calls (the temperature-2 script), both answered by `function_call_output`
    items in a row, then a response in words (temperature 1). Returns every event after the calls' response."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    async with client.realtime.connect(model="omnijax") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "tools": [TOOL], "omnijax": {"temperature": 2}})
        await _until(conn, "session.updated")
        await conn.conversation.item.create(item=ASK)
        await conn.response.create()
        done = (await _until(conn, "response.done"))[-1].response
        calls = [item for item in done.output if item.type == "function_call"]
        for call in calls:
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": f"sunny in {json.loads(call.arguments)['city']}"})
        await conn.session.update(session={"type": "realtime", "omnijax": {"temperature": 1}})
        await conn.response.create()
        return calls, await _until(conn, "response.done")


def test_two_outputs_in_a_row_are_fed_together(server):
    """Two calls in one response, then their two `function_call_output` items, then `response.create`: the template
    puts consecutive tool results in one user turn, so they are fed together with the response's prompt (the second
    output was refused before: 'the chat template renders the earlier conversation differently'). The answer's
    input tokens are exactly the template's rendering of that one turn and the generation prompt."""
    from tests.serve.tool_server import SCRIPTS

    calls, events = asyncio.run(_two_calls_two_outputs(server))
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert [e.error for e in events if e.type == "error"] == []
    added = [e.item for e in events if e.type == "conversation.item.added" and e.item.type == "function_call_output"]
    assert [(i.call_id, i.output) for i in added] == [(c.call_id, f"sunny in {city}")
                                                     for c, city in zip(calls, ("Paris", "Oslo"))]
    done_ids = {e.item.id for e in events if e.type == "conversation.item.done"}
    assert {i.id for i in added} <= done_ids
    answer = events[-1].response
    assert answer.status == "completed" and answer.output[0].content[0].text == "It is sunny in Paris."

    tokenizer = server.context.conversation().tokenizer  # the served template (Qwen's layout of tool results)
    tools = [WEATHER]
    before = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": SCRIPTS[2]}]
    results = [{"role": "tool", "tool_call_id": c.call_id, "content": f"sunny in {city}"}
               for c, city in zip(calls, ("Paris", "Oslo"))]
    fed = tokenizer.render(before, add_generation_prompt=False, tools=tools)
    assert fed.endswith("<|im_end|>\n")
    fed = fed[:-1]  # the cache holds the answer as decoded, up to its end-of-turn token: the newline is new
    turn = tokenizer.render(before + results, add_generation_prompt=True, tools=tools)[len(fed):]
    assert turn.count("<|im_start|>user") == 1 and turn.count("<tool_response>") == 2
    assert answer.usage.input_tokens == len(tokenizer.encode(turn))
