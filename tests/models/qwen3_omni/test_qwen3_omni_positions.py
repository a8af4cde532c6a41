"""Qwen3-Omni positions (omnijax.models.qwen3_omni.positions) against transformers' `get_rope_index`.

Prompts are built unit by unit with `StreamPositions` (which also yields the group token ids, audio and video
interleaved as merged), then the whole batch goes through `rope_index` and the reference; all three must agree
exactly in float32.
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the reference positions")
hf = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
                         reason="transformers (the test extra) holds the reference positions")

from omnijax.models.qwen3_omni import positions as qp  # noqa: E402
from omnijax.models.qwen3_omni.config import Qwen3OmniConfig  # noqa: E402

CFG = qp.Qwen3OmniConfig()
_HF = hf.Qwen3OmniMoePreTrainedModelForConditionalGeneration


class _Reference:
    """Just enough of the thinker for the unbound `get_rope_index`."""

    get_rope_index = _HF.get_rope_index
    get_llm_pos_ids_for_vision = _HF.get_llm_pos_ids_for_vision
    get_chunked_index = _HF.get_chunked_index

    def __init__(self, cfg):
        self.config = SimpleNamespace(**{k: v for k, v in cfg.to_json().items() if k != "spatial_merge_size"})
        self.spatial_merge_size = cfg.spatial_merge_size


# --- prompts ---------------------------------------------------------------------------------------------------------

class Prompt:
    """A prompt built from specs: ("text", n), ("audio", mel_frames), ("image", grid), ("video", grid, spg),
    ("aiv", grid, spg, mel_frames)."""

    def __init__(self, specs, seed=0, cfg=CFG):
        rng = np.random.default_rng(seed)
        stream = qp.StreamPositions(cfg)
        self.ids, self.segments, pieces = [], [], []
        self.images, self.videos, self.audios, self.spgs = [], [], [], []
        for spec in specs:
            kind = spec[0]
            if kind == "text":
                seg = qp.TextRun(spec[1])
            elif kind == "audio":
                seg = qp.AudioGroup(qp.audio_token_count(spec[1]))
                self.audios.append(spec[1])
            elif kind == "image":
                seg = qp.ImageGroup(spec[1])
                self.images.append(spec[1])
            elif kind == "video":
                seg = qp.VideoGroup(spec[1], spec[2])
                self.videos.append(spec[1])
                self.spgs.append(spec[2])
            else:
                seg = qp.AudioInVideoGroup(spec[1], spec[2], qp.audio_token_count(spec[3]))
                self.videos.append(spec[1])
                self.spgs.append(spec[2])
                self.audios.append(spec[3])
            out = stream.feed(seg)
            self.segments.append(seg)
            pieces.append(out.positions)
            self.ids += (rng.integers(0, 1000, seg.n).tolist() if out.token_ids is None else out.token_ids.tolist())
        self.positions = np.concatenate(pieces, 1)  # [3, n] from the stream
        self.cursor = stream.cursor


def batch(prompts, left_pad=True):
    """Pads prompts to one length; returns ids [B, T], mask [B, T] and the media of all rows in order."""
    width = max(len(p.ids) for p in prompts)
    ids = np.full((len(prompts), width), 151643, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        sl = slice(width - len(p.ids), width) if left_pad else slice(0, len(p.ids))
        ids[b, sl], mask[b, sl] = p.ids, 1
    media = {key: sum((getattr(p, key) for p in prompts), []) for key in ("images", "videos", "audios", "spgs")}
    return ids, mask, media


def reference(ids, mask, media, use_aiv, grids="auto", cfg=CFG):
    """The reference's (positions, deltas) as numpy; grids "auto" passes a grid array only for media present."""
    imgs = np.array(media["images"]).reshape(-1, 3) if grids != "auto" or media["images"] else None
    vids = np.array(media["videos"]).reshape(-1, 3) if grids != "auto" or media["videos"] else None
    pos, deltas = _Reference(cfg).get_rope_index(
        torch.tensor(ids), None if imgs is None else torch.tensor(imgs), None if vids is None else torch.tensor(vids),
        torch.tensor(mask), use_aiv,
        torch.tensor(media["audios"], dtype=torch.long) if media["audios"] else None,
        torch.tensor(media["spgs"], dtype=torch.float64) if media["spgs"] else None)
    return pos.numpy(), deltas.numpy(), imgs, vids


