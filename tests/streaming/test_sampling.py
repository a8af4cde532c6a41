"""`omnijax.decoding.Sampling`: each warp equals transformers' logits processor for the same setting (on random
logits with padded histories), the chain applies them in `generate`'s order, draws follow the warped distribution,
equal keys reproduce, and bad settings are refused by name."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers processors")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from omnijax.decoding import Greedy, Sampling  # noqa: E402
from omnijax.streaming.config import StreamConfig  # noqa: E402

B, V, N = 4, 64, 12


def _case(seed: int):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    history = rng.integers(0, V, (B, N))
    history[:, : rng.integers(1, N)] = -1  # left padding of various lengths
    history[2] = -1  # a row with no history at all
    return logits, history


def _transformers_chain(s: Sampling, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
    from transformers.generation import logits_process as lp

    processors = []
    if s.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(penalty=s.repetition_penalty))
    if s.temperature != 1.0:
        processors.append(lp.TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        processors.append(lp.TopKLogitsWarper(top_k=s.top_k))
    if s.top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(top_p=s.top_p))
    if s.min_p > 0.0:
        processors.append(lp.MinPLogitsWarper(min_p=s.min_p))
    scores = torch.tensor(logits)  # a copy: the rows are written back below
    for b in range(B):  # transformers has no padding in input_ids: each row with its own real history
        row = history[b][history[b] >= 0]
        out = scores[b: b + 1].clone()
        for p in processors:
            out = p(torch.as_tensor(row[None], dtype=torch.long), out)
        scores[b] = out[0]
    return scores.numpy()


SETTINGS = [Sampling(repetition_penalty=1.3), Sampling(repetition_penalty=0.7), Sampling(temperature=0.6),
            Sampling(top_k=5), Sampling(top_p=0.8), Sampling(min_p=0.1), Sampling(top_k=9, top_p=0.7),
            Sampling(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2)]


@pytest.mark.parametrize("strategy", SETTINGS, ids=repr)
def test_warp_equals_transformers_processors(strategy):
    for seed in range(3):
        logits, history = _case(seed)
        want = _transformers_chain(strategy, logits, history)
        got = np.asarray(strategy.warp(jnp.asarray(logits), jnp.asarray(history, jnp.int32)))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def test_top_p_after_top_k_with_ties_at_the_kth_score():
    # Scores tied with the k-th survive top-k (as in transformers), so top-p must see all of them.
    logits = np.zeros((2, V), np.float32)
    logits[0, :3] = [4.0, 3.0, 2.0]
    logits[0, 3:10] = 1.0  # seven ties at the 4th score
    logits[1] = np.linspace(-2, 2, V)
    s = Sampling(top_k=4, top_p=0.8)  # the floor is 2.0 over all survivors, 3.0 over the top four alone
    want = _transformers_chain(s, np.concatenate([logits, logits])[:B], np.full((B, 1), -1))[:2]
    got = np.asarray(s.warp(jnp.asarray(logits)))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)


def test_draws_follow_the_warped_distribution_and_keys_reproduce():
    s = Sampling(temperature=0.8, top_k=12, top_p=0.95, seed=7)
    logits, history = _case(5)
    logits, history = jnp.asarray(logits[:1]), jnp.asarray(history[:1], jnp.int32)
    probs = np.asarray(jax.nn.softmax(s.warp(logits, history), axis=-1))[0]
    draws = 20_000
    keys = jax.random.split(jax.random.key(s.seed), draws)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: s.select(logits, history, k[None])[0]))(keys))
    counts = np.bincount(tokens, minlength=V)
    assert counts[probs == 0].sum() == 0  # masked tokens are never drawn
    kept = probs > 0
    expected = probs[kept] * draws
    chi2 = float(np.sum((counts[kept] - expected) ** 2 / expected))
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # far inside the tail: a biased sampler fails
    batch = jnp.broadcast_to(logits, (3, V))
    first = np.asarray(s.select(batch, None, s.keys(3)))
    np.testing.assert_array_equal(first, np.asarray(s.select(batch, None, s.keys(3))))  # same seed, same draws
    many = np.asarray(jax.vmap(lambda k: s.select(batch, None, jax.random.split(k, 3)))(keys[:200]))
    assert (many[:, 0] != many[:, 1]).any()  # sequences of a batch draw independently


def test_greedy_is_argmax_and_ignores_a_key():
    logits, history = _case(1)
    got = Greedy().select(jnp.asarray(logits), jnp.asarray(history), jax.random.split(jax.random.key(0), B))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=0.0), "temperature must be > 0"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-1), "top_k must be an int >= 0"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=1.0), r"min_p must be in \[0, 1\)"), (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"), (dict(seed=1.5), "seed must be an int")])
def test_bad_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**bad)


def test_a_streamed_session_samples_inside_the_step_and_reproduces_from_its_seed():
    import omnijax
    from omnijax.chunks.chunk import text_chunk
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder

    model = Decoder(TINY_OMNI.replace(num_layers=1))
    rng = np.random.default_rng(0)
    chunks = [text_chunk(rng.integers(0, 200, 6).tolist(), unit=i, answer_tokens=8) for i in range(2)]

    def answers(decoding, batch=1):
        session = omnijax.Session(model, decoding=decoding, max_answer_tokens=8, num_pages=8, page_size=8,
                                  batch=batch)
        return [np.asarray(session.feed(c if batch == 1 else _rows(c, batch)).tokens) for c in chunks]

    hot = Sampling(temperature=5.0, seed=3)  # a flat distribution: draws differ unless the keys are the same
    first, again = answers(hot), answers(hot)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)  # the same seed draws the same answers
    assert any((a != b).any() for a, b in zip(first, answers(Sampling(temperature=5.0, seed=4))))
    assert (first[0] != first[1]).any()  # the key advances from chunk to chunk
    two = answers(hot, batch=2)[0]
    assert (two[0] != two[1]).any()  # rows of a batch draw with keys of their own
    greedy = answers(Greedy())
    for a, b in zip(answers(Sampling(top_k=1, seed=9)), greedy):
        np.testing.assert_array_equal(a, b)  # top-1 sampling is greedy decoding
    with pytest.raises(ValueError, match="needs one PRNG key per sequence"):
        Sampling().select(jnp.zeros((1, V)))


def test_stop_ids_end_an_answer_and_are_refused_when_malformed():
    import omnijax
    from omnijax.chunks.chunk import stack_chunks, text_chunk
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder

    model = Decoder(TINY_OMNI.replace(num_layers=1, eos_token_ids=()))
    chunk = stack_chunks([text_chunk([3, 4, 5], answer_tokens=8)])
    free = np.asarray(omnijax.stream(model, chunk, max_answer_tokens=8).tokens)[0, 0]
    assert (free >= 0).all()  # no eos in this config: all 8 tokens come
    stop = int(free[2])
    first = int(np.flatnonzero(free == stop)[0])
    for strategy in (Greedy(stop=(stop,)), Sampling(top_k=1, stop=[stop])):
        got = np.asarray(omnijax.stream(model, chunk, max_answer_tokens=8, decoding=strategy).tokens)[0, 0]
        np.testing.assert_array_equal(got[: first + 1], free[: first + 1])  # the stop token is the last one
        assert (got[first + 1:] == -1).all()
    for bad in ("7", (1.5,), (-1,), 3):
        with pytest.raises(ValueError, match="stop"):
            Greedy(stop=bad)


def test_tidekv_decoding_takes_a_strategy():
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    from omnijax.prefill import decode, greedy, tidekv_prefill

    model = Decoder(TINY_OMNI.replace(num_layers=1))
    x = jax.random.normal(jax.random.key(0), (2, 12, TINY_OMNI.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (1, 2, 12))
    tide = tidekv_prefill(model, x, pos, room=6, chunk=8, page=8)
    want, want_logits, _ = greedy(model, tide.cache, tide.logits, 6)
    got, got_logits, _ = decode(model, tide.cache, tide.logits, 6, decoding=Sampling(top_k=1, seed=2))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # top-1 sampling is greedy
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
    hot = Sampling(temperature=5.0, seed=2)
    a, _, _ = decode(model, tide.cache, tide.logits, 6, decoding=hot)
    b, _, _ = decode(model, tide.cache, tide.logits, 6, decoding=hot)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # a seed reproduces
    assert (np.asarray(a) != np.asarray(want)).any()
    with pytest.raises(TypeError, match="decoding strategy"):
        decode(model, tide.cache, tide.logits, 2, decoding="greedy")


def test_engine_sessions_sample_with_keys_of_their_own_and_reproduce():
    from omnijax.chunks.chunk import text_chunk
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    from omnijax.serve.engine.engine import Engine, EngineConfig

    model = Decoder(TINY_OMNI.replace(num_layers=1))
    chunk = text_chunk([5, 6, 7, 8])
    stream = StreamConfig(num_pages=16, page_size=8, max_answer_tokens=6,
                          decoding=Sampling(temperature=5.0, seed=11))

    def run():
        engine = Engine(model, EngineConfig(stream=stream, buckets=(1, 2), chunk_tokens=4))
        engine.open("a")
        engine.open("b")
        for s in ("a", "b"):
            engine.submit(s, chunk, 6)
        report = engine.tick()
        return {s: list(o.tokens) for s, o in report.outputs.items()}

    first = run()
    assert first == run()  # same seed, same sessions in the same order: the same draws
    assert first["a"] != first["b"]  # the same chunk, but each session draws with its own key


def _rows(chunk, batch):
    """A batch-1 chunk repeated into `batch` identical rows."""
    return jax.tree.map(lambda x: np.repeat(np.asarray(x), batch, axis=1 if np.ndim(x) == 3 else 0), chunk)
