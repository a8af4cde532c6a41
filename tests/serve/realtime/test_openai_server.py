"""`omnijax serve` through the official `openai` SDK: Realtime sessions (text items, audio, images, cancel, errors,
overload), chat completions (whole and streamed), models, the API key; answers equal `omnijax.Chat`'s greedy answers
to the same conversation (an independent path: one `Session`, not the engine's batched ticks)."""

import asyncio
import base64
import dataclasses
import io
import json
import re

import numpy as np
import pytest

openai = pytest.importorskip("openai")

import omnijax  # noqa: E402
from tests._support import tiny_omni  # noqa: E402
from tests._support.openai_server import (  # noqa: E402
    KEY,
    chat_answer,
    pcm_b64,
    response_text,
    sdk_async_client,
    sdk_client,
    tiny_server,
    until,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("serve"), tokenizer=True))


@pytest.fixture(scope="module")
def server(model):
    with tiny_server(model) as running:
        yield running


def test_models_and_api_key(server):
    assert [m.id for m in sdk_client(server).models.list()] == ["omnijax"]
    served = sdk_client(server).models.retrieve("omnijax")  # was a 404
    assert (served.id, served.object, served.owned_by) == ("omnijax", "model", "omnijax")
    with pytest.raises(openai.NotFoundError, match="does not exist") as missing:
        sdk_client(server).models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        sdk_client(server, key="wrong").models.retrieve("omnijax")
    with pytest.raises(openai.AuthenticationError):
        sdk_client(server, key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        sdk_client(server, key="wrong").chat.completions.create(model="omnijax", messages=[{"role": "user",
                                                                                          "content": "hi"}])

    async def realtime_with_wrong_key():
        async with sdk_async_client(server, key="wrong").realtime.connect(model="omnijax") as conn:
            await conn.recv()

    with pytest.raises(Exception, match="401"):
        asyncio.run(realtime_with_wrong_key())


def test_a_browser_authenticates_with_the_key_subprotocol(server):
    """Browsers cannot set `Authorization` on a WebSocket: the Realtime API's browser form sends the key as the
    subprotocol `openai-insecure-api-key.<key>` beside `realtime`. The right key is admitted and answered with the
    `realtime` subprotocol (never the key); a wrong one gets 401."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    url = server.base_url.replace("http://", "ws://") + "/realtime?model=omnijax"

    async def handshake(key):
        async with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{key}"]) as ws:
            return ws.subprotocol, json.loads(await ws.recv())["type"]

    assert asyncio.run(handshake(KEY)) == ("realtime", "session.created")
    with pytest.raises(InvalidStatus, match="401"):
        asyncio.run(handshake("wrong"))
    server.wait_idle()


def test_chat_completions_whole_and_streamed_equal_chat(server, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe the scene."}]
    client = sdk_client(server)
    whole = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=12)
    stream = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = chat_answer(model, "Be brief.", "Describe the scene.", 12)
    assert whole.choices[0].message.content == streamed
    assert streamed.rstrip("\n") == expected.rstrip("\n") or expected.startswith(streamed)
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens <= 12
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="omnijax", messages=messages, temperature=2.5)


def test_stop_strings_cut_the_answer_whole_and_streamed(server):
    """`stop` (what lm-eval and LangChain send): the answer ends before the first stop string to complete, which is
    never returned, with finish_reason "stop", whole and streamed alike; the openai SDK's own client sends it."""
    server.wait_idle()
    client = sdk_client(server)
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=16)
    text = full.choices[0].message.content
    assert len(text) > 6, text
    stops = [text[4:6], "never in the answer \u2603"]  # a string in the middle of the greedy answer
    want = text[:text.index(stops[0])]
    whole = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=16, stop=stops)
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens <= full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="omnijax", messages=messages, max_tokens=16, stop=stops[0],
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    unmatched = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=16, stop=[stops[1]])
    assert unmatched.choices[0].message.content == text
    assert unmatched.choices[0].finish_reason == full.choices[0].finish_reason
    for bad, name in (([""], "stop[0]"), (["a", "b", "c", "d", "e"], "at most 4")):
        with pytest.raises(openai.BadRequestError, match=re.escape(name)):
            client.chat.completions.create(model="omnijax", messages=messages, stop=bad)


