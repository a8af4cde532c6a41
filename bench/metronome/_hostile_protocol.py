"""The `hostile_probe` cases of the API key (HTTP headers, the Realtime browser subprotocol) and of the native
protocol's `/session` (hello, frames, bad JSON, silence), with the `Case` / `case` declarations of `_hostile_cases`."""

from __future__ import annotations

import asyncio
import json

from bench.metronome._hostile_cases import Case, Probe, body, case, post
from bench.metronome._hostile_server import AUTH, FRAME_MS, KEY, Observed, native_exchange


# ------------------------------------------------------------------------------------------------ auth
def auth_cases() -> list[Case]:
    from websockets.exceptions import InvalidStatus

    out: list[Case] = []
    C = "auth"
    for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                          ("empty_bearer", {"Authorization": "Bearer"}), ("basic", {"Authorization": f"Basic {KEY}"}),
                          ("no_scheme", {"Authorization": KEY}), ("x_api_key", {"X-API-Key": KEY}),
                          ("prefix", {"Authorization": f"Bearer {KEY[:-1]}"}),
                          ("huge", {"Authorization": "Bearer " + "k" * 200_000})]:
        case(out, C, f"models_{name}", f"GET /v1/models with {str(headers)[:60]}",
             post(method="GET", path="/v1/models", headers=headers), "refuse", "invalid_api_key", "401", "400",
             "431")
    case(out, C, "chat_none", "POST /v1/chat/completions with no key", post(body(), headers={}), "refuse",
         "invalid_api_key")
    case(out, C, "query_key", "GET /v1/models?api_key=KEY (keys go in headers)",
         post(method="GET", path=f"/v1/models?api_key={KEY}", headers={}), "refuse", "invalid_api_key")
    case(out, C, "bearer_lowercase", "'bearer KEY' (scheme is case-insensitive)",
         post(method="GET", path="/v1/models", headers={"Authorization": f"bearer {KEY}"}), "accept")

    def ws(path: str, headers: dict, subprotocols=None, expect_sub: str | None = None):
        async def run(p: Probe) -> Observed:
            from websockets.asyncio.client import connect

            try:
                async with connect(p.served.ws + path, additional_headers=headers, subprotocols=subprotocols,
                                   open_timeout=20, close_timeout=2) as conn:
                    if expect_sub is not None and conn.subprotocol != expect_sub:
                        return Observed("silent", f"accepted with subprotocol {conn.subprotocol!r}")
                    return Observed("accepted", f"handshake accepted, subprotocol {conn.subprotocol!r}")
            except InvalidStatus as e:
                return Observed("refused", f"handshake HTTP {e.response.status_code}", str(e.response.status_code))
        return run

    for route in ("/v1/realtime?model=omnijax", "/session"):
        tag = "realtime" if "realtime" in route else "native"
        case(out, C, f"{tag}_no_key", f"WS {route} with no key", ws(route, {}), "refuse", "401")
        case(out, C, f"{tag}_wrong_key", f"WS {route} with a wrong bearer key",
             ws(route, {"Authorization": "Bearer nope"}), "refuse", "401")
    case(out, C, "realtime_browser_key", "Realtime browser form: subprotocols realtime, openai-insecure-api-key.KEY",
         ws("/v1/realtime?model=omnijax", {}, ["realtime", f"openai-insecure-api-key.{KEY}"], "realtime"), "accept")
    case(out, C, "realtime_browser_wrong", "Realtime browser form with a wrong key",
         ws("/v1/realtime?model=omnijax", {}, ["realtime", "openai-insecure-api-key.nope"]), "refuse", "401")
    case(out, C, "realtime_browser_no_realtime", "only openai-insecure-api-key.KEY offered (no 'realtime')",
         ws("/v1/realtime?model=omnijax", {}, [f"openai-insecure-api-key.{KEY}"]), "either", "401")
    return out


