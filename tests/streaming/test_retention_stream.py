"""Retention inside the streaming scan: trims happen in the compiled program, keep the cache bounded, and the
accumulated attention scores H2O ranks by are really collected."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.models.config import TINY_OMNI
from omnijax.retention import (
    H2O,
    NoSlide,
    OfficialUnitWindow,
    OmniPick,
    SinkWindow,
    StreamingLLM,
    TokenSliding,
    UnitFIFO,
    sequence_view,
)


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
    result = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, impl="reference")
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
    tracked = omnijax.stream(model, chunks, policy=H2O(heavy=8, recent=16, high_watermark=1000), page_size=8,
                             impl="reference")
    plain = omnijax.stream(model, chunks, policy=NoSlide(), page_size=8, impl="reference")
    view = sequence_view(tracked.state.kv)
    scores = np.asarray(view.score)[np.asarray(view.live)]
    # Each query distributes one unit of attention mass per (layer-averaged) head: 40 queries in all.
    np.testing.assert_allclose(scores.sum(), 40.0, rtol=1e-5)
    assert (scores > 0).all()
    assert float(jnp.abs(plain.state.kv.score).max()) == 0.0
    np.testing.assert_array_equal(np.asarray(tracked.logits), np.asarray(plain.logits))


@pytest.mark.parametrize("paging", ["native", "tile_skip"])
def test_attended_layout_is_the_cache_before_the_chunks_trim(model, paging):
    """`stats.attended` of every chunk equals the layout the same chunk leaves, fed from the same state, when nothing
    trims (a NoSlide session); the scan reports the same figures as the step-wise session."""
    chunks = _session()
    policy = OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6)
    trimming = omnijax.Session(model, policy=policy, page_size=8, num_pages=16, paging=paging)
    untrimmed = omnijax.Session(model, page_size=8, num_pages=16, paging=paging)
    attended, evicted = [], []
    for c in range(chunks.token_ids.shape[0]):
        chunk = jax.tree.map(lambda x: x[c], chunks)
        untrimmed.state = jax.tree.map(jnp.copy, trimming.state)
        out = trimming.feed(chunk)
        expect = untrimmed.feed(chunk).stats.layout
        for field in dataclasses.fields(expect):
            np.testing.assert_array_equal(np.asarray(getattr(out.stats.attended, field.name)),
                                          np.asarray(getattr(expect, field.name)), err_msg=f"chunk {c} {field.name}")
        attended.append(out.stats.attended)
        evicted.append(int(out.stats.evicted[0]))
    assert sum(e > 0 for e in evicted) >= 3
    run = omnijax.stream(model, chunks, policy=policy, page_size=8, num_pages=16, paging=paging)
    for field in dataclasses.fields(run.stats.attended):
        np.testing.assert_array_equal(np.asarray(getattr(run.stats.attended, field.name)),
                                      np.stack([np.asarray(getattr(a, field.name)) for a in attended]),
                                      err_msg=field.name)
    after = run.stats.layout
    retained_before = np.concatenate([[0], np.asarray(after.retained_cells[:-1, 0])])
    np.testing.assert_array_equal(np.asarray(run.stats.attended.retained_cells[:, 0]), retained_before + 10)
    trims = np.asarray(evicted) > 0
    assert (np.asarray(run.stats.attended.retained_cells[trims, 0]) > 40).all()  # what crossed the watermark