def test_per_request_sampling_reproduces_from_its_seed(server):
    """Each request draws with its own temperature / top-p in the one batched program; a seed reproduces it, and
    temperature 0 is the greedy answer."""
    server.wait_idle()
    client = sdk_client(server)
    messages = [{"role": "user", "content": "Tell me a story."}]

    def ask(**kwargs):
        reply = client.chat.completions.create(model="omnijax", messages=messages, max_tokens=16, **kwargs)
        return reply.choices[0].message.content

    greedy = ask()
    assert ask(temperature=0) == greedy
    first, again = ask(temperature=1.5, top_p=0.95, seed=7), ask(temperature=1.5, top_p=0.95, seed=7)
    others = {ask(temperature=1.5, top_p=0.95, seed=s) for s in (8, 9, 10)}
    assert first == again and first != greedy and len(others | {first}) > 1


def test_realtime_text_then_audio_then_image(server, model):
    async def scenario():
        async with sdk_async_client(server).realtime.connect(model="omnijax") as conn:
            created = await conn.recv()
            assert created.type == "session.created"
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                               "output_modalities": ["text"], "max_output_tokens": 12})
            assert (await conn.recv()).type == "session.updated"
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text",
                                                                   "text": "Describe the scene."}]})
            await conn.response.create()
            first = await until(conn, "response.done")
            await conn.input_audio_buffer.append(audio=pcm_b64(0.5))  # 2 frames of 200 ms and a 100 ms tail
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"max_output_tokens": 5})
            second = await until(conn, "response.done")
            from PIL import Image
            png = io.BytesIO()
            Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), np.uint8)).save(png, "PNG")
            url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "And now?"}]})
            await conn.response.create()
            third = await until(conn, "response.done")
            return first, second, third

    first, second, third = asyncio.run(scenario())
    text, final = response_text(first)
    assert final.status in ("completed", "incomplete") and final.usage.output_tokens <= 12
    expected = chat_answer(model, "Be brief.", "Describe the scene.", 12)
    assert text.rstrip("\n") == expected.rstrip("\n") or expected.startswith(text)
    kinds = [e.type for e in second]
    assert kinds[:3] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    _, final2 = response_text(second)
    assert final2.usage.output_tokens <= 5 and final2.usage.input_tokens > 3 * 7  # 3 audio frames and a prompt
    user = third[0]
    assert user.type == "conversation.item.added" and user.item.role == "user"
    assert [c.type for c in user.item.content] == ["input_image", "input_text"]
    assert any(e.type == "conversation.item.done" and e.item.id == user.item.id for e in third)
    response_text(third)
    cells = [next(e for e in events if e.type == "response.done").model_extra["omnijax"]["kv_cells"]
             for events in (first, second, third)]
    assert cells[0] == final.usage.total_tokens and cells[0] < cells[1] < cells[2]  # nothing evicted yet


