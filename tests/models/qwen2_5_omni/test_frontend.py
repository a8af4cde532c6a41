"""The media frontend: raw frames / PCM / images -> chunks with encoder embeddings, on a tiny converted checkpoint."""

import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import pad_chunk, stack_chunks
from omnijax.chunks.spans import SpanKind
from omnijax.models.encoders.log_mel import InvalidPcmError, UnsupportedSampleRateError, log_mel
from omnijax.models.encoders.qwen_vl_preprocess import ImageTooSmallError, NonFinitePixelError, preprocess_video
from omnijax.models.encoders.whisper import encode_audio
from omnijax.models.qwen2_5_omni import frontend
from omnijax.models.qwen2_5_omni import layout as adapter
from omnijax.models.qwen2_5_omni.vision import encode_vision
from tests._support import tiny_omni

SMALL = {"min_pixels": 56 * 56}  # keep 56x84 frames at their size (2x3 LLM tokens per temporal patch)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    loaded = omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("frontend")))
    assert loaded.audio is not None and loaded.vision is not None
    return loaded


def _media(seconds, seed=0, start=0.0):
    return (frontend.synthetic_frames(seconds, 2.0, 56, 84, seed=seed, start=start),
            frontend.tone(seconds, 330.0, seed=seed, start=start))


def test_synthetic_media():
    frames = frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=3)
    assert frames.shape == (4, 56, 84, 3) and frames.dtype == np.uint8
    assert not np.array_equal(frames[0], frames[1])  # the shapes move
    np.testing.assert_array_equal(frames, frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=3))
    np.testing.assert_array_equal(frames[2:], frontend.synthetic_frames(1.0, 2.0, 56, 84, seed=3, start=1.0))
    pcm = frontend.tone(0.5, 440.0, seed=1)
    assert pcm.shape == (8000,) and pcm.dtype == np.float32 and 0.4 < np.abs(pcm).max() < 0.6


def test_audiovisual_chunk_is_the_adapters_unit_with_encoder_features(model):
    # 4 s: two 2 s interleaving chunks, V0 A0 V1 A1, so the features' order inside the unit matters.
    frames, pcm = _media(4.0)
    chunk = frontend.audiovisual_chunk(model, frames, pcm, unit=5, answer_tokens=2, **SMALL)
    vc = model.vision.config
    pixels, grid = preprocess_video(frames, **SMALL, patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                    temporal_patch_size=vc.temporal_patch_size)
    video = np.asarray(encode_vision(model.vision, pixels, grid), np.float32)
    audio = np.asarray(encode_audio(model.audio, log_mel(pcm)), np.float32)
    assert tuple(grid[0]) == (4, 4, 6) and video.shape == (24, 32) and audio.shape == (100, 32)
    ref = adapter.audiovisual_unit(tuple(grid[0]), 100, 1.0, 5, hidden_size=32, answer_tokens=2)
    for name in ("token_ids", "valid", "positions", "unit", "span", "offset", "answer_tokens", "answer_unit",
                 "advance", "embed_mask"):
        np.testing.assert_array_equal(getattr(chunk, name), getattr(ref, name), err_msg=name)
    ids = chunk.token_ids[0]
    spans = chunk.span[0]
    runs = [int(s) for i, s in enumerate(spans) if i == 0 or s != spans[i - 1]]
    assert runs == [SpanKind.BOUNDARY, SpanKind.VIDEO, SpanKind.AUDIO, SpanKind.VIDEO, SpanKind.AUDIO,
                    SpanKind.BOUNDARY]
    embeds = chunk.embeds[0]
    np.testing.assert_array_equal(embeds[ids == adapter.VIDEO], video)
    np.testing.assert_array_equal(embeds[ids == adapter.AUDIO], audio)
    assert not embeds[~chunk.embed_mask[0]].any()
    assert chunk.embeds.dtype == np.float32


def test_frame_count_rule(model):
    assert frontend.expected_frames(32000, 2.0) == 4
    assert frontend.expected_frames(31990, 2.0) == 4  # 200 feature frames: 2.00 s
    assert frontend.expected_frames(38400, 2.0) == 4  # 2.4 s: 4.8 frames, floored to whole temporal patches
    assert frontend.expected_frames(16000, 2.0) == 2
    assert frontend.expected_frames(8000, 2.0) == 0
    frames, pcm = _media(2.0)
    with pytest.raises(frontend.FrameCountError, match=r"unit 2 .*got 2 video frame.*implies 4 frames") as e:
        frontend.audiovisual_chunk(model, frames[:2], pcm, unit=2, **SMALL)
    assert (e.value.frames, e.value.expected) == (2, 4)
    long_frames, long_pcm = _media(4.0)
    with pytest.raises(frontend.FrameCountError, match="got 4 video frame.*implies 8 frames"):
        frontend.audiovisual_chunk(model, frames, long_pcm, unit=2, **SMALL)  # a video without its frames
    with pytest.raises(frontend.FrameCountError, match="got 8 video frame.*implies 4 frames"):
        frontend.audiovisual_chunk(model, long_frames, pcm, unit=2, **SMALL)
    with pytest.raises(frontend.FrameCountError, match="shorter than one temporal patch"):
        frontend.audiovisual_chunk(model, frames[:1], pcm[:8000], unit=2, **SMALL)
    # 3 frames fill the same 2 temporal patches: the last frame is repeated, as the processor pads.
    padded = frontend.audiovisual_chunk(model, frames[:3], pcm, unit=2, **SMALL)
    repeated = frontend.audiovisual_chunk(model, np.concatenate([frames[:3], frames[2:3]]), pcm, unit=2, **SMALL)
    np.testing.assert_array_equal(padded.embeds, repeated.embeds)


