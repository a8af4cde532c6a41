"""What `omnijax.Chat` and the server feed, per model family: text turns, media units and answer continuations as
`Chunk`s. `units_for(model)` returns the builder of the model's family (`Family.chat_units`); each family's
builder lives in its own folder (`omnijax/models/<family>/frontend.py`).

Every chunk is padded to a bucket length (`bucket`: 16, 32, 64, ... tokens), so a conversation compiles one step
per bucket rather than one per message length. When the model has encoders every chunk carries embeddings (zeros
on text), so text and media chunks of one bucket share a program.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from omnijax.chunks.chunk import Chunk, pad_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.media import video as video_lib
from omnijax.models.family import OmniModel, family_of


class FrontendError(ValueError):
    """Base class of the errors raised while turning media into chunks (beside the validators' own classes)."""


class MissingEncoderError(FrontendError):
    """The loaded checkpoint has no encoder for the given modality."""


MIN_BUCKET = 16


def bucket(length: int) -> int:
    """The padded length of a chunk of `length` tokens: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, int(length) - 1).bit_length())


def require_encoder(model: OmniModel, kind: str) -> None:
    """Refuses media for a checkpoint without the `kind` ("audio" or "vision") encoder, naming the fix."""
    if getattr(model, kind, None) is None:
        source = model.source
        where = f" ({source})" if source else ""
        raise MissingEncoderError(f"this checkpoint{where} has no {kind} encoder, so it cannot take "
                                  f"{'images or video' if kind == 'vision' else 'audio'}; convert a checkpoint "
                                  f"with its {kind} tower")


class ChatUnits(abc.ABC):
    """What every family's unit builder shares: padding to a bucket, continuation chunks, the embedding width.

    A family subclasses it with `text(ids, unit, kind, answer_tokens)`, `image(image, unit)`, `audio(pcm,
    sample_rate, unit)` and `av(frames, pcm, unit, **video_kwargs)`, each returning a batch-1 `Chunk`.
    """

    unit_seconds: float
    fps: float
    temporal_patch_size: int

    def __init__(self, model: OmniModel):
        self.model = model
        config = model.config
        self.axes = config.position_axes
        has_encoders = model.audio is not None or model.vision is not None
        self.hidden_size = config.hidden_size if has_encoders else None

    def pad(self, chunk: Chunk) -> Chunk:
        return pad_chunk(chunk, bucket(chunk.length))

    levels = 0  # DeepStack levels every chunk carries

    def continuation(self, unit: int, answer_tokens: int) -> Chunk:
        """A chunk without tokens that asks for `answer_tokens` more tokens of the answer unit `unit`."""
        embeds = None if self.hidden_size is None else np.zeros((1, 1, self.hidden_size), np.float32)
        deepstack = np.zeros((self.levels, 1, 1, cast(int, self.hidden_size)), np.float32) if self.levels else None
        return Chunk(token_ids=np.zeros((1, 1), np.int32), valid=np.zeros((1, 1), bool),
                     positions=np.zeros((self.axes, 1, 1), np.int32), unit=np.full((1, 1), unit, np.int32),
                     span=np.full((1, 1), int(SpanKind.RESPONSE), np.int32), offset=np.zeros((1, 1), np.int32),
                     answer_tokens=np.asarray([answer_tokens], np.int32), answer_unit=np.asarray([unit], np.int32),
                     advance=np.zeros((1,), np.int32), embeds=embeds,
                     embed_mask=None if embeds is None else np.zeros((1, 1), bool), deepstack=deepstack)

    @property
    @abc.abstractmethod
    def chat_markers(self) -> tuple[int, int]:
        """The ids of the chat template's turn markers `<|im_start|>`, `<|im_end|>` in this checkpoint."""

    @abc.abstractmethod
    def text(self, ids: Sequence[int], unit: int, kind: SpanKind, answer_tokens: int = 0) -> Chunk:
        """A text unit of token `ids` (a system prompt, a user turn or a response, by `kind`)."""

    @abc.abstractmethod
    def image(self, image: np.ndarray, unit: int) -> Chunk:
        """An image unit of one `[H, W, 3]` image."""

    @abc.abstractmethod
    def audio(self, pcm: np.ndarray, sample_rate: int, unit: int) -> Chunk:
        """An audio unit of `[samples]` PCM at `sample_rate`."""

    @abc.abstractmethod
    def av(self, frames: np.ndarray, pcm: np.ndarray, unit: int, **video_kwargs: Any) -> Chunk:
        """An audiovisual unit of `[n, H, W, 3]` frames and the PCM heard with them."""

    def open_video(self, path: str | Path, *, need_audio: bool = True) -> video_lib.VideoFile:
        """A video file cut into this family's audiovisual units (`omnijax.media.video.open_video`), checked up
        front; `need_audio=False` takes a file without sound (its units carry silence)."""
        return video_lib.open_video(path, unit_seconds=self.unit_seconds, fps=self.fps, need_audio=need_audio,
                                    temporal_patch_size=self.temporal_patch_size)

    def frames_of(self, frames: npt.ArrayLike) -> np.ndarray:
        frames = np.asarray(frames)
        if frames.ndim == 3:
            frames = frames[None]
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be [n, H, W, 3] (or one [H, W, 3] frame), got shape {frames.shape}")
        return frames


def units_for(model: OmniModel) -> ChatUnits:
    """The unit builder of the model's family (a bare decoder has no family and takes token ids only)."""
    family = family_of(model)
    if family is None:
        raise TypeError(f"units_for needs a loaded model (omnijax.load), got {type(model).__name__}")
    return family.chat_units(model)