# ------------------------------------------------------------------------------------------------ native protocol
def native_cases() -> list[Case]:
    out: list[Case] = []
    C = "native"
    hello = json.dumps({"type": "hello", "sample_rate": 16000, "frame_ms": FRAME_MS})
    frame = b"\x00\x00" * (16 * FRAME_MS)  # one frame at 16 kHz

    def ex(messages, replies=1):
        async def run(p: Probe) -> Observed:
            return await native_exchange(p.served.ws, messages, replies=replies)
        return run

    cases: list[tuple[str, list[str | bytes], str, tuple[str, ...]]] = [
             ("valid_frame", [hello, frame], "accept", ()), ("valid_bye", [hello, json.dumps({"type": "bye"})],
                                                            "accept", ()),
             ("binary_hello", [b"\x00" * 10], "refuse", ("no_hello",)),
             ("not_hello", [json.dumps({"type": "bye"})], "refuse", ("no_hello",)),
             ("hello_bad_json", ["{hello"], "refuse", ("bad_json",)),
             ("hello_array", ["[1]"], "refuse", ("bad_json",)),
             ("hello_no_type", [json.dumps({"sample_rate": 16000})], "refuse", ("bad_message",)),
             ("rate_8000", [json.dumps({"type": "hello", "sample_rate": 8000})], "refuse", ("bad_sample_rate",)),
             ("rate_string", [json.dumps({"type": "hello", "sample_rate": "16000"})], "refuse", ("bad_sample_rate",)),
             ("rate_true", [json.dumps({"type": "hello", "sample_rate": True})], "refuse", ("bad_sample_rate",)),
             ("frame_ms_other", [json.dumps({"type": "hello", "frame_ms": 100})], "refuse", ("bad_frame_ms",)),
             ("frame_ms_nan", ['{"type": "hello", "frame_ms": NaN}'], "refuse", ("bad_frame_ms",)),
             ("frame_ms_string", [json.dumps({"type": "hello", "frame_ms": str(FRAME_MS)})], "refuse",
              ("bad_frame_ms",)),
             ("duplex_not_bool", [json.dumps({"type": "hello", "duplex": "yes"})], "refuse", ("bad_message",)),
             ("duplex_demo", [json.dumps({"type": "hello", "duplex": True})], "refuse", ("unsupported",)),
             ("instructions_int", [json.dumps({"type": "hello", "instructions": 5})], "refuse", ("bad_message",)),
             ("hello_unknown_field", [json.dumps({"type": "hello", "sample_rate": 16000, "voice": "alloy"})],
              "refuse", ("bad_message",)),
             ("frame_odd", [hello, b"\x00" * 101], "refuse", ("odd_byte_count",)),
             ("frame_short", [hello, b"\x00\x00" * 100], "refuse", ("bad_frame_size",)),
             ("frame_long", [hello, frame * 3], "refuse", ("bad_frame_size",)),
             ("frame_empty", [hello, b""], "refuse", ("bad_frame_size",)),
             ("image_not_duplex", [hello, json.dumps({"type": "image", "data": ""})], "refuse", ("unsupported",)),
             ("unknown_type", [hello, json.dumps({"type": "flush"})], "refuse", ("bad_message",)),
             ("text_not_json", [hello, "frame please"], "refuse", ("bad_json",)),
             ("frame_over_cap", [hello, b"\x00" * (5 * 2 ** 20)], "refuse", ("close_1009", "bad_frame_size"))]
    for name, messages, expected, codes in cases:
        replies = 0 if name == "valid_bye" or len(messages) == 1 else 1  # a hello alone: "ready" answers it
        shown = ", ".join(m[:50] if isinstance(m, str) else f"<{len(m)} bytes>" for m in messages)
        case(out, C, name, f"/session: {shown}", ex(messages, replies), expected, *codes)

    async def no_hello(p: Probe) -> Observed:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        async with connect(p.served.ws + "/session", additional_headers=AUTH, open_timeout=20) as conn:
            try:
                reply = json.loads(await asyncio.wait_for(conn.recv(), 20))
            except ConnectionClosed as e:
                return Observed("dropped", f"closed {e.rcvd.code if e.rcvd else 1006} with no error")
            return Observed("refused", f"{reply}", reply.get("code"))
    case(out, C, "no_hello_10s", "/session: connect and say nothing", no_hello, "refuse", "hello_timeout",
         timeout_s=40, slow=True)
    return out
