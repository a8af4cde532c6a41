"""Qwen2.5-Omni audio path: log-mel features and the audio tower against transformers."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes
from omnijax.errors import UnexpectedTensorError
from omnijax.models.encoders import whisper as audio_lib
from omnijax.models.encoders.log_mel import mel_filters, num_frames
from omnijax.models.encoders.whisper import (
    AudioConfig,
    AudioEncoder,
    AudioInputError,
    FeatureShapeError,
    InvalidPcmError,
    UnsupportedAudioConfigError,
    UnsupportedSampleRateError,
    audio_component,
    audio_token_count,
    encode_audio,
    encoder_from_params,
    log_mel,
)

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

SR = 16000
HF_AUDIO = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, n_window=100,
                output_dim=64, num_mel_bins=128)
SKIP = ("audio_tower.audio_bos_eos_token",)


def tone_and_noise(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(round(seconds * SR))
    t = np.arange(n) / SR
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(2 * np.pi * 440.0 * t) + 0.1 * np.sin(2 * np.pi * 3100.0 * t) + 0.05 * rng.standard_normal(n)
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def feature_extractor():
    return transformers.WhisperFeatureExtractor(feature_size=128)


def processor_features(fe, pcm):
    """What `Qwen2_5OmniProcessor` hands the thinker: padded features and the valid-frame mask."""
    out = fe(pcm, sampling_rate=SR, padding="max_length", return_attention_mask=True, return_tensors="pt")
    return out["input_features"], out["attention_mask"]


@pytest.fixture(scope="module")
def hf_encoder():
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    torch.manual_seed(0)
    model = Qwen2_5OmniAudioEncoder(Qwen2_5OmniAudioEncoderConfig(**HF_AUDIO)).eval()
    with torch.no_grad():  # larger weights than the default init, so that mistakes show
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def hf_tensors(hf_encoder):
    return {"thinker.audio_tower." + k: v.numpy() for k, v in hf_encoder.state_dict().items()}


@pytest.fixture(scope="module")
def config(hf_encoder):
    return AudioConfig.from_hf(hf_encoder.config.to_dict())


@pytest.fixture(scope="module")
def params(config, hf_tensors):
    return convert_in_memory(hf_tensors, [audio_component(config)], skip_prefixes=SKIP)["audio"]


@pytest.fixture(scope="module")
def encoder(config, params):
    return encoder_from_params(config, params)


def hf_encode(hf_encoder, features: np.ndarray) -> np.ndarray:
    """The tower called as the thinker calls it for one clip (`feature_lens`, `aftercnn_lens`)."""
    lens = torch.tensor([features.shape[1]])
    after_cnn, _ = hf_encoder._get_feat_extract_output_lengths(lens)
    with torch.no_grad():
        out = hf_encoder(torch.from_numpy(features), feature_lens=lens, aftercnn_lens=after_cnn)
        return out.last_hidden_state.numpy()


# ---------------------------------------------------------------------------------------------------- features


def test_mel_filters_match_whisper(feature_extractor):
    np.testing.assert_allclose(mel_filters(128), feature_extractor.mel_filters, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seconds", [0.5, 2.0, 3.3, 7.0, 1.2345])
def test_log_mel_matches_processor(feature_extractor, seconds):
    pcm = tone_and_noise(seconds, seed=int(seconds * 10))
    ref, mask = processor_features(feature_extractor, pcm)
    valid = int(mask.sum())
    ours = log_mel(pcm)
    assert ours.dtype == np.float32
    assert ours.shape == (128, valid) == (128, num_frames(pcm.size))
    np.testing.assert_allclose(ours, ref[0, :, :valid].numpy(), rtol=0, atol=1e-4)


def test_log_mel_loud_end_and_tiny_clips(feature_extractor):
    """The clamp's maximum includes frames past the last valid one; clips shorter than one window work."""
    for n in (1, 150, 399, 8001):
        pcm = np.full(n, 1e-4, np.float32)
        pcm[-3:] = 0.9
        ref, mask = processor_features(feature_extractor, pcm)
        valid = int(mask.sum())
        np.testing.assert_allclose(log_mel(pcm), ref[0, :, :valid].numpy(), rtol=0, atol=1e-4)


