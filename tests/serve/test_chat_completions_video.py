"""Video in chat completions (`video_url` parts: a base64 `data:video/...` URL) through the official `openai` SDK
against `omnijax serve` on the tiny Qwen2.5-Omni: the served answer to a video message equals `omnijax.Chat` given
the same file through `Chat.video` (the same units, frame rate and frames a unit; tokens equal under greedy decoding),
whole and streamed; each refusal a 400 naming the problem (a network URL, bad base64, an undecodable file, a file
without sound, a file over the byte cap, a request over the seconds cap, a checkpoint without a vision encoder), the
server serving on; and the event loop stays free while a video decodes (the decoding runs in a worker thread).

The server is the one tests/serve/realtime/test_openai_server.py runs (the same settings, so the same compiled
programs), and the clip is one 2 s unit of 56 x 84 frames written with `omnijax.media.video.write_clip`.
"""

import asyncio
import base64
import copy
import dataclasses
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")

import httpx  # noqa: E402

import omnijax  # noqa: E402
from omnijax.media import video  # noqa: E402
from omnijax.models.qwen2_5_omni import frontend  # noqa: E402
from omnijax.serve import chat_request  # noqa: E402
from tests._support import tiny_omni  # noqa: E402
from tests._support.openai_server import KEY, sdk_client, stream_config, tiny_server  # noqa: E402

WATCH, QUESTION, MAX_TOKENS = "Watch this.", "What happens?", 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("serve"), tokenizer=True))


@pytest.fixture(scope="module")
def server(model):
    with tiny_server(model) as running:
        yield running


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """One 2 s unit (4 frames at 2 fps, a tone): the file, the same frames without an audio track, and other frames
    with the same tone."""
    root = tmp_path_factory.mktemp("clip")
    frames = frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=1)
    pcm = frontend.tone(2.0, 330.0, seed=1)
    other = frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=2)
    return (video.write_clip(root / "clip.mp4", frames, 2, pcm), video.write_clip(root / "silent.mp4", frames, 2),
            video.write_clip(root / "other.mp4", other, 2, pcm))


def _url(path, mime="video/mp4"):
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def _messages(part):
    return [{"role": "user", "content": [{"type": "text", "text": WATCH}, part]}, {"role": "user", "content": QUESTION}]


def _video_part(url):
    return {"type": "video_url", "video_url": {"url": url}}


def _create(server, messages, **kwargs):
    return sdk_client(server).chat.completions.create(model="omnijax", messages=messages, max_tokens=MAX_TOKENS,
                                                      **kwargs)


@pytest.fixture(scope="module")
def reference(model, clip):
    """`Chat`'s greedy answer after the same user turn and `Chat.video` of the same file: (text, answer token ids,
    prompt tokens, tokens of the video's units)."""
    chat = omnijax.Chat(model, stream_config())
    chat.user(WATCH)
    assert chat.video(clip[0]) == 1
    units = sum(chat.units[-1].fed.values())
    before = len(chat.text_ids)
    text = "".join(chat.ask(QUESTION, max_tokens=MAX_TOKENS))
    prompt_tokens = chat.conversation.tokens_fed
    answer = chat.text_ids[before:]
    return text, answer, prompt_tokens, units


