"""Chunk builders of the model adapters: token layout, span / unit / offset metadata, embeddings, MiniCPM-o units.

Expectations are written out in plain Python (run-walking loops, explicit token lists) rather than re-derived from the
adapters' helpers. Qwen positions are checked against transformers in test_positions.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from omnijax.chunks.builders import concat, span_offsets, token_layout, unstack
from omnijax.chunks.chunk import stack_chunks, validate
from omnijax.chunks.spans import SpanKind as S
from omnijax.models.minicpmo import layout as m
from omnijax.models.qwen2_5_omni import layout as q

B, V, A, I, T, R, SY, SL = S.BOUNDARY, S.VIDEO, S.AUDIO, S.IMAGE, S.TEXT, S.RESPONSE, S.SYSTEM, S.SLICE


def expected_offsets(spans, units=None):
    units = [0] * len(spans) if units is None else units
    out, count = [], 0
    for i, (s, u) in enumerate(zip(spans, units)):
        count = count + 1 if i and s == spans[i - 1] and u == units[i - 1] else 0
        out.append(count)
    return out


def check_meta(chunk, ids, spans, unit, axes):
    assert chunk.token_ids.tolist() == [list(ids)]
    assert chunk.span.tolist() == [[int(s) for s in spans]]
    assert chunk.unit.tolist() == [[unit] * len(ids)]
    assert chunk.offset.tolist() == [expected_offsets([int(s) for s in spans])]
    assert chunk.valid.all() and chunk.positions.shape == (axes, 1, len(ids))
    assert chunk.positions.dtype == np.int32 and chunk.token_ids.dtype == np.int32


def config(axes, hidden=8):
    return SimpleNamespace(position_axes=axes, vocab_size=152064, hidden_size=hidden)


# --- Qwen2.5-Omni ---------------------------------------------------------------------------------------------------

def test_qwen_text_builders():
    ids = [q.IM_START, 10, 11, q.IM_END, 12]
    c = q.system_unit(ids, unit=0)
    check_meta(c, ids, [SY] * 5, 0, 3)
    assert c.positions[:, 0].tolist() == [list(range(5))] * 3 and c.embeds is None and c.embed_mask is None
    c = q.text_unit(ids, unit=4, answer_tokens=3)
    check_meta(c, ids, [B, T, T, B, T], 4, 3)
    assert c.answer_tokens.tolist() == [3] and c.answer_unit.tolist() == [5]
    assert q.text_unit(ids, 4, 2, answer_unit=9).answer_unit.tolist() == [9]
    c = q.response_unit([20, 21, q.IM_END], unit=7)
    check_meta(c, [20, 21, q.IM_END], [R, R, B], 7, 3)
    assert c.answer_tokens.tolist() == [0]
    c = q.text_unit([1, 2], unit=1, hidden_size=8)
    assert c.embeds.shape == (1, 2, 8) and not c.embed_mask.any() and not c.embeds.any()
    with pytest.raises(ValueError, match="multimodal token 151655"):
        q.text_unit([1, q.IMAGE], unit=0)


def test_qwen_image_audio_video_builders():
    c = q.image_unit((1, 4, 6), unit=2)
    check_meta(c, [q.VISION_BOS] + [q.IMAGE] * 6 + [q.VISION_EOS], [B] + [I] * 6 + [B], 2, 3)
    assert c.embeds is None
    feats = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) + 1
    c = q.image_unit((1, 4, 6), unit=2, embeds=feats)
    assert c.embed_mask.tolist() == [[False] + [True] * 6 + [False]]
    np.testing.assert_array_equal(c.embeds[0, 1:-1], feats)
    assert not c.embeds[0, [0, -1]].any()
    c = q.audio_unit(5, unit=3, hidden_size=4, answer_tokens=2)
    check_meta(c, [q.AUDIO_BOS] + [q.AUDIO] * 5 + [q.AUDIO_EOS], [B] + [A] * 5 + [B], 3, 3)
    assert c.positions[:, 0].tolist() == [list(range(7))] * 3 and c.embeds.shape == (1, 7, 4)
    assert c.embed_mask.sum() == 5 and c.answer_tokens.tolist() == [2]
    c = q.video_unit((3, 2, 4), 2.0, unit=5)
    check_meta(c, [q.VISION_BOS] + [q.VIDEO] * 6 + [q.VISION_EOS], [B] + [V] * 6 + [B], 5, 3)
    assert c.positions[0, 0].tolist() == [0, 1, 1, 51, 51, 101, 101, 102]
    with pytest.raises(ValueError, match="got 5 embeddings for 6"):
        q.image_unit((1, 4, 6), unit=0, embeds=np.zeros((5, 4)))
    with pytest.raises(ValueError, match="widths disagree"):
        q.image_unit((1, 4, 6), unit=0, embeds=np.zeros((6, 4)), hidden_size=8)


def test_qwen_audiovisual_unit_layout_and_embeds():
    # spg 2.0, grid t = 3: temporal ids 0, 50, 100 -> video chunks of 2 tokens; 120 audio tokens -> 50, 50, 20
    vid = np.arange(6 * 3, dtype=np.float32).reshape(6, 3) + 1
    aud = -np.arange(120 * 3, dtype=np.float32).reshape(120, 3) - 1
    c = q.audiovisual_unit((3, 2, 4), 120, 2.0, unit=8, video_embeds=vid, audio_embeds=aud, answer_tokens=4)
    ids = [q.VISION_BOS, q.AUDIO_BOS] + [q.VIDEO] * 2 + [q.AUDIO] * 50 + [q.VIDEO] * 2 + [q.AUDIO] * 50 \
        + [q.VIDEO] * 2 + [q.AUDIO] * 20 + [q.AUDIO_EOS, q.VISION_EOS]
    spans = [B, B] + [V] * 2 + [A] * 50 + [V] * 2 + [A] * 50 + [V] * 2 + [A] * 20 + [B, B]
    check_meta(c, ids, spans, 8, 3)
    assert c.offset[0, 54:56].tolist() == [0, 1]  # the second video chunk starts a new run
    pos = c.positions[:, 0]
    assert pos[:, :2].tolist() == [[0, 0]] * 3 and pos[:, -2:].tolist() == [[121, 121]] * 3
    assert pos[0, 2:4].tolist() == [1, 1] and pos[0, 54:56].tolist() == [51, 51]
    assert pos[0, 106:108].tolist() == [101, 101]
    assert pos[:, 4].tolist() == [1, 1, 1] and pos[:, 56].tolist() == [51, 51, 51]
    assert pos[1:, 2:4].tolist() == [[1, 1], [1, 2]]  # h, w from base 1, not shifted by time
    mask = c.embed_mask[0]
    np.testing.assert_array_equal(c.embeds[0][np.asarray(ids) == q.VIDEO], vid)
    np.testing.assert_array_equal(c.embeds[0][np.asarray(ids) == q.AUDIO], aud)
    assert mask.sum() == 126 and not mask[[0, 1, -2, -1]].any()
    assert c.answer_tokens.tolist() == [4] and c.answer_unit.tolist() == [9]
    # a 2 s unit at 2 fps: bos bos V(t=0) V(t=25) A x50 eos eos, cursor advance 52
    c = q.audiovisual_unit((2, 2, 2), 50, 1.0, unit=0)
    assert c.token_ids[0, :4].tolist() == [q.VISION_BOS, q.AUDIO_BOS, q.VIDEO, q.VIDEO]
    assert c.positions[0, 0, 2:4].tolist() == [1, 26] and c.positions.max() + 1 == 52


def test_qwen_session_stacks_validates_and_concatenates():
    D = 8
    parts = [q.system_unit([q.IM_START, 1, 2, q.IM_END], 0, hidden_size=D),
             q.text_unit([q.IM_START, 3], 1, hidden_size=D),
             q.image_unit((1, 2, 4), 1, embeds=np.ones((2, D), np.float32)),
             q.audiovisual_unit((2, 2, 2), 50, 1.0, 2, hidden_size=D),
             q.text_unit([4, q.IM_END], 3, answer_tokens=2, hidden_size=D)]
    for p in parts:
        validate(p, config(3, D), max_answer_tokens=4, stacked=False)
    stacked = stack_chunks(parts)
    validate(stacked, config(3, D), max_answer_tokens=4, stacked=True)
    ids, pos = token_layout(parts)
    ids_s, pos_s = token_layout(stacked)
    np.testing.assert_array_equal(ids, ids_s)
    np.testing.assert_array_equal(pos, pos_s)
    assert [c.length for c in unstack(stacked)] == [stacked.length] * 5
    joined = concat(parts[1:3])  # user prefix + image as one chunk of unit 1
    ids_j, pos_j = token_layout([parts[0], joined] + parts[3:])
    np.testing.assert_array_equal(ids_j, ids)
    np.testing.assert_array_equal(pos_j, pos)
    assert joined.span.tolist() == [[B, T, B, I, I, B]] and joined.offset.tolist() == [[0, 0, 0, 0, 1, 0]]
    assert joined.embeds.shape == (1, 6, D) and joined.embed_mask.tolist() == [[False] * 3 + [True] * 2 + [False]]
    with pytest.raises(ValueError, match="every chunk carries embeddings"):
        concat([q.text_unit([1], 0), parts[2]])
    plain = q.with_embeds(q.image_unit((1, 2, 2), 0), D)
    assert plain.embeds.shape == (1, 3, D) and plain.embed_mask.tolist() == [[False, True, False]]


def test_token_layout_cursor_rule():
    ids, pos = token_layout([q.text_unit([1, 2], 0), q.image_unit((1, 2, 4), 0), q.text_unit([3], 0)], start=100)
    assert ids.tolist() == [1, 2, q.VISION_BOS, q.IMAGE, q.IMAGE, q.VISION_EOS, 3]
    assert pos.tolist() == [[100, 101, 102, 103, 103, 105, 106],
                            [100, 101, 102, 103, 103, 105, 106],
                            [100, 101, 102, 103, 104, 105, 106]]


def test_span_offsets():
    spans = [B, B, V, V, V, A, A, B, V]
    assert span_offsets(np.asarray(spans)).tolist() == expected_offsets(spans)
    units = [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert span_offsets(np.asarray(spans), np.asarray(units)).tolist() == expected_offsets(spans, units)
    assert span_offsets(np.zeros(0, np.int32)).tolist() == []


# --- MiniCPM-o ------------------------------------------------------------------------------------------------------

def test_slice_grid():
    assert m.slice_grid(1344, 1344) == (3, 3)
    assert m.slice_grid(448, 448) is None and m.slice_grid(300, 200) is None
    assert m.slice_grid(1920, 1080) == (4, 2)  # 9 (and 8) slices; 4 x 2 is closest to 16:9
    assert m.slice_grid(1000, 300) == (3, 1)
    assert m.slice_grid(1344, 1344, max_slice_nums=4) == (2, 2)
    assert m.image_token_count((3, 3)) == 640 and m.image_token_count(None) == 64


def test_minicpm_2_6_omni_unit():
    t = m.MINICPMO_2_6
    c = m.omni_unit_2_6(unit=3)
    ids = [t.unit_start, t.image_start] + [t.image_placeholder] * 64 + [t.image_end, t.audio_start] \
        + [t.audio_placeholder] * 25 + [t.audio_end]
    check_meta(c, ids, [B, B] + [I] * 64 + [B, B] + [A] * 25 + [B], 3, 1)
    assert c.positions[0, 0].tolist() == list(range(len(ids)))
    # one second of session: 93 tokens; a 1344 x 1344 frame: 640 image tokens
    c = m.omni_unit_2_6(unit=0, slices=m.slice_grid(1344, 1344), hidden_size=4)
    assert (c.span == S.IMAGE).sum() + (c.span == S.SLICE).sum() == 640 and c.embed_mask.sum() == 665
    custom = m.MiniCPMTokens(**{**m.MINICPMO_2_6.__dict__, "unit_start": 7})
    assert m.omni_unit_2_6(0, tokens=custom).token_ids[0, 0] == 7


def test_minicpm_4_5_duplex_unit_with_slices():
    t = m.MINICPMO_4_5
    D = 4
    feats = np.arange(10 * 64 * D, dtype=np.float32).reshape(10, 64, D)
    aud = -np.ones((10, D), np.float32)
    c = m.duplex_unit(5, slices=m.slice_grid(1344, 1344), tail="listen", image_embeds=feats, audio_embeds=aud)
    ids = [t.unit_start, t.image_start] + [t.image_placeholder] * 64 + [t.image_end]
    spans = [B, B] + [I] * 64 + [B]
    for _ in range(9):
        ids += [t.slice_start] + [t.image_placeholder] * 64 + [t.slice_end]
        spans += [B] + [SL] * 64 + [B]
    ids += [t.audio_placeholder] * 10 + [t.listen, t.unit_end]
    spans += [A] * 10 + [B, B]
    check_meta(c, ids, spans, 5, 1)
    assert len(ids) == 1 + 66 + 9 * 66 + 10 + 2 == 673
    assert (c.span == S.IMAGE).sum() + (c.span == S.SLICE).sum() == 640
    # each slice is its own SLICE run with offsets 0..63
    slice_offsets = c.offset[0][c.span[0] == S.SLICE].reshape(9, 64)
    assert (slice_offsets == np.arange(64)).all()
    np.testing.assert_array_equal(c.embeds[0][np.isin(c.span[0], [S.IMAGE, S.SLICE])], feats.reshape(640, D))
    np.testing.assert_array_equal(c.embeds[0][c.span[0] == S.AUDIO], aud)
    assert c.embed_mask.sum() == 650
    assert c.answer_unit.tolist() == [5]  # duplex output stays in its unit
    validate(c, config(1, D), max_answer_tokens=0, stacked=False)


def test_minicpm_4_5_duplex_tails():
    t = m.MINICPMO_4_5
    audio = [t.audio_placeholder] * 10
    img = [t.image_start] + [t.image_placeholder] * 64 + [t.image_end]
    c = m.duplex_unit(1, tail="chunk_eos")
    check_meta(c, [t.unit_start] + img + audio + [t.chunk_eos, t.unit_end], [B, B] + [I] * 64 + [B] + [A] * 10
               + [B, B], 1, 1)
    c = m.duplex_unit(2, image=False, tail=[t.speak, 40, 41, t.chunk_eos])
    check_meta(c, [t.unit_start] + audio + [t.speak, 40, 41, t.chunk_eos, t.unit_end],
               [B] + [A] * 10 + [B, R, R, B, B], 2, 1)
    live = m.duplex_unit(3, close=False, answer_tokens=4)  # the model decides: listen or speak
    assert live.token_ids[0, -1] == t.audio_placeholder and live.answer_tokens.tolist() == [4]
    assert live.answer_unit.tolist() == [3]
    c = m.duplex_unit(4, image=False, audio_markers=True)
    assert c.token_ids[0].tolist() == [t.unit_start, t.audio_start] + audio + [t.audio_end, t.unit_end]
    rows = m.MiniCPMTokens(**{**t.__dict__, "slice_row_separator": 198})
    c = m.duplex_unit(0, slices=(2, 2), tokens=rows, image=True, audio_tokens=0, close=False)
    assert (c.token_ids[0] == 198).sum() == 1 and c.span[0][c.token_ids[0] == 198].tolist() == [B]
    with pytest.raises(ValueError, match="tail must be"):
        m.duplex_unit(0, tail="talk")
    with pytest.raises(ValueError, match="slices need the source image"):
        m.duplex_unit(0, image=False, slices=(2, 2))


def test_minicpm_session_positions_are_indices():
    t = m.MINICPMO_4_5
    parts = [m.system_unit([t.im_start, 1, 2, t.im_end], 0), m.duplex_unit(1, tail="listen"),
             m.duplex_unit(2, slices=(2, 1), tail=[30, 31, t.chunk_eos]), m.text_unit([t.im_start, 5], 3),
             m.response_unit([6, t.im_end], 4)]
    assert parts[0].span.tolist() == [[SY] * 4]
    assert parts[3].span.tolist() == [[B, T]] and parts[4].span.tolist() == [[R, B]]
    ids, pos = token_layout(parts)
    assert pos.shape == (1, ids.shape[0]) and pos[0].tolist() == list(range(ids.shape[0]))
    D = 4
    with_e = [m.with_embeds(p, D) for p in parts]
    assert with_e[1].embed_mask.sum() == 74 and not with_e[0].embed_mask.any()
    validate(stack_chunks(with_e), config(1, D), max_answer_tokens=0, stacked=True)