def test_num_frames():
    assert [num_frames(n) for n in (1, 159, 160, 161, 16000, 16001)] == [1, 1, 1, 2, 100, 101]


# ---------------------------------------------------------------------------------------------------- encoder


@pytest.mark.parametrize("frames", [200, 400, 50, 330, 701])
def test_encoder_matches_transformers(hf_encoder, encoder, frames):
    feats = np.random.default_rng(frames).standard_normal((128, frames)).astype(np.float32)
    want = hf_encode(hf_encoder, feats)
    got = np.asarray(encode_audio(encoder, feats))
    assert got.shape == want.shape == (audio_token_count(frames), 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("seconds", [4.0, 3.3])
def test_pcm_to_tokens_matches_thinker(feature_extractor, hf_encoder, encoder, seconds):
    """Processor features + `Thinker.get_audio_features` against `log_mel` + `encode_audio`."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    pcm = tone_and_noise(seconds, seed=3)
    feats, mask = processor_features(feature_extractor, pcm)
    thinker = types.SimpleNamespace(audio_tower=hf_encoder, config=types.SimpleNamespace(return_dict=True))
    with torch.no_grad():
        want = Qwen2_5OmniThinkerForConditionalGeneration.get_audio_features(
            thinker, feats, feature_attention_mask=mask).last_hidden_state.numpy()
    got = np.asarray(encode_audio(encoder, log_mel(pcm)))
    assert got.shape == want.shape == (int(seconds * 25), 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_token_count(hf_encoder):
    assert all(audio_token_count(100 * s) == 25 * s for s in range(1, 121))
    frames = np.arange(0, 2001)
    _, want = hf_encoder._get_feat_extract_output_lengths(torch.from_numpy(frames))
    assert [audio_token_count(int(t)) for t in frames[1:]] == want.numpy()[1:].tolist()
    assert audio_token_count(0) == 0
    with pytest.raises(ValueError, match="non-negative"):
        audio_token_count(-1)


def test_buckets_share_compiles(encoder):
    """Lengths within one power-of-two chunk bucket reuse one compile; unbucketed padding gives the same tokens."""
    feats = np.random.default_rng(7).standard_normal((128, 780)).astype(np.float32)
    encode_audio(encoder, feats[:, :610])
    before = audio_lib._encode_chunks._cache_size()
    out = {t: np.asarray(encode_audio(encoder, feats[:, :t])) for t in (620, 700, 780)}
    assert audio_lib._encode_chunks._cache_size() == before
    np.testing.assert_allclose(out[700], np.asarray(encode_audio(encoder, feats[:, :700], bucket=False)), atol=1e-5)
    # Tokens of complete 2 s chunks do not depend on later audio (attention stays inside a chunk).
    np.testing.assert_allclose(out[620][:150], out[780][:150], atol=1e-5)


def test_split_entry_matches_module(encoder):
    feats = np.random.default_rng(1).standard_normal((128, 130)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(encode_audio(nnx.split(encoder), feats)),
                                  np.asarray(encode_audio(encoder, feats)))


def test_bfloat16_close_to_float32(config, params, encoder):
    feats = log_mel(tone_and_noise(2.5, seed=5))
    want = np.asarray(encode_audio(encoder, feats))
    bf16 = encoder_from_params(config.replace(dtype="bfloat16"), params)
    got = encode_audio(bf16, feats)
    assert got.dtype == jax.numpy.bfloat16 and got.shape == want.shape
    err = np.abs(np.asarray(got, np.float32) - want).max()
    assert err < 0.05 * np.abs(want).max(), err


# ---------------------------------------------------------------------------------------------------- conversion


def test_conversion_table(config, params, hf_tensors):
    want = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: AudioEncoder(config))))
    shapes = jax.tree.map(lambda a: tuple(a.shape), want)
    assert param_shapes(audio_component(config)) == shapes
    assert jax.tree.map(np.shape, params) == shapes
    np.testing.assert_array_equal(params["layers"]["k_proj"][1],
                                  hf_tensors["thinker.audio_tower.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(params["conv2_kernel"],
                                  hf_tensors["thinker.audio_tower.conv2.weight"].transpose(2, 1, 0))
    assert [SKIP[0] + ".weight"] == ["audio_tower." + n for n in audio_lib.UNUSED_HF_TENSORS]
    with pytest.raises(UnexpectedTensorError, match="audio_bos_eos_token"):
        convert_in_memory(hf_tensors, [audio_component(config)])


# ---------------------------------------------------------------------------------------------------- config


def test_config_from_hf_and_json(hf_encoder, config):
    assert (config.d_model, config.encoder_layers, config.encoder_attention_heads, config.encoder_ffn_dim,
            config.n_window, config.output_dim, config.num_mel_bins, config.max_source_positions) == (
        32, 2, 2, 64, 100, 64, 128, 1500)
    assert AudioConfig.from_json(config.to_json()) == config
    assert AudioConfig.from_hf(hf_encoder.config) == config  # config objects work too
    harmless = dict(HF_AUDIO, dropout=0.1, attention_dropout=0.2, activation_dropout=0.3, initializer_range=1.0)
    assert AudioConfig.from_hf(harmless) == config
    assert AudioConfig.from_hf({}) == audio_lib.QWEN2_5_OMNI_7B_AUDIO  # Hugging Face defaults
    assert AudioConfig.from_hf(HF_AUDIO, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown AudioConfig fields"):
        AudioConfig.from_json(dict(config.to_json(), window=3))


@pytest.mark.parametrize("attribute, value", [
    ("activation_function", "relu"), ("scale_embedding", True), ("model_type", "qwen3_omni_moe_audio_encoder"),
    ("num_hidden_layers", 3)])
def test_config_refuses_math_changes(attribute, value):
    with pytest.raises(UnsupportedAudioConfigError, match=f"audio_config.{attribute}") as info:
        AudioConfig.from_hf(dict(HF_AUDIO, **{attribute: value}))
    assert isinstance(info.value, ValueError) and info.value.attribute == f"audio_config.{attribute}"


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of encoder_attention_heads"):
        AudioConfig(d_model=30, encoder_attention_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        AudioConfig(dtype="float16")
    with pytest.raises(ValueError, match="n_window"):
        AudioConfig(n_window=2000)


# ---------------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("pcm, kwargs, error, message", [
    (np.zeros(1600, np.float32), dict(sample_rate=44100), UnsupportedSampleRateError, "resample to 16 kHz first"),
    (np.zeros(1600, np.float32), dict(sample_rate=8000), UnsupportedSampleRateError, "resample to 16 kHz first"),
    (np.zeros((2, 1600), np.float32), {}, InvalidPcmError, "1D.*mono"),
    (np.zeros(0, np.float32), {}, InvalidPcmError, "empty"),
    (np.array([0.0, np.nan, 0.1], np.float32), {}, InvalidPcmError, "NaN or inf.*index 1"),
    (np.array([0.0, 0.1, np.inf]), {}, InvalidPcmError, "non-finite"),
    (np.zeros(1600, np.int16), {}, InvalidPcmError, "int16"),
    (np.zeros(1600, np.float32), dict(num_mel_bins=0), ValueError, "num_mel_bins"),
])
def test_log_mel_rejects(pcm, kwargs, error, message):
    with pytest.raises(error, match=message):
        log_mel(pcm, **kwargs)


@pytest.mark.parametrize("features, message", [
    (np.zeros((80, 300), np.float32), "80 mel bins but the encoder expects 128"),
    (np.zeros((300, 128), np.float32), "transposed"),
    (np.zeros((128,), np.float32), r"\[num_mel_bins, frames\]"),
    (np.zeros((128, 2), np.float32), "at least 3"),
    (np.full((128, 10), np.nan, np.float32), "NaN or inf"),
])
def test_encode_audio_rejects(encoder, features, message):
    with pytest.raises(FeatureShapeError, match=message) as info:
        encode_audio(encoder, features)
    assert isinstance(info.value, AudioInputError) and isinstance(info.value, ValueError)
