"""Host-side (numpy) plan of MiniCPM-o 4.5's vision path: which patches of each padded strip are real, their NaViT
position ids in the learned table, and the resampler's 2D sin-cos key positions (`vision_plan` -> `VisionPlan`).

The position ids reproduce the reference's float32 arithmetic, down to the ulp-level quirks of torch's CPU `arange`
kernel (`torch_arange_f32`). The modules that consume the plan live in `omnijax.models.minicpmo.vision`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from omnijax.models.minicpmo import image_preprocess
from omnijax.models.minicpmo.vision_config import VisionConfig

__all__ = ["TORCH_ARANGE_VECTOR_WIDTH", "VisionPlan", "navit_position_ids", "sincos_2d", "torch_arange_f32",
           "vision_plan"]

# Width of the CPU SIMD vector (float32 lanes) torch's `arange` kernel used when the reference computed NaViT
# position ids: 8 on AVX2 machines (the golden vectors' machine), 16 on AVX-512, 4 on NEON. See `torch_arange_f32`.
TORCH_ARANGE_VECTOR_WIDTH = 8


def torch_arange_f32(start: float, end: float, step: float,
                     vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> np.ndarray:
    """`torch.arange(start, end, step)` with a float32 result, element for element as torch's CPU kernel writes it.

    The length is `ceil((end - start) / step)` in double. Element `i` is `float(start + step * i)` computed in
    double, except inside the kernel's vectorised main loop (blocks of `2 * vector_width` elements), where each
    vector of `vector_width` lanes starting at `b` holds `float(double(float(start + step * b)) + k * step)`. The
    two differ by one float32 ulp now and then, which decides a bucket when a coordinate sits on a boundary.
    `vector_width = 0` gives the scalar path everywhere.
    """
    n = max(int(math.ceil((end - start) / step)), 0)
    out = (start + step * np.arange(n, dtype=np.float64)).astype(np.float32)
    if vector_width:
        vectorised = (n // (2 * vector_width)) * 2 * vector_width
        lanes = np.arange(vector_width, dtype=np.float64) * step
        for b in range(0, vectorised, vector_width):
            base = np.float64(np.float32(start + step * b))
            out[b:b + vector_width] = (base + lanes).astype(np.float32)
    return out


def navit_position_ids(tgt_sizes: npt.ArrayLike, num_patches_per_side: int, max_patches: int | None = None,
                       vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> np.ndarray:
    """SigLIP position id of every patch, `[n, max_patches]` int64 (padded patches get 0).

    For a `rows x cols` grid the fractional coordinates `arange(0, 1 - 1e-6, 1 / rows)` (step = the float32
    reciprocal) are bucketised (right=True) against the float32 boundaries `arange(1/S, 1, 1/S)`,
    `S = num_patches_per_side`, in float32 as the reference does; id = bucket_row * S + bucket_col (row-major).
    """
    sizes = np.asarray(tgt_sizes, np.int64)
    counts = sizes[:, 0] * sizes[:, 1]
    length = int(counts.max()) if max_patches is None else int(max_patches)
    S = int(num_patches_per_side)
    boundaries = torch_arange_f32(1 / S, 1.0, 1 / S, vector_width)
    ids = np.zeros((len(sizes), length), np.int64)

    def buckets(n: int) -> np.ndarray:
        step = float(np.float32(1) / np.float32(n))
        coords = torch_arange_f32(0.0, 1 - 1e-6, step, vector_width)
        return np.searchsorted(boundaries, coords, side="right")

    for i, (rows, cols) in enumerate(sizes.tolist()):
        ids[i, :rows * cols] = (buckets(rows)[:, None] * S + buckets(cols)[None, :]).reshape(-1)
    return ids


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """`[..., dim]` float32: `[sin(pos * w), cos(pos * w)]`, `w_i = 1 / 10000**(i / (dim / 2))`, numpy float32 math."""
    omega = np.arange(dim // 2, dtype=np.float32)
    omega /= dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("hw,d->hwd", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=-1)


def sincos_2d(embed_dim: int, rows: int, cols: int) -> np.ndarray:
    """The resampler's key position table for a `rows x cols` grid, `[rows * cols, embed_dim]` float32 (row-major).

    Dims `[0, E/2)` encode the column, `[E/2, E)` the row, each as `[sin, cos]` halves (`get_2d_sincos_pos_embed`).
    """
    grid_w, grid_h = np.meshgrid(np.arange(cols, dtype=np.float32), np.arange(rows, dtype=np.float32))
    emb = np.concatenate([_sincos_1d(embed_dim // 2, grid_w), _sincos_1d(embed_dim // 2, grid_h)], axis=-1)
    return emb.reshape(rows * cols, embed_dim).astype(np.float32)


class VisionPlan(NamedTuple):
    """Host-built arrays for one batch of strips (n strips padded to L patches).

    Attributes:
        patch_mask: `[n, L]` bool, True for real patches.
        position_ids: `[n, L]` int32 rows of the learned position table (0 on padding).
        key_pos: `[n, L, embed_dim]` float32 resampler key positions (0 on padding).
    """

    patch_mask: np.ndarray
    position_ids: np.ndarray
    key_pos: np.ndarray


def vision_plan(tgt_sizes: npt.ArrayLike, config: VisionConfig, max_patches: int | None = None,
                vector_width: int = TORCH_ARANGE_VECTOR_WIDTH) -> VisionPlan:
    """Patch mask, NaViT position ids and resampler key positions for `tgt_sizes` (`[n, 2]` rows, cols)."""
    sizes = np.asarray(tgt_sizes)
    if sizes.ndim != 2 or sizes.shape[1] != 2 or sizes.shape[0] == 0 or not np.issubdtype(sizes.dtype, np.integer):
        raise ValueError(f"tgt_sizes must be a non-empty integer [n, 2] array, got {sizes.dtype} {sizes.shape}")
    if (sizes < 1).any():
        raise ValueError(f"tgt_sizes must be positive, got {sizes.tolist()}")
    mask = image_preprocess.patch_attention_mask(sizes, max_patches)[:, 0]
    length = mask.shape[1]
    ids = navit_position_ids(sizes, config.num_patches_per_side, length, vector_width)
    key_pos = np.zeros((len(sizes), length, config.embed_dim), np.float32)
    for i, (rows, cols) in enumerate(sizes.tolist()):
        key_pos[i, :rows * cols] = sincos_2d(config.embed_dim, rows, cols)
    return VisionPlan(patch_mask=mask, position_ids=ids.astype(np.int32), key_pos=key_pos)
