"""A converted Qwen2.5-Omni release that speaks: `omnijax convert` of a full release (talker, Token2Wav, the voices of
`spk_dict.pt` read without torch; single-file and sharded), `omnijax.load` (`model.speech`), and `speech.speak`
against transformers' `generate(..., return_audio=True, talker_do_sample=False)`: the same greedy text answer, the
same codec tokens, the same waveform (the DiT's initial noise drawn from the same torch seed on both sides).

The reference is `test_talker.seeded_full_model()` saved with `save_pretrained` (every tensor in the release's
layout) plus a `spk_dict.pt` written with `torch.save` (reference mels in bfloat16, as the release stores them).
"""

import json
import shutil
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chat import SpeakOptions
from omnijax.convert import convert_checkpoint
from omnijax.errors import MissingTensorError
from omnijax.models.family import SpeechOutput
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStreaming
from omnijax.models.qwen2_5_omni.voices import VoiceFileError, read_speaker_dict
from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
from tests._support.speech_refs import captured_talker, greedy_answer
from tests.models.qwen2_5_omni import test_talker as T

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

IM_START, IM_END, NL = 298, 299, 198
PROMPT = np.asarray([IM_START, 10, NL, 11, 12, 13, IM_END, NL, IM_START, 14, NL, 15, 16, 17, 18, IM_END, NL,
                     IM_START, 20, NL])
ANSWER_TOKENS, FRAMES, SEED = 6, 14, 1234


