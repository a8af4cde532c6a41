"""Qwen3-Omni audio encoder (AuT) against transformers' `Qwen3OmniMoeAudioEncoder`, with windowed attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes
from omnijax.errors import MissingTensorError
from omnijax.models.qwen3_omni import audio as audio_lib
from omnijax.models.qwen3_omni.audio import (
    QWEN3_OMNI_30B_A3B_AUDIO,
    FeatureShapeError,
    Qwen3AudioConfig,
    Qwen3AudioConfigError,
    Qwen3AudioEncoder,
    UnsupportedAudioConfigError,
    audio_component,
    audio_token_count,
    encode_audio,
    encoder_from_params,
    plan_audio,
)

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig  # noqa: E402
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeAudioEncoder,
    _get_feat_extract_output_lengths,
)

# A window is n_window_infer // (2 * n_window) = 2 chunks = 200 frames = 26 tokens.
HF_AUDIO = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                downsample_hidden_size=8, output_dim=48, n_window=50, n_window_infer=200)
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_encoder():
    torch.manual_seed(0)
    model = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**HF_AUDIO))
    model.set_attn_implementation("eager")
    model.eval()
    with torch.no_grad():  # larger weights than the default init, so that mistakes show
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def config(hf_encoder):
    return Qwen3AudioConfig.from_hf(hf_encoder.config.to_dict())


@pytest.fixture(scope="module")
def params(config, hf_encoder):
    tensors = {"thinker.audio_tower." + k: v.numpy() for k, v in hf_encoder.state_dict().items()}
    return convert_in_memory(tensors, [audio_component(config)])["audio"]


@pytest.fixture(scope="module")
def encoder(config, params):
    return encoder_from_params(config, params)


def features(frames: int, mel: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + frames).standard_normal((mel, frames)).astype(np.float32)


def hf_full(model, feats: np.ndarray) -> np.ndarray:
    """transformers' eager forward: attention across the whole clip."""
    with torch.no_grad():
        out = model(torch.from_numpy(feats), feature_lens=torch.tensor([feats.shape[1]]))
    return out.last_hidden_state.numpy()


def hf_windowed(model, feats: np.ndarray) -> tuple[np.ndarray, list]:
    """Windowed oracle: the reference forward, with each layer given the block-diagonal mask the reference itself
    builds from its `cu_seqlens` (`_prepare_attention_mask`), which its eager path otherwise never passes.

    Returns:
        the output and the `cu_seqlens` the reference computed.
    """
    seen = []

    def add_mask(layer, args, kwargs):
        hidden, cu_seqlens = args[0], args[1]
        seen.append(cu_seqlens.tolist())
        return args, {**kwargs, "attention_mask": model._prepare_attention_mask(hidden, cu_seqlens)}

    hooks = [layer.register_forward_pre_hook(add_mask, with_kwargs=True) for layer in model.layers]
    try:
        out = hf_full(model, feats)
    finally:
        for hook in hooks:
            hook.remove()
    return out, seen[0]


# ------------------------------------------------------------------------------------------------- conversion


def test_table_fills_the_module_tree(config, params):
    ref = jax.tree_util.tree_map(lambda x: tuple(x.shape),
                                 nnx.to_pure_dict(nnx.state(Qwen3AudioEncoder(config, rngs=nnx.Rngs(0)))))
    assert param_shapes(audio_component(config)) == ref
    assert jax.tree_util.tree_map(np.shape, params) == ref


def test_table_reports_missing_tensors(config, hf_encoder):
    tensors = {"thinker.audio_tower." + k: v.numpy() for k, v in hf_encoder.state_dict().items()
               if k != "conv2d2.weight"}
    with pytest.raises(MissingTensorError, match="conv2d2.weight"):
        convert_in_memory(tensors, [audio_component(config)])