def test_malformed_events_get_errors_while_another_session_streams(server):
    async def scenario():
        client = sdk_async_client(server)
        async with client.realtime.connect(model="omnijax") as good, \
                client.realtime.connect(model="omnijax") as bad:
            await good.recv(), await bad.recv()
            await good.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hello"}]})
            await good.response.create()
            await bad.send({"type": "no.such.event"})
            await bad.send({"type": "input_audio_buffer.append", "audio": "not base64!"})
            await bad.send({"type": "input_audio_buffer.append", "audio": pcm_b64(3.0)})  # over the 2 s cap
            await bad.send({"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}})
            await bad.send({"type": "response.cancel"})
            errors = [(await bad.recv()) for _ in range(5)]
            answered = await until(good, "response.done")
            # the refused session still works
            await bad.conversation.item.create(item={"type": "message", "role": "user",
                                                     "content": [{"type": "input_text", "text": "Hi"}]})
            await bad.response.create(response={"max_output_tokens": 3})
            after = await until(bad, "response.done")
            return errors, answered, after

    errors, answered, after = asyncio.run(scenario())
    assert [e.type for e in errors] == ["error"] * 5
    assert [e.error.code for e in errors] == ["unknown_event", "invalid_value", "buffer_too_large", "unsupported",
                                              "response_cancel_not_active"]
    assert "--policy unbounded" in errors[3].error.message
    response_text(answered)
    assert response_text(after)[1].usage.output_tokens <= 3


def test_cancel_ends_the_response_and_overload_is_refused(server):
    server.wait_idle()

    async def scenario():
        client = sdk_async_client(server)
        async with client.realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Talk a lot."}]})
            await conn.response.create(response={"max_output_tokens": 24})
            await until(conn, "response.created")
            await conn.response.cancel()
            cancelled = await until(conn, "response.done")
            # fill the engine (largest bucket 4): three more sessions, then a fifth is refused
            others = [client.realtime.connect(model="omnijax") for _ in range(3)]
            opened = [await o.__aenter__() for o in others]
            for o in opened:
                assert (await o.recv()).type == "session.created"
            refused = client.realtime.connect(model="omnijax")
            extra = await refused.__aenter__()
            error = await extra.recv()
            context = server.context  # a chat completion waits its queue timeout for room, then gets its 429
            options, context.options = context.options, dataclasses.replace(context.options, queue_timeout_s=0.2)
            try:
                with pytest.raises(openai.RateLimitError) as refusal:
                    await client.chat.completions.create(model="omnijax",
                                                         messages=[{"role": "user", "content": "x"}])
            finally:
                context.options = options
            assert int(refusal.value.response.headers["Retry-After"]) >= 1
            await refused.__aexit__(None, None, None)
            for o in others:
                await o.__aexit__(None, None, None)
            return cancelled, error

    cancelled, error = asyncio.run(scenario())
    final = cancelled[-1].response
    assert final.status == "cancelled" and final.usage.output_tokens < 24
    assert error.type == "error" and error.error.code == "overloaded"



def test_server_vad_commits_and_answers_a_spoken_turn(server):
    server.wait_idle()

    async def scenario():
        async with sdk_async_client(server).realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 400}}}, "max_output_tokens": 4})
            updated = await conn.recv()
            assert updated.session.audio.input.turn_detection.type == "server_vad"
            silence = base64.b64encode(np.zeros(int(0.6 * 24000), "<i2").tobytes()).decode()
            await conn.input_audio_buffer.append(audio=pcm_b64(0.6))  # three 200 ms frames of tone
            await conn.input_audio_buffer.append(audio=silence)  # then 400 ms of silence ends the turn
            return await until(conn, "response.done")

    events = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds[:5] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    started, stopped, committed = events[:3]
    assert started.audio_start_ms == 0 and stopped.audio_end_ms == 1000  # tone 0-600 ms, silence to 1000 ms
    assert started.item_id == stopped.item_id == committed.item_id
    assert "response.created" in kinds
    _, final = response_text(events)
    assert final.usage.output_tokens <= 4


