"""Raw media -> ready Qwen3-Omni chunks: preprocessing, the encoders and the unit adapters in one call.

The same API as `omnijax.models.qwen2_5_omni.frontend`, for a loaded Qwen3-Omni model (`model.model_type ==
"qwen3_omni"`). Every builder returns a batch-1, unpadded `Chunk` carrying embeddings (`[1, T, hidden]` float32 with
the placeholder mask) and, when the model has a vision encoder, its DeepStack levels (`[levels, 1, T, hidden]`, zero
away from visual tokens; text and audio chunks get zero levels), so the chunks of a session stack:

    model = omnijax.load(path)
    chunks = [frontend.system(model, system_ids, unit=0)]
    for k in range(n):
        chunks.append(frontend.audiovisual_chunk(model, frames[k], pcm[k], unit=1 + k))
    chunks.append(frontend.text(model, question_ids, unit=n + 1, answer_tokens=8))
    result = omnijax.stream(model, stack_chunks(chunks), max_answer_tokens=8)

Preprocessing is what `Qwen3OmniMoeProcessor` (transformers 5.2) runs with the Qwen3-Omni-30B-A3B release's
`preprocessor_config.json` (the same in the Instruct, Thinking and Captioner repos):

- audio: `WhisperFeatureExtractor(feature_size=128, hop_length=160, n_fft=400, sampling_rate=16000, dither=0)`
  called as the processor calls it (`padding=True`, i.e. pad to the longest clip of the call, which for one clip is
  no padding). Unlike Qwen2.5-Omni's processor (`padding="max_length"`: zeros after the clip), the STFT therefore
  reflects the clip at both ends, keeps `samples // 160` frames (the last STFT frame is dropped) and clamps to 8
  decades below the loudest of those frames; `log_mel` here computes exactly that.
- images: `Qwen2VLImageProcessor` with `patch_size=16, merge_size=2, temporal_patch_size=2`, mean = std =
  `(0.5, 0.5, 0.5)`, `min_pixels=3136, max_pixels=12845056` (release values), Pillow bicubic resize.
- videos: `Qwen2VLVideoProcessor` with the same patching and mean/std (the release has no
  `video_preprocessor_config.json`; the video processor reads `preprocessor_config.json`), sized by the processor's
  video default `size={"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}`, which overrides the
  config's min/max pixels; torch uint8 antialiased bicubic resize.

Any of the vision settings can be overridden with the builders' keyword arguments (`vision_preprocess` options).
`preprocess_image`, `preprocess_video` and `log_mel` expose the preprocessing alone. Note: with torchvision
installed, transformers 5.2's `AutoImageProcessor` loads the release as `Qwen2VLImageProcessorFast` (torch resize):
pass `resize_impl="torch"` to image builders to follow that one (Pillow and torch differ by one grey level on ~1% of
resized pixels; same-size images are not resized by either).

- `audiovisual_chunk`: one streaming unit of video frames and the 16 kHz audio recorded with them, laid out by
  `adapters.qwen3_omni.audiovisual_unit` as transformers lays out one video with `use_audio_in_video=True`:
  `second_per_grid = temporal_patch_size / fps` (the processor's value), which must give whole temporal ids
  (`position_id_per_seconds` = 13: fps 2 -> 1 s and 13 ids per temporal patch); rates giving fractional ids are
  refused.
- `image_chunk`, `audio_chunk`: one image, one audio clip (13 tokens per second: `audio_token_count(samples // 160)`).
- `system`, `text`, `response`: text units with zero embeddings and zero DeepStack levels.

Frame count rule: `expected_frames` is the Qwen2.5 frontend's (frames transformers' video sampler takes at `fps`
from the clip's duration `ceil(samples / 160) / 100` s, floored to whole temporal patches; a short tail is padded
by repeating the last frame).

Errors are the Qwen2.5 frontend's classes: a bad input raises a `ValueError` subclass whose message starts with the
unit id (`unit 3 (audio): ...`), keeping the validators' classes (`AudioInputError`, `VisionInputError`
subclasses); a missing encoder raises `MissingEncoderError`; a frame/audio mismatch `FrameCountError`; an audio
encoder whose mel-bin count is not the processor's 128, or a model that is not Qwen3-Omni, `FrontendError`.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt

from omnijax.chunks.chunk import Chunk
from omnijax.models.encoders import qwen_vl_preprocess as vision_preprocess
from omnijax.models.encoders.log_mel import (
    HOP_LENGTH,
    N_FFT,
    SAMPLE_RATE,
    AudioInputError,
    InvalidPcmError,
    check_pcm_layout,
    finite_float32,
    mel_filters,
)
from omnijax.models.encoders.qwen_vl_preprocess import VisionInputError
from omnijax.models.frontend import ChatUnits
from omnijax.models.qwen2_5_omni import frontend as frontend25
from omnijax.models.qwen2_5_omni.frontend import (
    FrameCountError,
    FrontendError,
    MissingEncoderError,
    QwenOmniUnits,
    expected_frames,
    relabel_error,
    synthetic_frames,
    tone,
    unit_id,
)
from omnijax.models.qwen3_omni import layout
from omnijax.models.qwen3_omni import layout as adapter
from omnijax.models.qwen3_omni.audio import audio_token_count, encode_audio
from omnijax.models.qwen3_omni.vision import Qwen3VisionConfig, encode_vision

if TYPE_CHECKING:
    from omnijax.models.model import Model
    from omnijax.models.qwen3_omni.audio import Qwen3AudioEncoder

__all__ = ["FrameCountError", "FrontendError", "MissingEncoderError", "audio_chunk", "audiovisual_chunk",
           "expected_frames", "image_chunk", "log_mel", "num_audio_tokens", "preprocess_image", "preprocess_video",
           "response", "synthetic_frames", "system", "text", "tone"]

# The release's preprocessor_config.json (Qwen/Qwen3-Omni-30B-A3B-{Instruct,Thinking,Captioner}).
NUM_MEL_BINS = 128  # WhisperFeatureExtractor feature_size
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
IMAGE_MIN_PIXELS = 3136  # 56 * 56
IMAGE_MAX_PIXELS = 12845056  # 28 * 28 * 16384
# Qwen3OmniMoeProcessor's videos_kwargs default `size` (overrides the config's min/max pixels for videos).
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 768 * 32 * 32
_MEL_FLOOR = 1e-10
_BLOCK_FRAMES = 4096  # STFT frames per block (bounds the float64 frame buffer)
_ID_TOLERANCE = 1e-6  # temporal ids per patch closer than this to an integer count as whole


# ------------------------------------------------------------------------------------------------------ log-mel


def log_mel(pcm: npt.ArrayLike, sample_rate: int = SAMPLE_RATE, *, num_mel_bins: int = NUM_MEL_BINS) -> np.ndarray:
    """Log-mel features of a mono 16 kHz clip, as `Qwen3OmniMoeProcessor` computes them for that clip alone.

    Hann window of 400 samples, hop 160, the clip reflected by 200 samples at both ends (a centred STFT), power
    spectrum through 128 slaney mel filters (0-8 kHz), log10 floored at 1e-10, the last STFT frame dropped, values
    clamped to 8 below the maximum of the kept frames, then `(x + 4) / 4`.

    Args:
        pcm: `[samples]` float samples (nominally in [-1, 1]); at least 201 samples (the reflection needs them).
        sample_rate: must be 16000.
        num_mel_bins: mel filters (128 for Qwen3-Omni; tiny test encoders take fewer).

    Returns:
        `[num_mel_bins, samples // 160]` float32 features (every frame valid: the processor's mask is all ones).

    Raises:
        UnsupportedSampleRateError: `sample_rate` is not 16000.
        InvalidPcmError: `pcm` is not 1D float, holds NaN/inf, or has fewer than 201 samples.
    """
    pcm = finite_float32(check_pcm_layout(pcm, sample_rate))
    half = N_FFT // 2
    n = pcm.size
    if n <= half:
        raise InvalidPcmError(f"the clip has {n} sample(s); the processor's centred STFT needs at least {half + 1} "
                              f"({(half + 1) / SAMPLE_RATE * 1000:.1f} ms)")
    frames = n // HOP_LENGTH
    padded = np.pad(pcm.astype(np.float64), half, mode="reflect")  # torch.stft(center=True)'s reflection
    views = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH]  # [frames + 1, N_FFT]
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic hann
    bank = mel_filters(num_mel_bins)  # [K, M]
    out = np.empty((frames, num_mel_bins), np.float64)
    for start in range(0, frames, _BLOCK_FRAMES):
        stop = min(start + _BLOCK_FRAMES, frames)
        spectrum = np.fft.rfft(views[start:stop] * window, axis=-1)
        power = spectrum.real ** 2 + spectrum.imag ** 2
        out[start:stop] = np.log10(np.maximum(power @ bank, _MEL_FLOOR))
    feats = (np.maximum(out, out.max() - 8.0) + 4.0) / 4.0
    return np.ascontiguousarray(feats.T, dtype=np.float32)


def num_audio_tokens(num_samples: int) -> int:
    """Audio tokens of a 16 kHz clip of `num_samples` samples: `audio_token_count(num_samples // 160)` (13/s)."""
    return audio_token_count(int(num_samples) // HOP_LENGTH)


# ------------------------------------------------------------------------------------------------------- helpers


def _omni(model):
    """The checkpoint's ids (`Qwen3OmniConfig`), or None (the release's); refuses a model of another family."""
    kind = getattr(model, "model_type", "qwen3_omni")
    if kind != "qwen3_omni":
        raise FrontendError(f"this frontend builds Qwen3-Omni chunks but the model is {kind!r}; use "
                            f"omnijax.models.{kind}.frontend")
    return model.omni


def _levels(model) -> int:
    """DeepStack levels every chunk of the model's sessions carries (0 without a vision encoder)."""
    vision = model.vision
    return 0 if vision is None else int(vision.config.num_deepstack)


