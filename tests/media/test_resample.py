"""`resample` against ideal band-limited results and an independent oracle (`scipy.signal.resample_poly`), on sines,
chirps and noise at 8 / 22.05 / 44.1 / 48 kHz -> 16 kHz, measured as the models see audio: the mean absolute
difference of Whisper log-mel features. The old resampler (a low-pass only when downsampling, then linear
interpolation) was 3-80x further from the ideal than the oracle on sines and chirps and 4x on 8 kHz noise."""

from math import gcd

import numpy as np
import pytest

from omnijax.media import audio
from omnijax.media.audio import resample
from omnijax.models.minicpmo.audio_features import log_mel

signal = pytest.importorskip("scipy.signal")  # the oracle: installed as a dependency of the test extra's packages
RATES = (8_000, 22_050, 44_100, 48_000)
SECONDS, EDGE = 2.0, 1600  # 0.1 s at each end is left out: the edges see the zeros beyond the clip


def synthetic(kind: str, source: int, rate: int) -> np.ndarray:
    """2 s of a sum of sines or of a linear chirp (up to 0.9 of the Nyquist frequency of `source` and 16 kHz)
    sampled at `rate`."""
    t = np.arange(int(round(SECONDS * rate))) / rate
    nyquist = min(source, 16_000) / 2
    if kind == "sine":
        return sum(0.3 * np.sin(2 * np.pi * f * t + i) for i, f in enumerate((220.0, 0.4 * nyquist, 0.85 * nyquist)))
    f0, f1 = 50.0, 0.9 * nyquist
    return 0.5 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * SECONDS)))


def band_limited(x: np.ndarray, rate: int) -> np.ndarray:
    """The ideal 16 kHz version of a periodic signal: its spectrum below both Nyquist frequencies, resynthesised."""
    n = int(round(x.shape[0] * 16_000 / rate))
    spectrum = np.fft.rfft(x.astype(np.float64))
    kept = np.zeros(n // 2 + 1, complex)
    k = min(kept.shape[0], spectrum.shape[0])
    kept[:k] = spectrum[:k]
    return np.fft.irfft(kept, n) * n / x.shape[0]


def case(kind: str, rate: int) -> tuple[np.ndarray, np.ndarray]:
    """`(signal at rate, its ideal at 16 kHz)`."""
    if kind == "noise":
        x = 0.2 * np.random.default_rng(rate).standard_normal(int(SECONDS * rate))
        return x.astype(np.float32), band_limited(x, rate)
    return synthetic(kind, rate, rate).astype(np.float32), synthetic(kind, rate, 16_000)


def oracle(x: np.ndarray, rate: int) -> np.ndarray:
    common = gcd(rate, 16_000)
    return signal.resample_poly(x.astype(np.float64), 16_000 // common, rate // common)


def mel_error(a: np.ndarray, b: np.ndarray) -> float:
    n = min(a.shape[0], b.shape[0]) - 2 * EDGE
    n -= n % 160
    cut = slice(EDGE, EDGE + n)
    return float(np.abs(log_mel(np.float32(a[cut])) - log_mel(np.float32(b[cut]))).mean())


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("kind", ["sine", "chirp", "noise"])
def test_log_mel_error_is_the_oracles_or_lower(kind, rate):
    x, ideal = case(kind, rate)
    ours, reference = resample(x, rate), oracle(x, rate)
    assert ours.dtype == np.float32 and ours.shape == ideal.shape == reference.shape
    ours_error, oracle_error = mel_error(ours, ideal), mel_error(reference, ideal)
    assert ours_error <= 1.2 * oracle_error + 1e-3, (ours_error, oracle_error)
    if kind != "noise":  # a known waveform: close sample by sample too (up to the filter's roll-off band)
        inner = slice(EDGE, -EDGE)
        assert np.abs(ours[inner] - ideal[inner]).max() < 2e-3


def test_nothing_folds_into_the_band_and_the_band_passes():
    rate = 48_000
    t = np.arange(rate) / rate
    for f, low, high in ((1_000, -0.01, 0.01), (7_000, -0.05, 0.05), (8_500, None, -80), (12_000, None, -90)):
        y = resample(np.sin(2 * np.pi * f * t).astype(np.float32), rate)[EDGE:-EDGE]
        gain = 20 * np.log10(np.sqrt(2) * y.std() + 1e-12)
        assert gain <= high and (low is None or gain >= low), (f, gain)


def test_ratios_without_small_terms_and_every_length():
    for rate in (44_101, 1_000, 384_000, 16_001):  # 16000/44101 has no common factor: 16000 phases
        x, ideal = case("sine", rate)
        y = resample(x, rate)
        assert y.shape == ideal.shape and np.abs(y[EDGE:-EDGE] - ideal[EDGE:-EDGE]).max() < 2e-3, rate
    for n in (1, 2, 3, 7, 160):
        for rate in (8_000, 44_100, 48_000):
            y = resample(np.ones(n, np.float32), rate)
            assert y.shape == (max(1, round(n * 16_000 / rate)),) and np.isfinite(y).all()
    assert resample(np.ones(3, np.float32), 16_000, target=48_000).shape == (9,)
    with pytest.raises(ValueError, match="target 5 Hz is outside the supported range"):
        resample(np.ones(3, np.float32), 16_000, target=5)


@pytest.mark.parametrize("rate", [44_100, 48_000])
def test_a_minute_resamples_in_a_few_large_blocks(rate, monkeypatch):
    """The cost of a minute of audio, counted rather than timed (timings belong to bench/): every output comes from
    one matrix product over a strided view of the input, in blocks of `_BLOCK // taps` outputs (fewer only in a
    phase's last block), so the number of products is at most one per phase plus the outputs over the block size
    (160 for 44.1 kHz, 46 for 48 kHz) -- not a Python step per sample or per output."""
    blocks = []
    strided = np.lib.stride_tricks.as_strided

    def counted(*args, **kwargs):
        blocks.append(kwargs["shape"])
        return strided(*args, **kwargs)

    monkeypatch.setattr(np.lib.stride_tricks, "as_strided", counted)
    x = np.random.default_rng(0).standard_normal(60 * rate).astype(np.float32)
    y = resample(x, rate)
    assert y.shape == (960_000,) and np.isfinite(y).all()
    taps = blocks[0][1]
    rows = max(1, audio._BLOCK // taps)
    up = 16_000 // gcd(rate, 16_000)
    assert sum(m for m, _ in blocks) == 960_000  # every output once
    assert len(blocks) <= up + -(-960_000 // rows), (len(blocks), up, rows)