def check_batch(prompts, use_aiv=False, left_pad=True, grids="auto", cfg=CFG):
    ids, mask, media = batch(prompts, left_pad)
    want, want_deltas, imgs, vids = reference(ids, mask, media, use_aiv, grids, cfg)
    got = qp.rope_index(ids, mask, cfg, image_grid_thw=imgs, video_grid_thw=vids, audio_seqlens=media["audios"],
                        second_per_grids=media["spgs"], use_audio_in_video=use_aiv)
    assert got.dtype == np.float32 and want.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(qp.rope_deltas(got, mask), want_deltas)
    if imgs is not None or vids is not None:  # the multimodal path: each row is its stream
        for b, p in enumerate(prompts):
            np.testing.assert_array_equal(got[:, b, mask[b] == 1], p.positions)
            assert (got[:, b, mask[b] == 0] == 0).all()
    return got, mask


# --- counts ----------------------------------------------------------------------------------------------------------

def test_audio_token_count_matches_reference():
    frames = np.arange(0, 1201)
    want = hf._get_feat_extract_output_lengths(torch.tensor(frames)).numpy()
    assert [qp.audio_token_count(f) for f in frames] == want.tolist()
    with pytest.raises(ValueError, match="mel_frames"):
        qp.audio_token_count(-1)


# --- one shot against the reference ----------------------------------------------------------------------------------

def test_text_only_padded_batch_uses_cumsum():
    got, mask = check_batch([Prompt([("text", 7)]), Prompt([("text", 3)], seed=1)], left_pad=True)
    assert got[0, 1].tolist() == [1, 1, 1, 1, 1, 1, 1][:4] + [0, 1, 2]  # padding 1, tokens 0..n-1
    check_batch([Prompt([("text", 5)]), Prompt([("text", 2)], seed=1)], left_pad=False)


def test_audio_only_takes_the_text_path():
    prompts = [Prompt([("text", 4), ("audio", 137), ("text", 3), ("audio", 250), ("text", 2)]),
               Prompt([("text", 2), ("audio", 60), ("text", 1)], seed=1)]
    got, mask = check_batch(prompts)
    assert (got[:, 1, mask[1] == 0] == 1).all()  # text path: padding 1
    np.testing.assert_array_equal(got[:, 0], prompts[0].positions)  # consecutive ids, as the stream gives
    # An (empty) grid array selects the multimodal path: same ids for the tokens, padding 0.
    got_mm, _ = check_batch(prompts, grids="empty")
    assert (got_mm[:, 1, mask[1] == 0] == 0).all()
    np.testing.assert_array_equal(got_mm[:, mask == 1], got[:, mask == 1])


@pytest.mark.parametrize("grid", [(1, 4, 6), (2, 6, 4), (1, 2, 2)])
def test_one_image(grid):
    check_batch([Prompt([("text", 5), ("image", grid), ("text", 4)])])


@pytest.mark.parametrize("spg", [1.0, 2.0, 0.5, 2 / 3, 0.7, 4 / 3, 1.5555555555555554])
def test_one_video_integer_and_fractional(spg):
    p = Prompt([("text", 3), ("video", (5, 4, 6), spg), ("text", 6)])
    check_batch([p])
    if spg in (0.5, 2 / 3):
        assert (p.positions % 1 != 0).any()  # fractional temporal ids
    q = Prompt([("text", 3), ("video", (4, 4, 6), spg), ("text", 6)])  # ends on a fractional id when spg is 0.5
    check_batch([q])
    if spg == 0.5:
        assert q.positions[0, -1] == 3 + 1 + 19.5 + 1 + 6  # the text after the group inherits the fraction


@pytest.mark.parametrize("spg", [1.0, 2 / 3, 0.5, 2.0])
@pytest.mark.parametrize("video, frames", [
    ((2, 4, 4), 300),   # audio longer than the video: an audio tail, ties at 0 and 13 with spg 1
    ((4, 4, 4), 60),    # audio shorter: a video tail
    ((1, 20, 20), 20),  # three audio tokens after one big frame: the tail ends below the frame's h/w ids
    ((6, 2, 4), 475),
])
def test_audio_in_video(video, frames, spg):
    p = Prompt([("text", 4), ("aiv", video, spg, frames), ("text", 5)])
    check_batch([p], use_aiv=True)
    merged = qp.audio_in_video_positions(video, qp.audio_token_count(frames), spg, start=6.0)
    assert merged.is_video.sum() == qp.vision_token_count(video)
    assert (~merged.is_video).sum() == qp.audio_token_count(frames)
    assert np.all(np.diff(merged.positions[0]) >= 0)  # merged by temporal id
    if video == (1, 20, 20):  # the end markers follow the audio tail, not the group's maximum
        assert merged.last_max < merged.positions.max()
        ends_on_group = Prompt([("text", 4), ("aiv", video, spg, frames)])
        check_batch([ends_on_group], use_aiv=True)  # decoding resumes at max + 1, past the stream's next id
        assert ends_on_group.cursor.next_id < ends_on_group.cursor.max_id