def _encoder(model, kind: str):
    """The model's encoder (the Qwen2.5-Omni frontend's checks: present, its width the decoder's), whose audio
    tower must also take this processor's 128 mel bins."""
    encoder = frontend25.require_model_encoder(model, kind)
    if kind == "audio" and encoder.config.num_mel_bins != NUM_MEL_BINS:
        raise FrontendError(f"the audio encoder takes {encoder.config.num_mel_bins} mel bins but Qwen3-Omni's "
                            f"processor (WhisperFeatureExtractor, feature_size {NUM_MEL_BINS}) makes {NUM_MEL_BINS}; "
                            "this frontend cannot feed it (build its input_features yourself)")
    return encoder


def _audio_features(encoder, pcm, sample_rate: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """`(mel [128, frames], tokens [n, hidden] float32)` of one clip; bad PCM raises with the unit id."""
    try:
        mel = log_mel(pcm, sample_rate)
        return mel, np.asarray(encode_audio(encoder, mel), np.float32)
    except AudioInputError as e:
        raise relabel_error(e, unit, "audio") from e


def _vision_features(encoder, pixel_values, grid, unit: int, what: str):
    """`(embeds [n, hidden], deepstack [levels, n, hidden] or None)` float32."""
    try:
        embeds, deepstack = encode_vision(encoder, pixel_values, grid)
    except ValueError as e:
        raise relabel_error(e, unit, what) from e
    deepstack = np.asarray(deepstack, np.float32)
    return np.asarray(embeds, np.float32), (deepstack if deepstack.shape[0] else None)


def _pixels(kind: str, config, media, options: dict):
    """Pixel rows and grid with the Qwen3-Omni defaults, `options` over them and the encoder's patching."""
    video = kind == "video"
    config = Qwen3VisionConfig() if config is None else config
    settings = dict(min_pixels=VIDEO_MIN_PIXELS if video else IMAGE_MIN_PIXELS,
                    max_pixels=VIDEO_MAX_PIXELS if video else IMAGE_MAX_PIXELS, mean=IMAGE_MEAN, std=IMAGE_STD)
    settings.update(options)
    settings.update(patch_size=config.patch_size, merge_size=config.spatial_merge_size,
                    temporal_patch_size=config.temporal_patch_size)
    run = vision_preprocess.preprocess_video if video else vision_preprocess.preprocess_images
    return run(media, **settings)


def preprocess_image(image: np.ndarray, config: Qwen3VisionConfig | None = None,
                     **image_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """One `[H, W, 3]` image -> `(pixel_values [N, 3 * 2 * 16 * 16] float32, grid_thw [1, 3] int64)`, as
    `Qwen2VLImageProcessor` with the Qwen3-Omni release settings.

    Args:
        image: uint8, or floating point in [0, 1].
        config: the vision encoder's config (its patching is used); None: the release's (16 px, merge 2, 2 frames).
        **image_kwargs: `vision_preprocess.preprocess_images` options overriding the defaults (`min_pixels` 3136,
            `max_pixels` 12845056, `mean` = `std` = 0.5, `resize_impl` "pil").

    Raises:
        VisionInputError: a subclass naming the problem.
    """
    return _pixels("image", config, image, image_kwargs)


def preprocess_video(frames: np.ndarray | Sequence[np.ndarray], config: Qwen3VisionConfig | None = None,
                     **video_kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """`[T, H, W, 3]` sampled frames -> `(pixel_values, grid_thw [1, 3])`, as `Qwen2VLVideoProcessor` configured by
    `Qwen3OmniMoeProcessor` (`min_pixels` 128 * 32 * 32, `max_pixels` 768 * 32 * 32, mean = std = 0.5, torch
    resize); `config` and `video_kwargs` as in `preprocess_image`.
    """
    return _pixels("video", config, frames, video_kwargs)


def _preprocess(kind: str, config, media, unit: int, options: dict):
    """`preprocess_image` / `preprocess_video` with the unit id in the errors."""
    try:
        return _pixels(kind, config, media, options)
    except VisionInputError as e:
        raise relabel_error(e, unit, kind) from e


def _second_per_grid(model, temporal_patch_size: int, fps: float, unit: int) -> float:
    """`temporal_patch_size / fps`, refused unless it spans a whole number of temporal ids."""
    omni = _omni(model) or adapter.RELEASE
    per_second = float(omni.position_id_per_seconds)
    seconds = temporal_patch_size / float(fps)
    ids = seconds * per_second
    if abs(ids - round(ids)) > _ID_TOLERANCE or round(ids) < 1:
        raise FrontendError(
            f"unit {unit} (audiovisual): at fps {fps:g} a temporal patch of {temporal_patch_size} frames spans "
            f"{seconds:g} s = {ids:g} temporal ids ({per_second:g} per second); streaming keeps whole ids, so use a "
            f"frame rate that makes {temporal_patch_size} / fps * {per_second:g} an integer (e.g. fps 2: 13 ids)")
    return round(ids) / per_second


# ------------------------------------------------------------------------------------------------------ builders


def audiovisual_chunk(model: Model, frames: np.ndarray, pcm: np.ndarray, unit: int, *, fps: float = 2.0,
                      sample_rate: int = SAMPLE_RATE, answer_tokens: int = 0, **video_kwargs: Any) -> Chunk:
    """One audiovisual streaming unit: `<|vision_start|><|audio_start|> V/A merged by time <|audio_end|><|vision_end|>`.

    Args:
        model: a loaded Qwen3-Omni `omnijax.Model` with audio and vision encoders.
        frames: `[T, H, W, 3]` video frames sampled at `fps` (uint8, or floating point in [0, 1]).
        pcm: `[samples]` float mono audio of the same stretch of time.
        unit: unit id.
        fps: frame rate the frames were sampled at; `second_per_grid = temporal_patch_size / fps` must span whole
            temporal ids (fps 2 with 2-frame patches: 1 s, 13 ids).
        sample_rate: must be 16000.
        answer_tokens: greedy tokens to generate after the unit.
        **video_kwargs: `vision_preprocess.preprocess_video` options (`min_pixels`, `max_pixels`, `resize_impl`,
            `mean`, `std`) overriding the Qwen3-Omni defaults; the patch sizes come from the vision encoder.

    Returns:
        A batch-1 `Chunk` with 3 position axes, embeddings (video features, then audio features, on their
        placeholders in token order) and DeepStack levels on the video tokens.

    Raises:
        MissingEncoderError: the model lacks the audio or the vision encoder.
        FrameCountError: the frame count does not match the audio's duration (see `expected_frames`).
        FrontendError: `fps` gives fractional temporal ids, or the audio encoder does not take 128 mel bins.
        AudioInputError, VisionInputError (subclasses): bad PCM or pixels, with the unit id in the message.
    """
    unit = unit_id(unit)
    vision = _encoder(model, "vision")
    audio = _encoder(model, "audio")
    try:
        pcm = finite_float32(check_pcm_layout(pcm, sample_rate))  # validates before the frame count is read
    except AudioInputError as e:
        raise relabel_error(e, unit, "audio") from e
    frames = frames if isinstance(frames, np.ndarray) else np.asarray(frames)
    if frames.ndim != 4:
        raise relabel_error(vision_preprocess.ChannelError(
            f"video must be a [T, H, W, 3] array of frames, got shape {frames.shape}"), unit, "video")
    tp = vision.config.temporal_patch_size
    num_frames, samples = int(frames.shape[0]), int(pcm.shape[0])
    expected = expected_frames(samples, fps, sample_rate=sample_rate, temporal_patch_size=tp)
    seconds = samples / sample_rate
    if expected == 0:
        raise FrameCountError(
            f"unit {unit} (audiovisual): {seconds:.3f} s of audio is shorter than one temporal patch "
            f"({tp} frames at fps {fps:g}, {tp / fps:g} s); a unit needs at least {tp / fps:g} s", num_frames, expected)
    if math.ceil(num_frames / tp) * tp != expected:
        raise FrameCountError(
            f"unit {unit} (audiovisual): got {num_frames} video frame(s), but {seconds:.3f} s of audio at fps "
            f"{fps:g} implies {expected} frames (accepted: {expected - tp + 1} to {expected}, a short tail is padded "
            "by repeating the last frame); a video needs the frames its audio implies", num_frames, expected)
    second_per_grid = _second_per_grid(model, tp, fps, unit)
    pixel_values, grid = _preprocess("video", vision.config, frames, unit, video_kwargs)
    video_features, deepstack = _vision_features(vision, pixel_values, grid, unit, "video")
    _, audio_features = _audio_features(audio, pcm, sample_rate, unit)
    return adapter.audiovisual_unit(
        tuple(int(g) for g in grid[0]), audio_features.shape[0], second_per_grid, unit, video_features,
        audio_features, deepstack, answer_tokens=answer_tokens, tokens=_omni(model))


def image_chunk(model: Model, image: np.ndarray, unit: int, *, answer_tokens: int = 0, **image_kwargs: Any) -> Chunk:
    """`<|vision_start|> <|image_pad|>×n <|vision_end|>` for one `[H, W, 3]` image, with its features and DeepStack
    levels.

    `image_kwargs` are `vision_preprocess.preprocess_images` options (`min_pixels`, `max_pixels`, `resize_impl`,
    `mean`, `std`) overriding the Qwen3-Omni defaults.
    """
    unit = unit_id(unit)
    vision = _encoder(model, "vision")
    if isinstance(image, (list, tuple)) or np.ndim(image) != 3:
        raise relabel_error(vision_preprocess.ChannelError(
            f"image_chunk takes one [H, W, 3] image, got shape {np.shape(image)}"), unit, "image")
    pixel_values, grid = _preprocess("image", vision.config, image, unit, image_kwargs)
    features, deepstack = _vision_features(vision, pixel_values, grid, unit, "image")
    return adapter.image_unit(tuple(int(g) for g in grid[0]), unit, features, deepstack,
                              answer_tokens=answer_tokens, tokens=_omni(model))


def audio_chunk(model: Model, pcm: np.ndarray, unit: int, *, sample_rate: int = SAMPLE_RATE,
                answer_tokens: int = 0) -> Chunk:
    """`<|audio_start|> <|audio_pad|>×n <|audio_end|>` for one mono 16 kHz clip (13 tokens per second), with zero
    DeepStack levels when the model has a vision encoder."""
    unit = unit_id(unit)
    encoder = _encoder(model, "audio")
    _, features = _audio_features(encoder, pcm, sample_rate, unit)
    return adapter.audio_unit(features.shape[0], unit, features, deepstack_levels=_levels(model),
                              answer_tokens=answer_tokens, tokens=_omni(model))


def _text_kwargs(model) -> dict:
    return dict(hidden_size=model.config.hidden_size, deepstack_levels=_levels(model), tokens=_omni(model))


def system(model: Model, token_ids: Sequence[int], unit: int) -> Chunk:
    """The system prompt (every token SYSTEM), with zero embeddings and DeepStack levels."""
    return adapter.system_unit(token_ids, unit_id(unit), **_text_kwargs(model))


def text(model: Model, token_ids: Sequence[int], unit: int, answer_tokens: int = 0, *,
         answer_unit: int | None = None) -> Chunk:
    """User text (chat markers BOUNDARY), with zero embeddings and DeepStack levels; `answer_tokens` greedy tokens
    follow."""
    return adapter.text_unit(token_ids, unit_id(unit), answer_tokens, answer_unit=answer_unit, **_text_kwargs(model))


def response(model: Model, token_ids: Sequence[int], unit: int) -> Chunk:
    """A model response fed back as input, with zero embeddings and DeepStack levels."""
    return adapter.response_unit(token_ids, unit_id(unit), **_text_kwargs(model))


def frame_unit(model: Model, audio: Qwen3AudioEncoder | tuple[Any, Any], pcm: np.ndarray, unit: int,
               answer_tokens: int) -> Chunk:
    """One PCM frame (`[samples]` float32 at 16 kHz) -> its audio unit chunk, with the Qwen3-Omni processor's
    features (reflected edges, samples // 160 frames); `audio` is the encoder or its `(graphdef, params)` split."""
    features = np.asarray(encode_audio(audio, log_mel(pcm, SAMPLE_RATE, num_mel_bins=model.audio.config.num_mel_bins)),
                          np.float32)
    return layout.audio_unit(features.shape[0], unit, features, answer_tokens=answer_tokens, tokens=model.omni)


class Qwen3OmniUnits(QwenOmniUnits):
    """Qwen3-Omni units: 2 s audiovisual groups at 2 fps, interleaved M-RoPE, DeepStack levels on every chunk."""

    def __init__(self, model: Model):
        ChatUnits.__init__(self, model)
        vision = model.vision
        self.temporal_patch_size = 2 if vision is None else vision.config.temporal_patch_size
        self.levels = 0 if vision is None else vision.config.num_deepstack
        self.adapter, self.tokens = layout, layout.token_ids_of(model.omni)

    @property
    def frontend(self) -> ModuleType:
        """The module of the family's media builders (`image_chunk`, `audio_chunk`, `audiovisual_chunk`)."""
        return sys.modules[__name__]

    def _text_options(self) -> dict:
        return dict(hidden_size=self.hidden_size, tokens=self.tokens, deepstack_levels=self.levels)
