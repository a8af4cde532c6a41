"""MiniCPM-o 4.5 vision path (image slicing, SigLIP/NaViT encoder, resampler) against the golden vectors that the
official PyTorch code produced from a tiny random checkpoint (`tests/_support/data/minicpmo45`, see its README)."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from omnijax.checkpoint.name_tables import param_shapes
from omnijax.errors import MissingTensorError, ShapeMismatchError
from omnijax.models.minicpmo import image_preprocess as ip
from omnijax.models.minicpmo import vision as V
from tests._support import DATA

GOLDEN = DATA / "minicpmo45"
CHECKPOINT = GOLDEN / "checkpoint"
TOL = 1e-5


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = float(np.abs(got.astype(np.float64) - want).max())
    assert err <= TOL, f"{what}: max abs diff {err:.3g} > {TOL}"


@pytest.fixture(scope="module")
def case2():
    return dict(np.load(GOLDEN / "case2_vision.npz"))


@pytest.fixture(scope="module")
def case2_meta():
    return json.loads((GOLDEN / "case2_vision.json").read_text())["meta"]


@pytest.fixture(scope="module")
def case4():
    return dict(np.load(GOLDEN / "case4_duplex.npz"))


@pytest.fixture(scope="module")
def hf_config():
    return json.loads((CHECKPOINT / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors():
    from safetensors.numpy import load_file

    return load_file(CHECKPOINT / "model.safetensors")


@pytest.fixture(scope="module")
def model():
    return V.load_vision(CHECKPOINT)


@pytest.fixture(scope="module")
def case2_out(model, case2):
    pv = [case2[f"pixel_values_{i}"] for i in range(3)]
    return jax.tree.map(np.asarray, V.encode_images(model, pv, case2["tgt_sizes"], return_intermediates=True))


# ------------------------------------------------------------------------------------------------ preprocessing


def test_case2_slicing_matches_processor(case2, case2_meta):
    sliced = ip.preprocess_image(case2["image_uint8"], max_slice_nums=case2_meta["max_slice_nums"])
    assert sliced.grid == tuple(case2_meta["slice_grid"]) == (2, 1)
    assert sliced.source_size == tuple(case2_meta["source_resized_wh"])
    assert sliced.slice_size == (364, 546)
    assert len(sliced.pixel_values) == case2_meta["num_images_incl_source"]
    np.testing.assert_array_equal(sliced.tgt_sizes, case2["tgt_sizes"])
    for i, pv in enumerate(sliced.pixel_values):
        assert pv.dtype == np.float32 and list(pv.shape) == case2_meta["pixel_values_shapes"][i]
        np.testing.assert_array_equal(pv, case2[f"pixel_values_{i}"])


def test_case2_patch_mask_and_position_ids(case2):
    pv = [case2[f"pixel_values_{i}"] for i in range(3)]
    rows, mask = ip.patch_rows(pv, case2["tgt_sizes"])
    np.testing.assert_array_equal(mask[:, None, :], case2["patch_attention_mask"])
    np.testing.assert_array_equal(ip.patch_attention_mask(case2["tgt_sizes"]), case2["patch_attention_mask"])
    assert rows.shape == (3, 1036, 3 * 14 * 14) and not rows[1, 39 * 26:].any()
    # Row j of a strip is patch j flattened as (channel, y, x).
    np.testing.assert_array_equal(rows[1, 5].reshape(3, 14, 14), pv[1][:, :, 5 * 14:6 * 14])
    padded = ip.pad_strips(pv)
    assert padded.shape == (3, 3, 14, 14504) and not padded[2, :, :, 14196:].any()
    np.testing.assert_array_equal(V.navit_position_ids(case2["tgt_sizes"], 70), case2["vpm_position_ids"])


@pytest.mark.parametrize("frame", [0, 1])
def test_case4_frames_without_slices(case4, frame):
    sliced = ip.preprocess_image(case4[f"frame{frame}_uint8"], max_slice_nums=1)
    assert sliced.grid is None and sliced.num_slices == 0
    np.testing.assert_array_equal(sliced.tgt_sizes, case4[f"vis{frame}_tgt_sizes"])
    np.testing.assert_array_equal(sliced.pixel_values[0], case4[f"vis{frame}_pixel_values"])


@pytest.mark.parametrize("wh, grid, source", [
    ((1344, 1344), (3, 3), (448, 448)),  # 3x3 slices + source = 10 x 64 tokens
    ((640, 480), (2, 1), (518, 392)),
    ((448, 448), None, (448, 448)),
    ((300, 300), None, (448, 448)),  # unsliced images are scaled up
    ((2000, 500), (4, 1), (896, 224)),
])
def test_grid_choice(wh, grid, source):
    assert ip.get_sliced_grid(*wh, max_slice_nums=9) == grid
    assert ip.get_sliced_grid(*wh, max_slice_nums=9, never_split=True) is None
    assert ip.find_best_resize(*wh, allow_upscale=grid is None) == source


def test_slices_cover_grid_and_many_images():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (700, 1000, 3), dtype=np.uint8)
    sliced, small = ip.preprocess_images([image, image[:50, :80]])
    cols, rows = sliced.grid
    assert sliced.num_slices == cols * rows and small.num_slices == 0
    for pv, (h, w) in zip(sliced.pixel_values, sliced.tgt_sizes):
        assert pv.shape == (3, 14, h * w * 14)
    assert all((s == sliced.tgt_sizes[1]).all() for s in sliced.tgt_sizes[1:])


def test_zero_area_image_is_rejected():
    image = np.zeros((480, 640, 3), np.uint8)
    for bad in (image[:0], image[:, :0]):
        with pytest.raises(ValueError, match=r"image has zero area"):
            ip.preprocess_image(bad)
    with pytest.raises(ip.EmptyImageError, match=r"image 1 has zero area \(0x480 px"):
        ip.preprocess_images([image, image[:, :0]])
    with pytest.raises(ip.EmptyImageError, match="no images"):
        ip.preprocess_images([])


def test_bad_pixels_are_rejected():
    with pytest.raises(ip.ImageLayoutError, match=r"\[H, W, 3\]"):
        ip.preprocess_image(np.zeros((20, 20), np.uint8))
    with pytest.raises(ip.ImageDtypeError, match="NaN"):
        ip.preprocess_image(np.full((20, 20, 3), np.nan, np.float32))
    with pytest.raises(ip.ImageDtypeError, match=r"\[0, 1\]"):
        ip.preprocess_image(np.full((20, 20, 3), 2.0, np.float32))
    with pytest.raises(ip.ImageDtypeError, match=r"\[0, 255\]"):
        ip.preprocess_image(np.full((20, 20, 3), 300, np.int32))
    with pytest.raises(ip.PixelValuesError, match="target size"):
        ip.patch_rows([np.zeros((3, 14, 14 * 5), np.float32)], np.array([[2, 3]]))


def test_float_and_pil_inputs_follow_the_reference():
    from PIL import Image

    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    as_float = image.astype(np.float32) / 255
    np.testing.assert_array_equal(ip.to_rgb_uint8(as_float), (as_float * 255).astype(np.uint8))  # truncation
    np.testing.assert_array_equal(ip.to_rgb_uint8(Image.fromarray(image).convert("RGBA")), image)


# -------------------------------------------------------------------------------------------------- encoder


def test_case2_intermediates(case2, case2_out):
    _close(case2_out["embeddings"], case2["vpm_embeddings"], "vpm_embeddings")
    _close(case2_out["layer_outputs"], case2["vpm_layer_outputs"], "vpm_layer_outputs")
    _close(case2_out["last_hidden_state"], case2["vpm_last_hidden_state"], "vpm_last_hidden_state")
    _close(case2_out["resampler_out"], case2["resampler_out"], "resampler_out")
    _close(case2_out["resampler_out"], case2["vision_embeds"], "vision_embeds")


def test_case2_from_pixels_end_to_end(model, case2):
    embeds, sliced = V.encode_image(model, case2["image_uint8"])
    assert sliced.grid == (2, 1)
    _close(embeds, case2["vision_embeds"], "vision_embeds from the uint8 image")


def test_case5_image_rows(case2_out):
    case5 = np.load(GOLDEN / "case5_chat.npz")
    rows = np.stack([case5["inputs_embeds"][0, a:b] for a, b in case5["image_bound"]])
    _close(case2_out["resampler_out"], rows, "case 5 image rows")


@pytest.mark.parametrize("frame", [0, 1])
def test_case4_frames(model, case4, frame):
    out = V.encode_images(model, [case4[f"vis{frame}_pixel_values"]], case4[f"vis{frame}_tgt_sizes"],
                          return_intermediates=True)
    _close(out["last_hidden_state"], case4[f"vis{frame}_vpm_last_hidden_state"], f"frame {frame} vpm output")
    _close(out["resampler_out"], case4[f"vis{frame}_embeds"], f"frame {frame} embeddings")


def test_padding_does_not_change_results(model, case2, case2_out):
    """A strip's embeddings do not depend on the batch's padding (one strip alone, padded further)."""
    out = V.encode_images(model, [case2["pixel_values_1"]], case2["tgt_sizes"][1:2], max_patches=1036)
    _close(out[0], case2_out["resampler_out"][1], "slice encoded alone")


# ---------------------------------------------------------------------------------------- config and weights


def test_config_from_hf(hf_config):
    config = V.VisionConfig.from_hf(hf_config)
    assert config.num_layers == 2  # num_hidden_layers 3, drop_vision_last_layer
    assert (config.hidden_size, config.embed_dim, config.resampler_heads, config.query_num) == (32, 128, 1, 64)
    assert config.num_patches_per_side == 70 and config.has_kv_proj
    assert V.VisionConfig.from_json(json.loads(config.dumps())) == config
    assert V.VisionConfig.from_hf({**hf_config, "drop_vision_last_layer": False}).num_layers == 3


def test_config_refuses_unknown_math(hf_config):
    def with_vision(**changes):
        return {**hf_config, "vision_config": {**hf_config["vision_config"], **changes}}

    with pytest.raises(V.UnsupportedVisionConfigError, match="vision_config.use_rope"):
        V.VisionConfig.from_hf(with_vision(use_rope=True))
    with pytest.raises(V.UnsupportedVisionConfigError, match="hidden_act"):
        V.VisionConfig.from_hf(with_vision(hidden_act="gelu"))
    with pytest.raises(V.UnsupportedVisionConfigError, match="insert_layer_id"):
        V.VisionConfig.from_hf({**hf_config, "insert_layer_id": 6})
    with pytest.raises(V.VisionConfigError, match="hidden_size"):
        V.VisionConfig.from_hf({k: v for k, v in hf_config.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="unknown VisionConfig fields"):
        V.VisionConfig.from_json({**V.MINICPM_O_4_5_VISION.to_json(), "rope": 1})


def test_rules_match_module(hf_config):
    config = V.VisionConfig.from_hf(hf_config)
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: V.MiniCPMVision(config))))
    shapes = jax.tree.map(lambda a: tuple(a.shape), state)
    assert shapes == {c.name: param_shapes(c) for c in V.vision_components(config)}
    # Without kv_proj (vision width = LLM width) the rule and the parameter both disappear.
    same = config.replace(embed_dim=32, resampler_heads=1)
    assert "kv_proj" not in param_shapes(V.resampler_component(same))


def test_checkpoint_missing_resampler(hf_config, tensors):
    config = V.VisionConfig.from_hf(hf_config)
    no_resampler = {k: v for k, v in tensors.items() if not k.startswith("resampler.")}
    with pytest.raises(MissingTensorError, match=r"'resampler\.query'.*and \d+ more"):
        V.vision_from_tensors(config, no_resampler)
    three_layers = V.VisionConfig.from_hf({**hf_config, "drop_vision_last_layer": False})
    with pytest.raises(MissingTensorError, match=r"vpm\.encoder\.layers\.2\."):
        V.vision_from_tensors(three_layers, tensors)
    wrong = {**tensors, "resampler.proj": np.zeros((128, 64), np.float32)}
    with pytest.raises(ShapeMismatchError, match="resampler.proj"):
        V.vision_from_tensors(config, wrong)


def test_load_vision_reports_missing_tensors(tmp_path, tensors):
    from safetensors.numpy import save_file

    shutil.copy(CHECKPOINT / "config.json", tmp_path / "config.json")
    save_file({k: v for k, v in tensors.items() if k.startswith("vpm.")}, tmp_path / "model.safetensors")
    with pytest.raises(MissingTensorError, match=r"checkpoint lacks tensor\(s\) 'resampler\.query'"):
        V.load_vision(tmp_path)
