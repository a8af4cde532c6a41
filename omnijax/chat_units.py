"""What `omnijax.Chat` feeds, per model family: text turns, media units and answer continuations as `Chunk`s.

`units_for(model)` returns the builder of the model's family:
- `QwenOmniUnits` (Qwen2.5-Omni and plain Qwen/Llama decoders): text through `omnijax.models.qwen2_5_omni.layout`, media
  through `omnijax.models.qwen2_5_omni.frontend` (2 s audiovisual units at 2 fps, TMRoPE offsets).
- `Qwen3OmniUnits` (Qwen3-Omni): the same through `omnijax.models.qwen3_omni.layout` and
  `omnijax.models.qwen3_omni.frontend` (2 s audiovisual groups at 2 fps, interleaved M-RoPE offsets); every chunk
  carries the vision encoder's DeepStack levels (zeros on text).
- `MiniCPMOUnits` (MiniCPM-o 4.5): text through `omnijax.models.minicpmo.layout`, media as `<unit> [<image> E </image>
  (<slice> E </slice>)*] [<|audio_start|> A <|audio_end|>] </unit>` (1 s units, one frame each), 1D positions.

Every chunk is padded to a bucket length (`bucket`: 16, 32, 64, ... tokens), so a conversation compiles one step
per bucket rather than one per message length. When the model has encoders every chunk carries embeddings (zeros
on text), so text and media chunks of one bucket share a program.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.chunks.chunk import Chunk, pad_chunk
from omnijax.chunks.spans import SpanKind

MIN_BUCKET = 16


def bucket(length: int) -> int:
    """The padded length of a chunk of `length` tokens: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, int(length) - 1).bit_length())


def _require(model, kind: str) -> None:
    """Refuses media for a checkpoint without that encoder, with the Qwen2.5-Omni frontend's error (which checks
    its own models; imported here, not at start-up)."""
    from omnijax.models.qwen2_5_omni.frontend import MissingEncoderError
    if getattr(model, kind, None) is None:
        source = getattr(model, "source", None)
        where = f" ({source})" if source else ""
        raise MissingEncoderError(f"this checkpoint{where} has no {kind} encoder, so it cannot take "
                                  f"{'images or video' if kind == 'vision' else 'audio'}; convert a checkpoint "
                                  f"with its {kind} tower")


class _Units:
    """What both families share: padding, continuation chunks, the embedding width."""

    unit_seconds: float
    fps: float
    temporal_patch_size: int

    def __init__(self, model):
        self.model = model
        config = model.config
        self.axes = config.position_axes
        has_encoders = getattr(model, "audio", None) is not None or getattr(model, "vision", None) is not None
        self.hidden_size = config.hidden_size if has_encoders else None

    def pad(self, chunk: Chunk) -> Chunk:
        return pad_chunk(chunk, bucket(chunk.length))

    levels = 0  # DeepStack levels every chunk carries

    def continuation(self, unit: int, answer_tokens: int) -> Chunk:
        """A chunk without tokens that asks for `answer_tokens` more tokens of the answer unit `unit`."""
        embeds = None if self.hidden_size is None else np.zeros((1, 1, self.hidden_size), np.float32)
        deepstack = np.zeros((self.levels, 1, 1, self.hidden_size), np.float32) if self.levels else None
        return Chunk(token_ids=np.zeros((1, 1), np.int32), valid=np.zeros((1, 1), bool),
                     positions=np.zeros((self.axes, 1, 1), np.int32), unit=np.full((1, 1), unit, np.int32),
                     span=np.full((1, 1), int(SpanKind.RESPONSE), np.int32), offset=np.zeros((1, 1), np.int32),
                     answer_tokens=np.asarray([answer_tokens], np.int32), answer_unit=np.asarray([unit], np.int32),
                     advance=np.zeros((1,), np.int32), embeds=embeds,
                     embed_mask=None if embeds is None else np.zeros((1, 1), bool), deepstack=deepstack)

    def open_video(self, path):
        """A video file cut into this family's audiovisual units (`omnijax.media.video.open_video`), checked up front."""
        from omnijax.media import video as video_lib
        return video_lib.open_video(path, unit_seconds=self.unit_seconds, fps=self.fps,
                                    temporal_patch_size=self.temporal_patch_size)

    def frames_of(self, frames) -> np.ndarray:
        frames = np.asarray(frames)
        if frames.ndim == 3:
            frames = frames[None]
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be [n, H, W, 3] (or one [H, W, 3] frame), got shape {frames.shape}")
        return frames


