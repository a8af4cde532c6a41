"""Spoken answers through `Chat.ask(..., speak=...)` and `omnijax chat --speak` on a converted tiny Qwen3-Omni full
release: the text deltas first, then PCM chunks as Code2Wav's streamed decode yields them, their concatenation equal
to `speech.speak` on the same prompt and answer ids (itself equal to transformers' `generate(return_audio=True)`,
tests/models/qwen3_omni/test_speech.py); the talker's prompt equal to transformers' own chat-template rendering; the
refusals (no talker, unknown voice, media rows past their bound, bad options) before anything changes.

The release is `test_talker.seeded_full_model()` with a tiny ChatML tokenizer whose role words and tts tokens are
single special tokens at the ids the config names (as the release's tokenizer has them), so the talker finds the turns.
Its random talker never ends the speech, so every answer is cut at `SPEECH_TOKENS` talker tokens.
"""

import io
import warnings

import numpy as np
import pytest

import omnijax
from omnijax import commands
from omnijax.chat import SpeakOptions
from omnijax.convert import convert_checkpoint
from omnijax.media.audio import pcm16, read_wav
from omnijax.models.qwen3_omni import speech as S
from omnijax.models.qwen3_omni import talker_forward
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
from tests._support import qwen3_omni_models as Q

torch = pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests.models.qwen3_omni import test_talker as T  # noqa: E402  (needs torch)

TTS = T.TTS
SPECIALS = {**Q.SPECIALS, "<|tts_pad|>": TTS["tts_pad_token_id"], "<|tts_bos|>": TTS["tts_bos_token_id"],
            "<|tts_eos|>": TTS["tts_eos_token_id"], "system": TTS["system_token_id"], "user": TTS["user_token_id"],
            "assistant": TTS["assistant_token_id"]}
SPEECH_TOKENS = 12  # talker tokens: 11 codec frames
FIRST_CHUNK, CHUNK = 4, 5  # vocoder calls of 4, 5 and 2 frames
SYSTEM, QUESTION, AGAIN = "Be brief.", "Say hello.", "Once more."


def spoken_release(root, *, thinker: bool = True):
    """`(full, thinker-only)` converted checkpoints of the seeded tiny release, each with the tiny tokenizer (the
    transformers source directories are `root / "hf"` and `root / "hf_thinker"`); `thinker=False`: `(full,)`."""
    full = T.seeded_full_model()
    full.save_pretrained(root / "hf", safe_serialization=True)
    if thinker:
        full.thinker.save_pretrained(root / "hf_thinker", safe_serialization=True)
    out = []
    for name in ("hf", "hf_thinker")[:2 if thinker else 1]:
        write_tiny_tokenizer(root / name, vocab_size=Q.TEXT["vocab_size"], special_tokens=SPECIALS,
                             chat_template=CHATML_TEMPLATE)
        out.append(convert_checkpoint(root / name, root / f"{name}_omnijax", progress=False, log=lambda _: None))
    return tuple(out)


def stream_config():
    return omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=4)


