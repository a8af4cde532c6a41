"""langchain-openai's `ChatOpenAI` against `omnijax serve` (issue 37 item 7): invoke, stream, `stop`, and tool
calling through `bind_tools`. The plain answers come from the demo model (per-request sampling, temperature 0), the
tool calls from the scripted server (`tests.serve.tool_server`: temperature 0 answers with text then one call,
temperature 1 in words, temperature 2 with two calls), each started once for this module. LangChain sends one
request at a time (streams are read to their end), so the engines decode few rows per tick: more rows would only
decode the 152K-wide lm_head for nothing. The tool server decodes one (`buckets=(1,)`, test_openai_tools' tick), the
demo server two (`buckets=(2,)`: test_lm_eval's tick, so that a cold run compiles one program for both, not two).

LangChain is imported by the tests that use it, not when the module is collected: every xdist worker collects every
module, and langchain-openai with what it imports (langchain-core, langsmith, aiohttp) costs ~0.9 CPU s that only the
worker running these tests needs."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest

if importlib.util.find_spec("langchain_openai") is None:  # as pytest.importorskip, without importing it
    pytest.skip("langchain-openai (the `test` extra) is the client under test", allow_module_level=True)
pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

from tests._support.demo_server import demo_server  # noqa: E402
from tests.serve.tool_server import WEATHER, tool_server  # noqa: E402

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

QUESTION = "Tell me about the weather in Paris."
MAX_TOKENS = 16


def _chat(base_url: str, **kwargs) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="omnijax", base_url=base_url, api_key="unused", max_retries=0, timeout=300,
                      **{"temperature": 0, "max_tokens": MAX_TOKENS, **kwargs})


@pytest.fixture(scope="module")
def llm():
    """`ChatOpenAI` on the demo model with per-request sampling (RowSampling, as `omnijax serve` runs)."""
    from omnijax.decoding import RowSampling

    with demo_server(decoding=RowSampling(), max_output_tokens=64, buckets=(2,)) as server:
        yield _chat(server.base_url)


@pytest.fixture(scope="module")
def tools_url(tmp_path_factory):
    """The scripted server's base URL."""
    with tool_server(tmp_path_factory.mktemp("tools")) as server:
        yield server.base_url


def _stop_inside(text: str) -> str:
    """A one-character stop string found in `text` after its first character (printable, not whitespace, not the
    replacement character a split UTF-8 sequence decodes to)."""
    for ch in text[1:]:
        if ch.isprintable() and not ch.isspace() and ch != "\ufffd":
            return ch
    raise AssertionError(f"no usable stop string in the demo model's answer {text!r}")


def test_invoke_stream_and_stop(llm):
    """invoke gives an AIMessage with the answer, its finish reason and usage; stream's chunks join to the same
    answer (temperature 0) and, asked for, its usage; `invoke(..., stop=[s])` ends before the first `s` of the
    unstopped answer, streamed too."""
    from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage

    whole = llm.invoke([HumanMessage(QUESTION)])
    assert isinstance(whole, AIMessage) and isinstance(whole.content, str) and whole.content
    assert whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == MAX_TOKENS
    assert llm.invoke(QUESTION).content == whole.content  # a plain string is a user message: the same prompt

    chunks = list(llm.stream(QUESTION, stream_usage=True))  # asks for stream_options.include_usage
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == whole.content
    joined = sum(chunks[1:], chunks[0])
    assert joined.usage_metadata is not None and joined.usage_metadata["output_tokens"] == MAX_TOKENS

    stop = _stop_inside(whole.content)
    stopped = llm.invoke(QUESTION, stop=[stop])
    assert stopped.content == whole.content[:whole.content.index(stop)]
    assert stopped.response_metadata["finish_reason"] == "stop"
    streamed = "".join(c.content for c in llm.stream(QUESTION, stop=[stop]))
    assert streamed == stopped.content


def test_bind_tools_parses_the_call(tools_url):
    """bind_tools sends the tool; the AIMessage's tool_calls carry its name and parsed arguments (whole and
    streamed: the chunks' tool-call pieces join to the same call), the text before the call is the content."""
    llm = _chat(tools_url, max_tokens=200).bind_tools([WEATHER])
    answer = llm.invoke(QUESTION)
    assert answer.content == "Let me check."
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    [call] = answer.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris", "days": [1, 2]}
    assert call["id"].startswith("call_") and not answer.invalid_tool_calls

    chunks = list(llm.stream(QUESTION))
    assert sum(1 for c in chunks if c.tool_call_chunks) >= 3  # the arguments arrive in pieces
    joined = sum(chunks[1:], chunks[0])
    assert joined.content == "Let me check."
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [("get_weather", {"city": "Paris", "days": [1, 2]})]


def test_two_calls_and_the_tool_result_round_trip(tools_url):
    """Two calls in one answer come back as two tool_calls; LangChain's history with the AIMessage and a
    ToolMessage per call is accepted, and the model's answer in words comes back as plain content."""
    from langchain_core.messages import HumanMessage, ToolMessage

    two = _chat(tools_url, max_tokens=200, temperature=2).bind_tools([WEATHER]).invoke(QUESTION)
    assert [c["args"]["city"] for c in two.tool_calls] == ["Paris", "Oslo"]
    assert len({c["id"] for c in two.tool_calls}) == 2

    history = [HumanMessage(QUESTION), two,
               *(ToolMessage(f"sunny in {c['args']['city']}", tool_call_id=c["id"]) for c in two.tool_calls)]
    reply = _chat(tools_url, max_tokens=200, temperature=1).bind_tools([WEATHER]).invoke(history)
    assert reply.content == "It is sunny in Paris." and not reply.tool_calls
    assert reply.response_metadata["finish_reason"] == "stop"
    assert reply.usage_metadata is not None and reply.usage_metadata["input_tokens"] > 0
