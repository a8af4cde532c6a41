"""GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors repacked into `omnijax.kernels.quant.QuantizedWeight` without a
float round trip: the integer codes are moved (never dequantised and requantised) and the float16 block scales kept
(for the K-quants, folded exactly into float32 group scales: below), so
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
inside a group, so the nibbles are only transposed to the decoder's `[..., in, out]` layout.

The K-quants cut each row into super-blocks of 256 elements:

- Q4_K, 144 bytes: float16 `d` and `dmin`, 12 bytes holding eight 6-bit scales `sc` and eight 6-bit mins `m` (one
  of each per 32-element sub-block), 128 bytes of nibbles; `w = (d sc) q - (dmin m)` -> `Int4Grouped(32)`, scales
  `d sc` and offsets `-(dmin m)` in float32. Both products are exact in float32 (11 + 6 significant bits), as is
  `q (d sc)` (4 more), so the dequantised weight is gguf's bit for bit. In each 64-element half-pair the 32 bytes
  hold sub-block `2c` in their low nibbles and `2c + 1` in their high ones; the codes are re-paired into omnijax's
  order (integer shuffles only).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit high parts, sixteen int8 scales `sc` (one per 16-element
  sub-block), float16 `d`; `w = (d sc) (q - 32)` -> `Int8Grouped(16)`, codes `q - 32` in [-32, 31], scales `d sc`
  in float32 (exact: 11 + 8 significant bits), so again bit for bit.

Kept K-quants cost more bytes than in the file (float32 scales and offsets per 32 or 16 values: Q4_K 6 bits a value
against the file's 4.5, Q6_K 10 against 6.56) and still a fraction of float32's 32. This module needs numpy only (not
the `gguf` package).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omnijax.kernels.quant import Int4Grouped, Int8Grouped, QuantizedWeight, check_quantized

BLOCK = 32
QK_K = 256  # elements of a K-quant super-block
BLOCK_BYTES = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2, "Q4_K": 4 + 12 + QK_K // 2,
               "Q6_K": QK_K // 2 + QK_K // 4 + QK_K // 16 + 2}
BLOCK_ELEMENTS = {"Q8_0": BLOCK, "Q4_0": BLOCK, "Q4_1": BLOCK, "Q4_K": QK_K, "Q6_K": QK_K}

__all__ = ["BLOCK_BYTES", "BLOCK_ELEMENTS", "from_gguf", "from_gguf_q4_0", "from_gguf_q4_1", "from_gguf_q4_k",
           "from_gguf_q6_k", "from_gguf_q8_0"]


def _blocks(raw_blocks: np.ndarray, shape: Sequence[int], kind: str) -> np.ndarray:
    """`raw_blocks` as `[..., out, in // block, bytes]` uint8, after checking its size against `shape`."""
    shape = tuple(int(d) for d in shape)
    block = BLOCK_ELEMENTS[kind]
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(f"{kind}: shape must be [..., out, in] with positive sizes, got {shape}")
    if shape[-1] % block:
        raise ValueError(f"{kind}: the input width {shape[-1]} is not a multiple of the block size {block}")
    raw = np.asarray(raw_blocks)
    if raw.dtype != np.uint8:
        raise ValueError(f"{kind}: raw_blocks must be uint8 bytes, got {raw.dtype}")
    want = int(np.prod(shape[:-1])) * (shape[-1] // block) * BLOCK_BYTES[kind]
    if raw.size != want:
        raise ValueError(f"{kind}: raw_blocks holds {raw.size} bytes; shape {shape} needs {want} "
                         f"({BLOCK_BYTES[kind]} bytes per block of {block})")
    return np.ascontiguousarray(raw).reshape(*shape[:-1], shape[-1] // block, BLOCK_BYTES[kind])


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


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes `[..., 12]` -> the eight 6-bit scales and mins `[..., 8]` (uint8).

    Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take a low 4 bits from
    bytes 8-11 (low nibble: scale, high nibble: min) and their top 2 bits from the top 2 bits of bytes 0-3 (scales)
    and 4-7 (mins).
    """
    lo_sc, lo_m, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (extra & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 0x3F, (extra >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, m


def _pack_groups(q: np.ndarray) -> np.ndarray:
    """Codes `[..., out, groups, 32]` in [0, 15] -> omnijax's packed `[..., in // 2, out]` (byte j of a group: row j
    low, row j + 16 high)."""
    packed = q[..., :16] | (q[..., 16:] << 4)  # [..., out, groups, 16]
    return _to_decoder(packed.reshape(*packed.shape[:-2], -1))


def from_gguf_q4_k(raw_blocks: np.ndarray, shape: Sequence[int]) -> QuantizedWeight:
    """A Q4_K tensor of float shape `[..., out, in]` as an `Int4Grouped(32)` weight `[..., in, out]` (float32 scales
    `d * sc`, offsets `-(dmin * m)`; module docstring).

    Raises:
        ValueError: the input width is not a multiple of 256, or the byte count does not match `shape`.
    """
    blocks = _blocks(raw_blocks, shape, "Q4_K")  # [..., out, nb, 144]
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])  # [..., out, nb, 8]
    scales = d[..., None] * sc.astype(np.float32)  # exact in float32
    offsets = -(dmin[..., None] * m.astype(np.float32))
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [..., out, nb, 4, 2, 32]: sub-block 2c + h
    lead = blocks.shape[:-2]
    groups = blocks.shape[-2] * 8
    qw = QuantizedWeight(_pack_groups(q.reshape(*lead, groups, 32)), _to_decoder(scales.reshape(*lead, groups)),
                         _to_decoder(offsets.reshape(*lead, groups)), Int4Grouped(BLOCK))
    check_quantized(qw)
    return qw


