"""Raw media -> ready Qwen2.5-Omni chunks: preprocessing, the encoders, and the unit adapters in one call.

Every builder returns a batch-1, unpadded `Chunk` that carries embeddings (`[1, T, hidden]` float32 with the
placeholder mask), so the chunks of a whole session can be stacked (`omnijax.chunks.chunk.stack_chunks`) and streamed:

    model = omnijax.load(path)
    chunks = [frontend.system(model, system_ids, unit=0)]
    for k in range(n):
        chunks.append(frontend.audiovisual_chunk(model, frames[k], pcm[k], unit=1 + k))
    chunks.append(frontend.text(model, question_ids, unit=n + 1, answer_tokens=8))
    result = omnijax.stream(model, stack_chunks(chunks), max_answer_tokens=8)

- `audiovisual_chunk`: one streaming unit (typically 2 s) of video frames and the 16 kHz audio recorded with them:
  `preprocess_video` -> `encode_vision` gives the video features, `log_mel` -> `encode_audio` the audio features,
  and `adapters.qwen2_5_omni.audiovisual_unit` lays them out as transformers does for a clip with
  `use_audio_in_video=True` (`second_per_grid = temporal_patch_size / fps`, the processor's value).
- `image_chunk`, `audio_chunk`: one image, one audio clip.
- `system`, `text`, `response`: text units with zero embeddings (no placeholders).

Token ids come from the loaded checkpoint (`model.omni`, which `omnijax-convert` fills from its config and
tokenizer), so a checkpoint whose special ids differ from the release's gets its own ids in every chunk.

Frame count rule (`expected_frames`). The frames must be the ones transformers' video processor would sample from
the clip at `fps`: its `sample_frames` takes `duration * fps` frames and floors the count to a multiple of
`temporal_patch_size`. The duration is that of the audio's valid feature frames, `ceil(samples / 160) / 100` s, so a
clip a few samples short of or beyond a whole number of frames is not pushed across a boundary. A unit's frames are
accepted when they fill the same number of temporal patches as that count, i.e. when padding them to a multiple of
`temporal_patch_size` by repeating the last frame (which `preprocess_video`, like the processor, does) gives it:
2 s at fps 2 expects 4 frames and accepts 3 or 4; 2.4 s at fps 2 also expects 4. Unlike the processor, no minimum
of 4 frames is imposed: stretching a short clip to 4 frames would break the audio-video alignment of TMRoPE
(positions assume `temporal_patch_size / fps` seconds per temporal patch), so a clip shorter than one temporal patch
(under 1 s at fps 2) is refused.

Errors: a bad input raises a `ValueError` subclass whose message starts with the unit id (`unit 3 (audio): ...`);
the classes of the underlying validators (`audio_features.AudioInputError`, `vision_preprocess.VisionInputError`
and their subclasses) are kept. A missing encoder raises `MissingEncoderError`, a frame/audio mismatch
`FrameCountError` naming both counts.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from omnijax.chunks.chunk import Chunk
from omnijax.chunks.spans import SpanKind
from omnijax.models.encoders import qwen_vl_preprocess as vision_preprocess
from omnijax.models.encoders.log_mel import HOP_LENGTH, SAMPLE_RATE, log_mel
from omnijax.models.encoders.qwen_vl_preprocess import VisionInputError
from omnijax.models.encoders.whisper import AudioInputError, audio_token_count, encode_audio
from omnijax.models.frontend import ChatUnits, FrontendError, MissingEncoderError
from omnijax.models.qwen2_5_omni import layout
from omnijax.models.qwen2_5_omni import layout as adapter
from omnijax.models.qwen2_5_omni.vision import encode_vision

if TYPE_CHECKING:
    from omnijax.models.encoders.whisper import AudioEncoder
    from omnijax.models.model import Model

__all__ = ["FrameCountError", "FrontendError", "MissingEncoderError", "audio_chunk", "audiovisual_chunk",
           "expected_frames", "image_chunk", "num_audio_tokens", "response", "synthetic_frames", "system", "text",
           "tone"]

FEATURE_FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 log-mel frames per second
_EPS = 1e-6  # tolerance of the frame-count floor against float rounding of duration * fps


class FrameCountError(FrontendError):
    """The number of video frames does not match the duration of the unit's audio.

    Attributes:
        frames: frames given.
        expected: frames the audio's duration implies at the unit's fps.
    """

    def __init__(self, message: str, frames: int, expected: int):
        self.frames, self.expected = frames, expected
        super().__init__(message)


# ----------------------------------------------------------------------------------------------------------- helpers


def _omni(model):
    """The checkpoint's special ids (an `OmniConfig`), or None (the release's) for a model without them."""
    return model.omni


def unit_id(unit: int) -> int:
    if isinstance(unit, bool) or not isinstance(unit, (int, np.integer)) or unit < 0:
        raise FrontendError(f"unit must be a non-negative integer, got {unit!r}")
    return int(unit)


def require_model_encoder(model: Model, kind: str) -> Any:
    encoder = getattr(model, kind, None)
    if encoder is None:
        source = model.source
        where = f" ({source})" if source else ""
        tensors = "thinker.audio_tower.*" if kind == "audio" else "thinker.visual.*"
        raise MissingEncoderError(f"this checkpoint has no {kind} encoder{where}; {kind} chunks need a checkpoint "
                                  f"converted with a {kind}_config and its {tensors} tensors")
    out = encoder.config.output_dim if kind == "audio" else encoder.config.out_hidden_size
    if out != model.config.hidden_size:
        raise FrontendError(f"the {kind} encoder outputs width {out} but the decoder's hidden size is "
                            f"{model.config.hidden_size}")
    return encoder


def relabel_error(error: ValueError, unit: int, what: str) -> ValueError:
    """The same error class with the unit id (and the kind of input) in front of the message."""
    message = f"unit {unit} ({what}): {error}"
    try:
        relabelled = type(error)(message)
    except TypeError:  # a class with a richer constructor
        relabelled = FrontendError(message)
    return relabelled


def _log_mel(encoder, pcm, sample_rate: int, unit: int) -> np.ndarray:
    """`[mel, frames]` features of one clip; PCM errors carry the unit id."""
    try:
        return log_mel(pcm, sample_rate, num_mel_bins=encoder.config.num_mel_bins)
    except AudioInputError as e:
        raise relabel_error(e, unit, "audio") from e


def _encode_audio(encoder, features: np.ndarray, unit: int) -> np.ndarray:
    """`[n_audio, hidden]` float32 audio features (too-short clips raise with the unit id)."""
    try:
        return np.asarray(encode_audio(encoder, features), np.float32)
    except AudioInputError as e:
        raise relabel_error(e, unit, "audio") from e


def _preprocess_kwargs(config) -> dict:
    return dict(patch_size=config.patch_size, merge_size=config.spatial_merge_size,
                temporal_patch_size=config.temporal_patch_size)


def _vision_features(encoder, pixel_values, grid, unit: int, what: str) -> np.ndarray:
    try:
        return np.asarray(encode_vision(encoder, pixel_values, grid), np.float32)
    except ValueError as e:
        raise relabel_error(e, unit, what) from e


def expected_frames(num_samples: int, fps: float, *, sample_rate: int = SAMPLE_RATE,
                    temporal_patch_size: int = vision_preprocess.TEMPORAL_PATCH_SIZE) -> int:
    """Frames transformers' video processor samples at `fps` from a clip with `num_samples` audio samples.

    `floor(duration * fps)` rounded down to a multiple of `temporal_patch_size`, where the duration is that of the
    audio's log-mel frames (`ceil(num_samples / 160) / 100` s at 16 kHz). May be 0 for a clip shorter than one
    temporal patch. See the module docstring for the accepted frame counts.
    """
    if not fps > 0:
        raise FrontendError(f"fps must be positive, got {fps!r}")
    hop = sample_rate // FEATURE_FRAMES_PER_SECOND
    mel_frames = -(-int(num_samples) // hop)
    nominal = mel_frames * float(fps) / FEATURE_FRAMES_PER_SECOND
    return int(math.floor(nominal / temporal_patch_size + _EPS)) * temporal_patch_size


# ------------------------------------------------------------------------------------------------------- builders


def audiovisual_chunk(model: Model, frames: np.ndarray, pcm: np.ndarray, unit: int, *, fps: float = 2.0,
                      sample_rate: int = SAMPLE_RATE, answer_tokens: int = 0, **video_kwargs: Any) -> Chunk:
    """One audiovisual streaming unit (typically 2 s): `<|vision_bos|><|audio_bos|> V A <|audio_eos|><|vision_eos|>`.

    Args:
        model: an `omnijax.Model` with audio and vision encoders.
        frames: `[T, H, W, 3]` video frames sampled at `fps` (uint8, or floating point in [0, 1]).
        pcm: `[samples]` float mono audio of the same stretch of time.
        unit: unit id.
        fps: frame rate the frames were sampled at; sets `second_per_grid = temporal_patch_size / fps`.
        sample_rate: must be 16000.
        answer_tokens: greedy tokens to generate after the unit.
        **video_kwargs: passed to `vision_preprocess.preprocess_video` (`min_pixels`, `max_pixels`, `resize_impl`,
            `mean`, `std`); the patch sizes come from the vision encoder's config.

    Returns:
        A batch-1 `Chunk` with 3 position axes and embeddings (video features, then audio features, placed on their
        placeholders in token order).

    Raises:
        MissingEncoderError: the model lacks the audio or the vision encoder.
        FrameCountError: the frame count does not match the audio's duration (see `expected_frames`).
        AudioInputError, VisionInputError (subclasses): bad PCM or pixels, with the unit id in the message.
    """
    unit = unit_id(unit)
    vision = require_model_encoder(model, "vision")
    audio = require_model_encoder(model, "audio")
    mel = _log_mel(audio, pcm, sample_rate, unit)  # validates the PCM
    frames = frames if isinstance(frames, np.ndarray) else np.asarray(frames)
    if frames.ndim != 4:
        raise relabel_error(vision_preprocess.ChannelError(
            f"video must be a [T, H, W, 3] array of frames, got shape {frames.shape}"), unit, "video")
    tp = vision.config.temporal_patch_size
    num_frames = int(frames.shape[0])
    samples = int(np.shape(pcm)[0])
    expected = expected_frames(samples, fps, sample_rate=sample_rate, temporal_patch_size=tp)
    seconds = samples / sample_rate
    if expected == 0:
        raise FrameCountError(
            f"unit {unit} (audiovisual): {seconds:.3f} s of audio is shorter than one temporal patch "
            f"({tp} frames at fps {fps:g}, {tp / fps:g} s); a unit needs at least {tp / fps:g} s", num_frames, expected)
    if -(-num_frames // tp) * tp != expected:
        raise FrameCountError(
            f"unit {unit} (audiovisual): got {num_frames} video frame(s), but {seconds:.3f} s of audio at fps "
            f"{fps:g} implies {expected} frames (accepted: {expected - tp + 1} to {expected}, a short tail is padded "
            "by repeating the last frame); a video needs the frames its audio implies", num_frames, expected)
    try:
        pixel_values, grid = vision_preprocess.preprocess_video(frames, **video_kwargs,
                                                                **_preprocess_kwargs(vision.config))
    except VisionInputError as e:
        raise relabel_error(e, unit, "video") from e
    video_features = _vision_features(vision, pixel_values, grid, unit, "video")
    audio_features = _encode_audio(audio, mel, unit)
    return adapter.audiovisual_unit(
        tuple(int(g) for g in grid[0]), audio_features.shape[0], tp / float(fps), unit, video_features,
        audio_features, answer_tokens=answer_tokens, spatial_merge_size=vision.config.spatial_merge_size,
        tokens=_omni(model))


def image_chunk(model: Model, image: np.ndarray, unit: int, *, answer_tokens: int = 0, **image_kwargs: Any) -> Chunk:
    """`<|vision_bos|> <|IMAGE|>×n <|vision_eos|>` for one `[H, W, 3]` image, with its features.

    `image_kwargs` go to `vision_preprocess.preprocess_images` (`min_pixels`, `max_pixels`, `resize_impl`, ...).
    """
    unit = unit_id(unit)
    vision = require_model_encoder(model, "vision")
    if isinstance(image, (list, tuple)) or np.ndim(image) != 3:
        raise relabel_error(vision_preprocess.ChannelError(
            f"image_chunk takes one [H, W, 3] image, got shape {np.shape(image)}"), unit, "image")
    try:
        pixel_values, grid = vision_preprocess.preprocess_images(image, **image_kwargs,
                                                                 **_preprocess_kwargs(vision.config))
    except VisionInputError as e:
        raise relabel_error(e, unit, "image") from e
    features = _vision_features(vision, pixel_values, grid, unit, "image")
    return adapter.image_unit(tuple(int(g) for g in grid[0]), unit, features, answer_tokens=answer_tokens,
                              spatial_merge_size=vision.config.spatial_merge_size, tokens=_omni(model))


def audio_chunk(model: Model, pcm: np.ndarray, unit: int, *, sample_rate: int = SAMPLE_RATE,
                answer_tokens: int = 0) -> Chunk:
    """`<|audio_bos|> <|AUDIO|>×n <|audio_eos|>` for one mono 16 kHz clip (25 tokens per second)."""
    unit = unit_id(unit)
    encoder = require_model_encoder(model, "audio")
    features = _encode_audio(encoder, _log_mel(encoder, pcm, sample_rate, unit), unit)
    return adapter.audio_unit(features.shape[0], unit, features, answer_tokens=answer_tokens, tokens=_omni(model))


def system(model: Model, token_ids: Sequence[int], unit: int) -> Chunk:
    """The system prompt (every token SYSTEM), with zero embeddings."""
    return adapter.system_unit(token_ids, unit_id(unit), hidden_size=model.config.hidden_size, tokens=_omni(model))


def text(model: Model, token_ids: Sequence[int], unit: int, answer_tokens: int = 0, *,
         answer_unit: int | None = None) -> Chunk:
    """User text (chat markers BOUNDARY), with zero embeddings; `answer_tokens` greedy tokens follow."""
    return adapter.text_unit(token_ids, unit_id(unit), answer_tokens, answer_unit=answer_unit,
                             hidden_size=model.config.hidden_size, tokens=_omni(model))


def response(model: Model, token_ids: Sequence[int], unit: int) -> Chunk:
    """A model response fed back as input, with zero embeddings."""
    return adapter.response_unit(token_ids, unit_id(unit), hidden_size=model.config.hidden_size, tokens=_omni(model))


def num_audio_tokens(num_samples: int) -> int:
    """Audio tokens of a 16 kHz clip of `num_samples` samples (25 per second)."""
    return audio_token_count(-(-int(num_samples) // HOP_LENGTH))


# ------------------------------------------------------------------------------------------------- synthetic media


def synthetic_frames(seconds: float, fps: float = 2.0, height: int = 56, width: int = 84, seed: int = 0, *,
                     start: float = 0.0) -> np.ndarray:
    """`[round(seconds * fps), height, width, 3]` uint8 frames of coloured shapes moving over a gradient.

    Frame k shows time `start + k / fps`, so consecutive units continue the same motion when `start` advances by
    their duration. Deterministic for a seed.
    """
    count = int(round(seconds * fps))
    if count < 1 or height < 1 or width < 1:
        raise ValueError(f"synthetic_frames needs at least one frame of at least 1x1 px, got {count} frames of "
                         f"{height}x{width}")
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    background = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), np.full_like(x, 0.3)], -1) * 80.0
    shapes = 3
    colours = rng.integers(80, 256, (shapes, 3)).astype(np.float32)
    origin = rng.uniform(0.0, 1.0, (shapes, 2)) * (height, width)
    velocity = rng.uniform(-0.4, 0.4, (shapes, 2)) * (height, width)  # px per second
    radius = rng.uniform(0.12, 0.25, shapes) * min(height, width)
    frames = np.empty((count, height, width, 3), np.uint8)
    for k in range(count):
        t = start + k / fps
        frame = background.copy()
        centre = np.mod(origin + velocity * t, (height, width))
        for s in range(shapes):
            dy, dx = np.abs(y - centre[s, 0]), np.abs(x - centre[s, 1])
            inside = (dy * dy + dx * dx <= radius[s] ** 2) if s % 2 == 0 else (np.maximum(dy, dx) <= radius[s])
            frame[inside] = colours[s]
        frames[k] = np.clip(frame, 0, 255).astype(np.uint8)
    return frames


def tone(seconds: float, frequency: float = 440.0, sample_rate: int = SAMPLE_RATE, seed: int = 0, *,
         start: float = 0.0, amplitude: float = 0.5, noise: float = 0.01) -> np.ndarray:
    """`[round(seconds * sample_rate)]` float32 samples: a sine at `frequency` Hz plus a little Gaussian noise.

    Sample i is at time `start + i / sample_rate`, so consecutive clips continue the same wave.
    """
    count = int(round(seconds * sample_rate))
    if count < 1:
        raise ValueError(f"tone needs at least one sample, got {seconds} s at {sample_rate} Hz")
    t = start + np.arange(count, dtype=np.float64) / sample_rate
    wave = amplitude * np.sin(2.0 * np.pi * frequency * t)
    wave += noise * np.random.default_rng(seed).standard_normal(count)
    return wave.astype(np.float32)


def frame_unit(model: Model, audio: AudioEncoder | tuple[Any, Any], pcm: np.ndarray, unit: int,
               answer_tokens: int) -> Chunk:
    """One PCM frame (`[samples]` float32 at 16 kHz) -> its audio unit chunk, as `omnijax serve` hears it.

    Args:
        model: a loaded Qwen2.5-Omni model (its `omni` ids are used when present).
        audio: its audio encoder, or the encoder's `(graphdef, params)` split once by the caller.
        pcm: the frame's samples in [-1, 1).
        unit: the unit id.
        answer_tokens: tokens asked after the frame.
    """
    features = np.asarray(encode_audio(audio, log_mel(pcm, SAMPLE_RATE, num_mel_bins=model.audio.config.num_mel_bins)),
                          np.float32)
    return layout.audio_unit(features.shape[0], unit, features, answer_tokens=answer_tokens,
                             tokens=model.omni)


class QwenOmniUnits(ChatUnits):
    """Qwen2.5-Omni units (also plain decoders, which take text only)."""

    unit_seconds, fps = 2.0, 2.0

    def __init__(self, model: Model):
        super().__init__(model)
        vision = model.vision
        self.temporal_patch_size = 2 if vision is None else vision.config.temporal_patch_size
        self.adapter, self.tokens = layout, layout.token_ids_of(model.omni)

    @property
    def frontend(self) -> ModuleType:
        """The module of the family's media builders (`image_chunk`, `audio_chunk`, `audiovisual_chunk`)."""
        return sys.modules[__name__]

    @property
    def chat_markers(self) -> tuple[int, int]:
        return self.tokens.im_start_token_id, self.tokens.im_end_token_id

    def _text_options(self) -> dict:
        return dict(hidden_size=self.hidden_size, tokens=self.tokens)

    def text(self, ids: Sequence[int], unit: int, kind: SpanKind, answer_tokens: int = 0) -> Chunk:
        a, common = self.adapter, self._text_options()
        if kind == SpanKind.SYSTEM:
            chunk = a.system_unit(ids, unit, **common)
        elif kind == SpanKind.RESPONSE:
            chunk = a.response_unit(ids, unit, **common)
        else:
            chunk = a.text_unit(ids, unit, answer_tokens, **common)
        # Text has equal t/h/w offsets: a decoder with one position axis takes the first.
        return chunk if self.axes == 3 else dataclasses.replace(chunk, positions=chunk.positions[:self.axes])

    def image(self, image: np.ndarray, unit: int) -> Chunk:
        return self.frontend.image_chunk(self.model, np.asarray(image), unit)

    def audio(self, pcm: np.ndarray, sample_rate: int, unit: int) -> Chunk:
        return self.frontend.audio_chunk(self.model, np.asarray(pcm, np.float32), unit, sample_rate=sample_rate)

    def av(self, frames: np.ndarray, pcm: np.ndarray, unit: int, **video_kwargs: Any) -> Chunk:
        return self.frontend.audiovisual_chunk(self.model, self.frames_of(frames), np.asarray(pcm, np.float32), unit,
                                               fps=self.fps, **video_kwargs)
