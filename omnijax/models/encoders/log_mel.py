"""Whisper-style log-mel features for the Qwen2.5-Omni audio encoder, computed in numpy.

`log_mel` reproduces what `Qwen2_5OmniProcessor` feeds the audio tower: `WhisperFeatureExtractor(feature_size=128)`
at 16 kHz (hann window of 400 samples, hop 160, slaney mel filters over 0-8 kHz, log10, dynamic range clamped to
8 decades below the loudest bin, then `(x + 4) / 4`), restricted to the frames that the processor's
`feature_attention_mask` marks valid.

The processor always pads the waveform on the right with zeros (`padding="max_length"`) before the STFT, so the last
frames of an utterance see silence after it (not a reflection of its end), and it marks `ceil(len / 160)` frames
valid. `log_mel` does the same without materialising the padding: it returns exactly `ceil(len / 160)` frames
(`len // 160` when the length is a multiple of the hop), 100 frames per second, and takes the clamp's maximum over
every frame that overlaps the audio, as the padded computation does.

The clamp makes features depend on the loudest part of the whole clip: features of a clip computed in pieces differ
from those of the clip computed at once wherever a piece's loudest bin is more than 8 decades above a quiet region.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

SAMPLE_RATE = 16000
HOP_LENGTH = 160
N_FFT = 400
_MEL_FLOOR = 1e-10
_BLOCK_FRAMES = 4096  # frames per STFT block (bounds the float64 frame buffer to ~13 MB)


class AudioInputError(ValueError):
    """Base class of every rejected audio input (PCM or features)."""


class UnsupportedSampleRateError(AudioInputError):
    """The PCM is not sampled at 16 kHz."""


class InvalidPcmError(AudioInputError):
    """The PCM is not a non-empty 1D array of finite real float samples."""


class FeatureShapeError(AudioInputError):
    """Features have the wrong rank, mel-bin count or too few frames for the encoder."""


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per factor 6.4)."""
    freq = np.asarray(freq, np.float64)
    linear = 3.0 * freq / 200.0
    log_part = 15.0 + np.log(np.maximum(freq, 1e-12) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(freq >= 1000.0, log_part, linear)


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, np.float64)
    linear = 200.0 * mels / 3.0
    log_part = 1000.0 * np.exp((mels - 15.0) * (np.log(6.4) / 27.0))
    return np.where(mels >= 15.0, log_part, linear)


@functools.lru_cache(maxsize=8)
def mel_filters(num_mel_bins: int = 128, *, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT,
                f_min: float = 0.0, f_max: float = 8000.0) -> np.ndarray:
    """Slaney-normalised triangular mel filter bank, `[n_fft // 2 + 1, num_mel_bins]` float64 (read-only).

    Filter m rises linearly from edge m to edge m + 1 and falls to zero at edge m + 2, where the `num_mel_bins + 2`
    edges are equally spaced on the slaney mel scale between `f_min` and `f_max`; each filter is scaled by
    `2 / (edge[m + 2] - edge[m])` so that it has unit area in Hz.
    """
    fft_freqs = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)  # [K]
    edges = _mel_to_hz(np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), num_mel_bins + 2))  # [M + 2]
    widths = np.diff(edges)  # [M + 1]
    offsets = edges[None, :] - fft_freqs[:, None]  # [K, M + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))  # [K, M]
    bank *= 2.0 / (edges[2:] - edges[:-2])
    bank.setflags(write=False)
    return bank


