"""Retention inside the streaming scan: trims happen in the compiled program, keep the cache bounded, and the
accumulated attention scores H2O ranks by are really collected."""

import dataclasses

import jax
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


@pytest.mark.parametrize("paging", ["native", "tile_skip"])
def test_attended_layout_is_the_cache_before_the_chunks_trim(model, paging):
    """`stats.attended` equals the layout of the same chunk streamed, from the state before it, without a trim."""
    chunks = _session()
    policy = OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6)
    run = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, paging=paging)
    attended, after = run.stats.attended, run.stats.layout
    evicted = np.asarray(run.stats.evicted[:, 0])
    trims = np.flatnonzero(evicted > 0)
    assert len(trims) >= 3
    for c in (int(trims[0]), int(trims[-1]), int(trims[-1]) - 1):
        head = jax.tree.map(lambda x: x[:c], chunks)
        before = omnijax.stream(model, head, policy=policy, page_size=8, num_pages=16, paging=paging).state
        one = jax.tree.map(lambda x: x[c:c + 1], chunks)
        untrimmed = omnijax.stream(model, one, policy=NoSlide(), state=before, paging=paging)
        for field in dataclasses.fields(attended):
            expect = np.asarray(getattr(untrimmed.stats.layout, field.name))[0]
            np.testing.assert_array_equal(np.asarray(getattr(attended, field.name))[c], expect, err_msg=field.name)
    retained_before = np.concatenate([[0], np.asarray(after.retained_cells[:-1, 0])])
    np.testing.assert_array_equal(np.asarray(attended.retained_cells[:, 0]), retained_before + 10)
    assert (np.asarray(attended.retained_cells[trims, 0]) > 40).all()  # what crossed the watermark
    calm = evicted == 0  # no trim: the chunk leaves the cache it attended over
    for field in dataclasses.fields(attended):
        np.testing.assert_array_equal(np.asarray(getattr(attended, field.name))[calm],
                                      np.asarray(getattr(after, field.name))[calm], err_msg=field.name)
