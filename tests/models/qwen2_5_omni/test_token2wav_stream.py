"""Token2Wav streamed (`token2wav_stream.Token2WavStream`) against the one-shot decode (`token2wav.synthesize`, which
equals transformers: test_token2wav) and against the vocoder's one-shot output of the stream's own mel.

Measured here (tiny random-weight DiT of test_token2wav: blocks of 4 frames, one look-ahead and two look-back layers,
10 ODE steps; 24 blocks, chunks of 2 blocks, past states held): the stream's mel differs from the one-shot mel by
2.6e-2 / 7.7e-4 / 1.7e-5 / 3.0e-7 of its range with 0 / 1 / 2 / 3 look-ahead blocks (~40x less per block).
"""

import numpy as np
import pytest

from omnijax.models.qwen2_5_omni.bigvgan import BigVGANConfig, vocode, vocode_params
from omnijax.models.qwen2_5_omni.token2wav import sample_mel, synthesize
from omnijax.models.qwen2_5_omni.token2wav_dit import dit_params
from omnijax.models.qwen2_5_omni.token2wav_stream import (
    Token2WavStream,
    Token2WavStreaming,
    frame_noise,
    vocoder_reach,
)
from tests.models.qwen2_5_omni.test_token2wav import token2wav_pair  # noqa: F401  (the fixture)

TOL = 1e-4
TOKENS = 48  # 96 frames = 24 blocks of 4


def _voice(model, seed: int = 5):
    c = model.config.dit
    rng = np.random.default_rng(seed)
    return (rng.integers(0, c.num_embeds + 1, TOKENS), rng.normal(size=(c.enc_emb_dim,)).astype(np.float32),
            rng.normal(-3.0, 1.5, (21, c.mel_dim)).astype(np.float32))


_STREAMS: dict = {}  # the streams already run: the default settings' stream two tests read


@pytest.fixture(scope="module", autouse=True)
def _forget_streams():
    yield
    _STREAMS.clear()


def _stream(model, codes, cond, ref, streaming, *, keep_mel=False):
    """Pushes the codes one at a time; returns the stream, its chunks, and how many codes each chunk waited for.
    A stream of the same model, inputs and settings is run once per module (the stream is finished: it is only
    read)."""
    key = (id(model), codes.tobytes(), cond.tobytes(), ref.tobytes(), streaming, keep_mel)
    if key not in _STREAMS:
        _STREAMS[key] = (model, _run_stream(model, codes, cond, ref, streaming, keep_mel=keep_mel))
    return _STREAMS[key][1]


def _run_stream(model, codes, cond, ref, streaming, *, keep_mel):
    stream = Token2WavStream(model, cond, ref, streaming=streaming, seed=3, keep_mel=keep_mel)
    chunks, pushed = [], []
    for i, code in enumerate(codes):
        for pcm in stream.push([code]):
            chunks.append(pcm)
            pushed.append(i + 1)
    for pcm in stream.finish():
        chunks.append(pcm)
        pushed.append(len(codes))
    return stream, chunks, pushed


def test_look_ahead_over_the_whole_utterance_equals_the_one_shot_decode(token2wav_pair):  # noqa: F811
    _, model = token2wav_pair
    codes, cond, ref = _voice(model)
    c = model.config.dit
    streaming = Token2WavStreaming(first_blocks=1, chunk_blocks=2, right_blocks=TOKENS)
    stream, chunks, _ = _stream(model, codes, cond, ref, streaming)
    assert stream.dit_calls == 1 + 23 // 2 + 1  # solved chunk by chunk (first 1 block, then 2), past states held
    noise = frame_noise(3, 0, TOKENS * c.repeats, block=c.block_size, mel_dim=c.mel_dim)
    want = np.asarray(synthesize(model, codes[None], cond[None], ref[None], noise))[0]
    pcm = np.concatenate(chunks)
    assert pcm.shape == want.shape
    peak = np.abs(want).max()
    assert peak > 0.05
    assert np.abs(pcm - want).max() <= TOL * peak, np.abs(pcm - want).max() / peak


