"""Qwen2.5-Omni speaks about audio through `omnijax serve`: a chat completion with an audio clip in a user turn and
`modalities: ["text", "audio"]` (official `openai` SDK) answers with the PCM `omnijax.Chat` speaks for the same
conversation (its talker reads every position: the server's replay keeps the clip's input rows, `speak` reruns the
thinker with them; `tests/models/qwen2_5_omni/test_speech_media.py` checks that against transformers), and the same
for an image (its vision rows kept with their grid; `test_speech_media_image` checks `speak` with an image against
transformers). Served both ways: speaking the finished answer (the default) and with `ServeOptions(speak_early=True)`,
where the utterance is admitted on the prompt and its media rows alone (`Qwen25SpeechPool.prepare(writing=True)`) and
the talker reads each answer token's row as the engine decodes it; both equal `Chat`'s finish-first PCM within 1 LSB.
"""

import base64
import shutil
import warnings

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

import omnijax  # noqa: E402
from omnijax.chat import SpeakOptions  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.media.audio import pcm16, wav_bytes  # noqa: E402
from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer  # noqa: E402
from omnijax.serve import chat_completions, speech_engine  # noqa: E402
from omnijax.serve import speech_output as so  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402
from tests.models.qwen2_5_omni import test_speech_media as TM  # noqa: E402
from tests.serve.test_speech_media import _png_url  # noqa: E402

release = TS.release
CLIP16 = np.round(TM.CLIP * 16000).astype(np.int16)
SYSTEM, HEAR, QUESTION, MAX_TOKENS = "Be brief.", "Hear this.", "What was it?", 3


def _config():
    return omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=4)


@pytest.fixture(scope="module", params=[False, True], ids=["finish_first", "speak_early"])
def served(release, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("served25")
    shutil.copytree(release[1] / "single", root / "hf")
    write_tiny_tokenizer(root / "hf", vocab_size=300, special_tokens=TS.SPECIALS, chat_template=CHATML_TEMPLATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(convert_checkpoint(root / "hf", root / "out", progress=False, log=lambda _: None))
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=8, max_speech_tokens=TS.FRAMES,
                           speak_early=request.param)
    context = build_context(model, options=options, stream=_config(), chunk_tokens=64, buckets=(1, 2), aimd_target=0)
    with BackgroundServer(context) as server:
        yield model, server


def _messages(media: dict) -> list:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": HEAR}, media]},
            {"role": "user", "content": QUESTION}]


def test_a_chat_completion_speaks_about_a_clip_as_chat_does(served, monkeypatch):
    model, server = served
    early: list = []  # what each request's route spoke with: a WrittenSpeech (speak_early) or None (finish-first)
    written = speech_engine.written_speech
    monkeypatch.setattr(chat_completions, "written_speech", lambda *a, **k: early.append(written(*a, **k)) or early[-1])
    chat = omnijax.Chat(model, _config())
    chat.system(SYSTEM)
    chat.user(HEAR)
    chat.audio(CLIP16.astype(np.float32) / 32768, 16000)
    items = list(chat.ask(QUESTION, max_tokens=MAX_TOKENS, speak=SpeakOptions(
        voice="Chelsie", max_speech_tokens=TS.FRAMES, first_chunk=so.FIRST_CHUNK, chunk=so.CHUNK)))
    text = "".join(i for i in items if isinstance(i, str))
    pcm = np.concatenate([i for i in items if not isinstance(i, str)])
    spoken = chat.last_spoken
    assert len(spoken.media) == 1 and np.abs(pcm).max() > 0.05
    assert not set(spoken.answer_ids) & set(model.omni.placeholder_ids)  # an answer with a placeholder cannot speak
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(CLIP16, 16000)).decode(),
                                                   "format": "wav"}}
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    message = client.chat.completions.create(model="omnijax", messages=_messages(clip), max_tokens=MAX_TOKENS,
                                             modalities=["text", "audio"],
                                             audio={"voice": "chelsie", "format": "pcm16"}).choices[0].message
    assert message.audio.transcript == text
    got = np.frombuffer(base64.b64decode(message.audio.data), "<i2").astype(np.int32)
    want = pcm16(pcm).astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1
    # an image: the replay keeps the vision rows with their grid, and the route speaks as Chat does
    chat = omnijax.Chat(model, _config())
    chat.system(SYSTEM)
    chat.user(HEAR)
    chat.image(TM.IMAGE)
    items = list(chat.ask(QUESTION, max_tokens=MAX_TOKENS, speak=SpeakOptions(
        voice="Chelsie", max_speech_tokens=TS.FRAMES, first_chunk=so.FIRST_CHUNK, chunk=so.CHUNK)))
    pcm = np.concatenate([i for i in items if not isinstance(i, str)])
    assert chat.last_spoken.media[0].grid is not None and np.abs(pcm).max() > 0.05
    image = {"type": "image_url", "image_url": {"url": _png_url(TM.IMAGE)}}
    message = client.chat.completions.create(model="omnijax", messages=_messages(image), max_tokens=MAX_TOKENS,
                                             modalities=["text", "audio"],
                                             audio={"voice": "chelsie", "format": "pcm16"}).choices[0].message
    assert message.audio.transcript == "".join(i for i in items if isinstance(i, str))
    got = np.frombuffer(base64.b64decode(message.audio.data), "<i2").astype(np.int32)
    want = pcm16(pcm).astype(np.int32)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1
    assert len(early) == 2 and all((e is not None) == server.context.options.speak_early for e in early), early
