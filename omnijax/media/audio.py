"""Audio files and sample rates: `read_wav` (a WAV file -> mono float32 samples), `wav_bytes` / `pcm16` (float
samples -> a 16-bit WAV file, what spoken answers are written as) and `resample` (mono PCM to the models' 16 kHz).

`read_wav` parses the RIFF/WAVE container itself (Python's `wave` module before 3.12 reads only plain PCM): integer
PCM of 8 (unsigned), 16, 24 and 32 bits and IEEE float of 32 and 64 bits, in the plain format (tags 1 and 3) and in
WAVE_FORMAT_EXTENSIBLE (tag 0xFFFE, what ffmpeg writes for more than 16 bits, more than 2 channels or more than
48 kHz) when its sub-format GUID is PCM or IEEE float. Compressed formats (A-law, mu-law, ADPCM, MP3, ...) and other
sub-formats are refused by name.

`resample` is a band-limited polyphase resampler written in numpy, the design of `scipy.signal.resample_poly` and
soxr: output sample `n` sits at input time `n * rate / target` and is the input convolved with a Kaiser-windowed
sinc low-pass whose cutoff is just below the lower of the two Nyquist frequencies (so downsampling folds nothing into
the band the models' log-mel features see, and upsampling leaves no spectral images above the input's band). Why
numpy and not PyAV's swresample: `resample` serves the base install (the server, `Chat`), while PyAV is an optional
extra for video files; this filter is also closer to the ideal band-limited result than swresample's defaults (mean
log-mel error of noise at 8 kHz -> 16 kHz, measured when it was written: 0.008, swresample 0.039,
`scipy.signal.resample_poly` 0.066; tests/media/test_resample.py holds it to resample_poly's error or lower) and
resamples a 60 s clip at 8-48 kHz in about 0.05-0.3 s of CPU.
"""

from __future__ import annotations

import functools
import math
import struct
import uuid
from pathlib import Path
from typing import BinaryIO

import numpy as np

# The sample rates accepted anywhere audio comes in (files, requests, `resample`): from telephone-grade 1 kHz to the
# 384 kHz of studio converters. A rate outside is refused by name before any work: a header claiming 4 GHz would
# otherwise build a resampling filter of millions of taps.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 384_000

# The low-pass of `resample`: a sinc reaching ZEROS zero crossings each side, under a Kaiser window of shape BETA
# (about 90 dB of stopband), its cutoff at ROLLOFF of the lower Nyquist frequency (-6 dB there; flat to about 0.93,
# below -90 dB from the Nyquist frequency on). The kernel is tabulated GRID points per zero crossing and linearly
# interpolated (error about 5e-6), so any rate ratio costs one small table.
_ZEROS, _BETA, _ROLLOFF, _GRID = 32, 9.0, 0.97, 512
_BLOCK = 1 << 22  # most input values one matrix product of `resample` reads (16 MB of float32)

_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_GUID_TAIL = bytes.fromhex("00001000800000aa00389b71")  # a KSDATAFORMAT_SUBTYPE_ GUID after its format tag
_FORMAT_NAMES = {0x0002: "Microsoft ADPCM", 0x0006: "A-law", 0x0007: "mu-law", 0x0011: "IMA ADPCM",
                 0x0031: "GSM 6.10", 0x0050: "MPEG audio", 0x0055: "MP3", 0x0161: "WMA", 0x0162: "WMA Pro",
                 0x2000: "AC-3", 0x2001: "DTS", 0xF1AC: "FLAC"}


