"""The OmniMMI harness: the six shipped files parse with the counts their README states, queries are timed as the
online protocol says (span midpoints, 5 frames before the end, polls), PA / PT / judged scores are hand-computed,
and sessions run end to end on a tiny model and through the command line on the demo model."""

import json

import numpy as np
import pytest

from omnijax.eval import media as media_lib
from omnijax.eval import omnimmi as om
from omnijax.eval import probes as probes_lib
from omnijax.eval import streamingbench as sb
from tests.eval.test_streamingbench import _certain_model


@pytest.fixture(scope="module")
def records():
    return om.load_all()


def test_every_file_parses(records):
    recs, notes = records
    root = om.packaged_root()
    assert (root / "LICENSE").is_file() and (root / "README.md").is_file()
    by = {t: [r for r in recs if r.task == t] for t in om.FILES}
    assert {t: len(v) for t, v in by.items()} == {"SG": 300, "MD": 300, "AP": 200, "SI": 200, "PA": 200, "PT": 200}
    assert sum(len(r.turns) for r in by["SG"]) == 704 and sum(len(r.turns) for r in by["MD"]) == 786
    assert sum(om.ANSWER_MARK in t.raw_question for r in by["MD"] for t in r.turns) == 475
    # Later turns carry the gold previous answer; the one first-turn mark is kept as annotated (and noted).
    assert sum(om.ANSWER_MARK in t.question for r in by["MD"] for t in r.turns) == 1 and len(notes) == 2
    md = next(r for r in by["MD"] if len(r.turns) > 1 and om.ANSWER_MARK in r.turns[1].raw_question)
    assert md.turns[0].answer in md.turns[1].question
    assert all(r.window and r.window[0] <= r.window[1] for r in by["PA"])
    assert all(r.turns[0].answer in r.vocab for r in by["AP"])
    assert all(len(r.history) == 1 and r.turns[0].answer == "" for r in by["PT"])
    assert len({r.video for r in recs}) == 1121
    assert om.parse_span("56.0 -- 74.0") == (56.0, 74.0)
    with pytest.raises(om.ann.AnnotationError):
        om.parse_span("56.0-74.0x")


def test_query_times(records):
    recs, _ = records
    sg = next(r for r in recs if r.task == "SG")
    assert [p.time_s for p in om.record_probes(sg, 600.0)] == [(s + e) / 2 for s, e in (t.span for t in sg.turns)]
    ap = next(r for r in recs if r.task == "AP")
    assert [p.time_s for p in om.record_probes(ap, 30.0)] == [27.5]  # 5 frames at 2 fps before the end
    assert "Choose one of: " in om.record_probes(ap, 30.0)[0].text
    si = next(r for r in recs if r.task == "SI")
    assert om.record_probes(si, 600.0)[0].time_s == si.turns[0].time_s
    pa = next(r for r in recs if r.task == "PA")
    assert om.nominal_seconds(pa, 30.0) == 150.0
    polls = om.record_probes(pa, 150.0)
    assert [p.time_s for p in polls] == [2.0 * k for k in range(75)] and polls[0].text.endswith(om.POLL)
    assert all(p.answer_tokens == 1 for p in polls)
    pt = next(r for r in recs if r.task == "PT")
    (probe,) = om.record_probes(pt, 20.0)
    assert probe.time_s == 17.5 and probe.history == pt.history


