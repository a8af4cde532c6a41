"""`omnijax chat --speak` on a converted tiny Qwen2.5-Omni release (the seeded release the server's speech tests
serve, `tests/_support/qwen25_speech.py`), run through the CLI's `main` with two questions on standard input: each
answer's text is printed, then a line naming the seconds spoken and the file, and the WAV holds both answers' speech
in turn, equal (PCM16 within 1 LSB) to the model's own one-shot path, `speech.speak()` (the talker, then Token2Wav in
one call; equal to transformers' `generate(..., return_audio=True)` in tests/models/qwen2_5_omni/test_speech.py), of
each turn's talker prompt and answer. The talker prompt is checked against transformers' own chat-template rendering
of the conversation (the second turn's holds the first answer); the answer against the printed text. A voice the
checkpoint lacks is refused by name before a message is read, no file written.
"""

import io
import sys
import warnings

import numpy as np
import pytest

import omnijax
from omnijax import commands
from omnijax.chat import SpeakOptions
from omnijax.media.audio import pcm16, read_wav
from omnijax.models.qwen2_5_omni import speech as S

pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests._support.qwen25_release_cache import kept_release25  # noqa: E402
from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402

QUESTIONS = ("Say hello.", "Once more.")
MAX_TOKENS, SPEECH_TOKENS = 6, TS.FRAMES  # test_watch_speak_qwen25's: its compiled talker and Token2Wav shapes
# the stream test_watch_speak_qwen25 and test_speech_media_qwen25 run (64 pages of 16, 4 answer tokens a step)
STREAM = ["--pages", "64", "--page-size", "16", "--block", "4"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat25")
    out = kept_release25(root, tokenizer=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return root, omnijax.load(out)


def _main(argv, lines, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    return commands.main("chat", argv)


@pytest.mark.parametrize("early", [[], ["--early-start"]], ids=["finish_first", "early_start"])
def test_chat_speak_writes_each_answer_spoken_as_speak_does(release, tmp_path, capsys, monkeypatch, early):
    """Also with `--early-start` (the talker fed each block's rows as the stream computed them): the same speech
    as one-shot `speak()` of the answer, within 1 LSB (on these weights the codes agree)."""
    root, model = release
    out = tmp_path / "spoken.wav"
    argv = [str(root / "out"), *STREAM, "--max-tokens", str(MAX_TOKENS), "--speak", str(out), "--voice", "chelsie",
            "--max-speech-tokens", str(SPEECH_TOKENS), *early]
    assert _main(argv, QUESTIONS, monkeypatch) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 * len(QUESTIONS), printed
    # the reference: the conversation through Chat with the CLI's settings gives each turn's talker prompt and
    # answer ids (Chat.last_spoken); the first prompt is checked against transformers' rendering, the second holds
    # the first turn as fed and decoded; the speech is the one-shot speak() of those ids
    chat = omnijax.Chat(model, commands.stream_config(commands.build_parser("chat").parse_args(argv)))
    options = SpeakOptions(voice="chelsie", max_speech_tokens=SPEECH_TOKENS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    want, turns = [], []
    for i, question in enumerate(QUESTIONS):
        text = "".join(x for x in chat.ask(question, max_tokens=MAX_TOKENS, speak=options) if isinstance(x, str))
        spoken = chat.last_spoken
        assert printed[2 * i] == text == tokenizer.decode(list(spoken.answer_ids), skip_special_tokens=True)
        turns.append(spoken)
        utterance = S.speak(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), speaker="Chelsie",
                            max_new_tokens=SPEECH_TOKENS)
        assert utterance.codes.size >= 6 and np.abs(utterance.pcm).max() > 0.05
        want.append(pcm16(utterance.pcm))
        assert printed[2 * i + 1] == f"[spoke {utterance.pcm.size / 24000:.2f} s -> {out}]"
    first = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    assert list(turns[0].prompt_ids) == list(first)
    head = [*first, *turns[0].answer_ids]
    assert list(turns[1].prompt_ids[:len(head)]) == head and len(turns[1].prompt_ids) > len(head) + 3
    samples, rate = read_wav(out)
    assert rate == 24000
    got, want = np.round(samples * 32768).astype(np.int32), np.concatenate(want).astype(np.int32)
    assert got.shape == want.shape and int(np.abs(got - want).max()) <= 1  # float rounding: within 1 LSB


def test_chat_speak_refuses_an_unknown_voice_before_reading(release, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.wav"
    argv = [str(release[0] / "out"), *STREAM, "--speak", str(bad), "--voice", "aiden"]
    assert _main(argv, QUESTIONS, monkeypatch) == 1
    assert "unknown voice 'aiden'" in capsys.readouterr().err and not bad.exists()
    assert sys.stdin.read() == "".join(f"{q}\n" for q in QUESTIONS)  # no message read
