"""Tests for omnijax.serve.realtime.client_events and realtime_server_events, with the official openai SDK as the
independent oracle."""

from __future__ import annotations

import base64
import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

realtime = pytest.importorskip("openai.types.realtime")
pydantic = pytest.importorskip("pydantic")

from openai.types.realtime import (  # noqa: E402
    ConversationItemCreateEventParam,
    InputAudioBufferAppendEventParam,
    InputAudioBufferClearEventParam,
    InputAudioBufferCommitEventParam,
    RealtimeServerEvent,
    ResponseCancelEventParam,
    ResponseCreateEventParam,
    SessionUpdateEventParam,
)

from omnijax.serve.realtime import client_events as rt  # noqa: E402
from omnijax.serve.realtime import server_events as rs  # noqa: E402

SERVER = pydantic.TypeAdapter(RealtimeServerEvent)
PNG = b"\x89PNG\r\n\x1a\nfakepng"
PCM = bytes(range(200))


def check(ev: dict):
    """Validates against the SDK union and returns the model."""
    json.dumps(ev)
    model = SERVER.validate_python(ev)
    assert model.type == ev["type"] and model.event_id == ev["event_id"]
    return model


def test_module_imports_without_openai_or_jax():
    """The codec (client_events and its field checks, event_fields) imports the standard library only: loaded under
    empty parent packages (the real omnijax/__init__ would import jax), nothing else of omnijax comes in."""
    path = Path(rt.__file__).parent
    code = ("import sys, types\n"
            "for name, sub in (('omnijax', 2), ('omnijax.serve', 1), ('omnijax.serve.realtime', 0)):\n"
            f"    m = types.ModuleType(name); m.__path__ = [{str(path)!r}.rsplit('/', sub)[0] if sub else "
            f"{str(path)!r}]; sys.modules[name] = m\n"
            "import omnijax.serve.realtime.client_events\n"
            "codec = {'omnijax', 'omnijax.serve', 'omnijax.serve.realtime', 'omnijax.serve.realtime.client_events',\n"
            "         'omnijax.serve.realtime.event_fields'}\n"
            "bad = [k for k in sys.modules if k.split('.')[0] in ('openai', 'jax', 'pydantic')\n"
            "       or (k.split('.')[0] == 'omnijax' and k not in codec)]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_session_events_validate_and_round_trip():
    s = rt.SessionSettings(instructions="be brief", input_audio_rate=24000, max_output_tokens=128,
                           turn_detection=rt.ServerVad(threshold=0.6, silence_duration_ms=400, create_response=True),
                           truncation=rt.RetentionRatio(0.75, post_instructions=1000))
    for builder in (rs.session_created, rs.session_updated):
        m = check(builder(s, session_id="sess_1"))
        assert m.session.instructions == "be brief" and m.session.output_modalities == ["text"]
        assert m.session.max_output_tokens == 128 and m.session.id == "sess_1"
        assert m.session.audio.input.format.rate == 24000
        td = m.session.audio.input.turn_detection
        assert td.type == "server_vad" and td.threshold == 0.6 and td.silence_duration_ms == 400
        assert m.session.truncation.retention_ratio == 0.75
        assert m.session.truncation.token_limits.post_instructions == 1000
    m = check(rs.session_updated(rt.SessionSettings(input_audio_rate=16000, truncation="disabled")))
    assert m.session.audio.input.format.type == "audio/pcm" and m.session.audio.input.turn_detection is None
    assert m.session.truncation == "disabled" and m.session.max_output_tokens == "inf"
    assert m.session.model_extra["omnijax"] == {"input_audio_rate": 16000, "duplex": False}


def test_buffer_and_item_events_validate():
    m = check(rs.input_audio_buffer_committed("item_1", previous_item_id="item_0"))
    assert (m.item_id, m.previous_item_id) == ("item_1", "item_0")
    check(rs.input_audio_buffer_cleared())
    assert check(rs.input_audio_buffer_speech_started("item_2", 120)).audio_start_ms == 120
    assert check(rs.input_audio_buffer_speech_stopped("item_2", 980)).audio_end_ms == 980
    parsed = rt.ConversationItemCreate("e", "item_u", "user", (rt.InputText("hi"), rt.InputImage(PNG, "image/png")))
    for builder in (rs.conversation_item_added, rs.conversation_item_done):
        m = check(builder(rs.user_item(parsed), previous_item_id="item_0"))
        assert m.item.id == "item_u" and m.item.role == "user" and m.item.content[0].text == "hi"
        assert m.item.content[1].image_url.endswith(base64.b64encode(PNG).decode())
        assert m.previous_item_id == "item_0"
    m = check(rs.conversation_item_added(rs.assistant_item("item_a", None, status="in_progress")))
    assert m.item.role == "assistant" and m.item.status == "in_progress" and m.item.content == []
    sysitem = rs.user_item(rt.ConversationItemCreate(None, None, "system", (rt.InputText("ctx"),)))
    assert check(rs.conversation_item_done(sysitem)).item.role == "system"


def test_response_events_validate():
    m = check(rs.response_created("resp_1", max_output_tokens=64))
    assert m.response.id == "resp_1" and m.response.status == "in_progress" and m.response.max_output_tokens == 64
    m = check(rs.response_output_text_delta("resp_1", "item_a", "Hel"))
    assert (m.response_id, m.item_id, m.delta, m.output_index, m.content_index) == ("resp_1", "item_a", "Hel", 0, 0)
    m = check(rs.response_output_text_done("resp_1", "item_a", "Hello", content_index=1))
    assert m.text == "Hello" and m.content_index == 1
    ev = rs.response_done("resp_1", output=[rs.assistant_item("item_a", "Hello")], input_tokens=10,
                          output_tokens=3, kv_cells=77)
    m = check(ev)
    assert m.response.status == "completed" and m.response.output[0].content[0].text == "Hello"
    u = m.response.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (10, 3, 13)
    assert m.model_extra["omnijax"] == {"kv_cells": 77} and ev["omnijax"]["kv_cells"] == 77
    m = check(rs.response_done("resp_2", status="cancelled", reason="client_cancelled"))
    assert m.response.status_details.reason == "client_cancelled" and m.response.status_details.type == "cancelled"


def test_error_event_and_ids():
    m = check(rt.error_event("invalid_value", "bad", event_id="evt_c", param="session.x"))
    assert (m.error.type, m.error.code, m.error.message, m.error.event_id, m.error.param) == (
        "invalid_request_error", "invalid_value", "bad", "evt_c", "session.x")
    with pytest.raises(rt.RealtimeEventError) as ei:
        rt.parse_client_event({"type": "nope", "event_id": "evt_9"})
    m = check(ei.value.to_event())
    assert m.error.code == "unknown_event" and m.error.event_id == "evt_9" and "nope" in m.error.message
    ids = {rt.new_id("item") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("item_") for i in ids)


def _session_update() -> SessionUpdateEventParam:
    return {"type": "session.update", "event_id": "evt_s", "session": {
        "type": "realtime", "instructions": "sys", "output_modalities": ["text"], "max_output_tokens": 200,
        "truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 900}},
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "threshold": 0.4, "prefix_padding_ms": 300}}}}}


