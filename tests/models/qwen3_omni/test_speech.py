"""A converted Qwen3-Omni release that speaks: `omnijax convert` of a full release (talker, code predictor, Code2Wav;
single-file and sharded), `omnijax.load` (`model.speech`), and `speech.speak` against transformers'
`generate(..., return_audio=True)`: the same greedy text answer, the same codes, the same waveform.

The reference is the tiny full model of `test_talker` (seeded talker and thinker weights, Code2Wav weights that keep
the signal in range) saved with `save_pretrained`, so every tensor is in the release's layout.
"""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.convert import convert_checkpoint
from omnijax.errors import ConvertError, MissingTensorError
from omnijax.models.qwen3_omni import speech as S
from tests._support import qwen3_omni_models as Q
from tests._support.speech_refs import captured_talker, greedy_answer
from tests.models.qwen3_omni import test_talker as T

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

TTS = T.TTS
IM_START, IM_END, NL = TTS["im_start_token_id"], TTS["im_end_token_id"], 198
# system turn, a user turn, an earlier answer (the talker skips both), a user turn, the assistant's opening
PROMPT = np.asarray([IM_START, TTS["system_token_id"], NL, 10, 11, IM_END, NL,
                     IM_START, TTS["user_token_id"], NL, 12, 13, 14, IM_END, NL,
                     IM_START, TTS["assistant_token_id"], NL, 20, 21, IM_END, NL,
                     IM_START, TTS["user_token_id"], NL, 15, 16, IM_END, NL,
                     IM_START, TTS["assistant_token_id"], NL])
