"""Recall on the engine under paging modes other than `native`, and with an int8 pool (issue 40). A relayout moves a
row's survivors into the holes its trim left and gives emptied pages back to the shared pool, where another row's
answer may take them in the same tick; the engine therefore gathers a served recall row's live tokens before the
step (`omnijax.serve.engine.recall_rows`). Oracle, as in `test_engine_recall`: a batch-1 `omnijax.Session` with the
same config fed the same padded chunks (whose recall under these settings is checked against the full context in
`tests/streaming/test_recall_paging.py` and `test_recall_int8.py`): every frame's logits (1e-5), answer tokens and
recall figures are equal, alone and beside a second recall session on a seeded schedule."""

import numpy as np
import pytest

from omnijax.paging import Paging
from omnijax.serve.engine.engine import Engine, EngineConfig
from tests._support import recall_setup
from tests.serve.engine.test_engine_recall import POLICIES, T, _assert_same, _config, _oracle, _run_engine, _script

CASES = {"omnipick-ordered_suffix": ("omnipick", Paging(mode="ordered_suffix"), "float"),
         "streamingllm-eager": ("streamingllm", Paging(mode="eager"), "float"),
         "omnipick-int8": ("omnipick", Paging(), "int8")}


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_engine_session_with_recall_answers_as_a_batch1_session_under_this_paging_or_pool(model, case):
    policy, paging, kv_dtype = CASES[case]
    config = _config(POLICIES[policy]).replace(paging=paging, kv_dtype=kv_dtype)
    script, other = _script(0), _script(50)
    session, want = _oracle(model, config, script)
    stats = session.recall_stats()
    assert stats.questions == 3 and stats.recalled_cells > 0 and stats.lost_cells == 0
    _, want_b = _oracle(model, config, other)
    rng = np.random.default_rng(7)
    schedule = [tuple(s for s in ("a", "b") if rng.random() < 0.7) for _ in range(4 * len(script))]
    engine = Engine(model, EngineConfig(stream=config, chunk_tokens=T, buckets=(1, 2, 4)))
    engine.open("a")
    engine.open("b")
    got = _run_engine(engine, {"a": script, "b": other}, [s for s in schedule if s] + [("a", "b")] * len(script))
    _assert_same(got["a"], want, f"{case} a")
    _assert_same(got["b"], want_b, f"{case} b")
    assert engine.recall_stats("a") == stats