def _item_create() -> ConversationItemCreateEventParam:
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    return {"type": "conversation.item.create", "event_id": "evt_i", "previous_item_id": "item_0",
            "item": {"type": "message", "role": "user", "id": "item_u", "content": [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": url, "detail": "auto"}]}}


def _valid_events() -> list:
    append: InputAudioBufferAppendEventParam = {"type": "input_audio_buffer.append", "event_id": "evt_a",
                                                "audio": base64.b64encode(PCM).decode()}
    commit: InputAudioBufferCommitEventParam = {"type": "input_audio_buffer.commit", "event_id": "evt_c"}
    clear: InputAudioBufferClearEventParam = {"type": "input_audio_buffer.clear"}
    create: ResponseCreateEventParam = {"type": "response.create", "event_id": "evt_r", "response": {
        "instructions": "short", "max_output_tokens": "inf", "output_modalities": ["text"]}}
    cancel: ResponseCancelEventParam = {"type": "response.cancel", "response_id": "resp_1"}
    return [_session_update(), append, commit, clear, _item_create(), create, cancel]


def test_client_events_parse():
    s, a, c, cl, i, r, x = (rt.parse_client_event(json.dumps(e)) for e in _valid_events())
    assert isinstance(s, rt.SessionUpdate) and s.event_id == "evt_s"
    new = s.apply(rt.SessionSettings())
    assert new == rt.SessionSettings(instructions="sys", max_output_tokens=200, input_audio_rate=24000,
                                     truncation=rt.RetentionRatio(0.5, 900),
                                     turn_detection=rt.ServerVad(threshold=0.4, prefix_padding_ms=300))
    check(rs.session_updated(new))
    assert a == rt.InputAudioBufferAppend("evt_a", PCM)
    assert c == rt.InputAudioBufferCommit("evt_c") and cl == rt.InputAudioBufferClear(None)
    assert i == rt.ConversationItemCreate("evt_i", "item_u", "user",
                                          (rt.InputText("what is this?"), rt.InputImage(PNG, "image/png", "auto")),
                                          previous_item_id="item_0")
    assert r == rt.ResponseCreate("evt_r", "short", "inf", ("text",))
    assert x == rt.ResponseCancel(None, "resp_1")
    assert rt.parse_client_event({"type": "response.create"}) == rt.ResponseCreate(None)
    u = rt.parse_client_event({"type": "session.update", "session": {
        "type": "realtime", "truncation": "auto", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                                                                      "turn_detection": None}}}})
    assert u.changes == {"truncation": "auto", "input_audio_rate": 16000, "turn_detection": None}
    sysmsg = rt.parse_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "system", "content": [{"type": "input_text", "text": "ctx"}]}})
    assert sysmsg.role == "system" and sysmsg.content == (rt.InputText("ctx"),)


