"""Sampled speech (`talker_decode.TalkerSampling`, the reference's default `generate(talker_do_sample=True)`):
transformers' torch draws cannot be reproduced, so the oracles are (1) the warped scores the draws come from, equal
to transformers' own logits processors in its order (repetition penalty over the talker's tokens, the suppressed
control ids, temperature, top-k; the code predictor's top-k 50 / top-p 0.8); (2) draws that follow those scores'
softmax; (3) a sampler that keeps one token (top-k 1, no penalty) giving exactly the greedy talker's tokens and codes;
(4) one seed, one speech; another seed, other speech.

The talker is the tiny config of `test_talker` with seeded random parameters (no transformers model is built).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.models.qwen3_omni import talker_decode as D
from omnijax.models.qwen3_omni import talker_forward as F
from omnijax.models.qwen3_omni.talker import Talker, TalkerConfig

torch = pytest.importorskip("torch", reason="torch (the test extra) runs transformers' logits processors")
logits_process = pytest.importorskip("transformers.generation.logits_process",
                                     reason="transformers (the test extra) is the reference")

from tests.models.qwen3_omni.test_talker import SUPPRESS, TALKER  # noqa: E402  (needs torch)

FRAMES = 5


@pytest.fixture(scope="module")
def talker():
    config = TalkerConfig.from_hf(TALKER)
    params = F.talker_params(Talker(config, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(0)
    D_ = config.decoder.hidden_size
    T = 7
    prompt = jnp.asarray(rng.normal(size=(T, D_)), jnp.float32)
    trailing = jnp.asarray(rng.normal(size=(3, D_)), jnp.float32)
    pad = jnp.asarray(rng.normal(size=(D_,)), jnp.float32)
    return config, params, prompt, np.broadcast_to(np.arange(T), (3, T)), trailing, pad


def _speak(talker, sampling):
    config, params, prompt, positions, trailing, pad = talker
    tokens: list[int] = []
    frames = list(D.greedy_frames(config, params, prompt, positions, trailing, pad, max_new_tokens=FRAMES,
                                  suppress=SUPPRESS, tokens=tokens, sampling=sampling))
    return tokens, np.stack(frames, axis=1)


def test_scores_equal_transformers_processors():
    rng = np.random.default_rng(1)
    V = TALKER["text_config"]["vocab_size"]
    logits = (rng.normal(size=(1, V)) * 3).astype(np.float32)
    seen = [3, 7, 7, 40, 12]
    history = np.full((1, FRAMES), -1, np.int32)
    history[0, :len(seen)] = seen
    logits[0, seen[:2]] = [-2.0, 9.0]  # a penalised negative and a penalised top score
    banned = np.zeros((V,), bool)
    banned[SUPPRESS] = True
    sampling = D.TalkerSampling()
    ours = np.asarray(D.talker_scores(jnp.asarray(logits), jnp.asarray(banned), jnp.asarray(history),
                                      sampling.talker))
    ids, scores = torch.tensor([seen]), torch.tensor(logits)
    for processor in (logits_process.RepetitionPenaltyLogitsProcessor(1.05),
                      logits_process.SuppressTokensLogitsProcessor(SUPPRESS),
                      logits_process.TemperatureLogitsWarper(0.9), logits_process.TopKLogitsWarper(50)):
        scores = processor(ids, scores)
    want = scores.numpy()
    kept = np.isfinite(want)
    assert kept.sum() == 50 and np.array_equal(np.isfinite(ours), kept)
    np.testing.assert_allclose(ours[kept], want[kept], rtol=1e-6)
    # the code predictor: top-k 50 (over 40 codes: all) then top-p 0.8, temperature 1
    codes = (rng.normal(size=(1, TALKER["code_predictor_config"]["vocab_size"])) * 2).astype(np.float32)
    ours = np.asarray(sampling.predictor.warp(jnp.asarray(codes)))
    want = logits_process.TopPLogitsWarper(0.8)(ids, logits_process.TopKLogitsWarper(50)(ids, torch.tensor(codes)))
    want = want.numpy()
    kept = np.isfinite(want)
    assert 1 < kept.sum() < codes.shape[1] and np.array_equal(np.isfinite(ours), kept)
    np.testing.assert_allclose(ours[kept], want[kept], rtol=1e-6)

    # the draws follow the warped scores' softmax (4,000 draws: every frequency within 0.03 of its probability)
    draws = jax.vmap(lambda k: D._draw(jnp.asarray(logits), jnp.asarray(banned), jnp.asarray(history), k,
                                       sampling.talker))(jax.random.split(jax.random.key(5), 4000))
    counts = np.bincount(np.asarray(draws).reshape(-1), minlength=V) / 4000
    scores = D.talker_scores(jnp.asarray(logits), jnp.asarray(banned), jnp.asarray(history), sampling.talker)
    probs = np.asarray(jax.nn.softmax(scores, axis=-1))[0]
    want = np.asarray(scores)
    assert counts[~np.isfinite(want[0])].sum() == 0  # never a suppressed or cut token
    assert np.abs(counts - probs).max() < 0.03


def test_a_one_token_sampler_is_greedy_and_seeds_reproduce(talker):
    greedy_tokens, greedy_codes = _speak(talker, None)
    one = D.TalkerSampling(top_k=1, repetition_penalty=1.0, predictor_top_k=1, seed=7)
    tokens, codes = _speak(talker, one)
    assert tokens == greedy_tokens
    np.testing.assert_array_equal(codes, greedy_codes)
    first, again, other = (_speak(talker, D.TalkerSampling(temperature=1.5, seed=s)) for s in (1, 1, 2))
    assert first[0] == again[0]
    np.testing.assert_array_equal(first[1], again[1])
    assert first[0] != other[0] or not np.array_equal(first[1], other[1])
    assert first[0] != greedy_tokens or not np.array_equal(first[1], greedy_codes)
    # every frame's residual codes are valid predictor codes, whatever was drawn
    assert first[1].shape == (TALKER["num_code_groups"], FRAMES - 1)
    assert (first[1][1:] < TALKER["code_predictor_config"]["vocab_size"]).all()


@pytest.mark.parametrize("bad, field", [({"temperature": 0}, "temperature"), ({"top_k": -1}, "top_k"),
                                        ({"top_p": 1.5}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                                        ({"predictor_top_p": 0}, "predictor_top_p"),
                                        ({"predictor_top_k": 2.5}, "predictor_top_k"), ({"seed": 1.0}, "seed")])
def test_bad_sampling_settings_are_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        D.TalkerSampling(**bad)
