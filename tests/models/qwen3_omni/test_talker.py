"""Qwen3-Omni talker and code predictor against transformers' `Qwen3OmniMoeTalkerForConditionalGeneration`.

The reference is a tiny full `Qwen3OmniMoeForConditionalGeneration` (the thinker of `qwen3_omni_models`, a tiny
talker and Code2Wav) with seeded talker weights, saved with `save_pretrained` so that the talker's tensors are in the
release's layout (one tensor per expert) and converted through `talker_components`. Checked: the config reader, the
tables, the projections, code-predictor logits of every head, talker logits (distinct mrope axes; on a prompt built
from thinker rows), user and assistant prompts, greedy talker generation, and the whole thinker -> talker -> Code2Wav
path of transformers' `generate(return_audio=True)` (same codes, same waveform).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes
from omnijax.errors import UnsupportedConfigError
from omnijax.models.qwen3_omni import talker_decode as D
from omnijax.models.qwen3_omni import talker_forward as F
from omnijax.models.qwen3_omni.talker import (
    Talker,
    TalkerConfig,
    TalkerConfigError,
    talker_components,
    talker_from_params,
)
from tests._support import qwen3_omni_models as Q
from tests._support.speech_refs import perturb_thinker_and_talker

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from safetensors.numpy import load_file  # noqa: E402
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig  # noqa: E402
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeForConditionalGeneration,
)

GROUPS = 4
# transformers' generate suppresses the top 1,024 codec ids (eos excepted): the codec vocabulary holds more, with the
# control ids up there, so that the first codebook's codes are 0 .. 75.
CODEC_VOCAB = 1100
TEXT = dict(vocab_size=CODEC_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1],
                             "interleaved": True})
PREDICTOR = dict(vocab_size=40, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=8, num_code_groups=GROUPS)
SPECIAL = dict(codec_eos_token_id=1080, codec_nothink_id=1091, codec_think_bos_id=1092, codec_think_eos_id=1093,
               codec_pad_id=1094, codec_bos_id=1095, speaker_id={"ethan": 1088, "chelsie": 1089})
SUPPRESS = [i for i in range(CODEC_VOCAB - 1024, CODEC_VOCAB) if i != SPECIAL["codec_eos_token_id"]]
TALKER = dict(text_config=TEXT, code_predictor_config=PREDICTOR, num_code_groups=GROUPS,
              thinker_hidden_size=Q.TEXT["hidden_size"], accept_hidden_layer=2, spatial_merge_size=2, **SPECIAL)
CODE2WAV = dict(codebook_size=80, num_quantizers=GROUPS, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                sliding_window=4, intermediate_size=16, num_hidden_layers=1, decoder_dim=16, upsample_rates=(2,),
                upsampling_ratios=(2,))
# Thinker-side tokens of the chat template, inside the tiny thinker's vocabulary.
TTS = dict(tts_pad_token_id=280, tts_bos_token_id=281, tts_eos_token_id=282, im_start_token_id=297,
           im_end_token_id=298, system_token_id=283, user_token_id=284, assistant_token_id=285)
TOL = 1e-4


def seeded_full_model():
    """transformers' tiny full model with seeded talker and thinker weights, and Code2Wav weights that keep the
    signal in range (`test_code2wav.seeded_reference`); test_speech converts the same model."""
    from tests.models.qwen3_omni.test_code2wav import seeded_reference

    torch.manual_seed(0)
    full = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(
        thinker_config=Q.thinker_config().to_dict(), talker_config=TALKER, code2wav_config=CODE2WAV,
        enable_audio_output=True, **TTS)).eval()
    perturb_thinker_and_talker(full)
    full.code2wav.load_state_dict(seeded_reference(CODE2WAV).state_dict())
    return full


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`seeded_full_model()` and its `talker.` / `code2wav.` tensors as `save_pretrained` writes them."""
    full = seeded_full_model()
    root = tmp_path_factory.mktemp("talker")
    full.save_pretrained(root, safe_serialization=True)
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(path).items() if k.startswith(("talker.", "code2wav."))})
    return full, tensors


@pytest.fixture(scope="module")
def pair(saved):
    """(transformers full model, omnijax config, params): the talker's weights through the name tables."""
    full, tensors = saved
    config = TalkerConfig.from_hf(full.config.talker_config.to_dict())
    talker = {k: v for k, v in tensors.items() if k.startswith("talker.")}
    trees = convert_in_memory(talker, talker_components(config), strip_prefix="")
    model = talker_from_params(config, {**trees["talker"], "code_predictor": trees["code_predictor"]})
    return full, config, F.talker_params(model)