ANSWER_TOKENS, FRAMES = 6, 10


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The full release saved single-file, sharded and thinker-only, each converted by `omnijax convert`."""
    full = T.seeded_full_model()
    root = tmp_path_factory.mktemp("speech")
    full.save_pretrained(root / "single", safe_serialization=True)
    full.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="300KB")
    full.thinker.save_pretrained(root / "thinker", safe_serialization=True)
    said: list[str] = []
    out = {name: convert_checkpoint(root / name, root / f"{name}_out", progress=False, log=said.append)
           for name in ("single", "sharded", "thinker")}
    return full, root, out, said


@pytest.fixture(scope="module")
def model(release):
    with pytest.warns(UserWarning, match="no tokenizer files"):  # token ids in, token ids out
        return omnijax.load(release[2]["single"])


def test_the_converted_release_has_its_speech_output(release, model):
    full, root, out, said = release
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    assert not said, said  # nothing skipped
    manifest = json.loads((out["single"] / "omnijax.json").read_text())
    assert manifest["source"]["speech_output"] is True and manifest["speech"]["tts_pad_token_id"] == 280
    speech = model.speech
    assert isinstance(speech, S.Qwen3Speech) and isinstance(speech, omnijax.models.family.SpeechOutput)
    assert speech.voices == ("chelsie", "ethan") and speech.sample_rate == 24000
    assert speech.talker.config.num_code_groups == T.GROUPS and speech.code2wav.config.codebook_size == 80
    # the converted weights are the release's (the Code2Wav embedding; a talker expert and a predictor head,
    # transposed)
    from safetensors.numpy import load_file

    saved = load_file(root / "single" / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(speech.code2wav.embedding[...]), saved["code2wav.code_embedding.weight"])
    np.testing.assert_array_equal(np.asarray(speech.talker.layers.expert_gate[...])[1, 3],
                                  saved["talker.model.layers.1.mlp.experts.3.gate_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(speech.talker.code_predictor.lm_head[...])[2],
                                  saved["talker.code_predictor.lm_head.2.weight"].T)
    with pytest.warns(UserWarning, match="no tokenizer"):
        sharded = omnijax.load(out["sharded"]).speech
    for a, b in ((speech.talker, sharded.talker), (speech.code2wav, sharded.code2wav)):
        jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)))
    with pytest.warns(UserWarning, match="no tokenizer"):
        assert omnijax.load(out["thinker"]).speech is None
        half = omnijax.load(out["single"], dtype="bfloat16").speech
    # a dtype asked at load reaches every speech part (the talker's decoders and code predictor included)
    dtypes = {str(leaf.dtype) for part in (half.talker, half.code2wav)
              for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(part)))}
    assert dtypes == {"bfloat16"} and half.talker.config.decoder.dtype == "bfloat16"


def test_speak_equals_transformers_generate_return_audio(release, model):
    full = release[0]
    with T.greedy_predictor(full.talker.code_predictor), captured_talker(full) as seen, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(PROMPT)[None], speaker="Ethan", return_audio=True,
            thinker_max_new_tokens=ANSWER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=IM_END,
            talker_max_new_tokens=FRAMES, talker_do_sample=False, talker_repetition_penalty=1.0)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_codes = torch.stack([h[-1] for h in seen[0].hidden_states if h[-1] is not None], dim=1)[0].T.numpy()

    answer = greedy_answer(model, PROMPT, ANSWER_TOKENS, IM_END)
    np.testing.assert_array_equal(answer, sequence[len(PROMPT):])
    assert len(answer) >= 4, "the answer is too short to have trailing text rows"
    # transformers' talker reads every generated row but the last token's (<|im_end|> when the answer ended)
    spoken = S.speak(model, PROMPT, answer[:-1], speaker="Ethan", max_new_tokens=FRAMES)
    assert want_codes.shape[1] >= 4 and len(set(want_codes[1:].ravel().tolist())) > 2
    np.testing.assert_array_equal(spoken.codes, want_codes)
    np.testing.assert_array_equal(spoken.talker_tokens, seen[0].sequences[0].numpy())
    peak = np.abs(wav).max()
    assert peak > 0.05, "the reference waveform is (near) silent: the test would prove nothing"
    assert spoken.pcm.shape == wav.shape and spoken.pcm.dtype == np.float32
    err = np.abs(spoken.pcm - wav).max()
    assert err <= 1e-4 * peak, f"waveform max error {err} (peak {peak})"
    pcm16 = spoken.pcm16()
    assert pcm16.dtype == np.int16 and np.abs(pcm16.astype(np.int32) - np.round(wav * 32767)).max() <= 1
    # a trailing <|im_end|> is not spoken; the voice is matched case-insensitively
    again = S.speak(model, PROMPT, np.append(answer[:-1], IM_END), speaker="ethan", max_new_tokens=FRAMES)
    np.testing.assert_array_equal(again.codes, spoken.codes)
    other = S.speak(model, PROMPT, answer[:-1], speaker="Chelsie", max_new_tokens=FRAMES)
    assert not np.array_equal(other.talker_tokens, spoken.talker_tokens)  # the speaker id reaches the talker


def test_bad_speech_requests_are_refused_by_name(release, model):
    with pytest.warns(UserWarning, match="no tokenizer"):
        thinker_only = omnijax.load(release[2]["thinker"])
    with pytest.raises(S.SpeechUnavailableError, match="convert the full Qwen3-Omni release"):
        S.speak(thinker_only, PROMPT, [5, 6, 7])
    with pytest.raises(S.UnknownVoiceError, match=r"'aiden'.*\['chelsie', 'ethan'\]"):
        S.speak(model, PROMPT, [5, 6, 7], speaker="aiden")
    audio = Q.IDS["audio_token_id"]
    prompt = np.concatenate([PROMPT[:-3], [IM_START, TTS["user_token_id"], NL, audio, IM_END, NL], PROMPT[-3:]])
    with pytest.raises(ValueError, match="multimodal placeholders.*audio_token_id"):
        S.speak(model, prompt, [5, 6, 7])
    with pytest.raises(ValueError, match="answer_ids holds no text"):
        S.speak(model, PROMPT, [IM_END])
    with pytest.raises(ValueError, match=r"answer_ids must lie in \[0, 300\)"):
        S.speak(model, PROMPT, [5, 300])
    with pytest.raises(ValueError, match="max_new_tokens"):
        S.speak(model, PROMPT, [5, 6], max_new_tokens=0)
    with pytest.raises(ValueError, match="last turn must be the assistant"):
        S.speak(model, PROMPT[:-3], [5, 6])


def _edited_source(release, tmp_path, edit):
    src = tmp_path / "src"
    shutil.copytree(release[1] / "single", src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["code2wav_config"].update(num_quantizers=8), "code2wav_config.num_quantizers"),
    (lambda c: c["talker_config"].update(thinker_hidden_size=32), "talker_config.thinker_hidden_size"),
    (lambda c: c["talker_config"]["text_config"].update(use_flux=1), "talker_config.text_config.use_flux"),
    (lambda c: c.update(tts_pad_token_id=5000), "speech.tts_pad_token_id"),
])
def test_speech_configs_omnijax_cannot_honour_are_refused_before_any_tensor(release, tmp_path, monkeypatch, edit,
                                                                          match):
    from omnijax.checkpoint.safetensors import SafetensorsCheckpoint

    src = _edited_source(release, tmp_path, edit)
    monkeypatch.setattr(SafetensorsCheckpoint, "read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(ConvertError, match=match):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_release_missing_its_talker_tensors_is_refused_by_name(release, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = _edited_source(release, tmp_path, lambda c: None)
    tensors = load_file(src / "model.safetensors")
    del tensors["talker.codec_head.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"lacks tensor\(s\) 'talker\.codec_head\.weight'"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    save_file({k: v for k, v in tensors.items() if not k.startswith("code2wav.")}, src / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"no code2wav\.\* tensors.*enable_audio_output false"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