def test_audio_in_video_ties_put_video_first():
    merged = qp.audio_in_video_positions((2, 2, 2), 20, 1.0)  # video t = 0 and 13; audio 0..19
    order = merged.is_video.tolist()
    assert order[:2] == [True, False] and merged.positions[0, 0] == merged.positions[0, 1] == 0
    at13 = np.flatnonzero(merged.positions[0] == 13)
    assert merged.is_video[at13].tolist() == [True, False]


MIXED = [("text", 6), ("image", (1, 4, 4)), ("text", 3), ("audio", 180), ("video", (3, 4, 2), 2 / 3),
         ("text", 2), ("video", (2, 2, 2), 0.5), ("audio", 99), ("image", (2, 2, 4)), ("text", 5)]
MIXED_AIV = [("text", 3), ("aiv", (3, 4, 4), 2 / 3, 230), ("audio", 40), ("image", (1, 6, 4)), ("text", 2),
             ("aiv", (2, 2, 2), 0.5, 70), ("aiv", (1, 8, 8), 1.0, 20), ("text", 4)]


def test_several_groups_with_text_between():
    check_batch([Prompt(MIXED)])
    check_batch([Prompt(MIXED_AIV)], use_aiv=True)


def test_large_ids_round_in_float32():
    """A fractional group thousands of ids in, then text crossing 4096: float32 rounding shows and must match."""
    p = Prompt([("text", 3000), ("video", (3, 2, 2), 2 / 3), ("text", 1200), ("image", (1, 2, 2)), ("text", 7)])
    got, _ = check_batch([p])
    assert (got[0, 0, -1207:] % 1 != 0).all()
    check_batch([Prompt([("text", 3000), ("aiv", (3, 2, 2), 0.7, 130), ("text", 1200), ("aiv", (2, 2, 2), 2 / 3, 90),
                         ("text", 50)])], use_aiv=True)


def test_left_padded_batch_of_two():
    prompts = [Prompt(MIXED), Prompt([("text", 2), ("image", (1, 2, 4)), ("audio", 33), ("text", 3)], seed=1)]
    check_batch(prompts, left_pad=True)
    check_batch(prompts, left_pad=False)
    aiv = [Prompt(MIXED_AIV), Prompt([("aiv", (2, 2, 2), 2.0, 150), ("text", 1)], seed=2)]
    check_batch(aiv, use_aiv=True)


# --- streaming -------------------------------------------------------------------------------------------------------

def _split(n, rng):
    cuts = sorted(set(rng.integers(1, n, size=min(n - 1, 3)).tolist())) if n > 1 else []
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


@pytest.mark.parametrize("specs, use_aiv", [(MIXED, False), (MIXED_AIV, True),
                                            ([("text", 2000), ("video", (3, 2, 2), 2 / 3), ("text", 2200)], False)])
def test_stream_unit_by_unit_matches_one_shot(specs, use_aiv):
    p = Prompt(specs)
    ids, mask, media = batch([p])
    want, deltas, imgs, vids = reference(ids, mask, media, use_aiv)
    rng = np.random.default_rng(3)
    stream, pieces = qp.StreamPositions(CFG), []
    for seg in p.segments:
        parts = [qp.TextRun(k) for k in _split(seg.n, rng)] if isinstance(seg, qp.TextRun) else [seg]
        for part in parts:
            cursor = stream.cursor  # a cursor is plain data: a new stream can carry on from it
            stream = qp.StreamPositions(CFG, qp.Cursor(cursor.base, cursor.offset, cursor.max_id))
            pieces.append(stream.feed(part).positions)
    np.testing.assert_array_equal(np.concatenate(pieces, 1), want[:, 0])
    np.testing.assert_array_equal(qp.place(p.segments, CFG), want[:, 0])
    # transformers decodes the next token at len + delta = the max id + 1
    assert stream.cursor.max_id + 1 == len(p.ids) + deltas[0, 0]
    assert qp.parse_segments(p.ids, CFG, image_grid_thw=imgs, video_grid_thw=vids, audio_seqlens=media["audios"],
                             second_per_grids=media["spgs"], use_audio_in_video=use_aiv) == p.segments


def test_relative_pieces_add_up():
    grid, spg = (3, 4, 2), 2 / 3
    t_index = qp.video_t_index(3, spg)
    rel = qp.vision_positions(grid, t_index)
    np.testing.assert_array_equal(rel + np.float32(17), qp.vision_positions(grid, t_index, start=17.0))
    np.testing.assert_array_equal(qp.text_positions(4, 5.0), [[5, 6, 7, 8]] * 3)
    np.testing.assert_array_equal(qp.image_t_index(3), [0, 13, 26])


# --- bad input -------------------------------------------------------------------------------------------------------

def _call(p, use_aiv=False, **change):
    ids, mask, media = batch([p])
    kw = dict(image_grid_thw=np.array(media["images"]).reshape(-1, 3),
              video_grid_thw=np.array(media["videos"]).reshape(-1, 3), audio_seqlens=media["audios"],
              second_per_grids=media["spgs"], use_audio_in_video=use_aiv)
    kw.update(change)
    return qp.rope_index(ids, mask, CFG, **kw)


