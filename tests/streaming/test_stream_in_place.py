"""The streaming step updates the KV cache in place: no whole-cache copy or fresh stack per chunk or decoded token,
no layer sliced out of the stack, and the state ownership that makes it possible (`Session` donates, `stream` keeps
a state it is given)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chunks.chunk import split_text, text_chunk
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.retention import OmniPick
from omnijax.streaming import session as stream_lib  # noqa: E402

N_PAGES, PAGE = 37, 16  # an odd pool size, so the stack's shape names no other array in the program
POLICY = OmniPick(high_watermark=200, low_watermark=100)


@pytest.fixture(scope="module")
def model():
    return Decoder(TINY_OMNI, rngs=nnx.Rngs(0))


def _instructions(hlo: str):
    """`(shape without layout, opcode)` of every instruction in an optimized HLO module's text."""
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+\[[\d,]*\])(?:\{[^}]*\})? ([\w\-]+)\(", line)
        if m:
            yield m.group(1), m.group(2)


def _size(shape: str) -> int:
    dims = shape[shape.index("[") + 1:-1]
    return int(np.prod([int(x) for x in dims.split(",")])) if dims else 1


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_compiled_step_writes_the_cache_in_place(model, impl):
    # The whole step of a Session (prefill through every layer, OmniPick's trim, tile_skip's migration, a greedy
    # answer loop) as XLA compiles it. A layer scan that takes the K/V stacks as scan inputs and outputs builds a
    # fresh stack every call (broadcast + copies) and slices one layer per iteration; a step that does not own its
    # state copies it first. Neither may appear. (impl="pallas" runs interpreted on CPU, which copies its blocks.)
    c = TINY_OMNI
    # A page table shorter than the pool, so the reference's dense gather over it has no layer's shape.
    state = omnijax.init_state(c, num_pages=N_PAGES, page_size=PAGE, max_pages=16)
    session = omnijax.Session(model, state=state, impl=impl, max_answer_tokens=3, policy=POLICY, paging="tile_skip")
    chunk = jax.tree.map(jnp.asarray, text_chunk(list(range(20)), answer_tokens=2))
    hlo = stream_lib._step.lower(session._graphdef, session._params, session.state, chunk,
                                 config=session.stream_config).compile().as_text()
    layer_size = N_PAGES * PAGE * c.num_kv_heads * c.head_dim
    stack = f"f32[{c.num_layers},{N_PAGES},{PAGE},{c.num_kv_heads},{c.head_dim}]"
    ops = list(_instructions(hlo))
    assert any(shape == stack for shape, _ in ops), "the K/V stack shape is not in the program: the check is void"
    # Any view of the stack (its slots reshaped too), by element count (the pool size is prime).
    fresh = [(shape, op) for shape, op in ops if _size(shape) == c.num_layers * layer_size
             and op in ("copy", "broadcast")]
    assert not fresh, f"whole K/V stacks copied or created in the step: {fresh}"
    G, d = c.num_kv_heads, c.head_dim
    slices = {f"f32[{dims}]" for dims in (f"{N_PAGES},{PAGE},{G},{d}", f"1,{N_PAGES},{PAGE},{G},{d}",
                                          f"{N_PAGES * PAGE},{G},{d}", f"1,{N_PAGES * PAGE},{G},{d}")}
    sliced = [(shape, op) for shape, op in ops if shape in slices]
    assert not sliced, f"a layer is sliced out of the K/V stack: {sliced}"
    assert "input_output_alias" in hlo, "the step does not reuse its donated state's buffers"


def test_session_donates_its_state(model):
    session = omnijax.Session(model, num_pages=8, page_size=PAGE)
    before = session.state
    session.feed(text_chunk(list(range(10))))
    assert before.kv.k.is_deleted() and before.kv.v.is_deleted()
    assert not session.state.kv.k.is_deleted()


def test_given_states_are_left_intact(model):
    # A state handed to Session or stream stays usable: both work on their own copy.
    chunks = split_text(np.arange(24) % TINY_OMNI.vocab_size, 2)
    first = omnijax.stream(model, jax.tree.map(lambda x: x[:1], chunks), num_pages=8, page_size=PAGE).state
    k_before = np.asarray(first.kv.k)
    continued = omnijax.stream(model, jax.tree.map(lambda x: x[1:], chunks), state=first)
    session = omnijax.Session(model, state=first)
    out = session.feed(jax.tree.map(lambda x: x[1], chunks))
    assert not first.kv.k.is_deleted()
    np.testing.assert_array_equal(np.asarray(first.kv.k), k_before)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(continued.logits[0]))
    np.testing.assert_array_equal(np.asarray(session.state.kv.k), np.asarray(continued.state.kv.k))