def _t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x))


def _close(ours, want, what: str):
    ours, want = np.asarray(ours), np.asarray(want)
    assert ours.shape == want.shape, (what, ours.shape, want.shape)
    assert np.abs(want).max() > 0.05, f"{what}: the oracle is (near) zero, the test would prove nothing"
    err = np.abs(ours - want).max()
    assert err <= TOL, f"{what}: max error {err}"


# ------------------------------------------------------------------------------------------------ config, table


def test_config_from_hf(pair):
    full, config, _ = pair
    assert config.num_code_groups == GROUPS and config.accept_hidden_layer == 2
    assert config.decoder.sparse_layers == (True, True) and config.decoder.mrope_interleaved
    assert config.decoder.mrope_section == (2, 1, 1) and config.predictor.mrope_section is None
    assert config.speaker("ETHAN") == 1088 and config.predictor.num_kv_heads == 1
    assert TalkerConfig.from_json(config.to_json()) == config
    with pytest.raises(KeyError, match="aiden"):
        config.speaker("aiden")
    hf = full.config.talker_config.to_dict()
    bad = [({"text_config": {**hf["text_config"], "use_flux": 1}}, UnsupportedConfigError, "use_flux"),
           ({"text_config": {**hf["text_config"], "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}},
            UnsupportedConfigError, "rope_parameters"),
           ({"code_predictor_config": {**hf["code_predictor_config"], "layer_types": ["sliding_attention"] * 2}},
            UnsupportedConfigError, "layer_types"),
           ({"code_predictor_config": {**hf["code_predictor_config"], "num_code_groups": 8}}, TalkerConfigError,
            "num_code_groups"),
           ({"code_predictor_config": {**hf["code_predictor_config"], "hidden_size": 16}}, TalkerConfigError,
            "hidden_size"),
           ({"speaker_id": {"ethan": 5000}}, TalkerConfigError, "speaker_id.ethan")]
    for change, error, name in bad:
        with pytest.raises(error, match=name):
            TalkerConfig.from_hf({**hf, **change})


def test_release_talker_config():
    """The Qwen3-Omni-30B-A3B-Instruct release's talker settings (as its config.json sets them)."""
    text = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=20, num_attention_heads=16,
                num_key_value_heads=2, head_dim=128, vocab_size=3072, num_local_experts=128, num_experts_per_tok=6,
                moe_intermediate_size=384, shared_expert_intermediate_size=768, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], sliding_window=None, use_sliding_window=False,
                rope_parameters={"interleaved": True, "mrope_section": [24, 20, 20], "rope_theta": 1000000,
                                 "rope_type": "default", "type": "default"})
    predictor = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=2048, num_code_groups=16,
                     layer_types=["full_attention"] * 5, rope_parameters={"rope_theta": 1000000,
                                                                          "rope_type": "default"})
    config = TalkerConfig.from_hf(dict(
        text_config=text, code_predictor_config=predictor, accept_hidden_layer=24, audio_token_id=151675,
        audio_start_token_id=151669, audio_end_token_id=151670, codec_bos_id=2149, codec_eos_token_id=2150,
        codec_nothink_id=2155, codec_pad_id=2148, codec_think_bos_id=2156, codec_think_eos_id=2157,
        image_token_id=151655, num_code_groups=16, position_id_per_seconds=13, seconds_per_chunk=2,
        spatial_merge_size=2, speaker_id={"aiden": 2303, "chelsie": 2301, "ethan": 2302}, thinker_hidden_size=2048,
        video_token_id=151656, vision_start_token_id=151652))
    d, p = config.decoder, config.predictor
    assert (d.num_layers, d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size) == (20, 128, 6, 384)
    assert d.sparse_layers == (True,) * 20 and d.mrope_section == (24, 20, 20) and d.rope_theta == 1e6
    assert (p.num_layers, p.intermediate_size, p.num_kv_heads, p.rope_theta) == (5, 3072, 8, 1e6)
    assert (config.num_code_groups, config.accept_hidden_layer, config.projection_size) == (16, 24, 2048)
    assert config.speaker("Chelsie") == 2301 and config.codec_eos_token_id == 2150
    talker, predictor_table = talker_components(config)
    shapes = param_shapes(talker)
    assert shapes["layers"]["expert_gate"] == (20, 128, 1024, 384) and shapes["shared"]["gate"] == (20, 1024, 1)
    assert param_shapes(predictor_table)["lm_head"] == (15, 1024, 2048)


