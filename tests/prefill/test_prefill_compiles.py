"""TideKV prefill compiles the layer forward once per shape, whatever the per-layer budgets.

PyramidKV gives every layer a different budget. When the budget was a static argument of the one jitted layer step,
each layer compiled the whole layer forward again (30 compiles a prompt on SmolLM2). The forward is now its own
program (`layer_major.layer_forward`) and only the small compression program (`layer_compress`) depends on the
budget. The count comes from jax's own compile log (`jax_log_compiles`), so any program that carries the forward and
is compiled per budget, whatever its name, shows up as more than one compile of a forward-sized program. The layer
programs are kept executables (`cached_jit`): a run after one that kept them loads them from disk without a compile
record, so their loads count as builds too.
"""

from __future__ import annotations

import logging
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.prefill import SnapKV, layer_major, pyramid_budgets, tidekv_prefill

L, B, CHUNK, PAGE, WINDOW = 4, 1, 32, 16, 8
COMPILING = re.compile(r"Compiling jit\((\w+)\)")
# the layer programs by the name jax compiles them under (`layer_step` is `run_layer` compiled as one program)
_KEPT = {"layer_forward": layer_major.layer_forward, "layer_compress": layer_major.layer_compress,
         "run_layer": layer_major.layer_step}


class _Compiles(logging.Handler):
    """Counts `Compiling jit(NAME)` records by program name."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: Counter = Counter()

    def emit(self, record):
        if (m := COMPILING.match(record.getMessage())) is not None:
            self.names[m.group(1)] += 1


class _Builds:
    """Programs built by name (`builds[name]`): compile records, plus kept executables of the layer programs loaded
    from disk; `clear()` starts the count again."""

    def __init__(self, compiled: Counter):
        self.compiled = compiled
        self.clear()

    def clear(self) -> None:
        self.compiled.clear()
        self.loads_before = {name: fn.stats["loaded"] for name, fn in _KEPT.items()}

    def loads(self, name: str) -> int:
        return _KEPT[name].stats["loaded"] - self.loads_before[name] if name in _KEPT else 0

    def __getitem__(self, name: str) -> int:
        return self.compiled[name] + self.loads(name)

    def __repr__(self) -> str:
        return f"compiled {dict(self.compiled)}, kept loads { {name: self.loads(name) for name in _KEPT} }"


@pytest.fixture
def compiles():
    handler = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    before = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield _Builds(handler.names)
    finally:
        jax.config.update("jax_log_compiles", before)
        logger.removeHandler(handler)


def _prompt(model, S, seed):
    rng = np.random.default_rng(seed)
    x = model.embed_tokens(jnp.asarray(rng.integers(0, 300, (B, S))))
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (3, B, S))
    return x, positions


def test_pyramid_budgets_compile_the_forward_once(compiles):
    model = Decoder(TINY_OMNI.replace(num_layers=L))
    S = 83  # a length no other test in the process prefills: every program below is compiled here
    x, positions = _prompt(model, S, 0)
    budgets = pyramid_budgets(40 * L, L, window=WINDOW)
    assert len(set(budgets)) == L  # four layers, four budgets
    selector = SnapKV(window=WINDOW, block_size=16)
    tidekv_prefill(model, x, positions, selector=selector, budgets=budgets, chunk=CHUNK, page=PAGE)
    assert compiles["layer_forward"] == 1, compiles
    assert compiles["layer_compress"] == L, compiles
    assert compiles["layer_step"] == 0 and compiles["run_layer"] == 0, compiles

    # Other budgets at the same prompt shape: no forward compiles at all, one compression program per new budget.
    compiles.clear()
    again = pyramid_budgets(48 * L, L, window=WINDOW)
    tidekv_prefill(model, x, positions, selector=selector, budgets=again, chunk=CHUNK, page=PAGE)
    assert compiles["layer_forward"] == 0, compiles
    assert compiles["layer_compress"] == len(set(again) - set(budgets)), compiles


def test_split_step_equals_the_fused_step():
    """`run_layer` (two programs) and `layer_step` (the same as one program) give the same bridge and cache."""
    from omnijax.prefill import layer_major as lm

    model = Decoder(TINY_OMNI.replace(num_layers=1))
    S = 71
    x, positions = _prompt(model, S, 1)
    Spad = lm.padded_length(S, CHUNK, PAGE)
    bridge = jnp.pad(x, ((0, 0), (0, Spad - S), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, 0), (0, Spad - S)), mode="edge")
    kw = dict(config=model.config, prompt_len=S, chunk=CHUNK, page=PAGE, impl="xla",
              selector=SnapKV(window=WINDOW, block_size=16), budget=30, window=WINDOW, room=2)
    params = lm.layer_params(model, 0)
    split_bridge, split_cache = lm.run_layer(params, jnp.array(bridge), positions, **kw)
    fused_bridge, fused_cache = lm.layer_step(params, jnp.array(bridge), positions, **kw)
    np.testing.assert_allclose(np.asarray(split_bridge), np.asarray(fused_bridge), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(split_cache.index), np.asarray(fused_cache.index))
    np.testing.assert_array_equal(np.asarray(split_cache.offset), np.asarray(fused_cache.offset))
    np.testing.assert_allclose(np.asarray(split_cache.k), np.asarray(fused_cache.k), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(split_cache.v), np.asarray(fused_cache.v), atol=1e-6, rtol=0)