def test_more_groups_than_grids_is_refused():
    p = Prompt([("image", (1, 2, 2)), ("text", 2), ("image", (1, 2, 2))])
    with pytest.raises(ValueError, match=r"image group #2 but only 1 image grids"):
        _call(p, image_grid_thw=np.array([[1, 2, 2]]))
    with pytest.raises(ValueError, match=r"audio group #1 but only 0 audio"):
        _call(Prompt([("audio", 50)]), audio_seqlens=(), image_grid_thw=np.zeros((0, 3)))
    with pytest.raises(ValueError, match="no second_per_grids"):
        _call(Prompt([("video", (2, 2, 2), 1.0)]), second_per_grids=())


def test_more_grids_than_groups_is_refused():
    with pytest.raises(ValueError, match="2 image inputs were given but the prompt has 1 image groups"):
        _call(Prompt([("image", (1, 2, 2))]), image_grid_thw=np.array([[1, 2, 2], [1, 2, 2]]))


def test_placeholder_count_mismatch_is_refused():
    p = Prompt([("aiv", (2, 2, 2), 1.0, 300), ("text", 2)])
    with pytest.raises(ValueError, match=r"<\|AUDIO\|> placeholders but audio of 200 mel frames needs 26"):
        _call(p, use_aiv=True, audio_seqlens=[200])
    with pytest.raises(ValueError, match=r"<\|VIDEO\|> placeholders but grid \(3, 2, 2\) needs 3"):
        _call(p, use_aiv=True, video_grid_thw=np.array([[3, 2, 2]]))
    img = Prompt([("image", (1, 4, 4)), ("text", 1)])
    with pytest.raises(ValueError, match=r"4 <\|IMAGE\|> placeholders but grid \(1, 4, 6\) needs 6"):
        _call(img, image_grid_thw=np.array([[1, 4, 6]]))
    ids = list(img.ids)
    ids[5] = 7  # the end marker replaced by text
    with pytest.raises(ValueError, match=r"expected <\|vision_end\|>"):
        qp.rope_index(np.array([ids]), None, CFG, image_grid_thw=[[1, 4, 4]])


def test_inconsistent_layouts_are_refused():
    aiv = Prompt([("aiv", (2, 2, 2), 1.0, 100)])
    with pytest.raises(ValueError, match="use_audio_in_video=False"):
        _call(aiv, use_aiv=False)
    vid = Prompt([("video", (2, 2, 2), 1.0)])
    with pytest.raises(ValueError, match="use_audio_in_video=True"):
        _call(vid, use_aiv=True)
    stray = np.array([[1, 2, CFG.image_token_id, 3]])
    with pytest.raises(ValueError, match=r"<\|IMAGE\|> outside a modality group"):
        qp.rope_index(stray, None, CFG, image_grid_thw=[[1, 2, 2]])
    with pytest.raises(ValueError, match="attention_mask"):
        qp.rope_index(stray, [[1, 1, 2, 1]], CFG)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        qp.vision_positions((1, 3, 4), [0.0])


# --- config ----------------------------------------------------------------------------------------------------------

def test_config_from_hf_and_json():
    thinker = {"audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
               "vision_start_token_id": 151652, "vision_end_token_id": 151653, "audio_start_token_id": 151669,
               "audio_end_token_id": 151670, "position_id_per_seconds": 13, "user_token_id": 872,
               "vision_config": {"spatial_merge_size": 2}}
    cfg = qp.Qwen3OmniConfig.from_hf({"thinker_config": thinker})
    assert cfg == qp.Qwen3OmniConfig()
    assert qp.Qwen3OmniConfig.from_hf({"audio_token_id": 5, "position_id_per_seconds": 25}).audio_token_id == 5
    assert qp.Qwen3OmniConfig.from_json(cfg.to_json()) == cfg
    assert cfg.placeholder_ids == {151675, 151655, 151656}
    assert cfg.boundary_ids == {151652, 151653, 151669, 151670, 151644, 151645}
    with pytest.raises(ValueError, match="distinct"):
        qp.Qwen3OmniConfig(audio_token_id=151655)
    with pytest.raises(ValueError, match="audio_token_id must be an integer"):  # not truncated to 151675
        Qwen3OmniConfig.from_hf({"audio_token_id": 151675.5})
    with pytest.raises(ValueError, match="spatial_merge_size must be an integer"):
        Qwen3OmniConfig.from_hf({"vision_config": {"spatial_merge_size": 2.5}})
    assert Qwen3OmniConfig.from_hf({"audio_token_id": 151675.0}).audio_token_id == 151675  # JSON may write 1.0
