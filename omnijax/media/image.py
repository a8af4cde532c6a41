"""Image files: `read_image` (a path or the file's bytes -> `[H, W, 3]` uint8 RGB).

Transparency is composited on white, as the model releases' preprocessing does (qwen-omni-utils' `to_rgb` pastes an
RGBA image on a white background): a transparent pixel is white, not the colour PIL happens to store under it (often
black), and a half-transparent one is its colour blended half with white. This covers every way an image carries
transparency: an alpha band (RGBA, LA, PA, premultiplied RGBa / La), and a palette or grey/RGB image with a
transparent colour (PNG `tRNS`, GIF transparency index)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

# The most pixels an image may have (50 MP, e.g. 8660x5773): checked from the file's header before decoding, so a small
# file claiming 20000x20000 is refused without allocating its 1.2 GB of pixels. The models' processors downscale far
# below this anyway.
MAX_IMAGE_PIXELS = 50_000_000


class ImageTooLarge(ValueError):
    """An image with more pixels than `MAX_IMAGE_PIXELS`."""


def read_image(source: str | Path | bytes) -> np.ndarray:
    """`[H, W, 3]` uint8 RGB of an image file (PNG, JPEG, ...): a path, or the file's bytes; a ValueError naming
    the path when PIL cannot read it."""

    try:
        with warnings.catch_warnings():  # PIL's decompression-bomb warning: the cap below decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        with opened as image:
            width, height = image.size  # from the header: nothing is decoded yet
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageTooLarge(f"the image is {width}x{height} = {width * height:,} pixels, over the "
                                    f"{MAX_IMAGE_PIXELS:,} accepted (MAX_IMAGE_PIXELS); downscale it first")
            return np.asarray(_on_white(image))
    except ImageTooLarge:
        raise
    except Image.DecompressionBombError as e:  # PIL refuses to open far larger ones itself
        raise ImageTooLarge(f"the image has more than the {MAX_IMAGE_PIXELS:,} pixels accepted (MAX_IMAGE_PIXELS): "
                            f"{e}") from None
    except (OSError, ValueError) as e:
        where = "the image could not be decoded" if isinstance(source, bytes) else f"{source}: not a readable image"
        # PIL names an unknown format by the file object it was given ("<_io.BytesIO object at 0x...>"): say what
        # was expected instead
        why = ("not in an image format PIL reads: PNG, JPEG, WebP, GIF, BMP, TIFF, ..."
               if isinstance(e, UnidentifiedImageError) else str(e))
        raise ValueError(f"{where} ({why})") from None


def _on_white(image: Image.Image) -> Image.Image:
    """`image` as RGB, any transparency composited on a white background."""
    if not {"A", "a"} & set(image.getbands()) and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = image.convert("RGBA")  # a palette's or a colour key's transparency becomes alpha here
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


__all__ = ["ImageTooLarge", "MAX_IMAGE_PIXELS", "read_image"]
