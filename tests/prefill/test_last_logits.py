"""The lm head (`decoder.head_logits`, what `Decoder.logits` and the prefill paths' `last_logits` run): the values of
the plain product, and no program that copies a tied head's table (written as `embed.T`, XLA:CPU copied the
transposed table into every one-row program: 113 MB per decode step of one sequence on SmolLM2, and eagerly the
transpose was a copy of its own at the end of every prefill)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder, head_logits, last_logits

pytestmark = pytest.mark.fast  # the quick tier (`make test-fast`): the last-position logits on a tiny decoder


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_the_plain_product(tied):
    model = Decoder(TINY_OMNI.replace(num_layers=1, tie_embeddings=tied))
    hidden = jax.random.normal(jax.random.key(0), (2, TINY_OMNI.hidden_size), jnp.float32)
    h = np.asarray(hidden, np.float64)
    h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + TINY_OMNI.rms_norm_eps) * np.asarray(model.final_norm[...])
    table = np.asarray(model.embed[...], np.float64).T if tied else np.asarray(model.lm_head[...], np.float64)
    want = h @ table
    for got in (np.asarray(last_logits(model, hidden)), np.asarray(model.logits(hidden))):
        assert got.shape == (2, TINY_OMNI.vocab_size) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_tied_head_is_read_as_stored(rows):
    c = TINY_OMNI.replace(num_layers=1, tie_embeddings=True, vocab_size=4096)
    model = Decoder(c)
    text = jax.jit(head_logits, static_argnums=0).lower(c, jnp.ones((rows, c.hidden_size), jnp.float32),
                                                        model.final_norm[...], model.head_weight()).compile().as_text()
    table = f"f32[{c.hidden_size},{c.vocab_size}]"  # the transposed table's shape (the stored one is [V, D])
    assert "dot(" in text, text
    assert table not in text, [ln for ln in text.splitlines() if table in ln]
