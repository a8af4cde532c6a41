"""The Realtime cases of `hostile_probe`: every client event type with bad field values, unknown events, bad JSON,
binary and oversized messages, audio buffer overflow, seeds outside 64 bits, wrong model names, and images in
`conversation.item.create`. Each case opens its own connection, sends the event, then a control event
(`input_audio_buffer.clear`) whose answer shows the session is alive: an `error` event before it is a refusal."""

from __future__ import annotations

import json
from typing import Any

from bench.metronome import _hostile_media as media
from bench.metronome._hostile_cases import Case, Probe, case
from bench.metronome._hostile_server import Observed, Realtime

C = "realtime_events"
QUESTIONS = ("First question.", "Second one.", "Third now.", "Fourth and last.")
ANSWER_TOKENS = 6


def rt(event: Any, accepted: frozenset[str] = frozenset(), *, query: str = "model=omnijax", setup: tuple = ()):
    async def run(p: Probe) -> Observed:
        async with Realtime.open(p.served.ws, query=query) as s:
            for e in setup:
                await s.send(e)
            return await s.probe(event, set(accepted))
    return run


async def say(s: Realtime, text: str, tokens: int = ANSWER_TOKENS) -> tuple[str, dict]:
    """One turn: a text item and `response.create`; the answer's text and its `response.done` (or the error)."""
    await s.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                               "content": [{"type": "input_text", "text": text}]}})
    await s.send({"type": "response.create", "response": {"max_output_tokens": tokens}})
    deltas = []
    while True:
        event = await s.until({"response.output_text.delta", "response.done"})
        if event["type"] == "error":
            return "", event
        if event["type"] == "response.done":
            return "".join(deltas), event
        deltas.append(event["delta"])


def responded():
    async def run(p: Probe) -> Observed:
        async with Realtime.open(p.served.ws) as s:
            text, done = await say(s, "Hello there.")
            if done["type"] == "error":
                return Observed("refused", str(done["error"])[:200], done["error"].get("code"))
            status = done["response"]["status"]
            if status != "completed" and done["response"].get("status_details", {}).get("reason") != \
                    "max_output_tokens":
                return Observed("dropped", f"response.done status {status}: {done['response'].get('status_details')}")
            return Observed("accepted", f"response.done {status}, {len(text)} characters")
    return run


def metadata_echoed():
    async def run(p: Probe) -> Observed:
        async with Realtime.open(p.served.ws) as s:
            await s.send(_item(_text("hi")))
            await s.send({"type": "response.create", "response": {"max_output_tokens": 2, "metadata": {"k": "v"}}})
            created = await s.until({"response.created"})
            done = await s.until({"response.done"})
        if created.get("type") == "error":
            return Observed("wrong", f"refused: {created['error']}")
        echoed = [e.get("response", {}).get("metadata") for e in (created, done)]
        if echoed == [{"k": "v"}] * 2:
            return Observed("ok", "response.created and response.done carry the metadata")
        return Observed("silent", f"accepted, metadata not echoed: {echoed}")
    return run


def connect_model(query: str):
    async def run(p: Probe) -> Observed:
        from websockets.exceptions import ConnectionClosed

        try:
            async with Realtime.open(p.served.ws, query=query) as s:
                if s.created.get("type") == "error":
                    err = s.created["error"]
                    return Observed("refused", f"error {err.get('code')}: {err.get('message')}", err.get("code"))
                return Observed("accepted", f"{s.created.get('type')}, session.model "
                                f"{(s.created.get('session') or {}).get('model')!r}")
        except ConnectionClosed as e:
            return Observed("refused", f"closed {e.rcvd.code if e.rcvd else 1006}", "closed")
    return run


def _item(*parts: Any, role: str = "user", **extra: Any) -> dict:
    return {"type": "conversation.item.create", "item": {"type": "message", "role": role, "content": list(parts),
                                                          **extra}}


def _text(text: Any = "hi") -> dict:
    return {"type": "input_text", "text": text}


def _session(**fields: Any) -> dict:
    return {"type": "session.update", "session": {"type": "realtime", **fields}}


