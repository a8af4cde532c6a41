"""The compiled paged-KV wrappers the tests share (tests/_support/kv_ops.py) compile once per shape and static
setting, and give what the package's eager functions give."""

import jax
import numpy as np
import pytest

from omnijax.kv import paged
from tests._support import kv_ops as ops

pytestmark = pytest.mark.fast  # the quick tier (`make test-fast`): the paged cache ops reused


def test_one_program_per_shape_and_the_eager_result():
    init = dict(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=4, page_size=4, position_axes=1)
    kv = ops.init(**init)
    chunks = np.random.default_rng(0).standard_normal((2, 1, 1, 3, 1, 2)).astype(np.float32)
    for k, start in zip(chunks, (0, 3)):  # same shapes, other values: no new program
        kv, slots = ops.append(kv, k, -k, np.ones((1, 3), bool), ops.meta(1, 3, start))
    assert ops._append._cache_size() == 1 and ops.init._cache_size() == 1
    want = paged.init(**init)  # the package's functions, eagerly
    for k, start in zip(chunks, (0, 3)):
        want, want_slots = paged.append(want, k, -k, np.ones((1, 3), bool), ops.meta(1, 3, start))
    for got_leaf, want_leaf in zip(jax.tree.leaves(kv), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(want_slots))