def test_tables_fill_the_module_tree(pair):
    _, config, params = pair
    talker, predictor = talker_components(config)
    want = jax.tree_util.tree_map(np.shape, nnx.to_pure_dict(nnx.state(Talker(config))))
    assert {**param_shapes(talker), "code_predictor": param_shapes(predictor)} == want
    assert jax.tree_util.tree_map(np.shape, params) == want


# ------------------------------------------------------------------------------------------------------- parity


def test_projections(pair):
    full, config, params = pair
    x = np.random.default_rng(0).standard_normal((2, 5, config.thinker_hidden_size)).astype(np.float32)
    with torch.no_grad():
        text, hidden = full.talker.text_projection(_t(x)), full.talker.hidden_projection(_t(x))
    _close(F.project_text(config, params, x), text, "text_projection")
    _close(F.project_hidden(config, params, x), hidden, "hidden_projection")


@pytest.mark.parametrize("length", range(2, GROUPS + 1))
def test_code_predictor_logits(pair, length):
    """A sequence of `length` embeddings uses head `length - 2` (codebook `length - 1`) at every position."""
    full, config, params = pair
    x = np.random.default_rng(length).standard_normal((2, length, config.predictor.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = full.talker.code_predictor(inputs_embeds=_t(x)).logits
    _close(F.predictor_logits(config, params, x, length - 2), want, f"code predictor head {length - 2}")


def test_talker_logits_with_distinct_position_axes(pair):
    full, config, params = pair
    B, T = 2, 13
    x = np.random.default_rng(1).standard_normal((B, T, config.decoder.hidden_size)).astype(np.float32)
    t = np.arange(T)
    positions = np.broadcast_to(np.stack([t, 2 + (t * 5) % 7, 3 * t])[:, None], (3, B, T)).copy()
    with torch.no_grad():
        want = full.talker(inputs_embeds=_t(x), attention_mask=torch.ones(B, T, dtype=torch.long),
                           position_ids=_t(positions)).logits
    _close(F.talker_logits(config, params, x, positions.astype(np.float32)), want, "talker logits")


@contextlib.contextmanager
def greedy_predictor(predictor):
    """transformers' talker samples its code predictor with top_k=50, top_p=0.8 hard-coded (whatever the talker's
    own settings); within the block the predictor decodes greedily."""
    greedy = functools.partial(type(predictor).generate, predictor)
    predictor.generate = lambda **kw: greedy(**{**kw, "do_sample": False, "top_k": None, "top_p": None})
    try:
        yield
    finally:
        del predictor.generate


def _thinker_rows(full, ids):
    with torch.no_grad():
        return full.thinker.get_input_embeddings()(_t(ids)[None])  # [1, T, Dt]


def _reference_prompt(full, answer_ids):
    """transformers' assistant part (its `_get_talker_assistant_parts`) for `<|im_start|>assistant\\n` + answer."""
    ids = np.asarray([TTS["im_start_token_id"], TTS["assistant_token_id"], 198] + list(answer_ids))
    embed = _thinker_rows(full, ids)
    with torch.no_grad():
        specials = _thinker_rows(full, [TTS["tts_bos_token_id"], TTS["tts_eos_token_id"], TTS["tts_pad_token_id"]])
        bos, eos, pad = full.talker.text_projection(specials).chunk(3, dim=1)
        prompt, prompt_ids, trailing = full._get_talker_assistant_parts(0, len(ids), 1088, embed, pad, bos, eos)
    return ids, embed[0].numpy(), specials[0].numpy(), prompt, prompt_ids, trailing, pad


def test_assistant_prompt_and_its_logits(pair):
    """The talker input built from thinker embedding rows, and the talker's logits on it (positions from
    transformers' own `get_rope_index` over the talker's input ids)."""
    full, config, params = pair
    _, embed, specials, prompt, prompt_ids, trailing, _ = _reference_prompt(full, [7, 8, 9, 10, 11])
    ours, ours_trailing = F.assistant_prompt(config, params, embed, "Ethan", specials)
    _close(ours, prompt[0], "assistant prompt")
    _close(ours_trailing, trailing[0], "trailing text rows")
    T = prompt.shape[1]
    with torch.no_grad():
        want = full.talker(inputs_embeds=prompt, attention_mask=torch.ones(1, T, dtype=torch.long),
                           talker_input_ids=prompt_ids).logits
    positions = np.broadcast_to(np.arange(T, dtype=np.float32), (3, 1, T))
    _close(F.talker_logits(config, params, np.asarray(ours)[None], positions), want, "talker logits on the prompt")


def test_user_prompt(pair):
    """User rows: projected thinker embeddings, and projected layer-`accept_hidden_layer` states at the
    placeholders, against transformers' `_get_talker_user_parts`."""
    full, config, params = pair
    ids = np.asarray([TTS["im_start_token_id"], TTS["user_token_id"], 198, 5, Q.IDS["audio_token_id"],
                      Q.IDS["audio_token_id"], 6, Q.IDS["image_token_id"], 7])
    mask = np.isin(ids, [Q.IDS["audio_token_id"], Q.IDS["image_token_id"], Q.IDS["video_token_id"]])
    embed = _thinker_rows(full, ids)
    hidden = _t(np.random.default_rng(3).standard_normal(embed.shape).astype(np.float32))
    with torch.no_grad():
        want = full._get_talker_user_parts(0, len(ids), _t(mask)[None], hidden, embed)
    ours = F.user_prompt(config, params, embed[0].numpy(), hidden[0].numpy(), mask)
    _close(ours, want[0], "user prompt")
    text_only = F.user_prompt(config, params, embed[0].numpy(), hidden[0].numpy(), np.zeros_like(mask))
    # the placeholders read the hidden rows
    assert np.abs(np.asarray(text_only) - np.asarray(ours))[mask].max(axis=1).min() > 1e-3


def test_greedy_generation_equals_transformers(pair):
    """transformers' talker `generate` (greedy; its code predictor made greedy too, it samples by default with
    top_k=50, top_p=0.8 hard-coded) against `talker_decode.generate_greedy`: the same talker tokens and the same
    codes, frame by frame."""
    full, config, params = pair
    _, embed, specials, prompt, prompt_ids, trailing, pad = _reference_prompt(full, [7, 8, 9])
    with greedy_predictor(full.talker.code_predictor), torch.no_grad():
        out = full.talker.generate(
            inputs_embeds=prompt, trailing_text_hidden=trailing, tts_pad_embed=pad, talker_input_ids=prompt_ids,
            attention_mask=torch.ones(prompt.shape[:2], dtype=torch.long), max_new_tokens=8, do_sample=False,
            suppress_tokens=SUPPRESS, eos_token_id=config.codec_eos_token_id, repetition_penalty=1.0,
            output_hidden_states=True, return_dict_in_generate=True)
    want_tokens = out.sequences[0].numpy()
    want_codes = torch.stack([h[-1] for h in out.hidden_states if h[-1] is not None], dim=1)[0].T.numpy()
    ours_prompt, ours_trailing = F.assistant_prompt(config, params, embed, "ethan", specials)
    T = ours_prompt.shape[0]
    tokens, codes = D.generate_greedy(config, params, ours_prompt, np.broadcast_to(np.arange(T), (3, T)),
                                      ours_trailing, F.project_text(config, params, specials)[2], max_new_tokens=8,
                                      suppress=SUPPRESS)
    assert want_codes.shape[1] >= 4, "fewer than 4 frames: the test would prove little"
    assert len(set(want_codes[1:].ravel().tolist())) > 2, "the predictor's codes barely vary"
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(codes, want_codes)


def test_predict_codes_is_one_compiled_frame(pair):
    """The per-frame predictor loop equals running `predictor_logits` on the growing sequence (argmax each time)."""
    _, config, params = pair
    rng = np.random.default_rng(5)
    past = rng.standard_normal((3, config.decoder.hidden_size)).astype(np.float32)
    code0 = np.asarray([1, 50, 77], np.int32)
    codes = np.asarray(F.predict_codes(config, params, past, code0))
    seq = np.stack([past, np.asarray(params["codec_embedding"])[code0]], axis=1)
    for g in range(1, GROUPS):
        logits = np.asarray(F.predictor_logits(config, params, seq, g - 1))[:, -1]
        np.testing.assert_array_equal(codes[:, g], logits.argmax(-1))
        emb = np.asarray(params["code_predictor"]["codec_embedding"])[g - 1][codes[:, g]]
        seq = np.concatenate([seq, emb[:, None]], axis=1)
    np.testing.assert_array_equal(codes[:, 0], code0)
    assert jnp.asarray(codes).dtype == jnp.int32


def test_thinker_to_waveform_equals_transformers_generate(pair, saved):
    """transformers' `generate(..., return_audio=True)` (greedy thinker, talker and code predictor) against omnijax's
    talker fed with the same thinker's embedding rows, then omnijax's Code2Wav: the same codes and waveform."""
    from omnijax.models.qwen3_omni.code2wav import Code2WavConfig, code2wav_component, code2wav_from_params
    from omnijax.models.qwen3_omni.code2wav_decode import decode

    full, config, params = pair
    _, tensors = saved
    im_start, im_end, nl = TTS["im_start_token_id"], TTS["im_end_token_id"], 198
    prompt = np.asarray([im_start, TTS["system_token_id"], nl, 10, 11, im_end, nl,
                         im_start, TTS["user_token_id"], nl, 12, 13, 14, im_end, nl,
                         im_start, TTS["assistant_token_id"], nl, 20, 21, im_end, nl,  # an earlier answer: skipped
                         im_start, TTS["user_token_id"], nl, 15, 16, im_end, nl,
                         im_start, TTS["assistant_token_id"], nl])
    with greedy_predictor(full.talker.code_predictor), torch.no_grad():
        sequence, wav = full.generate(
            input_ids=_t(prompt)[None], speaker="Ethan", return_audio=True, thinker_max_new_tokens=6,
            thinker_do_sample=False, thinker_eos_token_id=im_end, talker_max_new_tokens=10, talker_do_sample=False,
            talker_repetition_penalty=1.0)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    assert len(sequence) - len(prompt) >= 4, "the thinker's answer is too short to have trailing text rows"

    embeds = _thinker_rows(full, sequence[:-1])[0].numpy()  # the reference's rows: all but the last token's
    specials = _thinker_rows(full, [TTS["tts_bos_token_id"], TTS["tts_eos_token_id"], TTS["tts_pad_token_id"]])[0]
    chat = F.ChatTokens(im_start=im_start, system=TTS["system_token_id"], user=TTS["user_token_id"],
                        assistant=TTS["assistant_token_id"], tts_pad=TTS["tts_pad_token_id"],
                        multimodal=(Q.IDS["audio_token_id"], Q.IDS["image_token_id"], Q.IDS["video_token_id"]))
    rows, ids, trailing = F.talker_prompt(config, params, prompt, sequence, embeds, np.zeros_like(embeds),
                                          specials.numpy(), speaker="ethan", chat=chat)
    assert len(ids) == 8 + 7 + 9  # two user turns, the answer's 9-row prefix; the system and old answer skipped
    T = len(ids)
    _, codes = D.generate_greedy(config, params, rows, np.broadcast_to(np.arange(T), (3, T)), trailing,
                                 F.project_text(config, params, specials.numpy())[2], max_new_tokens=10,
                                 suppress=SUPPRESS)
    assert codes.shape[1] >= 4, "fewer than 4 frames: the test would prove little"

    c2w_config = Code2WavConfig.from_hf(full.config.code2wav_config.to_dict())
    c2w_tensors = {k: v for k, v in tensors.items() if k.startswith("code2wav.")}
    c2w = code2wav_from_params(c2w_config, convert_in_memory(c2w_tensors, [code2wav_component(c2w_config)],
                                                             strip_prefix="")["code2wav"])
    ours = np.asarray(decode(c2w, codes[None]))[0]
    assert ours.shape == wav.shape
    peak = np.abs(wav).max()
    assert peak > 0.05, "the reference waveform is (near) silent: the test would prove nothing"
    assert np.abs(ours - wav).max() <= TOL * peak


def test_bad_conversations_are_refused_by_name(pair):
    _, config, params = pair
    chat = F.ChatTokens(im_start=1, system=2, user=3, assistant=4, tts_pad=5, multimodal=(6,))
    rows = np.zeros((12, config.thinker_hidden_size), np.float32)
    specials = np.zeros((3, config.thinker_hidden_size), np.float32)

    def build(ids, speaker="ethan"):
        ids = np.asarray(ids)
        return F.talker_prompt(config, params, ids, ids, rows, rows, specials, speaker=speaker, chat=chat)

    with pytest.raises(ValueError, match="role token 9"):
        build([1, 9, 7, 1, 4, 7, 8, 8])
    with pytest.raises(ValueError, match="last turn must be the assistant"):
        build([1, 4, 7, 8, 8, 1, 3, 7, 8])
    with pytest.raises(ValueError, match=">= 4 rows"):
        build([1, 3, 7, 1, 4, 7])
    with pytest.raises(KeyError, match="'aiden'"):
        build([1, 3, 7, 1, 4, 7, 8, 8], speaker="aiden")
    prompt, ids, trailing = build([1, 2, 7, 1, 3, 7, 6, 1, 4, 7, 8, 8])
    assert list(ids) == [1, 3, 7, 6] + [5] * 9 and prompt.shape[0] == 13 and trailing.shape[0] == 2