def from_gguf_q6_k(raw_blocks: np.ndarray, shape: Sequence[int]) -> QuantizedWeight:
    """A Q6_K tensor of float shape `[..., out, in]` as an `Int8Grouped(16)` weight `[..., in, out]` (codes `q - 32`,
    float32 scales `d * sc`; module docstring).

    Raises:
        ValueError: the input width is not a multiple of 256, or the byte count does not match `shape`.
    """
    blocks = _blocks(raw_blocks, shape, "Q6_K")  # [..., out, nb, 210]
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 2, 32)  # [half, k, l]: byte half*64 + k*32 + l
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)  # [half, l]: byte half*32 + l
    # Element half*128 + s*64 + k*32 + l takes nibble s of ql[half, k, l] and bits 2j..2j+1 of qh[half, l], j = 2s+k.
    low = np.stack([ql & 0x0F, ql >> 4], axis=-3)  # [..., half, s, k, l]
    shifts = (2 * (2 * np.arange(2)[:, None] + np.arange(2)[None, :])).astype(np.uint8)  # [s, k] -> 2j
    high = (qh[..., None, :, :] >> shifts[:, :, None]) & 0x03  # [..., half, s, k, l]
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(*lead, QK_K)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [..., out, nb, 16]
    scales = _f16(blocks, 208).astype(np.float32)[..., None] * sc  # exact in float32
    outer = blocks.shape[:-2]
    qw = QuantizedWeight(_to_decoder(q.reshape(*outer, -1)), _to_decoder(scales.reshape(*outer, -1)), None,
                         Int8Grouped(16))
    check_quantized(qw)
    return qw


_REPACK = {"Q8_0": from_gguf_q8_0, "Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q4_K": from_gguf_q4_k,
           "Q6_K": from_gguf_q6_k}


def from_gguf(raw_blocks: np.ndarray, shape: Sequence[int], type_name: str) -> QuantizedWeight:
    """Repacks a tensor of GGUF quantisation type `type_name` (`"Q8_0"`, `"Q4_0"`, `"Q4_1"`, `"Q4_K"`, `"Q6_K"`).

    Raises:
        ValueError: any other type, named (it must be dequantised or requantised instead), or a bad size.
    """
    if type_name not in _REPACK:
        raise ValueError(f"GGUF type {type_name!r} cannot be repacked without a float round trip; "
                         f"repackable: {sorted(_REPACK)}")
    return _REPACK[type_name](raw_blocks, shape)
