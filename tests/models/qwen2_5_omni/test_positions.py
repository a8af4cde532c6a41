"""TMRoPE segment by segment (omnijax.models.qwen2_5_omni.positions) against transformers' whole-prompt oracle.

Sessions are assembled from the Qwen2.5-Omni chunk builders, flattened with `token_layout` (the stream's cursor
rule), and compared position for position with `get_rope_index` of a tiny thinker; token ids are compared with the
processor's placeholder expansion of the same conversation.
"""

import re
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the reference positions")
pytest.importorskip("transformers", reason="transformers (the test extra) holds the reference positions")

from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor  # noqa: E402

from omnijax.chunks.builders import token_layout  # noqa: E402
from omnijax.models.qwen2_5_omni import layout as q  # noqa: E402
from omnijax.models.qwen2_5_omni import positions as tm  # noqa: E402
from tests._support import hf_models  # noqa: E402

SPGS = [1.0, 2.0, 0.5, 0.7, 1.4, 2 / 3, 4 / 3, 1.5555555555555554, 3.0, 4.0]
_TOKENS = {"<|vision_bos|>": q.VISION_BOS, "<|vision_eos|>": q.VISION_EOS, "<|audio_bos|>": q.AUDIO_BOS,
           "<|audio_eos|>": q.AUDIO_EOS, "<|IMAGE|>": q.IMAGE, "<|VIDEO|>": q.VIDEO, "<|AUDIO|>": q.AUDIO}


@pytest.fixture(scope="module")
def thinker():
    # The chunk builders here lay out the release's ids (`q.RELEASE`), so the oracle reads those too; it only computes
    # positions (`get_rope_index`), never embeds a token, so the ids need not fit its 300-token vocabulary.
    return hf_models.build_thinker(ids=q.RELEASE)


# --- a session: a list of segment specs, built into chunks, an HF call and a processor template ---------------------

def build(spec):
    kind = spec[0]
    if kind == "system":
        return q.system_unit(spec[1], unit=0)
    if kind == "text":
        return q.text_unit(spec[1], unit=1)
    if kind == "response":
        return q.response_unit(spec[1], unit=2)
    if kind == "image":
        return q.image_unit(spec[1], unit=3)
    if kind == "audio":
        return q.audio_unit(spec[1], unit=4)
    if kind == "video":
        return q.video_unit(spec[1], spec[2], unit=5)
    if kind == "av":
        return q.audiovisual_unit(spec[1], spec[2], spec[3], unit=6)
    raise AssertionError(kind)


def hf_inputs(session):
    images, videos, spgs, audios, text = [], [], [], [], ""
    for spec in session:
        kind = spec[0]
        if kind in ("system", "text", "response"):
            text += "".join(f"<t{t}>" for t in spec[1])
        elif kind == "image":
            images.append(spec[1])
            text += "<|vision_bos|><|IMAGE|><|vision_eos|>"
        elif kind == "audio":
            audios.append(spec[1])
            text += "<|audio_bos|><|AUDIO|><|audio_eos|>"
        elif kind == "video":
            videos.append(spec[1]), spgs.append(spec[2])
            text += "<|vision_bos|><|VIDEO|><|vision_eos|>"
        else:
            videos.append(spec[1]), audios.append(spec[2]), spgs.append(spec[3])
            text += "<|vision_bos|><|VIDEO|><|vision_eos|>"
    return dict(images=images, videos=videos, spgs=spgs, audios=audios, text=text,
                use_audio_in_video=any(s[0] == "av" for s in session))


def hf_positions(thinker, ids, inputs):
    ids = torch.tensor(np.asarray(ids, np.int64))[None]
    grid = lambda g: torch.tensor(np.asarray(g, np.int64)).reshape(-1, 3) if g else None  # noqa: E731
    pos, _ = thinker.get_rope_index(
        ids, image_grid_thw=grid(inputs["images"]), video_grid_thw=grid(inputs["videos"]),
        attention_mask=torch.ones_like(ids), use_audio_in_video=inputs["use_audio_in_video"],
        # mel frames giving exactly n tokens: ((4n - 1) // 2 + 1 - 2) // 2 + 1 = n
        audio_seqlens=torch.tensor([4 * n for n in inputs["audios"]]) if inputs["audios"] else None,
        second_per_grids=torch.tensor(inputs["spgs"]) if inputs["spgs"] else None)
    return pos[:, 0].numpy()


