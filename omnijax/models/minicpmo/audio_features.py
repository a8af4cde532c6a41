"""MiniCPM-o 4.5 log-mel features (80 bins, 100 frames per second), computed in numpy.

Offline (`log_mel`): what the release's `MiniCPMOProcessor.process_audio` feeds the audio encoder. Its
`MiniCPMAAudioProcessor` is a `WhisperFeatureExtractor(feature_size=80)`: the clip is padded on the right with zeros
to 30 s, centred 400-point periodic-Hann STFT (reflect padding of 200 samples on both sides), hop 160, power
spectrum, slaney mel filters over 0-8 kHz, the last STFT frame dropped, `log10(max(mel, 1e-10))`, a dynamic floor
at (maximum over the whole padded clip) - 8, then `(x + 4) / 4`; the result is cut back to `ceil(samples / 160)`
frames. Clips longer than 30 s are split by the processor into 30 s pieces, each its own clip (`log_mel_clips`).

Streaming (`mel_stream_step`): what the 4.5 duplex path feeds the streaming encoder, one chunk per call. Two
pieces of the release are reproduced together:
- the duplex driver (`MiniCPMODuplex.streaming_prefill`) keeps the received samples not yet consumed; before the
  first chunk it left-pads them with zeros up to `first_chunk_ms` (1035 ms = 16560 samples), then hands the mel
  processor `get_streaming_chunk_size()` samples per chunk (16480 for the first: 1035 ms aligned down to the hop;
  16000 after) and drops the consumed samples;
- the mel processor (`StreamingMelProcessorExact`) appends them to a buffer (slid left by 10 s whenever it reaches
  30 s), recomputes the log-mel of the whole buffer without the 30 s padding (so the right edge is a reflection),
  and emits global frames `[next - r, next + 100 + r)` (r = 2 frames = `cnn_redundancy_ms` 20 ms of context on
  each side, none before frame 0), then advances `next` by 100. All emitted frames are "stable": their window ends
  inside the buffer, so the right-edge reflection never reaches them. The log floor is fixed at -10 (a no-op after
  the 1e-10 clamp) while the buffer is shorter than 5 s and the dynamic `max - 8` of the whole buffer after.

Reference quirk kept out of this module: the release's offline and streaming extractors are one object, and the
streaming processor switches it to the fixed floor in place, so an offline `process_audio` call made after a
streaming chunk of a short buffer uses the fixed floor instead of the dynamic one. `log_mel` always computes the
dynamic floor (what a fresh processor does, and what the duplex reference-audio prefill uses before streaming).

Numerics: computed in float64 and rounded to float32. The reference computes the STFT in float32 (torch), so the two
differ by float32 rounding noise: about 1e-6 typically, at most a few 1e-5 in low-energy bins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from omnijax.models.encoders.log_mel import (
    AudioInputError,
    FeatureShapeError,
    InvalidPcmError,
    UnsupportedSampleRateError,
    check_pcm_layout,
    finite_float32,
    mel_filters,
)

__all__ = ["AudioInputError", "AudioTooShortError", "DUPLEX_MEL_STREAM", "FeatureShapeError", "HOP_LENGTH",
           "InvalidPcmError", "MAX_CLIP_SAMPLES", "MelChunk", "MelStreamConfig", "MelStreamState", "NUM_MEL_BINS",
           "N_FFT", "SAMPLE_RATE", "UnsupportedSampleRateError", "log_mel", "log_mel_clips", "mel_filters",
           "mel_stream_start", "mel_stream_step", "num_frames", "pad_features"]

SAMPLE_RATE = 16000
HOP_LENGTH = 160
N_FFT = 400
NUM_MEL_BINS = 80
MAX_CLIP_SAMPLES = 30 * SAMPLE_RATE  # the processor pads to (and splits at) 30 s
_MEL_FLOOR = 1e-10
_DYNAMIC_RANGE = 8.0  # log10 decades kept below the maximum (the "max - 8 dB" of the release)
_FIXED_FLOOR = -10.0  # log10 floor of the streaming extractor on short buffers
_DYNAMIC_MIN_SAMPLES = 5 * SAMPLE_RATE  # streaming buffers of at least 5 s use the dynamic floor


class AudioTooShortError(AudioInputError):
    """The PCM is shorter than one mel frame (160 samples, 10 ms)."""


def num_frames(num_samples: int) -> int:
    """Mel frames the processor keeps for a clip of `num_samples` samples: `ceil(num_samples / 160)`."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
        raise ValueError(f"num_samples must be a non-negative integer, got {num_samples!r}")
    return -(-int(num_samples) // HOP_LENGTH)


def _check_pcm(pcm, sample_rate, *, min_samples: int = HOP_LENGTH) -> np.ndarray:
    pcm = check_pcm_layout(pcm, sample_rate)
    if pcm.size < min_samples:
        raise AudioTooShortError(
            f"audio has {pcm.size} sample(s) ({1000.0 * pcm.size / SAMPLE_RATE:.2f} ms); at least {min_samples} "
            f"samples ({1000.0 * min_samples / SAMPLE_RATE:g} ms, one mel frame) are needed")
    return finite_float32(pcm)


def _log10_mel(signal: np.ndarray, frames: int) -> np.ndarray:
    """`log10(max(mel, 1e-10))` of the first `frames` centred STFT frames of `signal` (reflect-padded by 200 on both
    sides, as `torch.stft(center=True)` does), `[frames, 80]` float64."""
    padded = np.pad(signal.astype(np.float64), N_FFT // 2, mode="reflect")
    views = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH][:frames]
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic hann
    spectrum = np.fft.rfft(views * window, axis=-1)
    power = spectrum.real ** 2 + spectrum.imag ** 2
    return np.log10(np.maximum(power @ mel_filters(NUM_MEL_BINS), _MEL_FLOOR))


def log_mel(pcm: npt.ArrayLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Log-mel features of one clip of at most 30 s, as `MiniCPMOProcessor.process_audio` computes them.

    Args:
        pcm: `[samples]` float samples (nominally in [-1, 1]), 160 <= samples <= 480000.
        sample_rate: must be 16000.

    Returns:
        `[80, ceil(samples / 160)]` float32 features.

    Raises:
        UnsupportedSampleRateError: `sample_rate` is not 16000.
        AudioTooShortError: fewer than 160 samples (one 10 ms mel frame).
        InvalidPcmError: `pcm` is not 1D, not floating point, holds NaN/inf, or is longer than 30 s (split it with
            `log_mel_clips`, as the processor does).
    """
    pcm = _check_pcm(pcm, sample_rate)
    n = pcm.size
    if n > MAX_CLIP_SAMPLES:
        raise InvalidPcmError(f"audio has {n} samples ({n / SAMPLE_RATE:.2f} s), over the 30 s of one clip; split "
                              f"it with log_mel_clips (the processor encodes each 30 s piece as its own clip)")
    signal = np.zeros(MAX_CLIP_SAMPLES, np.float32)
    signal[:n] = pcm
    # Frames past the audio (and its reflection) are silent: log10 = -10, never the maximum, so the dynamic floor
    # is the one of the frames overlapping the audio. The STFT of the padded clip has 3001 frames; the last is dropped.
    touching = min(MAX_CLIP_SAMPLES // HOP_LENGTH, (n + N_FFT // 2 - 1) // HOP_LENGTH + 1)
    log_spec = _log10_mel(signal, touching)
    floor = log_spec.max() - _DYNAMIC_RANGE
    feats = (np.maximum(log_spec[:num_frames(n)], floor) + 4.0) / 4.0
    return np.ascontiguousarray(feats.T, dtype=np.float32)


def log_mel_clips(pcm: npt.ArrayLike, sample_rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """Log-mel features of audio of any length, split into 30 s pieces as the processor splits it.

    Returns:
        one `[80, frames_i]` float32 array per 30 s piece (the last piece may be shorter; a trailing piece shorter
        than one mel frame raises, as `log_mel` does).
    """
    pcm = _check_pcm(pcm, sample_rate)
    return [log_mel(pcm[i:i + MAX_CLIP_SAMPLES]) for i in range(0, pcm.size, MAX_CLIP_SAMPLES)]


def pad_features(clips: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pads `[80, T_i]` features on the right with zeros into one batch, as the processor does.

    Returns:
        `(features [B, 80, max T_i] float32, lengths [B] int64)`.
    """
    clips = [np.asarray(c, np.float32) for c in clips]
    if not clips:
        raise FeatureShapeError("no audio clips given")
    for i, c in enumerate(clips):
        if c.ndim != 2 or c.shape[0] != NUM_MEL_BINS:
            raise FeatureShapeError(f"clip {i}: features must be [{NUM_MEL_BINS}, frames], got shape {c.shape}")
        if c.shape[1] == 0:
            raise FeatureShapeError(f"clip {i} has no mel frames")
    lengths = np.array([c.shape[1] for c in clips], np.int64)
    out = np.zeros((len(clips), NUM_MEL_BINS, int(lengths.max())), np.float32)
    for i, c in enumerate(clips):
        out[i, :, :c.shape[1]] = c
    return out, lengths


# ------------------------------------------------------------------------------------------------------ streaming


@dataclasses.dataclass(frozen=True)
class MelStreamConfig:
    """Chunking of the duplex audio stream (the release's `MiniCPMODuplex` settings by default).

    Attributes:
        chunk_ms: audio per chunk after the first (100 new mel frames per 1000 ms).
        first_chunk_ms: the first chunk's length; received audio shorter than it is left-padded with zeros.
        cnn_redundancy_ms: context emitted on each side of a chunk's new frames (20 ms = 2 frames).
        slide_trigger_s: the mel buffer is slid left once it holds this much audio.
        slide_stride_s: how much it is slid by.
        extra_frames: the prefix (after the first chunk) and suffix extra-frame counts the duplex driver passes to
            the encoder (2 and 2; prefix 0 for the first chunk).
    """

    chunk_ms: int = 1000
    first_chunk_ms: int = 1035
    cnn_redundancy_ms: int = 20
    slide_trigger_s: float = 30.0
    slide_stride_s: float = 10.0
    extra_frames: int = 2

    def __post_init__(self):
        if self.chunk_ms < 10 or self.first_chunk_ms < 10 or self.cnn_redundancy_ms < 0 or self.extra_frames < 0:
            raise ValueError(f"invalid MelStreamConfig {self}")
        if self.slide_stride_s <= 0 or self.slide_trigger_s <= 0:
            raise ValueError("slide_trigger_s and slide_stride_s must be positive")
        if self.chunk_samples % HOP_LENGTH:
            raise ValueError(f"chunk_ms={self.chunk_ms} is not a whole number of 10 ms hops")
        # Every chunk's last emitted frame must be stable (its window inside the buffer) when the chunk arrives.
        # Later chunks add `chunk_frames` stable frames each, so checking the first is enough.
        first_stable = (self.first_chunk_samples - N_FFT // 2) // HOP_LENGTH + 1
        if first_stable < self.chunk_frames + self.redundancy_frames:
            raise ValueError(f"first_chunk_ms={self.first_chunk_ms} leaves too little right context for "
                             f"{self.chunk_frames} frames plus {self.redundancy_frames} of redundancy")

    @property
    def chunk_samples(self) -> int:
        return int(round(self.chunk_ms * SAMPLE_RATE / 1000))

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // HOP_LENGTH

    @property
    def first_chunk_samples(self) -> int:
        """Samples of the first chunk: `first_chunk_ms` aligned down to the hop (16480 for 1035 ms)."""
        raw = int(round(self.first_chunk_ms * SAMPLE_RATE / 1000))
        return max(HOP_LENGTH, raw // HOP_LENGTH * HOP_LENGTH)

    @property
    def first_pad_to(self) -> int:
        """The first chunk's received audio is left-padded with zeros up to this many samples (16560)."""
        return int(self.first_chunk_ms * SAMPLE_RATE / 1000)

    @property
    def first_consumed(self) -> int:
        """Samples the driver drops after the first chunk (via whole milliseconds, as the release computes it)."""
        return int(int(self.first_chunk_samples / SAMPLE_RATE * 1000.0) * SAMPLE_RATE / 1000)

    @property
    def redundancy_frames(self) -> int:
        return max(0, int(self.cnn_redundancy_ms * SAMPLE_RATE / 1000) // HOP_LENGTH)


DUPLEX_MEL_STREAM = MelStreamConfig()


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, np.float32)
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True)
class MelStreamState:
    """Immutable state of the streaming features; each `mel_stream_step` returns a new one.

    Attributes:
        pending: received samples not yet consumed by a chunk (the duplex driver's buffer).
        window: samples the mel processor holds (its sliding buffer).
        base_frame: global mel frame index of `window`'s frame 0 (advances when the window slides).
        next_frame: global index of the first new frame of the next chunk.
        chunk_index: chunks emitted so far.
    """

    pending: np.ndarray
    window: np.ndarray
    base_frame: int = 0
    next_frame: int = 0
    chunk_index: int = 0


class MelChunk(NamedTuple):
    """One emitted chunk: features plus what the streaming encoder needs to know about them."""

    features: np.ndarray  # [80, frames] float32
    prefix_extra_frames: int  # context frames before the new ones, as the duplex driver declares them
    suffix_extra_frames: int  # context frames after the new ones
    index: int  # chunk number (0 first)
    start_frame: int  # global mel frame index of features[:, 0]


def mel_stream_start() -> MelStreamState:
    """An empty stream."""
    return MelStreamState(pending=_frozen(np.zeros(0)), window=_frozen(np.zeros(0)))


def _slide(window: np.ndarray, base_frame: int, config: MelStreamConfig) -> tuple[np.ndarray, int]:
    """The mel processor's trigger-mode sliding window."""
    n = window.size
    trigger = int(config.slide_trigger_s * SAMPLE_RATE)
    if n < trigger:
        return window, base_frame
    stride = int(config.slide_stride_s * SAMPLE_RATE)
    guard = min(SAMPLE_RATE, n - stride)  # keep at least 1 s
    drop = min(stride, max(0, n - guard)) // HOP_LENGTH * HOP_LENGTH
    if drop <= 0:
        return window, base_frame
    return window[drop:], base_frame + drop // HOP_LENGTH


def _window_log_mel(window: np.ndarray) -> np.ndarray:
    """The processor's features of the whole buffer (no 30 s padding): `[80, len // 160]` float64."""
    frames = window.size // HOP_LENGTH  # 1 + len // hop STFT frames, the last dropped
    log_spec = _log10_mel(window, frames)
    if window.size < _DYNAMIC_MIN_SAMPLES:
        log_spec = np.maximum(log_spec, _FIXED_FLOOR)
    else:
        log_spec = np.maximum(log_spec, log_spec.max() - _DYNAMIC_RANGE)
    return ((log_spec + 4.0) / 4.0).T


def mel_stream_step(state: MelStreamState, pcm: npt.ArrayLike, config: MelStreamConfig = DUPLEX_MEL_STREAM,
                    sample_rate: int = SAMPLE_RATE) -> tuple[MelChunk | None, MelStreamState]:
    """Receives `pcm` and emits at most one chunk's features, as one duplex `streaming_prefill` call does.

    Args:
        state: the stream so far (`mel_stream_start()` for a new one).
        pcm: newly received `[samples]` float samples (may be empty).
        config: chunking settings.

    Returns:
        `(chunk, new_state)`; `chunk` is None when fewer samples than the next chunk needs have arrived (they stay
        pending). One call consumes at most one chunk, like the release; call again with empty `pcm` to drain a
        backlog.

    Raises:
        UnsupportedSampleRateError / InvalidPcmError: as `log_mel`.
    """
    pcm = _check_pcm(pcm, sample_rate, min_samples=0)
    pending = np.concatenate([state.pending, pcm])
    first = state.chunk_index == 0
    if first and pending.size < config.first_pad_to:
        pending = np.concatenate([np.zeros(config.first_pad_to - pending.size, np.float32), pending])
    need = config.first_chunk_samples if first else config.chunk_samples
    if pending.size < need:
        return None, dataclasses.replace(state, pending=_frozen(pending))
    window, base = _slide(np.concatenate([state.window, pending[:need]]), state.base_frame, config)
    mel = _window_log_mel(window)
    local_frames = mel.shape[1]
    stable = min(local_frames, (window.size - N_FFT // 2) // HOP_LENGTH + 1)
    r = config.redundancy_frames
    core_start, core_end = state.next_frame, state.next_frame + config.chunk_frames
    if base + stable < core_end + r:  # excluded by MelStreamConfig's checks
        raise AssertionError("streaming mel chunk is not stable")
    start = max(0, min(max(0, core_start - r) - base, local_frames))
    stop = max(start, min(core_end + r - base, local_frames))
    features = np.ascontiguousarray(mel[:, start:stop], dtype=np.float32)
    consumed = config.first_consumed if first else config.chunk_samples
    chunk = MelChunk(features=features, prefix_extra_frames=0 if first else config.extra_frames,
                     suffix_extra_frames=config.extra_frames, index=state.chunk_index, start_frame=base + start)
    return chunk, MelStreamState(pending=_frozen(pending[consumed:]), window=_frozen(window), base_frame=base,
                                 next_frame=core_end, chunk_index=state.chunk_index + 1)