def realtime_event_cases() -> list[Case]:
    out: list[Case] = []
    updated = frozenset({"session.updated"})

    def add(name, summary, event, expected="refuse", *codes, accepted=frozenset(), **kw):
        case(out, C, name, summary, rt(event, accepted, **{k: kw.pop(k) for k in ("setup", "query") if k in kw}),
             expected, *codes, **kw)

    # session.update
    add("session_missing", "session.update without session", {"type": "session.update"}, "refuse", "missing_field")
    for name, v in [("string", "x"), ("list", []), ("null", None)]:
        add(f"session_{name}", f"session = {v!r}", {"type": "session.update", "session": v}, "refuse",
            "invalid_value")
    bad_session = [("type_transcription", {"type": "transcription"}), ("instructions_int", {"instructions": 5}),
                   ("model_int", {"model": 5}),
                   ("modalities_both", {"output_modalities": ["text", "audio"]}),
                   ("modalities_string", {"output_modalities": "text"}),
                   ("modalities_empty", {"output_modalities": []}),
                   ("max_tokens_0", {"max_output_tokens": 0}), ("max_tokens_negative", {"max_output_tokens": -5}),
                   ("max_tokens_float", {"max_output_tokens": 1.5}), ("max_tokens_string", {"max_output_tokens": "10"}),
                   ("max_tokens_bool", {"max_output_tokens": True}),
                   ("max_tokens_nan", {"max_output_tokens": float("nan")}),
                   ("omnijax_string", {"omnijax": "x"}), ("omnijax_unknown", {"omnijax": {"foo": 1}}),
                   ("temperature_negative", {"omnijax": {"temperature": -1}}),
                   ("temperature_3", {"omnijax": {"temperature": 3}}),
                   ("temperature_nan", {"omnijax": {"temperature": float("nan")}}),
                   ("temperature_inf", {"omnijax": {"temperature": float("inf")}}),
                   ("temperature_string", {"omnijax": {"temperature": "hot"}}),
                   ("top_p_0", {"omnijax": {"top_p": 0}}), ("top_p_1_5", {"omnijax": {"top_p": 1.5}}),
                   ("seed_2_64", {"omnijax": {"seed": 2 ** 64}}), ("seed_2_63", {"omnijax": {"seed": 2 ** 63}}),
                   ("seed_below", {"omnijax": {"seed": -(2 ** 63) - 1}}), ("seed_float", {"omnijax": {"seed": 1.5}}),
                   ("seed_string", {"omnijax": {"seed": "1"}}), ("duplex_string", {"omnijax": {"duplex": "yes"}}),
                   ("truncation_none", {"truncation": "none"}),
                   ("truncation_ratio_1_5", {"truncation": {"type": "retention_ratio", "retention_ratio": 1.5}}),
                   ("truncation_ratio_nan", {"truncation": {"type": "retention_ratio",
                                                            "retention_ratio": float("nan")}}),
                   ("truncation_ratio_missing", {"truncation": {"type": "retention_ratio"}}),
                   ("truncation_post_0", {"truncation": {"type": "retention_ratio", "retention_ratio": 0.5,
                                                         "token_limits": {"post_instructions": 0}}}),
                   ("audio_string", {"audio": "x"}),
                   ("input_format_pcmu", {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}),
                   ("input_rate_8000", {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}}),
                   ("input_rate_string", {"audio": {"input": {"format": {"type": "audio/pcm", "rate": "24000"}}}}),
                   ("input_rate_true", {"audio": {"input": {"format": {"type": "audio/pcm", "rate": True}}}}),
                   ("vad_semantic", {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}),
                   ("vad_string", {"audio": {"input": {"turn_detection": "server_vad"}}}),
                   ("vad_threshold_2", {"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                              "threshold": 2}}}}),
                   ("vad_threshold_nan", {"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                                "threshold": float("nan")}}}}),
                   ("vad_silence_negative", {"audio": {"input": {"turn_detection": {
                       "type": "server_vad", "silence_duration_ms": -1}}}}),
                   ("vad_create_string", {"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                                "create_response": "yes"}}}})]
    for name, s in bad_session:
        add(f"update_{name}", f"session.update {json.dumps(s)[:70]}", _session(**s), "refuse", "invalid_value",
            "missing_field")
    for name, s, codes in [("tools", {"tools": [{"type": "function", "name": "f"}]}, ("unsupported",)),
                           ("truncation_disabled", {"truncation": "disabled"}, ("unsupported",)),
                           ("truncation_ratio", {"truncation": {"type": "retention_ratio", "retention_ratio": 0.5}},
                            ("unsupported",)),
                           ("duplex_demo", {"omnijax": {"duplex": True}}, ("unsupported", "invalid_value")),
                           # audio output: the demo checkpoint has no talker
                           ("modalities_audio", {"output_modalities": ["audio"]}, ("unsupported",)),
                           ("audio_output_format", {"audio": {"output": {"format": {"type": "audio/pcm"}}}},
                            ("unsupported",))]:
        add(f"update_{name}", f"session.update {json.dumps(s)[:70]} (the server cannot do it)", _session(**s),
            "refuse", *codes)
    for name, s in [("modalities_text", {"output_modalities": ["text"]}), ("max_tokens_inf", {"max_output_tokens":
                                                                                              "inf"}),
                    ("sampling", {"omnijax": {"temperature": 0.5, "top_p": 0.9, "seed": 2 ** 63 - 1}}),
                    ("seed_min", {"omnijax": {"seed": -(2 ** 63)}}), ("rate_16k", {"audio": {"input": {"format": {
                        "type": "audio/pcm", "rate": 16000}}}}),
                    ("vad", {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}),
                    ("truncation_auto", {"truncation": "auto"}), ("instructions", {"instructions": "Be brief."})]:
        add(f"update_ok_{name}", f"session.update {json.dumps(s)[:70]} (valid)", _session(**s), "accept",
            accepted=updated)
    # GA session fields omnijax does not implement, at values that ask for something: silent when accepted
    for name, s in [("model_other", {"model": "gpt-4o-realtime-preview"}),
                    ("tool_choice", {"tool_choice": "required"}),
                    ("include", {"include": ["item.input_audio_transcription.logprobs"]}),
                    ("prompt", {"prompt": {"id": "pmpt_123"}}),
                    ("transcription", {"audio": {"input": {"transcription": {"model": "whisper-1"}}}}),
                    ("noise_reduction", {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}),
                    ("output_voice", {"audio": {"output": {"voice": "alloy"}}}), ("unknown_key", {"foo": 1})]:
        add(f"update_ignored_{name}", f"session.update {json.dumps(s)[:70]} (not implemented)", _session(**s),
            "refuse", "invalid_value", "unsupported", "unknown_parameter", "model_not_found")
    # ... and at the value that asks for nothing (what real clients send by default): honoured trivially
    for name, s in [("tool_choice_auto", {"tool_choice": "auto", "tools": []}), ("include_empty", {"include": []}),
                    ("nulls", {"prompt": None, "tracing": None, "audio": {
                        "input": {"transcription": None, "noise_reduction": None},
                        "output": {"voice": None}}}), ("model_served", {"model": "omnijax"})]:
        add(f"update_neutral_{name}", f"session.update {json.dumps(s)[:70]} (asks for nothing)", _session(**s),
            "accept", accepted=updated)
    # input_audio_buffer.*
    pcm = media.tone(0.5, 24000)
    add("append_missing", "append without audio", {"type": "input_audio_buffer.append"}, "refuse", "missing_field")
    add("append_int", "append audio = 5", {"type": "input_audio_buffer.append", "audio": 5}, "refuse", "invalid_value")
    add("append_not_base64", "append audio 'not base64!!'", {"type": "input_audio_buffer.append",
                                                           "audio": "not base64!!"}, "refuse", "invalid_value")
    add("append_odd", "append 3 bytes (odd: not int16)", {"type": "input_audio_buffer.append",
                                                        "audio": media.b64(b"abc")}, "refuse", "invalid_value")
    add("append_empty", "append ''", {"type": "input_audio_buffer.append", "audio": ""}, "either", "invalid_value")
    add("append_valid", "append 0.5 s of 24 kHz PCM16", {"type": "input_audio_buffer.append",
                                                         "audio": media.b64(pcm)}, "accept")
    add("append_61s", "append 61 s at once (buffer cap 60 s)",
        {"type": "input_audio_buffer.append", "audio": media.b64(b"\x00\x00" * 24000 * 61)}, "refuse",
        "buffer_too_large", timeout_s=60)
    add("append_over_message_cap", "a 5 MB append message (cap 4 MB)",
        {"type": "input_audio_buffer.append", "audio": media.b64(b"\x00" * (3 * 2 ** 20 + 2 ** 19))}, "refuse",
        "close_1009", "buffer_too_large")
    add("commit_empty", "commit with nothing appended", {"type": "input_audio_buffer.commit"}, "refuse",
        "input_audio_buffer_commit_empty")
    add("commit_valid", "append 0.5 s, then commit", {"type": "input_audio_buffer.commit"}, "accept",
        setup=({"type": "input_audio_buffer.append", "audio": media.b64(pcm)},),
        accepted=frozenset({"input_audio_buffer.committed"}))
    # conversation.item.create
    items = [("item_missing", {"type": "conversation.item.create"}, "missing_field"),
             ("item_string", {"type": "conversation.item.create", "item": "x"}, "invalid_value"),
             ("item_function_call", {"type": "conversation.item.create", "item": {
                 "type": "function_call", "name": "f", "arguments": "{}"}}, "invalid_value"),
             ("item_no_type", {"type": "conversation.item.create", "item": {"role": "user", "content": [_text()]}},
              "missing_field"),
             ("role_assistant", _item(_text(), role="assistant"), "invalid_value"),
             ("role_tool", _item(_text(), role="tool"), "invalid_value"),
             ("role_missing", {"type": "conversation.item.create", "item": {"type": "message",
                                                                            "content": [_text()]}}, "missing_field"),
             ("role_huge", _item(_text(), role="r" * 100_000), "invalid_value"),
             ("content_empty", _item(), "invalid_value"),
             ("content_string", {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                              "content": "hi"}}, "invalid_value"),
             ("part_int", _item(5), "invalid_value"), ("part_audio", _item({"type": "input_audio", "audio": "AAAA"}),
                                                     "invalid_value"),
             ("part_no_type", _item({"text": "hi"}), "missing_field"), ("text_int", _item(_text(5)), "invalid_value"),
             ("text_missing", _item({"type": "input_text"}), "missing_field"),
             ("system_image", _item({"type": "input_image", "image_url": media.data_url(media.image())},
                                    role="system"), "invalid_value"),
             ("image_url_int", _item({"type": "input_image", "image_url": 5}), "invalid_value"),
             ("image_detail", _item({"type": "input_image", "image_url": media.data_url(media.image()),
                                     "detail": "ultra"}), "invalid_value"),
             ("item_id_int", _item(_text(), id=5), "invalid_value"),
             ("previous_item_int", {**_item(_text()), "previous_item_id": 5}, "invalid_value")]
    for name, event, code in items:
        add(name, f"conversation.item.create {json.dumps(event)[:70]}", event, "refuse", code)
    add("item_valid", "a user text item", _item(_text("hello")), "accept",
        accepted=frozenset({"conversation.item.added"}))
    add("previous_item_unknown", "previous_item_id naming no item (the API refuses; is it ignored?)",
        {**_item(_text()), "previous_item_id": "item_does_not_exist"}, "refuse", "invalid_value")
    add("previous_item_root", "previous_item_id 'root' after an item (insert first: the cache is append-only)",
        {**_item(_text()), "previous_item_id": "root"}, "refuse", "invalid_value", "unsupported",
        setup=(_item(_text("first")),))
    add("previous_item_root_empty", "previous_item_id 'root' on an empty conversation (honoured: it is first)",
        {**_item(_text()), "previous_item_id": "root"}, "accept", accepted=frozenset({"conversation.item.added"}))
    add("previous_item_earlier", "previous_item_id naming an earlier item (not the last)",
        {**_item(_text()), "previous_item_id": "item_probe_a"}, "refuse", "unsupported",
        setup=(_item(_text("a"), id="item_probe_a"), _item(_text("b"))))
    add("previous_item_last", "previous_item_id naming the last item (honoured: appended after it)",
        {**_item(_text()), "previous_item_id": "item_probe_a"}, "accept",
        accepted=frozenset({"conversation.item.added"}), setup=(_item(_text("a"), id="item_probe_a"),))
    add("item_id_taken", "item.id already in the conversation", _item(_text(), id="item_probe_a"), "refuse",
        "invalid_value", setup=(_item(_text("a"), id="item_probe_a"),))
    # response.*
    for name, event, code in [
            ("response_string", {"type": "response.create", "response": "x"}, "invalid_value"),
            ("response_out_of_band", {"type": "response.create", "response": {"conversation": "none"}}, "unsupported"),
            ("response_input", {"type": "response.create", "response": {"input": []}}, "unsupported"),
            ("response_tools", {"type": "response.create", "response": {"tools": [{"type": "function"}]}},
             "unsupported"),
            ("response_instructions_int", {"type": "response.create", "response": {"instructions": 5}},
             "invalid_value"),
            ("response_instructions_other", {"type": "response.create", "response": {"instructions": "Be rude."}},
             "unsupported"),
            ("response_max_tokens_0", {"type": "response.create", "response": {"max_output_tokens": 0}},
             "invalid_value"),
            ("response_max_tokens_string", {"type": "response.create", "response": {"max_output_tokens": "lots"}},
             "invalid_value"),
            ("response_audio", {"type": "response.create", "response": {"output_modalities": ["audio"]}},
             "invalid_value"),
            ("response_metadata_int", {"type": "response.create", "response": {"metadata": {"k": 5}}},
             "invalid_value"),
            ("response_temperature", {"type": "response.create", "response": {"temperature": 0.5}},
             "unknown_parameter"),
            ("response_voice", {"type": "response.create", "response": {"audio": {"output": {"voice": "alloy"}}}},
             "unsupported"),
            ("cancel_idle", {"type": "response.cancel"}, "response_cancel_not_active"),
            ("cancel_id_int", {"type": "response.cancel", "response_id": 5}, "invalid_value")]:
        add(name, f"{json.dumps(event)[:80]}", event, "refuse", code, "unsupported")
    case(out, C, "response_valid", "a text item, then response.create", responded(), "accept", timeout_s=60)
    case(out, C, "response_metadata", "response.create with metadata {'k': 'v'}: echoed in the response",
         metadata_echoed(), "verdict", expect="the response object carries the metadata", timeout_s=60)
    # unknown events, bad JSON, binary, event ids
    for kind in ("conversation.item.delete", "conversation.item.truncate", "conversation.item.retrieve",
                 "output_audio_buffer.clear", "session.create", "transcription_session.update", "foo", ""):
        add(f"unknown_{kind or 'empty'}", f"event type {kind!r}", {"type": kind, "item_id": "x"}, "refuse",
            "unknown_event")
    add("type_int", "event type 5", {"type": 5}, "refuse", "unknown_event", "invalid_value")
    add("type_missing", "event with no type", {"event_id": "e"}, "refuse", "missing_field")
    for name, raw in [("not_json", "{"), ("array", "[]"), ("null", "null"), ("number", "5"), ("string", '"x"'),
                      ("deep_nesting", "[" * 100_000 + "]" * 100_000), ("nan_field", '{"type": NaN}')]:
        add(f"json_{name}", f"text message {raw[:30]!r}", raw, "refuse", "invalid_json", "unknown_event")
    add("binary", "a binary message", b"\x00\x01\xff", "refuse", "invalid_json")
    add("event_id_int", "event_id = 5", {"type": "input_audio_buffer.clear", "event_id": 5}, "refuse",
        "invalid_value")
    add("unknown_top_field", "input_audio_buffer.clear with an unknown field 'foo'",
        {"type": "input_audio_buffer.clear", "foo": 1}, "refuse", "invalid_value", "unknown_parameter")
    case(out, C, "connect_wrong_model", "connect with ?model=gpt-4o-realtime-preview (the server serves 'omnijax')",
         connect_model("model=gpt-4o-realtime-preview"), "refuse", "model_not_found", "invalid_value",
         "invalid_request_error", "closed")
    case(out, C, "connect_no_model", "connect with no ?model", connect_model(""), "either", "missing_field",
         "invalid_value", "closed")
    return out


def realtime_media_cases() -> list[Case]:
    out: list[Case] = []
    M = "realtime_media"
    images = [("png", media.data_url(media.image()), "accept"), ("rgba", media.data_url(media.image(mode="RGBA")),
                                                                "accept"),
              ("header_20000x20000", media.data_url(media.png_header(20000, 20000)), "refuse"),
              ("header_0x0", media.data_url(media.png_header(0, 0)), "refuse"),
              ("truncated", media.data_url(media.image(64, 64)[:-60]), "refuse"),
              ("corrupt", media.data_url(media.corrupt(media.image(64, 64))), "refuse"),
              ("not_image", media.data_url(b"text" * 50), "refuse"),
              ("text_mime", media.data_url(b"hello", "text/plain"), "refuse"),
              ("not_base64", "data:image/png;base64,@@@", "refuse"),
              ("http", "http://127.0.0.1:9/x.png", "refuse"), ("https", "https://example.com/x.png", "refuse")]
    for name, url, expected in images:
        case(out, M, f"image_{name}", f"input_image {url[:50]!r}",
             rt(_item(_text("look"), {"type": "input_image", "image_url": url}),
                frozenset({"conversation.item.added"}) if expected == "accept" else frozenset()),
             expected, "invalid_value", timeout_s=60)
    return out