def processor_ids(inputs):
    """Token ids of the processor's placeholder expansion (`replace_multimodal_special_tokens`)."""
    fake = SimpleNamespace(audio_token="<|AUDIO|>", image_token="<|IMAGE|>", video_token="<|VIDEO|>",
                           vision_bos_token="<|vision_bos|>", vision_eos_token="<|vision_eos|>",
                           audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>",
                           image_processor=SimpleNamespace(merge_size=2), video_processor=SimpleNamespace(merge_size=2))
    fake.get_chunked_index = lambda values, n: Qwen2_5OmniProcessor.get_chunked_index(fake, values, n)
    (text,) = Qwen2_5OmniProcessor.replace_multimodal_special_tokens(
        fake, [inputs["text"]], iter(inputs["audios"]), iter([np.asarray(g) for g in inputs["images"]]),
        iter([np.asarray(g) for g in inputs["videos"]]), video_second_per_grid=iter(inputs["spgs"]),
        use_audio_in_video=inputs["use_audio_in_video"], position_id_per_seconds=25, seconds_per_chunk=2.0)
    return [_TOKENS[t] if t in _TOKENS else int(t[2:-1]) for t in re.findall(r"<\|\w+\|>|<t\d+>", text)]


def check_session(thinker, session):
    ids, pos = token_layout([build(s) for s in session])
    inputs = hf_inputs(session)
    assert ids.tolist() == processor_ids(inputs)
    np.testing.assert_array_equal(pos, hf_positions(thinker, ids, inputs))
    return ids, pos


def random_session(seed, audio_in_video):
    rng = np.random.default_rng(seed)
    text = lambda lo=0: rng.integers(0, 300, rng.integers(lo, 6)).tolist()  # noqa: E731
    session = [("system", [q.IM_START] + text(1) + [q.IM_END])]
    video = "av" if audio_in_video else "video"
    kinds = ["image", "audio", video, video] + rng.choice(["image", "audio", video, "response"], 4).tolist()
    for kind in rng.permutation(kinds):
        t = text()
        if t:
            session.append(("text", t))
        if kind == "image":
            session.append(("image", (int(rng.choice([1, 1, 2])), 2 * int(rng.integers(1, 6)),
                                      2 * int(rng.integers(1, 6)))))
        elif kind == "audio":
            session.append(("audio", int(rng.integers(1, 121))))
        elif kind == "video":
            session.append(("video", (int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)),
                                      2 * int(rng.integers(1, 5))), float(rng.choice(SPGS))))
        elif kind == "av":
            while True:  # a unit whose eos markers hold its maximum (see test_audio_in_video_eos_below_max)
                grid = (int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)))
                spec = ("av", grid, int(rng.choice([50, 50, int(rng.integers(1, 61))])), float(rng.choice(SPGS)))
                seg = tm.audio_in_video_positions(*spec[1:])
                if seg.advance == seg.positions.max() + 1:
                    break
            session.append(spec)
        else:
            session.append(("response", text(1) + [q.IM_END]))
    session.append(("text", [q.IM_START] + text(1)))
    return session


# --- whole sessions ----------------------------------------------------------------------------------------------

