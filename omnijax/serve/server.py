"""`omnijax-serve`: the alias of `omnijax serve` (`omnijax.serve.app`), which serves the OpenAI-compatible routes and
omnijax's native per-frame protocol (`WS /session`, documented in `omnijax.serve.native.session`) on one port.

The names of the native protocol and its frame encoding stay importable from here.
"""

from omnijax.serve.app import build_demo_model, main
from omnijax.serve.audio_frames import AudioFrameEncoder, frame_tokens
from omnijax.serve.native.protocol import (
    CLOSE_ERROR,
    CLOSE_OVERLOADED,
    CLOSE_SHUTDOWN,
    PATH,
    SAMPLE_RATE,
    ProtocolError,
    decode_frame,
    frame_samples,
    parse_hello,
    parse_json,
)

__all__ = ["AudioFrameEncoder", "CLOSE_ERROR", "CLOSE_OVERLOADED", "CLOSE_SHUTDOWN", "PATH", "ProtocolError",
           "SAMPLE_RATE", "build_demo_model", "decode_frame", "frame_samples", "frame_tokens", "main", "parse_hello",
           "parse_json"]

if __name__ == "__main__":
    raise SystemExit(main())
