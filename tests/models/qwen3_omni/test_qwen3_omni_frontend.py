"""The Qwen3-Omni media frontend: preprocessing against transformers' processor components configured like the
Qwen3-Omni release, chunks of a tiny converted thinker against the one-shot forward and transformers, errors."""

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

import omnijax  # noqa: E402
from omnijax.chunks.chunk import stack_chunks  # noqa: E402
from omnijax.chunks.spans import SpanKind  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.models.encoders import qwen_vl_preprocess as vp  # noqa: E402
from omnijax.models.encoders.log_mel import InvalidPcmError  # noqa: E402
from omnijax.models.qwen2_5_omni import frontend as frontend25  # noqa: E402
from omnijax.models.qwen3_omni import frontend as F  # noqa: E402
from omnijax.models.qwen3_omni import layout as adapter  # noqa: E402
from omnijax.models.qwen3_omni import positions as P  # noqa: E402
from tests._support import qwen3_omni_models as Q  # noqa: E402
from tests._support import video_golden  # noqa: E402

SR = 16000
FPS = 2.0
SMALL = {"min_pixels": 64 * 96}  # keep 64x96 frames at their size: 2x3 LLM tokens per temporal patch
# The release's preprocessor_config.json (Qwen/Qwen3-Omni-30B-A3B-Instruct, -Thinking, -Captioner).
RELEASE_AUDIO = dict(feature_size=128, hop_length=160, n_fft=400, sampling_rate=16000, chunk_length=300,
                     n_samples=4800000, nb_max_frames=30000, dither=0.0, padding_side="right", padding_value=0.0,
                     return_attention_mask=True)
RELEASE_VISION = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
                      image_std=[0.5, 0.5, 0.5], min_pixels=3136, max_pixels=12845056)


# ----------------------------------------------------------------------------------------------------- references


@pytest.fixture(scope="module")
def feature_extractor():
    return transformers.WhisperFeatureExtractor(**RELEASE_AUDIO)


@pytest.fixture(scope="module")
def image_processor():
    return transformers.Qwen2VLImageProcessor(**RELEASE_VISION)


def _processor_kwargs(modality: str) -> dict:
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessorKwargs

    return Qwen3OmniMoeProcessorKwargs._defaults[f"{modality}_kwargs"]


def _hf_audio(fe, clips):
    """What `Qwen3OmniMoeProcessor` hands the thinker for `clips`: features and the valid-frame mask."""
    kwargs = _processor_kwargs("audio")
    out = fe(clips, return_tensors="np", **kwargs)
    return out["input_features"], out["attention_mask"]


def _hf_video(image_processor, frames, min_pixels=F.VIDEO_MIN_PIXELS, max_pixels=F.VIDEO_MAX_PIXELS):
    """`Qwen2VLVideoProcessor`'s pipeline without torchvision: torch's uint8 antialiased bicubic resize (what
    torchvision runs on CPU), then the image processor's shared rescale / normalise / patch path."""
    h, w = vp.smart_resize(frames.shape[1], frames.shape[2], 32, min_pixels, max_pixels)
    resized = torch.nn.functional.interpolate(torch.from_numpy(frames).permute(0, 3, 1, 2), size=[h, w],
                                              mode="bicubic", antialias=True, align_corners=False)
    p = image_processor
    rows, grid = p._preprocess(
        list(resized.permute(0, 2, 3, 1).numpy()), do_resize=False,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, resample=p.resample, do_rescale=True,
        rescale_factor=p.rescale_factor, do_normalize=True, image_mean=p.image_mean, image_std=p.image_std,
        patch_size=16, temporal_patch_size=2, merge_size=2, do_convert_rgb=True)
    return rows, np.asarray([grid])


def _close(got, want, atol):
    assert np.shape(got) == np.shape(want), (np.shape(got), np.shape(want))
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    assert err <= atol, err
    return err


# --------------------------------------------------------------------------------------------- (a) preprocessing


