"""The cases of `hostile_probe` over HTTP and the native protocol, and how an outcome is classified.

A `Case` declares what the server should do (`expected`: "refuse" with one of `codes`, "accept", "either" when both
are sound, "verdict" when the scenario judges itself), and `classify` turns what happened (`Observed`) into one of
the issue's classes: clear (refused as declared), ok (accepted as declared), crash (a 5xx, a dropped socket, a dead
server), hang (no answer within the case's timeout, or `/v1/models` slower than 2 s after it), silent (accepted
although it should have been refused, e.g. a field ignored), loss (a session or its snapshot lost), and wrong (a
refusal of valid input, or with another code than declared: the probe's expectation or the server is wrong)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bench.metronome import _hostile_media as media
from bench.metronome._hostile_sampling import tools_and_sampling_cases
from bench.metronome._hostile_server import AUTH, Observed, ProbeServer, http

CLASSES = ("clear", "ok", "crash", "hang", "silent", "loss", "wrong")
MISSING = object()


@dataclasses.dataclass
class Case:
    """One hostile input: `run(probe)` performs it; `expected` / `codes` / `expect` declare the right outcome."""

    id: str
    category: str
    summary: str
    expected: str  # "refuse" | "accept" | "either" | "verdict"
    run: Callable[[Probe], Awaitable[Observed]]
    codes: tuple[str, ...] = ()
    expect: str = ""
    timeout_s: float = 30.0
    param: str | None = None  # a refusal's error must name this field (or one inside it: a prefix)
    slow: bool = False  # left out of --smoke
    leak_check: bool = False  # afterwards, count the sessions the server still holds for this (idle) client

    def __post_init__(self):
        if not self.expect:
            self.expect = {"refuse": f"refused ({'/'.join(self.codes) or '4xx'})", "accept": "accepted, answered",
                           "either": "refused clearly or accepted"}.get(self.expected, "see summary")
            if self.param is not None:
                self.expect += f" naming {self.param!r}"


def classify(case: Case, seen: Observed) -> str:
    if seen.outcome in ("ok", "clear", "crash", "hang", "silent", "loss", "wrong"):
        return seen.outcome
    if seen.outcome == "dropped":
        return "crash"
    if case.expected == "refuse":
        if seen.outcome == "accepted":
            return "silent"
        if case.param is not None and not (seen.param or "").startswith(case.param):
            return "wrong"
        return "clear" if not case.codes or seen.code in case.codes else "wrong"
    if case.expected == "accept":
        return "ok" if seen.outcome == "accepted" else "wrong"
    return "ok" if seen.outcome == "accepted" else "clear"


class FetchListener:
    """A TCP listener on a free loopback port that counts connections: an image URL pointing here tells whether
    the server fetched it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()


@dataclasses.dataclass
class Probe:
    """What a case runs against: the served process, an HTTP client, the fetch listener, and shared state
    (a resumable session's token and reference answers)."""

    served: ProbeServer
    client: httpx.AsyncClient
    listener: FetchListener
    state: dict = dataclasses.field(default_factory=dict)

    @property
    def base(self) -> str:
        return self.served.base


