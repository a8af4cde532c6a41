"""Vision preprocessing and encoder against transformers' Qwen2-VL processors and Qwen2.5-Omni vision encoder."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes  # noqa: E402
from omnijax.models.encoders import qwen_vl_preprocess as vp  # noqa: E402
from omnijax.models.qwen2_5_omni import vision as V  # noqa: E402
from tests._support import video_golden  # noqa: E402

HF_VISION = dict(hidden_size=32, depth=2, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
                 temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], out_hidden_size=64)


def _rgb(rng, *shape):
    return rng.integers(0, 256, (*shape, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="module")
def image_processor():
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor()


def _hf_frames(processor, frames, *, resize, min_pixels, max_pixels):
    """The image processor's per-video path (rescale, normalise, temporal padding, patch order) on `frames`."""
    rows, grid = processor._preprocess(
        list(frames), do_resize=resize, size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        resample=processor.resample, do_rescale=True, rescale_factor=processor.rescale_factor, do_normalize=True,
        image_mean=processor.image_mean, image_std=processor.image_std, patch_size=14, temporal_patch_size=2,
        merge_size=2, do_convert_rgb=True)
    return rows, np.asarray([grid])


# ------------------------------------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize("kwargs", [{}, {"min_pixels": 4 * 28 * 28, "max_pixels": 20 * 28 * 28}])
def test_images_match_image_processor(image_processor, rng, kwargs):
    images = [_rgb(rng, 100, 73), _rgb(rng, 300, 200), _rgb(rng, 14, 40)]
    want = image_processor(images=images, return_tensors="np", **kwargs)
    rows, grid = vp.preprocess_images(images, **kwargs)
    np.testing.assert_array_equal(grid, want["image_grid_thw"])
    assert rows.dtype == np.float32 and rows.shape == want["pixel_values"].shape
    assert np.abs(rows - want["pixel_values"]).max() <= 1e-5


def test_single_image_and_float_input(image_processor, rng):
    image = _rgb(rng, 100, 73)
    rows, grid = vp.preprocess_images(image)
    assert grid.tolist() == [[1, 8, 6]] and rows.shape == (48, 1176)
    halves = rows.reshape(48, 3, 2, 196)
    np.testing.assert_array_equal(halves[:, :, 0], halves[:, :, 1])  # the image repeated to 2 frames
    as_float, _ = vp.preprocess_images(image.astype(np.float32) / 255.0)
    np.testing.assert_array_equal(as_float, rows)


def test_torch_resize_is_bit_exact(rng):
    for h, w, oh, ow in [(100, 73, 112, 84), (300, 200, 84, 56), (17, 500, 28, 476), (97, 131, 196, 252),
                         (480, 640, 336, 448), (100, 150, 100, 168)]:
        frames = _rgb(rng, 2, h, w)
        want = torch.nn.functional.interpolate(torch.from_numpy(frames).permute(0, 3, 1, 2), size=[oh, ow],
                                               mode="bicubic", antialias=True, align_corners=False)
        np.testing.assert_array_equal(vp._resize_torch(frames, oh, ow), want.permute(0, 2, 3, 1).numpy())


@pytest.mark.parametrize("frames", [4, 3])
def test_video_matches_video_processor_pipeline(image_processor, rng, frames):
    """Default ("torch") resize: torch's uint8 antialiased bicubic, which torchvision's resize runs for uint8 on CPU
    inside `Qwen2VLVideoProcessor`; the rest of the pipeline is the processor's (shared with the image processor)."""
    video = _rgb(rng, frames, 90, 120)
    rows, grid = vp.preprocess_video(video)
    h, w = vp.smart_resize(90, 120, 28, vp.VIDEO_MIN_PIXELS, vp.VIDEO_MAX_PIXELS)
    resized = torch.nn.functional.interpolate(torch.from_numpy(video).permute(0, 3, 1, 2), size=[h, w],
                                              mode="bicubic", antialias=True, align_corners=False)
    want, want_grid = _hf_frames(image_processor, resized.permute(0, 2, 3, 1).numpy(), resize=False,
                                 min_pixels=vp.VIDEO_MIN_PIXELS, max_pixels=vp.VIDEO_MAX_PIXELS)
    np.testing.assert_array_equal(grid, want_grid)
    assert grid[0, 0] == 2 and rows.shape == want.shape and np.abs(rows - want).max() <= 1e-5