def test_defaults_are_the_processors():
    video = _processor_kwargs("videos")
    assert video["size"] == {"shortest_edge": F.VIDEO_MIN_PIXELS, "longest_edge": F.VIDEO_MAX_PIXELS}
    assert video["position_id_per_seconds"] == P.Qwen3OmniConfig().position_id_per_seconds == 13
    assert _processor_kwargs("audio")["padding"] is True  # pad to the longest clip, not to 300 s
    assert (F.IMAGE_MIN_PIXELS, F.IMAGE_MAX_PIXELS) == (3136, 12845056)
    assert F.IMAGE_MEAN == F.IMAGE_STD == (0.5, 0.5, 0.5) and F.NUM_MEL_BINS == 128


@pytest.mark.parametrize("samples, loud_end", [(2 * SR, False), (2 * SR + 77, False), (SR // 2 + 5, True),
                                               (201, False)])
def test_log_mel_matches_whisper_feature_extractor(feature_extractor, samples, loud_end):
    pcm = F.tone(samples / SR, 440.0, seed=1)[:samples]
    if loud_end:  # the clamp's maximum sits in the last frames, which see the clip's reflection
        pcm[-300:] *= 1.9
    want, mask = _hf_audio(feature_extractor, pcm)
    ours = F.log_mel(pcm)
    assert mask.sum() == samples // 160 == ours.shape[1] == want.shape[-1]
    _close(ours, want[0], 1e-4)
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    assert F.num_audio_tokens(samples) == int(_get_feat_extract_output_lengths(mask.sum(-1))[0])


@pytest.mark.parametrize("size", [(100, 73), (300, 200), (64, 96)])
def test_image_matches_image_processor(image_processor, size):
    image = F.synthetic_frames(0.5, FPS, *size, seed=sum(size))[0]
    want = image_processor(images=[image], return_tensors="np")
    rows, grid = F.preprocess_image(image)
    np.testing.assert_array_equal(grid, want["image_grid_thw"])
    assert rows.dtype == np.float32
    _close(rows, want["pixel_values"], 1e-5)


@pytest.mark.parametrize("frames", [4, 3])
def test_video_matches_video_processor_pipeline(image_processor, frames):
    video = F.synthetic_frames(2.0, FPS, 90, 120, seed=3)[:frames]  # 2 s at 2 fps (or its first 3 frames)
    rows, grid = F.preprocess_video(video)
    want, want_grid = _hf_video(image_processor, video)
    np.testing.assert_array_equal(grid, want_grid)
    assert tuple(grid[0]) == (2, 20, 28)  # upscaled to at least 128 * 32 * 32 px
    _close(rows, want, 1e-5)


def test_video_matches_transformers_video_processor():
    """`Qwen2VLVideoProcessor(**RELEASE_VISION)` itself (torchvision's resize) called with `Qwen3OmniMoeProcessor`'s
    video `size`, recorded by tests/_support/data/video_processor/make.py in a second environment."""
    cases, info = video_golden.load("qwen3_omni")
    recorded = info["processors"]["qwen3_omni"]
    assert recorded["init_kwargs"] == RELEASE_VISION
    assert recorded["default_size"] == _processor_kwargs("videos")["size"] == {
        "shortest_edge": F.VIDEO_MIN_PIXELS, "longest_edge": F.VIDEO_MAX_PIXELS}
    assert tuple(recorded["settings"]["image_mean"]) == F.IMAGE_MEAN and tuple(
        recorded["settings"]["image_std"]) == F.IMAGE_STD
    assert len(cases) == 4 and {g.case.frames for g in cases} == {4, 3, 5, 2}
    for golden in cases:
        rows, grid = F.preprocess_video(golden.video, **golden.case.size_kwargs())
        np.testing.assert_array_equal(grid, golden.video_grid_thw, err_msg=golden.case.name)
        assert rows.dtype == np.float32, golden.case.name
        _close(rows, golden.pixel_values_videos, 1e-5)


# ------------------------------------------------------------------------------------------------ (b) the chunks


@pytest.fixture(scope="module")
def hf():
    thinker = Q.build_thinker(seed=1, audio_overrides={"num_mel_bins": 128})  # the processor's 128 mel bins
    with torch.no_grad():  # larger audio weights than the default init, so that the audio features show in the logits
        for p in thinker.audio_tower.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.1)
    return thinker


