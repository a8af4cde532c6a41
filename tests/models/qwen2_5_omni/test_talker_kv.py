"""The Qwen2.5-Omni talker's KV bounded by a retention policy (`talker_forward.greedy_tokens(policy=...)`, a
`SinkWindow` as the thinker's): a budget that never trims decodes the unbounded talker's tokens; a small one keeps
the cache at its budget over a long utterance (cells never past it, no exhaustion) and the speech still decodes;
a budget the talker cannot run with is refused by name."""

import numpy as np
import pytest

from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni import talker_forward as TF
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStream, talker_pcm
from omnijax.retention import SinkWindow
from tests.models.qwen2_5_omni import test_speech as TS
from tests.models.qwen2_5_omni.test_speech import model, release  # noqa: F401  (the fixtures)

pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

ANSWER = np.asarray([40, 24, 67])  # the tiny talker runs to the limit on it (Ethan): test_speech_stream
LONG = 48


def _talk(model, endless: bool = False, **more):  # noqa: F811
    """The talker's greedy tokens (`endless`: its stop ids suppressed too, so it speaks to the limit)."""
    speech = model.speech
    _, voice, prompt, answer = S.checked_request(model, TS.PROMPT, ANSWER, "Ethan", LONG, 1.05)
    talker = S.talker_input(model, prompt, answer, voice)
    c = speech.talker.config
    return TF.generate_greedy(c, speech.params, talker.rows, talker.positions, talker.trailing, talker.text_pad,
                              prompt_ids=talker.prompt_ids, max_new_tokens=LONG,
                              suppress=[c.codec_bos_id, *(c.stop_ids if endless else ())],
                              page_size=8, **more)


def test_a_bounded_talker_kv(model):  # noqa: F811
    free = TF.TalkerKVReport()
    want = _talk(model, report=free)
    assert len(want) == LONG and max(free.retained) == len(TS.PROMPT) + 2 + LONG - 1  # everything held
    # a budget the utterance never reaches: no trim, the same tokens
    roomy = TF.TalkerKVReport()
    np.testing.assert_array_equal(_talk(model, policy=SinkWindow(sink=4, window=200), report=roomy), want)
    assert roomy.evicted == 0 and not roomy.exhausted
    # a small budget over a long utterance (stop ids suppressed: 48 tokens, 3 x the budget): trimmed after the
    # prefill and after every step; memory stays at the budget
    small = TF.TalkerKVReport()
    budget = SinkWindow(sink=4, window=12)
    got = _talk(model, endless=True, policy=budget, report=small)
    assert len(got) == LONG and len(small.retained) == LONG  # the prefill's, then one per step
    assert max(small.retained) == budget.budget and small.evicted > LONG - 1
    assert small.capacity == 24 and not small.exhausted and small.dropped == 0  # the prefill's 22 rows, 3 pages
    assert not np.array_equal(got, want)  # it reads less of the prompt: other speech, still decoded
    codes = got
    stream = Token2WavStream(model.speech.token2wav, model.speech.voice("Ethan").conditioning,
                               model.speech.voice("Ethan").reference_mel)
    pcm = np.concatenate(list(talker_pcm(iter(list(codes) + [0]), stream)))
    assert pcm.shape == (len(codes) * model.speech.token2wav.config.samples_per_token,) and np.isfinite(pcm).all()
    # on the spoken path (speech.speak_streamed(talker_kv=...), what Qwen25Speech.talker_kv configures)
    spoken = S.speak_streamed(model, TS.PROMPT, ANSWER, speaker="Ethan", max_new_tokens=LONG,
                              talker_kv=SinkWindow(sink=4, window=200))
    np.testing.assert_array_equal(spoken.talker_tokens, want)
    with pytest.raises(ValueError, match="MIN_TALKER_WINDOW"):
        _talk(model, policy=SinkWindow(sink=4, window=1))
    with pytest.raises(ValueError, match="cell budget"):
        _talk(model, policy="sink_window")
