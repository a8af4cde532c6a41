"""Qwen2.5-Omni speaks about audio: `speech.speak(..., media=...)` recomputes the thinker's last layer over a prompt
holding an audio clip (the audio encoder's rows at its placeholders) and equals transformers' `generate(input_features=
..., return_audio=True, talker_do_sample=False)` (the same talker tokens, the waveform within 1e-4 of its peak, the
DiT's noise drawn from the same torch seed); `Chat` keeps those rows as it feeds the clip (tap 0) and speaks
`speak()`'s PCM, and the server's replay (`speech_output.MediaReplay`) keeps the same rows (an image's too, with its
grid); a video without its rows or layout and rows that do not fit are refused by name (speak() with an image:
`test_speech_media_image`, with a video: `test_speech_media_video`).

The release is `test_speech`'s tiny full model, saved single-file with the tiny ChatML tokenizer and converted once.
"""

import warnings

import numpy as np
import pytest

import omnijax
from omnijax.chat import SpeakOptions
from omnijax.conversation import Conversation
from omnijax.convert import convert_checkpoint
from omnijax.models.encoders.log_mel import log_mel
from omnijax.models.qwen2_5_omni import frontend as F
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStreaming
from omnijax.models.speech import MediaRows, media_rows
from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
from omnijax.serve.speech_output import MediaReplay
from tests._support.speech_refs import assert_speaks_as_transformers, captured_talker

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402
from tests.models.qwen2_5_omni import test_talker as T  # noqa: E402

IM_START, IM_END, NL = TS.IM_START, TS.IM_END, TS.NL
CLIP = F.tone(1.0, 330.0, seed=5)  # 1 s at 16 kHz: 25 audio tokens
IMAGE = F.synthetic_frames(0.5, 2.0, 56, 84, seed=3)[0]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """`test_speech`'s release saved single-file with its voices and the tiny ChatML tokenizer, converted once:
    transformers' model (its voices loaded) and the converted directory."""
    full = T.seeded_full_model()
    src = tmp_path_factory.mktemp("speech25_media") / "hf"
    full.save_pretrained(src, safe_serialization=True)
    torch.save(TS._voices(full), src / "spk_dict.pt")
    full.load_speakers(src / "spk_dict.pt")
    write_tiny_tokenizer(src, vocab_size=300, special_tokens=TS.SPECIALS, chat_template=CHATML_TEMPLATE)
    return full, convert_checkpoint(src, src.parent / "out", progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def model(release):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return omnijax.load(release[1])


def STREAMING(model):  # noqa: N802 - what Chat's SpeakOptions(first_chunk=4, chunk=5) streams Token2Wav with
    return Token2WavStreaming.for_tokens(model.speech.token2wav.config.dit, 4, 5)


def _audio(model, start):
    """The clip's ids and its `MediaRows` (the encoder's rows at its placeholders, placed from `start`)."""
    chunk = F.audio_chunk(model, CLIP, unit=1)
    ids = np.asarray(chunk.token_ids)[0][np.asarray(chunk.valid, bool)[0]]
    return ids, media_rows(chunk, chunk.embeds, 0, start, model.omni)


@pytest.mark.parametrize("speaker", ["Chelsie"])
def test_speak_about_audio_equals_transformers_generate_return_audio(release, model, speaker):
    full = release[0]
    head = [IM_START, 10, NL, 11, 12, IM_END, NL, IM_START, 14, NL]
    ids, rows = _audio(model, len(head))
    prompt = np.asarray([*head, *ids, 15, 16, IM_END, NL, IM_START, 20, NL])
    assert rows.rows.shape[0] == 25 and rows.layer == 0 and np.abs(rows.rows).max() > 0.05
    mel = log_mel(CLIP)
    torch.manual_seed(TS.SEED)  # the DiT's torch.randn is the first draw after it
    with captured_talker(full) as seen, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(prompt)[None], input_features=torch.as_tensor(mel)[None],
            feature_attention_mask=torch.ones((1, mel.shape[1]), dtype=torch.long), speaker=speaker,
            return_audio=True, thinker_max_new_tokens=TS.ANSWER_TOKENS, thinker_do_sample=False,
            thinker_eos_token_id=IM_END, talker_max_new_tokens=TS.FRAMES, talker_do_sample=False,
            talker_eos_token_id=T.STOP)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_tokens = seen[0][0, len(prompt) + 2:].numpy()
    answer = sequence[len(prompt):]
    assert len(answer) >= 3, "the answer is too short to have trailing text rows"
    spoken = S.speak(model, prompt, answer[:-1], speaker=speaker, max_new_tokens=TS.FRAMES, noise=TS._torch_noise,
                     media=[rows])
    assert_speaks_as_transformers(spoken, want_tokens, wav)
    # the clip's rows matter: zero features give other speech
    blank = MediaRows(positions=rows.positions, rows=np.zeros_like(rows.rows), layer=0)
    other = S.speak(model, prompt, answer[:-1], speaker=speaker, max_new_tokens=TS.FRAMES, noise=TS._torch_noise,
                    media=[blank])
    peak = np.abs(wav).max()
    assert not np.array_equal(other.talker_tokens, want_tokens) or np.abs(other.pcm - wav).max() > 1e-2 * peak


