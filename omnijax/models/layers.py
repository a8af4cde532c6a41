"""Building blocks shared by the decoder and the encoders."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from omnijax.kept_executables import cached_jit
from omnijax.kernels.quant import QuantizedWeight, qmatmul

_shapes_only = contextvars.ContextVar("omnijax_shapes_only", default=False)
_padded_rows = contextvars.ContextVar("omnijax_padded_rows", default=False)
ModuleT = TypeVar("ModuleT", bound=nnx.Module)


@contextlib.contextmanager
def _drawing_nothing() -> Iterator[None]:
    token = _shapes_only.set(True)
    try:
        yield
    finally:
        _shapes_only.reset(token)


def abstract_module(build: Callable[[], ModuleT]) -> ModuleT:
    """`nnx.eval_shape(build)` with every `new_param` a zero instead of a random draw: the module's structure, shapes
    and dtypes, for a caller that replaces every value (a checkpoint restore). Tracing a draw per parameter (the
    key split and the normal sampler) was most of the abstract build: ~0.2-0.5 CPU s a load of the tiny Qwen2.5-Omni
    release with its speech modules."""
    with _drawing_nothing():
        return nnx.eval_shape(build)


def new_param(shape: Sequence[int], dtype: DTypeLike, rngs: nnx.Rngs, *, ones: bool = False, zeros: bool = False,
              std: float = 0.02) -> nnx.Param:
    """A parameter of ones, zeros, or N(0, std) drawn in float32 and cast to `dtype` (random init is for tests and
    demos; real weights come from a converted checkpoint). Inside `abstract_module` nothing is drawn: zeros of
    the same shape and dtype stand in."""
    if ones:
        return nnx.Param(jnp.ones(shape, dtype))
    if zeros or _shapes_only.get():
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(_normal(jax.random.key_data(rngs.params()), shape=tuple(shape), dtype=jnp.dtype(dtype), std=std))


@cached_jit(static_argnames=("shape", "dtype", "std"))
def _normal(key_data: jax.Array, *, shape: tuple[int, ...], dtype: jnp.dtype, std: float) -> jax.Array:
    """`std * N(0, 1)` of `shape` drawn in float32 with the key `key_data` (`jax.random.key_data`), cast to `dtype`:
    one kept program per shape, where eagerly the draw, the scale and the cast were each a program of their own,
    traced and lowered again after every `jax.clear_caches()` (the test suite's tiny models draw hundreds)."""
    drawn = jax.lax.optimization_barrier(jax.random.normal(jax.random.wrap_key_data(key_data), shape, jnp.float32))
    return (std * drawn).astype(dtype)  # (the barrier: the draw as eager, unfused with the scale, to the bit)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm with statistics in float32; the normalised value is cast to `x.dtype` before the weight multiply."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """One of several layers' weights, picked by a traced layer number inside a layer loop: `linear` runs the
    product with `lax.switch`, each branch one layer's matmul reading that layer's array where it lies (a slice of
    a stacked array is copied before the matmul on XLA:CPU). Lives only inside a traced function.

    Attributes:
        index: int32 scalar, the layer (an index into `weights`).
        weights: each layer's `[in, out]` weight (float or `QuantizedWeight`), all of one shape and dtype.
    """

    index: jax.Array
    weights: tuple[jnp.ndarray | QuantizedWeight, ...]


@contextlib.contextmanager
def padded_one_row_products() -> Iterator[None]:
    """While tracing inside it, a one-row product over per-layer weights (`LayerWeight`: a decode step) is padded to
    two rows, so XLA:CPU runs its precompiled library matmul instead of emitting a matrix-vector kernel per layer
    and projection: the quick-compile program of `omnijax.streaming.quick_start` (SmolLM2-135M's step, LLVM
    optimisation off: 3.1 vs 5.0 CPU s to compile, ~1.2x the run time). The products equal the unpadded ones up to
    float32 rounding. Read at trace time only: a function traced inside it is its own jit (no inner `jax.jit`
    between it and `linear`, whose cached trace would not know the setting)."""
    token = _padded_rows.set(True)
    try:
        yield
    finally:
        _padded_rows.reset(token)


def _plain_matmul(w: object, spec: str) -> bool:
    """Whether `einsum(spec, x, w)` is `_dot_last(x, w)`: a float `[in, out]` weight and a spec contracting x's last
    axis with w's first, the output x's other axes then w's last (every spec the decoder passes)."""
    lhs, _, out = spec.replace("...", "").partition("->")
    x_axes, _, w_axes = lhs.partition(",")
    return (isinstance(w, jax.Array) and w.ndim == 2 and len(w_axes) == 2 and x_axes[-1:] == w_axes[0]
            and out == x_axes[:-1] + w_axes[1])


def _dot_last(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """`x [..., in] @ w [in, out]` accumulated in float32: the one `dot_general` of `linear`'s einsum."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def linear(x: jnp.ndarray, w: jnp.ndarray | QuantizedWeight | LayerWeight,
           spec: str = "...d,de->...e") -> jnp.ndarray:
    """`x [..., in] @ w [in, out]` accumulated in float32 (the result is float32).

    A float `w` runs `jnp.einsum(spec, ...)` (the decoder's own contraction strings, so float weights compute as
    before, bit for bit); a `QuantizedWeight` runs `omnijax.kernels.quant.qmatmul`, dequantised to `x.dtype` inside
    the compiled program (`spec` is then only the contraction of the last axis, which every call site uses); a
    `LayerWeight` runs the chosen layer's product in a `lax.switch` over the layers.
    """
    if isinstance(w, LayerWeight):
        # A float branch is the product's one dot_general (the HLO `jnp.einsum` emits for these last-axis
        # contractions): tracing layers x projections branches through einsum cost ~2.5x the time per branch.
        # One row (a decode step) stays one row: XLA:CPU emits each branch's matrix-vector product as its own
        # kernel, which streams the weights ~1.6x faster than its library matmul runs the row padded to two (SmolLM2
        # decode: 38.8 vs 61.2 CPU ms per token), for ~5 CPU s more compile per step program
        # (`bench/peers/RESULTS.md`, decode_profile.py). Inside `padded_one_row_products` (a quick compile) it is
        # padded to two rows: the library matmul, nothing emitted per branch.
        if _padded_rows.get() and x.ndim >= 2 and math.prod(x.shape[:-1]) == 1:
            return linear(jnp.concatenate([x, x], axis=0), w, spec)[:1]
        return jax.lax.switch(w.index, [functools.partial(_dot_last, w=one) if _plain_matmul(one, spec)
                                        else functools.partial(linear, w=one, spec=spec) for one in w.weights], x)
    if isinstance(w, QuantizedWeight):
        return qmatmul(x, w, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
