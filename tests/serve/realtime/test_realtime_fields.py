"""No Realtime client-event field is accepted and ignored (issue 37 item 6; the hostile-input probe's silent Realtime
cases): the codec refuses by name every field an event or object does not take, and every field the server does not
implement unless it is null or the value that asks for nothing; those neutral values are accepted."""

import base64

import pytest

from omnijax.serve.realtime import client_events as rt

PNG_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()


def _session(**fields) -> dict:
    return {"type": "session.update", "event_id": "evt_s", "session": {"type": "realtime", **fields}}


def _item(content=None, **fields) -> dict:
    return {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": content or [{"type": "input_text", "text": "hi"}], **fields}}


VAD = {"type": "server_vad"}


@pytest.mark.parametrize("event, code, param, says", [
    # the probe's silent session.update cases
    (_session(tool_choice="required"), "unsupported", "session.tool_choice", "cannot make the model call a tool"),
    (_session(include=["item.input_audio_transcription.logprobs"]), "unsupported", "session.include",
     "transcription"),
    (_session(prompt={"id": "pmpt_123"}), "unsupported", "session.prompt", "prompts stored by id"),
    (_session(audio={"input": {"transcription": {"model": "whisper-1"}}}), "unsupported",
     "session.audio.input.transcription", "transcription is not supported"),
    (_session(audio={"input": {"noise_reduction": {"type": "near_field"}}}), "unsupported",
     "session.audio.input.noise_reduction", "no noise reduction"),
    (_session(audio={"output": {"voice": {"id": "voice_1"}}}), "unsupported", "session.audio.output.voice",
     "custom voices"),
    (_session(audio={"output": {"speed": 1.5}}), "unsupported", "session.audio.output.speed", "own pace"),
    (_session(foo=1), "unknown_parameter", "session.foo", "unknown parameter 'session.foo'"),
    (_session(instrucions="x"), "unknown_parameter", "session.instrucions", "did you mean 'instructions'"),
    (_session(tracing="auto"), "unsupported", "session.tracing", "no traces"),
    (_session(audio={"input": {"turn_detection": {**VAD, "idle_timeout_ms": 5000}}}), "unsupported",
     "session.audio.input.turn_detection.idle_timeout_ms", "triggers nothing"),
    (_session(audio={"input": {"turn_detection": {**VAD, "eagerness": "high"}}}), "unknown_parameter",
     "session.audio.input.turn_detection.eagerness", "unknown parameter"),
    (_session(audio={"input": {"format": {"type": "audio/pcm", "rate": 24000, "channels": 2}}}),
     "unknown_parameter", "session.audio.input.format.channels", "unknown parameter"),
    (_session(truncation={"type": "retention_ratio", "retention_ratio": 0.5, "x": 1}), "unknown_parameter",
     "session.truncation.x", "unknown parameter"),
    # unknown top-level event fields
    ({"type": "input_audio_buffer.clear", "foo": 1}, "unknown_parameter", "foo", "unknown parameter 'foo'"),
    ({"type": "response.cancel", "respones_id": "r"}, "unknown_parameter", "respones_id", "did you mean"),
    # response.create
    ({"type": "response.create", "response": {"temperature": 0.5}}, "unknown_parameter", "response.temperature",
     "session.omnijax.temperature"),
    ({"type": "response.create", "response": {"metadata": {"k": 5}}}, "invalid_value", "response.metadata",
     "string values"),
    ({"type": "response.create", "response": {"audio": {"output": {"voice": "alloy"}}}}, "unsupported",
     "response.audio", "the session's"),
    ({"type": "response.create", "response": {"tool_choice": "required"}}, "unsupported", "response.tool_choice",
     "no tools"),
    # items and their parts
    (_item(status="incomplete"), "unsupported", "item.status", "complete"),
    (_item(name="alice"), "unknown_parameter", "item.name", "unknown parameter"),
    (_item([{"type": "input_text", "text": "hi", "lang": "en"}]), "unknown_parameter", "item.content[0].lang",
     "unknown parameter"),
    (_item([{"type": "input_image", "image_url": PNG_URL, "detail": "low"}]), "unsupported",
     "item.content[0].detail", "model's own resolution"),
    (_item([{"type": "input_image", "image_url": PNG_URL, "detail": "ultra"}]), "invalid_value",
     "item.content[0].detail", "auto, low or high"),
])
def test_every_unhonoured_field_is_refused_by_name(event, code, param, says):
    """Each was parsed and ignored before (the probe saw session.updated / conversation.item.added / response.created
    and nothing else)."""
    with pytest.raises(rt.RealtimeEventError) as e:
        rt.parse_client_event(event)
    assert (e.value.code, e.value.param) == (code, param), e.value.message
    assert says in e.value.message
    error = e.value.to_event()["error"]
    assert error["param"] == param and error["code"] == code


def test_neutral_values_are_accepted_and_metadata_is_carried():
    """What asks for nothing is honoured trivially (tools [] clears the session's tools, tool_choice "auto" is the
    default), empty include,
    null prompt / tracing / transcription / noise reduction / voice / idle timeout, an item marked completed."""
    update = rt.parse_client_event(_session(
        tools=[], tool_choice="auto", include=[], prompt=None, tracing=None,
        audio={"input": {"transcription": None, "noise_reduction": None,
                         "turn_detection": {**VAD, "idle_timeout_ms": None, "prefix_padding_ms": 300}},
               "output": {"voice": None, "speed": None}}))
    assert update.changes == {"turn_detection": rt.ServerVad(prefix_padding_ms=300), "tools": (), "tool_choice": "auto"}
    item = rt.parse_client_event(_item([{"type": "input_image", "image_url": PNG_URL, "detail": "auto"}],
                                       object="realtime.item", status="completed"))
    assert item.content[0].detail == "auto"
    created = rt.parse_client_event({"type": "response.create", "response": {
        "metadata": {"topic": "weather"}, "tool_choice": "none", "tools": [], "prompt": None, "audio": None}})
    assert created.metadata == {"topic": "weather"}
