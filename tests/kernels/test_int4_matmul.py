"""The Pallas int4 matmul (`omnijax.kernels.int4_matmul`): interpreted on CPU it equals its jnp reference and a
plain-numpy dequantise-then-matmul in float64; lowered for cuda on CPU it reaches Triton reading the uint8 codes
(no float copy of the weight in the program); bad input is refused by name."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kernels import quant as Q
from omnijax.kernels.int4_matmul import int4_matmul, int4_matmul_reference
from omnijax.kernels.lowering import has_triton_call, lower_for_cuda
from tests.kernels.test_quant import numpy_dequantize, weight


@pytest.mark.parametrize("g,rows,block_n", [(32, 1, 32), (64, 5, 64), (128, 17, 32)])
def test_kernel_equals_reference_and_numpy(g, rows, block_n):
    w = weight((256, 128), seed=g)
    qw = Q.quantize(w, Q.Int4Grouped(g))
    x = np.random.default_rng(rows).normal(size=(rows, 256)).astype(np.float32)
    oracle = x.astype(np.float64) @ numpy_dequantize(qw).astype(np.float64)  # numpy unpacks the nibbles itself
    tol = 1e-6 * (np.abs(x).sum(-1, keepdims=True) * np.abs(w).max()).max()
    got = np.asarray(int4_matmul(jnp.asarray(x), qw, block_n=block_n, interpret=True))
    ref = np.asarray(int4_matmul_reference(jnp.asarray(x), qw))
    assert got.shape == (rows, 128) and got.dtype == np.float32
    assert np.abs(got - oracle).max() <= tol and np.abs(ref - oracle).max() <= tol, (np.abs(got - oracle).max(), tol)
    assert np.abs(oracle).max() > 100 * tol  # the bound is tight next to the values


def test_lowers_to_triton_reading_the_codes():
    qw = Q.quantize(weight((512, 256), seed=1), Q.Int4Grouped(32))
    x = jax.ShapeDtypeStruct((16, 512), jnp.float32)
    text = lower_for_cuda(lambda x, qw: int4_matmul(x, qw, block_m=16, block_n=64), x, qw)
    assert has_triton_call(text)
    assert re.search(r"tensor<256x256xui8>", text), "the packed codes are not an operand"
    assert not re.search(r"tensor<512x256xf(32|16)>|tensor<512x256xbf16>", text), "a float copy of the weight"


def test_bad_input_is_refused_by_name():
    qw = Q.quantize(weight((64, 48), seed=2), Q.Int4Grouped(32))
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="takes an Int4Grouped weight, got Int8Grouped"):
        int4_matmul(x, Q.quantize(weight((64, 48)), Q.Int8Grouped(32)), block_n=16, interpret=True)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16 .*got 24"):
        int4_matmul(x, qw, block_n=24, interpret=True)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16 .*got 8"):
        int4_matmul(x, qw, block_m=8, block_n=16, interpret=True)
    with pytest.raises(ValueError, match="block_n 32 does not divide the weight's output width 48"):
        int4_matmul(x, qw, block_n=32, interpret=True)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\], got shape \(2, 32\)"):
        int4_matmul(jnp.ones((2, 32)), qw, block_n=16, interpret=True)
    with pytest.raises(ValueError, match="takes a 2-D weight"):
        int4_matmul_reference(x, Q.quantize(weight((2, 64, 48)), Q.Int4Grouped(32)))
