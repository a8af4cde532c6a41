"""Several tool results in a row (the answers to parallel tool calls, as LangChain and the openai SDK send them) on
`/v1/chat/completions`: Qwen's templates put consecutive tool messages in one user turn, so the first one's rendering
changes once the second follows; the request's messages are fed so that the cache holds the template's rendering of
the whole conversation (it was refused with a 400: "the chat template renders the earlier conversation differently
once this message is added")."""

from __future__ import annotations

import pytest

from omnijax.serve import chat_completions as cc
from tests.serve.tool_server import WEATHER

USER = {"role": "user", "content": "What is the weather in Paris and Oslo?"}
CALLS = [{"id": f"call_{city}", "type": "function",
          "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}} for city in ("Paris", "Oslo")]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """The demo checkpoint with the tools template (Qwen's layout of tool messages)."""
    import omnijax
    from omnijax.testing.scripted import tool_checkpoint
    from tests._support.demo_server import demo_checkpoint

    return omnijax.load(tool_checkpoint(demo_checkpoint(), tmp_path_factory.mktemp("tools") / "checkpoint"))


def _fed(model, messages):
    """What `build_prompt` feeds for a request of `messages` with the weather tool: the conversation's rendering."""
    from omnijax.conversation import Conversation
    from omnijax.decoding import Greedy

    req = cc.parse_chat_request({"model": "m", "messages": messages, "tools": [WEATHER]}, model_name="m",
                                decoding=Greedy())
    conversation = Conversation(model, model.tokenizer)
    parts, prompt = cc.build_prompt(conversation, req, 4, "tiny-demo")
    assert parts and prompt.parts
    return conversation


@pytest.mark.parametrize("results", [1, 2], ids=["one result", "two results"])
@pytest.mark.parametrize("after", [False, True], ids=["last", "then a user message"])
def test_tool_results_in_a_row_are_fed_as_the_template_renders_them(tools_model, results, after):
    """One or two tool results after an assistant's calls (then, or not, a user message): the rendering fed is the
    template's rendering of every message with the generation prompt, and the conversation records each message."""
    assistant = {"role": "assistant", "content": None, "tool_calls": CALLS[:results]}
    tools = [{"role": "tool", "tool_call_id": c["id"], "content": f"sunny in {c['id'][5:]}"} for c in CALLS[:results]]
    messages = [USER, assistant, *tools, *([{"role": "user", "content": "Thanks."}] if after else [])]
    conversation = _fed(tools_model, messages)
    assert [m["role"] for m in conversation.messages] == [m["role"] for m in messages]
    whole = tools_model.tokenizer.render(conversation.messages, add_generation_prompt=True,
                                         tools=conversation.tools)
    assert conversation.rendered == whole
    assert whole.count("<tool_response>") == results
    assert whole.count("<|im_start|>user") == 2 + after  # the results share one user turn


def test_a_tool_result_in_text_parts_is_fed_as_the_template_renders_it(tools_model):
    """A tool result whose content is a list of text parts: each part a tool message of the same call, in a row."""
    assistant = {"role": "assistant", "content": None, "tool_calls": CALLS[:1]}
    tool = {"role": "tool", "tool_call_id": CALLS[0]["id"],
            "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "24 degrees"}]}
    conversation = _fed(tools_model, [USER, assistant, tool])
    assert [m["content"] for m in conversation.messages[2:]] == ["sunny", "24 degrees"]
    assert conversation.rendered == tools_model.tokenizer.render(conversation.messages, add_generation_prompt=True,
                                                                 tools=conversation.tools)
