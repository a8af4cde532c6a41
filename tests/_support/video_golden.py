"""Recorded outputs of transformers' `Qwen2VLVideoProcessor` (the video processor of both Qwen2.5-Omni's and
Qwen3-Omni's HF processors), the oracle of the video preprocessing tests.

The processor needs torchvision, which cannot live beside the project's CPU torch (the index's torchvision wheels are
CUDA builds), so `data/video_processor/make.py` runs it once in a second virtual environment and records its outputs
in `data/video_processor/golden.npz` (with versions and processor settings in `golden.json`). This module holds
what both sides share: the cases and the seeded inputs, built with numpy alone (the generator's environment has no
JAX), and the loader that checks the rebuilt inputs are byte for byte the ones the processor saw.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent / "data" / "video_processor"


@dataclass(frozen=True)
class Case:
    """One video through the processor.

    Attributes:
        name: the key of its arrays in golden.npz.
        family: "qwen2_5_omni" (`Qwen2VLVideoProcessor()`, its defaults) or "qwen3_omni" (the Qwen3-Omni release's
            settings, `size` from `Qwen3OmniMoeProcessor`'s video defaults).
        kind: "noise" (every pixel drawn) or "blocky" (`block` x `block` px squares of one drawn colour: sharp edges
            for the resize, and outputs that compress).
        seed, frames, height, width, block: the recipe of the frames.
        min_pixels, max_pixels: area bounds given to both sides (the processor's `size`); None: the family default.
    """

    name: str
    family: str
    kind: str
    seed: int
    frames: int
    height: int
    width: int
    block: int = 1
    min_pixels: int | None = None
    max_pixels: int | None = None

    def video(self) -> np.ndarray:
        """The `[frames, height, width, 3]` uint8 input, deterministic for the recipe."""
        rng = np.random.default_rng(self.seed)
        if self.kind == "noise":
            return rng.integers(0, 256, (self.frames, self.height, self.width, 3), dtype=np.uint8)
        if self.kind == "blocky":
            b = self.block
            small = rng.integers(0, 256, (self.frames, -(-self.height // b), -(-self.width // b), 3), dtype=np.uint8)
            return np.ascontiguousarray(small.repeat(b, 1).repeat(b, 2)[:, :self.height, :self.width])
        raise ValueError(f"unknown video kind {self.kind!r}")

    def size_kwargs(self) -> dict[str, int]:
        """The `min_pixels` / `max_pixels` this case sets (both sides take them; the processor as `size`)."""
        return {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v is not None}


CASES = (
    # Qwen2.5-Omni: 14 px patches, CLIP mean / std, min 128 * 28 * 28 and max 768 * 28 * 28 px per frame.
    Case("q25_4_frames_default", "qwen2_5_omni", "blocky", 0, 4, 90, 120, block=15),  # upscaled to 280 x 392
    Case("q25_3_frames", "qwen2_5_omni", "noise", 1, 3, 90, 120, min_pixels=56 * 56),  # last frame repeated
    Case("q25_5_frames_100x73", "qwen2_5_omni", "noise", 2, 5, 100, 73, min_pixels=56 * 56,
         max_pixels=28 * 28 * 1280),  # odd count and odd sizes: 3 temporal patches, both sides resized
    Case("q25_large", "qwen2_5_omni", "blocky", 3, 2, 480, 640, block=32, min_pixels=56 * 56,
         max_pixels=48 * 28 * 28),  # shrunk (antialiased) to 168 x 224 to fit max_pixels
    # Qwen3-Omni: 16 px patches, mean = std = 0.5, min 128 * 32 * 32 and max 768 * 32 * 32 px per frame.
    Case("q3_4_frames_default", "qwen3_omni", "blocky", 4, 4, 90, 120, block=15),  # upscaled to 320 x 448
    Case("q3_3_frames_64x96", "qwen3_omni", "noise", 5, 3, 64, 96, min_pixels=64 * 96),  # kept at its size
    Case("q3_5_frames_100x73", "qwen3_omni", "noise", 6, 5, 100, 73, min_pixels=56 * 56),
    Case("q3_large", "qwen3_omni", "blocky", 7, 2, 720, 1280, block=48,
         max_pixels=64 * 32 * 32),  # shrunk to 192 x 320
)


def sha256(video: np.ndarray) -> str:
    """The hex digest of a video's bytes with its shape and dtype (what the generator recorded per input)."""
    digest = hashlib.sha256(f"{video.shape}{video.dtype}".encode())
    digest.update(np.ascontiguousarray(video).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Golden:
    """One case's input and the processor's output for it."""

    case: Case
    video: np.ndarray
    pixel_values_videos: np.ndarray
    video_grid_thw: np.ndarray


def load(family: str) -> tuple[list[Golden], dict]:
    """The recorded cases of `family` with their rebuilt inputs, and golden.json (versions, processor settings).

    Raises:
        AssertionError: the recorded cases or input digests differ from this module's (regenerate with make.py),
            or a case of the family is missing from golden.npz.
    """
    info = json.loads((FOLDER / "golden.json").read_text())
    recorded = {c["name"]: c for c in info["cases"]}
    out = []
    with np.load(FOLDER / "golden.npz") as arrays:
        for case in (c for c in CASES if c.family == family):
            entry = recorded.get(case.name)
            assert entry is not None, f"golden.json has no case {case.name}: rerun make.py"
            assert entry["recipe"] == _recipe(case), f"{case.name}: the recorded recipe differs: rerun make.py"
            video = case.video()
            assert sha256(video) == entry["input_sha256"], f"{case.name}: the rebuilt input is not the recorded one"
            out.append(Golden(case, video, arrays[f"{case.name}/pixel_values_videos"],
                              arrays[f"{case.name}/video_grid_thw"]))
    assert out, f"no golden cases for {family}"
    return out, info


def _recipe(case: Case) -> dict:
    """A case's fields as golden.json records them."""
    return {k: getattr(case, k) for k in case.__dataclass_fields__}
