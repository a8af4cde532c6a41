"""Recall on the engine under paging modes other than `native`, and with an int8 pool (issue 40). A relayout moves a
row's survivors into the holes its trim left and gives emptied pages back to the shared pool, where another row's
answer may take them in the same tick; the engine therefore gathers a served recall row's live tokens before the
step (`omnijax.serve.engine.recall_rows`). Oracle, as in `test_engine_recall`: a batch-1 `omnijax.Session` with the
same config fed the same padded chunks (whose recall under these settings is checked against the full context in
`tests/streaming/test_recall_paging.py` and `test_recall_int8.py`): every frame's logits (1e-5), answer tokens and
recall figures are equal, alone and beside a second recall session on a seeded schedule."""

import pytest

from omnijax.paging import Paging
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
