"""The recall benchmarks' own claims (issue 40 items 3-4), on the quality scripts' tiny random Llama.

`bench/quality/recall.py` feeds each context once, with recall on, and asks the question both without recall (a
session started from that state) and with it. Oracles: the row without recall equals a plain session that never had
recall (same cached cells, same answer tokens), and with a recall budget that holds everything SinkWindow evicted,
the row with recall attends as many cells as were fed (the full context's count), the key's among them. (Not
the full context's answer: what was written after an eviction was computed without the evicted tokens.)
`bench/quality/recall_cost.py`'s bytes per token equal the figures MODELS.md states for the two projected models,
and its measured transfer moves exactly the recalled units' bytes.
"""

import numpy as np
import pytest

import omnijax
from bench.quality import _common, _stream, _tiny, recall_cost
from bench.quality import recall as recall_bench
from bench.quality.passkey import with_recall
from omnijax.chunks.chunk import pad_chunk
from omnijax.models.config import PRESETS
from omnijax.retention.recall import Recall
from omnijax.streaming.session import Session

CHUNK, LENGTH, BUDGET = 64, 256, 96


@pytest.fixture(scope="module")
def model():
    checkpoint, _ = _tiny.tiny_model(_common.DEFAULT_WORK)
    return omnijax.load(checkpoint)


def _config(model, prompt, name, budget, recall_cells, units):
    config = _stream.stream_config(_stream.policy_at(name, budget), tokens=prompt.tokens, budget=budget, chunk=CHUNK,
                                   page_size=64)
    if recall_cells:
        config = with_recall(config, recall_cells, units).replace(recall=Recall(budget=recall_cells, top_units=units))
    return config


def _plain(model, prompt, config):
    """A session without recall fed the whole prompt: (cells cached before the question, answer text)."""
    parts = [pad_chunk(p, CHUNK) for p in prompt.parts]
    session = Session(model, config)
    for part in parts[:-1]:
        session.feed(part)
    cached = int(np.asarray(session.state.kv.valid).sum())
    return cached, recall_bench._answer(model, session.feed(parts[-1]))


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_rows_without_recall_equal_a_plain_session_and_full_recall_equals_full_context(model, mode):
    key = _common.pass_keys(1, 3)[0]
    prompt = (_stream.single_prompt(model, LENGTH, 0.2, key, CHUNK) if mode == "single"
              else _stream.multi_turn(model, LENGTH, key, CHUNK))
    config = _config(model, prompt, "sink_window", BUDGET, 512, 64)
    plain, on = recall_bench.run_setting(model, prompt, config, CHUNK, warm=mode == "single", recall=True)
    assert (plain["recall"], on["recall"]) == (False, True)
    cached, answer = _plain(model, prompt, config.replace(recall=None))
    assert plain["cached"] == on["cached"] == cached < plain["fed"]  # the policy evicted, recall changed nothing
    assert plain["answer"] == answer
    assert plain["key_held"] < plain["key_cells"] and plain["key_recalled"] == 0  # the key was evicted
    assert _plain(model, prompt, _config(model, prompt, "no_slide", prompt.tokens, 0, 0))[0] == plain["fed"]
    # everything SinkWindow evicted is recalled at its own positions: the question sees the full context's cells
    assert on["recalled_cells"] == plain["fed"] - cached and on["device_cells"] == plain["fed"]
    assert on["key_held"] + on["key_recalled"] == on["key_cells"]
    assert on["host_bytes"] > 0 and on["dropped_units"] == 0 and on["lost_cells"] == 0


def test_projected_bytes_per_token_are_the_ones_models_md_states():
    args = recall_cost.build_parser().parse_args([])
    got = {name: recall_cost.project(name, PRESETS[name], args, mass_gflops=1.0) for name in recall_cost.PROJECTED}
    # MODELS.md: Qwen2.5-Omni-7B 28 layers, 4 KV heads, head_dim 128; Qwen3-Omni-30B-A3B "KV ≈ 48·4·128·2·2 B"
    assert got["qwen2_5_omni_7b"]["bytes_per_token"] == 28 * 4 * 128 * 2 * 2
    assert got["qwen3_omni_30b_a3b"]["bytes_per_token"] == 48 * 4 * 128 * 2 * 2
    for p in got.values():
        assert p["pcie"]["25.0"]["av_unit_ms"] == pytest.approx(p["bytes_per_token"] * 562 / 25e9 * 1e3)
        assert p["pcie"]["50.0"]["av_unit_ms"] * 2 == pytest.approx(p["pcie"]["25.0"]["av_unit_ms"])


def test_transfer_moves_the_recalled_units_bytes(model):
    from omnijax.streaming.session import graphdef_config

    config = graphdef_config(model)
    args = recall_cost.build_parser().parse_args(["--recalled", "64", "--cached", "32", "--rounds", "1"])
    (row,) = recall_cost.measure_transfer(config, args, np.random.default_rng(0))
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # float32 host records
    assert row["cells"] == 64 and row["bytes"] == 64 * per_token and row["ms"] > 0