def test_chat_completion_with_an_image_and_audio(server, model):
    import wave

    from PIL import Image

    server.wait_idle()
    png, wav = io.BytesIO(), io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 56, 3), np.uint8)).save(png, "PNG")
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((3000 * np.sin(np.arange(8000) * 0.1)).astype("<i2").tobytes())
    content = [{"type": "text", "text": "What do you see and hear?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                          + base64.b64encode(png.getvalue()).decode()}},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(),
                                                       "format": "wav"}}]
    text_only = sdk_client(server).chat.completions.create(
        model="omnijax", messages=[{"role": "user", "content": content[:1]}], max_tokens=3)
    whole = sdk_client(server).chat.completions.create(model="omnijax", messages=[{"role": "user", "content": content}],
                                                    max_tokens=3)
    from omnijax.models.frontend import units_for
    units = units_for(model)  # the image unit and the audio unit the server feeds after the text turn
    image = np.asarray(Image.open(io.BytesIO(png.getvalue())).convert("RGB"))
    media = int(units.image(image, 0).valid.sum() + units.audio(np.zeros(8000, np.float32), 16000, 0).valid.sum())
    assert media > 10 and whole.usage.prompt_tokens == text_only.usage.prompt_tokens + media
    assert whole.usage.completion_tokens <= 3 and whole.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        sdk_client(server).chat.completions.create(model="omnijax", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_caps_on_sessions_per_client_and_body_size(server):

    server.wait_idle()
    context = server.context
    options = context.options
    context.options = dataclasses.replace(options, max_sessions_per_client=1, max_message_bytes=2000)
    try:
        big = sdk_client(server)
        with pytest.raises(openai.APIStatusError) as e:
            big.chat.completions.create(model="omnijax", messages=[{"role": "user", "content": "x" * 3000}])
        assert e.value.status_code == 413 and "over the server's cap of 2000" in str(e.value)

        async def two_sessions():
            client = sdk_async_client(server)
            async with client.realtime.connect(model="omnijax") as first, \
                    client.realtime.connect(model="omnijax") as second:
                return await first.recv(), await second.recv()

        first, second = asyncio.run(two_sessions())
    finally:
        context.options = options
    assert first.type == "session.created"
    assert second.type == "error" and second.error.code == "overloaded" and "one client may hold (1)" in \
        second.error.message


def test_realtime_session_sampling_extension(server, model):
    """`session.omnijax.temperature / top_p / seed`: a seeded session reproduces its sampled answer; temperature 0
    is the greedy answer."""
    server.wait_idle()

    async def answer(sampling):
        async with sdk_async_client(server).realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                               "omnijax": sampling})
            updated = await conn.recv()
            assert updated.type == "session.updated", updated
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Describe the scene."}]})
            await conn.response.create(response={"max_output_tokens": 12})
            return response_text(await until(conn, "response.done"))[0], updated

    sampled, updated = asyncio.run(answer({"temperature": 1.5, "top_p": 0.95, "seed": 11}))
    assert updated.session.model_extra["omnijax"]["seed"] == 11
    again, _ = asyncio.run(answer({"temperature": 1.5, "top_p": 0.95, "seed": 11}))
    greedy, _ = asyncio.run(answer({"temperature": 0}))
    expected = chat_answer(model, "Be brief.", "Describe the scene.", 12)
    assert sampled == again and greedy.rstrip("\n") == expected.rstrip("\n") and sampled != greedy


