"""Image files: `read_image` (a path or the file's bytes -> `[H, W, 3]` uint8 RGB)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def read_image(source: str | Path | bytes) -> np.ndarray:
    """`[H, W, 3]` uint8 RGB of an image file (PNG, JPEG, ...): a path, or the file's bytes; a ValueError naming
    the path when PIL cannot read it."""

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError) as e:
        where = "the image could not be decoded" if isinstance(source, bytes) else f"{source}: not a readable image"
        raise ValueError(f"{where} ({e})") from None


__all__ = ["read_image"]
