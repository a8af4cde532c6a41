"""`abstract_module`: the abstract build a checkpoint restore starts from has the ordinary build's structure, shapes
and dtypes, and traces no random draw (what made it cost most of a small model's load)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.models import layers
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavConfig


def _tree(module: nnx.Module) -> dict:
    return jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), nnx.to_pure_dict(nnx.state(module)))


def test_abstract_module_is_the_eval_shape_build_without_draws(monkeypatch):
    builds = {"decoder": lambda: Decoder(TINY_OMNI, rngs=nnx.Rngs(0)),
              "token2wav": lambda: Token2Wav(Token2WavConfig(), rngs=nnx.Rngs(0))}
    drawn = []
    normal = jax.random.normal
    monkeypatch.setattr(layers.jax.random, "normal", lambda *a, **k: drawn.append(a[1]) or normal(*a, **k))
    for name, build in builds.items():
        want = _tree(nnx.eval_shape(build))
        assert drawn, f"{name}: the ordinary abstract build draws its parameters"
        drawn.clear()
        got = _tree(layers.abstract_module(build))
        assert got == want, name
        assert not drawn, f"{name}: abstract_module drew {len(drawn)} parameters"
    # outside it, parameters are drawn again (the setting does not leak)
    assert float(abs(layers.new_param((4,), "float32", nnx.Rngs(0))[...]).sum()) > 0


def test_a_drawn_parameter_is_the_eager_draw_to_the_bit():
    """`new_param` draws in one kept program per shape (`layers._normal`); its values are the eager
    `std * N(0, 1)` cast to the dtype, bit for bit (the tiny models' weights every test builds stay as they were)."""
    import numpy as np

    ours, eager = nnx.Rngs(3), nnx.Rngs(3)
    for shape, dtype in (((4, 8), jnp.float32), ((3,), jnp.bfloat16), ((2, 5, 7), jnp.float32),
                         ((151, 96), jnp.bfloat16), ((1000,), jnp.float32)):
        for std in (0.02, 0.3):
            drawn = layers.new_param(shape, dtype, ours, std=std)[...]
            expected = (std * jax.random.normal(eager.params(), shape, jnp.float32)).astype(dtype)
            assert drawn.dtype == expected.dtype and drawn.shape == shape
            np.testing.assert_array_equal(np.asarray(drawn, np.float32), np.asarray(expected, np.float32))