def test_media_is_encoded_off_the_event_loop(server, monkeypatch):
    """While one request's audio is encoded, every other client is served: the encoder is held until another
    client's listing and chat completion have been answered (were the encoder on the event loop, they would wait
    for it and time out)."""
    import threading
    import wave

    from omnijax.conversation import Conversation

    entered, release = threading.Event(), threading.Event()
    encode = Conversation.audio

    def held(self, pcm, sample_rate=16_000):
        entered.set()
        assert release.wait(120), "the test never released the encoder"
        return encode(self, pcm, sample_rate)

    monkeypatch.setattr(Conversation, "audio", held)
    server.wait_idle()
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((3000 * np.sin(np.arange(16000) * 0.1)).astype("<i2").tobytes())
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(),
                                                    "format": "wav"}}
    heard = {}
    spoken = threading.Thread(target=lambda: heard.setdefault("reply", sdk_client(server).chat.completions.create(
        model="omnijax", messages=[{"role": "user", "content": [audio]}], max_tokens=2)))
    spoken.start()
    try:
        assert entered.wait(60), "the audio request never reached its encoder"
        assert [m.id for m in sdk_client(server, timeout=20).models.list().data] == ["omnijax"]
        other = sdk_client(server, timeout=60).chat.completions.create(
            model="omnijax", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert other.choices[0].finish_reason in ("stop", "length") and not heard
    finally:
        release.set()
        spoken.join(120)
    assert heard["reply"].choices[0].finish_reason in ("stop", "length")


def test_a_wrong_model_or_item_placement_is_refused_and_changes_nothing(server, caplog):
    """The probe's silent Realtime cases that need the session: a wrong `?model=` (Realtime and native routes) and a
    `session.update` model are `model_not_found`; `previous_item_id` is honoured when it names the last item and
    refused when unknown, "root" on a non-empty conversation, or a taken `item.id`; a `response_id` that is not the
    response in progress is refused; `response.metadata` comes back in the response. Before, every one was accepted
    (the model echoed back as if served, the item appended wherever it was asked to go, the cancel applied)."""
    import logging

    from websockets.sync.client import connect

    caplog.set_level(logging.INFO, logger="omnijax.serve")
    server.wait_idle()
    url = server.base_url.replace("http://", "ws://").removesuffix("/v1")
    with connect(url + "/session?model=gpt-4o", additional_headers={"Authorization": f"Bearer {KEY}"}) as native:
        assert json.loads(native.recv(timeout=30))["code"] == "model_not_found"

    def item(text, item_id=None, **event):
        content = [{"type": "input_text", "text": text}]
        return {"type": "conversation.item.create", **event,
                "item": {"type": "message", "role": "user", "content": content, **({"id": item_id} if item_id else {})}}

    async def next_of(conn, kinds):
        async for event in conn:
            if event.type in kinds:
                return event
        raise AssertionError(f"closed before {kinds}")

    async def scenario():
        client = sdk_async_client(server)
        async with client.realtime.connect(model="gpt-4o-realtime-preview") as wrong:
            connect_refused = await wrong.recv()
        seen = {}
        async with client.realtime.connect(model="omnijax") as conn:
            await conn.recv()
            await conn.send({"type": "session.update", "session": {"type": "realtime", "model": "gpt-4o"}})
            seen["model"] = await next_of(conn, {"error", "session.updated"})
            await conn.send({"type": "session.update", "session": {"type": "realtime"}})
            seen["unchanged"] = await next_of(conn, {"error", "session.updated"})
            for name, event in [("first", item("one", "a")),
                                ("unknown", item("x", previous_item_id="nope")),
                                ("taken", item("x", "a")),
                                ("root", item("x", previous_item_id="root")),
                                ("after_last", item("two", previous_item_id="a"))]:
                await conn.send(event)
                seen[name] = await next_of(conn, {"conversation.item.added", "error"})
            await conn.send({"type": "response.create", "response": {"max_output_tokens": 8,
                                                                      "metadata": {"run": "7"}}})
            await conn.send({"type": "response.cancel", "response_id": "resp_not_this_one"})
            seen["cancel"] = await next_of(conn, {"error"})
            seen["done"] = await next_of(conn, {"response.done"})
        return connect_refused, seen

    connect_refused, seen = asyncio.run(scenario())
    assert connect_refused.type == "error" and connect_refused.error.code == "model_not_found"
    assert (seen["model"].type, seen["model"].error.code, seen["model"].error.param) == (
        "error", "model_not_found", "session.model")
    assert seen["unchanged"].session.model == "omnijax"
    assert seen["first"].type == "conversation.item.added" and seen["first"].item.id == "a"
    for name, code in (("unknown", "invalid_value"), ("taken", "invalid_value"), ("root", "unsupported")):
        assert seen[name].type == "error" and seen[name].error.code == code, (name, seen[name])
    assert seen["unknown"].error.param == "previous_item_id" and seen["taken"].error.param == "item.id"
    assert seen["after_last"].type == "conversation.item.added" and seen["after_last"].previous_item_id == "a"
    assert (seen["cancel"].error.code, seen["cancel"].error.param) == ("invalid_value", "response_id")
    done = seen["done"].response
    assert done.status == "completed" or done.status_details.reason != "client_cancelled"
    assert done.metadata == {"run": "7"}
    logged = [r.getMessage() for r in caplog.records if "realtime refuse" in r.getMessage()]
    assert any("reason=model_not_found param=session.model" in line for line in logged), logged
