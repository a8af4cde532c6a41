"""Qwen2.5-Omni Token2Wav against transformers 5.2.0: the BigVGAN vocoder (mel -> waveform), the DiT (one forward,
and `sample`'s ODE solve from given noise), and the whole `Qwen2_5OmniToken2WavModel` (codes -> waveform)."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes
from omnijax.errors import UnsupportedConfigError
from omnijax.models.qwen2_5_omni.bigvgan import (
    BIGVGAN_RULES_PREFIX,
    BigVGAN,
    BigVGANConfig,
    BigVGANConfigError,
    bigvgan_component,
    bigvgan_from_params,
    kaiser_sinc_filter,
    vocode,
    vocode_params,
)
from omnijax.models.qwen2_5_omni.token2wav import (
    Token2Wav,
    Token2WavConfig,
    sample_mel,
    synthesize,
    time_grid,
    token2wav_components,
)
from omnijax.models.qwen2_5_omni.token2wav_dit import (
    DIT_RULES_PREFIX,
    DiT,
    DiTConfig,
    DiTConfigError,
    dit_component,
    dit_forward,
    dit_from_params,
    dit_params,
    speaker_encoder,
)

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf  # noqa: E402
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (  # noqa: E402
    Qwen2_5OmniBigVGANConfig,
    Qwen2_5OmniDiTConfig,
    Qwen2_5OmniToken2WavConfig,
)

TOL = 1e-4  # of the signal's peak (waveforms) or range (mels)


# The release's rates (5, 3, 2, ...) and kernels at tiny widths, two AMP kernel sizes with other dilations.
TINY_BIGVGAN = dict(mel_dim=8, upsample_initial_channel=32, resblock_kernel_sizes=[3, 5],
                    resblock_dilation_sizes=[[1, 3, 5], [1, 2, 4]], upsample_rates=[5, 3, 2],
                    upsample_kernel_sizes=[11, 7, 4])


def perturbed(model, seed: int, *, last: str = "", gain_last: float = 1.0):
    """`model` with variance-preserving random weights (so the signal stays in range) and every 1-D parameter
    (biases, Snake alpha/beta) moved off its initial value."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
                continue
            transposed = ".ups." in f".{name}" and p.ndim == 3
            fan = p.shape[0] * p.shape[-1] / 2 if transposed else math.prod(p.shape[1:])
            gain = gain_last if last and name.startswith(last) else 1.0
            p.normal_(0.0, gain / math.sqrt(fan))
    return model.eval()


def assert_close(ours, want, *, scale: str = "peak"):
    ours, want = np.asarray(ours), np.asarray(want)
    assert ours.shape == want.shape, (ours.shape, want.shape)
    ref = np.abs(want).max() if scale == "peak" else want.max() - want.min()
    assert ref > 0.1, "the oracle's signal is (near) silent: the test would prove nothing"
    err = np.abs(ours - want).max()
    assert err <= TOL * ref, f"max error {err:.3g} > {TOL} x {ref:.3g}"
    return err / ref


# ------------------------------------------------------------------------------------------------------ BigVGAN


@pytest.fixture(scope="module")
def vocoder():
    ref = perturbed(hf.Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig(**TINY_BIGVGAN)), 0,
                    last="conv_post", gain_last=0.1)
    config = BigVGANConfig.from_hf(ref.config.to_dict())
    tensors = {BIGVGAN_RULES_PREFIX + k: v.numpy() for k, v in ref.state_dict().items()}
    params = convert_in_memory(tensors, [bigvgan_component(config)], strip_prefix="")["bigvgan"]
    return ref, bigvgan_from_params(config, params)


