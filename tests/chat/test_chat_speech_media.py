"""Spoken answers of conversations holding media (Qwen3-Omni): the compiled step's static tap of
`hidden_states[k]` against transformers' `output_hidden_states`, and `Chat.ask(speak=...)` with an image and an
audio clip in a user turn against transformers' `generate(return_audio=True)`: the thinker's answer, the talker's
prompt embeddings and positions, its tokens, the codes and the waveform.

The release is the seeded tiny full model of `test_talker` with two changes: the talker config carries the thinker's
media token ids (as the release's does, so the talker's own positions lay images out; with transformers' defaults the
tiny talker would see every id as text) and the audio encoder takes 128 mel bins (Chat's audio frontend).
"""

import io
import warnings

import numpy as np
import pytest

import omnijax
from omnijax.chat import SpeakOptions
from omnijax.chunks.chunk import pad_chunk
from omnijax.convert import convert_checkpoint
from omnijax.models.qwen3_omni import frontend as F
from omnijax.models.qwen3_omni import speech as S
from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
from tests._support import qwen3_omni_models as Q
from tests._support.speech_refs import captured_talker_calls, perturb_thinker_and_talker

torch = pytest.importorskip("torch", reason="torch (the test extra) builds the transformers release")
transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests.chat import test_chat_speech as CS  # noqa: E402  (needs torch)
from tests.models.qwen3_omni import test_talker as T  # noqa: E402

TTS = T.TTS
IM_END = TTS["im_end_token_id"]
MEDIA_IDS = {k: Q.IDS[k] for k in ("audio_token_id", "image_token_id", "video_token_id", "vision_start_token_id",
                                   "audio_start_token_id", "position_id_per_seconds")}
SPEECH_TOKENS = 10
SYSTEM, LOOK, QUESTION = "Be brief.", "Look and listen.", "What was it?"
LAYER = T.TALKER["accept_hidden_layer"]  # 2 of the thinker's 3 layers: after DeepStack level 1 would be added


def media_full_model():
    """`test_talker.seeded_full_model` with the thinker's media ids in the talker config and 128 mel bins."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    from tests.models.qwen3_omni.test_code2wav import seeded_reference

    torch.manual_seed(0)
    full = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(
        thinker_config=Q.thinker_config(audio_overrides={"num_mel_bins": 128}).to_dict(),
        talker_config={**T.TALKER, **MEDIA_IDS}, code2wav_config=T.CODE2WAV, enable_audio_output=True,
        **TTS)).eval()
    perturb_thinker_and_talker(full)
    full.code2wav.load_state_dict(seeded_reference(T.CODE2WAV).state_dict())
    return full


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("spoken_media")
    full = media_full_model()
    full.save_pretrained(root / "hf", safe_serialization=True)
    write_tiny_tokenizer(root / "hf", vocab_size=Q.TEXT["vocab_size"], special_tokens=CS.SPECIALS,
                         chat_template=CHATML_TEMPLATE)
    out = convert_checkpoint(root / "hf", root / "omnijax", progress=False, log=lambda _: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return root, full, omnijax.load(out)


IMAGE = F.synthetic_frames(0.5, 2.0, 64, 96, seed=3)[0]  # 64 x 96: grid (1, 4, 6), 6 image tokens
OTHER = F.synthetic_frames(0.5, 2.0, 64, 96, seed=9)[0]  # same size (see the conversation below)
PCM = F.tone(1.0, 330.0, seed=5)  # 1 s: 13 audio tokens


def _hidden_states(full, ids, images, clip):
    """transformers' thinker `hidden_states` (all layers) over `ids` with the images and the clip."""
    pixels = [F.preprocess_image(im) for im in images]
    mel = F.log_mel(clip)
    inputs = dict(input_ids=ids[None], attention_mask=np.ones((1, len(ids)), np.int64),
                  pixel_values=np.concatenate([p for p, _ in pixels]),
                  image_grid_thw=np.concatenate([g for _, g in pixels]), input_features=mel[None],
                  feature_attention_mask=np.ones((1, mel.shape[1]), np.int64))
    with torch.no_grad(), Q.windowed_audio(full.thinker.audio_tower):
        out = full.thinker(**{k: torch.as_tensor(v) for k, v in inputs.items()}, output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states], inputs


