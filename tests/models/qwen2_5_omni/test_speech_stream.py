"""Qwen2.5-Omni's spoken path streamed (`speech.spoken_chunks`, `Qwen25Speech.speak_chunks`): the talker's codes go to
Token2Wav as they are decoded. Against `speech.speak` (equal to transformers' `generate(..., return_audio=True)`,
test_speech): the same talker tokens; with the look-ahead over the whole utterance the same waveform (1e-4 of the
peak); the first PCM chunk comes out before the talker's last code; the chunks' sample counts add up exactly."""

import numpy as np
import pytest

import omnijax
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStreaming
from tests._support.qwen25_release_cache import kept_release25
from tests.models.qwen2_5_omni import test_speech as TS

pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

ANSWER = np.asarray([40, 24, 67])  # the tiny talker runs to the limit on it (Ethan)
LONG = 48  # talker tokens at most


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """`test_speech`'s converted release (single file, its voices), without the other layouts that module checks;
    its transformers half kept between runs (`qwen25_release_cache`), converted afresh."""
    out = kept_release25(tmp_path_factory.mktemp("speech25_stream"))
    with pytest.warns(UserWarning, match="no tokenizer files"):  # token ids in, token ids out
        return omnijax.load(out)


def test_streamed_speech_equals_speak_with_the_whole_look_ahead(model):
    want = S.speak(model, TS.PROMPT, ANSWER, speaker="Ethan", max_new_tokens=LONG, seed=7)
    assert len(want.codes) == LONG - 1 and np.abs(want.pcm).max() > 0.05, len(want.codes)
    whole = S.speak_streamed(model, TS.PROMPT, ANSWER, speaker="Ethan", max_new_tokens=LONG, seed=7,
                                         streaming=Token2WavStreaming(right_blocks=LONG))
    np.testing.assert_array_equal(whole.talker_tokens, want.talker_tokens)
    np.testing.assert_array_equal(whole.codes, want.codes)
    peak = np.abs(want.pcm).max()
    assert whole.pcm.shape == want.pcm.shape
    assert np.abs(whole.pcm - want.pcm).max() <= 1e-4 * peak
    # the default look-ahead (2 blocks): the same length, a measured difference (not equal by construction)
    near = S.speak_streamed(model, TS.PROMPT, ANSWER, speaker="Ethan", max_new_tokens=LONG, seed=7)
    assert near.pcm.shape == want.pcm.shape
    print("default look-ahead: max PCM error / peak", np.abs(near.pcm - want.pcm).max() / peak)


def test_the_first_chunk_comes_before_the_last_code(model, monkeypatch):
    steps = []
    step = talker_forward._step
    monkeypatch.setattr(talker_forward, "_step", lambda *a: steps.append(1) or step(*a))
    at_chunk, chunks = [], []
    for pcm in model.speech.speak_chunks(model, TS.PROMPT, ANSWER, voice="ethan", max_new_tokens=LONG,
                                         first_chunk=2, chunk=4):
        at_chunk.append(len(steps))
        chunks.append(pcm)
    total = len(steps)
    assert at_chunk[0] < total - 6, (at_chunk, total)  # the first audio while the talker still decodes
    per = model.speech.token2wav.config.samples_per_token
    want = S.speak_streamed(
        model, TS.PROMPT, ANSWER, speaker="Ethan", max_new_tokens=LONG,
        streaming=Token2WavStreaming.for_tokens(model.speech.token2wav.config.dit, 2, 4))
    assert sum(len(c) for c in chunks) == len(want.codes) * per  # every code's samples, once
    np.testing.assert_array_equal(np.concatenate(chunks), want.pcm)


def test_refusals_come_at_the_call(model):
    with pytest.raises(S.UnknownVoiceError, match="Chelsie"):
        model.speech.speak_chunks(model, TS.PROMPT, ANSWER, voice="nobody")
    with pytest.raises(ValueError, match="first_chunk"):
        model.speech.speak_chunks(model, TS.PROMPT, ANSWER, voice="Ethan", first_chunk=0)
    with pytest.raises(ValueError, match="streaming must be"):
        S.spoken_chunks(model, TS.PROMPT, ANSWER, streaming=3)
