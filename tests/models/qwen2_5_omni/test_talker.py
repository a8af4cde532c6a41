"""Qwen2.5-Omni talker against transformers' `Qwen2_5OmniTalkerForConditionalGeneration`.

The reference is a tiny full `Qwen2_5OmniForConditionalGeneration` (the thinker of `tests/_support/hf_models`, a tiny
talker and Token2Wav) with seeded talker and thinker weights (`seeded_full_model`, which test_speech converts too).
Checked: the config reader and its refusals, the conversion table, talker logits (distinct TMRoPE axes), and greedy
talker generation for given thinker rows (repetition penalty, suppressed codec bos, stop ids), each against
transformers.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes
from omnijax.errors import ConfigError, UnsupportedConfigError
from omnijax.models.qwen2_5_omni import talker_forward as F
from omnijax.models.qwen2_5_omni.convert import talker_component, talker_config_from_hf
from omnijax.models.qwen2_5_omni.talker import Talker, TalkerConfig, TalkerConfigError, talker_from_params
from tests._support import hf_models
from tests._support.speech_refs import perturb_thinker_and_talker

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from safetensors.numpy import load_file  # noqa: E402
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration  # noqa: E402

from tests.models.qwen2_5_omni.test_token2wav import TINY_BIGVGAN, TINY_DIT, perturbed  # noqa: E402

CODEC = dict(tts_codec_pad_token_id=58, tts_codec_start_token_id=59, tts_codec_end_token_id=60,
             tts_codec_mask_token_id=61)
# thinker-vocabulary ids (the tiny thinker's 300 tokens; its specials sit at 290 ..)
TEXT_IDS = dict(tts_text_start_token_id=250, tts_text_end_token_id=251, tts_text_pad_token_id=252)
VOICE_BOS = {"Chelsie": 253, "Ethan": 254}
TALKER = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, embedding_size=hf_models.TEXT["hidden_size"],
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]},
              **CODEC, **TEXT_IDS)
TOKEN2WAV = dict(dit_config=dict(TINY_DIT, num_embeds=64), bigvgan_config=TINY_BIGVGAN)
STOP = [CODEC["tts_codec_pad_token_id"], CODEC["tts_codec_end_token_id"]]
TOL = 1e-4


def seeded_full_model():
    """transformers' tiny full model: talker and thinker weights redrawn (N(0, 0.3) matrices, shifted vectors) so
    that the codes depend on every row, Token2Wav weights that keep the signal in range (`test_token2wav`)."""
    torch.manual_seed(0)
    full = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(
        thinker_config=hf_models.thinker_config().to_dict(), talker_config=TALKER, token2wav_config=TOKEN2WAV,
        enable_audio_output=True)).eval()
    perturb_thinker_and_talker(full)
    perturbed(full.token2wav.code2wav_dit_model, 1)
    perturbed(full.token2wav.code2wav_bigvgan_model, 0, last="conv_post", gain_last=0.1)
    full.token2wav.eval()
    return full


def speakers(full) -> dict:
    """Seeded voices in `spk_dict.pt`'s layout: name -> cond `[1, E]`, ref_mel `[1, T, M]`, bos_token."""
    dit = full.config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(7)
    return {name: {"cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
                   "ref_mel": torch.randn(1, 19 + i, dit.mel_dim, generator=gen) * 1.5 - 3.0, "bos_token": bos}
            for i, (name, bos) in enumerate(VOICE_BOS.items())}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers full model, omnijax config, params): the talker's saved tensors through the table."""
    full = seeded_full_model()
    root = tmp_path_factory.mktemp("talker25")
    full.save_pretrained(root, safe_serialization=True)
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(path).items() if k.startswith("talker.")})
    config = talker_config_from_hf(full.config.talker_config.to_dict())
    tree = convert_in_memory(tensors, [talker_component(config)], strip_prefix="")["talker"]
    return full, config, F.talker_params(talker_from_params(config, tree))


def _close(ours, want, what: str):
    ours, want = np.asarray(ours), np.asarray(want)
    assert ours.shape == want.shape, (what, ours.shape, want.shape)
    assert np.abs(want).max() > 0.05, f"{what}: the oracle is (near) zero, the test would prove nothing"
    err = np.abs(ours - want).max()
    assert err <= TOL * max(1.0, np.abs(want).max()), f"{what}: max error {err}"


def test_config_from_hf(pair):
    full, config, _ = pair
    d = config.decoder
    assert (d.vocab_size, d.hidden_size, d.num_layers, d.head_dim, d.num_kv_heads) == (64, 32, 2, 8, 2)
    assert d.mrope_section == (2, 1, 1) and not d.mrope_interleaved and d.qkv_bias and not d.qk_norm
    assert config.embedding_size == 64 and config.stop_ids == (58, 60) and config.codec_bos_id == 59
    assert (config.text_eos_id, config.text_pad_id, config.codec_mask_id) == (251, 252, 61)
    assert TalkerConfig.from_json(config.to_json()) == config
    hf = full.config.talker_config.to_dict()
    bad = [({"use_flux": 1}, UnsupportedConfigError, "use_flux"),
           ({"hidden_act": "gelu"}, UnsupportedConfigError, "hidden_act"),
           ({"use_sliding_window": True}, UnsupportedConfigError, "use_sliding_window"),
           ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, UnsupportedConfigError,
            "rope"),
           ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ConfigError, "mrope_section"),
           ({"tts_codec_end_token_id": 64}, ConfigError, "codec_eos_id"),
           ({"embedding_size": None}, ConfigError, "embedding_size")]
    for change, error, name in bad:
        with pytest.raises(error, match=name):
            talker_config_from_hf({**hf, **change})
    with pytest.raises(TalkerConfigError, match="mrope_section"):
        TalkerConfig(decoder=d.replace(mrope_section=None), embedding_size=64)