def test_streamed_chunks_meet_without_holes_and_the_first_comes_early(token2wav_pair):  # noqa: F811
    _, model = token2wav_pair
    codes, cond, ref = _voice(model)
    c, hop = model.config, model.config.bigvgan.hop
    stream, chunks, pushed = _stream(model, codes, cond, ref, Token2WavStreaming(), keep_mel=True)
    # every sample once: the counts add up to the utterance, each chunk whole mel frames
    assert sum(len(x) for x in chunks) == TOKENS * c.samples_per_token == stream.samples
    assert all(len(x) % hop == 0 and len(x) for x in chunks)
    # the first PCM before the last code: codes of first + right blocks, then final mel to the vocoder's reach
    assert len(chunks) > 3 and pushed[0] < TOKENS // 2, pushed
    # the chunks are the vocoder's one-shot output of the stream's mel: nothing lost or doubled at a boundary
    mel = stream.mel()
    assert mel.shape == (c.dit.mel_dim, TOKENS * c.dit.repeats)
    whole = np.asarray(vocode(vocode_params(model.bigvgan), c.bigvgan, mel[None]))[0]
    pcm = np.concatenate(chunks)
    peak = np.abs(whole).max()
    assert np.abs(pcm - whole).max() <= 1e-5 * peak
    # a right context short of the vocoder's reach: the same counts, other samples at the boundaries
    short, cut, _ = _stream(model, codes, cond, ref, Token2WavStreaming(vocoder_right=2))
    assert [len(x) for x in cut] != [] and sum(len(x) for x in cut) == TOKENS * c.samples_per_token
    assert np.abs(np.concatenate(cut) - whole).max() > 1e-3 * peak


def test_look_ahead_error_is_measured(token2wav_pair):  # noqa: F811
    """The stream's mel against the one-shot solve's (module docstring): it falls geometrically with the look-ahead
    (what cannot equal the one-shot decode by construction), and is far below the re-solved bounded window's."""
    _, model = token2wav_pair
    codes, cond, ref = _voice(model)
    c = model.config.dit
    noise = frame_noise(3, 0, TOKENS * c.repeats, block=c.block_size, mel_dim=c.mel_dim)
    one = np.asarray(sample_mel(dit_params(model.dit), c, noise, cond[None], ref[None], codes[None]))[0]
    scale = one.max() - one.min()
    errs = []
    for right in (0, 1, 2, 3):
        stream, _, _ = _stream(model, codes, cond, ref, Token2WavStreaming(right_blocks=right), keep_mel=True)
        errs.append(np.abs(stream.mel() - one).max() / scale)
    print("look-ahead 0..3 blocks, max mel error / range:", [f"{e:.1e}" for e in errs])
    assert errs[0] > 1e-3 and all(a > 5 * b for a, b in zip(errs, errs[1:])), errs
    assert errs[2] <= TOL, errs


def test_vocoder_reach_and_bad_settings(token2wav_pair):  # noqa: F811
    _, model = token2wav_pair
    assert vocoder_reach(BigVGANConfig()) == (34, 34)  # the release's rates and kernels (bounds the 28 measured)
    codes, cond, ref = _voice(model)
    # the reach holds: a frame's change moves no sample past it
    c = model.config.bigvgan
    left, right = vocoder_reach(c)
    params = vocode_params(model.bigvgan)
    mel = np.random.default_rng(0).normal(-3, 1, (1, c.mel_dim, 2 * (left + right) + 1)).astype(np.float32)
    moved = mel.copy()
    f = left + right
    moved[:, :, f] += 1.0
    diff = np.flatnonzero(np.abs(np.asarray(vocode(params, c, moved)) - np.asarray(vocode(params, c, mel)))[0] > 0)
    assert diff.size and diff.min() // c.hop >= f - right and diff.max() // c.hop <= f + left
    for bad in (dict(first_blocks=0), dict(chunk_blocks=1.5), dict(right_blocks=-1), dict(vocoder_right=True)):
        with pytest.raises(ValueError, match=f"Token2WavStreaming.{next(iter(bad))}"):
            Token2WavStreaming(**bad)
    assert Token2WavStreaming.for_tokens(model.config.dit, 4, 25) == Token2WavStreaming(first_blocks=2,
                                                                                       chunk_blocks=13)
    stream = Token2WavStream(model, cond, ref)
    with pytest.raises(ValueError, match="codes must be integers"):
        stream.push([model.config.dit.num_embeds + 1])
    stream.finish()
    with pytest.raises(ValueError, match="finished"):
        stream.push([1])
    with pytest.raises(ValueError, match="do not fit"):
        Token2WavStream(model, cond[:3], ref)
