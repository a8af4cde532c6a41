"""A Pallas int4 weight-only matmul for GPU (Triton), with its jnp reference.

`int4_matmul(x, qw)` computes `x [M, K] @ dequantize(qw) [K, N]` for an `Int4Grouped(g)` weight
(`omnijax.kernels.quant`) without a float copy of the weight: grid `(M / block_m, N / block_n)`; each program walks
the `K / g` groups, loads the group's `g / 2` packed byte rows of its `block_n` columns, splits the nibbles (low:
group rows `0 .. g/2`, high: rows `g/2 .. g`, the packing's order) and takes two `[block_m, g/2] x [g/2, block_n]`
dots against the matching halves of the group's activations, then applies the group's scale after the dot and adds
its offset times the activations' sum: `acc += (x_lo . q_lo + x_hi . q_hi) * s_G + sum(x_G) * o_G`, in float32.

`int4_matmul_reference(x, qw)` is the same arithmetic in jnp over whole arrays (the kernel's oracle, beside
`quant.qmatmul_reference`'s dequantise-then-matmul). On CPU the kernel runs with `interpret=True` (tests); it is
lowered for cuda on CPU in tests to check that it reaches Triton. Not compiled or timed on a GPU here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from omnijax.kernels.quant import Int4Grouped, QuantizedWeight, check_quantized


def _power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 16 and n & (n - 1) == 0


def _check(x: jax.Array, qw: QuantizedWeight) -> None:
    check_quantized(qw)
    if not isinstance(qw.scheme, Int4Grouped):
        raise ValueError(f"int4_matmul takes an Int4Grouped weight, got {type(qw.scheme).__name__}")
    if len(qw.shape) != 2:
        raise ValueError(f"int4_matmul takes a 2-D weight; got {qw.shape} (use qw.index(i) on a stacked one)")
    if x.ndim != 2 or x.shape[1] != qw.shape[0]:
        raise ValueError(f"x must be [M, {qw.shape[0]}], got shape {x.shape}")


def _check_blocks(qw: QuantizedWeight, block_m: int, block_n: int) -> None:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not _power_of_two(value):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton's dot operands), got {value!r}")
    if qw.shape[1] % block_n:
        raise ValueError(f"block_n {block_n} does not divide the weight's output width {qw.shape[1]}")


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


def _kernel(x_ref, v_ref, s_ref, o_ref, out_ref, *, groups: int, g: int):
    half = g // 2

    def group(i, acc):
        x_lo = x_ref[:, pl.ds(i * g, half)].astype(jnp.float32)  # [bm, g/2]
        x_hi = x_ref[:, pl.ds(i * g + half, half)].astype(jnp.float32)
        packed = v_ref[pl.ds(i * half, half), :]  # [g/2, bn] uint8
        low = (packed & 15).astype(jnp.float32)
        high = (packed >> 4).astype(jnp.float32)
        dots = (plgpu.dot(x_lo, low, precision=lax.Precision.HIGHEST)
                + plgpu.dot(x_hi, high, precision=lax.Precision.HIGHEST))
        scale = s_ref[pl.ds(i, 1), :].astype(jnp.float32)  # [1, bn]
        offset = o_ref[pl.ds(i, 1), :].astype(jnp.float32)
        xsum = jnp.sum(x_lo, axis=1, keepdims=True) + jnp.sum(x_hi, axis=1, keepdims=True)  # [bm, 1]
        return acc + dots * scale + xsum * offset

    out_ref[...] = lax.fori_loop(0, groups, group, jnp.zeros(out_ref.shape, jnp.float32))


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
    rows, cols = qw.shape
    g = qw.scheme.size
    m = x.shape[0]
    mp = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, groups=rows // g, g=g),
        grid=(mp // block_m, cols // block_n),
        in_specs=[
            pl.BlockSpec((block_m, rows), lambda i, j: (i, 0)),  # activation rows, all of K
            pl.BlockSpec((rows // 2, block_n), lambda i, j: (0, j)),  # packed codes of the column block
            pl.BlockSpec((rows // g, block_n), lambda i, j: (0, j)),  # scales
            pl.BlockSpec((rows // g, block_n), lambda i, j: (0, j)),  # offsets
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, cols), jnp.float32),
        interpret=interpret,
        compiler_params=params,
    )(xp, qw.values, qw.scales, qw.offsets)
    return out[:m]