def test_bigvgan_config_and_filter():
    config = BigVGANConfig()
    assert config.hop == 240  # 10 ms of 24 kHz audio per mel frame
    assert BigVGANConfig.from_hf(Qwen2_5OmniBigVGANConfig().to_dict()) == config
    np.testing.assert_allclose(kaiser_sinc_filter(0.25, 0.3, 12),
                               hf.kaiser_sinc_filter1d(0.25, 0.3, 12).numpy()[0, 0], atol=1e-7)
    with pytest.raises(UnsupportedConfigError, match="use_weight_norm"):
        BigVGANConfig.from_hf({**Qwen2_5OmniBigVGANConfig().to_dict(), "use_weight_norm": True})
    with pytest.raises(BigVGANConfigError, match="upsample_kernel_sizes"):
        BigVGANConfig(upsample_kernel_sizes=(11, 7, 4, 4, 4, 5))
    with pytest.raises(BigVGANConfigError, match="resblock_dilation_sizes"):
        BigVGANConfig(resblock_dilation_sizes=((1, 3, 5),))


def test_bigvgan_table_fills_the_module_tree(vocoder):
    _, model = vocoder
    want = jax.tree_util.tree_map(np.shape, nnx.to_pure_dict(nnx.state(BigVGAN(model.config, rngs=nnx.Rngs(0)))))
    assert param_shapes(bigvgan_component(model.config)) == want


@pytest.mark.parametrize("frames", [1, 9, 23])
def test_bigvgan_equals_transformers(vocoder, frames):
    ref, model = vocoder
    mel = np.random.default_rng(frames).normal(-4.0, 2.5, (1, model.config.mel_dim, frames)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(mel)).numpy().reshape(1, -1)
    assert np.abs(want).max() < 1.0, "the oracle clips: the clamp would hide differences"
    ours = vocode(vocode_params(model), model.config, mel)
    assert ours.shape == (1, frames * model.config.hop)
    assert_close(ours, want)


# ---------------------------------------------------------------------------------------------------------- DiT

# Blocks of 4 frames; layer 1 looks ahead one block, layers 0 and 3 back; a Res2Net scale of 4 (the chain of splits).
TINY_DIT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8, ff_mult=2, emb_dim=16,
                block_size=4, look_ahead_layers=[1], look_backward_layers=[0, 3], repeats=2, num_embeds=20, mel_dim=8,
                enc_emb_dim=12, enc_dim=10, enc_channels=[16, 16, 16, 32], enc_kernel_sizes=[5, 3, 3, 1],
                enc_dilations=[1, 2, 3, 1], enc_attention_channels=8, enc_res2net_scale=4, enc_se_channels=8,
                max_position_embeddings=512)


@pytest.fixture(scope="module")
def dit():
    ref = perturbed(hf.Qwen2_5OmniToken2WavDiTModel._from_config(Qwen2_5OmniDiTConfig(**TINY_DIT),
                                                                  attn_implementation="sdpa"), 1)
    config = DiTConfig.from_hf(ref.config.to_dict())
    tensors = {DIT_RULES_PREFIX + k: v.numpy() for k, v in ref.state_dict().items()}
    params = convert_in_memory(tensors, [dit_component(config)], strip_prefix="")["dit"]
    return ref, dit_from_params(config, params)


def dit_inputs(config, codes_len: int, ref_len: int = 19, seed: int = 0):
    rng = np.random.default_rng(seed)
    T = codes_len * config.repeats
    return dict(x=rng.normal(size=(1, T, config.mel_dim)).astype(np.float32),
                reference_mel=rng.normal(-3.0, 1.5, (1, ref_len, config.mel_dim)).astype(np.float32),
                speaker=np.repeat(rng.normal(size=(1, 1, config.enc_emb_dim)).astype(np.float32), T, axis=1),
                codes=rng.integers(0, config.num_embeds + 1, (1, codes_len)))


