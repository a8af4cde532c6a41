"""A state handed to `stream` or `Session` is checked before any step runs: one made for another model, or one whose
rows share pages (an engine's forked rows: `Session`'s and `stream`'s steps trim without copy-on-write), is refused
by name, and the state given is left as it was."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.kv import page_sharing
from omnijax.kv import paged as paged_lib
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.streaming.step import init_state

CONFIG = TINY_OMNI.replace(num_layers=1)
PAGE = 4


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG)


def _forked() -> omnijax.StreamState:
    """Two rows, the second forked from the first: their first (full) page shared."""
    state = init_state(CONFIG, num_pages=8, page_size=PAGE, batch=2)
    kv = state.kv
    T = PAGE + 1
    values = jnp.ones((CONFIG.num_layers, 2, T, CONFIG.num_kv_heads, CONFIG.head_dim), kv.k.dtype)
    meta = paged_lib.SlotMeta(pos=jnp.zeros((CONFIG.position_axes, 2, T), jnp.int32), unit=jnp.zeros((2, T), jnp.int32),
                              span=jnp.zeros((2, T), jnp.int32), offset=jnp.zeros((2, T), jnp.int32))
    kv, _ = paged_lib.append(kv, values, values, jnp.asarray([[True] * T, [False] * T]), meta)
    kv = page_sharing.fork_rows(kv, 0, jnp.asarray([1]), share=True)
    assert int(jnp.sum(kv.shares > 0)) == 1
    return dataclasses.replace(state, kv=kv)


def test_a_state_whose_rows_share_pages_is_refused(model):
    state = _forked()
    before = jax.tree.map(np.asarray, state)
    with pytest.raises(ValueError, match=r"rows share 1 page\(s\) \(forked rows of a serving engine\).*export_row"):
        omnijax.Session(model, state=state, page_size=PAGE)
    chunks = stack_chunks([text_chunk(np.ones((2, 3), np.int32))])
    with pytest.raises(ValueError, match=r"rows share 1 page\(s\)"):
        omnijax.stream(model, chunks, state=state, page_size=PAGE)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)  # nothing changed


def test_a_state_made_for_another_model_is_refused_by_what_differs(model):
    other = init_state(CONFIG.replace(num_layers=2), num_pages=8, page_size=PAGE)
    with pytest.raises(ValueError, match=r"not made for this model: layers 2 \(model: 1\); build it with "
                                         r"omnijax.init_state"):
        omnijax.Session(model, state=other, page_size=PAGE)