def test_media_speak_cannot_take_is_refused_by_name(model):
    head = [IM_START, 10, NL]
    ids, rows = _audio(model, len(head))
    prompt = np.asarray([*head, *ids, IM_END, NL, IM_START, 20, NL])
    with pytest.raises(ValueError, match=r"placeholders \(audio_token_id\) .* without their thinker states"):
        S.speak(model, prompt, [5, 6])
    with pytest.raises(ValueError, match=r"holds hidden_states\[2\], the talker reads hidden_states\[0\]"):
        S.speak(model, prompt, [5, 6], media=[MediaRows(rows.positions, rows.rows, layer=2)])
    with pytest.raises(ValueError, match="not placeholders"):
        S.speak(model, prompt, [5, 6], media=[MediaRows(rows.positions - 1, rows.rows, layer=0)])
    image = np.asarray([*head, model.omni.vision_start_token_id, model.omni.image_token_id,
                        model.omni.vision_end_token_id, IM_END, NL, IM_START, 20, NL])
    with pytest.raises(ValueError, match=r"placeholders \(image_token_id\) .* without their thinker states"):
        S.speak(model, image, [5, 6])
    with pytest.raises(ValueError, match="image group at 3 without its grid"):
        S.speak(model, image, [5, 6], media=[MediaRows(np.asarray([4]), rows.rows[:1], layer=0)])
    with pytest.raises(ValueError, match="image group at 3 that does not fill its grid's 6 placeholders"):
        S.speak(model, image, [5, 6], media=[MediaRows(np.asarray([4]), rows.rows[:1], layer=0, grid=(1, 4, 6))])
    video = np.where(image == model.omni.image_token_id, model.omni.video_token_id, image)
    with pytest.raises(ValueError, match=r"placeholders \(video\) .* without their thinker states"):
        S.speak(model, video, [5, 6])
    with pytest.raises(ValueError, match="video group at 3 without its layout"):  # rows, but not where it lies
        S.speak(model, video, [5, 6], media=[MediaRows(np.asarray([4]), rows.rows[:1], layer=0)])


