"""The OVO-Bench harness: records of every task family parse (bad ones are reported), items are asked after the unit
of `ceil(realtime)`, OVO-Bench's scoring rules and category means give hand-computed scores, and the command line
runs on the demo model."""

import json

import numpy as np
import pytest

from omnijax.chunks.spans import SpanKind
from omnijax.eval import annotations as ann
from omnijax.eval import media as media_lib
from omnijax.eval import ovobench as ovo
from omnijax.eval import probes as probes_lib
from omnijax.eval import streamingbench as sb
from tests.eval.test_streamingbench import _certain_model

RECORDS = [
    {"id": 0, "task": "EPM", "video": "ego/a.mp4", "realtime": 3.2, "question": "Who?", "answer": "x",
     "options": ["p", "q", "r", "s"], "gt": 0},
    {"id": 1, "task": "HLD", "video": "ego/a.mp4", "realtime": 1, "question": "What?", "answer": "Unable to answer",
     "options": ["Unable to answer", "b"], "gt": 1},
    {"id": 2, "task": "OCR", "video": "auto/b.mp4", "realtime": 4.0, "question": "Read?", "answer": "t",
     "options": ["t", "u", "v"], "gt": 0},
    {"id": 3, "task": "REC", "video": "pt/c.mp4", "activity": "jump", "start_times": [0], "end_times": [1],
     "test_info": [{"realtime": 2, "count": 1}, {"realtime": 0.5, "count": 0}]},
    {"id": 4, "task": "SSR", "video": "coin/d.mp4", "tutorial": "Tyres", "all_steps": ["s1"], "start_time": [1],
     "end_time": [3], "test_info": [{"realtime": 3, "step": "s1", "type": 1}, {"realtime": 1.5, "step": "s1",
                                                                             "type": 0}]},
    {"id": 5, "task": "CRR", "video": "mn/e.mp4", "question": "Why?", "answer": "-", "ask_time": 1, "clue_time": 3,
     "test_info": [{"realtime": 1, "type": 0}, {"realtime": 3, "type": 1}]},
    {"id": 6, "task": "OJR", "video": "auto/b.mp4", "realtime": 2, "question": "Q", "options": ["a", "b"], "gt": 2},
    {"id": 7, "task": "XYZ", "video": "v.mp4"},
]


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "ovo_bench_new.json"
    path.write_text(json.dumps(RECORDS))
    return path


def test_parse_every_family(data):
    items, issues = ovo.load(data)
    assert [i.key for i in items] == ["0", "1", "2", "3/0", "3/1", "4/0", "4/1", "5/0", "5/1"]
    assert len(issues) == 2 and "gt 2 is not an index" in issues[0] and "unknown task 'XYZ'" in issues[1]
    by = {i.key: i for i in items}
    assert by["0"].expected == "A" and by["1"].expected == "B" and by["0"].options == 4
    assert by["0"].text.splitlines()[:2] == ["Who?", "A. p"] and by["0"].text.endswith(
        "Answer with the option's letter from the given choices directly.")
    assert by["0"].time_s == 4.0 and by["3/1"].time_s == 1.0 and by["2"].time_s == 4.0  # ceil(realtime)
    assert by["3/0"].expected == "1" and "jump" in by["3/0"].text
    assert (by["4/0"].expected, by["4/1"].expected) == ("Yes", "No") and "s1" in by["4/0"].text
    assert by["5/1"].text.startswith("Why?\n") and [by[k].category for k in ("0", "2", "5/0")] == [
        "backward", "realtime", "forward"]
    with pytest.raises(ann.AnnotationError, match="cannot read"):
        ovo.load(data.parent / "missing.json")


def test_sessions_ask_at_ceil_realtime(data):
    items, _ = ovo.load(data)
    plans = ovo.plan_sessions(items)
    assert [(p.name, len(p.items)) for p in plans] == [("ego/a.mp4", 2), ("auto/b.mp4", 1), ("REC 3", 2),
                                                       ("SSR 4", 2), ("CRR 5", 2)]
    assert [p.category for p in ovo.select(plans, max_sessions=3)] == ["backward", "realtime", "forward"]
    assert [p.name for p in ovo.select(plans, max_units=1)] == ["ego/a.mp4", "REC 3", "CRR 5"]
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    builder = probes_lib.PromptBuilder(Decoder(TINY_OMNI.replace(vocab_size=256)), media_lib.ByteTextEncoder(256))
    plan = plans[2]  # REC: probes at 2 s (unit 1) and ceil(0.5) = 1 s (unit 0), asked in time order
    asked = [probes_lib.Probe(i.key, i.task, i.time_s, i.text, n) for n, i in enumerate(plan.items)]
    session = probes_lib.build_probe_session(plan.name, plan.video, asked, media_lib.SyntheticMedia(0), builder,
                                             answer_tokens=2)
    assert session.units == 2 and [(a.probe.key, a.unit) for a in session.asked] == [("3/1", 0), ("3/0", 1)]
    av = [i for i, c in enumerate(session.chunks) if (np.asarray(c.span) == SpanKind.VIDEO).any()]
    assert all(len([i for i in av if i < a.chunk]) == a.unit + 1 for a in session.asked)
    assert all(int(np.asarray(session.chunks[a.chunk].answer_tokens)[0]) == 2 for a in session.asked)
    # A multiple-choice probe builds the chunk StreamingBench's ChunkBuilder.question builds.
    q = ann.Question("EPM", "Who?", 4.0, ("p", "q", "r", "s"), "A", 0)
    mine, theirs = builder.prompt(items[0].text, 3, 1), builder.question(q, 3, 1)
    np.testing.assert_array_equal(mine.token_ids, theirs.token_ids)


