"""A Realtime client that never reads while each of its events is refused with an echo of a megabyte value (issue 35
item 5, the hostile probe's `traffic/never_reads_big_echoes`: the server held +178 MB and never dropped it).

Where the bytes were: the client offers permessage-deflate (websockets does by default) and uvicorn accepted it, so
320 one-megabyte events cost ~1 KB each on the wire; the server parsed every frame of a socket read at once and queued
dozens of decompressed megabytes for the application, and each refusal built and sent a 1 MB echo that compressed to
~1 KB, so the socket never filled and the outbox cap never saw a slow consumer. Now the server negotiates no
compression and an error event's message is cut to `MAX_ERROR_CHARS`. Held bytes are measured with tracemalloc (every
Python allocation of the process, server and client), not RSS.
"""

import json
import socket
import time
import tracemalloc

import pytest

pytest.importorskip("websockets", reason="websockets (the `serve` and `test` extras) runs the server")

from omnijax.serve.outbox import MAX_ERROR_CHARS, Outbox, cap_error_message  # noqa: E402
from tests._support.demo_server import demo_server  # noqa: E402

CAP = 2 * 2 ** 20  # the test server's max_outbox_bytes
EVENTS = 160  # each a 1 MiB role the server refuses (the probe sent 320)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with demo_server(tmp_path_factory.mktemp("serve"), max_outbox_bytes=CAP, max_output_tokens=6) as server:
        yield server


class RawClient:
    """A WebSocket client on a plain socket (websockets' sans-I/O protocol) that offers permessage-deflate and writes
    its frames in bursts of up to 256 KB, as a hostile client can: nothing of it waits on the server."""

    def __init__(self, port: int):
        from websockets.client import ClientProtocol
        from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory
        from websockets.protocol import State
        from websockets.uri import parse_uri

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(20)
        self.conn = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/realtime"),
                                   extensions=[ClientPerMessageDeflateFactory()], max_size=None)
        self.conn.send_request(self.conn.connect())
        self._flush()
        self.events: list = []
        while self.conn.state is State.CONNECTING:
            self._read()
        self.response = self.events.pop(0)  # the handshake's Response; frames follow
        self.pending = bytearray()

    def _flush(self) -> None:
        self.sock.sendall(b"".join(self.conn.data_to_send()))

    def _read(self) -> None:
        self.conn.receive_data(self.sock.recv(1 << 16))
        self.events.extend(self.conn.events_received())

    def send(self, text: str) -> None:
        self.conn.send_text(text.encode())
        self.pending += b"".join(self.conn.data_to_send())
        if len(self.pending) >= 256 * 1024:
            self.sock.sendall(self.pending)
            self.pending.clear()

    def finish(self) -> None:
        self.sock.sendall(self.pending)
        self.pending.clear()

    def texts(self, n: int) -> list[dict]:
        """The first `n` text messages the server sent, read now."""
        while sum(getattr(e, "opcode", None) is not None for e in self.events) < n:
            self._read()
        return [json.loads(e.data) for e in self.events[:n]]


def test_a_never_reading_client_with_megabyte_refusals_holds_bounded_memory(served):
    """The peak of Python memory while the flood goes on stays within a few messages' size above the start (before:
    the server read a burst of ~1 KB compressed frames at once and queued one decompressed megabyte for each, over
    100 MiB at the peak), no compression is negotiated, and every error event the client finally reads is short and
    says it was cut (before: a 2 MiB outbox overflowed after two echoes)."""
    served.wait_idle()
    event = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "r" * 2 ** 20, "content": [{"type": "input_text", "text": "x"}]}})
    client = RawClient(served.port)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(EVENTS):
            client.send(event)
        client.finish()
        time.sleep(1.0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    received = client.texts(EVENTS + 1)
    client.sock.close()
    assert peak < 24 * 2 ** 20, f"{peak / 2 ** 20:.0f} MiB of Python memory held at the peak of the flood"
    extensions = client.response.headers.get("Sec-WebSocket-Extensions")
    assert extensions is None, f"the server negotiated {extensions!r}"
    assert received[0]["type"] == "session.created"
    errors = [e["error"] for e in received[1:]]
    assert all(e["code"] == "invalid_value" and e["param"] == "item.role" for e in errors)
    assert all(len(e["message"]) < MAX_ERROR_CHARS + 200 for e in errors)
    assert errors[0]["message"].startswith("'item.role' must be \"user\" or \"system\", got 'rrr")
    assert "message cut: 1,048," in errors[0]["message"]
    served.wait_idle()


def test_error_messages_are_cut_in_both_shapes_and_nothing_else_changes():
    long = "v" * (MAX_ERROR_CHARS * 3)
    realtime = {"type": "error", "event_id": "e1", "error": {"code": "invalid_value", "message": long, "param": "x"}}
    cut = cap_error_message(realtime)
    assert cut["error"]["message"].startswith("v" * MAX_ERROR_CHARS + "... [message cut: 6,144 characters")
    assert cut["error"]["code"] == "invalid_value" and cut["error"]["param"] == "x" and cut["event_id"] == "e1"
    assert realtime["error"]["message"] == long  # the caller's event is not changed
    native = {"type": "error", "code": "bad_frame", "message": long}
    assert cap_error_message(native)["message"].endswith(f"at most {MAX_ERROR_CHARS:,}]")
    short = {"type": "error", "error": {"message": "short"}}
    assert cap_error_message(short) is short
    delta = {"type": "response.output_text.delta", "delta": long}  # only error events are cut
    assert cap_error_message(delta) is delta

    box = Outbox(max_messages=4, max_bytes=10 * MAX_ERROR_CHARS)
    assert box.put(realtime) and box.put(delta)
    assert box.bytes < len(long) + 2 * MAX_ERROR_CHARS + 1000  # the error went in cut, the delta whole