def check_sample_rate(sample_rate: object, what: str = "sample_rate") -> int:
    """`sample_rate` as an int in [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE]; a ValueError naming the range otherwise."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ValueError(f"{what} must be an int in Hz, got {sample_rate!r}")
    if not MIN_SAMPLE_RATE <= int(sample_rate) <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what} {int(sample_rate)} Hz is outside the supported range [{MIN_SAMPLE_RATE}, "
                         f"{MAX_SAMPLE_RATE}] Hz (MAX_SAMPLE_RATE)")
    return int(sample_rate)


@functools.cache
def _kernel() -> np.ndarray:
    """The windowed sinc on `[0, _ZEROS]` zero crossings, `_GRID` points per crossing (two zeros past the end)."""
    u = np.arange(_ZEROS * _GRID + 2) / _GRID
    x = np.clip(u / _ZEROS, 0.0, 1.0)
    kernel = np.sinc(u) * np.i0(_BETA * np.sqrt(1.0 - x * x)) / np.i0(_BETA)
    kernel[u >= _ZEROS] = 0.0
    return kernel


def _phase_filters(phases: np.ndarray, up: int, reach: int, cutoff: float) -> np.ndarray:
    """`[len(phases), 2 * reach]` float32 taps: row `i` weighs input samples `base - reach + 1 ... base + reach` of
    an output at input time `base + phases[i] / up`, normalised to sum 1 (DC passes every phase unchanged)."""
    kernel = _kernel()
    tau = phases[:, None] / up + (reach - 1) - np.arange(2 * reach)  # output time - input time, in input samples
    position = np.abs(tau) * (cutoff * _GRID)
    index = np.minimum(position.astype(np.int64), kernel.shape[0] - 2)
    frac = position - index
    taps = (1.0 - frac) * kernel[index] + frac * kernel[index + 1]
    return (taps / taps.sum(axis=1, keepdims=True)).astype(np.float32)


def resample(pcm: np.ndarray, sample_rate: int, target: int = 16_000) -> np.ndarray:
    """Mono PCM at `sample_rate` -> `target` Hz with a band-limited polyphase filter (see the module docstring).

    Args:
        pcm: `[samples]` finite float samples, at least one.
        sample_rate: the input rate in Hz, in [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE].
        target: the output rate in Hz, in the same range.

    Returns:
        `[round(samples * target / sample_rate)]` float32 (at least one sample); output `n` is at input time
        `n * sample_rate / target` (the first samples coincide); `pcm` itself when the rates are equal.

    Raises:
        ValueError: a rate outside the range, audio that is not mono or is empty, or NaN/infinite samples.
    """
    sample_rate = check_sample_rate(sample_rate)
    target = check_sample_rate(target, "target")
    if pcm.ndim != 1 or pcm.shape[0] == 0:
        raise ValueError(f"audio must be mono [samples] with at least one sample, got shape {pcm.shape}")
    if not np.isfinite(pcm).all():
        raise ValueError("audio holds NaN or infinite samples")
    if sample_rate == target:
        return pcm
    common = math.gcd(sample_rate, target)
    up, down = target // common, sample_rate // common  # output n at input time n * down / up
    cutoff = _ROLLOFF * min(1.0, target / sample_rate)  # cycles per input sample, times 2
    reach = int(math.ceil(_ZEROS / cutoff))
    taps = 2 * reach
    count = max(1, int(round(pcm.shape[0] * target / sample_rate)))
    padded = np.zeros(pcm.shape[0] + 2 * taps + down + 1, np.float32)  # input sample k at padded[k + reach]
    padded[reach:reach + pcm.shape[0]] = pcm
    out = np.empty(count, np.float32)
    rows = max(1, _BLOCK // taps)
    # The outputs r, r + up, r + 2 up, ... share one phase and step `down` input samples apart: one filter applied
    # to a strided view of the input. Filters are built for a batch of residues r at a time.
    for first in range(0, min(up, count), rows):
        residues = np.arange(first, min(first + rows, up, count))
        positions = residues * down
        filters = _phase_filters(positions % up, up, reach, cutoff)
        for r, base, taps_r in zip(residues.tolist(), (positions // up).tolist(), filters):
            outputs = (count - r + up - 1) // up
            for start in range(0, outputs, rows):
                m = min(rows, outputs - start)
                view = np.lib.stride_tricks.as_strided(padded[base + 1 + start * down:], shape=(m, taps),
                                                       strides=(down * padded.itemsize, padded.itemsize),
                                                       writeable=False)
                out[r + start * up:r + (start + m) * up:up] = view @ taps_r
    return out


def _read_bytes(source: str | Path | BinaryIO, label: object) -> bytes:
    try:
        if isinstance(source, (str, Path)):
            return Path(source).read_bytes()
        return source.read()
    except OSError as e:
        raise ValueError(f"{label}: not a readable WAV file ({e})") from e


def _chunks(data: bytes, label: object) -> tuple[bytes, bytes]:
    """The `fmt ` and `data` chunk bodies of a RIFF/WAVE file (a data chunk whose size runs past the end of the
    file, as written by a streaming encoder or cut short, is what is there)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        kind = {b"RF64": "an RF64 (over 4 GB) file", b"RIFX": "a big-endian RIFX file"}.get(data[:4])
        raise ValueError(f"{label}: {kind or 'not a RIFF/WAVE file'}; WAV audio (RIFF, little-endian) is expected")
    fmt = body = None
    at = 12
    while at + 8 <= len(data) and (fmt is None or body is None):
        name, size = struct.unpack_from("<4sI", data, at)
        content = data[at + 8:at + 8 + size]
        if name == b"fmt " and fmt is None:
            fmt = content
        elif name == b"data" and body is None:
            body = content
        at += 8 + size + (size & 1)  # chunks are padded to an even length
    if fmt is None:
        raise ValueError(f"{label}: the WAV file has no 'fmt ' chunk")
    if body is None:
        raise ValueError(f"{label}: the WAV file has no 'data' chunk")
    return fmt, body


