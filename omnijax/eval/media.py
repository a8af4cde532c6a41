"""Text and media for the harness: a `TextEncoder` protocol, and each video's 2 s units of frames plus audio.

Text: `text_encoder(checkpoint_dir, vocab_size)` returns the converted checkpoint's tokenizer
(`omnijax.models.tokenizer`, what `omnijax.load` attaches as `model.tokenizer`) when it has tokenizer files, else
`ByteTextEncoder`: UTF-8 bytes folded into the vocabulary, deterministic, for checkpoints without a tokenizer.

Media: `open_media` decodes a real video file when the file and PyAV (`pip install av`) exist, through
`omnijax.media.video` (the one place video files are decoded: frames sampled at `fps` by its rule and resized to
`frame_size`, audio resampled to 16 kHz mono). Otherwise it falls back to `SyntheticMedia` (moving shapes and a tone
from `omnijax.models.qwen2_5_omni.frontend`, seeded by the video path) and says why in `source.notice`. A last
partial unit is completed by repeating the last frame and with silence.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import numpy as np

from omnijax.media.video import open_video
from omnijax.models.qwen2_5_omni import frontend
from omnijax.models.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from omnijax.media.video import VideoFile
    from omnijax.models.tokenizer import Tokenizer

QWEN_SPECIALS = {"<|im_start|>": 151644, "<|im_end|>": 151645}


class TextEncoder(Protocol):
    """What the harness needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids."""

    def special(self, token: str) -> int:
        """Id of a chat marker such as `<|im_start|>`."""

    def letter_id(self, letter: str) -> int:
        """The single id an option letter ("A") is scored and generated as."""


@dataclasses.dataclass(frozen=True)
class ByteTextEncoder:
    """UTF-8 bytes folded into `[0, vocab_size)` (`byte % vocab_size`); chat markers keep Qwen's ids when the
    vocabulary holds them, else are folded the same way. Decoding maps ids below 256 back to bytes."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def special(self, token: str) -> int:
        if token not in QWEN_SPECIALS:
            raise KeyError(f"unknown special token {token!r}; known: {sorted(QWEN_SPECIALS)}")
        return QWEN_SPECIALS[token] % self.vocab_size

    def letter_id(self, letter: str) -> int:
        return self.encode(letter)[0]


class CheckpointTextEncoder:
    """A checkpoint's `omnijax.models.tokenizer.Tokenizer` behind the `TextEncoder` protocol."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def special(self, token: str) -> int:
        return self.tokenizer.token_id(token)

    def letter_id(self, letter: str) -> int:
        ids = self.encode(letter)
        if len(ids) != 1:
            raise ValueError(f"option letter {letter!r} is {len(ids)} tokens for this tokenizer; want one")
        return ids[0]


def text_encoder(checkpoint_dir: str | Path | None, vocab_size: int, notices: list[str] | None = None) -> TextEncoder:
    """The checkpoint's tokenizer when it has tokenizer files, else a `ByteTextEncoder` (with a notice saying why)."""
    notices = [] if notices is None else notices
    directory = None if checkpoint_dir is None else Path(checkpoint_dir)
    tokenizer = None if directory is None else load_tokenizer(directory)
    if tokenizer is not None:
        return CheckpointTextEncoder(tokenizer, vocab_size)
    why = "no checkpoint directory" if directory is None else f"no tokenizer files in {directory}"
    notices.append(f"text: {why}; using ByteTextEncoder (UTF-8 bytes folded into the {vocab_size}-token vocabulary)")
    return ByteTextEncoder(vocab_size)


class MediaSource(Protocol):
    """A video's units: `units(count)` yields `count` pairs `(frames [n, H, W, 3] uint8, pcm [samples] float32)`."""

    duration_s: float | None
    kind: str
    notice: str

    def units(self, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        ...


@dataclasses.dataclass
class SyntheticMedia:
    """Moving coloured shapes and a tone, deterministic for a seed; no duration of its own."""

    seed: int
    unit_seconds: float = 2.0
    fps: float = 2.0
    frame_size: tuple[int, int] = (56, 84)
    notice: str = ""
    kind: str = "synthetic"
    duration_s: float | None = None

    def units(self, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        h, w = self.frame_size
        for k in range(count):
            start = k * self.unit_seconds
            frames = frontend.synthetic_frames(self.unit_seconds, self.fps, h, w, seed=self.seed, start=start)
            pcm = frontend.tone(self.unit_seconds, 220.0 * (1 + self.seed % 4), seed=self.seed + k, start=start)
            yield frames, pcm


@dataclasses.dataclass
class DecodedVideo:
    """A video file decoded unit by unit through `omnijax.media.video` (frames sampled at `fps` by its rule and resized
    to `frame_size`, audio at 16 kHz mono; a file without audio gives silence). `units(count)` yields `count` units:
    the file's own (a partial last one completed by repeating the last frame, with silence), then, past the end of
    the file, further units of the last frame and silence."""

    path: Path
    unit_seconds: float = 2.0
    fps: float = 2.0
    frame_size: tuple[int, int] = (252, 448)
    notice: str = ""
    kind: str = "video file"
    duration_s: float | None = None
    video: "VideoFile | None" = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        self.video = open_video(self.path, unit_seconds=self.unit_seconds, fps=self.fps, need_audio=False,
                                frame_size=tuple(self.frame_size))
        self.duration_s = self.video.duration_s

    def units(self, count: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        decoded = self.video.units()
        frames = None
        try:
            for _ in range(count):
                unit = next(decoded, None)
                if unit is None:  # past the end of the file
                    frames = np.repeat(frames[-1:], self.video.frames_per_unit, axis=0)
                    unit = (frames, np.zeros(self.video.samples_per_unit, np.float32))
                frames = unit[0]
                yield unit
        finally:
            decoded.close()


def open_media(video_root: str | Path | None, video_path: str, *, unit_seconds: float = 2.0, fps: float = 2.0,
               frame_size: tuple[int, int] | None = None, synthetic_size: tuple[int, int] = (56, 84)) -> MediaSource:
    """The video's decoded file when it and PyAV exist, else synthetic media with a notice saying why."""
    path = None if video_root is None else Path(video_root) / video_path
    if path is not None and path.is_file() and importlib.util.find_spec("av") is not None:
        return DecodedVideo(path, unit_seconds, fps, frame_size or (252, 448))
    if path is None:
        why = "no video root given"
    elif not path.is_file():
        why = f"{path} not found"
    else:
        why = "PyAV is not installed (pip install av)"
    seed = zlib.crc32(video_path.encode("utf-8")) % (2 ** 31)
    return SyntheticMedia(seed, unit_seconds, fps, frame_size or synthetic_size,
                          notice=f"{video_path}: {why}; using synthetic frames and a tone")


__all__ = ["ByteTextEncoder", "DecodedVideo", "CheckpointTextEncoder", "MediaSource", "QWEN_SPECIALS", "SyntheticMedia",
           "TextEncoder", "open_media", "text_encoder"]