def test_the_step_taps_hidden_states_as_transformers_records_them(release):
    """`Session.feed(chunk, tap=k)` returns transformers' `hidden_states[k]` of the chunk's tokens (k = 0: the
    input embeddings with the encoders' features; 2: layer 1's output before its DeepStack level; 3 = L: the
    final-normed output); without a tap the step's output is the same bit for bit and carries none."""
    _, full, model = release
    chunks = [F.system(model, [1, 2, 3], unit=0), F.image_chunk(model, IMAGE, unit=1),
              F.audio_chunk(model, PCM, unit=2), F.text(model, [10, 11, 12], unit=3, answer_tokens=1)]
    # padded to the longest (invalid tokens write nothing): one step program per tap, not one per tap and length
    longest = max(c.length for c in chunks)
    chunks = [pad_chunk(c, longest) for c in chunks]
    ids = np.concatenate([np.asarray(c.token_ids)[0][np.asarray(c.valid)[0]] for c in chunks])
    want, _ = _hidden_states(full, ids, [IMAGE], PCM)
    config = omnijax.StreamConfig(num_pages=16, page_size=16, max_answer_tokens=1)
    plain = omnijax.Session(model, config)
    outs = [plain.feed(c) for c in chunks]
    assert all(o.tapped is None for o in outs)
    for k in (0, LAYER, Q.TEXT["num_hidden_layers"]):
        session = omnijax.Session(model, config)
        rows = []
        for chunk, out in zip(chunks, outs):
            tapped = session.feed(chunk, tap=k)
            np.testing.assert_array_equal(np.asarray(tapped.logits), np.asarray(out.logits))
            np.testing.assert_array_equal(np.asarray(tapped.tokens), np.asarray(out.tokens))
            valid = np.asarray(chunk.valid)[0]
            rows.append(np.asarray(tapped.tapped)[0][valid])
        got = np.concatenate(rows)
        assert np.abs(want[k]).max() > 0.05
        err = np.abs(got - want[k]).max()
        assert err <= 1e-4 * max(1.0, np.abs(want[k]).max()), f"hidden_states[{k}]: max error {err}"
    with pytest.raises(ValueError, match=r"tap must be a hidden_states index in \[0, 3\]"):
        omnijax.Session(model, config).feed(chunks[0], tap=4)


def _close(got, want, rel=2e-5):
    """Within `rel` of the reference's peak (float32 sums in another order)."""
    peak = np.abs(want).max()
    assert got.shape == want.shape and peak > 0.05
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * peak)


def _media_ids(kind, n):
    ids = Q.IDS
    if kind == "image":
        return [ids["vision_start_token_id"], *[ids["image_token_id"]] * n, ids["vision_end_token_id"]]
    return [ids["audio_start_token_id"], *[ids["audio_token_id"]] * n, ids["audio_end_token_id"]]