def body(**changes: Any) -> dict:
    """A valid chat-completions body with `changes` (MISSING deletes a field)."""
    b: dict[str, Any] = {"model": "omnijax", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for k, v in changes.items():
        if v is MISSING:
            b.pop(k, None)
        else:
            b[k] = v
    return b


def user(*parts: Any) -> dict:
    return body(messages=[{"role": "user", "content": list(parts)}])


def post(payload: Any = None, *, raw: bytes | None = None, headers: dict | None = None, method: str = "POST",
         path: str = "/v1/chat/completions"):
    async def run(p: Probe) -> Observed:
        return await http(p.client, method, p.base + path, body=payload, raw=raw, headers=headers)
    return run


def case(cases: list, category: str, name: str, summary: str, run, expected: str = "refuse", *codes: str, **kw):
    cases.append(Case(f"{category}/{name}", category, summary, expected, run, tuple(codes), **kw))


# ------------------------------------------------------------------------------------------------ chat fields
def chat_field_cases() -> list[Case]:
    out: list[Case] = []
    C = "chat_fields"

    def add(name, summary, payload, expected="refuse", *codes, **kw):
        case(out, C, name, summary, post(payload), expected, *codes, **kw)

    add("valid", "a plain request (control)", body(), "accept")
    add("valid_stream", "stream true, include_usage", body(stream=True, stream_options={"include_usage": True}),
        "accept")
    for name, v in [("missing", MISSING), ("empty", ""), ("other", "gpt-4o"), ("int", 5), ("list", ["omnijax"]),
                    ("case", "OMNIJAX"), ("space", "omnijax ")]:
        add(f"model_{name}", f"model = {v if v is not MISSING else '(missing)'!r}", body(model=v), "refuse",
            "model_not_found")
    msgs = [("missing", MISSING), ("empty_list", []), ("object", {}), ("string", "hi"), ("int_item", [1]),
            ("no_content", [{"role": "user"}]),
            ("function_role", [{"role": "function", "content": "x", "name": "f"}]), ("no_role", [{"content": "hi"}]),
            ("int_role", [{"role": 5, "content": "hi"}]), ("empty_parts", [{"role": "user", "content": []}]),
            ("int_content", [{"role": "user", "content": 5}]), ("dict_content", [{"role": "user", "content": {}}]),
            ("part_no_text", [{"role": "user", "content": [{"type": "text"}]}]),
            ("part_int_text", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            ("part_no_type", [{"role": "user", "content": [{"text": "hi"}]}]),
            ("part_not_object", [{"role": "user", "content": ["hi"]}]),
            ("part_video_url", [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]),
            ("part_file", [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]),
            ("part_refusal", [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]),
            ("assistant_image", [{"role": "assistant", "content": [
                {"type": "image_url", "image_url": {"url": media.data_url(media.image())}}]}]),
            ("system_audio", [{"role": "system", "content": [
                {"type": "input_audio", "input_audio": {"data": media.b64(media.wav()), "format": "wav"}}]}])]
    for name, v in msgs:
        add(f"messages_{name}", f"messages = {json.dumps(v)[:70] if v is not MISSING else '(missing)'}",
            body(messages=v), "refuse", "invalid_value", "unsupported")
    add("messages_tool_role", "a tool message without its tool_call_id (the call it answers)",
        body(messages=[{"role": "tool", "content": "x"}]), "refuse", "invalid_value", param="messages[0].tool_call_id")
    add("messages_multi_turn", "system, user, assistant (content null), user", body(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]), "accept")
    add("messages_developer", "developer role (system)", body(messages=[{"role": "developer", "content": "x"},
                                                                        {"role": "user", "content": "hi"}]), "accept")
    add("messages_empty_text", "user content ''", body(messages=[{"role": "user", "content": ""}]), "either")
    add("messages_nul", "user content with NUL and control characters",
        body(messages=[{"role": "user", "content": "a\u0000b\u0007c"}]), "either")
    add("messages_lone_surrogate", "user content with a lone surrogate (\\ud800)",
        body(messages=[{"role": "user", "content": "a\ud800b"}]), "either")
    add("messages_name_ignored", "message 'name' (who speaks) is ignored?",
        body(messages=[{"role": "user", "content": "hi", "name": "alice"}]))
    add("messages_tool_calls_ignored", "assistant 'tool_calls' in history: honoured by a template that renders "
        "tools; the demo model's renders none, so refused naming the message and the model", body(messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "user", "content": "go"}]), "refuse", "unsupported", param="messages[1]")
    for field in ("max_tokens", "max_completion_tokens"):
        for name, v in [("zero", 0), ("negative", -1), ("float", 1.5), ("string", "5"), ("bool", True),
                        ("nan", float("nan")), ("list", [2])]:
            add(f"{field}_{name}", f"{field} = {v!r}", body(**{field: v, "max_tokens": MISSING} if field !=
                                                            "max_tokens" else {field: v}), "refuse", "invalid_value")
    add("max_tokens_huge", "max_tokens = 10**12 (answered up to the server's cap, finish_reason length)",
        body(max_tokens=10 ** 12), "accept")
    add("max_tokens_2_64", "max_tokens = 2**64", body(max_tokens=2 ** 64), "either")
    for name, v in [("string", "true"), ("int", 1), ("null", None)]:
        add(f"stream_{name}", f"stream = {v!r}", body(stream=v), "either" if v is None else "refuse",
            "invalid_value")
    add("stream_options_string", "stream_options = 'x'", body(stream=True, stream_options="x"), "refuse",
        "invalid_value")
    add("stream_options_usage_string", "stream_options.include_usage = 'yes' (a string)",
        body(stream=True, stream_options={"include_usage": "yes"}), "refuse", "invalid_value")
    add("stream_options_without_stream", "stream_options with stream false",
        body(stream_options={"include_usage": True}), "refuse", "invalid_value")
    add("stream_options_unknown", "stream_options has an unknown key", body(stream=True, stream_options={"x": 1}),
        "refuse", "invalid_value", "unknown_parameter")
    for name, v in [("negative", -0.1), ("over", 2.1), ("string", "1"), ("nan", float("nan")),
                    ("inf", float("inf")), ("bool", True), ("list", [1])]:
        add(f"temperature_{name}", f"temperature = {v!r}", body(temperature=v), "refuse", "invalid_value")
    add("temperature_valid", "temperature = 0.7, seed 7", body(temperature=0.7, seed=7), "accept")
    for name, v in [("zero", 0), ("over", 1.1), ("negative", -1), ("string", "0.5"), ("nan", float("nan"))]:
        add(f"top_p_{name}", f"top_p = {v!r}", body(top_p=v), "refuse", "invalid_value")
    add("top_p_valid", "top_p = 0.5", body(top_p=0.5), "accept")
    for name, v in [("2_63", 2 ** 63), ("below", -(2 ** 63) - 1), ("2_64", 2 ** 64), ("float", 1.5), ("string", "7"),
                    ("bool", True), ("huge", 10 ** 40)]:
        add(f"seed_{name}", f"seed = {v!r}", body(seed=v), "refuse", "invalid_value")
    for name, v in [("max", 2 ** 63 - 1), ("min", -(2 ** 63)), ("negative", -1)]:
        add(f"seed_ok_{name}", f"seed = {v} (inside the signed 64-bit range)", body(seed=v), "accept")
    refused = [("response_format_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
               ("response_format_string", {"response_format": "text"}),
               ("response_format_type", {"response_format": {"type": "yaml"}}),
               ("functions", {"functions": [{"name": "f"}]}),
               ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
               ("prediction", {"prediction": {"type": "content", "content": "x"}})]
    for name, extra in refused:
        add(name, f"{json.dumps(extra)[:80]} (documented as refused)", body(**extra), "refuse", "unsupported",
            "invalid_value", param="response_format" if name.startswith("response_format") else name)
    tools_and_sampling_cases(add, body)
    add("response_format_text", "response_format {'type': 'text'}", body(response_format={"type": "text"}), "accept")
    add("response_format_json", "response_format {'type': 'json_object'} (constrained decoding)",
        body(response_format={"type": "json_object"}), "accept")
    add("response_format_json_schema", "response_format json_schema {'type': 'object'} (constrained decoding)",
        body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
        "accept")
    add("stop_string", "stop = '\\n' (honoured)", body(stop="\n"), "accept")
    add("stop_list", "stop = ['a', 'b'] (honoured)", body(stop=["a", "b"]), "accept")
    for name, v in [("five", ["a", "b", "c", "d", "e"]), ("empty", [""]), ("number", 5), ("long", ["x" * 1001])]:
        add(f"stop_{name}", f"stop = {json.dumps(v)[:40]}", body(stop=v), "refuse", "invalid_value", param="stop")
    # Fields chat_completions.py's docstring neither accepts nor refuses: ignoring them is silent acceptance.
    unknown = [("metadata", {"k": 5}), ("user", ["probe"]), ("store", True), ("service_tier", "flex"),
               ("modalities", ["text", "audio"]), ("reasoning_effort", "high"), ("parallel_tool_calls", "no"),
               ("web_search_options", {}), ("max_token", 5),
               ("temprature", 0.5), ("safety_identifier", 7), ("prompt_cache_key", "k")]
    for name, v in unknown:
        add(f"unknown_{name}", f"{name} = {json.dumps(v)} (not documented: accepted or refused?)", body(**{name: v}),
            "refuse", "invalid_value", "unsupported", "unknown_parameter")
    # The same fields at the value that asks for nothing (what LangChain, lm-eval and the SDK send): honoured
    add("neutral_defaults", "penalties 0, logit_bias {}, stop [], tools [] / tool_choice none / parallel_tool_calls, "
        "service_tier auto, store false, user, metadata (asks for nothing)",
        body(frequency_penalty=0, presence_penalty=0.0, logit_bias={}, stop=[], tools=[], tool_choice="none",
             parallel_tool_calls=True, service_tier="auto", store=False, modalities=["text"], user="probe",
             metadata={"k": "v"}, n=1, top_k=-1, repetition_penalty=1.0), "accept")
    add("neutral_stream_usage", "stream with stream_options include_usage true (LangChain's streaming)",
        body(stream=True, stream_options={"include_usage": True}), "accept")
    case(out, C, "labels_kept", "user 'probe-user-7' and metadata {'k': 'v'}: logged and echoed (no effect on the "
         "answer)", _labels_kept(), "verdict", expect="the completion echoes the metadata, the log names the user")
    return out


def _labels_kept():
    async def run(p: Probe) -> Observed:
        mark = len(p.served.lines)
        r = await p.client.post(p.base + "/v1/chat/completions", json=body(user="probe-user-7", metadata={"k": "v"}),
                                headers=AUTH)
        if r.status_code != 200:
            return Observed("wrong", f"HTTP {r.status_code}: {r.text[:160]}")
        await asyncio.sleep(0.5)  # the server's log line
        logged = any("user='probe-user-7'" in x for x in p.served.log_since(mark))
        echoed = r.json().get("metadata") == {"k": "v"}
        return Observed("ok" if logged and echoed else "silent", f"metadata echoed: {echoed}; user logged: {logged}")
    return run


# ------------------------------------------------------------------------------------------------ chat body / caps
def chat_body_cases() -> list[Case]:
    out: list[Case] = []
    C = "chat_body"
    for name, raw in [("not_json", b"{"), ("empty", b""), ("array", b"[]"), ("string", b'"hi"'), ("null", b"null"),
                      ("nan", b"NaN"), ("deep_nesting", b"[" * 100_000 + b"]" * 100_000),
                      ("deep_object", b'{"model": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
                      ("bad_utf8", b'{"model": "omnijax", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
                      ("duplicate_keys", b'{"model": "x", "model": "omnijax", "messages": '
                                         b'[{"role": "user", "content": "hi"}], "max_tokens": 2}')]:
        expected = "either" if name == "duplicate_keys" else "refuse"
        case(out, C, name, f"body = {raw[:40]!r}{'...' if len(raw) > 40 else ''}", post(raw=raw), expected,
             "invalid_json", "invalid_value", "model_not_found", "400")
    big = json.dumps(body(messages=[{"role": "user", "content": "x" * (5 * 2 ** 20)}])).encode()
    case(out, C, "over_body_cap", "a 5 MB body (server cap 4 MB)", post(raw=big), "refuse", "too_large", "413")
    case(out, C, "messages_1001", "1,001 messages (MAX_MESSAGES 1,000)",
         post(body(messages=[{"role": "user", "content": "hi"}] * 1001)), "refuse", "invalid_value")
    case(out, C, "parts_257", "257 text parts (MAX_PARTS 256)",
         post(user(*[{"type": "text", "text": "a"}] * 257)), "refuse", "invalid_value")
    case(out, C, "parts_10000", "10,000 text parts in one message",
         post(user(*[{"type": "text", "text": "a"}] * 10_000)), "refuse", "invalid_value")
    case(out, C, "parts_256", "256 one-letter text parts (at the cap)",
         post(user(*[{"type": "text", "text": "a"}] * 256)), "accept", timeout_s=90, slow=True)
    case(out, C, "get_chat", "GET /v1/chat/completions", post(method="GET"), "refuse", "405")
    case(out, C, "post_models", "POST /v1/models", post(body(), path="/v1/models"), "refuse", "405")
    case(out, C, "unknown_route", "POST /v1/completions", post(body(), path="/v1/completions"), "refuse", "404")
    case(out, C, "embeddings_route", "POST /v1/embeddings", post({"input": "x"}, path="/v1/embeddings"), "refuse",
         "404")
    case(out, C, "path_traversal", "GET /v1/../../etc/passwd", post(method="GET", path="/v1/%2e%2e/%2e%2e/etc/passwd"),
         "refuse", "404")
    case(out, C, "text_plain", "a valid body sent as text/plain",
         post(raw=json.dumps(body()).encode(), headers={**AUTH, "content-type": "text/plain"}), "either")
    return out


# ------------------------------------------------------------------------------------------------ media
def _audio(data: str | Any, fmt: Any = "wav") -> dict:
    return user({"type": "text", "text": "listen"}, {"type": "input_audio", "input_audio": {"data": data,
                                                                                        "format": fmt}})


def _img(url: Any, **extra) -> dict:
    return user({"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url, **extra}})


def _fetch_checked(payload: dict):
    """A request whose image URL points at the probe's listener: a connection there means the server fetched."""
    async def run(p: Probe) -> Observed:
        before = p.listener.hits
        url = payload["messages"][0]["content"][1]["image_url"]["url"].replace("PORT", str(p.listener.port))
        seen = await post(_img(url))(p)
        await asyncio.sleep(0.3)
        if p.listener.hits > before:
            return Observed("silent", f"the server connected to {url} ({seen.detail})")
        return seen
    return run


def chat_media_cases() -> list[Case]:
    out: list[Case] = []
    C = "chat_media"
    W = media.wav
    wavs = [("valid_16k", W(), "accept"), ("valid_24k_stereo", W(media.tone(0.5, 24000, 2), rate=24000, channels=2),
                                           "accept"),
            ("valid_8k", W(media.tone(0.5, 8000), rate=8000), "accept"),
            ("valid_384k", W(media.tone(0.1, 384000), rate=384000), "accept"),
            ("extensible_pcm16", W(tag=media.EXTENSIBLE, fmt_extra=media.extensible()), "accept"),
            ("rate_0", W(rate=0), "refuse"), ("rate_1", W(rate=1), "refuse"), ("rate_4e9", W(rate=4_000_000_000),
                                                                               "refuse"),
            ("rate_384001", W(rate=384_001), "refuse"), ("rate_999", W(rate=999), "refuse"),
            ("bits_8", W(media.tone()[::2], bits=8), "refuse"), ("bits_24", W(media.tone()[:-2], bits=24), "refuse"),
            ("bits_0", W(bits=0, block_align=2), "refuse"), ("bits_12", W(bits=12, block_align=2), "either"),
            ("float32", W(b"\x00" * 4000, bits=32, tag=media.FLOAT), "refuse"),
            ("block_align_0", W(block_align=0), "refuse"), ("block_align_3", W(block_align=3), "either"),
            ("byte_rate_wrong", W(byte_rate=1), "either"), ("channels_0", W(channels=0, block_align=2), "refuse"),
            ("channels_65535", W(b"\x00" * (65535 * 2 * 4), channels=65535), "either"),
            ("truncated_data", W(media.tone()[:100], data_size=16000), "either"),
            ("odd_data", W(b"\x01"), "refuse"), ("empty_data", W(b""), "refuse"),
            ("no_data_chunk", W(with_data=False), "refuse"), ("no_fmt_chunk", W(with_fmt=False), "refuse"),
            ("fmt_size_2", W(fmt_size=2), "refuse"), ("not_riff", b"NOTAWAVEFILE" * 10, "refuse"),
            ("avi_magic", W(wave=b"AVI "), "refuse"), ("empty_file", b"", "refuse"),
            ("huge_junk_chunk", W(chunks=b"JUNK" + b"\xff\xff\xff\xff"), "refuse"),
            ("extensible_float", W(b"\x00" * 4000, bits=32, tag=media.EXTENSIBLE,
                                   fmt_extra=media.extensible(media.FLOAT, bits=32)), "refuse"),
            ("extensible_unknown_guid", W(tag=media.EXTENSIBLE, fmt_extra=media.extensible(
                guid_tail=b"\x11" * 12)), "refuse"),
            ("extensible_truncated", W(tag=media.EXTENSIBLE, fmt_extra=media.extensible(truncate=6)), "refuse"),
            ("mp3_tag", W(tag=0x55), "refuse"), ("alaw_tag", W(tag=6, bits=8, block_align=1), "refuse")]
    for name, data, expected in wavs:
        case(out, C, f"wav_{name}", f"input_audio wav: {name.replace('_', ' ')} ({len(data)} bytes)",
             post(_audio(media.b64(data))), expected, "invalid_value", timeout_s=60)
    case(out, C, "wav_not_base64", "input_audio data '@@not base64@@'", post(_audio("@@not base64@@")), "refuse",
         "invalid_value")
    case(out, C, "wav_base64_newlines", "input_audio data base64 with line breaks",
         post(_audio("\n".join(media.b64(W())[i:i + 76] for i in range(0, len(media.b64(W())), 76)))), "either",
         "invalid_value")
    case(out, C, "wav_data_int", "input_audio data = 5", post(_audio(5)), "refuse", "invalid_value")
    case(out, C, "audio_format_mp3", "input_audio format 'mp3'", post(_audio(media.b64(W()), "mp3")), "refuse",
         "unsupported")
    case(out, C, "audio_format_missing", "input_audio without format", post(_audio(media.b64(W()), None)), "refuse",
         "unsupported", "invalid_value")
    case(out, C, "audio_not_object", "input_audio = 'x'", post(user({"type": "input_audio", "input_audio": "x"})),
         "refuse", "invalid_value")
    images = [("png_rgb", media.image(), "accept", "image/png"),
              ("png_rgba_alpha", media.image(mode="RGBA"), "accept", "image/png"),
              ("jpeg", media.image(fmt="JPEG"), "accept", "image/jpeg"),
              ("gray", media.image(mode="L"), "accept", "image/png"),
              ("gif_palette", media.image(mode="P", fmt="GIF"), "either", "image/gif"),
              ("jpeg_labelled_png", media.image(fmt="JPEG"), "either", "image/png"),
              ("header_20000x20000", media.png_header(20000, 20000), "refuse", "image/png"),
              ("header_12000x12000", media.png_header(12000, 12000), "refuse", "image/png"),
              ("header_0x0", media.png_header(0, 0), "refuse", "image/png"),
              ("header_1x100000", media.png_header(1, 100_000), "either", "image/png"),
              ("header_2p31", media.png_header(2 ** 31 - 1, 1), "refuse", "image/png"),
              ("png_1x1", media.image(1, 1), "either", "image/png"),
              ("png_truncated", media.image(64, 64)[:-60], "refuse", "image/png"),
              ("png_half", media.image(64, 64)[: len(media.image(64, 64)) // 2], "refuse", "image/png"),
              ("png_corrupt", media.corrupt(media.image(64, 64)), "refuse", "image/png"),
              ("jpeg_truncated", media.image(64, 64, fmt="JPEG")[:200], "refuse", "image/jpeg"),
              ("not_an_image", b"hello, I am text" * 20, "refuse", "image/png"),
              ("empty", b"", "refuse", "image/png"),
              ("svg", b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "refuse", "image/svg+xml")]
    for name, data, expected, mime in images:
        case(out, C, f"image_{name}", f"image_url {mime}: {name.replace('_', ' ')} ({len(data)} bytes)",
             post(_img(media.data_url(data, mime))), expected, "invalid_value", timeout_s=60)
    case(out, C, "image_6000x6000", "a whole black 6000x6000 PNG (36 MP, under the 50 MP cap)",
         post(_img(media.data_url(media.png_zeros(6000, 6000)))), "accept", timeout_s=120, slow=True)
    for name, url in [("text_mime", media.data_url(b"hello", "text/plain")),
                      ("audio_mime", media.data_url(W(), "audio/wav")),
                      ("not_base64", "data:image/png;base64,@@@@"), ("url_encoded", "data:image/png,%89PNG"),
                      ("file_url", "file:///etc/passwd"), ("ftp_url", "ftp://127.0.0.1/x.png"), ("int", 5)]:
        case(out, C, f"image_url_{name}", f"image_url = {str(url)[:60]!r}", post(_img(url)), "refuse",
             "unsupported", "invalid_value")
    for name, url in [("http", "http://127.0.0.1:PORT/x.png"), ("https", "https://127.0.0.1:PORT/x.png")]:
        case(out, C, f"image_url_{name}_not_fetched", f"image_url {url} (must be refused and never fetched)",
             _fetch_checked(_img(url)), "refuse", "unsupported")
    case(out, C, "image_detail_bogus", "image_url.detail = 'ultra' (not a detail level)",
         post(_img(media.data_url(media.image()), detail="ultra")), "refuse", "invalid_value")
    return out
