"""MiniCPM-o 4.5 image preprocessing in numpy: slicing, bicubic resizing, normalisation and NaViT patch strips.

Follows the release's `MiniCPMVImageProcessor` (`processing_minicpmo.py`) for
`slice_config {max_slice_nums 9, scale_resolution 448, patch_size 14}`:

1. Grid choice (`get_sliced_grid`): with `ratio = W * H / scale_resolution**2` and
   `multiple = min(ceil(ratio), max_slice_nums)`, an image with `multiple <= 1` is not sliced. Otherwise every
   factorisation `[cols, rows]` of `multiple - 1`, `multiple` and `multiple + 1` (skipping 1 and counts above
   `max_slice_nums`) is a candidate, and the first one (in that order, `cols` ascending) minimising
   `|log(W / H) - log(cols / rows)|` wins.
2. Source image (`find_best_resize`): if the area exceeds `scale_resolution**2` (or the image is not sliced, which
   allows upscaling) the size becomes `h = int(scale_resolution / sqrt(W / H))`, `w = int(h * W / H)`; each side is
   then rounded to a multiple of `patch_size` (Python `round`, half to even, at least one patch).
3. Slices (`get_refine_size`): the image is resized (upscaling allowed) to `cols x rows` times the best size of one
   cell and cut row by row into `cols * rows` crops.
4. Every image (source first, then slices row-major) is resized with Pillow's bicubic filter (the reference's
   `PIL.Image.resize(..., BICUBIC)`), scaled as `(x / 255 - mean) / std` in float32 (mean = std = 0.5) and laid out
   as one 14-pixel-high strip: `pv[c, y, p * 14 + x] = img[c, r * 14 + y, q * 14 + x]` with patch index
   `p = r * cols + q` (row-major over the patch grid); its target size is `(rows, cols)` in patches.

`patch_rows` then pads the strips of a batch to the longest one, as `MiniCPMO.get_vision_embedding` does, and returns
one `C * p * p` row per patch (ordered channel, y, x: the layout of the flattened patch-embedding convolution) and
the patch attention mask.

Input quirks kept from the reference: floating-point pixels in [0, 1] are scaled by 255 and truncated (not rounded)
to uint8; Pillow images of any mode are converted to RGB. Every input problem raises an `ImageInputError` (a
`ValueError`) subclass naming the offending image.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

PATCH_SIZE = 14
SCALE_RESOLUTION = 448
MAX_SLICE_NUMS = 9
NORM_MEAN = (0.5, 0.5, 0.5)
NORM_STD = (0.5, 0.5, 0.5)


class ImageInputError(ValueError):
    """Base class of every rejected image input."""


class EmptyImageError(ImageInputError):
    """The image has zero area (a side of 0 px), or no image was given."""


class ImageLayoutError(ImageInputError):
    """The array is not an `[H, W, 3]` RGB image."""


class ImageDtypeError(ImageInputError):
    """Pixels are neither integers in [0, 255] nor floating point in [0, 1] (or are NaN / infinite)."""


class PixelValuesError(ImageInputError):
    """Preprocessed pixel strips do not match their target sizes."""


# --------------------------------------------------------------------------------------------------- size rules


def ensure_divide(length: float, patch_size: int) -> int:
    """`length` rounded to a multiple of `patch_size` (Python `round`, half to even), at least `patch_size`."""
    return max(round(length / patch_size) * patch_size, patch_size)


def find_best_resize(width: float, height: float, scale_resolution: int = SCALE_RESOLUTION,
                     patch_size: int = PATCH_SIZE, allow_upscale: bool = False) -> tuple[int, int]:
    """`(width, height)` of an image scaled to about `scale_resolution**2` pixels, sides multiples of `patch_size`.

    Images at most `scale_resolution**2` in area keep their size (up to the rounding) unless `allow_upscale`.
    """
    if width * height > scale_resolution * scale_resolution or allow_upscale:
        r = width / height
        height = int(scale_resolution / math.sqrt(r))
        width = int(height * r)
    return ensure_divide(width, patch_size), ensure_divide(height, patch_size)


def get_refine_size(width: int, height: int, grid: tuple[int, int], scale_resolution: int = SCALE_RESOLUTION,
                    patch_size: int = PATCH_SIZE, allow_upscale: bool = False) -> tuple[int, int]:
    """`(width, height)` the image is resized to before being cut into `grid = (cols, rows)` slices."""
    cols, rows = grid
    refine_width = ensure_divide(width, cols)
    refine_height = ensure_divide(height, rows)
    cell_w, cell_h = find_best_resize(refine_width / cols, refine_height / rows, scale_resolution, patch_size,
                                      allow_upscale=allow_upscale)
    return cell_w * cols, cell_h * rows


def get_sliced_grid(width: int, height: int, max_slice_nums: int = MAX_SLICE_NUMS,
                    scale_resolution: int = SCALE_RESOLUTION, never_split: bool = False) -> tuple[int, int] | None:
    """The slice grid `(cols, rows)` the release chooses for a `width x height` image, or None (no slices)."""
    log_ratio = math.log(width / height)
    ratio = width * height / (scale_resolution * scale_resolution)
    multiple = min(math.ceil(ratio), max_slice_nums)
    if multiple <= 1 or never_split:
        return None
    candidates = [i for i in (multiple - 1, multiple, multiple + 1) if i != 1 and i <= max_slice_nums]
    grids = [(m, n // m) for n in candidates for m in range(1, n + 1) if n % m == 0]
    best, min_error = (1, 1), float("inf")
    for grid in grids:
        error = abs(log_ratio - math.log(grid[0] / grid[1]))
        if error < min_error:
            best, min_error = grid, error
    return best


# ---------------------------------------------------------------------------------------------------- images


def to_rgb_uint8(image: np.ndarray | Image.Image, what: str = "image") -> np.ndarray:
    """A Pillow image or an `[H, W, 3]` array -> `[H, W, 3]` uint8 RGB, validated.

    Integer arrays must hold values in [0, 255]; floating-point arrays values in [0, 1], which are scaled by 255 and
    truncated to uint8 as the reference's `to_pil_image` does.

    Raises:
        ImageLayoutError, ImageDtypeError, EmptyImageError: naming `what`.
    """
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise EmptyImageError(f"{what} has zero area ({image.width}x{image.height} px, width x height)")
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ImageLayoutError(f"{what} must be an [H, W, 3] RGB array (or a PIL image), got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise EmptyImageError(f"{what} has zero area ({array.shape[1]}x{array.shape[0]} px, width x height)")
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer)
                                       or np.issubdtype(array.dtype, np.floating)):
        raise ImageDtypeError(f"{what} must hold uint8 (or floating point in [0, 1]) pixels, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ImageDtypeError(f"{what} holds {int((~np.isfinite(array)).sum())} NaN or infinite value(s)")
        if array.min() < 0.0 or array.max() > 1.0:
            raise ImageDtypeError(f"floating-point {what} must lie in [0, 1], got [{array.min()}, {array.max()}]")
        return (array * 255).astype(np.uint8)  # truncation, as the reference
    if array.min() < 0 or array.max() > 255:
        raise ImageDtypeError(f"integer {what} must lie in [0, 255], got [{array.min()}, {array.max()}]")
    return array.astype(np.uint8)


def resize_bicubic(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """`[H, W, 3]` uint8 -> `[height, width, 3]` uint8 with Pillow's bicubic filter (as the reference)."""
    return np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling.BICUBIC))


