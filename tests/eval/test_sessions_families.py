"""The evaluation session builder (`omnijax.eval.sessions.ChunkBuilder`) works for every family with encoders: a
StreamingBench question over synthetic media becomes the family's audiovisual units and chat turns (its own unit
length, frame rate and chat markers), and the session streams through `omnijax.Session`, answering the question."""

import numpy as np
import pytest

import omnijax
from omnijax.chunks.spans import SpanKind
from omnijax.convert import convert_checkpoint
from omnijax.eval import annotations as ann
from omnijax.eval import media as media_lib
from omnijax.eval import sessions as sessions_lib
from omnijax.models.minicpmo.layout import TOKEN_TEXT
from tests._support import DATA
from tests._support import qwen3_omni_models as Q


@pytest.fixture(scope="module")
def minicpmo(tmp_path_factory):
    out = tmp_path_factory.mktemp("minicpmo") / "converted"
    model = omnijax.load(convert_checkpoint(DATA / "minicpmo45" / "checkpoint", out, progress=False))
    # The golden checkpoint's vocabulary (2,048) holds none of the release's marker ids: give it markers of its own,
    # as a checkpoint's tokenizer declares them.
    model.special_tokens = {text: 2000 + i for i, text in enumerate(sorted(set(TOKEN_TEXT.values())))}
    return model


@pytest.fixture(scope="module")
def qwen3_omni(tmp_path_factory):
    thinker = Q.build_thinker(seed=3, scale=0.3, audio_overrides={"num_mel_bins": 128})  # the processor's 128 bins
    src = Q.save_thinker(thinker, tmp_path_factory.mktemp("qwen3") / "hf")
    return omnijax.load(convert_checkpoint(src, src.parent / "converted", progress=False))


@pytest.mark.parametrize("family", ["minicpmo", "qwen3_omni"])
def test_a_session_of_every_family_streams_and_answers(family, request):
    model = request.getfixturevalue(family)
    builder = sessions_lib.ChunkBuilder(model, media_lib.ByteTextEncoder(256))
    assert builder.features and builder.units is not None
    expected = {"minicpmo": (1.0, 1.0), "qwen3_omni": (2.0, 2.0)}[family]
    assert (builder.unit_seconds, builder.fps) == expected  # the family's unit, not Qwen2.5-Omni's by default
    video = ann.Video("toy.json", "a.mp4", "", [ann.Question("T1", "q?", 1.5, ("w", "x", "y", "z"), "B", 0)])
    media = media_lib.SyntheticMedia(seed=0, unit_seconds=builder.unit_seconds, fps=builder.fps)
    session = sessions_lib.build_session(video, media, builder, answer_tokens=1)
    start, end = (marker % model.config.vocab_size for marker in builder.units.chat_markers)  # folded as built
    ids = np.concatenate([np.asarray(c.token_ids[0])[np.asarray(c.valid[0], bool)] for c in session.chunks])
    assert ids[0] == start and end in ids.tolist()
    spans = set(np.concatenate([np.asarray(c.span[0])[np.asarray(c.valid[0], bool)] for c in session.chunks]).tolist())
    assert {int(SpanKind.AUDIO), int(SpanKind.SYSTEM), int(SpanKind.TEXT)} <= spans
    assert spans & {int(SpanKind.IMAGE), int(SpanKind.VIDEO)}  # the frames went through the vision encoder
    stream = omnijax.Session(model, num_pages=64, page_size=16, max_answer_tokens=1)
    answers = [stream.feed(builder.units.pad(chunk)) for chunk in session.chunks]
    (asked,) = session.asked
    token = int(np.asarray(answers[asked.chunk].tokens)[0, 0])
    assert 0 <= token < model.config.vocab_size
