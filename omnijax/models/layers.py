"""Building blocks shared by the decoder and the encoders."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from omnijax.kernels.quant import QuantizedWeight, qmatmul


def new_param(shape: Sequence[int], dtype: DTypeLike, rngs: nnx.Rngs, *, ones: bool = False, zeros: bool = False,
              std: float = 0.02) -> nnx.Param:
    """A parameter of ones, zeros, or N(0, std) drawn in float32 and cast to `dtype` (random init is for tests and
    demos; real weights come from a converted checkpoint)."""
    if ones:
        return nnx.Param(jnp.ones(shape, dtype))
    if zeros:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm with statistics in float32; the normalised value is cast to `x.dtype` before the weight multiply."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def linear(x: jnp.ndarray, w: jnp.ndarray | QuantizedWeight, spec: str = "...d,de->...e") -> jnp.ndarray:
    """`x [..., in] @ w [in, out]` accumulated in float32 (the result is float32).

    A float `w` runs `jnp.einsum(spec, ...)` (the decoder's own contraction strings, so float weights compute as
    before, bit for bit); a `QuantizedWeight` runs `omnijax.kernels.quant.qmatmul`, dequantised to `x.dtype` inside
    the compiled program (`spec` is then only the contraction of the last axis, which every call site uses).
    """
    if isinstance(w, QuantizedWeight):
        return qmatmul(x, w, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