def test_sessions_for_a_sample_of_each_task(records):
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    recs, _ = records
    builder = probes_lib.PromptBuilder(Decoder(TINY_OMNI.replace(vocab_size=256)), media_lib.ByteTextEncoder(256))
    for task in om.FILES:
        for record in [r for r in recs if r.task == task][:3]:
            nominal = om.nominal_seconds(record, 30.0)
            duration = max([nominal] + [t.time_s + 1 for t in record.turns if t.time_s is not None])
            probes = om.record_probes(record, duration)
            session = probes_lib.build_probe_session(record.video, record.video, probes,
                                                     media_lib.SyntheticMedia(1), builder, max_units=4,
                                                     nominal_s=nominal)
            assert session.units <= 4 and len(session.asked) + len(session.left_out) == len(probes)
            assert all(a.unit == min(int(a.probe.time_s // 2), session.units - 1) for a in session.asked)
            assert all("max_units" in why for _, why in session.left_out)


def test_pa_pt_and_judged_scores():
    assert om.pa_metrics([], (1, 5)) == {"hit": 0.0, "precision": 0.0, "iou": 0.0}
    m = om.pa_metrics([4.0, 6.0, 10.0], (3.0, 8.0))  # first inside; 2 of 3 inside; [4, 10] vs [3, 8]: 4 / 7
    assert m["hit"] == 1.0 and m["precision"] == pytest.approx(2 / 3) and m["iou"] == pytest.approx(4 / 7)
    assert om.pa_metrics([2.0], (3.0, 8.0))["hit"] == 0.0
    assert om.is_yes(" Yes.") and om.is_yes("y") and not om.is_yes("No") and not om.is_yes("yy")
    assert om.pt_hit("", False) and om.pt_hit("<2> ok", False) and om.pt_hit("anything", True)
    assert not om.pt_hit("Sure!", False)
    judged = [{"task": "SG", "video": "a", "index": 0, "turn": 0, "pred": "yes"},
              {"task": "SG", "video": "a", "index": 0, "turn": 1, "pred": "no"},
              {"task": "SG", "video": "b", "index": 1, "turn": 0, "pred": "yes"},
              {"task": "SI", "video": "c", "index": 0, "turn": 0, "pred": "no"},
              {"task": "SI", "video": "d", "index": 1, "turn": 0, "pred": "Yes"}]
    s = om.score_judged(judged)[""]
    assert s["SG"] == {"n": 3, "turn_accuracy": pytest.approx(2 / 3), "accuracy": 0.5}
    assert s["SI"] == {"n": 2, "turn_accuracy": 0.5, "accuracy": 0.5}


def test_end_to_end_on_a_model_that_always_says_y(records):
    """Head reads only "Y": every poll answers yes (PA responses after units 0, 1, 2, at 2, 4, 6 s), PT replies."""
    recs, _ = records
    sample = [next(r for r in recs if r.task == t) for t in om.FILES]
    sample = [om.Record("PA", r.index, r.video, r.turns, window=(0.0, 3.0)) if r.task == "PA" else r
              for r in sample]
    report = om.run(_certain_model("Y"), sample, [sb.parse_config("full", answer_tokens=2, page_size=16)],
                    encoder=media_lib.ByteTextEncoder(256), answer_tokens=2, max_units=3, progress=False,
                    batch_size=8)
    pa = report["scores"]["full"]["PA"]  # first 2 s in [0, 3]; 1 of 3 inside; [2, 6] vs [0, 3]: 1 / 6
    assert pa["n"] == 1 and pa["hit_generated"] == 1.0 and pa["hit_loglik"] == 1.0
    assert pa["precision_generated"] == pytest.approx(1 / 3) and pa["iou_loglik"] == pytest.approx(1 / 6)
    assert report["scores"]["full"]["PT"] == {"n": 1, "hit": 0.0}
    tasks = {p["task"] for p in report["predictions"]}
    assert tasks <= set(om.JUDGED) and "AP" in tasks and all(p["prediction"] == "YY" for p in report["predictions"])
    assert any("judge" in n for n in report["notices"]) and report["summary"]["full"]["sessions"] == len(
        {r["session"] for r in report["records"]})
    assert not np.isnan(report["summary"]["full"]["kv"]["mean_retained_at_question"])


def test_cli(tmp_path, capsys):
    assert om.main(["--demo", "--data", str(tmp_path)]) == 1
    assert "cannot read" in capsys.readouterr().err
    out, judge = tmp_path / "r.json", tmp_path / "j.json"
    assert om.main(["--demo-model", "--tasks", "AP", "PT", "--max-sessions", "1", "--max-units", "2", "--configs",
                    "full", "--out", str(out), "--judge-out", str(judge)]) == 0
    assert "PT" in capsys.readouterr().out
    predictions = json.loads(judge.read_text())
    assert [p["task"] for p in predictions] == ["AP"] and predictions[0]["answer"]
    assert json.loads(out.read_text())["scores"]["full"]["PT"]["n"] == 1
