"""`qmatmul` routed to the int4 Pallas kernel (`method="pallas"`, or a weight set to `kernel="pallas"`): equal to the
dequantise-then-matmul oracle on CPU (interpreted), lowered for cuda it is the Triton call reading the uint8 codes
(and without the setting it is not), and what the kernel cannot take is refused by name, never run another way."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kernels import quant as Q
from omnijax.kernels.lowering import has_triton_call, lower_for_cuda
from tests.kernels.test_quant import numpy_dequantize, weight


@pytest.mark.parametrize("g,cols,lead", [(32, 96, (3,)), (128, 48, (2, 5))])
def test_pallas_method_and_kernel_setting_equal_the_numpy_oracle(g, cols, lead):
    """Any leading activation shape, output widths whose widest block is 32 / 16, float32 and bfloat16 `x`."""
    w = weight((256, cols), seed=g)
    qw = Q.quantize(w, Q.Int4Grouped(g))
    x = np.random.default_rng(g).normal(size=(*lead, 256)).astype(np.float32)
    oracle = x.astype(np.float64) @ numpy_dequantize(qw).astype(np.float64)
    tol = 1e-6 * np.abs(x).sum(-1).max() * np.abs(w).max()
    marked = Q.with_kernel(qw, "pallas")
    assert marked.kernel == "pallas" and qw.kernel == "xla"  # a new weight; the old one unchanged
    explicit = np.asarray(Q.qmatmul(jnp.asarray(x), qw, method="pallas", preferred_element_type=jnp.float32))
    auto = np.asarray(jax.jit(lambda x, w: Q.qmatmul(x, w, preferred_element_type=jnp.float32))(x, marked))
    assert explicit.shape == auto.shape == (*lead, cols)
    assert np.abs(explicit - oracle).max() <= tol and np.abs(auto - oracle).max() <= tol
    assert np.abs(oracle).max() > 100 * tol
    half = np.asarray(Q.qmatmul(jnp.asarray(x, jnp.bfloat16), marked))  # the kernel reads bf16 rows as float32
    assert half.dtype == jnp.bfloat16
    want = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ numpy_dequantize(qw).astype(np.float64)
    assert np.abs(half.astype(np.float64) - want).max() <= 1e-2 * np.abs(want).max()


def test_the_setting_is_what_lowers_to_triton():
    """A stacked weight indexed by layer inside the program keeps its kernel; lowered for cuda, the marked weight's
    matmul is the Triton call with the packed codes as its operand, the unmarked one has no Triton call."""
    qw = Q.quantize(weight((2, 512, 256), seed=4), Q.Int4Grouped(32))
    x = jax.ShapeDtypeStruct((2, 512), jnp.float32)

    def fn(x, qw):
        return Q.qmatmul(x, qw.index(1), preferred_element_type=jnp.float32)

    marked = lower_for_cuda(fn, x, Q.with_kernel(qw, "pallas"))
    assert has_triton_call(marked)
    assert re.search(r"tensor<256x256xui8>", marked), "the packed codes are not the kernel's operand"
    assert not re.search(r"tensor<512x256x(f32|f16|bf16)>", marked), "a float copy of the weight"
    assert not has_triton_call(lower_for_cuda(fn, x, qw))


def test_what_the_kernel_cannot_take_is_refused_by_name():
    int8 = Q.quantize(weight((64, 48)), Q.Int8Grouped(32))
    int4 = Q.quantize(weight((64, 40)), Q.Int4Grouped(32))
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="takes Int4Grouped weights, not Int8Grouped"):
        Q.qmatmul(x, int8, method="pallas")
    with pytest.raises(ValueError, match=r"no block of \(128, 64, 32, 16\) output columns divides .* width 40"):
        Q.qmatmul(x, int4, method="pallas")
    with pytest.raises(ValueError, match="kernel must be one of \\('xla', 'pallas'\\), got 'triton'"):
        Q.with_kernel(int4, "triton")
    with pytest.raises(ValueError, match=r"Int4Grouped weights only; these are not: \['b'\] \(Int8Grouped\)"):
        Q.with_kernel({"a": int4, "b": int8}, "pallas")
    with pytest.raises(ValueError, match="takes Int4Grouped weights, not Int8PerChannel"):
        Q.QuantizedWeight(int8.values, int8.scales, None, Q.Int8PerChannel(), "pallas")
    with pytest.raises(ValueError, match="kernel must be one of"):
        Q.QuantizedWeight(int4.values, int4.scales, int4.offsets, int4.scheme, "cuda")
    tree = {"a": int4, "f": jnp.ones(3)}
    assert Q.with_kernel(tree, "pallas")["f"] is tree["f"]  # other leaves untouched
