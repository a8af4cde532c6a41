"""`omnijax watch --speak` on a converted tiny Qwen2.5-Omni release: its talker reads every unit fed, the video's
audiovisual units included (their encoder rows kept with the positions they were fed at, `MediaRows.layout`), so
each answer is spoken about the video. Run through the CLI's `main`: the WAV holds each answer's speech in turn,
equal (PCM16 within 1 LSB) to `speech.speak()` of the prompt, answer and media rows a `Chat` fed the same units and
asked the same questions speaks (`Chat.last_spoken`); `speak()` with a video equals transformers' `generate(...,
use_audio_in_video=True, return_audio=True)` (tests/models/qwen2_5_omni/test_speech_media_video.py). A voice the
checkpoint lacks and a thinker-only checkpoint are refused by name before the video is read.
"""

import warnings

import numpy as np
import pytest

import omnijax
from omnijax.chat import SpeakOptions
from omnijax.convert import convert_checkpoint
from omnijax.media.audio import pcm16, read_wav
from omnijax.models.qwen2_5_omni import frontend as F
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer

torch = pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) builds the release")
pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")

from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402
from tests.models.qwen2_5_omni import test_speech_media_image as TI  # noqa: E402

QUESTIONS = ("Then?", "Speak.")  # the tiny release's greedy answers to them hold no media placeholder
MAX_TOKENS, SPEECH_TOKENS = 6, TS.FRAMES


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny release (talker media ids = the thinker's) with its voices and tokenizer, converted, and its
    thinker-only conversion."""
    root = tmp_path_factory.mktemp("watch25")
    full = TI._full_model(True)
    full.save_pretrained(root / "hf", safe_serialization=True)
    full.thinker.save_pretrained(root / "thinker", safe_serialization=True)
    torch.save(TS._voices(full), root / "hf" / "spk_dict.pt")
    for name in ("hf", "thinker"):
        write_tiny_tokenizer(root / name, vocab_size=300, special_tokens=TS.SPECIALS, chat_template=CHATML_TEMPLATE)
        convert_checkpoint(root / name, root / f"{name}_out", progress=False, log=lambda _: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return root, omnijax.load(root / "hf_out")


def test_watch_speaks_qwen25_answers_about_the_video(release, tmp_path, capsys):
    from omnijax import commands
    from omnijax.media import video

    root, model = release
    clip = video.write_clip(tmp_path / "clip.mp4", F.synthetic_frames(2.0, 2.0, 56, 84, seed=4), 2,
                            F.tone(2.0, 330.0, seed=6))
    out = tmp_path / "answers.wav"
    argv = [str(root / "hf_out"), str(clip), *[a for q in QUESTIONS for a in ("--ask", q)], "--pages", "64",
            "--page-size", "16", "--block", "4", "--max-tokens", str(MAX_TOKENS), "--speak", str(out), "--voice",
            "chelsie", "--max-speech-tokens", str(SPEECH_TOKENS)]
    assert commands.main("watch", argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert printed.count(f" s -> {out}]") == len(QUESTIONS)
    # the reference: speak() of what a Chat fed the same units and asked the same questions speaks
    args = commands.build_parser("watch").parse_args(argv)
    chat = omnijax.Chat(model, commands.stream_config(args))
    for unit in chat.units_builder.open_video(clip).units():
        chat.av(*unit)
    want = []
    for question in QUESTIONS:
        list(chat.ask(question, max_tokens=MAX_TOKENS, speak=SpeakOptions(voice="chelsie",
                                                                         max_speech_tokens=SPEECH_TOKENS)))
        spoken = chat.last_spoken
        assert len(spoken.media) == 1 and spoken.media[0].layout is not None  # the video's one 2 s unit
        utterance = S.speak(model, spoken.prompt_ids, spoken.answer_ids, speaker="Chelsie",
                            max_new_tokens=SPEECH_TOKENS, media=spoken.media)
        assert utterance.pcm.size and np.abs(utterance.pcm).max() > 0.05
        want.append(pcm16(utterance.pcm))
    samples, rate = read_wav(out)
    assert rate == 24000
    got, want = np.round(samples * 32768).astype(np.int32), np.concatenate(want).astype(np.int32)
    assert got.shape == want.shape and int(np.abs(got - want).max()) <= 1  # float rounding: within 1 LSB
    # refused by name before the video is read (no file written)
    for ckpt, more, says in ((root / "hf_out", ["--voice", "aiden"], "unknown voice 'aiden'"),
                             (root / "thinker_out", [], "has no speech output")):
        bad = tmp_path / "bad.wav"
        assert commands.main("watch", [str(ckpt), str(tmp_path / "missing.mp4"), "--ask", "a", "--speak", str(bad),
                                       *more]) == 1
        assert says in capsys.readouterr().err
        assert not bad.exists()

