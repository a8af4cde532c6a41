"""Recall on the engine under paging modes other than `native`, and with an int8 pool (issue 40). A relayout moves a
row's survivors into the holes its trim left and gives emptied pages back to the shared pool, where another row's
answer may take them in the same tick; the engine therefore gathers a served recall row's live tokens before the
step (`omnijax.serve.engine.recall_rows`). Oracle, as in `test_engine_recall`: a batch-1 `omnijax.Session` with the
same config fed the same padded chunks (whose recall under these settings is checked against the full context in
`tests/streaming/test_recall_paging.py` and `test_recall_int8.py`): every frame's logits (1e-5), answer tokens and
recall figures are equal, alone and beside a second recall session on a seeded schedule."""

import numpy as np
import pytest

from omnijax.chunks.chunk import text_chunk
from omnijax.paging import Paging
from omnijax.retention import StreamingLLM
from omnijax.retention.recall import Recall
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session
from tests._support import recall_setup
from tests.serve.engine.test_engine_recall import POLICIES, _beside_another, _config, _oracle, _script

CASES = {"omnipick-ordered_suffix": ("omnipick", Paging(mode="ordered_suffix"), "float"),
         "streamingllm-eager": ("streamingllm", Paging(mode="eager"), "float"),
         "sinkwindow-tile_skip": ("sinkwindow", Paging(mode="tile_skip"), "float"),
         "omnipick-int8": ("omnipick", Paging(), "int8")}


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_engine_session_with_recall_answers_as_a_batch1_session_under_this_paging_or_pool(model, case):
    policy, paging, kv_dtype = CASES[case]
    config = _config(POLICIES[policy]).replace(paging=paging, kv_dtype=kv_dtype)
    script = _script(0)
    session, want = _oracle(model, config, script)
    stats = session.recall_stats()
    assert stats.questions == 3 and stats.recalled_cells > 0 and stats.lost_cells == 0
    _beside_another(model, config, script, want, stats, case)


@pytest.mark.parametrize("per_token", [False, True], ids=["fused", "per_token"])
def test_tokens_a_tick_wrote_and_evicted_under_a_relayout_are_stored_as_a_batch1_session_stores_them(model,
                                                                                                    per_token):
    # StreamingLLM(4, 16) under tile_skip, three 18-token text chunks: the third evicts 2 of its own tokens in its
    # tick and the migration moves survivors into their slots (checked on the batch-1 session: no slot holds them
    # after the step). The engine reads them from its step's record of the chunk (`ChunkOutput.written`), as the
    # session does: the same records, none lost, beside a second session served in the same ticks, fused or
    # host-driven (whose answer tokens, written one program at a time after the trim, could take those slots too).
    config = StreamConfig(policy=StreamingLLM(sink_tokens=4, window=16, high_watermark=24), paging=Paging("tile_skip"),
                          num_pages=24, page_size=8, max_answer_tokens=2, impl="xla",
                          recall=Recall(budget=128, top_units=64))
    rng = np.random.default_rng(3)
    chunks = [text_chunk(rng.integers(3, 290, n), length=18, unit=i) for i, n in enumerate((6, 18, 18))]
    session = Session(model, config)
    for chunk in chunks[:2]:
        session.feed(chunk)
    first = int(np.asarray(session.state.kv.next_order)[0])
    session.feed(chunks[2])
    want = {int(o): (u.k[:, :, i], u.v[:, :, i], u.pos[:, i]) for u in session._recall.tier.units
            for i, o in enumerate(u.order)}
    own = [o for o in want if o >= first]
    assert len(own) == 2 and not set(own) & set(np.asarray(session.state.kv.order).ravel().tolist())
    assert session.recall_stats().lost_cells == 0
    engine = Engine(model, EngineConfig(stream=config.replace(num_pages=48), chunk_tokens=18, buckets=(1, 2),
                                        per_token=per_token))
    for sid in ("a", "b"):
        engine.open(sid)
    for chunk in chunks:
        for sid in ("a", "b"):
            engine.submit(sid, chunk, 0)
        engine.tick()
    for sid in ("a", "b"):
        assert engine.recall_stats(sid).lost_cells == 0, sid
        got = {int(o): (u.k[:, :, i], u.v[:, :, i], u.pos[:, i]) for u in engine.recall.sessions[sid].tier.units
               for i, o in enumerate(u.order)}
        assert sorted(got) == sorted(want), sid
        for o, (k, v, pos) in want.items():
            np.testing.assert_allclose(got[o][0], k, atol=1e-5)
            np.testing.assert_allclose(got[o][1], v, atol=1e-5)
            np.testing.assert_array_equal(got[o][2], pos)