def hf_prompt(source, messages):
    """transformers' own rendering and tokenization of `messages` with the generation prompt (the oracle of the
    talker's prompt)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("spoken")
    full, thinker = spoken_release(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return root, omnijax.load(full), omnijax.load(thinker)


def split(items):
    """(text, PCM chunks) of what a spoken `ask` yielded, checking the text comes first."""
    kinds = [isinstance(i, str) for i in items]
    assert kinds == sorted(kinds, reverse=True), "text deltas come before the PCM chunks"
    return "".join(i for i in items if isinstance(i, str)), [i for i in items if not isinstance(i, str)]


def test_spoken_answers_stream_the_pcm_speak_gives(release, monkeypatch):
    root, model, _ = release
    steps = []  # the talker's frame steps run so far
    step = talker_forward.talker_step
    monkeypatch.setattr(talker_forward, "talker_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    chat = omnijax.Chat(model, stream_config())
    chat.system(SYSTEM)
    items, at = [], []  # what ask yielded; the talker steps run when each PCM chunk came
    for item in chat.ask(QUESTION, max_tokens=6, speak=SpeakOptions(
            voice="Chelsie", max_speech_tokens=SPEECH_TOKENS, first_chunk=FIRST_CHUNK, chunk=CHUNK)):
        items.append(item)
        if not isinstance(item, str):
            at.append(len(steps))
    text, chunks = split(items)
    # talker and vocoder interleave: each chunk comes as soon as the talker has decoded its frames
    assert at == [FIRST_CHUNK, FIRST_CHUNK + CHUNK, SPEECH_TOKENS - 1]
    spoken = chat.last_spoken
    # the talker's prompt is what transformers renders for the conversation; the answer is what was decoded
    want_prompt = hf_prompt(root / "hf", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert list(spoken.prompt_ids) == list(want_prompt)
    assert spoken.answer_ids and spoken.answer_ids[-1] not in model.config.eos_token_ids
    assert model.tokenizer.decode(list(spoken.answer_ids), skip_special_tokens=True) == text
    assert chat.messages[-1] == {"role": "assistant", "content": text}
    want = S.speak(model, np.asarray(want_prompt), np.asarray(spoken.answer_ids), speaker="Chelsie",
                   max_new_tokens=SPEECH_TOKENS)
    # Code2Wav's streamed decode, chunk by chunk: first_chunk * F - lag samples, then chunk * F, the rest last
    frames = want.codes.shape[1]
    assert frames == SPEECH_TOKENS - 1, "the tiny talker ended its speech: the chunk schedule below assumes not"
    F = model.speech.code2wav.config.samples_per_frame
    lag = F * FIRST_CHUNK - chunks[0].shape[0]
    assert 0 <= lag < F
    assert [c.shape[0] for c in chunks] == [FIRST_CHUNK * F - lag, CHUNK * F, (frames - FIRST_CHUNK - CHUNK) * F]
    assert all(c.dtype == np.float32 and c.ndim == 1 for c in chunks)
    pcm = np.concatenate(chunks)
    peak = np.abs(want.pcm).max()
    assert peak > 0.05, "the reference waveform is (near) silent: the test would prove nothing"
    assert pcm.shape == want.pcm.shape and spoken.samples == pcm.shape[0]
    assert np.abs(pcm - want.pcm).max() <= 1e-5 * peak

    # a second spoken turn: the talker's prompt holds the first turn, the answer as decoded, and the new question
    again, chunks = split(list(chat.ask(AGAIN, max_tokens=5, speak=SpeakOptions(max_speech_tokens=SPEECH_TOKENS))))
    second = chat.last_spoken
    assert second.voice == "Ethan"
    assert list(second.prompt_ids[:len(want_prompt) + len(spoken.answer_ids)]) == [*want_prompt, *spoken.answer_ids]
    assert model.tokenizer.decode(list(second.answer_ids), skip_special_tokens=True) == again
    other = S.speak(model, np.asarray(second.prompt_ids), np.asarray(second.answer_ids), speaker="Ethan",
                    max_new_tokens=SPEECH_TOKENS)
    np.testing.assert_allclose(np.concatenate(chunks), other.pcm, rtol=0, atol=1e-5 * np.abs(other.pcm).max())


def test_the_talker_speaks_while_the_thinker_still_writes(release, monkeypatch):
    """Qwen3-Omni's talker step t reads answer token t + 1 only, so `Chat` runs it after each decoded block: PCM
    comes before the answer's last block, the talker never runs past what the thinker wrote, and the PCM equals
    `speak_streamed` on the finished answer."""
    _, model, _ = release
    steps = []
    step = talker_forward.talker_step
    monkeypatch.setattr(talker_forward, "talker_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    chat = omnijax.Chat(model, stream_config())  # 4 answer tokens a block
    first, chunk = 2, 3
    items, at = [], []  # (talker steps, thinker blocks fed) when each PCM chunk came
    for item in chat.ask(QUESTION, max_tokens=16, speak=SpeakOptions(
            max_speech_tokens=SPEECH_TOKENS, first_chunk=first, chunk=chunk)):
        items.append(item)
        if not isinstance(item, str):
            at.append((len(steps), len([s for s in chat.steps if s.label in ("user", "answer")])))
    spoken = chat.last_spoken
    blocks = len(chat.steps)  # the question's step (its first answer block) and the continuations
    assert len(spoken.answer_ids) > 2 * 4, "the tiny thinker's answer ended early: nothing to overlap"
    assert at[0][1] < blocks, "the first PCM chunk came only after the whole answer"
    # each chunk as soon as its frames are ready, and never a talker step past the tokens written (4 a block)
    assert [a for a, _ in at] == [first, first + chunk, first + 2 * chunk, SPEECH_TOKENS - 1]
    assert all(steps_run <= 4 * fed - 1 for steps_run, fed in at[:-1])
    want = list(S.speak_streamed(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids),
                                 speaker="Ethan", max_new_tokens=SPEECH_TOKENS, first_chunk=first, chunk=chunk))
    chunks = [i for i in items if not isinstance(i, str)]
    assert [c.shape for c in chunks] == [w.shape for w in want] and spoken.samples == sum(c.size for c in chunks)
    peak = max(np.abs(w).max() for w in want)
    assert peak > 0.05 and max(np.abs(c - w).max() for c, w in zip(chunks, want)) <= 1e-5 * peak


def test_answer_speech_holds_back_what_may_not_be_spoken(release):
    """`AnswerSpeech` fed one token at a time, the answer ending `<|im_end|>` then a stop id (both dropped), equals
    `speak_streamed` on the answer without them; refusals name the problem."""
    root, model, _ = release
    prompt = np.asarray(hf_prompt(root / "hf", [{"role": "user", "content": QUESTION}]))
    im_end, stop = TTS["im_end_token_id"], TTS["tts_eos_token_id"]  # any id can be a stop
    words = [int(t) for t in model.tokenizer.encode("hello there you all")][:6]
    assert len(words) >= 4
    stream = model.speech.answer_stream(model, prompt, voice="Chelsie", max_new_tokens=SPEECH_TOKENS,
                                        first_chunk=3, chunk=4, stop=(stop,))
    got = []
    for token in [*words, im_end]:
        got += stream.push([token])
        # talker step t reads answer token t + 1: never more steps than tokens certainly spoken, less one
        assert len(stream.talker_tokens) - 1 <= max(0, len(stream._readable()) - 1)
    assert stream._readable() == words  # <|im_end|> held back: a stop may follow
    got += stream.finish([stop])
    assert stream.answer() == words
    want = list(S.speak_streamed(model, prompt, np.asarray(words), speaker="Chelsie", max_new_tokens=SPEECH_TOKENS,
                                 first_chunk=3, chunk=4))
    assert [g.shape for g in got] == [w.shape for w in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=0,
                               atol=1e-5 * np.abs(np.concatenate(want)).max())
    with pytest.raises(ValueError, match="has ended"):
        stream.push([words[0]])
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, "):
        model.speech.answer_stream(model, prompt, voice="Ethan").push([model.config.vocab_size])
    with pytest.raises(S.UnknownVoiceError, match="aiden"):
        model.speech.answer_stream(model, prompt, voice="aiden")
    with pytest.raises(ValueError, match="last turn must be the assistant"):
        model.speech.answer_stream(model, prompt[:-3], voice="Ethan")


def test_sampled_speech_through_chat_is_the_seeded_speech_of_its_answer(release):
    """`SpeakOptions(sampling=TalkerSampling(...))`: the spoken answer is `speak_streamed` of the same answer with
    the same sampling (seeded draws, test_talker_sampling.py), not the greedy speech; a non-sampler is refused."""
    _, model, _ = release
    sampling = TalkerSampling(temperature=1.3, seed=4)
    chat = omnijax.Chat(model, stream_config())
    options = SpeakOptions(max_speech_tokens=SPEECH_TOKENS, first_chunk=FIRST_CHUNK, chunk=CHUNK, sampling=sampling)
    chunks = [i for i in chat.ask(QUESTION, max_tokens=6, speak=options) if not isinstance(i, str)]
    spoken = chat.last_spoken
    args = (model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids))
    want = list(S.speak_streamed(*args, max_new_tokens=SPEECH_TOKENS, first_chunk=FIRST_CHUNK, chunk=CHUNK,
                                 sampling=sampling))
    assert [c.shape for c in chunks] == [w.shape for w in want]
    peak = max(np.abs(w).max() for w in want)
    assert max(np.abs(c - w).max() for c, w in zip(chunks, want)) <= 1e-5 * peak
    greedy = S.speak(*args, max_new_tokens=SPEECH_TOKENS)
    drawn = S.speak(*args, max_new_tokens=SPEECH_TOKENS, sampling=sampling)
    assert not np.array_equal(drawn.codes, greedy.codes[:, :drawn.codes.shape[1]])
    with pytest.raises(ValueError, match="sampling must be a TalkerSampling"):
        SpeakOptions(sampling=0.9)


def test_what_cannot_be_spoken_is_refused_before_anything_changes(release):
    _, model, thinker = release
    mute = omnijax.Chat(thinker, stream_config())
    with pytest.raises(ValueError, match="has no speech output.*convert the model's full release"):
        mute.ask(QUESTION, speak=True)
    assert mute.messages == [] and mute.units == [] and mute.text_ids == []
    chat = omnijax.Chat(model, stream_config())
    chat.system(SYSTEM)
    state, units, ids = chat.session.state, list(chat.units), list(chat.text_ids)
    with pytest.raises(ValueError, match=r"unknown voice 'aiden'.*\['chelsie', 'ethan'\]"):
        chat.ask(QUESTION, speak=SpeakOptions(voice="aiden"))
    with pytest.raises(ValueError, match="speak must be a bool or a SpeakOptions"):
        chat.ask(QUESTION, speak="Ethan")
    for bad, field in (({"chunk": 0}, "chunk"), ({"first_chunk": -1}, "first_chunk"),
                       ({"max_speech_tokens": 1.5}, "max_speech_tokens"), ({"voice": ""}, "voice")):
        with pytest.raises(ValueError, match=field):
            SpeakOptions(**bad)
    assert chat.session.state is state and chat.units == units and chat.text_ids == ids
    assert chat.messages == [{"role": "system", "content": SYSTEM}]
    # media in a user turn keep the talker's rows within speech_media_bytes (test_chat_speech_media.py); past it the
    # conversation is refused by name
    tight = omnijax.Chat(model, stream_config(), speech_media_bytes=0)
    tight.user(QUESTION)
    tight.image(np.zeros((64, 64, 3), np.uint8))
    state, units = tight.session.state, list(tight.units)
    with pytest.raises(ValueError, match="outgrew speech_media_bytes=0"):
        tight.ask(QUESTION, speak=True)
    assert tight.session.state is state and tight.units == units and len(tight.messages) == 1


def _cli_args(checkpoint, *more):
    return commands.build_parser("chat").parse_args(
        [str(checkpoint), "--pages", "64", "--page-size", "16", "--block", "4", "--max-tokens", "6", *more])


def test_chat_cli_writes_the_conversation_speech_to_a_wav(release, tmp_path):
    root, model, _ = release
    out = tmp_path / "spoken.wav"
    args = _cli_args(root / "hf_omnijax", "--speak", str(out), "--voice", "chelsie", "--max-speech-tokens",
                     str(SPEECH_TOKENS))
    args.command = "chat"
    printed = io.StringIO()
    assert commands.run_chat(args, io.StringIO(f"{QUESTION}\n{AGAIN}\n"), printed) == 0
    # the same conversation through Chat with the CLI's settings: the file holds both answers' speech in turn
    chat = omnijax.Chat(model, commands.stream_config(args))
    options = SpeakOptions(voice="chelsie", max_speech_tokens=SPEECH_TOKENS)
    answers = [split(list(chat.ask(q, max_tokens=6, speak=options))) for q in (QUESTION, AGAIN)]
    lines = printed.getvalue().splitlines()
    assert lines[0] == answers[0][0] and lines[2] == answers[1][0]
    assert lines[1].startswith("[spoke ") and lines[1].endswith(f" s -> {out}]")
    samples, rate = read_wav(out)
    assert rate == 24000
    want = pcm16(np.concatenate([c for _, chunks in answers for c in chunks]))
    np.testing.assert_array_equal(np.round(samples * 32768).astype(np.int16), want)


def test_chat_cli_speaks_in_the_vocoder_chunks_its_flags_give(release, tmp_path, monkeypatch):
    root, model, _ = release
    first, later = 2, 3  # not the defaults (4, 25): with 11 frames, calls of 2, 3, 3 and 3 frames
    out = tmp_path / "chunked.wav"
    args = _cli_args(root / "hf_omnijax", "--speak", str(out), "--max-speech-tokens", str(SPEECH_TOKENS),
                     "--speech-first-chunk", str(first), "--speech-chunk", str(later))
    args.command = "chat"
    written = []  # each answer's PCM chunks as the CLI hands them to its WAV file
    add = commands.SpeechFile.add
    monkeypatch.setattr(commands.SpeechFile, "add",
                        lambda self, chunks: written.append(list(chunks)) or add(self, chunks))
    assert commands.run_chat(args, io.StringIO(f"{QUESTION}\n"), io.StringIO()) == 0
    (chunks,) = written
    # the Python path with the same options yields the same chunks
    chat = omnijax.Chat(model, commands.stream_config(args))
    want_chunks = [i for i in chat.ask(QUESTION, max_tokens=6, speak=SpeakOptions(
        max_speech_tokens=SPEECH_TOKENS, first_chunk=first, chunk=later)) if not isinstance(i, str)]
    assert [c.shape for c in chunks] == [c.shape for c in want_chunks]
    for got, want in zip(chunks, want_chunks):
        np.testing.assert_array_equal(got, want)
    # ... in vocoder calls of `first` frames, then `later`: the flags reached the vocoder
    spoken = chat.last_spoken
    one_shot = S.speak(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), speaker="Ethan",
                       max_new_tokens=SPEECH_TOKENS)
    frames, F = one_shot.codes.shape[1], model.speech.code2wav.config.samples_per_frame
    assert frames == SPEECH_TOKENS - 1, "the tiny talker ended its speech: the chunk schedule below assumes not"
    sizes = [c.shape[0] for c in chunks]
    lag = first * F - sizes[0]
    assert 0 <= lag < F and len(sizes) == 1 + -(-(frames - first) // later)
    assert all(n == later * F for n in sizes[1:-1]) and 0 < sizes[-1] <= later * F
    # ... whose concatenation is the one-shot decode, and the file holds it
    pcm, peak = np.concatenate(chunks), np.abs(one_shot.pcm).max()
    assert peak > 0.05 and pcm.shape == one_shot.pcm.shape and np.abs(pcm - one_shot.pcm).max() <= 1e-4 * peak
    samples, _ = read_wav(out)
    np.testing.assert_array_equal(np.round(samples * 32768).astype(np.int16), pcm16(pcm))


@pytest.mark.parametrize("checkpoint, more, says", [
    ("hf_thinker_omnijax", ["--speak", "x.wav"], "has no speech output"),
    ("hf_omnijax", ["--speak", "x.wav", "--voice", "aiden"], "unknown voice 'aiden'"),
    ("hf_omnijax", ["--voice", "ethan"], "--voice needs --speak"),
    ("hf_omnijax", ["--early-start"], "--early-start needs --speak"),
    ("hf_omnijax", ["--speak", "x.mp3"], "ending in .wav"),
    ("hf_omnijax", ["--speak", "x.wav", "--speech-first-chunk", "0"], "--speech-first-chunk must be at least 1"),
    ("hf_omnijax", ["--speak", "x.wav", "--speech-chunk", "-2"], "--speech-chunk must be at least 1"),
    ("hf_omnijax", ["--speech-chunk", "5"], "--speech-chunk needs --speak"),
])
def test_chat_cli_refuses_what_it_cannot_speak(release, tmp_path, capsys, checkpoint, more, says):
    checkpoint = release[0] / checkpoint
    status = commands.main("chat", [str(checkpoint), *[str(tmp_path / m) if m.startswith("x.") else m for m in more]])
    assert status == 1 and says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_watch_refuses_a_vocoder_chunk_below_one_frame_before_the_video_is_read(release, tmp_path, capsys):
    video = tmp_path / "never-read.mp4"  # absent: a refusal after the checkpoint or the video was read would say so
    status = commands.main("watch", [str(release[0] / "hf_omnijax"), str(video), "--ask", QUESTION, "--speak",
                                     str(tmp_path / "x.wav"), "--speech-first-chunk", "0"])
    assert status == 1 and "--speech-first-chunk must be at least 1 codec frame, got 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
