"""Video files -> the model's streaming units: `(frames, pcm)` per unit, decoded lazily with PyAV.

    video = open_video("talk.mp4")                       # 2 s units, frames at 2 fps (Qwen2.5-Omni)
    for k, (frames, pcm) in enumerate(video.units()):    # frames [4, H, W, 3] uint8, pcm [32000] float32
        chunk = frontend.audiovisual_chunk(model, frames, pcm, unit=1 + k)

    open_video("talk.mp4", unit_seconds=1.0, fps=1.0, temporal_patch_size=1)   # MiniCPM-o: 1 frame + 1 s of audio

This is the one place where video files are decoded (`Chat.video`, `omnijax watch` and the StreamingBench
harness's `DecodedVideo` all read files through it). PyAV (`pip install av`, or the `video` extra) is imported only
when a file is opened, so the module imports without it.

Timeline. The video track defines it: native frame `i` (in decode order) is at `i / r` seconds, where `r` is the
stream's average frame rate, as in transformers' `read_video_pyav` (which also indexes decoded frames and takes
`average_rate` as the fps; a variable-frame-rate file is treated as if it ran at its average rate). The video lasts
`num_frames / r` seconds (the container's duration when the stream does not state its frame count). Unit `k` covers
`[k * unit_seconds, (k + 1) * unit_seconds)`: the native frames `first_k = ceil(k * U * r)` up to `first_{k+1}`.

Frame sampling (per unit). transformers' Qwen2.5-Omni video processor (`Qwen2VLVideoProcessor.sample_frames`, used
by `Qwen2_5OmniProcessor`) picks `n` frames out of a clip of `total` native frames at the indices
`floor(j * total / n)`, `j = 0 .. n-1` (`arange(0, total, total / n)`), with `n = total / r * fps` floored to a
multiple of `temporal_patch_size`. Each unit is treated as such a clip: the frames taken are
`first_k + floor(j * total_k / n)` with `total_k = first_{k+1} - first_k`, and `n = frames_per_unit`, the count
`frontend.expected_frames` derives from the unit's `unit_seconds * 16000` audio samples (`floor(unit_seconds * fps)`
floored to a multiple of `temporal_patch_size`: 4 for 2 s at 2 fps), which is what the processor samples from a clip
of exactly `unit_seconds`. Over a whole file whose units hold a whole number of native frames (10 fps, 2 s units)
this is the processor's selection for the whole file: frames 0, 5, 10, ... . Unlike the processor, `n` does not
drop to 2 when a 2 s clip of a 29.97 fps file holds 59 frames (59 / 29.97 * 2 < 4), and a source slower than `fps`
repeats frames instead of returning fewer. Frames keep their native resolution (the frontend's preprocessing
resizes them) unless `frame_size=(h, w)` is given, which rescales them with PyAV's `reformat`.

Audio. The first audio track is decoded and brought to 16 kHz float32 by PyAV's `AudioResampler` (FFmpeg's
swresample), channel by channel; mono is the mean of the channels, as `librosa.load(..., mono=True)` makes it
(transformers' `audio_utils.load_audio` with librosa). swresample's own stereo downmix would weight each channel
1/sqrt(2), 1.41x the mean. Unit `k` gets samples `[k * S, (k + 1) * S)`, `S = unit_seconds * 16000`;
an audio track that starts later than the video (`start_time`) is preceded by silence, one that starts earlier is
cut, and one shorter than the video is completed with silence. A file without an audio track is refused when
`need_audio=True` (the default): silence in its place would tell the model the scene was silent, so that has to be
asked for with `need_audio=False`, whose units then carry zeros (and the file's audio when it has some).

The last partial unit. With `tail="pad"` (default) a video whose length is not a whole number of units ends with a
unit completed to full length: the frames it would take past the end repeat the last decoded frame, and its audio
past the track's end is silence. Every unit therefore has the same shapes (`frames_per_unit` frames,
`samples_per_unit` samples: one compiled program for the whole session) and is accepted by
`frontend.audiovisual_chunk`. With `tail="drop"` a partial last unit is left out (`num_units` counts whole units).

A truncated file. A file cut short (a download or a copy that stopped, with its index at the front, as MP4 with
`faststart` has it) still states its full length, but its streams end early. `units()` notices when the video stream
ends more than half a second (and more than a frame) before the frame count or duration the file states (a smaller
gap is what an audio track a little longer than the video makes of the container's duration), and stops at the real
end instead of holding the last frame and silence for the rest: the unit in which the stream ended is the last one
(completed as above with `tail="pad"`, left out with `tail="drop"`), and a `TruncatedVideoWarning` names the file,
the stated and the decoded durations. An audio packet cut in two at the end of such a file ends the audio there; an
audio decoding error where the video goes on is a `VideoError` as before.

Memory. `units()` decodes as it goes: it holds the current unit's sampled frames, the last decoded frame and at most
about one unit of audio, whatever the length of the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np

__all__ = ["SAMPLE_RATE", "TAILS", "TruncatedVideoWarning", "VideoError", "VideoFile", "frames_per_unit", "open_video",
           "unit_frame_indices", "write_clip"]

SAMPLE_RATE = 16_000  # the audio encoders' rate
TAILS = ("pad", "drop")
_MEL_HOP = 160  # samples per log-mel frame at 16 kHz (frontend.expected_frames measures duration in these)
_EPS = 1e-6
# How much shorter than stated a video stream may decode before it counts as truncated: streams that state no length
# of their own take the container's, which an audio track a few frames longer than the video sets.
_SHORT_S = 0.5


class VideoError(ValueError):
    """A video file that cannot be read as asked: missing, not a video, without a video or audio track."""


class TruncatedVideoWarning(UserWarning):
    """A video file whose video stream ends before the length the file states (see "A truncated file")."""


def _import_av():
    try:
        import av  # optional (omnijax[video]): only video files need it
    except ImportError as e:
        raise ImportError("reading video files needs PyAV: pip install av (or pip install 'omnijax[video]')") from e
    return av


def _exact(value: float) -> Fraction:
    """The decimal a float was written as (2.0 -> 2, 0.1 -> 1/10), for exact unit boundaries."""
    return Fraction(repr(float(value)))


def frames_per_unit(unit_seconds: float, fps: float, temporal_patch_size: int = 2) -> int:
    """Frames a unit of `unit_seconds` of 16 kHz audio takes at `fps`: `frontend.expected_frames` of its samples
    (`floor(duration * fps)` floored to a multiple of `temporal_patch_size`, the duration measured in 10 ms log-mel
    frames). 0 when the unit is shorter than one temporal patch."""
    samples = int(round(unit_seconds * SAMPLE_RATE))
    mel_frames = -(-samples // _MEL_HOP)
    nominal = mel_frames * float(fps) / (SAMPLE_RATE // _MEL_HOP)
    return int(math.floor(nominal / temporal_patch_size + _EPS)) * temporal_patch_size


def unit_frame_indices(k: int, unit_seconds: float, native_fps: float | Fraction, count: int) -> list[int]:
    """Native frame indices (decode order) unit `k` samples: `first + floor(j * total / count)`, `j < count`, where
    the unit's clip holds native frames `first = ceil(k * unit_seconds * native_fps)` up to (excluding)
    `ceil((k + 1) * unit_seconds * native_fps)` and `total` is their number (see the module docstring). Indices past
    the end of the file stand for its last frame."""
    unit = _exact(unit_seconds)
    rate = native_fps if isinstance(native_fps, Fraction) else _exact(native_fps)
    first, stop = math.ceil(k * unit * rate), math.ceil((k + 1) * unit * rate)
    total = stop - first
    return [first + (j * total) // count for j in range(count)]


def _seconds(value, time_base) -> float:
    return 0.0 if value is None or time_base is None else float(value * time_base)


@dataclasses.dataclass(frozen=True)
class VideoFile:
    """An opened, validated video file (see `open_video`); `units()` decodes it.

    Attributes:
        path: the file.
        unit_seconds, fps, temporal_patch_size, tail, frame_size: as given to `open_video`.
        duration_s: the video track's duration in seconds.
        num_units: units `units()` yields.
        frames_per_unit: frames in every unit (`frontend.expected_frames` of `samples_per_unit`).
        samples_per_unit: 16 kHz samples in every unit.
        native_fps: the video stream's average frame rate.
        num_frames: native frames the stream declares (None when it does not say).
        width, height: native frame size in pixels.
        has_audio: whether the file has an audio track (if not, the units carry silence).
    """

    path: Path
    unit_seconds: float
    fps: float
    temporal_patch_size: int
    tail: str
    frame_size: tuple[int, int] | None
    duration_s: float
    num_units: int
    frames_per_unit: int
    samples_per_unit: int
    native_fps: Fraction
    num_frames: int | None
    width: int
    height: int
    has_audio: bool

    def frame_indices(self, k: int) -> list[int]:
        """Native frame indices unit `k` takes (indices past the last frame repeat it)."""
        return unit_frame_indices(k, self.unit_seconds, self.native_fps, self.frames_per_unit)

    def units(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yields `num_units` pairs `(frames [frames_per_unit, H, W, 3] uint8, pcm [samples_per_unit] float32)`,
        decoding as it goes (closing the generator closes the file); fewer, with a `TruncatedVideoWarning`, when the
        video stream ends early (see "A truncated file"). A decoding error raises `VideoError`."""
        av = _import_av()
        with contextlib.ExitStack() as files:
            frames = _FrameReader(files.enter_context(av.open(str(self.path))), self.frame_size)
            audio = None
            if self.has_audio:
                audio = _AudioReader(files.enter_context(av.open(str(self.path))))
            for k in range(self.num_units):
                first, stop = self._span(k)
                try:
                    frames.reach(first)
                    if self._short(frames) and first >= frames.count:
                        self._warn_truncated(frames, k)
                        return
                    picked = np.stack([frames.at(i) for i in self.frame_indices(k)])
                    frames.reach(stop - 1)  # is the unit's clip whole? (decodes what the next unit reads anyway)
                    pcm = (audio.take(self.samples_per_unit) if audio is not None
                           else np.zeros(self.samples_per_unit, np.float32))
                    if audio is not None and audio.error is not None and not audio.explained:
                        if self._video_goes_on(av, audio.seconds):  # damage, not the end of a cut file
                            raise audio.error
                        audio.explained = True  # the file ends about here: silence after, as past any track's end
                except av.FFmpegError as e:
                    raise VideoError(f"{self.path}: decoding unit {k} failed: {e.strerror or e}") from e
                if self._short(frames) and frames.count < stop:  # the stream ended inside this unit
                    if self.tail == "pad":
                        yield picked, pcm
                    self._warn_truncated(frames, k + (self.tail == "pad"))
                    return
                yield picked, pcm

    def _video_goes_on(self, av, seconds: float) -> bool:
        """Whether the video stream has a frame `2 * unit_seconds` past `seconds` of its timeline (read from a
        second handle on the file, seeking near `seconds`, so the units' decoding is not disturbed)."""
        try:
            with av.open(str(self.path)) as container:
                stream = container.streams.video[0]
                start = _seconds(stream.start_time, stream.time_base)
                if stream.time_base is not None:
                    container.seek(int((start + max(0.0, seconds - self.unit_seconds)) / stream.time_base),
                                   stream=stream)  # to the key frame at or before
                for frame in container.decode(stream):
                    if frame.time is not None and frame.time - start >= seconds + 2 * self.unit_seconds:
                        return True
        except av.FFmpegError:  # the video is damaged or cut there too
            return False
        return False

    def _span(self, k: int) -> tuple[int, int]:
        """Native frames `[first, stop)` of unit `k`'s clip."""
        unit = _exact(self.unit_seconds)
        return math.ceil(k * unit * self.native_fps), math.ceil((k + 1) * unit * self.native_fps)

    def _stated_frames(self) -> int:
        if self.num_frames is not None:
            return self.num_frames
        return int(math.floor(self.duration_s * self.native_fps + 1e-6))

    def _short(self, frames: "_FrameReader") -> bool:
        """Whether the video stream ended more than `_SHORT_S` (and more than one frame) before the length the file
        states."""
        slack = max(1, math.floor(_SHORT_S * self.native_fps))
        return frames.ended and frames.count < self._stated_frames() - slack

    def _warn_truncated(self, frames: "_FrameReader", yielded: int) -> None:
        decoded = frames.count / self.native_fps
        warnings.warn(f"{self.path}: the video stream ends after {float(decoded):.2f} s although the file states "
                      f"{self.duration_s:.2f} s (the file looks truncated); stopping at the decoded end after "
                      f"{yielded} of {self.num_units} units instead of holding the last frame and silence",
                      TruncatedVideoWarning, stacklevel=3)


