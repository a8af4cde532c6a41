"""The Qwen2.5-Omni talker starts before the answer is finished (`omnijax.models.qwen2_5_omni.speech_stream`), on
the tiny release and stream settings test_chat_speak_qwen25 runs (its compiled programs: 64 pages of 16, 4 answer
tokens a step, 6 answer tokens, 14 speech tokens, Token2Wav chunks of 4 then 25 codec tokens):

- through `omnijax.Chat`, two turns (the second's prompt holds the first answer): the talker has decoded tokens
  after the answer's first step, before the answer ends, and the speech equals the finish-first path (the speech
  output's `speak_chunks` on the finished answer, what `Chat` spoke before): the talker's tokens those of
  `talker_forward.generate_greedy` over `talker_input`, the PCM chunks' sizes and samples bit for bit;
- the thinker rows a prefix of the answer gives are the whole answer's, bit for bit (`talker_forward.thinker_rows`
  runs whole pages: what lets the talker read them early);
- sampling is refused by name (the talker is greedy only), by `Chat` before anything is fed and by `answer_stream`.
"""

import warnings

import numpy as np
import pytest

import omnijax
from omnijax import commands
from omnijax.chat import SpeakOptions
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni import speech_stream, talker_forward
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling

pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
pytest.importorskip("transformers", reason="transformers (the test extra) builds the release")

from tests._support.qwen25_speech import spoken_release25  # noqa: E402
from tests.chat import test_chat_speak_qwen25 as CS  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("early25")
    out = spoken_release25(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(out)
    argv = [str(out), *CS.STREAM, "--max-tokens", str(CS.MAX_TOKENS), "--speak", "x.wav"]
    return model, commands.stream_config(commands.build_parser("chat").parse_args(argv))


def test_the_talker_speaks_while_the_answer_is_written_as_the_finished_answer(chat_model, monkeypatch):
    model, config = chat_model
    seen = []  # (finished, answer tokens pushed, talker tokens) after each push / finish
    run = speech_stream.AnswerSpeech._run

    def spy(self):
        yield from run(self)
        seen.append((self._finished, len(self.generated), list(self.talker_tokens)))

    monkeypatch.setattr(speech_stream.AnswerSpeech, "_run", spy)
    chat, speech = omnijax.Chat(model, config), model.speech
    options = SpeakOptions(voice="chelsie", max_speech_tokens=CS.SPEECH_TOKENS)
    talker = speech.talker.config
    for question in CS.QUESTIONS:
        seen.clear()
        items = list(chat.ask(question, max_tokens=CS.MAX_TOKENS, speak=options))
        spoken = chat.last_spoken
        prompt, answer = np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids)
        early = [s for s in seen if not s[0]]
        assert early and early[0][1] < len(answer) and len(early[0][2]) >= 2, seen  # started before the end
        assert seen[-1][0]
        # the finish-first path: the talker alone over talker_input, and speak_chunks' PCM chunks
        made = S.talker_input(model, prompt, answer, speech.voice("chelsie"))
        want = talker_forward.generate_greedy(
            talker, speech.params, made.rows, made.positions, made.trailing, made.text_pad,
            prompt_ids=made.prompt_ids, max_new_tokens=CS.SPEECH_TOKENS, repetition_penalty=1.05,
            suppress=[talker.codec_bos_id])
        np.testing.assert_array_equal(np.asarray(seen[-1][2]), want)
        chunks = list(speech.speak_chunks(model, prompt, answer, voice="chelsie",
                                          max_new_tokens=CS.SPEECH_TOKENS))
        mine = [i for i in items if not isinstance(i, str)]
        assert [c.size for c in mine] == [c.size for c in chunks]
        ref = np.concatenate(chunks)
        assert want.size >= 6 and np.abs(ref).max() > 0.05, "near silent: the test would prove nothing"
        np.testing.assert_array_equal(np.concatenate(mine), ref)
        # a prefix's thinker rows are the whole sequence's (one page here), bit for bit
        whole = talker_forward.thinker_rows(model.decoder, np.concatenate([prompt, answer]))
        part = talker_forward.thinker_rows(model.decoder, np.concatenate([prompt, answer[:2]]))
        for w, p in zip(whole, part):
            np.testing.assert_array_equal(np.asarray(w)[:p.shape[0]], np.asarray(p))


def test_sampling_is_refused_by_name(chat_model):
    model, config = chat_model
    chat = omnijax.Chat(model, config)
    before = (list(chat.units), list(chat.text_ids))
    with pytest.raises(ValueError, match="greedily only"):
        chat.ask("Hi", speak=SpeakOptions(voice="chelsie", sampling=TalkerSampling(seed=1)))
    assert (list(chat.units), list(chat.text_ids)) == before  # nothing fed
    with pytest.raises(ValueError, match="greedily only"):
        model.speech.answer_stream(model, [1, 2], voice="chelsie", sampling=TalkerSampling(seed=1))