def _set(ev: dict, path: str, value):
    ev = copy.deepcopy(ev)
    keys, d = path.split("."), ev
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value
    return ev


BAD = [
    ("{not json", "invalid_json", "JSON"),
    ("[1, 2]", "invalid_json", "object"),
    ({"type": "conversation.item.delete"}, "unknown_event", "conversation.item.delete"),
    ({"event_id": "x"}, "missing_field", "type"),
    ({"type": "session.update"}, "missing_field", "session"),
    ({"type": "input_audio_buffer.append"}, "missing_field", "audio"),
    ({"type": "input_audio_buffer.append", "audio": "@@not base64!!"}, "invalid_value", "base64"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "invalid_value", "odd"),
    ({"type": "input_audio_buffer.append", "audio": 5}, "invalid_value", "string"),
    ({"type": "response.create", "response": {"output_modalities": ["text", "audio"]}}, "invalid_value",
     "audio comes with its transcript"),
    ({"type": "response.create", "response": {"max_output_tokens": "lots"}}, "invalid_value", "max_output_tokens"),
    ({"type": "response.create", "response": {"conversation": "none"}}, "unsupported", "out-of-band"),
    ({"type": "response.create", "response": {"instructions": 3}}, "invalid_value", "response.instructions"),
    ({"type": "conversation.item.create"}, "missing_field", "item"),
    ({"type": "conversation.item.create", "item": {"type": "function_call"}}, "invalid_value", "message"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": []}},
     "invalid_value", "item.role"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user"}}, "missing_field",
     "item.content"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}}, "invalid_value", "network"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:text/plain;base64,aGk="}]}}, "invalid_value", "data:image"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": "AAAA"}]}}, "invalid_value", "input_audio"),
]


@pytest.mark.parametrize("event,code,needle", BAD)
def test_bad_events(event, code, needle):
    with pytest.raises(rt.RealtimeEventError) as ei:
        rt.parse_client_event(event)
    assert ei.value.code == code and needle.lower() in ei.value.message.lower(), ei.value.message
    check(ei.value.to_event())


@pytest.mark.parametrize("path,value,code,needle", [
    ("session.output_modalities", ["audio", "text"], "invalid_value", "audio comes with its transcript"),
    ("session.output_modalities", "text", "invalid_value", "list"),
    ("session.audio.input.format", {"type": "audio/pcmu"}, "invalid_value", "audio/pcmu"),
    ("session.audio.input.format", {"type": "audio/pcm", "rate": 44100}, "invalid_value", "44100"),
    ("session.audio.input.turn_detection", {"type": "semantic_vad"}, "invalid_value", "server_vad"),
    ("session.audio.input.turn_detection", {"type": "server_vad", "threshold": 2.0}, "invalid_value", "threshold"),
    ("session.max_output_tokens", 0, "invalid_value", "max_output_tokens"),
    ("session.max_output_tokens", True, "invalid_value", "integer"),
    ("session.truncation", "sometimes", "invalid_value", "retention_ratio"),
    ("session.truncation", {"type": "retention_ratio"}, "missing_field", "retention_ratio"),
    ("session.truncation", {"type": "retention_ratio", "retention_ratio": 1.5}, "invalid_value", "retention_ratio"),
    ("session.instructions", None, "invalid_value", "session.instructions"),
    ("session.audio", [], "invalid_value", "session.audio"),
])
def test_bad_session_updates(path, value, code, needle):
    with pytest.raises(rt.RealtimeEventError) as ei:
        rt.parse_client_event(_set(_session_update(), path, value))
    err = ei.value
    assert err.code == code and needle.lower() in err.message.lower(), err.message
    assert err.event_id == "evt_s" and err.param and err.param.startswith(path.rsplit(".", 1)[0])
    m = check(err.to_event())
    assert m.error.event_id == "evt_s" and m.error.code == code