def test_table_covers_the_module(pair):
    _, config, params = pair
    shapes = param_shapes(talker_component(config))
    model_shapes = {k: v.shape for k, v in F.talker_params(Talker(config)).items() if k != "layers"}
    assert {k: v for k, v in shapes.items() if k != "layers"} == model_shapes
    assert params["codec_embedding"].shape == (64, 64) and params["proj"].shape == (64, 32)


def test_talker_logits_equal_transformers(pair):
    full, config, params = pair
    rng = np.random.default_rng(3)
    T = 11
    rows = rng.normal(size=(2, T, config.embedding_size)).astype(np.float32)
    # distinct temporal / height / width positions, so a wrong mrope split shows
    positions = np.stack([np.arange(T), np.arange(T) // 2, (np.arange(T) * 3) % 7])[:, None].repeat(2, axis=1)
    with torch.no_grad():
        want = full.talker(inputs_embeds=torch.from_numpy(rows.copy()), position_ids=torch.from_numpy(positions),
                           use_cache=False).logits.numpy()
    ours = F.talker_logits(config, params, jnp.asarray(rows), jnp.asarray(positions))
    _close(ours, want, "talker logits")


@pytest.mark.parametrize("penalty", [1.05, 1.3])
def test_greedy_generation_equals_transformers(pair, penalty):
    """Given thinker rows (prompt, answer), the talker's greedy tokens equal transformers' talker `generate` as the
    full model's `generate` calls it (codec pad / bos added to the last two prefill rows inside its forward), with
    the default repetition penalty (which changes no token on these weights) and a stronger one that does (over the
    prompt's codec mask ids too)."""
    full, config, params = pair
    rng = np.random.default_rng(4)
    T0, N, Dt = 7, 5, config.embedding_size
    embeds = rng.normal(size=(T0 + N, Dt)).astype(np.float32)
    hidden = rng.normal(size=(T0 + N, Dt)).astype(np.float32)
    bos, eos, pad = (rng.normal(size=(Dt,)).astype(np.float32) for _ in range(3))
    rows = embeds + hidden
    ids = rng.integers(0, 200, T0 + 1)  # the talker's text ids only feed get_rope_index (text: consecutive)
    max_new = 12

    def reference(stop):
        with torch.no_grad():
            return full.talker.generate(
                input_ids=torch.as_tensor([[config.codec_mask_id] * T0 + [config.codec_pad_id, config.codec_bos_id]]),
                input_text_ids=torch.as_tensor(np.concatenate([ids[:T0], [VOICE_BOS["Chelsie"]], ids[T0:]])[None]),
                inputs_embeds=torch.from_numpy(np.concatenate([rows[:T0], bos[None], rows[T0:T0 + 1]])[None].copy()),
                thinker_reply_part=torch.from_numpy(np.concatenate([rows[T0 + 1:], eos[None], pad[None]])[None]
                                                    .copy()),
                suppress_tokens=[config.codec_bos_id], do_sample=False, repetition_penalty=penalty, eos_token_id=stop,
                max_new_tokens=max_new)[0, T0 + 2:].numpy()

    prefill, trailing = F.talker_prompt(config, params, jnp.asarray(embeds), jnp.asarray(hidden), T0,
                                        jnp.asarray(bos), jnp.asarray(eos))

    def ours(p, c=config):
        return F.generate_greedy(c, params, prefill, np.broadcast_to(np.arange(T0 + 2), (3, T0 + 2)), trailing,
                                 jnp.asarray(pad), prompt_ids=[config.codec_mask_id] * T0 + [58, 59],
                                 max_new_tokens=max_new, repetition_penalty=p, suppress=[config.codec_bos_id])

    want = reference(STOP)
    assert len(want) == max_new and len(set(want.tolist())) > 2, want  # (no stop id came: cut at max_new_tokens)
    np.testing.assert_array_equal(ours(penalty), want)
    assert config.codec_bos_id not in want.tolist()
    if penalty > 1.1:  # the penalty is exercised: without it the tokens differ
        assert (ours(1.0) != want).any()
    # the stop ids end the speech (after the stop token, as transformers' eos): the end id made one that comes
    stop_at = int(want[4])
    early = reference([config.codec_pad_id, stop_at])
    assert len(early) == 5
    np.testing.assert_array_equal(ours(penalty, config.replace(codec_eos_id=stop_at)), early)
