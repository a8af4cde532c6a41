"""Chat completions' audio output (`modalities: ["text", "audio"]`, `audio: {voice, format}`) from `omnijax serve` on
a converted tiny Qwen3-Omni full release, through the official `openai` SDK: the whole response's
`message.audio` (`ChatCompletionAudio`: WAV or raw PCM16) and the streamed `delta.audio` chunks, the PCM equal to
`speech.speak` on the talker prompt transformers renders and the answer `omnijax.Chat` decodes; each refusal a 400
naming its field, the server serving on.
"""

import base64
import io
import types
import warnings

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

import omnijax  # noqa: E402
from omnijax.chat import SpeakOptions  # noqa: E402
from omnijax.media.audio import pcm16, read_wav, wav_bytes  # noqa: E402
from omnijax.models.qwen3_omni import speech as S  # noqa: E402
from omnijax.serve import app  # noqa: E402
from omnijax.serve import speech_output as so  # noqa: E402
from omnijax.serve.app import BackgroundServer, build_context  # noqa: E402
from omnijax.serve.chat_params import RequestError  # noqa: E402
from omnijax.serve.chat_request import parse_payload  # noqa: E402
from omnijax.serve.context import ServeOptions  # noqa: E402
from tests.chat.test_chat_speech import SPEECH_TOKENS, hf_prompt, spoken_release, stream_config  # noqa: E402

QUESTION = [{"role": "user", "content": "Say hello."}]
MAX_TOKENS = 6
FIRST, LATER = 3, 4  # the server's vocoder chunks (--speech-first-chunk / --speech-chunk), not the defaults (4, 25)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_speech")
    full, thinker = spoken_release(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model, mute = omnijax.load(full), omnijax.load(thinker)
    options = ServeOptions(port=0, frame_ms=200, max_output_tokens=8, max_speech_tokens=SPEECH_TOKENS,
                           speech_first_chunk=FIRST, speech_chunk=LATER)
    context = build_context(model, options=options, stream=stream_config(), chunk_tokens=64, buckets=(1, 2),
                            aimd_target=0)
    with BackgroundServer(context) as server:
        yield root, model, mute, server


@pytest.fixture(scope="module")
def reference(served):
    """What the served answer should be: `Chat`'s greedy answer to the same question (its text and token ids), and
    `speak` of those ids after the prompt transformers renders."""
    root, model, _, _ = served
    chat = omnijax.Chat(model, stream_config())
    items = list(chat.ask(QUESTION[0]["content"], max_tokens=MAX_TOKENS,
                          speak=SpeakOptions(voice="Chelsie", max_speech_tokens=SPEECH_TOKENS)))
    text = "".join(i for i in items if isinstance(i, str))
    prompt = hf_prompt(root / "hf", QUESTION)
    assert list(chat.last_spoken.prompt_ids) == list(prompt)
    spoken = S.speak(model, np.asarray(prompt), np.asarray(chat.last_spoken.answer_ids), speaker="Chelsie",
                     max_new_tokens=SPEECH_TOKENS)
    assert np.abs(spoken.pcm).max() > 0.05, "the reference waveform is (near) silent: the test would prove nothing"
    return text, spoken


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _ask(server, **kwargs):
    return _client(server).chat.completions.create(model="omnijax", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                   **kwargs)


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
def test_whole_response_carries_the_spoken_answer(served, reference, fmt):
    _, model, _, server = served
    text, spoken = reference
    response = _ask(server, modalities=["text", "audio"], audio={"voice": "chelsie", "format": fmt})
    message = response.choices[0].message
    assert isinstance(message.audio, openai.types.chat.ChatCompletionAudio)
    assert message.content is None and message.audio.transcript == text  # the text is the audio's transcript
    assert message.audio.id.startswith("audio_") and message.audio.expires_at == response.created
    data = base64.b64decode(message.audio.data)
    if fmt == "wav":
        samples, rate = read_wav(io.BytesIO(data))
        assert rate == model.speech.sample_rate == 24000
        samples = np.round(samples * 32768).astype(np.int32)
    else:
        samples = np.frombuffer(data, "<i2").astype(np.int32)
    want = pcm16(spoken.pcm).astype(np.int32)
    assert samples.shape == want.shape
    assert np.abs(samples - want).max() <= 1  # float PCM equal to ~1e-8: a rounding may land on the other side
    assert response.choices[0].finish_reason in ("stop", "length")


def test_streamed_audio_arrives_chunk_by_chunk(served, reference):
    _, model, _, server = served
    text, spoken = reference
    stream = _ask(server, modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"}, stream=True)
    transcript, data, expiry, ids, finish = [], [], [], set(), None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        audio = choice.delta.audio
        assert choice.delta.content is None
        if audio is None:
            continue
        if audio.id is not None:
            ids.add(audio.id)
        if audio.transcript is not None:
            assert not data, "the transcript comes before the speech"
            transcript.append(audio.transcript)
        if audio.data is not None:
            data.append(np.frombuffer(base64.b64decode(audio.data), "<i2"))
        if audio.expires_at is not None:
            expiry.append(audio.expires_at)
    assert "".join(transcript) == text and len(ids) == 1 and len(expiry) == 1
    assert finish in ("stop", "length")
    # the vocoder's calls: the server's FIRST frames, then LATER each (the last one what is left)
    F = model.speech.code2wav.config.samples_per_frame
    frames = spoken.codes.shape[1]
    lag = FIRST * F - data[0].shape[0]
    rest = frames - FIRST - LATER * ((frames - FIRST - 1) // LATER)
    assert frames > FIRST + LATER, "too few frames to see the later chunks"
    assert 0 <= lag < F and [d.shape[0] for d in data] == \
        [FIRST * F - lag] + [LATER * F] * ((frames - FIRST - 1) // LATER) + [rest * F]
    got = np.concatenate(data).astype(np.int32)
    assert np.abs(got - pcm16(spoken.pcm).astype(np.int32)).max() <= 1


@pytest.mark.parametrize("fields, param, says", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio.voice",
     "['chelsie', 'ethan']"),
    ({"modalities": ["text", "audio"], "audio": {"voice": {"id": "voice_1"}, "format": "wav"}}, "audio.voice",
     "custom voices"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "mp3"}}, "audio.format", "wav or pcm16"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "ogg"}}, "audio.format",
     "OpenAI's formats"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "stream": True}, "audio.format",
     "cannot be streamed"),
    ({"modalities": ["text", "audio"]}, "audio", "must be an object"),
    ({"audio": {"voice": "ethan", "format": "wav"}}, "audio", "does not ask for audio"),
    ({"modalities": ["audio"], "audio": {"voice": "ethan", "format": "wav"}}, "modalities", "[\"text\", \"audio\"]"),
    ({"modalities": ["text", "video"]}, "modalities", "must be"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav", "speed": 2}}, "audio.speed",
     "unknown parameter"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "stop": ["x"]}, "stop",
     "not supported with audio"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "n": 2}, "n",
     "not supported with audio"),
])
def test_bad_audio_requests_are_refused_by_name(served, fields, param, says):
    server = served[3]
    with pytest.raises(openai.BadRequestError) as e:
        _ask(server, extra_body=fields)
    assert e.value.status_code == 400 and e.value.body["param"] == param and says in e.value.body["message"], \
        e.value.body
    assert _ask(server).choices[0].message.content is not None  # the server serves on, text only by default