def test_buffer_too_large():
    big = base64.b64encode(bytes(1000)).decode()
    with pytest.raises(rt.RealtimeEventError) as ei:
        rt.parse_client_event({"type": "input_audio_buffer.append", "audio": big}, max_bytes=999)
    assert ei.value.code == "buffer_too_large" and "999" in ei.value.message
    with pytest.raises(rt.RealtimeEventError) as ei:
        rt.parse_client_event({"type": "input_audio_buffer.append", "audio": big * 10}, max_bytes=1000)
    assert ei.value.code == "buffer_too_large"
    assert rt.parse_client_event({"type": "input_audio_buffer.append", "audio": big}, max_bytes=1000).audio == bytes(
        1000)
    with pytest.raises(rt.RealtimeEventError) as ei:
        rt.parse_client_event(_item_create(), max_bytes=4)
    assert ei.value.code == "buffer_too_large"


GARBAGE = [None, 0, -1, 1.5, float("nan"), True, "", "garbage\x00", "inf", [], [1, "x"], {}, {"type": 3},
           "data:image/png;base64,@@", "data:", "x" * 50]


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _mutate(ev, rng: random.Random):
    ev = copy.deepcopy(ev)
    paths = list(_paths(ev))
    op = rng.randrange(4)
    if op == 3:
        text = json.dumps(ev)
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(["", "\"", "}", "\\", "\x00", "]"]) + text[i + rng.randrange(3):]
    path = rng.choice(paths)
    parent = ev
    for k in path[:-1]:
        parent = parent[k]
    if op == 0:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(GARBAGE)
    return ev


def test_fuzz_only_raises_realtime_event_error():
    rng = random.Random(1234)
    valid = _valid_events()
    codes = set()
    for _ in range(200):
        ev = _mutate(rng.choice(valid), rng)
        try:
            rt.parse_client_event(ev, max_bytes=1 << 16)
        except rt.RealtimeEventError as e:
            codes.add(e.code)
            check(e.to_event())
    assert {"invalid_json", "invalid_value", "missing_field"} <= codes


def test_the_duplex_extension_is_parsed_and_echoed():
    update = rt.parse_client_event({"type": "session.update", "session": {"type": "realtime",
                                                                       "omnijax": {"duplex": True}}})
    settings = update.apply(rt.SessionSettings())
    assert settings.duplex is True
    assert check(rs.session_updated(settings)).session.model_extra["omnijax"]["duplex"] is True
    for bad in ({"duplex": "yes"}, {"speed": 2}, "duplex"):
        with pytest.raises(rt.RealtimeEventError) as e:
            rt.parse_client_event({"type": "session.update", "session": {"omnijax": bad}})
        assert e.value.code == "invalid_value" and e.value.param.startswith("session.omnijax")


def test_the_sampling_extension_is_parsed_and_refused_out_of_range():
    update = rt.parse_client_event({"type": "session.update", "session": {"omnijax": {
        "temperature": 0.8, "top_p": 0.9, "seed": 4}}})
    settings = update.apply(rt.SessionSettings())
    assert (settings.temperature, settings.top_p, settings.seed) == (0.8, 0.9, 4)
    assert check(rs.session_updated(settings)).session.model_extra["omnijax"]["top_p"] == 0.9
    for bad in ({"temperature": 3}, {"top_p": 0}, {"seed": "x"}, {"temperature": True}, {"seed": 2 ** 64},
                {"seed": -(2 ** 63) - 1}):
        with pytest.raises(rt.RealtimeEventError) as e:
            rt.parse_client_event({"type": "session.update", "session": {"omnijax": bad}})
        assert e.value.param.startswith("session.omnijax."), bad
