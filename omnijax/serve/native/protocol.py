"""The native wire protocol of `omnijax serve` (`WS /session`; the whole exchange is in `omnijax.serve.native.session`):
the session path, close codes, the audio format, and validation of the client's messages, each failure a `ProtocolError`
naming the error code the server sends back."""

from __future__ import annotations

import difflib
import json
from typing import Any

import numpy as np

SAMPLE_RATE = 16000
# The fields each client message takes (a field in none is refused by name, `bad_message`: nothing is ignored).
FIELDS = {"hello": ("type", "sample_rate", "frame_ms", "duplex", "instructions"), "bye": ("type",),
          "image": ("type", "data")}
PATH = "/session"
CLOSE_ERROR, CLOSE_OVERLOADED, CLOSE_SHUTDOWN = 1008, 1013, 1012  # 1012: uvicorn closes sockets at shutdown


class ProtocolError(ValueError):
    """A malformed message from one client; `code` is the error code sent back."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def frame_samples(frame_ms: float, sample_rate: int = SAMPLE_RATE) -> int:
    """Samples in one frame of `frame_ms` milliseconds (must be a whole number)."""
    n = sample_rate * float(frame_ms) / 1000.0
    if n < 1 or abs(n - round(n)) > 1e-6:
        raise ValueError(f"frame_ms={frame_ms} is not a whole number of samples at {sample_rate} Hz")
    return int(round(n))


def parse_json(message: str) -> dict:
    """A text message as a JSON object with a string `type` (raises `ProtocolError`)."""
    try:
        obj = json.loads(message)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise ProtocolError("bad_json", f"text messages must be JSON objects: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", f"text messages must be JSON objects, got {type(obj).__name__}")
    if not isinstance(obj.get("type"), str):
        raise ProtocolError("bad_message", "a JSON message needs a string 'type'")
    return obj


def check_fields(message: dict) -> None:
    """Refuses (`bad_message`, naming it, with the closest known field as a hint) a field a message of this type does
    not take (`FIELDS`); types not listed are left to their handler."""
    allowed = FIELDS.get(message["type"])
    for key in message if allowed is not None else ():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ProtocolError("bad_message", f"unknown field {key!r} in a {message['type']!r} message{hint}; it "
                                               f"takes {', '.join(allowed)}")


def parse_hello(message: Any, *, frame_ms: float) -> int:
    """Validates the hello (text message) and returns the session's samples per frame."""
    if not isinstance(message, str):
        raise ProtocolError("no_hello", "the first message must be a JSON hello, got a binary message")
    hello = parse_json(message)
    if hello["type"] != "hello":
        raise ProtocolError("no_hello", f"the first message must be a hello, got type {hello['type']!r}")
    check_fields(hello)
    rate = hello.get("sample_rate", SAMPLE_RATE)
    if isinstance(rate, bool) or rate != SAMPLE_RATE:
        raise ProtocolError("bad_sample_rate", f"sample_rate must be {SAMPLE_RATE} (mono int16 PCM), got {rate!r}")
    ms = hello.get("frame_ms", frame_ms)
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not abs(float(ms) - frame_ms) <= 1e-6:  # NaN
        raise ProtocolError("bad_frame_ms", f"this server ticks every {frame_ms:g} ms: frame_ms must be {frame_ms:g}, "
                                            f"got {ms!r}")
    return frame_samples(frame_ms)


def hello_duplex(message: str) -> bool:
    """Whether a (valid) hello asks for full duplex (`"duplex": true`; raises `ProtocolError` on a non-boolean)."""
    duplex = parse_json(message).get("duplex", False)
    if not isinstance(duplex, bool):
        raise ProtocolError("bad_message", f"'duplex' must be a boolean, got {duplex!r}")
    return duplex


def decode_frame(data: bytes, samples: int) -> np.ndarray:
    """One binary frame -> `[samples]` int16 PCM (raises `ProtocolError` on a wrong byte count)."""
    if len(data) % 2:
        raise ProtocolError("odd_byte_count", f"a frame is int16 PCM (2 bytes per sample), got {len(data)} bytes")
    if len(data) != 2 * samples:
        raise ProtocolError("bad_frame_size", f"a frame is exactly {samples} samples ({2 * samples} bytes), "
                                              f"got {len(data) // 2} samples")
    return np.frombuffer(data, dtype="<i2")