class _FrameReader:
    """Decoded frames by increasing native index; converts only the frames asked for."""

    def __init__(self, container, frame_size: tuple[int, int] | None):
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        self._decoded = container.decode(stream)
        self._size = {} if frame_size is None else {"height": frame_size[0], "width": frame_size[1]}
        self._index, self._frame, self.ended = -1, None, False
        self._converted: tuple[int, np.ndarray] | None = None

    @property
    def count(self) -> int:
        """Frames decoded so far (all of them once `ended`)."""
        return self._index + 1

    def reach(self, index: int) -> None:
        """Decodes up to frame `index` (or the end of the stream), converting nothing."""
        while self._index < index and not self.ended:
            frame = next(self._decoded, None)
            if frame is None:
                self.ended = True
            else:
                self._index, self._frame = self._index + 1, frame

    def at(self, index: int) -> np.ndarray:
        """Frame `index` as `[H, W, 3]` uint8 RGB (the last frame when the file ends first). Indices must not
        decrease from call to call."""
        self.reach(index)
        if self._frame is None:
            raise VideoError("the video stream has no decodable frame")
        if self._converted is None or self._converted[0] != self._index:
            self._converted = (self._index, self._frame.to_ndarray(format="rgb24", **self._size))
        return self._converted[1]


class _AudioReader:
    """16 kHz mono float32 audio of the first audio track (the mean of its channels), on the video's timeline, taken
    in consecutive pieces. A decoding error ends the track and is kept in `error` (`units()` decides what it is)."""

    def __init__(self, container):
        av = _import_av()
        audio, video = container.streams.audio[0], container.streams.video[0]
        offset = _seconds(audio.start_time, audio.time_base) - _seconds(video.start_time, video.time_base)
        self._lead = int(round(offset * SAMPLE_RATE))  # > 0: silence first; < 0: samples to skip
        self._resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)  # the track's own channels
        self._decoded = container.decode(audio)
        self._pieces: list[np.ndarray] = [np.zeros(max(self._lead, 0), np.float32)]
        self._buffered = max(self._lead, 0)
        self._skip = max(-self._lead, 0)
        self._ended = False
        self._total = self._buffered  # samples on the video's timeline produced so far
        self._errors = av.FFmpegError
        self.error: Exception | None = None
        self.explained = False  # `error` is where a truncated file ends (`units()` found so)

    @property
    def seconds(self) -> float:
        """Seconds of the video's timeline the audio decoded so far reaches."""
        return self._total / SAMPLE_RATE

    def _resampled(self):
        try:
            frame = next(self._decoded, None)
        except self._errors as e:  # a damaged packet, or one cut in two at the end of a truncated file
            self.error, frame = e, None
        if frame is None:
            self._ended = True
        return self._resampler.resample(frame)  # None flushes the resampler

    def take(self, count: int) -> np.ndarray:
        """The next `count` samples (silence past the end of the track)."""
        while self._buffered < count and not self._ended:
            for out in self._resampled():
                piece = out.to_ndarray().mean(axis=0, dtype=np.float32)  # [channels, n] -> mono
                if self._skip:
                    cut = min(self._skip, piece.shape[0])
                    piece, self._skip = piece[cut:], self._skip - cut
                self._pieces.append(piece)
                self._buffered += piece.shape[0]
                self._total += piece.shape[0]
        data = np.concatenate(self._pieces) if len(self._pieces) != 1 else self._pieces[0]
        pcm = np.zeros(count, np.float32)
        pcm[:min(count, data.shape[0])] = data[:count]
        rest = data[count:]
        self._pieces, self._buffered = [rest], rest.shape[0]
        return pcm


