"""The chat-completions codec (`omnijax.serve.chat_completions`): requests parsed and refused with the field named, and
the objects it builds validated by the official `openai` SDK's types."""

import base64
import io
import wave

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from omnijax.decoding import Greedy, Sampling  # noqa: E402
from omnijax.media.audio import resample  # noqa: E402
from omnijax.serve import chat_completions as oh  # noqa: E402


def _wav(pcm: np.ndarray, rate: int, width: int = 2) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(pcm.shape[1] if pcm.ndim == 2 else 1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2" if width == 2 else "u1").tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


def _parse(body, decoding=Greedy()):
    return oh.parse_chat_request({"model": "m", **body}, model_name="m", decoding=decoding)


def test_requests_parse_into_parts_in_order():
    png = base64.b64encode(b"\x89PNG fake").decode()
    stereo = (np.random.default_rng(0).normal(size=(2400, 2)) * 3000).astype(np.int16)
    req = _parse({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                                     {"type": "input_audio", "input_audio": {"data": _wav(stereo, 24000),
                                                                             "format": "wav"}}]},
        {"role": "assistant", "content": None}], "max_completion_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0})
    assert [role for role, _ in req.messages] == ["system", "user", "assistant"]
    kinds = [p.kind for p in req.messages[1][1]]
    assert kinds == ["text", "image", "audio"] and req.messages[1][1][1].data == b"\x89PNG fake"
    expected = resample(stereo.astype(np.float32).mean(axis=1) / 32768.0, 24000)
    np.testing.assert_allclose(req.messages[1][1][2].pcm, expected, atol=1e-6)
    assert req.messages[2][1][0].text == "" and req.max_tokens == 7 and req.stream and req.include_usage


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"stop": 7}, 400, "stop"),
    ({"n": 9}, 400, "n"),  # above MAX_N (n > 1 on a greedy server: identical choices)
    ({"temperature": 0.7}, 400, "temperature"),
    ({"seed": 3}, 400, "seed"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, 400, "max_completion_tokens"),
    ({"stream": "yes"}, 400, "stream"),
    ({"response_format": {"type": "json"}}, 400, "response_format.type"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     400, "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "AAAA", "format": "mp3"}}]}]},
     400, "messages[0].content[0].input_audio.format"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                 "input_audio": {"data": "%%%", "format": "wav"}}]}]},
     400, "messages[0].content[0].input_audio.data"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": _wav(np.full(100, 128), 16000, width=1), "format": "wav"}}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url",
                                                   "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, 400, "messages[0].content[0].type"),
])
def test_refusals_name_the_field(body, status, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(oh.RequestError) as e:
        oh.parse_chat_request({"model": "m", **body}, model_name="m", decoding=Greedy())
    assert e.value.status == status and e.value.param == param, str(e.value)
    error = oh.error_body(str(e.value), code=e.value.code, param=e.value.param)
    assert error["error"]["param"] == param and error["error"]["message"]


def test_sampling_fields_that_match_the_server_are_accepted():
    decoding = Sampling(temperature=0.7, top_p=0.9, seed=5)
    _parse({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "top_p": 0.9, "seed": 5}, decoding)
    with pytest.raises(oh.RequestError, match="--temperature"):
        _parse({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}, decoding)


def test_built_objects_validate_as_the_sdk_types():
    from openai.types import Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    whole = ChatCompletion.model_validate(oh.completion("c1", 5, "m", "Hello", "stop", 10, 2, kv_cells=12))
    assert whole.choices[0].message.content == "Hello" and whole.usage.total_tokens == 12
    assert whole.model_extra["omnijax"] == {"kv_cells": 12}
    first = ChatCompletionChunk.model_validate(oh.completion_chunk("c1", 5, "m", {"role": "assistant",
                                                                                  "content": ""}))
    last = ChatCompletionChunk.model_validate(oh.completion_chunk("c1", 5, "m", {}, "length"))
    usage = ChatCompletionChunk.model_validate(oh.completion_chunk("c1", 5, "m", None, usage_=oh.usage(3, 4)))
    assert first.choices[0].delta.role == "assistant" and last.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.total_tokens == 7
    listed = oh.models_list("m", 5)
    assert [Model.model_validate(m).id for m in listed["data"]] == ["m"]


def test_a_per_row_server_takes_each_requests_sampling():
    from omnijax.decoding import RowSampling, sampling_row

    decoding = RowSampling(temperature=0.0, top_p=1.0)
    hi = [{"role": "user", "content": "hi"}]
    req = _parse({"messages": hi, "temperature": 0.7, "seed": 3}, decoding)
    np.testing.assert_array_equal(req.sampling, sampling_row(0.7, 1.0))
    assert req.seed == 3
    req = _parse({"messages": hi, "top_p": 0.5}, decoding)
    np.testing.assert_array_equal(req.sampling, sampling_row(0.0, 0.5))
    plain = _parse({"messages": hi}, decoding)
    assert plain.sampling is None and plain.seed is None
    for field, value in (("temperature", 2.5), ("temperature", "hot"), ("top_p", 0), ("seed", 1.5)):
        with pytest.raises(oh.RequestError) as e:
            _parse({"messages": hi, field: value}, decoding)
        assert e.value.param == field


def test_a_seed_outside_64_bits_is_refused_by_name():
    """A seed of 2**64 once escaped as a 500 (jax keys take signed 64-bit integers)."""
    from omnijax.decoding import RowSampling, folded_keys

    for bad in (2 ** 64, 2 ** 63, -(2 ** 63) - 1):
        with pytest.raises(oh.RequestError, match=r"'seed' must be a signed 64-bit integer") as refused:
            _parse({"messages": [{"role": "user", "content": "hi"}], "seed": bad}, decoding=RowSampling())
        assert refused.value.param == "seed" and refused.value.status == 400
    for edge in (2 ** 63 - 1, -(2 ** 63)):
        assert _parse({"messages": [{"role": "user", "content": "hi"}], "seed": edge}, decoding=RowSampling()).seed \
            == edge
        assert folded_keys(edge, [0]).shape == (1, 2)  # the engine can key a session with it
    from omnijax.decoding import SEED_RANGE
    from omnijax.serve.realtime import client_events

    assert client_events.SEED_RANGE == SEED_RANGE  # the Realtime parser's copy (it imports no jax)


def test_a_request_over_the_message_or_part_caps_is_refused_before_parsing():
    """10,000 text parts once took 213 s of templating: the caps refuse them by name, at once."""
    import time

    start = time.perf_counter()
    parts = [{"type": "text", "text": "x"}] * (oh.MAX_PARTS + 1)
    with pytest.raises(oh.RequestError, match=rf"{oh.MAX_PARTS + 1} content parts, over the {oh.MAX_PARTS} "
                                              r"accepted \(MAX_PARTS\)") as refused:
        _parse({"messages": [{"role": "user", "content": parts[:200]}, {"role": "user", "content": parts[200:]}]})
    assert refused.value.status == 400 and refused.value.param == "messages"
    with pytest.raises(oh.RequestError, match=r"over the 1000 accepted \(MAX_MESSAGES\)"):
        _parse({"messages": [{"role": "user", "content": "hi"}] * (oh.MAX_MESSAGES + 1)})
    with pytest.raises(oh.RequestError, match="MAX_PARTS"):
        _parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 10_000}]})
    assert time.perf_counter() - start < 1.0
    at_cap = _parse({"messages": [{"role": "user", "content": parts[:oh.MAX_PARTS]}]})
    assert len(at_cap.messages[0][1]) == oh.MAX_PARTS


