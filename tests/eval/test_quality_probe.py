"""Metronome's quality probe (`omnijax.eval.quality_probe`): the lenient keyword scorer against a plain
reading, the free-running decode mode, an end-to-end run whose answers are known, and the command line."""

import json
import random

import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.decoding import Greedy
from omnijax.eval import quality_probe as qp


def _answering_plain(texts, questions, session, config):
    """The scorer read plainly: per frame, the frames of its segment up to it, the last `window_frames` of them."""
    per, out = config.frames_per_segment, []
    for k in range(len(texts)):
        segment_start = (k // per) * per
        frames = [j for j in range(segment_start, k + 1)][-config.window_frames:]
        question = questions[((k // per) + session) % len(questions)]
        text = "".join(texts[j] for j in frames).lower()
        out.append(any(w.lower() in text for w in question.keywords))
    return out


def test_scorer_equals_its_plain_reading():
    rng = random.Random(0)
    questions = [qp.Question(f"q{i}", (w,)) for i, w in enumerate(["ab", "Cd", "e"])]
    for _ in range(300):
        config = qp.ProbeConfig(sessions=1, seconds=12, segment_s=rng.choice([1, 2, 3]), frame_ms=500,
                                window_frames=rng.randint(1, 4))
        texts = ["".join(rng.choice("abcdeAB ") for _ in range(rng.randint(0, 3))) for _ in range(config.frames)]
        session = rng.randint(0, 5)
        assert qp.answering(texts, questions, session, config) == _answering_plain(texts, questions, session, config)
    assert qp.by_age([[True, False, True, True], [False, False, True, False]],
                     qp.ProbeConfig(seconds=2, segment_s=1, frame_ms=500)) == [0.25, 0.75]
    assert len(qp.table2_conditions()) == 13 and qp.table2_conditions()[0] == "unbounded"
    with pytest.raises(ValueError, match="segment"):
        qp.ProbeConfig(seconds=10, segment_s=20)


@pytest.fixture(scope="module")
def model():
    """The demo model (`build_demo_model`), written, converted and loaded once per process and shared with the
    serving tests of the same worker (read only: `_rigged` loads its own copy from `model.source`)."""
    from tests._support.demo_server import demo_model
    return demo_model()


def _rigged(model, token: int):
    """The demo model with its decoder rigged to always say `token`: zero layers (each adds nothing), every
    embedding e0 (twice as long for `token`), so the tied head's largest logit is always `token`'s."""
    rigged = omnijax.load(model.source) if getattr(model, "source", None) else model
    graphdef, params = nnx.split(rigged.decoder)
    pure = nnx.to_pure_dict(params)
    import jax
    pure = jax.tree.map(np.zeros_like, pure)
    embed = np.zeros_like(pure["embed"])
    embed[:, 0], embed[token, 0] = 1.0, 2.0
    pure["embed"], pure["final_norm"] = embed, np.ones_like(pure["final_norm"])
    nnx.replace_by_pure_dict(params, pure)
    rigged.decoder = nnx.merge(graphdef, params)
    return rigged


def test_free_running_decodes_through_end_of_sequence(model):
    eos = model.config.eos_token_ids[0]
    rigged = _rigged(model, eos)
    chunk = omnijax.chunks.chunk.text_chunk([5, 6, 7], answer_tokens=4, position_axes=3)
    common = dict(num_pages=8, page_size=16, max_answer_tokens=4)
    stops = omnijax.stream(rigged.decoder, omnijax.chunks.chunk.stack_chunks([chunk]), omnijax.StreamConfig(**common))
    runs = omnijax.stream(rigged.decoder, omnijax.chunks.chunk.stack_chunks([chunk]),
                          omnijax.StreamConfig(**common, decoding=Greedy(free_running=True)))
    assert np.asarray(stops.tokens)[0, 0].tolist() == [eos, -1, -1, -1]
    assert np.asarray(runs.tokens)[0, 0].tolist() == [eos] * 4
    with pytest.raises(ValueError, match="free_running"):
        Greedy(free_running=1)


def test_known_answers_give_the_expected_curve_and_recall(model):
    token = model.tokenizer.encode("x")
    assert len(token) == 1
    rigged = _rigged(model, token[0])
    questions = [qp.Question("Zero?", ("x",)), qp.Question("One?", ("q",)), qp.Question("Two?", ("z",))]
    config = qp.ProbeConfig(sessions=2, seconds=6, segment_s=1, frame_ms=500, tau=2, recall_tokens=2)
    row = qp.run_condition(rigged, "sink_window:sink=4,window=64", questions, config, log=lambda _: None)
    # session i hears question (segment + i) % 3; only question 0's keyword is ever said
    expected = [np.mean([(s + i) % 3 == 0 for i in range(2)]) for s in range(6)]
    assert row["answering_by_age"] == expected
    assert row["recall"] == 0.5 and row["preempted"] == 0  # session 0's first question was question 0
    assert set(row["texts"]["q0"]) == {"x"}


def test_command_line_smoke(tmp_path, capsys, monkeypatch):
    from tests._support.demo_server import demo_checkpoint
    built = []  # --demo-model's checkpoint: the one build_demo_model wrote for this process, not a second conversion
    monkeypatch.setattr(qp, "build_demo_model", lambda folder: built.append(folder) or demo_checkpoint())
    out = tmp_path / "probe"
    assert qp.main(["--demo-model", "--sessions", "2", "--seconds", "2", "--segment-s", "1", "--frame-ms", "500",
                    "--tau", "2", "--conditions", "unbounded", "sink_window:sink=0,window=32", "--out",
                    str(out)]) == 0
    data = json.loads((out / "quality_probe.json").read_text())
    assert [r["condition"] for r in data["rows"]] == ["unbounded", "sink_window:sink=0,window=32"]
    assert all(len(r["answering_by_age"]) == 2 for r in data["rows"]) and (out / "quality_probe.png").stat().st_size
    assert "wrote" in capsys.readouterr().out and len(built) == 1
    with pytest.raises(SystemExit):
        qp.main(["--sessions", "2"])  # neither a checkpoint nor --demo-model
