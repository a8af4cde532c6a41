"""Building blocks shared by the decoder and the encoders."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike


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