def test_documented_session(thinker):
    """System text, an image, user text, audio, three 2 s audiovisual units, more text, a response."""
    session = [
        ("system", [q.IM_START, 10, 11, 12, q.IM_END, 13]),
        ("text", [q.IM_START, 20, 21]),
        ("image", (1, 6, 8)),
        ("text", [22, 23]),
        ("audio", 37),
        ("av", (2, 4, 6), 50, 1.0),   # 2 s at 2 fps: bos bos V(t=0) V(t=25) A×50 eos eos
        ("av", (1, 4, 6), 50, 2.0),   # 2 s at 1 fps
        ("av", (1, 4, 6), 24, 1.0),   # a 1 s tail (one temporal patch)
        ("text", [q.IM_END, 24, q.IM_START, 25, 26]),
        ("response", [30, 31, 32, q.IM_END]),
    ]
    ids, pos = check_session(thinker, session)
    av = ids.tolist().index(q.AUDIO_BOS, ids.tolist().index(q.VISION_BOS, 10))
    assert pos[:, av - 1].tolist() == pos[:, av].tolist()  # both bos markers share one position


@pytest.mark.parametrize("seed", range(6))
def test_random_sessions_with_video(thinker, seed):
    check_session(thinker, random_session(seed, audio_in_video=False))


@pytest.mark.parametrize("seed", range(6))
def test_random_sessions_with_audio_in_video(thinker, seed):
    check_session(thinker, random_session(100 + seed, audio_in_video=True))


@pytest.mark.parametrize("grid, n_audio, spg", [
    ((3, 2, 2), 250, 4.0),     # temporal steps of 100 > 50 per chunk: one chunk boundary per token
    ((4, 4, 2), 200, 2.0),     # exactly one temporal patch per chunk
    ((5, 2, 4), 30, 0.7),      # audio shorter than the video: video chunks trail
    ((2, 2, 2), 140, 1.0),     # audio longer than the video: audio chunks trail
])
def test_long_audio_in_video_segments(thinker, grid, n_audio, spg):
    check_session(thinker, [("text", [1, 2]), ("av", grid, n_audio, spg), ("text", [3])])


@pytest.mark.parametrize("spg", SPGS)
def test_videos_of_every_second_per_grid(thinker, spg):
    """Videos of 1-4 temporal patches, with and without their audio, for each second_per_grid."""
    check_session(thinker, [("text", [1])] + [("video", (t, 4, 2), spg) for t in range(1, 5)] + [("text", [2])])
    units = [("av", (t, 2, 4), int((t - 1) * spg * 25) + 2 + 23 * (t % 2), spg) for t in range(1, 5)]
    check_session(thinker, [("text", [1])] + units + [("audio", 7), ("text", [2])])


def test_long_videos_where_float32_truncation_matters(thinker):
    """Temporal ids that float32 rounding pushes below an integer (0.12 x 5 x 25 -> 14, 0.7 x 6 x 25 -> 104)."""
    session = [("text", [1]), ("video", (12, 2, 2), 0.12), ("video", (8, 2, 4), 0.7), ("video", (12, 2, 2), 0.9)]
    check_session(thinker, session + [("text", [2])])
    units = [("av", (12, 2, 2), 40, 0.12), ("av", (8, 2, 2), 130, 0.7)]
    check_session(thinker, [("text", [1])] + units + [("text", [2])])


# --- the pieces ---------------------------------------------------------------------------------------------------

def test_video_temporal_ids_use_float32_truncation():
    for spg in SPGS + [0.12, 0.9, 0.28]:
        want = (torch.arange(12) * torch.tensor(spg).float() * 25).long().numpy()
        np.testing.assert_array_equal(tm.video_temporal_ids(12, spg), want)
    assert tm.video_temporal_ids(7, 0.7)[6] == 104  # not the exact 105
    for spg in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="second_per_grid must be a positive number of seconds"):
            tm.video_temporal_ids(4, spg)


def test_chunk_ranges_match_transformers(thinker):
    rng = np.random.default_rng(0)
    for _ in range(50):
        values = np.sort(rng.integers(0, 400, rng.integers(0, 40)))
        want = thinker.get_chunked_index(torch.tensor(values), 50, 0)
        assert tm.chunk_ranges(values, 50) == [tuple(int(x) for x in r) for r in want]
        assert tm.chunk_ranges(values, 50) == Qwen2_5OmniProcessor.get_chunked_index(None, values, 50)
    assert tm.chunk_ranges([0, 0, 100, 100, 100], 50) == [(0, 2), (2, 3), (3, 5)]


