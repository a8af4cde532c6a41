"""`omnijax.Chat`: text turns follow the checkpoint's chat template, answers equal what `stream` generates for the
templated prompt, media go in as units, `kept()` accounts for the cache, refused calls change nothing; and the
`omnijax chat` command line."""

import copy
import io
import json

import numpy as np
import pytest

import omnijax
from omnijax.chat import Chat, ChatTemplateError, format_kept
from omnijax.chunks.chunk import pad_chunk, stack_chunks
from omnijax.chunks.spans import SpanKind
from omnijax.convert import convert_checkpoint
from omnijax.decoding import Sampling
from omnijax.media.audio import resample
from omnijax.models.frontend import bucket
from omnijax.models.qwen2_5_omni import frontend
from omnijax.models.qwen2_5_omni.frontend import MissingEncoderError
from omnijax.models.tokenizer import MINICPMO_4_5_TEMPLATE, write_tiny_tokenizer
from omnijax.retention import OmniPick
from tests._support import tiny_omni

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|AUDIO|>": 151646,
                 "<|audio_bos|>": 151647, "<|audio_eos|>": 151648, "<|vision_bos|>": 151652,
                 "<|vision_eos|>": 151653, "<|IMAGE|>": 151655, "<|VIDEO|>": 151656}
SMALL = {"min_pixels": 56 * 56}
# The chats of the tiny Qwen2.5-Omni model share one stream shape (tau 4 over 16 pages, as `omnijax chat` runs below
# with `--block 4 --pages 16`), and the video chats another (tau 4 over 32 pages, as `omnijax watch` runs with
# `--block 4 --pages 32`): their programs compile once.
CONFIG = omnijax.StreamConfig(max_answer_tokens=4, num_pages=16)
VIDEO_CONFIG = CONFIG.replace(num_pages=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen2.5-Omni checkpoint with encoders and the demo's tiny tokenizer (ChatML, the release's ids)."""
    return tiny_omni.checkpoint(tmp_path_factory.mktemp("chat"), tokenizer=True)


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded = omnijax.load(checkpoint)
    assert loaded.tokenizer is not None and loaded.vision is not None
    return loaded


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(checkpoint))


def _spy(chat):
    """Records every chunk the chat feeds (unpadded view: valid tokens only)."""
    fed = []
    feed = chat.session.feed

    def recording(chunk, **kwargs):
        fed.append(chunk)
        return feed(chunk, **kwargs)

    chat.session.feed = recording
    return fed


def _ids(chunk):
    return [int(t) for t in np.asarray(chunk.token_ids)[np.asarray(chunk.valid, bool)]]


def _hf_ids(hf_tokenizer, messages, generation_prompt):
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _state(chat):
    kv = chat.session.state.kv
    return (np.asarray(kv.valid).copy(), np.asarray(chat.session.state.next_pos).copy(), len(chat.units),
            copy.deepcopy(chat.messages), chat.conversation.rendered, len(chat.steps))


def _same(a, b):
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def test_ask_streams_what_stream_generates_for_the_templated_prompt(model, hf_tokenizer):
    config = CONFIG
    chat = Chat(model, config)
    fed = _spy(chat)
    chat.system("You are a brief assistant.")
    deltas = list(chat.ask("Hi there!", max_tokens=11))
    messages = [{"role": "system", "content": "You are a brief assistant."}, {"role": "user", "content": "Hi there!"}]
    # What was fed of the text is exactly transformers' rendering and tokenization of the conversation.
    assert _ids(fed[0]) + _ids(fed[1]) == _hf_ids(hf_tokenizer, messages, True)
    assert all(not np.asarray(c.valid).any() for c in fed[2:])  # the rest are answer continuations
    # The same templated prompt through `stream` as one scan, one answer of 11 tokens.
    length = bucket(max(len(_ids(fed[0])), len(_ids(fed[1]))))
    assert fed[0].length == fed[1].length == length  # both padded alike, so both runs compute the same rows
    reference = omnijax.stream(model, stack_chunks([fed[0], pad_chunk(
        frontend.text(model, _ids(fed[1]), 1, answer_tokens=11), length)]), config.replace(max_answer_tokens=11))
    tokens = [int(t) for t in np.asarray(reference.tokens[-1, 0]) if t >= 0]
    assert "".join(deltas) == model.tokenizer.decode(tokens, skip_special_tokens=True)
    ended = tokens[-1] in model.config.eos_token_ids
    assert len(fed) == 2 + (0 if ended else -(-(len(tokens) - 4) // 4))
    assert chat.messages[-1] == {"role": "assistant",
                                 "content": model.tokenizer.decode(tokens[:-1] if ended else tokens,
                                                                   skip_special_tokens=True)}


def test_multi_turn_cache_holds_the_template_rendering(model, hf_tokenizer):
    chat = Chat(model, CONFIG)
    fed = _spy(chat)
    chat.system("You answer questions.")
    first = "".join(chat.ask("What is 2 + 2?", max_tokens=6))
    chat.user("And one more thing.")
    second = "".join(chat.ask("Why?", max_tokens=5, decoding=Sampling(temperature=0.8, seed=3)))
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "user", "assistant"]
    assert (chat.messages[2]["content"], chat.messages[5]["content"]) == (first, second)
    # Every text turn was fed once; answers went into the cache as generated tokens, and their text is what the
    # template renders as assistant turns.
    assert sum(1 for c in fed if np.asarray(c.valid).any()) == 4
    # Answers are in the cache too (generated tokens); their text is what the template renders as assistant turns.
    answers = [u for u in chat.units if u.kind == "answer"]
    assert len(answers) == 2 and all(u.fed[SpanKind.RESPONSE] >= 1 for u in answers)
    rendered = hf_tokenizer.apply_chat_template(chat.messages, add_generation_prompt=False, tokenize=False)
    tail = rendered[len(chat.conversation.rendered):]
    assert rendered.startswith(chat.conversation.rendered) and tail in ("\n", "<|im_end|>\n")
    # Sampling with a seed reproduces the answer.
    again = Chat(model, CONFIG)
    again.system("You answer questions.")
    assert "".join(again.ask("What is 2 + 2?", max_tokens=6)) == first
    again.user("And one more thing.")
    assert "".join(again.ask("Why?", max_tokens=5, decoding=Sampling(temperature=0.8, seed=3))) == second


def test_media_units_and_kept_rows(model):
    chat = Chat(model, omnijax.StreamConfig(policy=OmniPick(high_watermark=120, low_watermark=90, recent_units=1),
                                            num_pages=16, page_size=16), video_kwargs=SMALL)
    chat.system("Watch.")
    for k in range(3):
        frames = frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=k, start=2.0 * k)
        pcm = frontend.tone(2.0, 330.0, seed=k, start=2.0 * k)
        fed = _spy(chat)
        chat.av(frames, pcm)
        want = frontend.audiovisual_chunk(model, frames, pcm, chat.units[-1].unit, **SMALL)
        np.testing.assert_array_equal(_ids(fed[-1]), _ids(want))
    chat.audio(np.sin(np.linspace(0, 900, 44_100)).astype(np.float32), sample_rate=44_100)
    list(chat.ask("What did you see?", max_tokens=3))
    rows = chat.kept()
    retained = int(np.asarray(chat.session.state.kv.valid).sum())
    assert sum(r.kept for r in rows) == retained == chat.steps[-1].retained
    assert all(0 <= r.kept <= r.fed for r in rows)
    assert any(r.kept < r.fed for r in rows if r.kind == "av")  # the bounded policy dropped old media
    assert all(r.kept == r.fed for r in rows if r.kind == "system")
    table = format_kept(rows)
    assert "video" in table and "audio" in table and table.count("\n") == len(rows)
    trace = chat.trace()
    assert trace.retained.tolist() == [s.retained for s in chat.steps] and len(trace.labels) == len(chat.steps)


def test_refused_calls_leave_the_session_unchanged(model, tmp_path):
    chat = Chat(model, CONFIG)
    chat.system("Hello.")
    before = _state(chat)
    bad = [
        (lambda: chat.add({"role": "robot", "content": "hi"}), ValueError, "unknown chat role 'robot'"),
        (lambda: chat.ask("x", max_tokens=0), ValueError, "max_tokens"),
        (lambda: chat.ask("x", decoding="greedy"), TypeError, "decoding"),
        (lambda: chat.system("again"), ChatTemplateError, "system message comes first"),
        (lambda: chat.user("<|VIDEO|>"), ValueError, "multimodal token"),
        (lambda: chat.av(np.zeros((4, 56, 84)), np.zeros(32000, np.float32)), ValueError, "[n, H, W, 3]"),
        (lambda: chat.audio(np.full(16000, np.nan, np.float32)), ValueError, "NaN"),
        (lambda: chat.image(tmp_path / "missing.png"), ValueError, "missing.png"),
        (lambda: chat.video(tmp_path / "missing.mp4"), ValueError, "missing.mp4"),
    ]
    for call, error, words in bad:
        with pytest.raises(error, match=None) as info:
            call()
        assert words in str(info.value), (words, str(info.value))
        assert _same(_state(chat), before), words
    blind = copy.copy(model)
    blind.vision = None
    chat = Chat(blind, CONFIG)
    before = _state(chat)
    with pytest.raises(MissingEncoderError, match="no vision encoder"):
        chat.image(np.zeros((56, 56, 3), np.uint8))
    assert _same(_state(chat), before)
    # One answer at a time: the conversation waits until the streamed answer is consumed or closed.
    chat = Chat(model, CONFIG)
    answer = chat.ask("Count.", max_tokens=6)
    with pytest.raises(RuntimeError, match="still being streamed"):
        chat.user("wait")
    answer.close()
    chat.user("ok")  # a closed answer frees the conversation


def test_templates_that_rewrite_earlier_turns(model, tmp_path):
    # Qwen3-style: earlier answers lose their (empty) reasoning block; the new turn is fed as the template renders
    # it at the end of the conversation.
    write_tiny_tokenizer(tmp_path / "qwen3", vocab_size=151_700, special_tokens=QWEN_SPECIALS,
                         chat_template=MINICPMO_4_5_TEMPLATE)
    tokenizer = omnijax.models.tokenizer.Tokenizer.from_directory(tmp_path / "qwen3")
    chat = Chat(model, CONFIG, tokenizer=tokenizer)
    fed = _spy(chat)
    list(chat.ask("One?", max_tokens=3))
    list(chat.ask("Two?", max_tokens=3))
    second = [c for c in fed if np.asarray(c.valid).any()][-1]
    own = tokenizer.render([{"role": "user", "content": "Two?"}], add_generation_prompt=True)
    assert tokenizer.decode(_ids(second)) == own and own.endswith("<think>\n\n</think>\n\n")
    # A template whose rendering of the new turn depends on the earlier ones cannot be followed: refused.
    numbered = "{% for m in messages %}[{{ messages | length }}]{{ m['content'] }}{% endfor %}"
    write_tiny_tokenizer(tmp_path / "numbered", vocab_size=151_700, special_tokens=QWEN_SPECIALS,
                         chat_template=numbered)
    chat = Chat(model, CONFIG,
                tokenizer=omnijax.models.tokenizer.Tokenizer.from_directory(tmp_path / "numbered"))
    chat.user("a")
    before = _state(chat)
    with pytest.raises(ChatTemplateError, match="cannot rewrite the cache"):
        chat.user("b")
    assert _same(_state(chat), before)


def test_minicpmo_chat_answers_like_stream(tmp_path):
    src = tiny_omni.minicpmo_source(tmp_path)
    model = omnijax.load(convert_checkpoint(src, tmp_path / "omnijax", progress=False, log=lambda _: None))
    assert model.tokens.unit_start == 1930 and model.tokenizer is not None
    chat = Chat(model, CONFIG)
    fed = _spy(chat)
    text = "".join(chat.ask("Describe it.", max_tokens=6))
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Describe it."}])
    assert _ids(fed[0]) == prompt
    from omnijax.models.minicpmo import layout as adapter
    chunk = adapter.text_unit(prompt, 0, 6, hidden_size=model.config.hidden_size, tokens=model.tokens)
    reference = omnijax.stream(model, stack_chunks([pad_chunk(chunk, fed[0].length)]),
                               omnijax.StreamConfig(max_answer_tokens=6, num_pages=16))
    tokens = [int(t) for t in np.asarray(reference.tokens[0, 0]) if t >= 0]
    assert text == model.tokenizer.decode(tokens, skip_special_tokens=True)
    assert json.loads((tmp_path / "omnijax" / "omnijax.json").read_text())["model_type"] == "minicpmo"
    # Media as MiniCPM-o units: <unit> [<image> E </image>] [<|audio_start|> A <|audio_end|>] </unit>.
    frame = (np.random.default_rng(0).random((112, 112, 3)) * 255).astype(np.uint8)
    pcm = np.sin(np.linspace(0, 700, 16_000)).astype(np.float32)
    chat.image(frame)
    chat.audio(pcm)
    chat.av(frame[None], pcm)
    before = _state(chat)
    with pytest.raises(ValueError, match="takes one frame"):
        chat.av(np.stack([frame, frame]), pcm)
    assert _same(_state(chat), before)
    media = [c for c in fed if np.asarray(c.valid).any()][-3:]
    for chunk, kinds in zip(media, ({SpanKind.IMAGE}, {SpanKind.AUDIO}, {SpanKind.IMAGE, SpanKind.AUDIO})):
        ids, spans = _ids(chunk), set(np.asarray(chunk.span)[np.asarray(chunk.valid, bool)].tolist())
        assert ids[0] == model.tokens.unit_start and ids[-1] == model.tokens.unit_end
        assert kinds <= spans and not ({SpanKind.IMAGE, SpanKind.AUDIO} - kinds) & spans
        assert np.asarray(chunk.embed_mask)[np.asarray(chunk.valid, bool)].sum() > 0
    list(chat.ask("And now?", max_tokens=2))
    rows = chat.kept()
    assert {r.span for r in rows if r.kind in ("image", "av")} >= {"image", "boundary"}
    assert sum(r.kept for r in rows) == int(np.asarray(chat.session.state.kv.valid).sum())


def test_resample_keeps_a_tone_and_drops_what_would_fold():
    rate = 48_000
    t = np.arange(rate) / rate
    low = resample((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate)
    assert low.shape == (16_000,)
    np.testing.assert_allclose(low[200:-200], 0.5 * np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000)[200:-200],
                               atol=2e-2)
    high = resample(np.sin(2 * np.pi * 12_000 * t).astype(np.float32), rate)  # above 8 kHz: filtered out
    assert np.abs(high[200:-200]).max() < 0.05


def test_chat_command_line(checkpoint, monkeypatch, capsys):
    from omnijax import cli
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n/kept\n/bogus\n/image nowhere.png\n/quit\n"))
    code = cli.main(["chat", str(checkpoint), "--pages", "16", "--max-tokens", "4", "--block", "4",
                     "--system", "Be brief."])
    out = capsys.readouterr().out
    assert code == 0
    assert "unit  kind" in out and "system" in out and "user" in out
    assert "unknown command /bogus" in out and "error: nowhere.png" in out
    assert cli.main(["chat", str(checkpoint), "--policy", "nonsense"]) == 1


def _clip(tmp_path, units=3):
    from omnijax.media import video
    frames = np.concatenate([frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=1, start=2.0 * k) for k in range(units)])
    pcm = np.concatenate([frontend.tone(2.0, 330.0, seed=1 + k, start=2.0 * k) for k in range(units)])
    return video.write_clip(tmp_path / "clip.mp4", frames, 2, pcm)


def test_video_feeds_the_frontends_chunks_of_the_files_units(model, tmp_path):
    pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")
    from omnijax.media import video
    path = _clip(tmp_path)
    chat = Chat(model, VIDEO_CONFIG, video_kwargs=SMALL)
    fed = _spy(chat)
    progress = []
    assert chat.video(path, start=2.0, progress=lambda done, total: progress.append((done, total))) == 2
    assert progress == [(1, 2), (2, 2)]
    units = list(video.open_video(path).units())[1:]  # the same frames and PCM, read independently
    assert len(fed) == 2
    for chunk, (frames, pcm), record in zip(fed, units, chat.units):
        want = frontend.audiovisual_chunk(model, frames, pcm, record.unit, **SMALL)
        n = want.length
        np.testing.assert_array_equal(np.asarray(chunk.token_ids)[:, :n], want.token_ids)
        np.testing.assert_array_equal(np.asarray(chunk.positions)[..., :n], want.positions)
        np.testing.assert_allclose(np.asarray(chunk.embeds)[:, :n], want.embeds, atol=1e-6)
        assert not np.asarray(chunk.valid)[:, n:].any()
    assert [u.label for u in chat.units] == ["clip.mp4 0:02-0:04", "clip.mp4 0:04-0:06"]
    before = _state(chat)
    with pytest.raises(ValueError, match="nothing to feed"):
        chat.video(path, start=30.0)
    (tmp_path / "notes.mp4").write_text("not a video")
    with pytest.raises(video.VideoError, match="notes.mp4"):
        chat.video(tmp_path / "notes.mp4")
    assert _same(_state(chat), before)


def test_watch_command_line(checkpoint, tmp_path, capsys):
    pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")
    from omnijax import cli
    path = _clip(tmp_path)
    code = cli.main(["watch", str(checkpoint), str(path), "--ask", "What?", "--at", "0:02", "--ask", "Then?",
                     "--pages", "32", "--block", "4", "--max-tokens", "3", "--plot", str(tmp_path / "watch.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[2 s] Q: What?" in out and "[6 s] Q: Then?" in out and "KV:" in out
    assert (tmp_path / "watch.png").stat().st_size > 10_000
    assert cli.main(["watch", str(checkpoint), str(path), "--ask", "a", "--at", "0:01", "--at", "0:02"]) == 1
    assert "each --at goes with the --ask of the same rank" in capsys.readouterr().err


def test_watch_reads_up_to_its_last_question_and_takes_a_silent_video_when_told(checkpoint, tmp_path, capsys):
    """The progress bar counts the units fed up to the last question (it stopped at 1/3 when the last --at came
    before the end); a video without sound is refused naming --silent-video, and fed with silence with it."""
    pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")
    from omnijax import cli
    from omnijax.media import video
    args = ["--ask", "What?", "--at", "0:02", "--pages", "32", "--block", "4", "--max-tokens", "3"]
    assert cli.main(["watch", str(checkpoint), str(_clip(tmp_path)), *args]) == 0
    captured = capsys.readouterr()
    assert "[2 s] Q: What?" in captured.out and "1/1" in captured.err and "1/3" not in captured.err
    frames = np.concatenate([frontend.synthetic_frames(2.0, 2.0, 56, 84, seed=1, start=2.0 * k) for k in range(2)])
    silent = video.write_clip(tmp_path / "silent.mp4", frames, 2)
    assert cli.main(["watch", str(checkpoint), str(silent), *args]) == 1
    err = capsys.readouterr().err
    assert "has no audio track" in err and "--silent-video" in err
    assert cli.main(["watch", str(checkpoint), str(silent), *args, "--silent-video"]) == 0
    assert "[2 s] Q: What?" in capsys.readouterr().out


def test_watch_answers_at_the_decoded_end_of_a_file_cut_short(checkpoint, tmp_path, capsys, monkeypatch):
    """A file that ends before its stated duration (omnijax.media.video stops its units at the decoded end and warns):
    `omnijax watch` asks its questions there (it died with StopIteration, the file's units being fewer than stated)."""
    pytest.importorskip("av", reason="PyAV writes and reads the test clip (the test extra installs it)")
    from omnijax import cli
    from omnijax.media import video
    whole = video.VideoFile.units
    monkeypatch.setattr(video.VideoFile, "units", lambda self: iter(list(whole(self))[:1]))  # 1 of 3 units decode
    code = cli.main(["watch", str(checkpoint), str(_clip(tmp_path)), "--ask", "What?", "--pages", "32",
                     "--block", "4", "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[2 s] Q: What?" in out and "KV:" in out
