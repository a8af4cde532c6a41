"""The native protocol refuses a field it does not take, by name, instead of ignoring it (the hostile-input probe's
`native/hello_unknown_field`: a hello with "voice" got `ready`)."""

import json

import pytest

from omnijax.serve.native.protocol import ProtocolError, check_fields, parse_hello

FRAME_MS = 200.0


@pytest.mark.parametrize("message, says", [
    ({"type": "hello", "sample_rate": 16000, "voice": "alloy"}, "unknown field 'voice' in a 'hello' message"),
    ({"type": "hello", "frame_m": 200}, "did you mean 'frame_ms'?"),
    ({"type": "hello", "instrucions": "be brief"}, "did you mean 'instructions'?"),
])
def test_a_hello_with_an_unknown_field_is_refused_by_name(message, says):
    with pytest.raises(ProtocolError) as e:
        parse_hello(json.dumps(message), frame_ms=FRAME_MS)
    assert e.value.code == "bad_message" and says in str(e.value)


def test_known_fields_pass_and_later_messages_are_checked_too():
    hello = {"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS, "duplex": False, "instructions": ""}
    assert parse_hello(json.dumps(hello), frame_ms=FRAME_MS) == 3200
    check_fields({"type": "bye"})
    check_fields({"type": "image", "data": ""})
    for message in ({"type": "bye", "reason": "done"}, {"type": "image", "data": "", "mime": "image/png"}):
        with pytest.raises(ProtocolError, match="unknown field") as e:
            check_fields(message)
        assert e.value.code == "bad_message"
