"""The engine's recall reads and writes a session's own row in place (issue 40): no program a question runs copies
the shared pool. Two checks:

- HLO: each program the engine runs around a question (the question's forward, the re-laying shift, the write of
  the recalled units, the release and the deferred trim), compiled for a row of a pool whose page count is prime,
  creates or copies no whole K/V stack and reuses its donated buffers. Control: the batch-1 `Session`'s own
  question forward (its cache not donated) does copy the stack, so the check can fail.
- Run time: across ticks that capture evictions and a question that recalls, re-lays and releases, the pool's
  key and value buffers stay the very buffers they were (every program donated and updated in place).
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import text_chunk
from omnijax.kv import host_tier
from omnijax.models.config import TINY_OMNI
from omnijax.retention import OmniPick
from omnijax.retention import recall as recall_lib
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.recall_rows import row_view
from omnijax.streaming import recall_ops
from omnijax.streaming.session import graphdef_config, model_parts
from tests._support import recall_setup
from tests.serve.engine.test_engine_recall import PAGE, POLICIES, T, _config
from tests.streaming.test_stream_in_place import _instructions, _size

N_PAGES = 37  # the HLO check's pool: a prime page count, so no other array has the K/V stack's size


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _copies(hlo: str) -> list:
    c = TINY_OMNI
    stack = c.num_layers * N_PAGES * PAGE * c.num_kv_heads * c.head_dim
    return [(shape, op) for shape, op in _instructions(hlo) if _size(shape) == stack and op in ("copy", "broadcast")]


def _stack_in(hlo: str) -> bool:
    c = TINY_OMNI
    return f"f32[{c.num_layers},{N_PAGES},{PAGE},{c.num_kv_heads},{c.head_dim}]" in hlo


def test_the_recall_programs_update_the_pool_in_place(model):
    c = TINY_OMNI
    graphdef, params = model_parts(model)
    rope = (c.rope_base, c.mrope_section)
    state = omnijax.init_state(graphdef_config(model), num_pages=N_PAGES, page_size=PAGE, batch=3, max_pages=12)
    view = row_view(state, 1)  # the engine's batch-1 view of row 1: the pool shared
    kv = view.kv
    question = jax.tree.map(jnp.asarray, text_chunk(list(range(5)), length=T, answer_tokens=2))
    paging = omnijax.StreamConfig().paging
    programs = {
        "question": recall_ops.question_queries_in_place.lower(graphdef, params, kv, view.next_pos, question,
                                                               impl="xla"),
        "shift": recall_ops.shift_row.lower(kv, jnp.zeros((N_PAGES, PAGE), jnp.int32),
                                            rope=(c.rope_base, c.mrope_section, c.mrope_interleaved)),
        "write": recall_lib._write_in_place.lower(
            kv, np.zeros((c.num_layers, c.num_kv_heads, 16, c.head_dim), np.float32),
            np.zeros((c.num_layers, c.num_kv_heads, 16, c.head_dim), np.float32), np.zeros((3, 16), np.int32),
            np.zeros((3, 16), np.int32), np.zeros(16, np.int32), np.zeros(16, np.int8), np.zeros(16, np.int32),
            np.ones(16, bool), jnp.int32(0), rope=(c.rope_base, c.mrope_section, c.mrope_interleaved), turn=True),
        "release": recall_ops.release_range.lower(kv, view.next_pos, jnp.int32(0), jnp.int32(4), reindex=True,
                                                  rope=rope, paging=paging, subblock=8),
        "trim": recall_ops.trim_now_in_place.lower(kv, view.next_pos, policy=OmniPick(high_watermark=40,
                                                                                      low_watermark=30),
                                                   rope=rope, paging=paging, subblock=8),
    }
    for name, lowered in programs.items():
        hlo = lowered.compile().as_text()
        assert _stack_in(hlo), f"{name}: the K/V stack shape is not in the program: the check is void"
        assert not _copies(hlo), f"{name}: whole K/V stacks copied or created: {_copies(hlo)}"
        assert "input_output_alias" in hlo, f"{name}: the donated pool's buffers are not reused"
    # control: the batch-1 Session's question forward keeps its cache, so it copies the stack to write into
    kept = recall_ops.question_queries.lower(graphdef, params, kv, view.next_pos, question, impl="xla")
    assert _copies(kept.compile().as_text()), "a kept cache's forward shows no copy: the check above proves nothing"


def test_a_question_tick_keeps_the_pools_buffers(model):
    # test_engine_recall's settings under the same StreamingLLM (its programs compile once per suite)
    engine = Engine(model, EngineConfig(stream=_config(POLICIES["streamingllm"]), chunk_tokens=T, buckets=(1, 2, 4)))
    engine.open("a")
    engine.open("b")
    engine.submit("a", text_chunk([5, 6, 7], length=T, unit=0), 0)
    engine.tick()  # the bucket settles
    pointers = (engine.state.kv.k.unsafe_buffer_pointer(), engine.state.kv.v.unsafe_buffer_pointer())
    rng = np.random.default_rng(0)
    for i in range(6):  # StreamingLLM evicts: captured from the slots in place
        engine.submit("a", text_chunk(rng.integers(3, 290, 8), length=T, unit=2 + 2 * i), 0)
        engine.submit("b", text_chunk(rng.integers(3, 290, 8), length=T, unit=2 + 2 * i), 1)  # b answers too
        engine.tick()
    assert engine.recall_stats("a").stored_units > 0 and engine.recall_stats("b").stored_units > 0
    engine.submit("a", text_chunk(rng.integers(3, 290, 5), length=T, unit=100, answer_tokens=3), 3)
    report = engine.tick()
    while report.recalling:
        concurrent.futures.wait(engine.recall.futures(), 60)
        report = engine.tick()
    assert report.outputs["a"].tokens and engine.recall_stats("a").recalled_cells > 0
    assert engine.recall_stats("a").lost_cells == 0 and engine.recall_stats("b").lost_cells == 0
    assert (engine.state.kv.k.unsafe_buffer_pointer(), engine.state.kv.v.unsafe_buffer_pointer()) == pointers


def test_an_in_place_capture_reads_what_answer_tokens_overwrote_from_the_saved_slots(model):
    """A step whose answer refills the holes its trim left: read in place alone, the overwritten tokens are lost
    (reported); with the row's live slots saved before the step, the capture equals one from a copy of the cache."""
    session = omnijax.Session(model, _config(POLICIES["streamingllm"], recall=None))
    rng = np.random.default_rng(1)
    for i in range(2):
        session.feed(text_chunk(rng.integers(3, 290, 8), length=T, unit=2 * i))
    chunk = text_chunk(rng.integers(3, 290, 8), length=T, unit=10, answer_tokens=3)
    copy = jax.tree.map(jnp.copy, session.state.kv)
    meta = host_tier.metadata_copy(session.state.kv)
    saved = host_tier.save_slots(session.state.kv, 0)
    session.feed(chunk)
    after = session.state.kv
    want = host_tier.capture_evicted(copy, after)
    alone = host_tier.capture_evicted(meta, after, in_place=True)
    got = host_tier.capture_evicted(meta, after, in_place=True, saved=saved)
    assert want.units and not want.lost
    assert alone.lost, "the answer refilled no hole: the saved slots are not exercised"
    assert got.lost == want.lost and len(got.units) == len(want.units)
    for u, w in zip(got.units, want.units):
        assert u.unit == w.unit
        for name in ("k", "v", "pos", "span", "offset", "order"):
            np.testing.assert_array_equal(getattr(u, name), getattr(w, name))
