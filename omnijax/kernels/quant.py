"""Weight-only quantised linear layers: int8 and int4 weights dequantised inside the compiled program.

A weight `w [..., in, out]` (the decoder's `[D, out]` layout, stacked over layers or experts in the leading axes) is
stored as integer codes plus float parameters per group of `g` consecutive rows of the input axis:

- `Int8PerChannel()`: symmetric, one scale per output column (a single group of `in` rows): `w = q * scale`,
  `q` int8 in [-127, 127].
- `Int8Grouped(g)`: symmetric, one scale per `g` input rows and output column (GGUF Q8_0 is `Int8Grouped(32)` with
  float16 scales; GGUF Q6_K kept quantised is `Int8Grouped(16)`, its 16-value sub-blocks, with float32 scales).
- `Int4Grouped(g)`: asymmetric, a scale and an offset per group: `w = q * scale + offset`, `q` in [0, 15]. The
  offset is the value code 0 stands for (the group's minimum when `quantize` made it; GGUF Q4_1's `m`; Q4_0's `-8 d`),
  so GGUF's formulas are reproduced bit for bit in float32. Two codes share a byte: within each group, byte row `j`
  holds row `j` in its low nibble and row `j + g/2` in its high nibble (GGUF's own order inside a 32-row block).

`qmatmul(x, qw, method=...)` has two formulations (both inside the jitted program; "auto" picks by the number of
activation rows, `GROUPED_ROWS`, which is 0 today: always dense, see there):

- "grouped", meant for a few float32 rows (a decode step): the codes are contracted group by group and the scale applied
  after each group's sum, `y = sum_G s_G (x_G . q_G) + sum_G o_G sum(x_G)`. It is written as a multiply-reduce, so
  XLA fuses the int8 codes' conversion into the reduction: no float copy of the weight, not even a tile, exists.
  int4's two nibbles (`& 15`, `>> 4`) are contracted with the two halves of each group's `x`, never re-interleaved;
  XLA:CPU writes the two nibble planes as bytes before the reduction (one byte a value, still no float weight).
- "dense": `out_block` output columns are dequantised at a time (only that tile
  exists in float) and multiplied by the library matmul, which amortises the dequantisation over the rows.
- "pallas" (int4 only): the Pallas kernel of `omnijax.kernels.int4_matmul` (its program, `int4_pallas`), Triton in
  a program lowered for cuda and the Pallas interpreter in one lowered for CPU (`jax.lax.platform_dependent`; other
  platforms have no branch). "auto" never picks it on its own: a weight asks for it with `kernel="pallas"`
  (`with_kernel`, or `omnijax.models.quant_kernel.set_matmul_kernel` on a loaded model), and then every `qmatmul` of
  that weight with `method="auto"` runs the kernel. A weight the kernel cannot take (not int4, an output width no
  block of 16..128 divides) is refused by name, never run another way. Not compiled or timed on a GPU yet: opt-in
  until it is.

`qmatmul_reference(x, qw)` is `x @ dequantize(qw)`, the dense oracle of all three. This module imports jax only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from omnijax.kernels.int4_pallas import int4_pallas

# The most activation rows `qmatmul(method="auto")` contracts grouped, by code width (above: dense tiles and the
# library matmul). 0: auto is always dense. The grouped formulation wins alone on XLA:CPU (`quantized --matmul`, CPU
# time over float32 at 1 / 2 rows: int8 0.52 / 0.83x vs dense 1.27 / 2.28x; int4 g32 0.99 / 1.69x vs 1.34 / 2.26x),
# but in SmolLM2's decode step, run beside the dense build at the same time, it decoded slower: int8 1.17x vs 0.84x
# float32, int4 g32 2.46x vs 0.89x (an earlier sequential pair said the opposite for int8: 0.77x vs 1.01x).
# bench/quality/RESULTS.md has the figures; until a quiet machine settles it, auto stays dense.
GROUPED_ROWS = {8: 0, 4: 0}
METHODS = ("auto", "grouped", "dense", "pallas")
KERNELS = ("xla", "pallas")  # `QuantizedWeight.kernel`: what `qmatmul(method="auto")` runs for the weight
PALLAS_BLOCK_N = (128, 64, 32, 16)  # output columns per Pallas program: the widest of these dividing the width
GROUP_SIZES = (32, 64, 128)  # what `quantize` offers (`omnijax convert --group-size`)
INT8_GROUP_SIZES = (16, *GROUP_SIZES)  # 16: GGUF Q6_K's sub-blocks, only ever repacked from a file


@dataclasses.dataclass(frozen=True)
class Int8PerChannel:
    """Symmetric int8 with one scale per output channel."""

    bits = 8
    symmetric = True

    def group_size(self, rows: int) -> int:
        """The rows one scale covers for a weight of `rows` input rows (all of them)."""
        return rows


@dataclasses.dataclass(frozen=True)
class Int8Grouped:
    """Symmetric int8 with one scale per `size` input rows and output column."""

    size: int = 32
    bits = 8
    symmetric = True

    def __post_init__(self):
        if self.size not in INT8_GROUP_SIZES:
            raise ValueError(f"Int8Grouped group size must be one of {GROUP_SIZES}, got {self.size!r} (or 16, the "
                             "sub-block of a GGUF Q6_K weight kept quantised)")

    def group_size(self, rows: int) -> int:
        """The rows one scale covers (`size`)."""
        return self.size


@dataclasses.dataclass(frozen=True)
class Int4Grouped:
    """Asymmetric int4 (scale and offset per `size` input rows and output column), two codes per byte."""

    size: int = 32
    bits = 4
    symmetric = False

    def __post_init__(self):
        if self.size not in GROUP_SIZES:
            raise ValueError(f"Int4Grouped group size must be one of {GROUP_SIZES}, got {self.size!r}")

    def group_size(self, rows: int) -> int:
        """The rows one scale and offset cover (`size`)."""
        return self.size


Scheme = Int8PerChannel | Int8Grouped | Int4Grouped
SCHEMES = (Int8PerChannel, Int8Grouped, Int4Grouped)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantised `[..., in, out]` weight (a pytree; `scheme` is static).

    Attributes:
        values: int8 `[..., in, out]` codes, or for int4 uint8 `[..., in // 2, out]` (two codes a byte).
        scales: float `[..., in // g, out]` (float32 from `quantize`, float16 from GGUF).
        offsets: float `[..., in // g, out]` for int4 (the value of code 0), None for the symmetric schemes.
        scheme: the scheme, which fixes the group size `g`.
        kernel: what `qmatmul(method="auto")` runs for this weight (static, not stored in a checkpoint): "xla" (the
            default: the grouped or dense formulation) or "pallas" (the int4 Pallas kernel; Int4Grouped only).
    """

    values: Any
    scales: Any
    offsets: Any
    scheme: Scheme
    kernel: str = "xla"

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"QuantizedWeight kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "pallas" and not isinstance(self.scheme, Int4Grouped):
            raise ValueError(f"kernel='pallas' is the int4 Pallas matmul: it takes Int4Grouped weights, not "
                             f"{type(self.scheme).__name__}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape `[..., in, out]`."""
        *lead, rows, cols = self.values.shape
        return (*lead, rows * 2 if self.scheme.bits == 4 else rows, cols)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets."""
        return sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in (self.values, self.scales, self.offsets)
                   if a is not None)

    def index(self, i: Any) -> QuantizedWeight:
        """The weight at index `i` of the leading axis (a layer or an expert of a stack; `i` may be traced)."""
        def take(a):
            return None if a is None else jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        return QuantizedWeight(take(self.values), take(self.scales), take(self.offsets), self.scheme, self.kernel)

    def __getitem__(self, key: Any) -> QuantizedWeight:
        """`qw[i]` is `qw.index(i)` (an int or a traced scalar on the leading axis); `qw[...]` is `qw` (as
        `nnx.Param[...]` reads its value). Any other key is refused: slicing codes would cut packed bytes."""
        if key is Ellipsis:
            return self
        if isinstance(key, (tuple, slice)) or len(self.shape) < 3:
            raise TypeError(f"a QuantizedWeight of shape {self.shape} takes one index on its leading (stack) axis "
                            f"or ..., got {key!r}")
        return self.index(key)


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["values", "scales", "offsets"],
                                 meta_fields=["scheme", "kernel"])


def with_kernel(tree: Any, kernel: str) -> Any:
    """`tree` with every `QuantizedWeight` in it set to run `kernel` ("xla" or "pallas"); other leaves unchanged.

    Raises:
        ValueError: an unknown kernel, or "pallas" where some quantised weight is not `Int4Grouped` (all of them
            are named; nothing is changed).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    if kernel == "pallas":
        bad = [f"{jax.tree_util.keystr(path)} ({type(leaf.scheme).__name__})" for path, leaf in found
               if isinstance(leaf, QuantizedWeight) and not isinstance(leaf.scheme, Int4Grouped)]
        if bad:
            raise ValueError(f"kernel='pallas' runs Int4Grouped weights only; these are not: {', '.join(bad)}")
    return jax.tree.map(lambda leaf: dataclasses.replace(leaf, kernel=kernel) if isinstance(leaf, QuantizedWeight)
                        else leaf, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def _group(scheme: Scheme, rows: int) -> int:
    if not isinstance(scheme, SCHEMES):
        raise ValueError(f"unknown quantisation scheme {scheme!r}; known: {[s.__name__ for s in SCHEMES]}")
    g = scheme.group_size(rows)
    if rows % g:
        raise ValueError(f"{type(scheme).__name__}: group size {g} does not divide the input width {rows}")
    return g


def check_quantized(qw: QuantizedWeight) -> None:
    """Raises ValueError naming the field when `qw`'s arrays do not fit its scheme (dtype, shape, offsets)."""
    values, scales, offsets, scheme = qw.values, qw.scales, qw.offsets, qw.scheme
    if values.ndim < 2:
        raise ValueError(f"values must be [..., in, out], got shape {values.shape}")
    *lead, rows, cols = qw.shape
    g = _group(scheme, rows)
    want = jnp.uint8 if scheme.bits == 4 else jnp.int8
    if values.dtype != want:
        raise ValueError(f"values of {type(scheme).__name__} must be {jnp.dtype(want).name}, got {values.dtype}")
    expect = (*lead, rows // g, cols)
    for name, a in (("scales", scales), ("offsets", offsets)):
        if name == "offsets" and scheme.symmetric:
            if a is not None:
                raise ValueError(f"offsets must be None for the symmetric {type(scheme).__name__}")
            continue
        if a is None or tuple(a.shape) != expect:
            raise ValueError(f"{name} must have shape {expect}, got {None if a is None else tuple(a.shape)}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {a.dtype}")


def quantize(w: jax.Array, scheme: Scheme) -> QuantizedWeight:
    """Quantises a float weight `w [..., in, out]` along its input axis (round to nearest).

    Every element dequantises to within half its group's scale: `|dequantize(q) - w| <= scale / 2` (up to float32
    rounding). Scales and offsets are float32.

    Raises:
        ValueError: `w` is not a float array of rank >= 2, or the scheme's group size does not divide `in`.
    """
    w = jnp.asarray(w)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a float [..., in, out] array, got {w.dtype} of shape {w.shape}")
    *lead, rows, cols = w.shape
    g = _group(scheme, rows)
    wg = w.astype(jnp.float32).reshape(*lead, rows // g, g, cols)  # [..., G, g, out]
    if scheme.symmetric:
        scale = jnp.max(jnp.abs(wg), axis=-2, keepdims=True) / 127.0  # [..., G, 1, out]
        q = jnp.round(wg / jnp.where(scale > 0, scale, 1.0))
        values = jnp.clip(q, -127, 127).astype(jnp.int8).reshape(w.shape)
        return QuantizedWeight(values, scale[..., 0, :], None, scheme)
    low = jnp.min(wg, axis=-2, keepdims=True)
    scale = (jnp.max(wg, axis=-2, keepdims=True) - low) / 15.0
    q = jnp.clip(jnp.round((wg - low) / jnp.where(scale > 0, scale, 1.0)), 0, 15).astype(jnp.uint8)
    packed = q[..., : g // 2, :] | (q[..., g // 2:, :] << 4)  # [..., G, g/2, out]
    return QuantizedWeight(packed.reshape(*lead, rows // 2, cols), scale[..., 0, :], low[..., 0, :], scheme)


def codes(qw: QuantizedWeight) -> jax.Array:
    """The integer codes `[..., in, out]` (int8 for the int8 schemes, uint8 in [0, 15] for int4)."""
    if qw.scheme.bits == 8:
        return qw.values
    *lead, half, cols = qw.values.shape
    g = qw.scheme.group_size(2 * half)
    p = qw.values.reshape(*lead, 2 * half // g, g // 2, cols)
    return jnp.concatenate([p & 15, p >> 4], axis=-2).reshape(*lead, 2 * half, cols)


def dequantize(qw: QuantizedWeight, dtype: Any = jnp.float32) -> jax.Array:
    """The dense weight `[..., in, out]`: `q * scale (+ offset)` computed in float32, then cast to `dtype`."""
    check_quantized(qw)
    *lead, rows, cols = qw.shape
    g = qw.scheme.group_size(rows)
    q = codes(qw).astype(jnp.float32).reshape(*lead, rows // g, g, cols)
    w = q * qw.scales.astype(jnp.float32)[..., None, :]
    if qw.offsets is not None:
        w = w + qw.offsets.astype(jnp.float32)[..., None, :]
    return w.reshape(*lead, rows, cols).astype(dtype)


def _tile(qw: QuantizedWeight, start: Any, width: int) -> QuantizedWeight:
    """Output columns `[start, start + width)` of a 2-D quantised weight (`start` may be traced)."""
    def cut(a):
        return None if a is None else jax.lax.dynamic_slice_in_dim(a, start, width, axis=-1)
    return QuantizedWeight(cut(qw.values), cut(qw.scales), cut(qw.offsets), qw.scheme, qw.kernel)


def qmatmul(x: jax.Array, qw: QuantizedWeight, *, preferred_element_type: Any = None,
            out_block: int | None = 2048, method: str = "auto") -> jax.Array:
    """`x [..., in] @ w [in, out]` for a quantised 2-D `w`, dequantised inside the program (module docstring).

    Args:
        x: activations `[..., in]` (float).
        qw: a 2-D quantised weight (index a stacked one with `qw.index(i)` first).
        preferred_element_type: the result dtype (as `jnp.matmul`'s); default `x.dtype`.
        out_block: the dense formulation's float tile: output columns dequantised at once (`[in, out_block]` in
            `x.dtype`, so a wide weight such as an LM head never exists in float whole); None dequantises the whole
            weight in one piece (still inside the caller's jit). On CPU one piece was fastest for SmolLM2's
            576 x 1536 layers; smaller tiles measured no faster. The grouped formulation makes no float tile at all,
            so any `out_block` bound holds for it too.
        method: "grouped" (float32 `x` only: it accumulates in float32, as the reference does for float32), "dense",
            "pallas" (an Int4Grouped weight only: `omnijax.kernels.int4_matmul`, accumulating in float32), or "auto":
            "pallas" when the weight's `kernel` is "pallas", else grouped for float32 `x` of at most
            `GROUPED_ROWS[bits]` rows (0 today), else dense.

    Returns:
        `[..., out]` in `preferred_element_type` (accumulated in float32 by the grouped formulation, as `jnp.matmul`
        does for `x.dtype` by the dense one).

    Raises:
        ValueError: a stacked weight, a width mismatch, a bad `out_block` or `method`, "grouped" for non-float32
            `x`, or "pallas" for a weight that is not Int4Grouped or whose output width no block of
            `PALLAS_BLOCK_N` divides.
    """
    check_quantized(qw)
    if len(qw.shape) != 2:
        raise ValueError(f"qmatmul takes a 2-D weight; got {qw.shape} (use qw.index(i) on a stacked one)")
    rows, cols = qw.shape
    if x.shape[-1] != rows:
        raise ValueError(f"x's last axis {x.shape[-1]} does not match the weight's input width {rows}")
    if out_block is not None and (not isinstance(out_block, int) or out_block < 1):
        raise ValueError(f"out_block must be a positive int or None, got {out_block!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "grouped" and x.dtype != jnp.float32:
        raise ValueError(f"method='grouped' takes float32 x (it accumulates in float32), got {x.dtype}")
    out_type = x.dtype if preferred_element_type is None else preferred_element_type
    n = math.prod(x.shape[:-1])
    if method == "pallas" or (method == "auto" and qw.kernel == "pallas"):
        return _pallas(x.reshape(n, rows), qw).reshape(*x.shape[:-1], cols).astype(out_type)
    if method == "grouped" or (method == "auto" and x.dtype == jnp.float32 and n <= GROUPED_ROWS[qw.scheme.bits]):
        return _grouped(x.reshape(n, rows), qw).reshape(*x.shape[:-1], cols).astype(out_type)
    if out_block is None or out_block >= cols:
        return jnp.matmul(x, dequantize(qw, x.dtype), preferred_element_type=out_type)
    # one tile at a time in a loop (unrolled tiles let XLA fuse them back into one whole float weight); the last
    # tile starts at cols - out_block, overlapping its neighbour, and rewrites those columns with the same values
    out = jnp.zeros((*x.shape[:-1], cols), out_type)

    def tile(j, out):
        start = jnp.minimum(j * out_block, cols - out_block)
        y = jnp.matmul(x, dequantize(_tile(qw, start, out_block), x.dtype), preferred_element_type=out_type)
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=-1)

    return jax.lax.fori_loop(0, -(-cols // out_block), tile, out)


def _pallas(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """`x [n, in] @ dequantize(qw)` in float32 by the int4 Pallas kernel: Triton for cuda, interpreted for CPU."""
    if not isinstance(qw.scheme, Int4Grouped):
        raise ValueError(f"method='pallas' is the int4 Pallas matmul: it takes Int4Grouped weights, not "
                         f"{type(qw.scheme).__name__}")
    cols = qw.shape[1]
    block_n = next((b for b in PALLAS_BLOCK_N if cols % b == 0), None)
    if block_n is None:
        raise ValueError(f"method='pallas': no block of {PALLAS_BLOCK_N} output columns divides the weight's output "
                         f"width {cols}")
    block_m = min(64, max(16, 1 << max(0, x.shape[0] - 1).bit_length()))  # a power of two: 16 for a decode step
    run = functools.partial(int4_pallas, group=qw.scheme.size, block_m=block_m, block_n=block_n)
    # picked where the program is lowered (a CPU program interprets the kernel, a cuda one is Triton's); another
    # platform has no branch, and lowering there fails naming it
    return jax.lax.platform_dependent(x, qw.values, qw.scales, qw.offsets, cpu=functools.partial(run, interpret=True),
                                      cuda=run)


def _grouped(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """`x [n, in] @ dequantize(qw)` in float32 as multiply-reduces over each group's codes, scaled after the sum.

    One row is contracted as two equal rows: XLA:CPU's reduction over a single row measured ~30x slower than over
    two (the same fusion, a different loop order).
    """
    if x.shape[0] == 1:
        return _grouped(jnp.concatenate([x, x], axis=0), qw)[:1]
    rows, cols = qw.shape
    g = qw.scheme.group_size(rows)
    xg = x.astype(jnp.float32).reshape(-1, rows // g, g)  # [n, G, g]
    scales = qw.scales.astype(jnp.float32)  # [G, out]
    if qw.scheme.bits == 8:
        q = qw.values.reshape(rows // g, g, cols).astype(jnp.float32)
        return jnp.sum(jnp.sum(xg[..., None] * q, axis=-2) * scales, axis=-2)
    p = qw.values.reshape(rows // g, g // 2, cols)  # byte row j: group row j (low nibble) and j + g/2 (high)
    low, high = (p & 15).astype(jnp.float32), (p >> 4).astype(jnp.float32)
    dots = jnp.sum(xg[..., : g // 2, None] * low, axis=-2) + jnp.sum(xg[..., g // 2:, None] * high, axis=-2)
    # the offsets' term: each group's x sum times its offset (a [n, G] x [G, out] product)
    return jnp.sum(dots * scales, axis=-2) + jnp.einsum("ng,go->no", jnp.sum(xg, axis=-1),
                                                        qw.offsets.astype(jnp.float32),
                                                        precision=jax.lax.Precision.HIGHEST)


def qmatmul_reference(x: jax.Array, qw: QuantizedWeight, *, preferred_element_type: Any = None) -> jax.Array:
    """`x @ dequantize(qw)` with the whole weight dense (the oracle of `qmatmul`)."""
    out_type = x.dtype if preferred_element_type is None else preferred_element_type
    return jnp.matmul(x, dequantize(qw, x.dtype), preferred_element_type=out_type)


def float_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of a dense weight of `shape` in `dtype` (to compare with `QuantizedWeight.nbytes`)."""
    return math.prod(shape) * jnp.dtype(dtype).itemsize