def test_a_spoken_answer_about_media_equals_transformers_generate(release):
    root, full, model = release
    chat = omnijax.Chat(model, CS.stream_config())
    chat.system(SYSTEM)
    chat.image(OTHER)  # after the system turn: the thinker sees it, the talker skips it (no rows kept)
    chat.user(LOOK)
    chat.image(IMAGE)  # in the user turn: the talker reads layer 2 at its placeholders
    chat.audio(PCM)
    items = list(chat.ask(QUESTION, max_tokens=6, speak=SpeakOptions(max_speech_tokens=SPEECH_TOKENS,
                                                                       first_chunk=4, chunk=5)))
    text, chunks = CS.split(items)
    spoken = chat.last_spoken
    # the prompt: transformers' own renderings of the turns, the media units' ids between them
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LOOK},
             {"role": "user", "content": QUESTION}]
    render = [tokenizer.apply_chat_template(turns[:n], add_generation_prompt=n == 3, tokenize=True,
                                            return_dict=False) for n in (1, 2, 3)]
    prompt = [*render[0], *_media_ids("image", 6), *render[1][len(render[0]):], *_media_ids("image", 6),
              *_media_ids("audio", 13), *render[2][len(render[1]):]]
    assert list(spoken.prompt_ids) == prompt
    # only the user turn's units keep rows: 6 image + 13 audio placeholders x 64 float32
    assert [m.grid for m in spoken.media] == [(1, 4, 6), None]
    assert sum(m.nbytes for m in spoken.media) == 19 * 64 * 4

    ids = np.asarray(prompt)
    hidden, inputs = _hidden_states(full, ids, [OTHER, IMAGE], PCM)
    for m in spoken.media:  # the kept rows are transformers' hidden_states[accept_hidden_layer] there
        _close(m.rows, hidden[LAYER][m.positions])
    with T.greedy_predictor(full.talker.code_predictor), captured_talker_calls(full) as calls, \
            Q.windowed_audio(full.thinker.audio_tower), torch.no_grad():
        sequence, wav = full.generate(
            **{k: torch.as_tensor(v) for k, v in inputs.items()}, speaker="Ethan", return_audio=True,
            thinker_max_new_tokens=6, thinker_do_sample=False, thinker_eos_token_id=IM_END,
            talker_max_new_tokens=SPEECH_TOKENS, talker_do_sample=False, talker_repetition_penalty=1.0)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    (kwargs, result), = calls
    answer = list(sequence[len(prompt):])
    ended = answer[-1] == IM_END
    assert list(spoken.answer_ids) == (answer[:-1] if ended else answer)
    assert model.tokenizer.decode(answer, skip_special_tokens=True) == text
    # transformers' talker reads every generated row but the last token's: Chat speaks the whole answer, so when
    # the answer was cut short (no <|im_end|>) the reference is speak() of the answer less its last token
    reads = answer[:-1]
    mine = S.talker_input(model, ids, reads, speaker="Ethan", media=spoken.media)
    want_rows = kwargs["inputs_embeds"][0].numpy()
    assert mine.rows.shape == want_rows.shape
    _close(mine.rows, want_rows)
    _close(mine.trailing, kwargs["trailing_text_hidden"][0].numpy())
    talker_ids = kwargs["talker_input_ids"]
    want_pos = full.talker.get_rope_index(talker_ids, torch.as_tensor(inputs["image_grid_thw"]), None,
                                          torch.ones_like(talker_ids), False,
                                          torch.as_tensor([inputs["input_features"].shape[-1]]))[0][:, 0].numpy()
    np.testing.assert_array_equal(mine.positions, want_pos)
    assert len(np.unique(want_pos[1])) != len(np.unique(want_pos[0])), "the image layout did not reach positions"
    want_codes = torch.stack([h[-1] for h in result.hidden_states if h[-1] is not None], dim=1)[0].T.numpy()
    spoken_ref = S.speak(model, ids, reads, speaker="Ethan", max_new_tokens=SPEECH_TOKENS, media=spoken.media)
    np.testing.assert_array_equal(spoken_ref.talker_tokens, result.sequences[0].numpy())
    np.testing.assert_array_equal(spoken_ref.codes, want_codes)
    peak = np.abs(wav).max()
    assert peak > 0.05 and spoken_ref.pcm.shape == wav.shape
    assert np.abs(spoken_ref.pcm - wav).max() <= 1e-4 * peak
    # Chat's PCM chunks are speak() of its own ids and rows (the reference itself when the answer ended)
    pcm = np.concatenate(chunks)
    whole = S.speak(model, ids, list(spoken.answer_ids), speaker="Ethan", max_new_tokens=SPEECH_TOKENS,
                    media=spoken.media)
    np.testing.assert_allclose(pcm, whole.pcm, rtol=0, atol=1e-5 * np.abs(whole.pcm).max())
    if ended:
        np.testing.assert_allclose(pcm, wav, rtol=0, atol=1e-4 * peak)
    # without the rows the same prompt is refused by name
    with pytest.raises(ValueError, match=r"multimodal placeholders \(audio_token_id, image_token_id\) in user turns"):
        S.speak(model, ids, reads)


def test_what_a_media_conversation_cannot_speak_is_refused_before_anything_changes(release):
    _, _, model = release
    chat = omnijax.Chat(model, CS.stream_config(), speech_media_bytes=6 * 64 * 4)
    chat.user(LOOK)
    chat.image(IMAGE)  # 6 rows: fits
    assert len(chat._media_rows) == 1
    chat.audio(PCM)  # 13 more: over the bound, everything dropped
    assert chat._media_rows == []
    state, units = chat.session.state, list(chat.units)
    with pytest.raises(ValueError, match=r"outgrew speech_media_bytes=1536 at unit 2 \(audio 1.0 s: 4864 bytes\)"):
        chat.ask(QUESTION, speak=True)
    assert chat.session.state is state and chat.units == units and len(chat.messages) == 1
    other = omnijax.Chat(model, CS.stream_config())
    other.user(LOOK)
    other.av(np.stack([IMAGE] * 2), F.tone(1.0, 330.0, seed=1))  # 1 s at 2 fps
    with pytest.raises(ValueError, match="audiovisual unit in a user turn"):
        other.ask(QUESTION, speak=True)
    with pytest.raises(ValueError, match="speech_media_bytes must be an int >= 0"):
        omnijax.Chat(model, CS.stream_config(), speech_media_bytes=-1)


