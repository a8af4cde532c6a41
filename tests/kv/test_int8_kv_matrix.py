"""The int8 KV pool across the paging x retention matrix (issue 41's done-when): under every paging mode and several
retention policies an int8 pool streams exactly as the int8 native layout does (migration moves codes and scales as
they are), and the native int8 stream stays within 2 % of the float pool's logit range. OmniPick's row is
`tests/kv/test_int8_kv.py::test_every_paging_mode_streams_int8_like_int8_native`; the float pool's own paging check
is `tests/paging/test_paging.py::test_every_paging_mode_streams_like_native`."""

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.kv.quant_kv import QuantPages
from omnijax.models.config import TINY_OMNI
from omnijax.paging import PAGING_MODES, Paging
from omnijax.retention import H2O, SinkWindow, StreamingLLM

POLICIES = [(SinkWindow(sink=4, window=30), "xla"), (StreamingLLM(sink_tokens=4, window=22, high_watermark=40), "xla"),
            (H2O(heavy=10, recent=20, high_watermark=40), "reference")]  # H2O's attention mass: reference only


@pytest.fixture(scope="module")
def tiny():
    return omnijax.Decoder(TINY_OMNI)


@pytest.mark.parametrize("policy,impl", POLICIES, ids=[type(p).__name__ for p, _ in POLICIES])
def test_every_paging_mode_streams_an_int8_pool_like_int8_native(tiny, policy, impl):
    rng = np.random.default_rng(7)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i) for i in range(12)])
    common = dict(policy=policy, page_size=8, num_pages=16, subblock=4, impl=impl)
    flt = omnijax.stream(tiny, chunks, **common)
    native = omnijax.stream(tiny, chunks, kv_dtype="int8", **common)
    assert isinstance(native.state.kv.k, QuantPages)
    assert int(np.asarray(native.stats.evicted).sum()) > 0
    span = float(np.ptp(np.asarray(flt.logits)))
    assert float(np.abs(np.asarray(native.logits) - np.asarray(flt.logits)).max()) <= 0.02 * span
    moved = {}
    for mode in PAGING_MODES[1:]:
        other = omnijax.stream(tiny, chunks, kv_dtype="int8", paging=Paging(mode), **common)
        np.testing.assert_allclose(np.asarray(other.logits), np.asarray(native.logits), atol=1e-5, rtol=0,
                                   err_msg=mode)
        np.testing.assert_array_equal(np.asarray(other.stats.evicted), np.asarray(native.stats.evicted))
        moved[mode] = int(np.asarray(other.stats.moved).sum())
    assert sum(moved.values()) > 0, moved  # some mode did move int8 pages under this policy
