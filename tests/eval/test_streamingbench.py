"""The StreamingBench harness: every annotation file parses, timestamps map to the right 2 s unit (0 s, the last
second, past the end), question chunks stream like the whole question, and a model whose weights make one option
certain is scored exactly as constructed."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from omnijax.chunks.builders import token_layout
from omnijax.chunks.spans import SpanKind
from omnijax.eval import annotations as ann
from omnijax.eval import media as media_lib
from omnijax.eval import sessions as sessions_lib
from omnijax.eval import streamingbench as sb

FILES = {  # file -> (videos, usable questions, skipped questions)
    "questions_omni.json": (300, 1496, 4), "questions_omni_stream.json": (300, 1496, 4),
    "questions_proactive_50.json": (50, 51, 0), "questions_real.json": (499, 2499, 1),
    "questions_sqa.json": (50, 249, 1)}


@pytest.fixture(scope="module")
def videos():
    return ann.load_all(ann.packaged_root())


def test_every_annotation_file_parses(videos):
    assert sorted(p.name for p in ann.annotation_files(ann.packaged_root())) == sorted(FILES)
    for name, (count, questions, skipped) in FILES.items():
        vs = [v for v in videos if v.source == name]
        assert (len(vs), sum(len(v.questions) for v in vs), sum(len(v.issues) for v in vs)) == (
            count, questions, skipped), name
    qs = [q for v in videos for q in v.questions]
    assert all(q.multiple_choice for q in qs if q.task_type != "Proactive Output")
    assert not any(q.multiple_choice for q in qs if q.task_type == "Proactive Output")
    assert all(all(o and not o.startswith(f"{ann.LETTERS[i]}.") for i, o in enumerate(q.options)) for q in qs)
    assert all(v.questions == sorted(v.questions, key=lambda q: (q.time_s, q.index)) for v in videos)
    issues = [i for v in videos for i in v.issues]
    assert any("'00:12450'" in i for i in issues) and any("out of sequence" in i for i in issues)
    assert len({q.task_type for q in qs}) == 18


def test_timestamps():
    assert ann.parse_timestamp("00:00:50") == 50 and ann.parse_timestamp("0:10:18") == 618
    assert ann.parse_timestamp("00:24") == 24 and ann.parse_timestamp("00:00:8") == 8
    assert ann.parse_timestamp("5:11:00") == 5 * 3600 + 660
    for bad in ("00:12450", "1:2:3:4", "aa:bb", "00:61", ""):
        with pytest.raises(ann.AnnotationError):
            ann.parse_timestamp(bad)


def test_options_are_repaired_or_refused():
    assert ann.parse_options(["A. x", "B. y"]) == (("x", "y"), ())
    assert ann.parse_options(["A.Lebrun.", "Fan Z.D.", "Xu xin."])[0] == ("Lebrun.", "Fan Z.D.", "Xu xin.")
    assert ann.parse_options(["A. one", "two'.", "", "B. three"]) == (
        ("one, two'.", "three"), ("dropped empty option pieces", "joined an option split by a comma"))
    assert ann.parse_options(["A. a", "B. b", "C. ."])[0] == ("a", "b")
    assert ann.parse_options(["A. A.The a", "B. B. b", "C. A. c"])[0] == ("The a", "b", "A. c")
    with pytest.raises(ann.AnnotationError, match="out of sequence"):
        ann.parse_options(["A. a", "B. b", "B. c", "D. d"])


def _q(t, answer="C", task="T1", index=0):
    return ann.Question(task, f"q{index}?", float(t), ("w", "x", "y", "z"), answer, index)


def test_timeline_units_and_edge_cases():
    assert [ann.unit_of(t) for t in (0, 1, 1.99, 2, 3, 59, 60)] == [0, 0, 0, 1, 1, 29, 30]
    assert ann.num_units(60) == 30 and ann.num_units(61) == 31 and ann.num_units(0.5) == 1
    qs = [_q(0, index=0), _q(59, index=1), _q(60, index=2), _q(61, index=3), _q(300, index=4)]
    placed = ann.place_questions(qs, ann.num_units(60), duration_s=60.0)
    # 0 s: after unit 0; the last second and the very end: after the last unit; past the end: clamped and flagged.
    assert [(p.unit, p.status) for p in placed] == [(0, "ok"), (29, "ok"), (29, "ok"), (29, "past_end"),
                                                    (29, "past_end")]
    assert [p.status for p in ann.place_questions(qs, 30, duration_s=60.0, past_end="skip")][3:] == ["skipped"] * 2
    with pytest.raises(ann.AnnotationError, match="past the end"):
        ann.place_questions(qs, 30, duration_s=60.0, past_end="error")


@dataclasses.dataclass
class _FixedMedia:
    """Synthetic media with a known duration (as a decoded file would have)."""

    duration_s: float
    kind: str = "test"
    notice: str = ""

    def units(self, count):
        return media_lib.SyntheticMedia(0).units(count)


def _builder(vocab=256):
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    model = Decoder(TINY_OMNI.replace(vocab_size=vocab))
    return model, sessions_lib.ChunkBuilder(model, media_lib.ByteTextEncoder(vocab))


def test_session_asks_each_question_after_its_unit():
    _, builder = _builder()
    video = ann.Video("f.json", "v.mp4", "", [_q(0, index=0), _q(5, index=1), _q(7, index=2), _q(9, index=3),
                                              _q(11, index=4)])
    session = sessions_lib.build_session(video, _FixedMedia(8.0), builder, answer_tokens=1)
    assert session.units == 4
    av = [i for i, c in enumerate(session.chunks) if (np.asarray(c.span) == SpanKind.VIDEO).any()]
    assert len(av) == 4
    for a in session.asked:  # the question's last chunk comes after its unit's audiovisual chunk, before the next
        after = [i for i in av if i < a.chunk]
        assert len(after) == a.unit + 1
        assert int(np.asarray(session.chunks[a.chunk].answer_tokens)[0]) == 1
    assert [(a.unit, a.status) for a in session.asked] == [(0, "ok"), (2, "ok"), (3, "ok"), (3, "past_end"),
                                                           (3, "past_end")]
    cut = sessions_lib.build_session(video, _FixedMedia(8.0), builder, max_units=2)
    assert [q.index for q, _ in cut.left_out] == [1, 2, 3, 4] and cut.units == 2  # 5 s is in unit 2
    open_ended = dataclasses.replace(_q(1, index=9), options=(), answer="")
    skipped = sessions_lib.build_session(ann.Video("f", "v", "", [open_ended]), _FixedMedia(4.0), builder)
    assert not skipped.asked and "open-ended" in skipped.left_out[0][1]


def test_long_questions_are_split_like_the_whole():
    _, builder = _builder()
    whole = builder.question(_q(0), unit=5, answer_tokens=3)
    parts = sessions_lib.split_text_chunk(whole, 40)
    assert len(parts) == -(-whole.length // 40) and all(p.length <= 40 for p in parts)
    ids, pos = token_layout(parts)
    ids_w, pos_w = token_layout([whole])
    np.testing.assert_array_equal(ids, ids_w)
    np.testing.assert_array_equal(pos, pos_w)
    np.testing.assert_array_equal(np.concatenate([p.offset[0] for p in parts]), whole.offset[0])
    assert [int(p.answer_tokens[0]) for p in parts] == [0] * (len(parts) - 1) + [3]
    assert all(int(p.unit[0, 0]) == 5 for p in parts)


def test_text_encoders_and_letter_parsing(tmp_path):
    notices = []
    enc = media_lib.text_encoder(tmp_path, 512, notices)
    assert isinstance(enc, media_lib.ByteTextEncoder) and "no tokenizer files" in notices[0]
    assert enc.decode(enc.encode("Answer: B")) == "Answer: B" and enc.letter_id("B") == ord("B")
    assert media_lib.ByteTextEncoder(200).encode("é") == [0xC3 % 200, 0xA9 % 200]
    assert enc.special("<|im_start|>") == 151644 % 512
    assert media_lib.ByteTextEncoder(151936).special("<|im_end|>") == 151645
    first = sessions_lib.first_letter
    assert first("B", 4) == "B" and first("The answer is C.", 4) == "C" and first("(D) yes", 4) == "D"
    assert first("E", 4) == "" and first("Because", 4) == "" and first("", 4) == ""


def test_synthetic_media_fallback_says_why(tmp_path):
    source = media_lib.open_media(tmp_path, "videos/missing.mp4")
    assert source.kind == "synthetic" and "not found" in source.notice
    frames, pcm = next(source.units(1))
    assert frames.shape == (4, 56, 84, 3) and pcm.shape == (32000,)
    assert "no video root" in media_lib.open_media(None, "v.mp4").notice


def _certain_model(letter: str, vocab=256):
    """Zero layers (each adds nothing to the residual), all-ones embeddings and a head that reads only `letter`:
    every position's logits put `hidden_size` on the letter's byte and 0 elsewhere."""
    import jax
    from flax import nnx

    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder

    model = Decoder(TINY_OMNI.replace(vocab_size=vocab))
    graphdef, params = nnx.split(model)
    pure = jax.tree.map(np.zeros_like, nnx.to_pure_dict(params))
    pure["embed"] = np.ones_like(pure["embed"])
    pure["final_norm"] = np.ones_like(pure["final_norm"])
    pure["lm_head"][:, ord(letter)] = 1.0
    nnx.replace_by_pure_dict(params, pure)
    return nnx.merge(graphdef, params)


def test_known_answer_is_scored_by_both_scorers():
    model = _certain_model("C")
    videos = [ann.Video("toy.json", "a.mp4", "", [_q(0, "C", "T1", 0), _q(3, "C", "T1", 1), _q(5, "B", "T2", 2)]),
              ann.Video("toy.json", "b.mp4", "", [_q(1, "C", "T1", 3), _q(4, "A", "T2", 4)])]
    configs = [sb.parse_config("full", page_size=16), dataclasses.replace(sb.parse_config("full", page_size=16),
                                                                          name="full again")]
    report = sb.run(model, videos, configs, batch_size=1, progress=False)  # two program calls per configuration
    assert len(report.records) == 10
    assert {r["pred_loglik"] for r in report.records} == {"C"} == {r["pred_generated"] for r in report.records}
    for name in ("full", "full again"):
        acc = report.summary[name]["accuracy"]
        assert acc["T1"] == {"n": 3, "loglik": 1.0, "generated": 1.0}
        assert acc["T2"] == {"n": 2, "loglik": 0.0, "generated": 0.0}
        assert acc["overall"]["n"] == 5 and abs(acc["overall"]["loglik"] - 3 / 5) < 1e-9
        kv = report.summary[name]["kv"]
        assert kv["max_retained_cells"] > 0 and kv["evicted"] == 0 and kv["exhausted_sessions"] == 0
        assert report.summary[name]["wall_s"] > 0 and report.summary[name]["sessions"] == 2
        assert report.summary[name]["batch_size"] == 1
    record = report.records[0]
    assert record["loglik"][2] > max(record["loglik"][:2] + record["loglik"][3:]) + 10  # C is certain
    assert any("synthetic" in n for n in report.notices) and any("layout-only" in n for n in report.notices)
    text = sb.format_summary(report)
    assert "full again" in text and "T2" in text


def test_parse_config():
    cfg = sb.parse_config("omnipick:high_watermark=600,low_watermark=400+tile_skip", answer_tokens=2)
    assert cfg.policy.high_watermark == 600 and cfg.policy.low_watermark == 400
    assert cfg.paging.mode == "tile_skip" and cfg.max_answer_tokens == 2
    assert sb.parse_config("full").policy.name == "no_slide"
    with pytest.raises(ValueError, match="unknown retention policy"):
        sb.parse_config("nope")


def test_decoded_video_units(tmp_path):
    av = pytest.importorskip("av", reason="PyAV (`av`, the `eval` extra) encodes and decodes the test video")
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        for i in range(45):  # 4.5 s at 10 fps, brightness rising with time
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 5 * i, np.uint8), format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        t = np.arange(int(4.5 * 16000)) / 16000
        tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        for start in range(0, tone.size, 1024):
            frame = av.AudioFrame.from_ndarray(tone[None, start:start + 1024], format="fltp", layout="mono")
            frame.sample_rate = 16000
            for packet in audio.encode(frame):
                container.mux(packet)
        for stream in (video, audio):
            for packet in stream.encode(None):
                container.mux(packet)
    source = media_lib.open_media(tmp_path, "clip.mp4", frame_size=(48, 64))
    assert source.kind == "video file" and abs(source.duration_s - 4.5) < 0.2
    units = list(source.units(ann.num_units(source.duration_s)))
    assert len(units) == 3 and all(f.shape == (4, 48, 64, 3) and p.shape == (32000,) for f, p in units)
    brightness = [float(f.mean()) for frames, _ in units for f in frames]
    assert brightness[:9] == sorted(brightness[:9]) and brightness[-1] == brightness[-2]  # tail repeats last frame
    spectrum = np.abs(np.fft.rfft(units[0][1]))
    assert abs(np.argmax(spectrum) * 16000 / 32000 - 440) < 5


def test_cli_reports_what_is_wrong_without_a_traceback(tmp_path, capsys):
    for argv, message in ((["--demo", "--configs", "lru"], "error: unknown retention policy 'lru'"),
                          (["--demo", "--data", str(tmp_path)], "error: no StreamingBench annotation files"),
                          (["--demo", "--mesh", "4y2"], "error: --mesh must be DATAxMODEL"),
                          (["--checkpoint", str(tmp_path)], "is not an omnijax checkpoint")):
        assert sb.main(argv) == 1
        assert message in capsys.readouterr().err
    # The documented command runs the module as __main__; the package must not have imported it already.
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "omnijax.eval.streamingbench",
                          "--demo", "--configs", "lru"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "error: unknown retention policy 'lru'" in run.stderr, run.stderr