def open_video(path: str | Path, *, unit_seconds: float = 2.0, fps: float = 2.0, need_audio: bool = True,
               frame_size: tuple[int, int] | None = None, temporal_patch_size: int = 2,
               tail: str = "pad") -> VideoFile:
    """Opens and validates a video file; nothing is decoded past its first frames until `VideoFile.units()`.

    Args:
        path: the file.
        unit_seconds: seconds per streaming unit (2 for Qwen2.5-Omni, 1 for MiniCPM-o); `unit_seconds * 16000`
            must be a whole number of samples.
        fps: frames per second sampled (2 is Qwen2.5-Omni's processor default).
        need_audio: refuse a file without an audio track (True); with False such a file's units carry silence.
        frame_size: `(height, width)` to rescale frames to; None keeps the native size.
        temporal_patch_size: frames per temporal patch of the vision encoder (2 for Qwen2.5-Omni; 1 for models
            that take single frames, such as MiniCPM-o); `frames_per_unit` is a multiple of it.
        tail: "pad" completes a partial last unit (repeating the last frame, with silence), "drop" leaves it out.

    Raises:
        ImportError: PyAV is not installed.
        VideoError: the file is missing or unreadable (PyAV's reason is quoted), has no video stream, has no
            audio track while `need_audio`, or is shorter than one unit with `tail="drop"`.
        ValueError: a bad argument (for instance a unit shorter than one temporal patch at `fps`).
    """
    if not unit_seconds > 0 or not fps > 0:
        raise ValueError(f"unit_seconds and fps must be positive, got unit_seconds={unit_seconds!r}, fps={fps!r}")
    samples = unit_seconds * SAMPLE_RATE
    if abs(samples - round(samples)) > _EPS:
        raise ValueError(f"unit_seconds={unit_seconds!r} is not a whole number of {SAMPLE_RATE} Hz samples")
    if isinstance(temporal_patch_size, bool) or not isinstance(temporal_patch_size, int) or temporal_patch_size < 1:
        raise ValueError(f"temporal_patch_size must be a positive integer, got {temporal_patch_size!r}")
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    if frame_size is not None:
        if len(frame_size) != 2 or not all(isinstance(s, (int, np.integer)) and s > 0 for s in frame_size):
            raise ValueError(f"frame_size must be (height, width) in positive pixels, got {frame_size!r}")
        frame_size = (int(frame_size[0]), int(frame_size[1]))
    per_unit = frames_per_unit(unit_seconds, fps, temporal_patch_size)
    if per_unit == 0:
        raise ValueError(f"a {unit_seconds:g} s unit at {fps:g} fps holds no whole temporal patch of "
                         f"{temporal_patch_size} frames; raise unit_seconds or fps (or pass temporal_patch_size=1 "
                         "for a model that takes single frames)")
    av = _import_av()
    path = Path(path)
    if not path.exists():
        raise VideoError(f"cannot open video {path}: no such file")
    if not path.is_file():
        raise VideoError(f"cannot open video {path}: not a file")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError(f"{path} has no video stream (streams: "
                                 f"{[s.type for s in container.streams] or 'none'})")
            stream = container.streams.video[0]
            has_audio = bool(container.streams.audio)
            if need_audio and not has_audio:
                raise VideoError(f"{path} has no audio track; an audiovisual unit needs the sound recorded with the "
                                 "frames. To feed silence with the frames instead, pass need_audio=False "
                                 "(Chat.video, open_video) or --silent-video (omnijax watch)")
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            if not rate:
                raise VideoError(f"{path}: the video stream states no frame rate")
            rate = Fraction(rate)
            num_frames = int(stream.frames) or None
            if num_frames is not None:
                duration = float(num_frames / rate)
            elif stream.duration is not None:
                duration = _seconds(stream.duration, stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
            else:
                raise VideoError(f"{path}: neither the video stream nor the container states a duration")
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            if next(container.decode(stream), None) is None:
                raise VideoError(f"{path}: the video stream has no decodable frame")
    except av.FFmpegError as e:
        raise VideoError(f"cannot read {path} as a video: {e.strerror or e}") from e
    unit = _exact(unit_seconds)
    if tail == "drop":
        count = int(math.floor(duration / unit_seconds + 1e-9))
        if count == 0:
            raise VideoError(f"{path} lasts {duration:.3f} s, less than one {unit_seconds:g} s unit; with "
                             "tail='drop' nothing is left (tail='pad' completes it)")
    elif num_frames is not None:  # units whose clip starts before the last frame
        count = math.ceil(num_frames / (unit * rate))
    else:
        count = max(1, int(math.ceil(duration / unit_seconds - 1e-9)))
    return VideoFile(path=path, unit_seconds=float(unit_seconds), fps=float(fps),
                     temporal_patch_size=temporal_patch_size, tail=tail, frame_size=frame_size, duration_s=duration,
                     num_units=count, frames_per_unit=per_unit, samples_per_unit=int(round(samples)),
                     native_fps=rate, num_frames=num_frames, width=width, height=height, has_audio=has_audio)


def write_clip(path: str | Path, frames: np.ndarray, fps: int, pcm: np.ndarray | None = None,
               sample_rate: int = SAMPLE_RATE) -> Path:
    """Writes frames (and audio) as an mp4 (MPEG-4 video, AAC audio) with PyAV, e.g. a synthetic clip for the demo.

    Args:
        path: the file to write.
        frames: `[n, H, W, 3]` uint8 frames shown at `fps` (H and W even).
        fps: frames per second (an int).
        pcm: optional float audio in [-1, 1] at `sample_rate`: `[samples]` (mono) or `[2, samples]` (stereo).
    """
    av = _import_av()
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[1] % 2 or \
            frames.shape[2] % 2:
        raise ValueError(f"frames must be [n, H, W, 3] uint8 with even H and W, got {frames.shape} {frames.dtype}")
    wave = None if pcm is None else np.asarray(pcm, np.float32)
    if wave is not None:
        wave = wave[None] if wave.ndim == 1 else wave
        if wave.ndim != 2 or wave.shape[0] not in (1, 2):
            raise ValueError(f"pcm must be [samples] or [2, samples], got shape {np.shape(pcm)}")
    layout = None if wave is None else ("mono", "stereo")[wave.shape[0] - 1]
    path = Path(path)
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=int(fps))
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if wave is not None:
            sound = container.add_stream("aac", rate=int(sample_rate))
            sound.layout = layout
        for frame in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        if wave is not None:
            for start in range(0, wave.shape[1], 1024):
                piece = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + 1024]), format="fltp",
                                                   layout=layout)
                piece.sample_rate = int(sample_rate)
                for packet in sound.encode(piece):
                    container.mux(packet)
        for stream in container.streams:
            for packet in stream.encode(None):
                container.mux(packet)
    return path
