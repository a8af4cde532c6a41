"""Retention inside the streaming scan: trims happen in the compiled program, keep the cache bounded, and the
accumulated attention scores H2O ranks by are really collected."""

import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks import stack_chunks, text_chunk
from omnijax.config import TINY_OMNI
from omnijax.retention import (H2O, NoSlide, OfficialUnitWindow, OmniPick, SinkWindow, StreamingLLM, TokenSliding,
                               UnitFIFO, sequence_view)


@pytest.fixture(scope="module")
def model():
    return omnijax.Decoder(TINY_OMNI)


def _session(n_chunks=12, length=10, seed=0):
    rng = np.random.default_rng(seed)
    return stack_chunks([text_chunk(rng.integers(0, 300, length), unit=i) for i in range(n_chunks)])


@pytest.mark.parametrize("policy", [TokenSliding(window=24, high_watermark=40),
                                    StreamingLLM(sink_tokens=2, window=22, high_watermark=40),
                                    H2O(heavy=8, recent=16, high_watermark=40), SinkWindow(sink=4, window=20),
                                    UnitFIFO(high_watermark=40, low_watermark=25),
                                    OfficialUnitWindow(high_watermark=40, low_watermark=25),
                                    OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6)])
def test_trims_bound_the_cache_inside_the_scan(model, policy):
    chunks = _session()
    result = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16)
    retained = np.asarray(result.stats.layout.retained_cells[:, 0])
    evicted = np.asarray(result.stats.evicted[:, 0])
    cap = policy.high_watermark if hasattr(policy, "high_watermark") else policy.sink + policy.window
    assert retained.max() <= cap and evicted.sum() > 0
    assert (retained + np.cumsum(evicted) == 10 * np.arange(1, 13)).all()  # nothing lost or invented
    assert not bool(result.state.kv.exhausted[0])
    next_pos = np.asarray(result.stats.next_pos[:, 0])
    if policy.reindex:  # positions closed up: the cursor is the retained count
        np.testing.assert_array_equal(next_pos, retained)
    else:
        np.testing.assert_array_equal(next_pos, 10 * np.arange(1, 13))


def test_h2o_scores_are_accumulated_and_nothing_else_pays_for_them(model):
    chunks = _session(4)
    tracked = omnijax.stream(model, chunks, policy=H2O(heavy=8, recent=16, high_watermark=1000), page_size=8)
    plain = omnijax.stream(model, chunks, policy=NoSlide(), page_size=8)
    view = sequence_view(tracked.state.kv)
    scores = np.asarray(view.score)[np.asarray(view.live)]
    # Each query distributes one unit of attention mass per (layer-averaged) head: 40 queries in all.
    np.testing.assert_allclose(scores.sum(), 40.0, rtol=1e-5)
    assert (scores > 0).all()
    assert float(jnp.abs(plain.state.kv.score).max()) == 0.0
    np.testing.assert_array_equal(np.asarray(tracked.logits), np.asarray(plain.logits))
