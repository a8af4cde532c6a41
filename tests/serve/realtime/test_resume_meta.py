"""A Realtime snapshot's metadata is checked field by field before a resume opens anything
(`omnijax.serve.realtime.resume.restored`): what a session writes comes back as it was, and a damaged or altered
field (wrong type, out of range, unknown) is refused by name. No model."""

import dataclasses
import json

import pytest

from omnijax.serve.engine.snapshot import COUNTER_LIMIT, SessionSnapshot
from omnijax.serve.realtime import client_events as rte
from omnijax.serve.realtime.resume import ResumeRefused, restored
from tests.serve.realtime.test_snapshot_store import snap

SETTINGS = rte.SessionSettings(instructions="Be brief.", input_audio_rate=16000,
                               turn_detection=rte.ServerVad(threshold=0.3, silence_duration_ms=400,
                                                            create_response=False),
                               max_output_tokens=20, truncation=rte.RetentionRatio(0.5, 100), temperature=0.7,
                               top_p=0.9, seed=-(2 ** 63))


def _meta() -> dict:
    return {"conversation": {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}],
                             "rendered": "<|im_start|>system...", "next_unit": 3, "tokens_fed": 41},
            "settings": dataclasses.asdict(SETTINGS), "session_id": "sess_1", "instructions_fed": "Be brief.",
            "last_item": "item_2", "tokens_since_response": 12, "model": "omnijax"}


def _with(meta: dict) -> SessionSnapshot:
    return dataclasses.replace(snap(), meta=json.loads(json.dumps(meta)))  # through JSON, as on disk


def test_what_a_session_writes_comes_back():
    state = restored(_with(_meta()), "omnijax")
    assert state.settings == SETTINGS
    assert state.conversation == _meta()["conversation"]
    assert (state.session_id, state.instructions_fed, state.last_item, state.tokens_since_response) == (
        "sess_1", "Be brief.", "item_2", 12)
    plain = _meta()
    plain["settings"] = dataclasses.asdict(rte.SessionSettings())
    assert restored(_with(plain), "omnijax").settings == rte.SessionSettings()
    assert state.spoken is None  # a snapshot without the text ids fed: a resumed session cannot speak
    spoken = _meta()
    spoken["settings"] = dataclasses.asdict(dataclasses.replace(SETTINGS, output_modalities=("audio",),
                                                                output_voice="chelsie"))
    spoken["spoken"] = {"ids": [3, 1, 4, 1, 5], "unspeakable": None}
    state = restored(_with(spoken), "omnijax")
    assert state.spoken == ((3, 1, 4, 1, 5), None)
    assert (state.settings.output_modalities, state.settings.output_voice) == (("audio",), "chelsie")


def _set(path: str, value):
    meta = _meta()
    *parents, last = path.split(".")
    target = meta
    for key in parents:
        target = target[key]
    target[last] = value
    return meta


@pytest.mark.parametrize("path, value, named", [
    ("conversation.next_unit", 2 ** 40, "conversation.next_unit must be an integer in [1, 1073741824]"),
    ("conversation.next_unit", 0, "conversation.next_unit"),  # units up to 0 are in the cache already
    ("conversation.next_unit", "3", "conversation.next_unit"),
    ("conversation.tokens_fed", -1, "conversation.tokens_fed"),
    ("conversation.messages", {"role": "user"}, "conversation.messages must be a list"),
    ("conversation.messages", [{"role": "robot", "content": "x"}], "conversation.messages[0]"),
    ("conversation.messages", [{"role": "user", "content": ["x"]}], "conversation.messages[0]"),
    ("conversation.rendered", None, "conversation.rendered"),
    ("settings", "fast", "settings must be an object"),
    ("settings.temperature", "hot", "settings.temperature must be a number in [0, 2]"),
    ("settings.temperature", 1e9, "settings.temperature"),
    ("settings.top_p", 0, "settings.top_p"),
    ("settings.seed", 2 ** 64, "settings.seed"),
    ("settings.seed", True, "settings.seed"),
    ("settings.input_audio_rate", 44100, "settings.input_audio_rate"),
    ("settings.max_output_tokens", -5, "settings.max_output_tokens"),
    ("settings.turn_detection", {"threshold": "high"}, "settings.turn_detection.threshold"),
    ("settings.turn_detection", {"volume": 3}, "settings.turn_detection has unknown fields ['volume']"),
    ("settings.truncation", "sometimes", "settings.truncation"),
    ("settings.duplex", True, "settings.duplex must be false"),
    ("settings.output_modalities", ["video"], "settings.output_modalities"),
    ("settings.output_voice", 5, "settings.output_voice must be a string or null"),
    ("settings.output_format", "audio/pcmu", "settings.output_format must be 'audio/pcm'"),
    ("spoken", [1, 2], "spoken must be an object"),
    ("spoken", {"ids": [1, -2]}, "spoken.ids must be a list of token ids"),
    ("spoken", {"ids": [1, True]}, "spoken.ids must be a list of token ids"),
    ("spoken", {"ids": [1], "unspeakable": 3}, "spoken.unspeakable must be a string or null"),
    ("spoken", {"ids": [1], "voice": "x"}, "spoken has unknown fields ['voice']"),
    ("settings.instructions", 5, "settings.instructions must be a string"),
    ("settings.colour", "red", "settings has unknown fields ['colour']"),
    ("tokens_since_response", 2 ** 60, "tokens_since_response"),
    ("session_id", None, "session_id must be a string"),
    ("last_item", 3, "last_item must be a string or null"),
])
def test_a_damaged_field_is_refused_by_name(path, value, named):
    snapshot = _with(_set(path, value))
    snapshot.unit[...] = 0  # the cache holds unit 0: the conversation's next unit is at least 1
    with pytest.raises(ResumeRefused, match="the snapshot cannot be resumed: meta " + _escape(named)):
        restored(snapshot, "omnijax")


def _escape(text: str) -> str:
    return text.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")


def test_another_model_or_a_non_object_meta_is_refused():
    with pytest.raises(ResumeRefused, match="of model str 'omnijax', this server serves 'other'"):
        restored(_with(_meta()), "other")
    with pytest.raises(ResumeRefused, match="has unknown fields"):
        restored(_with({**_meta(), "extra": 1}), "omnijax")
    assert COUNTER_LIMIT < 2 ** 31


def test_held_tool_results_come_back_and_must_be_the_last_tool_messages():
    """Tool results recorded but not yet fed (two function_call_output items in a row wait for what comes next) are
    counted in the meta and restored; a count beyond the conversation's trailing tool messages is refused by name;
    a meta written before the count was kept restores none."""
    meta = _meta()
    meta["conversation"]["messages"] += [{"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                                         {"role": "tool", "content": "rain", "tool_call_id": "c2"}]
    meta["call_ids"] = ["c1", "c2"]
    assert restored(_with(dict(meta, held_outputs=2)), "omnijax").held_outputs == 2
    assert restored(_with(meta), "omnijax").held_outputs == 0
    with pytest.raises(ResumeRefused, match=r"meta held_outputs must be an integer in \[0, 2\], got int 3"):
        restored(_with(dict(meta, held_outputs=3)), "omnijax")
    with pytest.raises(ResumeRefused, match=r"meta held_outputs must be an integer in \[0, 0\]"):
        restored(_with(dict(_meta(), held_outputs=1)), "omnijax")
