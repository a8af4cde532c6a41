"""`abstract_module`: the abstract build a checkpoint restore starts from has the ordinary build's structure, shapes
and dtypes, and traces no random draw (what made it cost most of a small model's load)."""

from __future__ import annotations

import jax
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
