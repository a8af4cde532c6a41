"""Qwen3-Omni vision encoder (Qwen3-VL ViT + DeepStack) against transformers' `Qwen3OmniMoeVisionEncoder`."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes  # noqa: E402
from omnijax.models.qwen3_omni import vision as V  # noqa: E402

# A 4x4 learned position grid, so every grid below is interpolated; two DeepStack levels out of three blocks.
HF_VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, in_channels=3, out_hidden_size=48, num_position_embeddings=16,
                 deepstack_visual_indexes=[0, 1])
GRIDS = {"image": [[1, 4, 6]], "video": [[2, 4, 4]], "two_images": [[1, 8, 6], [1, 2, 4]]}


def _hf_model(**overrides):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    torch.manual_seed(0)
    config = Qwen3OmniMoeVisionEncoderConfig(**{**HF_VISION, **overrides}, attn_implementation="eager")
    model = Qwen3OmniMoeVisionEncoder(config).eval()
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():  # O(1) activations: weights ~ 1/sqrt(fan_in), norms ~ 1, biases and positions small
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.2)
            elif name == "pos_embed.weight":
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5)
    return model


def _converted(model):
    config = V.Qwen3VisionConfig.from_hf(model.config)
    tensors = {"thinker.visual." + k: v.numpy() for k, v in model.state_dict().items()}
    return config, V.vision_tree(convert_in_memory(tensors, V.vision_components(config)))


@pytest.fixture(scope="module")
def hf_encoder():
    return _hf_model()


@pytest.fixture(scope="module")
def config(hf_encoder):
    return V.Qwen3VisionConfig.from_hf(hf_encoder.config)


@pytest.fixture(scope="module")
def params(hf_encoder):
    return _converted(hf_encoder)[1]


@pytest.fixture(scope="module")
def encoder(config, params):
    return V.encoder_from_params(config, params)


def _inputs(config, grid):
    grid = np.asarray(grid, np.int64)
    rng = np.random.default_rng(int(grid.sum()))
    return rng.standard_normal((int(grid.prod(axis=1).sum()), config.patch_dim)).astype(np.float32), grid


def _hf(model, rows, grid):
    with torch.no_grad():
        out = model(torch.from_numpy(rows), grid_thw=torch.from_numpy(grid))
    return out.pooler_output.numpy(), np.stack([f.numpy() for f in out.deepstack_features])


def test_config_and_parameter_tree(config, encoder):
    assert config.head_dim == 16 and config.patch_dim == 1536 and config.grid_side == 4
    assert config.deepstack_slots == (0, 1, -1) and config.hidden_act == "gelu_pytorch_tanh"
    shapes = jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(nnx.state(encoder)))
    vision, deepstack = (param_shapes(c) for c in V.vision_components(config))
    assert shapes == {**vision, "deepstack": deepstack}
    assert shapes["layers"]["qkv"] == (3, 32, 96) and shapes["pos_embed"] == (16, 32)
    assert shapes["merger"]["norm_scale"] == (32,) and shapes["deepstack"]["norm_scale"] == (2, 128)
    assert shapes["deepstack"]["fc2"] == (2, 128, 48)
    assert V.Qwen3VisionConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("name", list(GRIDS))
def test_encoder_matches_transformers(hf_encoder, config, encoder, name):
    rows, grid = _inputs(config, GRIDS[name])
    want, want_deep = _hf(hf_encoder, rows, grid)
    got, got_deep = (np.asarray(a) for a in V.encode_vision(encoder, rows, grid))
    m = int(grid.prod(axis=1).sum()) // 4
    assert got.shape == want.shape == (m, 48) and got_deep.shape == want_deep.shape == (2, m, 48)
    assert 0.3 < np.abs(want).mean() < 10 and 0.3 < np.abs(want_deep).mean() < 10  # O(1), not saturated
    assert np.abs(got - want).max() <= 1e-4
    for level in range(2):
        assert np.abs(got_deep[level] - want_deep[level]).max() <= 1e-4


def test_deepstack_levels_come_in_block_order():
    """Indexes listed out of order: merger k serves the k-th listed block; the features come out in block order."""
    model = _hf_model(deepstack_visual_indexes=[2, 0])
    config, params = _converted(model)
    assert config.deepstack_slots == (1, -1, 0)
    rows, grid = _inputs(config, GRIDS["image"])
    want, want_deep = _hf(model, rows, grid)
    got, got_deep = (np.asarray(a) for a in V.encode_vision(V.encoder_from_params(config, params), rows, grid))
    assert np.abs(got - want).max() <= 1e-4 and np.abs(got_deep - want_deep).max() <= 1e-4


def test_position_interpolation_matches_reference(hf_encoder, config):
    """The plan's bilinear rows and weights reproduce `fast_pos_embed_interpolate` (and `rot_pos_emb` positions)."""
    table = hf_encoder.pos_embed.weight.detach().numpy()
    for grid in ([[1, 4, 6]], [[2, 10, 14], [1, 2, 2]], [[1, 30, 2]]):
        plan = V.vision_plan(grid, config)
        corners = table[plan.pos_index] * plan.pos_weight[..., None]
        got = ((corners[0] + corners[1]) + corners[2]) + corners[3]
        with torch.no_grad():
            want = hf_encoder.fast_pos_embed_interpolate(torch.tensor(grid)).numpy()
        np.testing.assert_array_equal(got, want)  # same float32 operations, bit for bit
        inv_freq = 1.0 / (10000.0 ** (np.arange(0, 8, 2, dtype=np.float32) / 8))
        want_rot = hf_encoder.rot_pos_emb(torch.tensor(grid)).numpy()
        got_rot = (plan.positions[:, :, None] * inv_freq).reshape(len(plan.positions), -1)
        np.testing.assert_allclose(got_rot, want_rot, rtol=0, atol=1e-6)