def _format(fmt: bytes, label: object) -> tuple[str, int, int, int]:
    """`(kind "pcm" | "float", channels, sample_rate, bytes per sample)` of a `fmt ` chunk."""
    if len(fmt) < 16:
        raise ValueError(f"{label}: the WAV 'fmt ' chunk is {len(fmt)} bytes, shorter than the 16 it needs")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _EXTENSIBLE:
        if len(fmt) < 40:
            raise ValueError(f"{label}: a WAVE_FORMAT_EXTENSIBLE 'fmt ' chunk needs 40 bytes, this one has {len(fmt)}")
        guid = fmt[24:40]
        if guid[4:] != _GUID_TAIL or struct.unpack_from("<I", guid)[0] not in (_PCM, _FLOAT):
            known = _FORMAT_NAMES.get(struct.unpack_from("<I", guid)[0]) if guid[4:] == _GUID_TAIL else None
            raise ValueError(f"{label}: WAVE_FORMAT_EXTENSIBLE sub-format {known or uuid.UUID(bytes_le=guid)} is "
                             "not supported (only PCM and IEEE float samples); convert the file to PCM WAV")
        tag = struct.unpack_from("<I", guid)[0]
    elif tag not in (_PCM, _FLOAT):
        name = _FORMAT_NAMES.get(tag, f"format tag {tag:#06x}")
        raise ValueError(f"{label}: {name} WAV audio is not supported (only PCM and IEEE float samples); convert "
                         "the file to PCM WAV")
    if channels < 1 or block_align == 0 or block_align % channels:
        raise ValueError(f"{label}: malformed WAV format ({channels} channel(s), {block_align}-byte frames)")
    width = block_align // channels
    if bits > 8 * width or bits == 0:
        raise ValueError(f"{label}: malformed WAV format ({bits}-bit samples in {width}-byte containers)")
    kind = "pcm" if tag == _PCM else "float"
    if (kind == "pcm" and width not in (1, 2, 3, 4)) or (kind == "float" and width not in (4, 8)):
        raise ValueError(f"{label}: {8 * width}-bit {'PCM' if kind == 'pcm' else 'float'} samples are not supported "
                         "(8/16/24/32-bit PCM, 32/64-bit float)")
    return kind, channels, rate, width


def _samples(body: bytes, kind: str, width: int) -> np.ndarray:
    """Interleaved samples as float32 in [-1, 1) (PCM) or as stored (float)."""
    if kind == "float":
        return np.frombuffer(body, "<f4" if width == 4 else "<f8").astype(np.float32)
    if width == 1:
        return (np.frombuffer(body, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 3:  # 24-bit: each sample into the top 3 bytes of an int32, then an arithmetic shift sign-extends it
        wide = np.zeros((len(body) // 3, 4), np.uint8)
        wide[:, 1:] = np.frombuffer(body, np.uint8).reshape(-1, 3)
        values = wide.view("<i4")[:, 0] >> 8
    else:
        values = np.frombuffer(body, "<i2" if width == 2 else "<i4")
    return values.astype(np.float32) / float(2 ** (8 * width - 1))


def read_wav(source: str | Path | BinaryIO, *, widths: tuple[int, ...] = (1, 2, 3, 4, 8)) -> tuple[np.ndarray, int]:
    """`(pcm [samples] float32 mono, sample_rate)` of a WAV file (a path or a binary file object; channels averaged).

    Reads integer PCM (8-bit unsigned, 16/24/32-bit signed, scaled to [-1, 1)) and IEEE float (32/64-bit, as
    stored), in the plain or the WAVE_FORMAT_EXTENSIBLE layout (see the module docstring). A trailing partial frame is
    dropped.

    Args:
        source: a path, or a binary file object positioned at the start of the file.
        widths: the sample sizes in bytes accepted (e.g. `(2,)` for 16-bit PCM only).

    Raises:
        ValueError: naming the source: not a RIFF/WAVE file, a compressed or unknown format or sub-format, a sample
            size outside `widths`, a sample rate outside [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE], NaN or infinite float
            samples.
    """
    label = source if isinstance(source, (str, Path)) else "the WAV data"
    fmt, body = _chunks(_read_bytes(source, label), label)
    kind, channels, rate, width = _format(fmt, label)
    rate = check_sample_rate(rate, f"{label}: the sample rate")
    if width not in widths:
        bits = ", ".join(str(8 * w) for w in widths)
        raise ValueError(f"{label}: {8 * width}-bit samples are not supported here ({bits}-bit only)")
    frame = channels * width
    samples = _samples(body[:len(body) - len(body) % frame], kind, width)
    if kind == "float" and not np.isfinite(samples).all():
        raise ValueError(f"{label}: the WAV file holds NaN or infinite float samples")
    return samples.reshape(-1, channels).mean(axis=1, dtype=np.float32), rate


def pcm16(pcm: np.ndarray) -> np.ndarray:
    """Float PCM in [-1, 1] as little-endian int16: times 32767, rounded, clipped to the int16 range."""
    return np.clip(np.round(np.asarray(pcm, np.float32) * 32767.0), -32768, 32767).astype("<i2")


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """A WAV file (plain PCM, tag 1) of int16 mono `samples` at `sample_rate`."""
    data = np.asarray(samples, "<i2").tobytes()
    rate = check_sample_rate(sample_rate)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    riff = struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data))
    return b"RIFF" + riff + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack(
        "<I", len(data)) + data


__all__ = ["MAX_SAMPLE_RATE", "MIN_SAMPLE_RATE", "check_sample_rate", "pcm16", "read_wav", "resample", "wav_bytes"]