@pytest.mark.parametrize("argv, env", [(["--api-key", ""], None), ([], "")])
def test_an_empty_api_key_is_refused_not_read_as_no_key(argv, env, monkeypatch, capsys):
    """`--api-key ""` once served with no auth at all (the empty flag fell through to the unset variable); it is
    refused like an empty OMNIJAX_API_KEY, before any model is loaded."""
    from omnijax.serve import app

    monkeypatch.delenv(app.API_KEY_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(app.API_KEY_ENV, env)
    with pytest.raises(SystemExit) as stopped:
        app.main(["--demo-model", *argv])
    assert stopped.value.code == 2
    assert "api_key must be a non-empty string" in capsys.readouterr().err


def test_beyond_loopback_without_a_key_is_refused_unless_allowed(monkeypatch, capsys, caplog, tmp_path):
    """`--host 0.0.0.0` with no key once served the model to anyone who could reach it, silently: it is refused
    (exit 2, naming both ways out) before any model loads; `--allow-unauthenticated` serves, with a loud warning."""
    import logging

    from omnijax.serve import app

    monkeypatch.delenv(app.API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as stopped:
        app.main(["--demo-model", "--host", "0.0.0.0"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "beyond loopback with no API key" in err and "--api-key" in err and "--allow-unauthenticated" in err
    caplog.set_level(logging.WARNING, logger="omnijax.serve")
    assert app.main([str(tmp_path), "--host", "0.0.0.0", "--allow-unauthenticated"]) == 1  # then: no checkpoint
    assert any("SERVING WITHOUT AUTHENTICATION on 0.0.0.0" in r.getMessage() for r in caplog.records)
    assert [app.is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost", "0.0.0.0", "::",
                                         "10.0.0.1", "example.org")] == [True] * 4 + [False] * 4


def test_a_deeply_nested_body_and_lone_surrogates_are_refused_by_name():
    """Two bodies that escaped as HTTP 500 (the hostile-input probe): JSON nested 100,000 deep (a RecursionError the
    parser did not catch) and text with a lone surrogate (the tokenizer's TypeError); both are 400s naming it."""
    from types import SimpleNamespace

    context = SimpleNamespace(options=SimpleNamespace(model_name="omnijax", max_request_audio_s=600.0),
                              worker=SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(
                                  stream=SimpleNamespace(decoding=Greedy())))))
    with pytest.raises(oh.RequestError, match="nests JSON deeper") as deep:
        oh.parse_body(b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", context)
    assert deep.value.status == 400
    for content, param in (("a\ud800b", "messages[0].content"),
                           ([{"type": "text", "text": "x\udfffy"}], "messages[0].content[0].text")):
        with pytest.raises(oh.RequestError, match="lone surrogate") as lone:
            _parse({"messages": [{"role": "user", "content": content}]})
        assert lone.value.param == param


HI = [{"role": "user", "content": "hi"}]
PNG_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()


@pytest.mark.parametrize("body, code, param, says", [
    # unknown top-level fields, with a hint when close to a known one (the probe's misspelt keys)
    ({"max_token": 5}, "unknown_parameter", "max_token", "did you mean 'max_tokens'"),
    ({"temprature": 0.5}, "unknown_parameter", "temprature", "did you mean 'temperature'"),
    ({"chat_template_kwargs": {}}, "unknown_parameter", "chat_template_kwargs", "unknown parameter"),
    # fields the server does not implement, at a value that asks for something
    ({"frequency_penalty": 1.5}, "unsupported", "frequency_penalty", "send 0"),
    ({"presence_penalty": -2}, "unsupported", "presence_penalty", "send 0"),
    ({"logit_bias": {"50256": -100}}, "unsupported", "logit_bias", "send {}"),
    ({"store": True}, "unsupported", "store", "not stored"),
    ({"service_tier": "flex"}, "unsupported", "service_tier", '"auto" or "default"'),
    ({"modalities": ["text", "audio"]}, "unsupported", "modalities", "text only"),
    ({"reasoning_effort": "high"}, "unsupported", "reasoning_effort", "not asked to reason"),
    ({"web_search_options": {}}, "unsupported", "web_search_options", "never searches"),
    ({"top_k": 5}, "unsupported", "top_k", "-1 or 0"),
    ({"repetition_penalty": 1.3}, "unsupported", "repetition_penalty", "send 1"),
    ({"min_p": 0.1}, "unsupported", "min_p", "send 0"),
    ({"stop": ["a", ""]}, "invalid_value", "stop", "'stop[1]' is an empty string"),
    ({"tool_choice": "required"}, "unsupported", "tool_choice", "cannot make the model call a tool"),
    ({"parallel_tool_calls": "no"}, "invalid_value", "parallel_tool_calls", "boolean"),
    ({"frequency_penalty": False}, "unsupported", "frequency_penalty", "send 0"),  # not 0: JSON false
    ({"metadata": {"k": 5}}, "invalid_value", "metadata", "string values"),
    ({"user": ["u"]}, "invalid_value", "user", "string"),
    # message fields
    ({"messages": [{"role": "user", "content": "hi", "name": "alice"}]}, "unsupported", "messages[0].name",
     "speaker names"),
    ({"messages": [*HI, {"role": "tool", "content": "sunny", "tool_call_id": "c9"}]}, "invalid_value",
     "messages[1].tool_call_id", "answers no tool call"),
    ({"messages": [{"role": "user", "content": "hi", "contnet": "x"}]}, "unknown_parameter", "messages[0].contnet",
     "did you mean 'content'"),
    # stream_options
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "invalid_value", "stream_options.include_usage",
     "boolean"),
    ({"stream_options": {"include_usage": True}}, "invalid_value", "stream_options", "only allowed when 'stream'"),
    ({"stream": True, "stream_options": {"x": 1}}, "unknown_parameter", "stream_options.x", "unknown parameter"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "unsupported",
     "stream_options.include_obfuscation", "pads no chunk"),
    # content parts
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL,
                                                                                    "detail": "ultra"}}]}]},
     "invalid_value", "messages[0].content[0].image_url.detail", "must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL,
                                                                                    "detail": "low"}}]}]},
     "unsupported", "messages[0].content[0].image_url.detail", "model's own resolution"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]},
     "unknown_parameter", "messages[0].content[0].cache_control", "unknown parameter"),
    ({"response_format": {"type": "text", "strict": True}}, "unknown_parameter", "response_format.strict",
     "unknown parameter"),
])
def test_no_field_is_accepted_and_ignored(body, code, param, says):
    """The hostile-input probe's silent cases: each field the server neither applies nor can keep honestly is
    refused by name (400, `param` set, the accepted value said), unknown keys with a hint when close to a known one.
    Before, each of these was answered 200 and the field ignored."""
    with pytest.raises(oh.RequestError) as e:
        _parse({"messages": HI, **body})
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param), str(e.value)
    assert says in str(e.value)