def test_chat_keeps_the_audio_and_image_rows_and_speaks_about_them(model):
    """`Chat` feeds the clip with tap 0 and keeps its rows (the encoder's features, also after a system turn: this
    talker reads every position); its PCM is `speak_streamed()`'s of its ids and rows (`speak()` with Token2Wav
    streamed). An image's rows are kept with its grid the same way, by `Chat` and by the server's replay."""
    chatty = model  # with its tokenizer
    config = omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=4)
    chat = omnijax.Chat(chatty, config)
    chat.system("Be brief.")
    chat.audio(CLIP)  # after the system turn: read all the same
    # 3 tokens: the tiny model's 4th answer token here is <|IMAGE|> (295), which an answer cannot speak
    items = list(chat.ask("What was it?", max_tokens=3, speak=SpeakOptions(
        voice="chelsie", max_speech_tokens=TS.FRAMES, first_chunk=4, chunk=5)))
    chunks = [i for i in items if not isinstance(i, str)]
    spoken = chat.last_spoken
    assert len(spoken.answer_ids) == 3 and not set(spoken.answer_ids) & set(chatty.omni.placeholder_ids)
    (kept,) = spoken.media
    ids, rows = _audio(chatty, int(kept.positions[0]) - 1)
    np.testing.assert_array_equal(kept.positions, rows.positions)
    np.testing.assert_allclose(kept.rows, rows.rows, rtol=0, atol=1e-6 * np.abs(rows.rows).max())
    want = S.speak_streamed(chatty, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids),
                                        speaker="Chelsie", max_new_tokens=TS.FRAMES, media=spoken.media,
                                        streaming=STREAMING(chatty))
    assert np.abs(want.pcm).max() > 0.05, "the waveform is (near) silent: the test would prove nothing"
    np.testing.assert_array_equal(np.concatenate(chunks), want.pcm)
    # the server's replay of the same parts (split at 8 tokens) keeps the same rows; an image it cannot speak
    conversation = Conversation(chatty, chatty.tokenizer, 8)
    parts = conversation.message("system", "Be brief.") + conversation.audio(CLIP)
    replay = MediaReplay(chatty, config, 64, conversation.units)
    replay.fed(parts + conversation.message("user", "What was it?") + conversation.prompt(4).parts)
    assert replay.ids == list(spoken.prompt_ids) and replay.needs_replay
    (again,) = replay.rows()
    np.testing.assert_array_equal(again.positions, kept.positions)
    np.testing.assert_allclose(again.rows, kept.rows, rtol=0, atol=1e-6 * np.abs(kept.rows).max())
    # an image: Chat keeps the vision encoder's rows with the patch grid, and speaks speak_streamed()'s PCM of them
    # (speak() with an image equals transformers: test_speech_media_image)
    seeing = omnijax.Chat(chatty, config)
    seeing.user("Look.")
    seeing.image(IMAGE)
    chunks = [i for i in seeing.ask("What was it?", max_tokens=3, speak=SpeakOptions(
        voice="chelsie", max_speech_tokens=TS.FRAMES, first_chunk=4, chunk=5)) if not isinstance(i, str)]
    spoken = seeing.last_spoken
    (kept,) = spoken.media
    image = F.image_chunk(chatty, IMAGE, unit=1)
    valid = np.asarray(image.valid, bool)[0]
    holes = np.asarray(image.token_ids)[0][valid] == chatty.omni.image_token_id
    assert kept.grid == (1, 4, 6) and kept.layer == 0 and len(kept.positions) == 6
    np.testing.assert_array_equal(np.asarray(spoken.prompt_ids)[kept.positions], chatty.omni.image_token_id)
    want_rows = np.asarray(image.embeds)[0][:valid.shape[0]][valid][holes]
    np.testing.assert_allclose(kept.rows, want_rows, rtol=0, atol=1e-6 * np.abs(want_rows).max())
    want = S.speak_streamed(chatty, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids),
                                        speaker="Chelsie", max_new_tokens=TS.FRAMES, media=spoken.media,
                                        streaming=STREAMING(chatty))
    assert np.abs(want.pcm).max() > 0.05, "the waveform is (near) silent: the test would prove nothing"
    np.testing.assert_array_equal(np.concatenate(chunks), want.pcm)
    # the server's replay keeps the same image rows and grid
    conversation = Conversation(chatty, chatty.tokenizer, 8)
    parts = conversation.message("user", "Look.") + conversation.image(IMAGE)
    replay = MediaReplay(chatty, config, 64, conversation.units)
    replay.fed(parts + conversation.message("user", "What was it?") + conversation.prompt(4).parts)
    assert replay.ids == list(spoken.prompt_ids) and replay.unspeakable is None
    (again,) = replay.rows()
    assert again.grid == kept.grid
    np.testing.assert_array_equal(again.positions, kept.positions)
    np.testing.assert_allclose(again.rows, kept.rows, rtol=0, atol=1e-6 * np.abs(kept.rows).max())
