"""`bench/quality/perplexity.py` across the retention policies (issue 36 item 3), on the quality scripts' tiny random
Llama.

The scorer (`bench/quality/_score.py`) must compute what `chunk_step` computes under every policy, H2O included:
H2O ranks cells by the attention mass the stream accumulates, so a scorer that did not track it would evict by
recency alone and score another cache. Oracle: a `Session` fed the same chunks under the same H2O policy (the step
tracks the mass itself); each chunk's last token scored by the scorer equals the log-likelihood the session's last
logits give it, and the cells the session holds never pass the budget. The resume rule and the budget refusal are
checked in plain Python.
"""

import json

import jax
import numpy as np
import pytest

import omnijax
from bench.quality import _common, _score, _stream, _tiny
from bench.quality import perplexity as ppl_bench
from omnijax.chunks.chunk import text_chunk
from omnijax.streaming.config import StreamConfig
from omnijax.streaming.session import Session


def test_h2o_scored_as_chunk_step_scores_it():
    """Under H2O at 48 cells (mass tracked, reference attention), the scorer's per-chunk last-token NLL equals the
    session's, chunk by chunk, and the session holds at most the budget after every step."""
    checkpoint, _ = _tiny.tiny_model(_common.DEFAULT_WORK)
    model = omnijax.load(checkpoint)
    ids = np.random.default_rng(1).integers(0, _tiny.SPECIALS["<|endoftext|>"], 193)
    window, chunk = 48, 32
    policy = ppl_bench.policy_for("h2o", window, 4)
    assert policy == _stream.policy_at("h2o", window) and policy.needs_scores
    nll, attended = _score.score_stream(model, ids, policy, chunk=chunk, cells=window, impl="reference")
    assert nll.shape == (192,) and np.all(np.isfinite(nll))
    assert max(attended) <= window + chunk, list(attended)
    session = Session(model, StreamConfig(policy=policy, num_pages=4, page_size=64, impl="reference"))
    for i, a in enumerate(range(0, 192, chunk)):
        out = session.feed(text_chunk(ids[a:a + chunk], unit=i + 1))
        want = -np.asarray(jax.nn.log_softmax(out.logits[0]))[ids[a + chunk]]
        assert abs(nll[a + chunk - 1] - want) < 1e-4, (i, nll[a + chunk - 1], want)
        assert int(np.asarray(out.stats.layout.retained_cells)[0]) <= window


def test_configs_and_resume(tmp_path):
    """`policies` expands to the ten pass-key policies once each, after the names before it; `--resume` keeps the
    named configurations of a file with the same settings and refuses one written with others, naming the field."""
    names = ppl_bench.expand_configs(["full", "h2o", "policies", "sinks"])
    assert names == ["full", "h2o"] + [p for p in _stream.POLICIES if p != "h2o"] + ["sinks"]
    settings = dict(model="m.gguf", text="alice29.txt", length=2048, window=256)
    (tmp_path / "perplexity.json").write_text(json.dumps(dict(settings, configs={"full": {"ppl": 1.0},
                                                                                   "window": {"ppl": 2.0}})))
    assert ppl_bench.resumed(tmp_path, settings, ["full", "omnipick"]) == {"full": {"ppl": 1.0}}
    assert ppl_bench.resumed(tmp_path / "none", settings, ["full"]) == {}
    with pytest.raises(SystemExit, match="window"):
        ppl_bench.resumed(tmp_path, dict(settings, window=128), ["full"])


def test_budget_refusal():
    """A bounded configuration that attended more than window + chunk cells is refused by name; the unbounded ones
    (full, no_slide, InfiniPot-V on text) may attend everything."""
    from types import SimpleNamespace

    args = SimpleNamespace(window=256, chunk=64)
    fine = {"full": {"max_attended": 2048}, "infinipot_v": {"max_attended": 2048}, "h2o": {"max_attended": 320}}
    ppl_bench.check_budget(fine, args)
    with pytest.raises(SystemExit, match="omnipick"):
        ppl_bench.check_budget(dict(fine, omnipick={"max_attended": 321}), args)