def slice_image(image: np.ndarray, max_slice_nums: int = MAX_SLICE_NUMS, scale_resolution: int = SCALE_RESOLUTION,
                patch_size: int = PATCH_SIZE, never_split: bool = False
                ) -> tuple[np.ndarray, list[list[np.ndarray]], tuple[int, int] | None]:
    """Source image and slices of one `[H, W, 3]` uint8 image.

    Returns:
        `(source [h, w, 3], slices, grid)`: `slices[row][col]` are `[h', w', 3]` crops (empty when `grid` is None),
        `grid = (cols, rows)` or None.
    """
    height, width = image.shape[:2]
    grid = get_sliced_grid(width, height, max_slice_nums, scale_resolution, never_split)
    if grid is None:
        w, h = find_best_resize(width, height, scale_resolution, patch_size, allow_upscale=True)
        return resize_bicubic(image, w, h), [], None
    w, h = find_best_resize(width, height, scale_resolution, patch_size)
    source = resize_bicubic(image, w, h)
    rw, rh = get_refine_size(width, height, grid, scale_resolution, patch_size, allow_upscale=True)
    refined = resize_bicubic(image, rw, rh)
    cell_w, cell_h = rw // grid[0], rh // grid[1]
    slices = [[refined[i:i + cell_h, j:j + cell_w] for j in range(0, rw, cell_w)] for i in range(0, rh, cell_h)]
    return source, slices, grid


