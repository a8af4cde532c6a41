"""A Pallas int4 weight-only matmul for GPU (Triton), with its jnp reference.

`int4_matmul(x, qw)` computes `x [M, K] @ dequantize(qw) [K, N]` for an `Int4Grouped(g)` weight
(`omnijax.kernels.quant`) without a float copy of the weight: grid `(M / block_m, N / block_n)`; each program walks
the `K / g` groups, loads the group's `g / 2` packed byte rows of its `block_n` columns, splits the nibbles (low:
group rows `0 .. g/2`, high: rows `g/2 .. g`, the packing's order) and takes two `[block_m, g/2] x [g/2, block_n]`
dots against the matching halves of the group's activations, then applies the group's scale after the dot and adds
its offset times the activations' sum: `acc += (x_lo . q_lo + x_hi . q_hi) * s_G + sum(x_G) * o_G`, in float32.

The Pallas program itself is `omnijax.kernels.int4_pallas` (on raw arrays, so that `quant.qmatmul(method="pallas")`
can call it too); this module checks the weight and the blocks. `int4_matmul_reference(x, qw)` is the same
arithmetic in jnp over whole arrays (the kernel's oracle, beside `quant.qmatmul_reference`'s
dequantise-then-matmul). On CPU the kernel runs with `interpret=True` (tests); it is
lowered for cuda on CPU in tests to check that it reaches Triton. Not compiled or timed on a GPU here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from omnijax.kernels.int4_pallas import check_blocks, int4_pallas
from omnijax.kernels.quant import Int4Grouped, QuantizedWeight, check_quantized


def _check(x: jax.Array, qw: QuantizedWeight) -> None:
    check_quantized(qw)
    if not isinstance(qw.scheme, Int4Grouped):
        raise ValueError(f"int4_matmul takes an Int4Grouped weight, got {type(qw.scheme).__name__}")
    if len(qw.shape) != 2:
        raise ValueError(f"int4_matmul takes a 2-D weight; got {qw.shape} (use qw.index(i) on a stacked one)")
    if x.ndim != 2 or x.shape[1] != qw.shape[0]:
        raise ValueError(f"x must be [M, {qw.shape[0]}], got shape {x.shape}")


def _check_blocks(qw: QuantizedWeight, block_m: int, block_n: int) -> None:
    check_blocks(qw.shape[1], block_m, block_n)


def int4_matmul_reference(x: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """The kernel's arithmetic over whole arrays: per group, nibble dots, scale after, offset times the x sum.

    Returns:
        `[M, N]` float32.
    """
    _check(x, qw)
    rows, cols = qw.shape
    g = qw.scheme.size
    xg = x.astype(jnp.float32).reshape(x.shape[0], rows // g, g)
    p = qw.values.reshape(rows // g, g // 2, cols)
    hp = lax.Precision.HIGHEST
    dots = (jnp.einsum("mgj,gjn->mgn", xg[..., : g // 2], (p & 15).astype(jnp.float32), precision=hp)
            + jnp.einsum("mgj,gjn->mgn", xg[..., g // 2:], (p >> 4).astype(jnp.float32), precision=hp))
    return (jnp.sum(dots * qw.scales.astype(jnp.float32), axis=1)
            + jnp.einsum("mg,gn->mn", jnp.sum(xg, axis=-1), qw.offsets.astype(jnp.float32), precision=hp))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "num_warps"))
def int4_matmul(x: jax.Array, qw: QuantizedWeight, *, block_m: int = 16, block_n: int = 64,
                interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """`x [M, K] @ dequantize(qw)` for an `Int4Grouped` `qw [K, N]`, as a Pallas kernel (module docstring).

    Args:
        x: activations `[M, K]` (float); rows are zero-padded to a multiple of `block_m` inside.
        qw: a 2-D `Int4Grouped` weight.
        block_m: activation rows per program (a power of two >= 16).
        block_n: output columns per program (a power of two >= 16 dividing N).
        interpret: run the kernel in the Pallas interpreter (CPU tests).
        num_warps: Triton warps per program (GPU only).

    Returns:
        `[M, N]` float32.

    Raises:
        ValueError: not an `Int4Grouped` 2-D weight, `x` not `[M, K]`, or bad block sizes (named).
    """
    _check(x, qw)
    _check_blocks(qw, block_m, block_n)
    return int4_pallas(x, qw.values, qw.scales, qw.offsets, group=qw.scheme.size, block_m=block_m, block_n=block_n,
                       interpret=interpret, num_warps=num_warps)