def test_torch_linspace_is_bit_exact():
    for end in (1, 3, 7, 47):
        for steps in (*range(1, 130), 255, 256, 511, 1000):
            np.testing.assert_array_equal(V.torch_linspace(end, steps), torch.linspace(0, end, steps).numpy())


def test_split_form_and_bfloat16(config, params, encoder):
    rows, grid = _inputs(config, GRIDS["image"])
    want, want_deep = (np.asarray(a) for a in V.encode_vision(encoder, rows, grid))
    bf16 = V.encoder_from_params(config.replace(dtype="bfloat16"), params)
    got, got_deep = (np.asarray(a).astype(np.float32) for a in V.encode_vision(nnx.split(bf16), rows, grid))
    assert np.isfinite(got).all() and np.isfinite(got_deep).all()
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert np.abs(got_deep - want_deep).max() <= 0.05 * np.abs(want_deep).max()


def test_bad_grids_and_shapes_are_refused(config, params, encoder):
    rows, grid = _inputs(config, GRIDS["image"])
    for bad in ([[1, 5, 6]], [[1, 4, 3]], [[0, 4, 4]], [1, 4, 4], np.array([[1.0, 4, 4]])):
        with pytest.raises(ValueError, match="grid_thw"):
            V.vision_plan(bad, config)
    with pytest.raises(ValueError, match="spatial_merge_size 2"):
        V.encode_vision(encoder, rows, np.array([[1, 3, 8]]))
    with pytest.raises(ValueError, match="pixel_values"):
        V.encode_vision(encoder, rows[:-4], grid)
    with pytest.raises(ValueError, match="deepstack/fc1"):
        V.encoder_from_params(config, {**params, "deepstack": {**params["deepstack"], "fc1": np.zeros((3, 128, 128))}})
    with pytest.raises(ValueError, match="lack pos_embed"):
        V.encoder_from_params(config, {k: v for k, v in params.items() if k != "pos_embed"})


def test_from_hf_refuses_what_it_does_not_implement():
    release = dict(HF_VISION, hidden_act="gelu_pytorch_tanh", apply_vit_abs_pos_embed=True, image_size=64,
                   in_chans=3, spatial_patch_size=16, tokens_per_second=2, model_type="qwen3_omni_moe_vision_encoder",
                   torch_dtype="bfloat16", initializer_range=0.02, do_sample=False)
    assert V.Qwen3VisionConfig.from_hf(release, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(V.UnsupportedVisionConfigError, match="window_size") as err:
        V.Qwen3VisionConfig.from_hf(dict(release, window_size=112))
    assert isinstance(err.value, ValueError) and err.value.attribute == "vision_config.window_size"
    assert "not understood" in str(err.value)
    for change, attribute in ((dict(hidden_act="quick_gelu"), "hidden_act"),
                              (dict(apply_vit_abs_pos_embed=False), "apply_vit_abs_pos_embed"),
                              (dict(image_size=80), "image_size"),
                              (dict(model_type="qwen3_vl"), "model_type")):
        with pytest.raises(V.UnsupportedVisionConfigError, match=attribute):
            V.Qwen3VisionConfig.from_hf(dict(release, **change))
    for change, attribute in ((dict(deepstack_visual_indexes=[0, 3]), "deepstack_visual_indexes"),
                              (dict(deepstack_visual_indexes=[1, 1]), "deepstack_visual_indexes"),
                              (dict(num_heads=3), "num_heads")):
        with pytest.raises(V.Qwen3VisionConfigError, match=attribute):
            V.Qwen3VisionConfig.from_hf(dict(release, **change))
    with pytest.raises(ValueError, match="unknown Qwen3VisionConfig fields"):
        V.Qwen3VisionConfig.from_json({"depth": 1, "typo": 0})
