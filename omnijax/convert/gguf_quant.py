"""GGUF's Q8_0, Q4_0 and Q4_1 tensors repacked into `omnijax.kernels.quant.QuantizedWeight` without a float round
trip: the integer codes are moved (never dequantised and requantised) and the float16 block scales kept, so
`dequantize` of the result equals `gguf.quants.dequantize` of the blocks bit for bit in float32 (Q4_0 but for the
sign of an exact zero: gguf's `d * (q - 8)` gives -0.0 where the repack's `q * d + (-8 d)` gives +0.0).

GGUF stores a weight as rows of the output axis (`[..., out, in]` in numpy order, the HF layout), each row cut into
32-element blocks along the input axis:

- Q8_0, 34 bytes a block: float16 `d`, 32 int8 codes; `w = d * q` -> `Int8Grouped(32)`, scales `d`.
- Q4_0, 18 bytes: float16 `d`, 16 bytes of nibbles; `w = d * (q - 8)` -> `Int4Grouped(32)`, scales `d`, offsets
  `-8 d` (float16, exact: a power-of-two multiple; float32 for a tensor where it would overflow float16).
- Q4_1, 20 bytes: float16 `d` and `m`, 16 bytes of nibbles; `w = d * q + m` -> `Int4Grouped(32)`, scales `d`,
  offsets `m`.

Byte `j` of a block holds element `j` in its low nibble and `j + 16` in its high one, which is omnijax's int4 order
inside a group, so the nibbles are only transposed to the decoder's `[..., in, out]` layout. This module needs numpy
only (not the `gguf` package).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omnijax.kernels.quant import Int4Grouped, Int8Grouped, QuantizedWeight, check_quantized

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2}

__all__ = ["BLOCK_BYTES", "from_gguf", "from_gguf_q4_0", "from_gguf_q4_1", "from_gguf_q8_0"]


def _blocks(raw_blocks: np.ndarray, shape: Sequence[int], kind: str) -> np.ndarray:
    """`raw_blocks` as `[..., out, in // 32, bytes]` uint8, after checking its size against `shape`."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(f"{kind}: shape must be [..., out, in] with positive sizes, got {shape}")
    if shape[-1] % BLOCK:
        raise ValueError(f"{kind}: the input width {shape[-1]} is not a multiple of the block size {BLOCK}")
    raw = np.asarray(raw_blocks)
    if raw.dtype != np.uint8:
        raise ValueError(f"{kind}: raw_blocks must be uint8 bytes, got {raw.dtype}")
    want = int(np.prod(shape[:-1])) * (shape[-1] // BLOCK) * BLOCK_BYTES[kind]
    if raw.size != want:
        raise ValueError(f"{kind}: raw_blocks holds {raw.size} bytes; shape {shape} needs {want} "
                         f"({BLOCK_BYTES[kind]} bytes per block of {BLOCK})")
    return np.ascontiguousarray(raw).reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK_BYTES[kind])


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block: `[..., out, nb]`."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def _to_decoder(a: np.ndarray) -> np.ndarray:
    """`[..., out, k]` -> `[..., k, out]` (contiguous)."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def _nibbles(blocks: np.ndarray, start: int) -> np.ndarray:
    """The packed nibbles from byte `start` on, as omnijax's `[..., in // 2, out]` uint8."""
    packed = blocks[..., start:]  # [..., out, nb, 16]
    return _to_decoder(packed.reshape(*packed.shape[:-2], -1))


def from_gguf_q8_0(raw_blocks: np.ndarray, shape: Sequence[int]) -> QuantizedWeight:
    """A Q8_0 tensor of float shape `[..., out, in]` as an `Int8Grouped(32)` weight `[..., in, out]`.

    Raises:
        ValueError: the input width is not a multiple of 32, or the byte count does not match `shape`.
    """
    blocks = _blocks(raw_blocks, shape, "Q8_0")
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)  # [..., out, nb, 32]
    qw = QuantizedWeight(_to_decoder(codes.reshape(*codes.shape[:-2], -1)), _to_decoder(_f16(blocks, 0)), None,
                         Int8Grouped(BLOCK))
    check_quantized(qw)
    return qw


def from_gguf_q4_0(raw_blocks: np.ndarray, shape: Sequence[int]) -> QuantizedWeight:
    """A Q4_0 tensor of float shape `[..., out, in]` as an `Int4Grouped(32)` weight `[..., in, out]` (offsets `-8 d`).

    Raises:
        ValueError: the input width is not a multiple of 32, or the byte count does not match `shape`.
    """
    blocks = _blocks(raw_blocks, shape, "Q4_0")
    d = _f16(blocks, 0)
    with np.errstate(over="ignore"):
        offsets = d * np.float16(-8)
    if not np.isfinite(offsets[np.isfinite(d)]).all():
        offsets = d.astype(np.float32) * np.float32(-8)  # exact in float32 where -8 d overflows float16
    qw = QuantizedWeight(_nibbles(blocks, 2), _to_decoder(d), _to_decoder(offsets), Int4Grouped(BLOCK))
    check_quantized(qw)
    return qw


def from_gguf_q4_1(raw_blocks: np.ndarray, shape: Sequence[int]) -> QuantizedWeight:
    """A Q4_1 tensor of float shape `[..., out, in]` as an `Int4Grouped(32)` weight `[..., in, out]` (offsets `m`).

    Raises:
        ValueError: the input width is not a multiple of 32, or the byte count does not match `shape`.
    """
    blocks = _blocks(raw_blocks, shape, "Q4_1")
    qw = QuantizedWeight(_nibbles(blocks, 4), _to_decoder(_f16(blocks, 0)), _to_decoder(_f16(blocks, 2)),
                         Int4Grouped(BLOCK))
    check_quantized(qw)
    return qw


_REPACK = {"Q8_0": from_gguf_q8_0, "Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1}


def from_gguf(raw_blocks: np.ndarray, shape: Sequence[int], type_name: str) -> QuantizedWeight:
    """Repacks a tensor of GGUF quantisation type `type_name` (`"Q8_0"`, `"Q4_0"` or `"Q4_1"`).

    Raises:
        ValueError: any other type, named (it must be dequantised or requantised instead), or a bad size.
    """
    if type_name not in _REPACK:
        raise ValueError(f"GGUF type {type_name!r} cannot be repacked without a float round trip; "
                         f"repackable: {sorted(_REPACK)}")
    return _REPACK[type_name](raw_blocks, shape)