def test_a_video_message_is_answered_as_chat_answers_it(server, model, clip, reference):
    server.wait_idle()
    text, answer, prompt_tokens, units = reference
    assert text and units > 100  # the unit's frames and sound went in: the comparison below proves something
    messages = _messages(_video_part(_url(clip[0])))
    whole = _create(server, messages)
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == prompt_tokens
    streamed = list(_create(server, messages, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    # the answer's tokens, one by one (log probabilities name each chosen token)
    scored = _create(server, messages, logprobs=True, top_logprobs=3)
    tokens = [t.token for t in scored.choices[0].logprobs.content]
    assert scored.choices[0].message.content == text
    assert len(tokens) == whole.usage.completion_tokens
    assert tokens == [model.tokenizer.decode([i]) for i in answer[-len(tokens):]], (tokens, answer)
    # the frames reach the model: other frames (the same sound) change the first token's log probabilities
    other = _create(server, _messages(_video_part(_url(clip[2]))), logprobs=True, top_logprobs=3)
    first = [t.logprob for t in scored.choices[0].logprobs.content[0].top_logprobs]
    assert np.abs(np.subtract(first, [t.logprob for t in other.choices[0].logprobs.content[0].top_logprobs])).max() \
        > 1e-4
    text_only = _create(server, [{"role": "user", "content": [{"type": "text", "text": WATCH}]},
                                 {"role": "user", "content": QUESTION}])
    assert whole.usage.prompt_tokens == text_only.usage.prompt_tokens + units


def _refused(server, part):
    with pytest.raises(openai.BadRequestError) as info:
        _create(server, _messages(part))
    return info.value


def test_bad_videos_are_refused_by_name_and_the_server_serves_on(server, model, clip, reference, monkeypatch):
    server.wait_idle()
    cases = [
        (_video_part("https://example.com/clip.mp4"), "never fetches from the network"),
        (_video_part("data:image/png;base64,AAAA"), "data:video/"),
        (_video_part("data:video/mp4;base64,@@@"), "not valid base64"),
        (_video_part("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode()),
         "could not be decoded as a video"),
        (_video_part(_url(clip[1])), "no audio track"),
        ({"type": "video_url", "video_url": {"url": _url(clip[0]), "fps": 4}}, "fps"),
    ]
    for part, words in cases:
        error = _refused(server, part)
        assert words in str(error), (words, str(error))
        assert "messages[0].content[1]" in str(error), str(error)
    monkeypatch.setattr(chat_request, "MAX_VIDEO_BYTES", clip[0].stat().st_size - 1)
    error = _refused(server, _video_part(_url(clip[0])))
    assert "MAX_VIDEO_BYTES" in str(error) and error.code == "video_too_large", str(error)
    monkeypatch.undo()
    context = server.context
    options, served = context.options, context.model
    context.options = dataclasses.replace(options, max_request_video_s=3.0)
    try:  # one 2 s clip passes, two do not
        two = {"role": "user", "content": [_video_part(_url(clip[0])), _video_part(_url(clip[0]))]}
        with pytest.raises(openai.BadRequestError) as info:
            _create(server, [two])
        assert "over the 3 s one request may carry (--max-request-video-s)" in str(info.value), str(info.value)
        assert "messages[0].content[1]" in str(info.value) and info.value.code == "video_too_long"
        blind = copy.copy(model)
        blind.vision = None
        context.model = blind
        error = _refused(server, _video_part(_url(clip[0])))
        assert "no vision encoder" in str(error), str(error)
    finally:
        context.options, context.model = options, served
    assert _create(server, _messages(_video_part(_url(clip[0])))).choices[0].message.content == reference[0]


def test_the_event_loop_is_free_while_a_video_decodes(server, clip, monkeypatch):
    """The file's units decode slowly here (each held 1.5 s, blocking its thread): `/v1/models` answers meanwhile
    within a fraction of that, so the decoding runs off the event loop."""
    server.wait_idle()
    units, hold = video.VideoFile.units, 1.5
    decoding = []

    def slow_units(self):
        for unit in units(self):
            decoding.append(time.perf_counter())
            time.sleep(hold)
            yield unit

    monkeypatch.setattr(video.VideoFile, "units", slow_units)
    body = {"model": "omnijax", "messages": _messages(_video_part(_url(clip[0]))), "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def scenario():
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            request = asyncio.create_task(client.post(server.base_url + "/chat/completions", json=body))
            worst, probes = 0.0, 0
            while not request.done():
                t = time.perf_counter()
                assert (await client.get(server.base_url + "/models")).status_code == 200
                if decoding and t > decoding[0]:
                    worst, probes = max(worst, time.perf_counter() - t), probes + 1
                await asyncio.sleep(0.05)
            return (await request), worst, probes

    response, worst, probes = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert decoding and probes >= 5 and worst < hold / 3, (probes, worst)