def _voices(full) -> dict:
    voices = T.speakers(full)
    for v in voices.values():
        v["ref_mel"] = v["ref_mel"].to(torch.bfloat16)  # as the release's spk_dict.pt stores them
    return voices


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The full release saved single-file, sharded, without its voices, and thinker-only; converted."""
    full = T.seeded_full_model()
    root = tmp_path_factory.mktemp("speech25")
    for name, shard in (("single", None), ("sharded", "300KB"), ("novoices", None)):
        full.save_pretrained(root / name, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
        if name != "novoices":
            torch.save(_voices(full), root / name / "spk_dict.pt")
    full.thinker.save_pretrained(root / "thinker", safe_serialization=True)
    full.load_speakers(root / "single" / "spk_dict.pt")
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
    # nothing of the speech output skipped (the one unused audio tensor a release ships is, for each source)
    assert said and all(line.endswith("audio_tower.audio_bos_eos_token.weight") for line in said), said
    manifest = json.loads((out["single"] / "omnijax.json").read_text())
    assert manifest["source"]["speech_output"] is True and manifest["talker"]["codec_eos_id"] == 60
    speech = model.speech
    assert isinstance(speech, S.Qwen25Speech) and isinstance(speech, SpeechOutput)
    assert speech.voices == ("Chelsie", "Ethan") and speech.sample_rate == 24000
    from safetensors.numpy import load_file

    saved = load_file(root / "single" / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(speech.talker.proj[...]), saved["talker.thinker_to_talker_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(speech.talker.layers.q_bias[...])[1],
                                  saved["talker.model.layers.1.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(np.asarray(speech.token2wav.dit.codec_embed[...]),
                                  saved["token2wav.code2wav_dit_model.text_embed.codec_embed.weight"])
    for name, voice in full.speaker_map.items():  # the voices as transformers reads them (bfloat16 widened)
        ours = speech.voice(name)
        np.testing.assert_array_equal(ours.reference_mel, voice["ref_mel"].float().numpy()[0])
        np.testing.assert_array_equal(ours.conditioning, voice["cond"].numpy()[0])
        assert ours.bos_token == voice["bos_token"]
    with pytest.warns(UserWarning, match="no tokenizer"):
        sharded = omnijax.load(out["sharded"]).speech
        assert omnijax.load(out["thinker"]).speech is None
        half = omnijax.load(out["single"], dtype="bfloat16").speech
    for a, b in ((speech.talker, sharded.talker), (speech.token2wav, sharded.token2wav)):
        jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)))
    # a dtype asked at load reaches the talker; Token2Wav stays as converted (float32, as transformers runs it)
    assert {str(x.dtype) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(half.talker)))} == {"bfloat16"}
    assert half.talker.config.decoder.dtype == "bfloat16"
    assert {str(x.dtype) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(half.token2wav)))} == {"float32"}


def test_a_release_without_its_voices_is_refused(release, tmp_path):
    root = release[1]
    with pytest.raises(MissingTensorError, match="spk_dict.pt"):
        convert_checkpoint(root / "novoices", tmp_path / "out", progress=False, log=lambda _: None)
    assert not (tmp_path / "out" / "omnijax.json").exists()
    bad = tmp_path / "spk_dict.pt"
    torch.save({"Chelsie": {"cond": torch.zeros(3), "ref_mel": torch.zeros(2, 8), "bos_token": 1,
                            "extra": torch.nn.Linear(1, 1)}}, bad)
    with pytest.raises(VoiceFileError, match="refusing to load"):
        read_speaker_dict(bad)
    torch.save({"Chelsie": {"cond": torch.zeros(3), "bos_token": 1}}, bad)
    with pytest.raises(VoiceFileError, match="ref_mel"):
        read_speaker_dict(bad)


@pytest.mark.parametrize("edit, error", [
    (lambda c: c["talker_config"].update(use_flux=1), "talker_config.use_flux"),
    (lambda c: c["talker_config"].update(embedding_size=32), "talker_config.embedding_size"),
    (lambda c: c["token2wav_config"]["dit_config"].update(rope_parameters={"rope_type": "yarn"}), "rope"),
    (lambda c: c.pop("talker_config"), "no 'talker_config'"),
])
def test_speech_configs_omnijax_cannot_honour_are_refused_by_name(release, tmp_path, edit, error):
    src = tmp_path / "src"
    shutil.copytree(release[1] / "single", src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(omnijax.errors.ConvertError, match=error):
        convert_checkpoint(src, tmp_path / "out", progress=False, log=lambda _: None)
    assert not (tmp_path / "out" / "omnijax.json").exists()


def test_a_release_missing_its_talker_tensors_is_refused_by_name(release, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(release[1] / "single", src)
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("talker.")}, src / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"no talker\.\* tensors"):
        convert_checkpoint(src, tmp_path / "out", progress=False, log=lambda _: None)
    # with enable_audio_output false the same source converts, its token2wav.* tensors skipped and logged
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "enable_audio_output": False}))
    said: list[str] = []
    out = convert_checkpoint(src, tmp_path / "thinker_out", progress=False, log=said.append)
    assert any("speech-output tensors" in line and "token2wav." in line for line in said), said
    with pytest.warns(UserWarning, match="no tokenizer"):
        assert omnijax.load(out).speech is None


def _torch_noise(shape):
    torch.manual_seed(SEED)
    return torch.randn(list(shape)).numpy()


@pytest.mark.parametrize("speaker", ["Chelsie", "Ethan"])
def test_speak_equals_transformers_generate_return_audio(release, model, speaker):
    full = release[0]
    torch.manual_seed(SEED)  # the DiT's torch.randn is the first draw after it (greedy thinker and talker draw none)
    with captured_talker(full) as seen, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(PROMPT)[None], speaker=speaker, return_audio=True,
            thinker_max_new_tokens=ANSWER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=IM_END,
            talker_max_new_tokens=FRAMES, talker_do_sample=False, talker_eos_token_id=T.STOP)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_tokens = seen[0][0, len(PROMPT) + 2:].numpy()

    answer = greedy_answer(model, PROMPT, ANSWER_TOKENS, IM_END)
    np.testing.assert_array_equal(answer, sequence[len(PROMPT):])
    assert len(answer) >= 3, "the answer is too short to have trailing text rows"
    # transformers' talker reads every generated row but the last token's (<|im_end|> when the answer ended)
    spoken = S.speak(model, PROMPT, answer[:-1], speaker=speaker, max_new_tokens=FRAMES, noise=_torch_noise)
    np.testing.assert_array_equal(spoken.talker_tokens, want_tokens)
    assert len(want_tokens) >= 6 and len(set(want_tokens.tolist())) > 2, want_tokens
    np.testing.assert_array_equal(spoken.codes, want_tokens[:-1])
    peak = np.abs(wav).max()
    assert peak > 0.05, "the reference waveform is (near) silent: the test would prove nothing"
    assert spoken.pcm.shape == wav.shape and spoken.pcm.dtype == np.float32
    err = np.abs(spoken.pcm - wav).max()
    assert err <= 1e-4 * peak, f"max error {err:.3g} > 1e-4 x peak {peak:.3g}"
    # the SpeechOutput method: the same talker, Token2Wav streamed (test_speech_stream: equal to speak() where the
    # look-ahead covers the utterance)
    chunks = list(model.speech.speak_chunks(model, PROMPT, answer[:-1], voice=speaker.lower(),
                                            max_new_tokens=FRAMES, first_chunk=4, chunk=5))
    streamed = S.speak_streamed(
        model, PROMPT, answer[:-1], speaker=speaker, max_new_tokens=FRAMES,
        streaming=Token2WavStreaming.for_tokens(model.speech.token2wav.config.dit, 4, 5))
    np.testing.assert_array_equal(streamed.talker_tokens, want_tokens)
    np.testing.assert_array_equal(np.concatenate(chunks), streamed.pcm)


def test_bad_speech_requests_are_refused(release, model):
    with pytest.raises(S.UnknownVoiceError, match="'Aiden'.*Chelsie"):
        S.speak(model, PROMPT, [5, 6], speaker="Aiden")
    with pytest.raises(S.UnknownVoiceError, match="Ethan"):
        list(model.speech.speak_chunks(model, PROMPT, [5, 6], voice="nobody"))
    with pytest.raises(ValueError, match="placeholders"):
        S.speak(model, np.concatenate([PROMPT, [290]]), [5, 6])
    with pytest.raises(ValueError, match="no text to speak"):
        S.speak(model, PROMPT, [IM_END])
    with pytest.raises(ValueError, match=r"answer_ids must lie in \[0, 300\)"):
        S.speak(model, PROMPT, [5, 300])
    with pytest.raises(ValueError, match="max_new_tokens"):
        S.speak(model, PROMPT, [5, 6], max_new_tokens=0)
    with pytest.raises(ValueError, match="noise returned shape"):
        S.speak(model, PROMPT, [5, 6], max_new_tokens=4, noise=lambda shape: np.zeros((1, 2, 3)))
    with pytest.warns(UserWarning, match="no tokenizer"):
        thinker_only = omnijax.load(release[2]["thinker"])
    with pytest.raises(S.SpeechUnavailableError, match="full release"):
        S.speak(thinker_only, PROMPT, [5, 6])


def test_a_manifest_with_part_of_the_speech_output_is_refused(release, tmp_path):
    out = tmp_path / "partial"
    shutil.copytree(release[2]["single"], out)
    manifest = json.loads((out / "omnijax.json").read_text())
    del manifest["token2wav"]
    (out / "omnijax.json").write_text(json.dumps(manifest))
    with pytest.raises(omnijax.checkpoint.format.CheckpointFormatError, match="without \\['token2wav'\\]"):
        omnijax.load(out)


# the tiny thinker's special ids (`omnijax.testing.checkpoints.tiny_token_ids(300)`; the byte alphabet needs the 256
# ids below them, so the talker's text ids 250 .. 254 stay ordinary tokens here)
SPECIALS = {"<|audio_pad|>": 290, "<|audio_start|>": 291, "<|audio_end|>": 292, "<|vision_start|>": 293,
            "<|vision_end|>": 294, "<|image_pad|>": 295, "<|video_pad|>": 296, "<|endoftext|>": 297,
            "<|im_start|>": IM_START, "<|im_end|>": IM_END}


def test_spoken_answers_through_chat(release, tmp_path):
    """`Chat.ask(..., speak=...)` on the converted release (with a tiny ChatML tokenizer): the text first, then PCM
    chunks whose concatenation is `speak` of the conversation's ids, Token2Wav streamed in chunks of 4 then 5 codec
    tokens (rounded up to DiT blocks)."""
    src = tmp_path / "hf"
    shutil.copytree(release[1] / "single", src)
    write_tiny_tokenizer(src, vocab_size=300, special_tokens=SPECIALS, chat_template=CHATML_TEMPLATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(convert_checkpoint(src, tmp_path / "out", progress=False, log=lambda _: None))
    chat = omnijax.Chat(model, omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=4))
    items = list(chat.ask("Say hello.", max_tokens=6, speak=SpeakOptions(
        voice="chelsie", max_speech_tokens=FRAMES, first_chunk=4, chunk=5)))
    kinds = [isinstance(i, str) for i in items]
    assert kinds == sorted(kinds, reverse=True), "text deltas come before the PCM chunks"
    chunks = [i for i in items if not isinstance(i, str)]
    spoken = chat.last_spoken
    assert spoken.answer_ids and list(spoken.prompt_ids[:1]) == [IM_START]
    want = S.speak_streamed(  # speak() with Token2Wav streamed as the options say (test_speech_stream)
        model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids), speaker="Chelsie", max_new_tokens=FRAMES,
        streaming=Token2WavStreaming.for_tokens(model.speech.token2wav.config.dit, 4, 5))
    per = model.speech.token2wav.config.samples_per_token
    assert want.codes.size > 4 and sum(c.shape[0] for c in chunks) == want.codes.size * per
    assert np.abs(want.pcm).max() > 0.05, "the waveform is (near) silent: the test would prove nothing"
    np.testing.assert_array_equal(np.concatenate(chunks), want.pcm)
    assert spoken.samples == want.pcm.shape[0]
