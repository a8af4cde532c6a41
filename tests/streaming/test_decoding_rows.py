"""`RowSampling`: per-sequence temperature and top-p chosen at run time. Each row draws exactly as `Sampling` with
its settings (or takes the argmax at temperature 0), alone and through the engine's batched ticks."""

import dataclasses

import jax
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.decoding import Greedy, RowSampling, Sampling, sampling_keys, sampling_row
from omnijax.models.config import TINY_OMNI
from omnijax.serve.engine.engine import Engine, EngineConfig

ROWS = [(0.0, 1.0), (0.7, 0.9), (1.3, 1.0), (1.0, 0.5), (0.2, 0.999)]


# The strategies' methods as the step programs call them: jitted (each strategy is a static argument), so the 20
# trials below run a few compiled programs instead of lowering every primitive, and every `lax.cond` over new closures,
# op by op (an eager run lowered `cond` 284 times).
_select = jax.jit(lambda strategy, *args, **kw: strategy.select(*args, **kw), static_argnums=0)
_warp = jax.jit(lambda strategy, *args, **kw: strategy.warp(*args, **kw), static_argnums=0)


def test_each_row_draws_as_sampling_with_its_settings():
    rng = np.random.default_rng(0)
    B, V = len(ROWS), 64
    strategy = RowSampling(top_k=20, repetition_penalty=1.3, seed=5)
    rows = np.stack([sampling_row(t, p, top_k=20, repetition_penalty=1.3) for t, p in ROWS])
    for trial in range(20):
        logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
        history = rng.integers(-1, V, size=(B, 6)).astype(np.int32)
        keys = jax.random.wrap_key_data(sampling_keys(trial, B))
        got = np.asarray(_select(strategy, logits, history, keys, row=rows))
        for b, (t, p) in enumerate(ROWS):
            if t == 0:
                want = _select(Greedy(), _warp(strategy, logits[b:b + 1], history[b:b + 1], rows[b:b + 1]))
            else:
                want = _select(Sampling(temperature=t, top_p=p, top_k=20, repetition_penalty=1.3),
                               logits[b:b + 1], history[b:b + 1], keys[b:b + 1])
            assert int(got[b]) == int(np.asarray(want)[0]), (trial, b)
        scores = np.asarray(_warp(strategy, logits, history, rows))
        for b, (t, p) in enumerate(ROWS):
            if t > 0:
                ref = np.asarray(_warp(Sampling(temperature=t, top_p=p, top_k=20, repetition_penalty=1.3),
                                       logits[b:b + 1], history[b:b + 1]))[0]
                # the same ops; XLA:CPU may round a division 1 ulp apart between batch shapes
                assert np.array_equal(np.isinf(scores[b]), np.isinf(ref))
                np.testing.assert_allclose(scores[b], ref, rtol=1e-6)
    default = np.asarray(RowSampling(temperature=0.7, top_p=0.9).warp(logits))
    np.testing.assert_allclose(default, np.asarray(Sampling(temperature=0.7, top_p=0.9).warp(logits)), rtol=1e-6)


def test_settings_and_refusals():
    assert sampling_row(0.7, 0.9).dtype == np.float32 and float(sampling_row(1.0, 0.25)[1]) == 0.75
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            RowSampling(**bad)
        with pytest.raises(ValueError):
            sampling_row(**{"temperature": 1.0, "top_p": 1.0, **bad})
    chunk = dataclasses.replace(text_chunk([1, 2, 3], answer_tokens=2), sampling=sampling_row(0.5, 1.0)[None])
    model = omnijax.Decoder(TINY_OMNI)
    with pytest.raises(ValueError, match="RowSampling"):  # a strategy that would ignore them refuses them
        omnijax.Session(model, omnijax.StreamConfig(num_pages=8, page_size=8, max_answer_tokens=2)).feed(chunk)
    bad = dataclasses.replace(chunk, sampling=sampling_row(0.5, 1.0)[None])
    bad.sampling[0, 1] = 1.0  # 1 - top_p must be < 1
    with pytest.raises(ValueError, match="sampling_row"):
        omnijax.Session(model, omnijax.StreamConfig(num_pages=8, page_size=8, max_answer_tokens=2,
                                                    decoding=RowSampling())).feed(bad)


def test_engine_rows_decode_as_engines_with_those_strategies():
    """Two sessions of one RowSampling engine, one greedy and one at (0.8, 0.9): each answers as the first session
    of an engine decoding with Greedy() / Sampling(0.8, 0.9) (same seed, so the same keys)."""
    model = omnijax.Decoder(TINY_OMNI)
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, TINY_OMNI.vocab_size, 6) for _ in range(3)]

    def run(decoding, rows):
        stream = omnijax.StreamConfig(num_pages=32, page_size=8, max_answer_tokens=4, decoding=decoding)
        engine = Engine(model, EngineConfig(stream, chunk_tokens=8, buckets=(2,), return_logits=False))
        for s in range(len(rows)):
            engine.open(f"s{s}")
        answers = {f"s{s}": [] for s in range(len(rows))}
        for unit, ids in enumerate(frames):
            for s, row in enumerate(rows):
                chunk = text_chunk(ids, unit=2 * unit)
                if row is not None:
                    chunk = dataclasses.replace(chunk, sampling=sampling_row(*row)[None])
                engine.submit(f"s{s}", chunk, 4)
            for sid, out in engine.tick().outputs.items():
                answers[sid].append(out.tokens)
        return answers

    mixed = run(RowSampling(seed=9), [(0.0, 1.0), (0.8, 0.9)])
    assert mixed["s0"] == run(Greedy(), [None])["s0"]
    sampled = run(Sampling(temperature=0.8, top_p=0.9, seed=9), [None, None])
    assert mixed["s1"] == sampled["s1"]
    assert mixed["s1"] != mixed["s0"]  # the two rows did decode differently