class QwenOmniUnits(_Units):
    """Qwen2.5-Omni units (also plain decoders, which take text only)."""

    unit_seconds, fps = 2.0, 2.0

    def __init__(self, model):
        super().__init__(model)
        vision = getattr(model, "vision", None)
        self.temporal_patch_size = 2 if vision is None else vision.config.temporal_patch_size
        from omnijax.models.qwen2_5_omni import layout as adapter
        self.adapter, self.tokens = adapter, adapter._tokens(getattr(model, "omni", None))

    @property
    def frontend(self):
        from omnijax.models.qwen2_5_omni import frontend
        return frontend

    def _text_options(self) -> dict:
        return dict(hidden_size=self.hidden_size, tokens=self.tokens)

    def text(self, ids, unit: int, kind: SpanKind, answer_tokens: int = 0) -> Chunk:
        a, common = self.adapter, self._text_options()
        if kind == SpanKind.SYSTEM:
            chunk = a.system_unit(ids, unit, **common)
        elif kind == SpanKind.RESPONSE:
            chunk = a.response_unit(ids, unit, **common)
        else:
            chunk = a.text_unit(ids, unit, answer_tokens, **common)
        # Text has equal t/h/w offsets: a decoder with one position axis takes the first.
        return chunk if self.axes == 3 else dataclasses.replace(chunk, positions=chunk.positions[:self.axes])

    def image(self, image, unit: int) -> Chunk:
        return self.frontend.image_chunk(self.model, np.asarray(image), unit)

    def audio(self, pcm, sample_rate: int, unit: int) -> Chunk:
        return self.frontend.audio_chunk(self.model, np.asarray(pcm, np.float32), unit, sample_rate=sample_rate)

    def av(self, frames, pcm, unit: int, **video_kwargs) -> Chunk:
        return self.frontend.audiovisual_chunk(self.model, self.frames_of(frames), np.asarray(pcm, np.float32), unit,
                                               fps=self.fps, **video_kwargs)


class Qwen3OmniUnits(QwenOmniUnits):
    """Qwen3-Omni units: 2 s audiovisual groups at 2 fps, interleaved M-RoPE, DeepStack levels on every chunk."""

    def __init__(self, model):
        _Units.__init__(self, model)
        vision = model.vision
        self.temporal_patch_size = 2 if vision is None else vision.config.temporal_patch_size
        self.levels = 0 if vision is None else vision.config.num_deepstack
        from omnijax.models.qwen3_omni import layout as adapter
        self.adapter, self.tokens = adapter, adapter._tokens(model.omni)

    @property
    def frontend(self):
        from omnijax.models.qwen3_omni import frontend
        return frontend

    def _text_options(self) -> dict:
        return dict(hidden_size=self.hidden_size, tokens=self.tokens, deepstack_levels=self.levels)


class MiniCPMOUnits(_Units):
    """MiniCPM-o 4.5 units: 1 s of audio with at most one frame each, as its streaming mode takes them."""

    unit_seconds, fps, temporal_patch_size = 1.0, 1.0, 1

    def __init__(self, model, *, max_slice_nums: int = 1):
        super().__init__(model)
        from omnijax.models.minicpmo import layout as adapter
        self.adapter, self.tokens, self.max_slice_nums = adapter, model.tokens, max_slice_nums

    def text(self, ids, unit: int, kind: SpanKind, answer_tokens: int = 0) -> Chunk:
        a = self.adapter
        if kind == SpanKind.SYSTEM:
            return a.system_unit(ids, unit, hidden_size=self.hidden_size)
        if kind == SpanKind.RESPONSE:
            return a.response_unit(ids, unit, hidden_size=self.hidden_size, tokens=self.tokens)
        return a.text_unit(ids, unit, answer_tokens, hidden_size=self.hidden_size, tokens=self.tokens)

    def _unit(self, unit: int, image=None, pcm=None, sample_rate: int = 16_000) -> Chunk:
        """`<unit> [<image> E </image> (<slice> E </slice>)*] [<|audio_start|> A <|audio_end|>] </unit>`."""
        from omnijax.models.minicpmo import audio as audio_lib
        from omnijax.models.minicpmo import audio_features
        from omnijax.models.minicpmo import vision as vision_lib
        parts = {}
        if image is not None:
            _require(self.model, "vision")
        if pcm is not None:
            _require(self.model, "audio")
        if image is not None:
            embeds, sliced = vision_lib.encode_image(self.model.vision, np.asarray(image),
                                                     max_slice_nums=self.max_slice_nums)
            embeds = np.asarray(embeds, np.float32)
            parts.update(image=True, slices=sliced.grid, image_embeds=embeds.reshape(-1, embeds.shape[-1]))
        if pcm is not None:
            features = audio_features.log_mel(np.asarray(pcm, np.float32), sample_rate)
            audio = np.asarray(audio_lib.encode_audio(self.model.audio, features), np.float32)
            parts.update(audio_tokens=audio.shape[0], audio_embeds=audio)
        return self.adapter.unit_chunk(unit, tokens=self.tokens, hidden_size=self.model.config.hidden_size, **parts)

    def image(self, image, unit: int) -> Chunk:
        return self._unit(unit, image=image)

    def audio(self, pcm, sample_rate: int, unit: int) -> Chunk:
        return self._unit(unit, pcm=pcm, sample_rate=sample_rate)

    def av(self, frames, pcm, unit: int, **_) -> Chunk:
        frames = self.frames_of(frames)
        if frames.shape[0] != 1:
            raise ValueError(f"a MiniCPM-o unit takes one frame (1 s of audio with the frame seen in it), got "
                             f"{frames.shape[0]}")
        return self._unit(unit, image=frames[0], pcm=pcm)


def units_for(model) -> _Units:
    """The unit builder of the model's family."""
    if getattr(model, "model_type", None) == "minicpmo":
        return MiniCPMOUnits(model)
    if getattr(model, "model_type", None) == "qwen3_omni":
        return Qwen3OmniUnits(model)
    return QwenOmniUnits(model)


__all__ = ["MIN_BUCKET", "MiniCPMOUnits", "Qwen3OmniUnits", "QwenOmniUnits", "bucket", "units_for"]