def test_scoring_rules():
    mc = ovo.Item(0, -1, "EPM", "v", 1, "", "C", 4)
    assert ovo.correct_generated(mc, "The answer is C.") and not ovo.correct_generated(mc, "B")
    assert ovo.correct_loglik(mc, [0, 1, 5, 2, 9, 0, 0]) and not ovo.correct_loglik(mc, [9, 1, 5, 2, 0, 0, 0])
    rec = ovo.Item(3, 0, "REC", "v", 1, "", "10")
    assert ovo.correct_generated(rec, "1 0 times") and not ovo.correct_generated(rec, "1 time")
    assert ovo.correct_loglik(rec, [0] * 7) is None
    yes = ovo.Item(4, 0, "SSR", "v", 1, "", "Yes")
    assert ovo.correct_generated(yes, "Yes, it is") and ovo.correct_generated(yes, " Y")
    assert not ovo.correct_generated(yes, "No") and not ovo.correct_generated(yes, "YY")
    assert ovo.correct_loglik(yes, [0, 0, 0, 0, 0, -1, -2]) and not ovo.correct_loglik(yes, [0] * 5 + [-3, -2])
    rows = [("EPM", 1), ("EPM", 0), ("ASI", 1), ("OCR", 0), ("OCR", 0), ("OCR", 1), ("OCR", 1), ("REC", 1),
            ("REC", 0), ("REC", 0), ("SSR", 1)]
    records = [{"config": "c", "task": t, "correct_generated": bool(g),
                "correct_loglik": None if t == "REC" else not g} for t, g in rows]
    s = ovo.aggregate(records)["c"]
    assert s["tasks"]["EPM"] == {"n": 2, "generated": 0.5, "loglik": 0.5} and np.isnan(s["tasks"]["REC"]["loglik"])
    assert s["categories"]["backward"]["generated"] == 0.75 and s["categories"]["realtime"]["generated"] == 0.5
    assert abs(s["categories"]["forward"]["generated"] - 2 / 3) < 1e-9
    assert abs(s["total"]["generated"] - (0.75 + 0.5 + 2 / 3) / 3) < 1e-9
    assert s["categories"]["forward"]["loglik"] == 0.0  # SSR only (REC has no closed set)
    assert abs(s["total"]["loglik"] - (0.25 + 0.5 + 0.0) / 3) < 1e-9


def test_end_to_end_on_a_model_that_always_says_y(data):
    """Head reads only "Y": every letter scores alike (argmax: A), every answer is "Y"."""
    items, _ = ovo.load(data)
    report = ovo.run(_certain_model("Y"), items, [sb.parse_config("full", page_size=16)],
                     encoder=media_lib.ByteTextEncoder(256), answer_tokens=1, progress=False, batch_size=8)
    got = {r["key"]: (r["generated"], r["correct_generated"], r["correct_loglik"]) for r in report["records"]}
    assert got == {"0": ("Y", False, True), "1": ("Y", False, False), "2": ("Y", False, True),
                   "3/0": ("Y", False, None), "3/1": ("Y", False, None), "4/0": ("Y", True, True),
                   "4/1": ("Y", False, False), "5/0": ("Y", False, False), "5/1": ("Y", True, True)}
    s = report["scores"]["full"]
    assert s["categories"]["backward"] == {"generated": 0.0, "loglik": 0.5}  # EPM 1, HLD 0
    assert s["categories"]["realtime"] == {"generated": 0.0, "loglik": 1.0}
    assert s["categories"]["forward"]["generated"] == pytest.approx((0 + 0.5 + 0.5) / 3)
    assert s["categories"]["forward"]["loglik"] == 0.5  # SSR 0.5, CRR 0.5
    assert s["total"]["generated"] == pytest.approx(1 / 9)
    assert report["summary"]["full"]["sessions"] == 5 and "[total]" in ovo.format_scores(report)


def test_cli(data, tmp_path, capsys):
    assert ovo.main(["--data", str(tmp_path / "none.json"), "--demo"]) == 1
    assert "cannot read the OVO-Bench annotations" in capsys.readouterr().err
    assert ovo.main(["--data", str(data), "--demo", "--tasks", "NOPE"]) == 1
    assert "unknown tasks ['NOPE']" in capsys.readouterr().err
    out = tmp_path / "ovo.json"
    assert ovo.main(["--data", str(data), "--demo-model", "--max-sessions", "1", "--max-units", "3", "--configs",
                     "full", "--answer-tokens", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["key"] for r in report["records"]} == {"0", "1"} and "[backward]" in capsys.readouterr().out
