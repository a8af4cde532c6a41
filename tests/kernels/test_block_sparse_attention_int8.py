"""The block-sparse kernel reading int8 pages (codes + one float32 scale per token and kv head): interpreted on CPU
against its reference, against `jax.nn.dot_product_attention` over the pages dequantised in numpy, and against
impl="xla" attention over the same `QuantPages`; Triton lowering for cuda on CPU; the refusals."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kernels.block_sparse_attention import block_sparse_attention, block_sparse_attention_reference
from omnijax.kernels.lowering import TRITON_CALL_TARGET, has_triton_call, lower_for_cuda
from omnijax.kv import attention
from omnijax.kv.quant_kv import QuantPages
from tests.kernels.test_block_sparse_attention import INTERPRET, TOL, library_attention, make_case


def np_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax int8 per vector (the last axis), written plainly; all-zero vectors get scale 0."""
    scale = np.abs(x).max(axis=-1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(x / safe[..., None]), -127, 127).astype(np.int8), scale.astype(np.float32)


def int8_case(seed, *, dtype=jnp.float32, layers=None, layer=0, **kw):
    """`make_case`'s cache with keys and values quantised per token and kv head. Dead slots hold random codes and NaN
    scales. With `layers`, the pages are layer `layer` of a stack whose other layers hold other codes and scales.

    Returns `(args, scales, dequantised)`: the kernel's positional args (int8 pages), `(k_scales, v_scales)`, and the
    numpy float32 pages the codes stand for (NaN in dead slots), for the float oracles."""
    q, k, v, table, valid, order, q_order = make_case(seed, dtype=jnp.float32, **kw)
    rng, noise = np.random.default_rng(seed + 100), np.random.default_rng(seed + 200)
    live = np.asarray(valid)
    codes, scales, deq = [], [], []
    for x in (np.asarray(k), np.asarray(v)):
        x = np.where(live[..., None, None], x, 0.0) * rng.choice([0.05, 1.0, 8.0], x.shape[:-1] + (1,))
        c, s = np_quantize(x)
        c[~live] = rng.integers(-127, 128, c[~live].shape)
        s[~live] = np.nan
        deq.append(c.astype(np.float32) * s[..., None])
        if layers is not None:
            c_stack = noise.integers(-127, 128, (layers,) + c.shape).astype(np.int8)
            s_stack = noise.random((layers,) + s.shape).astype(np.float32)
            c_stack[layer], s_stack[layer] = c, s
            c, s = c_stack, s_stack
        codes.append(jnp.asarray(c))
        scales.append(jnp.asarray(s))
    args = (jnp.asarray(q, dtype), codes[0], codes[1], table, valid, order, q_order)
    return args, tuple(scales), deq


@functools.partial(jax.jit, static_argnames=("num_splits",))
def kernel(args, scales, layer=None, num_splits=1):
    return block_sparse_attention(*args, k_scales=scales[0], v_scales=scales[1], layer=layer, num_splits=num_splits,
                                  interpret=INTERPRET)


@jax.jit
def reference(args, scales, layer=None):
    return block_sparse_attention_reference(*args, k_scales=scales[0], v_scales=scales[1], layer=layer)


@jax.jit
def xla_attention(args, scales, layer=None):
    q, k, v, table, valid, order, q_order = args
    view = attention.CacheView(write_slots=jnp.zeros(q_order.shape, jnp.int32), page_table=table, slot_valid=valid,
                               slot_order=order, q_order=q_order)
    name = jnp.dtype(q.dtype).name
    return attention.attend(q, QuantPages(k, scales[0], name), QuantPages(v, scales[1], name), view, impl="xla",
                            layer=layer)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T,H,G", [(8, 4, 2), (1, 4, 2), (5, 14, 2)], ids=["prefill", "decode", "r7"])
