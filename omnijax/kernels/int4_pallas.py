"""The Pallas program of the int4 weight-only matmul, on raw arrays (`omnijax.kernels.int4_matmul` documents it and
checks a `QuantizedWeight` before calling it; `omnijax.kernels.quant.qmatmul(method="pallas")` calls it too, which is
why it lives apart from both: it imports neither).

`int4_pallas(x, values, scales, offsets, group=g)`: `x [M, K]` float, `values [K / 2, N]` uint8 (two codes a byte:
within each group of `g` rows, byte row `j` holds row `j` in its low nibble and row `j + g/2` in its high one),
`scales` / `offsets [K / g, N]` float. Grid `(M / block_m, N / block_n)`; each program walks the `K / g` groups:
`acc += (x_lo . q_lo + x_hi . q_hi) * s_G + sum(x_G) * o_G` in float32, never a float copy of the weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def check_blocks(cols: int, block_m: int, block_n: int) -> None:
    """Raises ValueError naming the block size that Triton cannot take or that does not divide `cols`."""
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton's dot operands), got {value!r}")
    if cols % block_n:
        raise ValueError(f"block_n {block_n} does not divide the weight's output width {cols}")


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


@functools.partial(jax.jit, static_argnames=("group", "block_m", "block_n", "interpret", "num_warps"))
def int4_pallas(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array, *, group: int,
                block_m: int = 16, block_n: int = 64, interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """`x [M, K] @` the int4 weight held by `values` / `scales` / `offsets` (module docstring), as a Pallas kernel.

    Args:
        x: activations `[M, K]` (float); rows are zero-padded to a multiple of `block_m` inside.
        values: uint8 `[K / 2, N]` packed codes; scales, offsets: `[K / group, N]` float.
        group: rows per group `g` (a scale and an offset each).
        block_m: activation rows per program (a power of two >= 16).
        block_n: output columns per program (a power of two >= 16 dividing N).
        interpret: run the kernel in the Pallas interpreter (CPU).
        num_warps: Triton warps per program (GPU only).

    Returns:
        `[M, N]` float32.

    Raises:
        ValueError: bad block sizes (named).
    """
    rows, cols = 2 * values.shape[0], values.shape[1]
    check_blocks(cols, block_m, block_n)
    m = x.shape[0]
    mp = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, groups=rows // group, g=group),
        grid=(mp // block_m, cols // block_n),
        in_specs=[
            pl.BlockSpec((block_m, rows), lambda i, j: (i, 0)),  # activation rows, all of K
            pl.BlockSpec((rows // 2, block_n), lambda i, j: (0, j)),  # packed codes of the column block
            pl.BlockSpec((rows // group, block_n), lambda i, j: (0, j)),  # scales
            pl.BlockSpec((rows // group, block_n), lambda i, j: (0, j)),  # offsets
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, cols), jnp.float32),
        interpret=interpret,
        compiler_params=params,
    )(xp, values, scales, offsets)
    return out[:m]