def test_segment_positions_and_advance():
    seg = tm.image_positions((1, 4, 6))
    assert seg.positions.shape == (3, 2 + 6) and seg.advance == 5  # bos 0, grid from 1 (w up to 3), eos 4
    assert seg.positions[:, 0].tolist() == [0, 0, 0] and seg.positions[:, -1].tolist() == [4, 4, 4]
    assert seg.positions[:, 1:-1].T.tolist() == [[1, 1 + r, 1 + c] for r in range(2) for c in range(3)]
    seg = tm.video_positions((3, 2, 2), 2.0)
    assert seg.positions[0, 1:-1].tolist() == [1, 51, 101] and seg.advance == 103
    assert tm.audio_positions(5).advance == 7 and tm.text_positions(0).positions.shape == (3, 0)
    pos, cursor = tm.place([tm.text_positions(2), tm.image_positions((1, 2, 2)), tm.text_positions(1)], start=10)
    assert pos[0].tolist() == [10, 11, 12, 13, 14, 15] and cursor == 16
    assert tm.audio_token_count(200) == 50 and tm.vision_token_count((2, 4, 6)) == 12
    with pytest.raises(ValueError, match="multiples of the merge size"):
        tm.image_positions((1, 3, 4))
    with pytest.raises(ValueError, match="num_audio_tokens"):
        tm.audio_positions(0)


def test_audio_in_video_eos_below_max(thinker):
    """The eos markers sit after the LAST chunk, not after the segment's maximum (frames wider than the audio)."""
    grid, n_audio = (1, 2, 40), 10  # 20 merged columns, 10 audio tokens: V0 (w up to base + 19) then A0 (to base + 9)
    seg = tm.audio_in_video_positions(grid, n_audio, 2.0)
    assert seg.positions[:, -1].tolist() == [11, 11, 11] and seg.positions.max() == 20 and seg.advance == 12
    unit = q.audiovisual_unit(grid, n_audio, 2.0, unit=0)
    assert int(unit.advance[0]) == 12 < int(unit.positions.max()) + 1  # the cursor moves past the eos markers only
    session = [("text", [1]), ("av", grid, n_audio, 2.0), ("text", [2, 3])]
    ids, pos = token_layout([build(session[0]), unit, build(session[2])])
    np.testing.assert_array_equal(pos, hf_positions(thinker, ids, hf_inputs(session)))


def test_audio_in_video_token_order_follows_the_processor(thinker):
    """Processor (float64) and get_rope_index (float32, truncated) can chunk a temporal id differently."""
    grid, n_audio, spg = (10, 2, 2), 400, 1.5555555555555554  # k = 9: 349.99999999999994 vs 350

    def roles(video_values):  # V0 A0 V1 A1 ... as one role per token
        v, a = tm.chunk_ranges(video_values, 50), tm.chunk_ranges(np.arange(n_audio), 50)
        out = []
        for j in range(max(len(v), len(a))):
            for kind, ranges in ((tm.ROLE_VIDEO, v), (tm.ROLE_AUDIO, a)):
                if j < len(ranges):
                    out += [kind] * (ranges[j][1] - ranges[j][0])
        return out

    processor, model = roles(np.arange(10) * spg * 25), roles(tm.video_temporal_ids(10, spg))
    assert processor != model
    assert tm.audio_in_video_positions(grid, n_audio, spg).roles[2:-2].tolist() == processor
    check_session(thinker, [("text", [5]), ("av", grid, n_audio, spg), ("text", [6])])


def test_streamed_units_differ_from_one_long_video():
    """Streaming 2 s units spends two marker positions per unit: 4 s as two units is not one 4 s video."""
    unit = q.audiovisual_unit((2, 2, 2), 50, 1.0, unit=0)
    _, pos_units = token_layout([unit, unit])
    one = tm.audio_in_video_positions((4, 2, 2), 100, 1.0)
    assert pos_units.max() + 1 == 2 * 52 and one.advance == 102
    assert pos_units.shape[1] == one.positions.shape[1] + 4