def test_dit_config():
    assert DiTConfig.from_hf(Qwen2_5OmniDiTConfig().to_dict()) == DiTConfig()
    with pytest.raises(UnsupportedConfigError, match="rope_parameters"):
        DiTConfig.from_hf({**Qwen2_5OmniDiTConfig().to_dict(), "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(DiTConfigError, match="enc_channels"):
        DiTConfig(enc_channels=(256, 256, 256, 256, 512))
    with pytest.raises(DiTConfigError, match="look_ahead_layers"):
        DiTConfig(look_ahead_layers=(22,))


def test_dit_table_fills_the_module_tree(dit):
    _, model = dit
    want = jax.tree_util.tree_map(np.shape, nnx.to_pure_dict(nnx.state(DiT(model.config, rngs=nnx.Rngs(0)))))
    assert param_shapes(dit_component(model.config)) == want


@pytest.mark.parametrize("apply_cfg, drop_audio, drop_code", [(True, False, False), (False, False, False),
                                                              (False, True, True)])
def test_dit_forward_equals_transformers(dit, apply_cfg, drop_audio, drop_code):
    ref, model = dit
    inputs = dit_inputs(model.config, codes_len=11)  # 22 frames: 6 blocks, the last one short
    with torch.no_grad():
        want = ref(hidden_states=torch.from_numpy(inputs["x"]), condition_vector=torch.from_numpy(
            inputs["reference_mel"]), speaker_embedding=torch.from_numpy(inputs["speaker"]),
            quantized_code=torch.from_numpy(inputs["codes"]), time_step=torch.tensor(0.37), apply_cfg=apply_cfg,
            drop_audio_conditioning=drop_audio, drop_code=drop_code).numpy()
    ours = dit_forward(dit_params(model), model.config, **inputs, time=np.float32(0.37), apply_cfg=apply_cfg,
                       drop_audio_conditioning=drop_audio, drop_code=drop_code)
    assert_close(ours, want, scale="range")


def test_speaker_encoder_equals_transformers(dit):
    ref, model = dit
    mel = dit_inputs(model.config, 3, ref_len=30)["reference_mel"]
    with torch.no_grad():
        want = ref.input_embed.spk_encoder(torch.from_numpy(mel)).numpy()
    assert_close(speaker_encoder(dit_params(model)["spk"], model.config, mel), want, scale="range")


# ------------------------------------------------------------------------------------- ODE sampling, Token2Wav


def reference_noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """What `torch.randn(shape)` draws after `torch.manual_seed(seed)` -- the reference's initial state."""
    torch.manual_seed(seed)
    return torch.randn(list(shape)).numpy()


@pytest.mark.parametrize("num_steps, guidance, sway", [(10, 0.5, -1.0), (4, 0.0, None)])
def test_sample_equals_transformers(dit, num_steps, guidance, sway):
    ref, model = dit
    c = model.config
    inputs = dit_inputs(c, codes_len=9, seed=3)
    noise = reference_noise(7, (1, 18, c.mel_dim))
    torch.manual_seed(7)
    with torch.no_grad():
        want = ref.sample(torch.from_numpy(inputs["speaker"][:, 0]), torch.from_numpy(inputs["reference_mel"]),
                          torch.from_numpy(inputs["codes"]), num_steps=num_steps, guidance_scale=guidance,
                          sway_coefficient=sway).numpy()
    ours = sample_mel(dit_params(model), c, noise, inputs["speaker"][:, 0], inputs["reference_mel"], inputs["codes"],
                      num_steps=num_steps, guidance_scale=guidance, sway=sway)
    assert ours.shape == (1, c.mel_dim, 18)
    assert_close(ours, want, scale="range")
    grid = torch.linspace(0, 1, num_steps)
    if sway is not None:
        grid = grid + sway * (torch.cos(torch.pi / 2 * grid) - 1 + grid)
    np.testing.assert_allclose(time_grid(num_steps, sway), grid.numpy(), atol=1e-7)


@pytest.fixture(scope="module")
def token2wav_pair():
    hf_config = Qwen2_5OmniToken2WavConfig(dit_config=TINY_DIT, bigvgan_config=TINY_BIGVGAN)
    ref = hf.Qwen2_5OmniToken2WavModel(hf_config)
    perturbed(ref.code2wav_dit_model, 1)
    perturbed(ref.code2wav_bigvgan_model, 0, last="conv_post", gain_last=0.1)
    config = Token2WavConfig.from_hf(hf_config.to_dict())
    tensors = {"token2wav." + k: v.numpy() for k, v in ref.state_dict().items()}
    params = convert_in_memory(tensors, token2wav_components(config), strip_prefix="")
    model = Token2Wav(config)
    nnx.update(model.dit, nnx.state(dit_from_params(config.dit, params["dit"])))
    nnx.update(model.bigvgan, nnx.state(bigvgan_from_params(config.bigvgan, params["bigvgan"])))
    return ref.eval(), model


def test_token2wav_equals_transformers(token2wav_pair):
    ref, model = token2wav_pair
    c = model.config
    rng = np.random.default_rng(5)
    codes = rng.integers(0, c.dit.num_embeds + 1, (1, 13))
    cond = rng.normal(size=(1, c.dit.enc_emb_dim)).astype(np.float32)
    ref_mel = rng.normal(-3.0, 1.5, (1, 21, c.dit.mel_dim)).astype(np.float32)
    noise = reference_noise(11, (1, 26, c.dit.mel_dim))
    torch.manual_seed(11)
    with torch.no_grad():
        want = ref(torch.from_numpy(codes), torch.from_numpy(cond), torch.from_numpy(ref_mel)).numpy()[None]
    assert np.abs(want).max() < 1.0, "the oracle clips: the clamp would hide differences"
    ours = synthesize(model, codes, cond, ref_mel, noise)
    assert ours.shape == (1, 13 * c.samples_per_token)
    assert_close(ours, want)


def test_token2wav_refuses_bad_input(token2wav_pair):
    _, model = token2wav_pair
    c = model.config.dit
    codes, cond = np.zeros((1, 4), np.int64), np.zeros((1, c.enc_emb_dim), np.float32)
    ref_mel, noise = np.zeros((1, 21, c.mel_dim), np.float32), np.zeros((1, 8, c.mel_dim), np.float32)
    with pytest.raises(ValueError, match="codes"):
        synthesize(model, codes + c.num_embeds + 1, cond, ref_mel, noise)
    with pytest.raises(ValueError, match="noise"):
        synthesize(model, codes, cond, ref_mel, noise[:, :7])
    with pytest.raises(ValueError, match="conditioning"):
        synthesize(model, codes, cond[:, :3], ref_mel, noise)
    with pytest.raises(ValueError, match="reference mel has 2 frames"):
        synthesize(model, codes, cond, ref_mel[:, :2], noise)


def test_token2wav_config_and_bfloat16_storage(token2wav_pair):
    """bfloat16 parameters are stored as such and computed in float32: the waveform stays near the float32 one."""
    ref, model = token2wav_pair
    hf_dict = ref.config.to_dict()
    with pytest.raises(UnsupportedConfigError, match="vocoder_type"):
        Token2WavConfig.from_hf({**hf_dict, "vocoder_type": "hifigan"})
    with pytest.raises(ValueError, match="mel_dim"):
        Token2WavConfig(dit=model.config.dit, bigvgan=model.config.bigvgan.replace(mel_dim=9))
    config = Token2WavConfig.from_hf(hf_dict, dtype="bfloat16")
    half = Token2Wav(config)
    nnx.update(half, jax.tree_util.tree_map(lambda a: a.astype("bfloat16"), nnx.state(model, nnx.Param)))
    assert dit_params(half.dit)["layers"]["q"].dtype == "bfloat16"
    c = model.config.dit
    rng = np.random.default_rng(2)
    args = (rng.integers(0, c.num_embeds + 1, (1, 6)), rng.normal(size=(1, c.enc_emb_dim)).astype(np.float32),
            rng.normal(-3.0, 1.5, (1, 21, c.mel_dim)).astype(np.float32),
            rng.normal(size=(1, 12, c.mel_dim)).astype(np.float32))
    full, low = np.asarray(synthesize(model, *args)), np.asarray(synthesize(half, *args))
    assert low.dtype == np.float32
    assert 0 < np.abs(low - full).max() <= 0.05 * np.abs(full).max()