def num_frames(num_samples: int) -> int:
    """Valid feature frames for `num_samples` samples at 16 kHz: `ceil(num_samples / 160)` (100 per second)."""
    return -(-int(num_samples) // HOP_LENGTH)


def check_pcm_layout(pcm: npt.ArrayLike, sample_rate: int) -> np.ndarray:
    """`pcm` as a numpy array, once its sample rate is 16 kHz, its samples real floats and its shape 1D (mono).

    Raises:
        UnsupportedSampleRateError: `sample_rate` is not the integer 16000.
        InvalidPcmError: the samples are not floating point, or the array is not 1D.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate != SAMPLE_RATE:
        raise UnsupportedSampleRateError(
            f"audio must be sampled at {SAMPLE_RATE} Hz, got sample_rate={sample_rate!r}; resample to 16 kHz first")
    pcm = np.asarray(pcm)
    if pcm.dtype.kind != "f":
        hint = (" (integer PCM: divide by 32768 for int16 to get floats in [-1, 1])" if pcm.dtype.kind in "iu"
                else "")
        raise InvalidPcmError(f"PCM samples must be real floats, got dtype {pcm.dtype}{hint}")
    if pcm.ndim != 1:
        raise InvalidPcmError(f"PCM must be a 1D array of mono samples, got shape {pcm.shape}"
                              + ("; mix channels down to mono first" if pcm.ndim == 2 else ""))
    return pcm


def finite_float32(pcm: np.ndarray) -> np.ndarray:
    """`pcm` cast to float32 (the processors work on float32 samples), refusing NaN and inf.

    Raises:
        InvalidPcmError: naming how many samples are not finite and the first one's index.
    """
    pcm = pcm.astype(np.float32)
    bad = ~np.isfinite(pcm)
    if bad.any():
        raise InvalidPcmError(f"PCM holds {int(bad.sum())} non-finite sample(s) (NaN or inf), first at index "
                              f"{int(np.argmax(bad))}")
    return pcm


def _check_pcm(pcm, sample_rate) -> np.ndarray:
    pcm = check_pcm_layout(pcm, sample_rate)
    if pcm.size == 0:
        raise InvalidPcmError("PCM is empty (0 samples)")
    return finite_float32(pcm)


def log_mel(pcm: npt.ArrayLike, sample_rate: int = SAMPLE_RATE, *, num_mel_bins: int = 128) -> np.ndarray:
    """Log-mel features of a mono 16 kHz waveform, as `Qwen2_5OmniProcessor` computes them.

    Args:
        pcm: `[samples]` float samples (nominally in [-1, 1]).
        sample_rate: must be 16000.
        num_mel_bins: mel filters (128 for Qwen2.5-Omni).

    Returns:
        `[num_mel_bins, ceil(samples / 160)]` float32 features (the frames the processor marks valid).

    Raises:
        UnsupportedSampleRateError: `sample_rate` is not 16000.
        InvalidPcmError: `pcm` is not 1D, is empty, is not floating point, or holds NaN/inf.
        ValueError: `num_mel_bins` is not a positive integer.
    """
    if isinstance(num_mel_bins, bool) or not isinstance(num_mel_bins, (int, np.integer)) or num_mel_bins < 1:
        raise ValueError(f"num_mel_bins must be a positive integer, got {num_mel_bins!r}")
    pcm = _check_pcm(pcm, sample_rate)
    n = pcm.size
    frames = num_frames(n)
    # Frames of the zero-padded waveform that overlap the audio; the clamp's maximum is taken over all of them.
    frames_touching = (n + N_FFT // 2 - 1) // HOP_LENGTH + 1
    half = N_FFT // 2
    # Right: zeros (the processor pads to its max length first); left: reflection of the (zero-extended) start.
    right = np.concatenate([pcm.astype(np.float64), np.zeros(N_FFT + half, np.float64)])
    padded = np.concatenate([right[1:half + 1][::-1], right])
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic hann
    bank = mel_filters(int(num_mel_bins))  # [K, M]
    out = np.empty((frames_touching, int(num_mel_bins)), np.float64)
    views = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]  # [>= frames_touching, N_FFT]
    for start in range(0, frames_touching, _BLOCK_FRAMES):
        stop = min(start + _BLOCK_FRAMES, frames_touching)
        spectrum = np.fft.rfft(views[start:stop] * window, axis=-1)  # [B, K]
        power = spectrum.real ** 2 + spectrum.imag ** 2
        out[start:stop] = np.log10(np.maximum(power @ bank, _MEL_FLOOR))
    floor = out.max() - 8.0
    feats = (np.maximum(out[:frames], floor) + 4.0) / 4.0
    return np.ascontiguousarray(feats.T, dtype=np.float32)