def test_media_parts_with_a_talker_without_a_media_tap_are_refused_by_name(served):
    """A talker without a media tap (a way to keep the thinker states it reads at media placeholders) takes
    text-only messages; Qwen3-Omni's speaks about media (`test_speech_media`)."""
    server = served[3]
    wav = base64.b64encode(wav_bytes(np.zeros(1600, "<i2"), 16000)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hear this."},
                                             {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]
    req = parse_payload({"model": "omnijax", "messages": messages}, server.context)
    with pytest.raises(RequestError) as e:
        so.check_spoken_request(req, types.SimpleNamespace(speech=types.SimpleNamespace()))
    assert e.value.param == "messages[0].content[1]" and "has no media tap" in str(e.value) and e.value.status == 400
    so.check_spoken_request(req, server.context.model)  # Qwen3-Omni's talker has a media tap


@pytest.mark.parametrize("flag, value", [("--speech-first-chunk", 0), ("--speech-chunk", -1)])
def test_a_vocoder_chunk_below_one_frame_is_refused_by_name_before_the_model_loads(tmp_path, capsys, flag, value):
    field = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=rf"{field} \({flag}\) must be an int of at least 1 codec frame, got {value}"):
        ServeOptions(**{field: value})
    with pytest.raises(SystemExit) as e:  # tmp_path holds no checkpoint: a refusal after loading would say so
        app.main([str(tmp_path), flag, str(value)])
    assert e.value.code == 2 and f"({flag}) must be an int of at least 1 codec frame" in capsys.readouterr().err


def test_a_checkpoint_without_a_talker_refuses_audio_output(served):
    mute = served[2]
    body = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}
    with pytest.raises(RequestError) as e:
        so.parse_audio_output(body, mute, "omnijax")
    assert e.value.param == "modalities" and "has no speech output" in str(e.value) and e.value.status == 400
    assert so.parse_audio_output({"modalities": ["text"]}, mute, "omnijax") is None


def test_the_request_is_checked_before_its_audio_and_text_stays_the_default(served):
    server = served[3]
    with pytest.raises(openai.NotFoundError) as e:  # the model first, as every other request
        _client(server).chat.completions.create(model="gpt-4o-audio-preview", messages=QUESTION, max_tokens=2,
                                                modalities=["text", "audio"],
                                                audio={"voice": "alloy", "format": "wav"})
    assert e.value.body["param"] == "model"
    message = _ask(server, modalities=["text"]).choices[0].message
    assert message.audio is None and message.content is not None