@pytest.fixture(scope="module")
def model(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_frontend")
    loaded = omnijax.load(convert_checkpoint(Q.save_full(hf, root / "full"), root / "out", progress=False))
    assert loaded.model_type == "qwen3_omni" and loaded.audio.config.num_mel_bins == 128
    return loaded


def _media(k: int):
    """Unit k of a live stream: 2 s of 64x96 frames at 2 fps and the 2 s tone recorded with them."""
    return (F.synthetic_frames(2.0, FPS, 64, 96, seed=7, start=2.0 * k),
            F.tone(2.0, 330.0, seed=7 + k, start=2.0 * k))


def test_audiovisual_chunk_is_the_adapters_unit(model):
    frames, pcm = _media(0)
    chunk = F.audiovisual_chunk(model, frames, pcm, unit=5, answer_tokens=2, **SMALL)
    ref = adapter.audiovisual_unit((2, 4, 6), P.audio_token_count(200), 1.0, 5, hidden_size=64, deepstack_levels=2,
                                   answer_tokens=2, tokens=model.omni)
    for name in ("token_ids", "valid", "positions", "unit", "span", "offset", "answer_tokens", "answer_unit",
                 "advance", "embed_mask"):
        np.testing.assert_array_equal(getattr(chunk, name), getattr(ref, name), err_msg=name)
    ids, t = chunk.token_ids[0], model.omni
    video, audio = ids == t.video_token_id, ids == t.audio_token_id
    assert video.sum() == 12 and audio.sum() == 26
    assert chunk.deepstack.shape == (2, 1, chunk.length, 64) and chunk.deepstack.dtype == np.float32
    assert np.abs(chunk.deepstack[:, 0, video]).sum(-1).min() > 0  # every video token has its levels
    assert not chunk.deepstack[:, 0, ~video].any() and not chunk.embeds[0][~chunk.embed_mask[0]].any()
    runs = [int(s) for i, s in enumerate(chunk.span[0]) if i == 0 or s != chunk.span[0][i - 1]]
    assert runs[0] == runs[-1] == SpanKind.BOUNDARY and {SpanKind.VIDEO, SpanKind.AUDIO} <= set(runs)


def test_session_streams_like_the_one_shot_forward_and_transformers(model, hf, feature_extractor,
                                                                   image_processor):
    """[system, image, audiovisual x2, text] from the frontend, streamed unit by unit, give the one-shot forward's
    logits at every unit's last token, and transformers' thinker fed its own processors' outputs agrees."""
    image = F.synthetic_frames(0.5, FPS, 64, 96, seed=11)[0]
    media = [_media(k) for k in range(2)]
    chunks = [F.system(model, [1, 2, 3, 4], unit=0), F.image_chunk(model, image, unit=1)]
    chunks += [F.audiovisual_chunk(model, frames, pcm, unit=2 + k, **SMALL) for k, (frames, pcm) in enumerate(media)]
    chunks.append(F.text(model, [10, 11, 12, 13], unit=4, answer_tokens=3))
    assert all(c.deepstack is not None and c.deepstack.shape[0] == 2 for c in chunks)
    assert not chunks[0].deepstack.any() and not chunks[-1].deepstack.any() and chunks[1].deepstack.any()
    result = omnijax.stream(model, stack_chunks(chunks), max_answer_tokens=3, page_size=8)
    streamed = np.asarray(result.logits[:, 0])
    ends = np.cumsum([c.length for c in chunks]) - 1

    ids = np.concatenate([np.asarray(c.token_ids)[0] for c in chunks])[None]
    image_rows, image_grid = F.preprocess_image(image, model.vision.config)
    videos = [F.preprocess_video(frames, model.vision.config, **SMALL) for frames, _ in media]
    mels = [F.log_mel(pcm) for _, pcm in media]
    frames_max = max(m.shape[1] for m in mels)
    feats = np.stack([np.pad(m, ((0, 0), (0, frames_max - m.shape[1]))) for m in mels])
    feature_mask = np.stack([np.arange(frames_max) < m.shape[1] for m in mels]).astype(np.int64)
    one_shot = np.asarray(model(
        input_ids=ids, attention_mask=np.ones_like(ids), input_features=feats, feature_attention_mask=feature_mask,
        pixel_values=image_rows, image_grid_thw=image_grid, pixel_values_videos=np.concatenate([v for v, _ in videos]),
        video_grid_thw=np.concatenate([g for _, g in videos]), video_second_per_grid=np.asarray([1.0, 1.0]),
        use_audio_in_video=True))[0]
    err_one_shot = _close(streamed, one_shot[ends], 1e-4)

    # transformers end to end: its processors' outputs into its thinker.
    hf_feats, hf_mask = _hf_audio(feature_extractor, [pcm for _, pcm in media])
    hf_image = image_processor(images=[image], return_tensors="np")
    hf_videos = [_hf_video(image_processor, frames, min_pixels=SMALL["min_pixels"]) for frames, _ in media]
    inputs = dict(input_ids=ids, attention_mask=np.ones_like(ids), input_features=hf_feats,
                  feature_attention_mask=hf_mask, pixel_values=hf_image["pixel_values"],
                  image_grid_thw=hf_image["image_grid_thw"],
                  pixel_values_videos=np.concatenate([v for v, _ in hf_videos]),
                  video_grid_thw=np.concatenate([g for _, g in hf_videos]),
                  video_second_per_grid=np.asarray([2 / FPS] * 2))
    with torch.no_grad(), Q.windowed_audio(hf.audio_tower):
        want = hf(**{k: torch.as_tensor(v) for k, v in inputs.items()}, use_audio_in_video=True).logits[0].numpy()
    err_hf = _close(streamed, want[ends], 3e-5)  # measured 2.5e-6; Qwen2.5's zero-padded log-mel gives 9e-5
    print(f"streamed vs one-shot {err_one_shot:.2e}, vs transformers {err_hf:.2e}")


# ---------------------------------------------------------------------------------------------------- (c) errors


def test_missing_encoders_and_audio_only_sessions(model):
    frames, pcm = _media(0)
    no_vision = omnijax.Model(model.decoder, model_type="qwen3_omni", audio=model.audio, vision=None, omni=model.omni)
    no_audio = omnijax.Model(model.decoder, model_type="qwen3_omni", audio=None, vision=model.vision, omni=model.omni)
    with pytest.raises(F.MissingEncoderError, match="this checkpoint has no vision encoder"):
        F.audiovisual_chunk(no_vision, frames, pcm, unit=1)
    with pytest.raises(F.MissingEncoderError, match="no vision encoder"):
        F.image_chunk(no_vision, frames[0], unit=1)
    with pytest.raises(F.MissingEncoderError, match="no audio encoder"):
        F.audiovisual_chunk(no_audio, frames, pcm, unit=1)
    with pytest.raises(F.MissingEncoderError, match="no audio encoder"):
        F.audio_chunk(no_audio, pcm, unit=1)
    assert F.MissingEncoderError is frontend25.MissingEncoderError and F.FrontendError is frontend25.FrontendError
    # Without a vision encoder no chunk carries DeepStack levels, so a session still stacks.
    chunks = [F.system(no_vision, [1, 2], unit=0), F.audio_chunk(no_vision, pcm, unit=1),
              F.text(no_vision, [3], unit=2)]
    assert all(c.deepstack is None for c in chunks) and stack_chunks(chunks).embeds.shape[0] == 3
    assert chunks[1].length == 2 + F.num_audio_tokens(pcm.size) == 28


def test_mel_bins_and_model_family_are_checked(model):
    pcm = _media(0)[1]
    audio16 = types.SimpleNamespace(config=types.SimpleNamespace(num_mel_bins=16, output_dim=64))
    odd = omnijax.Model(model.decoder, model_type="qwen3_omni", audio=audio16, vision=model.vision, omni=model.omni)
    with pytest.raises(F.FrontendError, match="16 mel bins but Qwen3-Omni's processor.*128"):
        F.audio_chunk(odd, pcm, unit=1)
    qwen25 = omnijax.Model(model.decoder, model_type="qwen2_5_omni")
    with pytest.raises(F.FrontendError, match="qwen2_5_omni.frontend"):
        F.text(qwen25, [1, 2], unit=0)


def test_frame_count_and_rate_errors_name_the_unit(model):
    frames, pcm = _media(0)
    with pytest.raises(F.FrameCountError, match=r"^unit 2 \(audiovisual\): got 2 video frame.*implies 4 frames") as e:
        F.audiovisual_chunk(model, frames[:2], pcm, unit=2, **SMALL)
    assert (e.value.frames, e.value.expected) == (2, 4) and isinstance(e.value, frontend25.FrameCountError)
    with pytest.raises(F.FrameCountError, match=r"^unit 3 .*got 4 video frame.*implies 8 frames"):
        F.audiovisual_chunk(model, frames, np.concatenate([pcm, pcm]), unit=3, **SMALL)
    with pytest.raises(F.FrameCountError, match=r"^unit 3 .*shorter than one temporal patch"):
        F.audiovisual_chunk(model, frames[:1], pcm[:SR // 2], unit=3, **SMALL)
    six = F.synthetic_frames(2.0, 3.0, 64, 96, seed=1)  # fps 3: 2/3 s per temporal patch, 8.67 temporal ids
    with pytest.raises(F.FrontendError, match=r"^unit 5 \(audiovisual\): at fps 3 .*8\.66667 temporal ids"):
        F.audiovisual_chunk(model, six, pcm, unit=5, fps=3.0, **SMALL)
    # 3 frames fill the same 2 temporal patches: the last frame is repeated, as the processor pads.
    padded = F.audiovisual_chunk(model, frames[:3], pcm, unit=2, **SMALL)
    repeated = F.audiovisual_chunk(model, np.concatenate([frames[:3], frames[2:3]]), pcm, unit=2, **SMALL)
    np.testing.assert_array_equal(padded.embeds, repeated.embeds)


def test_bad_media_errors_name_the_unit(model):
    frames, pcm = _media(0)
    nan_pcm = pcm.copy()
    nan_pcm[100] = np.nan
    with pytest.raises(InvalidPcmError, match=r"^unit 7 \(audio\): .*non-finite"):
        F.audio_chunk(model, nan_pcm, unit=7)
    with pytest.raises(InvalidPcmError, match=r"^unit 8 \(audio\)"):
        F.audiovisual_chunk(model, frames, nan_pcm, unit=8)
    with pytest.raises(InvalidPcmError, match=r"^unit 6 \(audio\): .*needs at least 201"):
        F.audio_chunk(model, pcm[:150], unit=6)
    with pytest.raises(vp.ImageTooSmallError, match=r"^unit 9 \(image\)"):
        F.image_chunk(model, np.zeros((10, 10, 3), np.uint8), unit=9)
    with pytest.raises(ValueError, match=r"^unit 4 \(video\): video must be a \[T, H, W, 3\]"):
        F.audiovisual_chunk(model, frames[0], pcm, unit=4)
    with pytest.raises(F.FrontendError, match="unit must be a non-negative integer"):
        F.audio_chunk(model, pcm, unit=-1)