# --------------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("frames", [1, 37, 100, 137, 200])
def test_within_one_window_matches_eager_reference(hf_encoder, encoder, frames):
    feats = features(frames)
    ref = hf_full(hf_encoder, feats)
    out = np.asarray(encode_audio(encoder, feats))
    assert out.shape == ref.shape == (audio_token_count(frames), 48)
    assert 0.3 < np.abs(ref).mean() < 3.0  # O(1) outputs, so the tolerance means something
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("frames", [230, 530, 1000])
def test_long_clips_match_the_windowed_oracle(config, hf_encoder, encoder, frames):
    feats = features(frames)
    ref, cu_seqlens = hf_windowed(hf_encoder, feats)
    assert tuple(cu_seqlens) == plan_audio(config, frames).cu_seqlens
    out = np.asarray(encode_audio(encoder, feats))
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    full = hf_full(hf_encoder, feats)  # transformers' eager path ignores the windows
    assert np.abs(full - out).max() > 1e-2


def test_windowed_oracle_equals_encoding_each_window_alone(hf_encoder):
    """Cross-check of the mask oracle: for 530 frames every window holds whole 100-frame chunks, or ends with the
    clip's short chunk after a full one (so it is padded to 100 frames either way); encoding each window's frames
    on its own with plain eager attention must then give the same tokens."""
    feats = features(530)
    ref, _ = hf_windowed(hf_encoder, feats)
    pieces = [hf_full(hf_encoder, np.ascontiguousarray(feats[:, s:s + 200])) for s in range(0, 530, 200)]
    np.testing.assert_allclose(np.concatenate(pieces), ref, atol=1e-5, rtol=0)


def test_bucket_and_no_bucket_agree(encoder):
    feats = features(530)
    np.testing.assert_allclose(np.asarray(encode_audio(encoder, feats, bucket=False)),
                               np.asarray(encode_audio(encoder, feats)), atol=1e-5, rtol=0)


def test_one_compile_per_bucket_and_one_scan(encoder):
    encode_audio(encoder, features(137))
    compiled = audio_lib._encode_chunks._cache_size()
    encode_audio(encoder, features(181))  # also two chunks
    assert audio_lib._encode_chunks._cache_size() == compiled
    plan = plan_audio(encoder.config, 530)
    assert (plan.padded_chunks, plan.window_chunks) == (8, 2)
    graphdef, state = nnx.split(encoder)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).encode_chunks(
        jnp.zeros((8, 16, 100)), jnp.asarray(plan.conv_frames), jnp.asarray(plan.token_valid)))(state)
    assert str(jaxpr).count("scan[") == 1


def test_bfloat16_runs_close(config, params, encoder):
    feats = features(530)
    ref = np.asarray(encode_audio(encoder, feats))
    out = encode_audio(encoder_from_params(config.replace(dtype="bfloat16"), params), feats)
    assert out.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out, np.float32) - ref).max() < 0.1 * np.abs(ref).max()


# ------------------------------------------------------------------------------------------------ token counts


def test_token_counts_match_reference_formula():
    frames = np.arange(0, 2001)
    ref = _get_feat_extract_output_lengths(torch.from_numpy(frames)).numpy()
    assert [audio_token_count(int(n)) for n in frames] == ref.tolist()


@pytest.mark.parametrize("frames", [1, 99, 100, 101, 250, 1000])
def test_encoder_output_length(encoder, frames):
    expected = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    assert plan_audio(encoder.config, frames).tokens == expected
    assert encode_audio(encoder, features(frames)).shape == (expected, 48)


