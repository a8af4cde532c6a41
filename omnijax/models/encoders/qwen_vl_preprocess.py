"""Qwen2.5-Omni image and video preprocessing: uint8 frames -> ViT pixel rows and `grid_thw`.

Matches the Hugging Face Qwen2.5-Omni processor: each image or video is resized (bicubic) to sides that are multiples
of `patch_size * merge_size` (28 px) with `smart_resize`, rescaled by 1/255, normalised with the CLIP mean/std,
padded in time to a multiple of `temporal_patch_size` by repeating the last frame, and cut into rows of
`3 * temporal_patch_size * patch_size**2` (= 1176) values ordered (channel, time, y, x). Rows are ordered so that
the `merge_size**2` patches of one LLM token are consecutive: (t, h_block, w_block, h_in_block, w_in_block).

Two resize implementations, both bicubic with antialiasing:
- "pil": Pillow's resize, as the Qwen2-VL image processor (`Qwen2VLImageProcessor`) does. Default for images.
- "torch": a numpy re-implementation of torch's uint8 antialiased bicubic interpolation (double-precision filter
  weights rounded to int16 fixed point, horizontal pass then vertical, each rounded to uint8), which is what the
  torchvision-based Qwen2-VL video processor (`Qwen2VLVideoProcessor`) runs on CPU. Default for videos. Pillow and
  torch disagree by one grey level on roughly 1% of pixels, so each default follows its processor.

Every input problem raises a `VisionInputError` (a `ValueError`) subclass naming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Defaults of the Qwen2-VL image processor and of the Qwen2.5-Omni processor's video settings.
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESIZE_IMPLS = ("pil", "torch")


class VisionInputError(ValueError):
    """Base class of every rejected image or video input."""


class PixelDtypeError(VisionInputError):
    """Pixels are neither uint8 nor floating point in [0, 1]."""


class ChannelError(VisionInputError):
    """The array is not `[H, W, 3]` (images) or `[T, H, W, 3]` (videos)."""


class NonFinitePixelError(VisionInputError):
    """A floating-point input holds NaN or infinite values."""


class ImageTooSmallError(VisionInputError):
    """A side is shorter than one patch, or the resize rules leave less than one LLM token (28 px)."""


class AspectRatioError(VisionInputError):
    """The long side is more than 200 times the short side."""


class EmptyVideoError(VisionInputError):
    """A video has no frames (or no images were given)."""


def smart_resize(height: int, width: int, factor: int = PATCH_SIZE * MERGE_SIZE, min_pixels: int = IMAGE_MIN_PIXELS,
                 max_pixels: int = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """Target `(height, width)`: multiples of `factor`, area within `[min_pixels, max_pixels]`, aspect kept.

    Each side is first rounded to the nearest multiple of `factor` (Python `round`, half to even); if the area then
    exceeds `max_pixels` both sides shrink by the same ratio (floored to multiples of `factor`, at least `factor`),
    and if it falls below `min_pixels` both grow (ceiled).

    Raises:
        AspectRatioError: `max(height, width) / min(height, width) > 200`.
        ImageTooSmallError: a resulting side is shorter than `factor`.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise AspectRatioError(f"aspect ratio {max(height, width) / min(height, width):.1f} of a {height}x{width} "
                               f"image exceeds {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar < factor or w_bar < factor:
        raise ImageTooSmallError(f"a {height}x{width} image resizes to {h_bar}x{w_bar}, less than one "
                                 f"{factor}x{factor} token (min_pixels={min_pixels}, max_pixels={max_pixels})")
    return h_bar, w_bar


# ------------------------------------------------------------------------------------------------ torch-style resize


def _keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    """Keys' cubic convolution kernel (a = -0.5, as Pillow and torch's antialiased bicubic use)."""
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Antialiased bicubic taps of one axis: `(first_index [O], weights [O, K] int64, precision_bits)`."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    size = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first
    size = np.clip(size, 0, taps)
    j = np.arange(taps)
    w = _keys_cubic((j[None, :] + first[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j[None, :] < size[:, None], w, 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # sequential sum, as the reference kernel accumulates
        total = total + w[:, k]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    w_max = w.max()
    bits = 0
    while bits < 22 and int(0.5 + w_max * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    v = w * (1 << bits)
    fixed = np.trunc(np.where(v < 0, v - 0.5, v + 0.5)).astype(np.int64)
    return first, fixed, bits


def _resample_axis(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One fixed-point pass along `axis` of a uint8 array (int32 accumulation, as the reference kernel)."""
    in_size = x.shape[axis]
    if in_size == out_size:
        return x
    first, fixed, bits = _int16_weights(in_size, out_size)
    shape = [1] * x.ndim
    shape[axis] = out_size
    x = x.astype(np.int32)
    acc = np.full(x.shape[:axis] + (out_size,) + x.shape[axis + 1:], 1 << (bits - 1), np.int32)
    tap = np.empty_like(acc)
    for k in range(fixed.shape[1]):
        if fixed[:, k].any():
            np.take(x, np.minimum(first + k, in_size - 1), axis=axis, out=tap)  # taps past the end weigh 0
            tap *= fixed[:, k].astype(np.int32).reshape(shape)
            acc += tap
    acc >>= bits
    return np.clip(acc, 0, 255).astype(np.uint8)


def _resize_torch(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """`[T, H, W, C]` uint8 -> `[T, height, width, C]` uint8, bit-exact with torch's uint8 antialiased bicubic."""
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([_resample_axis(_resample_axis(f, width, axis=1), height, axis=0) for f in frames])


def _resize_pil(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """`[T, H, W, 3]` uint8 -> `[T, height, width, 3]` uint8 with Pillow's bicubic filter."""

    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), resample=Image.Resampling.BICUBIC))
                     for f in frames])


# ------------------------------------------------------------------------------------------------------ validation


def _as_uint8(array, what: str, ndim: int) -> np.ndarray:
    """Validates layout and values; float inputs in [0, 1] are rounded to uint8."""
    array = np.asarray(array)
    layout = "[H, W, 3]" if ndim == 3 else "[T, H, W, 3]"
    if array.ndim != ndim or array.shape[-1] != 3:
        raise ChannelError(f"{what} must be a {layout} RGB array, got shape {array.shape}")
    if array.dtype == np.uint8:
        return array
    if not np.issubdtype(array.dtype, np.floating):
        raise PixelDtypeError(f"{what} must be uint8 (or floating point in [0, 1]), got dtype {array.dtype}")
    if not np.isfinite(array).all():
        raise NonFinitePixelError(f"{what} holds {int((~np.isfinite(array)).sum())} NaN or infinite value(s)")
    if array.size and (array.min() < 0.0 or array.max() > 1.0):
        raise PixelDtypeError(f"floating-point {what} must lie in [0, 1], got [{array.min()}, {array.max()}]")
    return np.round(array.astype(np.float64) * 255.0).astype(np.uint8)


def _check_size(height: int, width: int, what: str, patch_size: int) -> None:
    if height < patch_size or width < patch_size:
        raise ImageTooSmallError(f"{what} is {height}x{width}, smaller than one {patch_size}x{patch_size} patch")


# ------------------------------------------------------------------------------------------------------- patchify


def _patchify(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int,
              mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`[T, H, W, C]` uint8 (sides multiples of patch*merge) -> `(rows [t*h*w, C*tp*p*p] float32, (t, h, w))`."""
    pad = -frames.shape[0] % temporal_patch_size
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)], axis=0)
    T, H, W, C = frames.shape
    # Per-channel lookup of every uint8 level: (level / 255 - mean) / std, computed in float64.
    table = ((np.arange(256)[:, None] / 255.0 - np.asarray(mean)) / np.asarray(std)).astype(np.float32)
    x = table[frames, np.arange(C)]
    p, m, tp = patch_size, merge_size, temporal_patch_size
    gt, gh, gw = T // tp, H // p, W // p
    x = x.reshape(gt, tp, gh // m, m, p, gw // m, m, p, C)
    # -> (t, h_block, w_block, h_in, w_in, C, tp, py, px)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return x.reshape(gt * gh * gw, C * tp * p * p), (gt, gh, gw)


def _process(frames: np.ndarray, what: str, *, min_pixels: int, max_pixels: int, resize_impl: str, patch_size: int,
             merge_size: int, temporal_patch_size: int, mean, std) -> tuple[np.ndarray, tuple[int, int, int]]:
    if resize_impl not in RESIZE_IMPLS:
        raise ValueError(f"resize_impl must be one of {RESIZE_IMPLS}, got {resize_impl!r}")
    _, height, width, _ = frames.shape
    _check_size(height, width, what, patch_size)
    h, w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    resized = (_resize_pil if resize_impl == "pil" else _resize_torch)(frames, h, w)
    return _patchify(resized, patch_size, merge_size, temporal_patch_size, mean, std)


def preprocess_images(images: np.ndarray | Sequence[np.ndarray], *, min_pixels: int = IMAGE_MIN_PIXELS,
                      max_pixels: int = IMAGE_MAX_PIXELS,
                      resize_impl: str = "pil", patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
                      temporal_patch_size: int = TEMPORAL_PATCH_SIZE, mean: Sequence[float] = CLIP_MEAN,
                      std: Sequence[float] = CLIP_STD) -> tuple[np.ndarray, np.ndarray]:
    """Images -> ViT pixel rows, like the Qwen2-VL image processor.

    Each image is its own grid entry: resized with `smart_resize`, repeated to `temporal_patch_size` frames.

    Args:
        images: one `[H, W, 3]` array or a sequence of them (sizes may differ); uint8, or floating point in [0, 1]
            (rounded to uint8 first).
        min_pixels, max_pixels: area bounds of the resized image.
        resize_impl: "pil" (as `Qwen2VLImageProcessor`) or "torch" (as the torchvision-based processors).
        patch_size, merge_size, temporal_patch_size: the vision encoder's patching.
        mean, std: per-channel normalisation after rescaling to [0, 1].

    Returns:
        `(pixel_values [N, 3 * tp * p * p] float32, grid_thw [num_images, 3] int64)`, rows of all images
        concatenated in order; `N = sum(t * h * w)`.

    Raises:
        VisionInputError: a subclass naming the problem (layout, dtype, non-finite values, size, aspect ratio).
    """
    if isinstance(images, np.ndarray) and images.ndim == 3:
        images = [images]
    images = list(images)
    if not images:
        raise EmptyVideoError("no images given")
    rows, grids = [], []
    for i, image in enumerate(images):
        frames = _as_uint8(image, f"image {i}", 3)[None]
        r, g = _process(frames, f"image {i}", min_pixels=min_pixels, max_pixels=max_pixels, resize_impl=resize_impl,
                        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                        mean=mean, std=std)
        rows.append(r)
        grids.append(g)
    return np.concatenate(rows), np.asarray(grids, np.int64)


def preprocess_video(frames: np.ndarray | Sequence[np.ndarray], *, min_pixels: int = VIDEO_MIN_PIXELS,
                     max_pixels: int = VIDEO_MAX_PIXELS,
                     resize_impl: str = "torch", patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
                     temporal_patch_size: int = TEMPORAL_PATCH_SIZE, mean: Sequence[float] = CLIP_MEAN,
                     std: Sequence[float] = CLIP_STD) -> tuple[np.ndarray, np.ndarray]:
    """One video (already sampled frames) -> ViT pixel rows, like the Qwen2-VL video processor.

    All frames share one resize; a frame count that is not a multiple of `temporal_patch_size` is padded by
    repeating the last frame. Frame sampling (fps) is the caller's business.

    Args:
        frames: `[T, H, W, 3]` array or a sequence of `[H, W, 3]` frames of one size; uint8, or floating point in
            [0, 1].
        min_pixels, max_pixels: area bounds of each resized frame.
        resize_impl: "torch" (as `Qwen2VLVideoProcessor`) or "pil".
        patch_size, merge_size, temporal_patch_size, mean, std: as in `preprocess_images`.

    Returns:
        `(pixel_values [t * h * w, 3 * tp * p * p] float32, grid_thw [1, 3] int64)`.

    Raises:
        EmptyVideoError: no frames.
        VisionInputError: another subclass naming the problem.
    """
    if not isinstance(frames, np.ndarray):
        frames = list(frames)
        if not frames:
            raise EmptyVideoError("the video has no frames")
        shapes = {np.shape(f) for f in frames}
        if len(shapes) > 1:
            raise ChannelError(f"video frames differ in shape: {sorted(shapes)}")
        frames = np.stack([np.asarray(f) for f in frames])
    if frames.ndim == 4 and frames.shape[0] == 0:
        raise EmptyVideoError("the video has no frames")
    video = _as_uint8(frames, "video", 4)
    rows, grid = _process(video, "video", min_pixels=min_pixels, max_pixels=max_pixels, resize_impl=resize_impl,
                          patch_size=patch_size, merge_size=merge_size, temporal_patch_size=temporal_patch_size,
                          mean=mean, std=std)
    return rows, np.asarray([grid], np.int64)
