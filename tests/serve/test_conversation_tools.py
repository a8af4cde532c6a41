"""Tools in a conversation (`omnijax.conversation`): rendered by the chat template, refused by templates without
them and once the conversation has started, tool calls and results as messages, and kept by `state`/`restore`."""

import pytest

from omnijax.conversation import ChatTemplateError, Conversation, ToolsUnsupported, check_template_tools
from omnijax.models.chat_templates import MINICPMO_4_5_TEMPLATE
from omnijax.models.tokenizer import Tokenizer
from omnijax.testing.scripted import TOOLS_CHATML_TEMPLATE
from tests._support.demo_server import demo_model
from tests.serve.tool_server import WEATHER


def _tokenizer(template: str) -> Tokenizer:
    base = demo_model().tokenizer
    return Tokenizer(base.backend, chat_templates={"default": template}, special_tokens=base.special_tokens,
                     source="test-template")


def _text(conversation: Conversation, parts) -> str:
    return conversation.tokenizer.decode([int(t) for p in parts for t, v in zip(p.token_ids.reshape(-1),
                                                                                p.valid.reshape(-1)) if v])


def test_tools_are_rendered_and_calls_and_results_are_messages():
    conversation = Conversation(demo_model(), _tokenizer(TOOLS_CHATML_TEMPLATE))
    conversation.set_tools([WEATHER])
    fed = _text(conversation, conversation.message("user", "Weather in Paris?"))
    assert fed.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in fed
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    fed = _text(conversation, conversation.message("assistant", "", tool_calls=[call]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in fed
    fed = _text(conversation, conversation.message("tool", "sunny", tool_call_id="call_1"))
    assert fed == "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    state = conversation.state()
    again = Conversation(demo_model(), _tokenizer(TOOLS_CHATML_TEMPLATE))
    again.restore(state)
    assert again.tools == [WEATHER] and again.state() == state
    conversation.set_tools([WEATHER])  # the same tools again change nothing


def test_tools_cannot_change_once_the_conversation_started():
    conversation = Conversation(demo_model(), _tokenizer(TOOLS_CHATML_TEMPLATE))
    conversation.message("user", "hi")
    before = conversation.state()
    with pytest.raises(ChatTemplateError, match="cannot change once the conversation has started"):
        conversation.set_tools([WEATHER])
    assert conversation.state() == before and conversation.tools is None


@pytest.mark.parametrize("template, says", [(TOOLS_CHATML_TEMPLATE.replace("{%- if tools %}", "{%- if false %}"),
                                             "no tools section"),
                                            (MINICPMO_4_5_TEMPLATE, "does not render tools")])
def test_templates_without_tools_are_refused(template, says):
    conversation = Conversation(demo_model(), _tokenizer(template))
    with pytest.raises(ToolsUnsupported, match=says) as e:
        conversation.set_tools([WEATHER])
    assert "test-template" in str(e.value) and conversation.tools is None and conversation.rendered == ""
    check_template_tools(_tokenizer(TOOLS_CHATML_TEMPLATE))  # the tools template passes


@pytest.mark.parametrize("message, says", [({"role": "tool", "content": "x"}, "tool_call_id"),
                                           ({"role": "user", "content": "x", "tool_call_id": "c"}, "takes no"),
                                           ({"role": "assistant", "content": "", "tool_calls": {}}, "a list")])
def test_malformed_tool_messages_are_refused(message, says):
    with pytest.raises(ValueError, match=says):
        Conversation.check_message(message)