def test_plan_layout(config):
    plan = plan_audio(config, 37)  # a single short chunk: the reference pads it to its own length
    assert (plan.num_chunks, plan.padded_chunks, plan.tokens) == (1, 1, 5)
    assert plan.conv_frames.tolist() == [37]
    plan = plan_audio(config, 530)  # 6 chunks -> a bucket of 8; the short last chunk is padded to 100 frames
    assert plan.conv_frames.tolist() == [100] * 6 + [0, 0]
    assert plan.token_valid.sum(axis=1).tolist() == [13] * 5 + [4, 0, 0]
    assert plan.window_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plan.cu_seqlens == (0, 26, 52, 69)


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_features_are_refused(encoder):
    with pytest.raises(FeatureShapeError, match="0 frames"):
        encode_audio(encoder, np.zeros((16, 0), np.float32))
    with pytest.raises(FeatureShapeError, match="20 mel bins but the encoder expects 16"):
        encode_audio(encoder, np.zeros((20, 100), np.float32))
    with pytest.raises(FeatureShapeError, match="transposed"):
        encode_audio(encoder, np.zeros((100, 16), np.float32))
    with pytest.raises(FeatureShapeError, match=r"\[num_mel_bins, frames\]"):
        encode_audio(encoder, np.zeros((1, 16, 100), np.float32))
    bad = features(50)
    bad[3, 7] = np.nan
    with pytest.raises(FeatureShapeError, match="NaN"):
        encode_audio(encoder, bad)


# Qwen3-Omni-30B-A3B's `thinker_config.audio_config` as published (saved by transformers).
REAL_AUDIO_CONFIG = {
    "_name_or_path": "", "activation_dropout": 0, "activation_function": "gelu", "add_cross_attention": False,
    "architectures": None, "attention_dropout": 0, "bos_token_id": None, "chunk_size_feed_forward": 0,
    "conv_chunksize": 500, "cross_attention_hidden_size": None, "d_model": 1280, "decoder_start_token_id": None,
    "downsample_hidden_size": 480, "dropout": 0, "dtype": None, "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120, "encoder_layers": 32, "eos_token_id": None, "finetuning_task": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_range": 0.02, "is_decoder": False,
    "is_encoder_decoder": False, "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "max_source_positions": 1500,
    "model_type": "qwen3_omni_moe_audio_encoder", "n_window": 50, "n_window_infer": 800, "num_mel_bins": 128,
    "output_attentions": False, "output_dim": 2048, "output_hidden_states": False, "pad_token_id": None,
    "prefix": None, "problem_type": None, "pruned_heads": {}, "return_dict": True, "scale_embedding": False,
    "sep_token_id": None, "task_specific_params": None, "tf_legacy_loss": False, "tie_encoder_decoder": False,
    "tie_word_embeddings": True, "tokenizer_class": None, "torchscript": False, "use_bfloat16": False,
}


def test_from_hf_reads_the_published_config():
    config = Qwen3AudioConfig.from_hf(REAL_AUDIO_CONFIG)
    assert config == QWEN3_OMNI_30B_A3B_AUDIO
    assert (config.window_chunks, config.tokens_per_chunk, config.conv_out_features) == (8, 13, 7680)
    assert Qwen3AudioConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("change, match", [
    ({"rope_theta": 1.0}, "audio_config.rope_theta"),
    ({"n_window": 100}, "n_window"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"scale_embedding": True}, "scale_embedding"),
    ({"num_hidden_layers": 3}, "num_hidden_layers"),
    ({"model_type": "qwen2_5_omni_audio_encoder"}, "model_type"),
])
def test_from_hf_refuses_what_it_does_not_implement(change, match):
    with pytest.raises(UnsupportedAudioConfigError, match=match):
        Qwen3AudioConfig.from_hf({**REAL_AUDIO_CONFIG, **change})


@pytest.mark.parametrize("change, match", [
    ({"n_window_infer": 50}, "n_window_infer"),
    ({"d_model": 30}, "encoder_attention_heads"),
    ({"max_source_positions": 12}, "max_source_positions"),
    ({"dtype": "float16"}, "dtype"),
])
def test_inconsistent_config_refused(change, match):
    with pytest.raises(Qwen3AudioConfigError, match=match):
        QWEN3_OMNI_30B_A3B_AUDIO.replace(**change)
