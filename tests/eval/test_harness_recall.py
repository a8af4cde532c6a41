"""The omni harnesses take the recall setting (issue 40): `--recall key=value,...` becomes `StreamConfig(recall=...)`
on every configuration (StreamingBench's and, through `probes.prepare`, OVO-Bench's), the run recalls at its
questions and reports the figures; with a budget nothing fits, its answers equal the same policy's without recall."""

import argparse
import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from omnijax.eval import annotations as ann
from omnijax.eval import ovobench as ovo
from omnijax.eval import probes
from omnijax.eval import streamingbench as sb
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.retention.recall import Recall

POLICY = "sink_window:sink=4,window=48"


def _q(t, answer, index):
    return ann.Question("T1", f"q{index}?", float(t), ("w", "x", "y", "z"), answer, index)


def test_recall_options_become_the_configs_recall_setting():
    parser = argparse.ArgumentParser()
    sb.add_run_options(parser)
    args = parser.parse_args(["--configs", "full", POLICY, "--page-size", "16", "--recall",
                              "budget=64,top_units=3,scoring=two_stage,shortlist=4,keep=true"])
    configs = sb.configs_from_args(args, 2)
    want = Recall(budget=64, top_units=3, scoring="two_stage", shortlist=4, keep=True)
    assert [c.name for c in configs] == ["full recall", f"{POLICY} recall"]
    assert all(c.config.recall == want and c.config.max_answer_tokens == 2 for c in configs)
    assert sb.configs_from_args(parser.parse_args(["--configs", "full"]), 1)[0].config.recall is None
    assert sb.parse_recall("budget=8,disk_dir=/tmp/spill,disk_bytes=4096") == Recall(budget=8, disk_dir="/tmp/spill",
                                                                                  disk_bytes=4096)
    assert probes.sb.configs_from_args is sb.configs_from_args  # OVO-Bench's prepare builds its configs so
    for bad, why in (("budget=64,foo=1", "'foo=1' is not key=value with a key among"),
                     ("top_units=2", "needs budget=CELLS"), ("budget=x", "budget must be a non-negative integer"),
                     ("budget=8,keep=yes", "keep must be true or false"),
                     ("budget=0", "budget must be a positive int")):
        with pytest.raises(ValueError, match=why):
            sb.parse_recall(bad)


def test_streamingbench_run_recalls_at_its_questions_and_reports_it():
    model = Decoder(TINY_OMNI.replace(vocab_size=256), rngs=nnx.Rngs(0))
    videos = [ann.Video("toy.json", "a.mp4", "", [_q(1, "C", 0), _q(7, "B", 1), _q(11, "A", 2)]),
              ann.Video("toy.json", "b.mp4", "", [_q(9, "C", 3)])]
    plain = sb.parse_config(POLICY, page_size=16)
    recall = sb.parse_config(POLICY, page_size=16, recall=Recall(budget=96, top_units=4))
    idle = dataclasses.replace(sb.parse_config(POLICY, page_size=16, recall=Recall(budget=1)), name="idle")
    report = sb.run(model, videos, [plain, recall, idle], progress=False)
    by = {c: [r for r in report.records if r["config"] == c] for c in (plain.name, recall.name, "idle")}
    assert len(by[plain.name]) == 4
    assert "recall" not in report.summary[plain.name] and report.summary[plain.name]["kv"]["evicted"] > 0
    got = report.summary[recall.name]["recall"]
    assert got["questions"] >= 3 and got["recalled_cells"] > 0 and got["max_stored_bytes"] > 0
    assert any(not np.allclose(a["loglik"], b["loglik"], atol=1e-4) for a, b in zip(by[plain.name], by[recall.name]))
    idle_figures = report.summary["idle"]["recall"]
    assert idle_figures["captured_units"] > 0 and idle_figures["recalled_cells"] == 0
    for a, b in zip(by[plain.name], by["idle"]):  # recall on, nothing recalled: the same answers
        np.testing.assert_allclose(a["loglik"], b["loglik"], atol=1e-5)
        assert a["generated"] == b["generated"]
    assert "recall: " in sb.format_summary(report)


def test_the_ovobench_command_line_takes_recall_and_reports_its_figures(tmp_path, capsys):
    # One backward-tracing (EPM) question at 4 s on the demo model: SinkWindow(4, 16) has evicted by then, so with
    # --recall the question recalls within its budget, the figures say so and the config is named "... recall"
    # (without --recall a config has no recall setting: test_recall_options_become_the_configs_recall_setting).
    data, out = tmp_path / "ovo.json", tmp_path / "report.json"
    data.write_text(json.dumps([{"id": 0, "task": "EPM", "video": "ego/a.mp4", "realtime": 3.2, "question": "Who?",
                                 "answer": "x", "options": ["p", "q", "r", "s"], "gt": 0}]))
    policy = "sink_window:sink=4,window=16"
    assert ovo.main(["--data", str(data), "--demo", "--configs", policy, "--page-size", "16", "--answer-tokens", "2",
                     "--recall", "budget=256,top_units=4", "--out", str(out)]) == 0
    report, printed = json.loads(out.read_text()), capsys.readouterr().out
    summary = report["summary"][f"{policy} recall"]
    figures = summary["recall"]
    assert list(report["summary"]) == [f"{policy} recall"] and summary["kv"]["evicted"] > 0
    assert figures["questions"] == 1 and figures["captured_units"] > 0 and figures["dropped_units"] == 0
    assert 0 < figures["recalled_cells"] <= 256 and 0 < figures["recalled_units"] <= 4
    assert "recall: 1 questions" in printed and [r["key"] for r in report["records"]] == ["0"]