@pytest.mark.parametrize("stop, want", [(None, ()), ("\n", ("\n",)), (["\n\n", "User:"], ("\n\n", "User:")),
                                        ([], ())])
def test_stop_is_read_as_a_string_or_up_to_four(stop, want):
    assert _parse({"messages": HI, "stop": stop}).stop == want


def test_neutral_values_and_labels_are_accepted():
    """What real clients send by default or as a no-op is accepted: the penalties at 0, `logit_bias` {}, `stop` [],
    `tools` [] with `tool_choice` "none" and `parallel_tool_calls`, `service_tier` "auto", `store` false, null
    fields, an assistant turn with an empty `tool_calls`, `detail` "auto"; `user` and `metadata` are kept (logged,
    echoed back), and the metadata validates in the SDK's completion type."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    req = _parse({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "auto"}}]},
        {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None, "name": None},
        {"role": "user", "content": "again"}],
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "stop": [], "tools": [],
        "tool_choice": "none", "parallel_tool_calls": True, "service_tier": "auto", "store": False,
        "logprobs": False, "top_logprobs": 0, "modalities": ["text"], "top_k": -1, "repetition_penalty": 1.0,
        "min_p": 0, "reasoning_effort": None, "n": None, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}, "user": "u-1",
        "safety_identifier": "h-2", "metadata": {"run": "7"}})
    assert req.stream and req.include_usage and [role for role, _ in req.messages] == ["user", "assistant", "user"]
    assert req.labels == {"user": "u-1", "safety_identifier": "h-2", "metadata": {"run": "7"}}
    assert _parse({"messages": HI, "stream": None}).stream is False
    whole = ChatCompletion.model_validate(oh.completion("c", 5, "m", "x", "stop", 1, 1, metadata={"run": "7"}))
    assert whole.metadata == {"run": "7"}  # the SDK's own field
    first = ChatCompletionChunk.model_validate(oh.completion_chunk("c", 5, "m", {"role": "assistant"},
                                                                   metadata={"run": "7"}))
    assert first.model_extra["metadata"] == {"run": "7"}


def test_the_docs_table_lists_every_classified_field():
    """docs/serving.md's Parameters table names every field the chat route honours, keeps or accepts neutral."""
    from pathlib import Path

    from omnijax.serve import chat_params

    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    table = docs[docs.index("### Chat completions parameters"):]
    missing = [f for f in (*chat_params.HONOURED, *chat_params.LABELS, *chat_params.NEUTRAL) if f"`{f}`" not in table]
    assert not missing, missing