@pytest.mark.parametrize("frames", [4, 3])
def test_video_pil_resize_matches_image_processor(image_processor, rng, frames):
    video = _rgb(rng, frames, 100, 73)
    rows, grid = vp.preprocess_video(list(video), min_pixels=56 * 56, max_pixels=28 * 28 * 1280, resize_impl="pil")
    want, want_grid = _hf_frames(image_processor, video, resize=True, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    np.testing.assert_array_equal(grid, want_grid)
    assert np.abs(rows - want).max() <= 1e-5


def test_video_matches_transformers_video_processor():
    """`Qwen2VLVideoProcessor()` itself (torchvision's resize), recorded by tests/_support/data/video_processor/make.py
    in a second environment: default and explicit pixel bounds, 4, 3, 5 and 2 frames, upscaled and shrunk frames."""
    cases, info = video_golden.load("qwen2_5_omni")
    settings = info["processors"]["qwen2_5_omni"]["settings"]
    assert settings["size"] == {"shortest_edge": vp.VIDEO_MIN_PIXELS, "longest_edge": vp.VIDEO_MAX_PIXELS}
    assert (settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"]) == (
        vp.PATCH_SIZE, vp.MERGE_SIZE, vp.TEMPORAL_PATCH_SIZE)
    np.testing.assert_array_equal(settings["image_mean"], vp.CLIP_MEAN)
    np.testing.assert_array_equal(settings["image_std"], vp.CLIP_STD)
    assert len(cases) == 4 and {g.case.frames for g in cases} == {4, 3, 5, 2}
    for golden in cases:
        rows, grid = vp.preprocess_video(golden.video, **golden.case.size_kwargs())
        np.testing.assert_array_equal(grid, golden.video_grid_thw, err_msg=golden.case.name)
        assert rows.dtype == np.float32 and rows.shape == golden.pixel_values_videos.shape, golden.case.name
        err = float(np.abs(rows - golden.pixel_values_videos).max())
        assert err <= 1e-5, (golden.case.name, err)


@pytest.mark.parametrize("call, error", [
    (lambda r: vp.preprocess_images(_rgb(r, 10, 100)), vp.ImageTooSmallError),
    (lambda r: vp.preprocess_images(_rgb(r, 14, 14), min_pixels=0), vp.ImageTooSmallError),
    (lambda r: vp.preprocess_images(r.integers(0, 256, (50, 50, 4), dtype=np.uint8)), vp.ChannelError),
    (lambda r: vp.preprocess_images(r.integers(0, 256, (50, 50), dtype=np.uint8)), vp.ChannelError),
    (lambda r: vp.preprocess_images(_rgb(r, 50, 50).astype(np.int32)), vp.PixelDtypeError),
    (lambda r: vp.preprocess_images(np.full((50, 50, 3), 2.0, np.float32)), vp.PixelDtypeError),
    (lambda r: vp.preprocess_images(np.where(np.eye(50)[..., None] > 0, np.nan, np.full((50, 50, 3), 0.5))),
     vp.NonFinitePixelError),
    (lambda r: vp.preprocess_video(np.full((2, 50, 50, 3), np.inf)), vp.NonFinitePixelError),
    (lambda r: vp.preprocess_images(_rgb(r, 14, 3000)), vp.AspectRatioError),
    (lambda r: vp.preprocess_images([]), vp.EmptyVideoError),
    (lambda r: vp.preprocess_video(np.zeros((0, 50, 50, 3), np.uint8)), vp.EmptyVideoError),
    (lambda r: vp.preprocess_video([]), vp.EmptyVideoError),
    (lambda r: vp.preprocess_video([_rgb(r, 50, 50), _rgb(r, 50, 60)]), vp.ChannelError),
    (lambda r: vp.preprocess_video(_rgb(r, 50, 50)), vp.ChannelError),
])
def test_bad_inputs_raise(rng, call, error):
    with pytest.raises(error):
        call(rng)
    assert issubclass(error, ValueError)


# ---------------------------------------------------------------------------------------------------- encoder


@pytest.fixture(scope="module")
def hf_encoder():
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    torch.manual_seed(0)
    model = Qwen2_5OmniVisionEncoder(Qwen2_5OmniVisionEncoderConfig(**HF_VISION)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def config(hf_encoder):
    return V.VisionConfig.from_hf(hf_encoder.config.to_dict())


@pytest.fixture(scope="module")
def params(hf_encoder, config):
    tensors = {"thinker.visual." + k: v.numpy() for k, v in hf_encoder.state_dict().items()}
    return convert_in_memory(tensors, [V.vision_component(config)])["vision"]


@pytest.fixture(scope="module")
def encoder(config, params):
    return V.encoder_from_params(config, params)


@pytest.fixture(scope="module")
def inputs(rng):
    image = vp.preprocess_images(_rgb(rng, 300, 200))  # grid (1, 22, 14): 11x7 tokens, not a multiple of 4x4
    video = vp.preprocess_video(_rgb(rng, 4, 100, 150), min_pixels=56 * 56)  # grid (2, 8, 10)
    both = tuple(np.concatenate(parts) for parts in zip(image, video))
    return {"image": image, "video": video, "both": both}


def _hf(model, rows, grid):
    with torch.no_grad():
        return model(torch.from_numpy(rows), grid_thw=torch.from_numpy(grid)).pooler_output.numpy()


def test_config_and_parameter_tree(config, encoder):
    assert config.full_attention == (False, True) and config.head_dim == 16 and config.patch_dim == 1176
    shapes = jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(nnx.state(encoder)))
    assert shapes == param_shapes(V.vision_component(config))
    assert shapes["patch_embed"] == (1176, 32) and shapes["merger"]["fc1"] == (128, 128)
    assert V.VisionConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("name", ["image", "video", "both"])
def test_encoder_matches_transformers(hf_encoder, encoder, inputs, name):
    rows, grid = inputs[name]
    want = _hf(hf_encoder, rows, grid)
    got = np.asarray(V.encode_vision(encoder, rows, grid))
    assert got.shape == want.shape == (int(grid.prod(axis=1).sum()) // 4, 64)
    assert np.abs(got - want).max() <= 1e-4


def test_split_form_and_bfloat16(hf_encoder, config, params, inputs):
    rows, grid = inputs["image"]
    want = _hf(hf_encoder, rows, grid)
    bf16 = V.encoder_from_params(config.replace(dtype="bfloat16"), params)
    got = np.asarray(V.encode_vision(nnx.split(bf16), rows, grid)).astype(np.float32)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_vision_plan_inverts_window_order(config, inputs):
    plan = V.vision_plan(inputs["both"][1], config)
    window_index = plan.patch_order[::4] // 4
    np.testing.assert_array_equal(window_index[plan.reverse_index], np.arange(window_index.size))
    for segments, inverse in ((plan.window_segments, plan.window_inverse), (plan.frame_segments, plan.frame_inverse)):
        np.testing.assert_array_equal(segments.reshape(-1)[inverse], np.arange(plan.patch_order.size))
    assert plan.window_segments.shape[1] == 64 and plan.frame_segments.shape == (3, 308)


def test_encoder_rejects_bad_shapes(config, params, encoder, inputs):
    with pytest.raises(ValueError, match="merger/fc2"):
        V.encoder_from_params(config, {**params, "merger": {**params["merger"], "fc2": np.zeros((128, 3))}})
    with pytest.raises(ValueError, match="lack patch_embed"):
        V.encoder_from_params(config, {k: v for k, v in params.items() if k != "patch_embed"})
    rows, grid = inputs["image"]
    with pytest.raises(ValueError, match="pixel_values"):
        V.encode_vision(encoder, rows[:-4], grid)
    with pytest.raises(ValueError, match="grid_thw"):
        V.encode_vision(encoder, rows, np.array([[1, 21, 14]]))


def test_from_hf_refuses_math_changes_and_ignores_bookkeeping():
    release = dict(HF_VISION, hidden_act="silu", in_chans=3, embed_dim=32, spatial_patch_size=14, tokens_per_second=25,
                   model_type="qwen2_5_omni_vision_encoder", torch_dtype="bfloat16", initializer_range=0.02)
    assert V.VisionConfig.from_hf(release, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(V.UnsupportedVisionConfigError, match="hidden_act") as err:
        V.VisionConfig.from_hf(dict(release, hidden_act="gelu"))
    assert isinstance(err.value, ValueError) and err.value.attribute == "vision_config.hidden_act"
    with pytest.raises(ValueError, match="qk_norm"):
        V.VisionConfig.from_hf(dict(release, qk_norm=True))
    with pytest.raises(V.VisionConfigError, match="window_size"):
        V.VisionConfig.from_hf(dict(release, window_size=100))
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        V.VisionConfig.from_hf(dict(release, fullatt_block_indexes=[2]))
    with pytest.raises(ValueError, match="unknown VisionConfig fields"):
        V.VisionConfig.from_json({"depth": 1, "typo": 0})
