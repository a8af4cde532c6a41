"""Audio files and sample rates: `read_wav` (a PCM WAV file -> mono float32 samples) and `resample` (mono PCM to the
models' 16 kHz)."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import BinaryIO

import numpy as np

# The sample rates accepted anywhere audio comes in (files, requests, `resample`): from telephone-grade 1 kHz to the
# 384 kHz of studio converters. A rate outside is refused by name before any work: a header claiming 4 GHz would
# otherwise build a resampling filter of millions of taps.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 384_000


def check_sample_rate(sample_rate: object, what: str = "sample_rate") -> int:
    """`sample_rate` as an int in [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE]; a ValueError naming the range otherwise."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ValueError(f"{what} must be an int in Hz, got {sample_rate!r}")
    if not MIN_SAMPLE_RATE <= int(sample_rate) <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what} {int(sample_rate)} Hz is outside the supported range [{MIN_SAMPLE_RATE}, "
                         f"{MAX_SAMPLE_RATE}] Hz (MAX_SAMPLE_RATE)")
    return int(sample_rate)


def resample(pcm: np.ndarray, sample_rate: int, target: int = 16_000) -> np.ndarray:
    """Mono PCM at `sample_rate` -> `target` Hz: a windowed-sinc low-pass at the target's Nyquist frequency when
    downsampling (so nothing above it folds into the band the models' log-mel features see), then linear
    interpolation onto the target's sample times."""
    sample_rate = check_sample_rate(sample_rate)
    if pcm.ndim != 1 or pcm.shape[0] == 0:
        raise ValueError(f"audio must be mono [samples] with at least one sample, got shape {pcm.shape}")
    if not np.isfinite(pcm).all():
        raise ValueError("audio holds NaN or infinite samples")
    if sample_rate == target:
        return pcm
    if sample_rate > target:
        cutoff = 0.5 * target / sample_rate  # cycles per input sample
        half = int(np.ceil(4 / cutoff))
        taps = 2 * cutoff * np.sinc(2 * cutoff * np.arange(-half, half + 1)) * np.blackman(2 * half + 1)
        pcm = np.convolve(pcm, taps / taps.sum(), mode="same")
    n = max(1, int(round(pcm.shape[0] * target / sample_rate)))
    return np.interp(np.arange(n) * (sample_rate / target), np.arange(pcm.shape[0]), pcm).astype(np.float32)


def read_wav(source: str | Path | BinaryIO, *, widths: tuple[int, ...] = (1, 2, 4)) -> tuple[np.ndarray, int]:
    """`(pcm [samples] float32 mono, sample_rate)` of a PCM WAV file (a path or a binary file object; channels
    averaged), refusing sample widths (bytes) outside `widths` with a ValueError naming the source."""

    label = source if isinstance(source, (str, Path)) else "the WAV data"
    try:
        with wave.open(source if not isinstance(source, Path) else str(source), "rb") as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            data = f.readframes(f.getnframes())
    except (OSError, EOFError, wave.Error) as e:
        raise ValueError(f"{label}: not a readable PCM WAV file ({e})") from e
    rate = check_sample_rate(rate, f"{label}: the sample rate")
    if width not in widths:
        bits = ", ".join(str(8 * w) for w in widths)
        raise ValueError(f"{label}: {8 * width}-bit samples are not supported ({bits}-bit PCM)")
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    pcm = np.frombuffer(data, dtype).astype(np.float32)
    pcm = (pcm - 128.0) / 128.0 if width == 1 else pcm / float(2 ** (8 * width - 1))
    return pcm.reshape(-1, channels).mean(axis=1), rate


__all__ = ["MAX_SAMPLE_RATE", "MIN_SAMPLE_RATE", "check_sample_rate", "read_wav", "resample"]