def test_int8_kernel_equals_reference_library_and_xla(T, H, G, dtype, num_splits):
    args, scales, deq = int8_case(T * 10 + H + num_splits, T=T, H=H, G=G, dtype=dtype, lengths=(70, 23))
    got = np.asarray(kernel(args, scales, num_splits=num_splits), np.float32)
    # Rounding errors follow the values' magnitude (outputs average values of up to ~8 sigma): TOL per unit of it.
    tol = TOL[jnp.dtype(dtype)] * max(1.0, float(np.nanmax(np.abs(deq[1]))) / 4)
    assert got.shape == args[0].shape and np.isfinite(got).all(), "NaN scales of dead slots leaked"
    ref = np.asarray(reference(args, scales), np.float32)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    xla = np.asarray(xla_attention(args, scales), np.float32)
    np.testing.assert_allclose(got, xla, rtol=tol, atol=tol)
    # An oracle that shares no code with the kernel: the library's attention over the numpy-dequantised pages
    # (rounded to bfloat16 as the kernel rounds what it dequantises, for bf16 queries).
    k, v = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in deq)
    oracle = library_attention(np.asarray(args[0], np.float32), k, v, *args[3:])
    np.testing.assert_allclose(got, oracle, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["whole", "split"])
def test_int8_layer_of_a_stack_equals_that_layer_alone(num_splits):
    single, scales, _ = int8_case(61, T=4, H=4, G=2)
    want = np.asarray(kernel(single, scales, num_splits=num_splits))
    for layer in (0, 2):
        stack, stack_scales, _ = int8_case(61, T=4, H=4, G=2, layers=3, layer=layer)
        got = kernel(stack, stack_scales, jnp.int32(layer), num_splits=num_splits)
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(reference(stack, stack_scales, layer)),
                                      np.asarray(reference(single, scales)))


def test_int8_pages_are_not_float_pages():
    # The codes are read as codes times scales: the same kernel over the codes cast to float (scales ignored) and
    # over the float values the codes came from are both far from the int8 result.
    args, scales, deq = int8_case(7, T=4, H=4, G=2)
    got = np.asarray(kernel(args, scales))
    ref = np.asarray(reference(args, scales))
    live = np.asarray(args[4])
    as_float = tuple(jnp.asarray(np.where(live[..., None, None], np.asarray(x, np.float32), 0.0)) for x in args[1:3])
    unscaled = np.asarray(jax.jit(lambda *a: block_sparse_attention(*a, interpret=INTERPRET))(
        args[0], *as_float, *args[3:]))
    assert np.abs(unscaled - ref).max() > 0.1
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_int8_kernel_lowers_to_triton_for_cuda_reading_int8(dtype, num_splits):
    args, scales, _ = int8_case(6, T=8, H=4, G=2, d=32, dtype=dtype, layers=3, layer=1)

    def layers(q, k, v, table, valid, order, q_order, ks, vs):  # inside a layer loop, the layer traced
        return jax.lax.fori_loop(0, 3, lambda i, x: block_sparse_attention(
            x, k, v, table, valid, order, q_order, layer=i, k_scales=ks, v_scales=vs, num_splits=num_splits,
            interpret=False), q)

    text = lower_for_cuda(layers, *args, *scales)
    assert has_triton_call(text)
    # The Triton call is handed the int8 stacks and their float32 scales themselves: no dequantised copy of the pool
    # is made around it.
    call = next(line for line in text.splitlines() if TRITON_CALL_TARGET in line)
    operands = re.search(r"\} : \((.*)\) -> ", call).group(1)
    assert operands.count("tensor<3x12x16x2x32xi8>") == 2 and operands.count("tensor<3x12x16x2xf32>") == 2, operands
    assert "xf32>" not in operands.replace("tensor<3x12x16x2xf32>", "") or dtype == jnp.float32


def test_bad_int8_arguments_are_refused_by_name():
    args, (ks, vs), _ = int8_case(5, T=2, H=4, G=2)
    with pytest.raises(ValueError, match="k_pages is int8: pass its per-token scales"):
        block_sparse_attention(*args, interpret=True)
    with pytest.raises(ValueError, match="k_pages is int8"):
        block_sparse_attention_reference(*args)
    with pytest.raises(ValueError, match="only k_scales"):
        block_sparse_attention(*args, k_scales=ks, interpret=True)
    with pytest.raises(ValueError, match=r"v_scales must be float32 \(12, 16, 2\)"):
        block_sparse_attention(*args, k_scales=ks, v_scales=vs[:, :8], interpret=True)
    with pytest.raises(ValueError, match="k_scales must be float32"):
        block_sparse_attention(*args, k_scales=ks.astype(jnp.bfloat16), v_scales=vs, interpret=True)
    floats = (args[0], args[1].astype(jnp.float32), args[2].astype(jnp.float32)) + args[3:]
    with pytest.raises(ValueError, match="k_pages must be int8 codes when scales are given"):
        block_sparse_attention(*floats, k_scales=ks, v_scales=vs, interpret=True)