def normalize(image: np.ndarray, mean: Sequence[float] = NORM_MEAN, std: Sequence[float] = NORM_STD) -> np.ndarray:
    """`[H, W, C]` uint8 -> `[C, H, W]` float32 `(x / 255 - mean) / std`, with the reference's float32 rounding."""
    levels = np.arange(256, dtype=np.float32) / 255
    table = ((levels[:, None] - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).astype(np.float32)
    return table[image, np.arange(image.shape[-1])].transpose(2, 0, 1)


def reshape_by_patch(image: np.ndarray, patch_size: int = PATCH_SIZE) -> np.ndarray:
    """`[C, H, W]` -> `[C, p, (H / p) * (W / p) * p]`: patches side by side in one strip, row-major."""
    c, h, w = image.shape
    p = patch_size
    x = image.reshape(c, h // p, p, w // p, p).transpose(0, 2, 1, 3, 4)  # [C, y, r, q, x]
    return np.ascontiguousarray(x.reshape(c, p, -1))


@dataclasses.dataclass(frozen=True)
class SlicedImage:
    """Processor output for one image.

    Attributes:
        pixel_values: `[C, p, n_i * p]` float32 strips, source image first, then slices row by row.
        tgt_sizes: `[len(pixel_values), 2]` int64 patches per strip as (rows, cols).
        grid: slice grid `(cols, rows)`, or None when the image is not sliced.
        source_size: `(width, height)` of the resized source image in px.
        slice_size: `(width, height)` of each slice in px, or None.
    """

    pixel_values: tuple[np.ndarray, ...]
    tgt_sizes: np.ndarray
    grid: tuple[int, int] | None
    source_size: tuple[int, int]
    slice_size: tuple[int, int] | None

    @property
    def num_slices(self) -> int:
        return len(self.pixel_values) - 1


def preprocess_image(image: np.ndarray | Image.Image, *, max_slice_nums: int = MAX_SLICE_NUMS,
                     scale_resolution: int = SCALE_RESOLUTION,
                     patch_size: int = PATCH_SIZE, never_split: bool = False,
                     mean: Sequence[float] = NORM_MEAN, std: Sequence[float] = NORM_STD,
                     what: str = "image") -> SlicedImage:
    """One image -> its source strip and slice strips, like `MiniCPMVImageProcessor.preprocess`.

    Args:
        image: `[H, W, 3]` uint8 array (or floating point in [0, 1], or a PIL image).
        max_slice_nums: at most this many slices (9 in chat, 1 in the duplex stream: no slices).
        scale_resolution: side of the target area in px.
        patch_size: SigLIP patch side.
        never_split: never slice.
        mean, std: per-channel normalisation after scaling to [0, 1].
        what: name of the image in error messages.

    Raises:
        ImageInputError: a subclass naming the problem (layout, dtype, zero area).
    """
    if int(max_slice_nums) < 1:
        raise ValueError(f"max_slice_nums must be at least 1, got {max_slice_nums}")
    rgb = to_rgb_uint8(image, what)
    source, slices, grid = slice_image(rgb, int(max_slice_nums), scale_resolution, patch_size, never_split)
    images = [source] + [s for row in slices for s in row]
    strips, sizes = [], []
    for img in images:
        chw = normalize(img, mean, std)
        strips.append(reshape_by_patch(chw, patch_size))
        sizes.append((chw.shape[1] // patch_size, chw.shape[2] // patch_size))
    slice_size = None if grid is None else (images[1].shape[1], images[1].shape[0])
    return SlicedImage(pixel_values=tuple(strips), tgt_sizes=np.asarray(sizes, np.int64), grid=grid,
                       source_size=(source.shape[1], source.shape[0]), slice_size=slice_size)


def preprocess_images(images: np.ndarray | Image.Image | list[np.ndarray | Image.Image]
                      | tuple[np.ndarray | Image.Image, ...], **kwargs: Any) -> list[SlicedImage]:
    """Several images (a sequence, or one image) -> one `SlicedImage` each; keyword arguments as `preprocess_image`.

    Raises:
        EmptyImageError: no images.
        ImageInputError: a subclass naming the problem and the image's index.
    """
    if isinstance(images, np.ndarray) and images.ndim == 3:
        images = [images]
    elif not isinstance(images, (list, tuple)):
        images = [images]
    if len(images) == 0:
        raise EmptyImageError("no images given")
    return [preprocess_image(img, what=f"image {i}", **kwargs) for i, img in enumerate(images)]


# ------------------------------------------------------------------------------------------------ model input


def check_strips(pixel_values: Sequence[np.ndarray], tgt_sizes: npt.ArrayLike, patch_size: int = PATCH_SIZE,
                 num_channels: int = 3) -> np.ndarray:
    """Validates strips against their target sizes; returns `tgt_sizes` as int64 `[n, 2]`."""
    sizes = np.asarray(tgt_sizes)
    if sizes.ndim != 2 or sizes.shape[1] != 2 or not np.issubdtype(sizes.dtype, np.integer):
        raise PixelValuesError(f"tgt_sizes must be an integer [n, 2] array, got {sizes.dtype} {sizes.shape}")
    if len(pixel_values) != sizes.shape[0] or sizes.shape[0] == 0:
        raise PixelValuesError(f"{len(pixel_values)} pixel strips for {sizes.shape[0]} target sizes "
                               "(need the same positive number)")
    if (sizes < 1).any():
        raise PixelValuesError(f"target sizes must be positive, got {sizes.tolist()}")
    for i, (pv, (h, w)) in enumerate(zip(pixel_values, sizes.tolist())):
        want = (num_channels, patch_size, h * w * patch_size)
        if tuple(np.shape(pv)) != want:
            raise PixelValuesError(f"pixel strip {i} has shape {tuple(np.shape(pv))}, its target size {(h, w)} "
                                   f"implies {want}")
    return sizes.astype(np.int64)


def patch_attention_mask(tgt_sizes: npt.ArrayLike, max_patches: int | None = None) -> np.ndarray:
    """`[n, 1, max_patches]` bool: True for the first `rows * cols` patches of each strip (the reference's layout)."""
    sizes = np.asarray(tgt_sizes, np.int64)
    counts = sizes[:, 0] * sizes[:, 1]
    length = int(counts.max()) if max_patches is None else int(max_patches)
    if length < counts.max():
        raise ValueError(f"max_patches={length} is shorter than the longest strip ({int(counts.max())} patches)")
    return (np.arange(length)[None, :] < counts[:, None])[:, None, :]


def pad_strips(pixel_values: Sequence[np.ndarray], max_patches: int | None = None,
               patch_size: int = PATCH_SIZE) -> np.ndarray:
    """Strips -> `[n, C, p, max_patches * p]` float32, zero-padded on the right (the tensor the model's `vpm` sees)."""
    longest = max(np.shape(pv)[2] for pv in pixel_values) // patch_size
    length = longest if max_patches is None else int(max_patches)
    c = np.shape(pixel_values[0])[0]
    out = np.zeros((len(pixel_values), c, patch_size, length * patch_size), np.float32)
    for i, pv in enumerate(pixel_values):
        out[i, :, :, :np.shape(pv)[2]] = pv
    return out


def patch_rows(pixel_values: Sequence[np.ndarray], tgt_sizes: npt.ArrayLike, max_patches: int | None = None,
               patch_size: int = PATCH_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Strips -> `(patches [n, L, C * p * p] float32, mask [n, L] bool)`, padded to `L = max_patches` (default: the
    longest strip). Row `j` of strip `i` is patch `j` flattened as (channel, y, x); padded rows are zero.

    Raises:
        PixelValuesError: strips and target sizes disagree.
    """
    num_channels = np.shape(pixel_values[0])[0] if len(pixel_values) else 3
    sizes = check_strips(pixel_values, tgt_sizes, patch_size, num_channels)
    mask = patch_attention_mask(sizes, max_patches)[:, 0]
    padded = pad_strips(pixel_values, mask.shape[1], patch_size)  # [n, C, p, L * p]
    n, c, p, _ = padded.shape
    rows = padded.reshape(n, c, p, -1, p).transpose(0, 3, 1, 2, 4).reshape(n, -1, c * p * p)
    return np.ascontiguousarray(rows), mask