def test_media_rows_the_talker_cannot_read_are_refused_by_name():
    """`speech_media.thinker_hidden` checks every kept row against the prompt before the talker runs."""
    import jax.numpy as jnp

    from omnijax.models.qwen3_omni import speech_media
    from omnijax.models.speech import MediaRows

    im_start, user, system, image = TTS["im_start_token_id"], TTS["user_token_id"], TTS["system_token_id"], 291
    prompt = np.asarray([im_start, system, 5, IM_END, 295, image, image, 296,  # an image after the system turn
                         im_start, user, 6, IM_END, 295, image, image, 296, 7])  # and one in a user turn
    read = speech_media.user_turns(prompt, im_start, user)
    assert read.tolist() == [False] * 8 + [True] * 9
    holes = {"audio_token_id": 290, "image_token_id": image, "video_token_id": 292}
    embeds = jnp.zeros((len(prompt) + 1, 4))
    sequence = np.append(prompt, 9)

    def rows(positions, layer=LAYER, width=4):
        return MediaRows(positions=np.asarray(positions), rows=np.ones((len(positions), width)), layer=layer)

    got = speech_media.thinker_hidden(embeds, sequence, len(prompt), read, holes, [rows([13, 14])], LAYER)
    assert np.asarray(got)[[13, 14]].tolist() == [[1.0] * 4] * 2 and not np.asarray(got)[5].any()
    for media, says in (([], r"placeholders \(image_token_id\) in user turns at positions \[13, 14\]"),
                        ([rows([13])], r"at positions \[14\]"),
                        ([rows([13, 14], layer=1)], r"holds hidden_states\[1\], the talker reads hidden_states\[2\]"),
                        ([rows([13, 14], width=3)], "rows are 3 wide, the thinker's hidden size is 4"),
                        ([rows([5, 6])], r"prompt positions \[5, 6\] that are not placeholders of a user turn"),
                        ([rows([13, 14]), rows([14])], "already gave")):
        with pytest.raises(ValueError, match=says):
            speech_media.thinker_hidden(embeds, sequence, len(prompt), read, holes, media, LAYER)
    with pytest.raises(ValueError, match="answer_ids holds multimodal placeholders"):
        speech_media.thinker_hidden(embeds, np.append(prompt, image), len(prompt), read, holes, [rows([13, 14])],
                                    LAYER)
    video = prompt.copy()
    video[[13, 14]] = 292
    with pytest.raises(ValueError, match="a user turn holds a video"):
        speech_media.thinker_hidden(embeds, np.append(video, 9), len(prompt), read, holes, [], LAYER)
    with pytest.raises(ValueError, match=r"MediaRows.rows must be \[n, D\] with n = 2"):
        MediaRows(positions=np.asarray([1, 2]), rows=np.ones((3, 4)), layer=2)
    with pytest.raises(ValueError, match="MediaRows.grid"):
        MediaRows(positions=np.asarray([1]), rows=np.ones((1, 4)), layer=2, grid=(1, 0, 2))


def test_watch_speaks_its_answers_about_a_video(release, tmp_path, capsys):
    """`omnijax watch --speak`: the video's units are fed outside the questions' user turns (Qwen3-Omni's talker
    reads the questions and answers only); the WAV holds each answer's speech in turn, equal to a `Chat` fed the same
    units and asked the same with the same settings. Bad speech settings are refused before the video is read."""
    pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")
    from omnijax import commands
    from omnijax.media import video
    from omnijax.media.audio import pcm16, read_wav

    root, _, model = release
    frames = F.synthetic_frames(2.0, 2.0, 64, 96, seed=4)
    clip = video.write_clip(tmp_path / "clip.mp4", frames, 2, F.tone(2.0, 330.0, seed=6))
    out = tmp_path / "answers.wav"
    args = commands.build_parser("watch").parse_args(
        [str(root / "omnijax"), str(clip), "--ask", "What?", "--ask", "Then?", "--pages", "64",
         "--page-size", "16", "--block", "4", "--max-tokens", "6", "--speak", str(out), "--voice", "chelsie",
         "--max-speech-tokens", str(SPEECH_TOKENS)])
    args.command = "watch"
    printed = io.StringIO()
    assert commands.run_watch(args, printed) == 0
    lines = printed.getvalue().splitlines()
    assert [line.startswith("[spoke ") and line.endswith(f" s -> {out}]") for line in lines[:6]] == [
        False, False, True, False, False, True]
    # the same through Chat: the video's units, then the two spoken questions
    chat = omnijax.Chat(model, commands.stream_config(args))
    options = SpeakOptions(voice="chelsie", max_speech_tokens=SPEECH_TOKENS)
    pcm = []
    for unit in chat.units_builder.open_video(clip).units():
        chat.av(*unit)
    for question in ("What?", "Then?"):
        answer = list(chat.ask(question, max_tokens=6, speak=options))
        assert chat.last_spoken.samples > 0
        pcm += [a for a in answer if not isinstance(a, str)]
    samples, rate = read_wav(out)
    assert rate == 24000 and samples.size == sum(p.size for p in pcm)
    np.testing.assert_array_equal(np.round(samples * 32768).astype(np.int16), pcm16(np.concatenate(pcm)))
    for more, says in ((["--voice", "ethan"], "--voice needs --speak"),
                       (["--speak", str(tmp_path / "x.wav"), "--voice", "aiden"], "unknown voice 'aiden'")):
        assert commands.main("watch", [str(root / "omnijax"), str(tmp_path / "missing.mp4"), "--ask", "a",
                                       *more]) == 1
        assert says in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()
