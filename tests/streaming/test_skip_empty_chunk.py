"""A chunk with no token (a continuation: the rest of a long answer) skips the prefill pass through every layer and
the lm_head (`chunk_step(..., skip_empty=True)`, the default), and the step computes exactly what it did with the
pass (`skip_empty=False`, the oracle: the pass runs and writes nothing)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.chunks.spans import SpanKind
from omnijax.decoding import Greedy
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.retention import H2O, OmniPick
from omnijax.streaming.step import chunk_step


@pytest.fixture(scope="module")
def model():
    return Decoder(TINY_OMNI, rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "skip_empty"))
def _step(graphdef, params, state, chunk, *, config, skip_empty):
    return chunk_step(nnx.merge(graphdef, params), state, chunk, config, shared_pages=False, skip_empty=skip_empty)


def _continuation(answer_tokens: int) -> omnijax.Chunk:
    """A batch-1 chunk of one padding slot and no valid token, asking `answer_tokens` more tokens of unit 1."""
    chunk = text_chunk([0], unit=1, span=SpanKind.RESPONSE, position_axes=TINY_OMNI.position_axes,
                       answer_tokens=answer_tokens)
    return dataclasses.replace(chunk, valid=np.zeros_like(chunk.valid), advance=np.zeros_like(chunk.advance))


def _assert_same(a, b, what: str) -> None:
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{what}{jax.tree_util.keystr(path)}")
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("policy, impl", [(OmniPick(high_watermark=40, low_watermark=24), "xla"),
                                          (H2O(heavy=16, recent=8, high_watermark=40), "reference")],
                         ids=["omnipick", "h2o"])
def test_continuation_without_the_pass_computes_the_same(model, policy, impl):
    # A prompt with the first answer tokens, then continuation chunks: with and without the skipped pass, the same
    # tokens, logits and cache (H2O: the attention mass the pass would have added, none, included), chunk by chunk,
    # through OmniPick's and H2O's trims (the prompt and answers pass their watermark / budget).
    config = omnijax.StreamConfig(policy=policy, impl=impl, page_size=8, num_pages=12, max_answer_tokens=6,
                                  decoding=Greedy(free_running=True))
    graphdef, params = nnx.split(model)
    state = omnijax.init_state(TINY_OMNI, num_pages=12, page_size=8)
    chunks = [text_chunk(list(range(3, 33)), unit=0, position_axes=TINY_OMNI.position_axes, answer_tokens=6)]
    chunks += [_continuation(6), _continuation(4), _continuation(6)]
    states, evicted = {True: state, False: state}, 0
    for i, chunk in enumerate(chunks):
        chunk = jax.tree.map(jnp.asarray, chunk)
        outs = {}
        for skip in (True, False):
            states[skip], outs[skip] = _step(graphdef, params, states[skip], chunk, config=config, skip_empty=skip)
        assert int((np.asarray(outs[True].tokens) >= 0).sum()) == int(chunk.answer_tokens[0])  # it decoded
        np.testing.assert_array_equal(np.asarray(outs[True].tokens), np.asarray(outs[False].tokens))
        _assert_same(outs[True], outs[False], f"chunk {i} output")
        _assert_same(states[True], states[False], f"chunk {i} state")
        evicted += int(np.asarray(outs[True].stats.evicted).sum())
    assert evicted > 0  # the policy trimmed along the way


def test_skip_is_a_conditional_around_the_pass(model):
    # What `skip_empty` changes in the program: one more conditional (the pass and the lm_head in a branch), and
    # with a tap the pass always runs (no conditional added).
    config = omnijax.StreamConfig(policy=OmniPick(high_watermark=40, low_watermark=24), page_size=8, num_pages=12,
                                  max_answer_tokens=4)
    graphdef, params = nnx.split(model)
    state = omnijax.init_state(TINY_OMNI, num_pages=12, page_size=8)
    chunk = jax.tree.map(jnp.asarray, _continuation(4))

    def conditionals(skip_empty, tap=None):
        text = jax.jit(lambda p, s, c: chunk_step(nnx.merge(graphdef, p), s, c, config, shared_pages=False, tap=tap,
                                                  skip_empty=skip_empty)).lower(params, state, chunk).as_text()
        return text.count("stablehlo.case") + text.count("stablehlo.if")

    assert conditionals(True) == conditionals(False) + 1
    assert conditionals(True, tap=1) == conditionals(False, tap=1)