def test_missing_encoders(model):
    frames, pcm = _media(2.0)
    no_vision = omnijax.Model(model.decoder, audio=model.audio, vision=None)
    no_audio = omnijax.Model(model.decoder, audio=None, vision=model.vision)
    with pytest.raises(frontend.MissingEncoderError, match="this checkpoint has no vision encoder"):
        frontend.audiovisual_chunk(no_vision, frames, pcm, unit=1)
    with pytest.raises(frontend.MissingEncoderError, match="no vision encoder"):
        frontend.image_chunk(no_vision, frames[0], unit=1)
    with pytest.raises(frontend.MissingEncoderError, match="no audio encoder"):
        frontend.audiovisual_chunk(no_audio, frames, pcm, unit=1)
    with pytest.raises(frontend.MissingEncoderError, match="no audio encoder"):
        frontend.audio_chunk(no_audio, pcm, unit=1)


def test_bad_media_errors_name_the_unit(model):
    frames, pcm = _media(2.0)
    nan_pcm = pcm.copy()
    nan_pcm[100] = np.nan
    with pytest.raises(InvalidPcmError, match=r"^unit 7 \(audio\): .*non-finite"):
        frontend.audio_chunk(model, nan_pcm, unit=7)
    with pytest.raises(InvalidPcmError, match=r"^unit 8 \(audio\)"):
        frontend.audiovisual_chunk(model, frames, nan_pcm, unit=8)
    with pytest.raises(UnsupportedSampleRateError, match=r"^unit 7 \(audio\): .*16000"):
        frontend.audio_chunk(model, pcm, unit=7, sample_rate=44100)
    with pytest.raises(ImageTooSmallError, match=r"^unit 9 \(image\)"):
        frontend.image_chunk(model, np.zeros((10, 10, 3), np.uint8), unit=9)
    bad_frames = frames.astype(np.float32) / 255.0
    bad_frames[0, 0, 0, 0] = np.nan
    with pytest.raises(NonFinitePixelError, match=r"^unit 4 \(video\)"):
        frontend.audiovisual_chunk(model, bad_frames, pcm, unit=4)
    with pytest.raises(ValueError, match=r"^unit 4 \(video\): video must be a \[T, H, W, 3\]"):
        frontend.audiovisual_chunk(model, frames[0], pcm, unit=4)
    with pytest.raises(frontend.FrontendError, match="unit must be a non-negative integer"):
        frontend.audio_chunk(model, pcm, unit=-1)


def test_stacked_session_streams_like_the_step_wise_session(model):
    im_start, im_end = adapter.IM_START, adapter.IM_END
    chunks = [frontend.system(model, [im_start, 11, 12, 13, im_end], unit=0)]
    for k in range(2):
        frames, pcm = _media(2.0, seed=k, start=2.0 * k)
        chunks.append(frontend.audiovisual_chunk(model, frames, pcm, unit=1 + k, **SMALL))
    chunks.append(frontend.image_chunk(model, _media(1.0)[0][0], unit=3))
    chunks.append(frontend.audio_chunk(model, frontend.tone(1.0, 500.0), unit=4))
    chunks.append(frontend.text(model, [im_start, 21, 22, im_end, im_start, 23], unit=5, answer_tokens=4))
    assert all(c.embeds is not None and c.embeds.shape[-1] == 32 for c in chunks)
    assert not chunks[0].embed_mask.any() and not chunks[-1].embeds.any()
    assert [c.length for c in chunks] == [5, 66, 66, 8, 27, 6]
    stacked = stack_chunks(chunks)
    result = omnijax.stream(model, stacked, max_answer_tokens=4, num_pages=16, page_size=16)
    session = omnijax.Session(model, max_answer_tokens=4, num_pages=16, page_size=16)
    outs = [session.feed(pad_chunk(c, stacked.token_ids.shape[-1])) for c in chunks]
    np.testing.assert_array_equal(np.asarray(result.logits[:, 0]), np.stack([np.asarray(o.logits[0]) for o in outs]))
    np.testing.assert_array_equal(np.asarray(result.tokens[:, 0]), np.stack([np.asarray(o.tokens[0]) for o in outs]))
    assert (np.asarray(result.tokens[-1, 0]) >= 0).sum() >= 1
    retained = int(result.stats.layout.retained_cells[-1, 0])
    answered = int((np.asarray(result.tokens[-1, 0]) >= 0).sum())
    assert retained == sum(c.length for c in chunks) + answered
