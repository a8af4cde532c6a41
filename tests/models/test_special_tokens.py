"""Special-token ids come from the checkpoint: a tiny Qwen2.5-Omni whose ids differ from the release's is converted,
streamed through the frontend (frames + PCM), served through the engine and evaluated by the StreamingBench harness
with its own ids, against transformers for the same checkpoint; MiniCPM-o reads its markers from the tokenizer."""

import json
import shutil

import numpy as np
import pytest

import omnijax
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.chunks.builders import token_layout
from omnijax.chunks.chunk import stack_chunks
from omnijax.convert import convert_checkpoint
from omnijax.errors import ConfigError
from omnijax.models.qwen2_5_omni import layout as q
from omnijax.models.qwen2_5_omni.config import TOKEN_TEXT, OmniConfig

# Every special id moved (inside hf_models.TEXT's 300-token vocabulary, above the byte range the harness's
# ByteTextEncoder uses): none equals the release's, nor the tiny checkpoints' own (the top ten ids, 290-299).
SHIFTED = OmniConfig(im_start_token_id=280, im_end_token_id=281, audio_token_id=282, audio_start_token_id=283,
                     audio_end_token_id=284, vision_start_token_id=285, vision_end_token_id=286, image_token_id=287,
                     video_token_id=288)
RELEASE_IDS = sorted(q.RELEASE.boundary_ids | q.RELEASE.placeholder_ids)
SPECIAL = sorted(SHIFTED.boundary_ids | SHIFTED.placeholder_ids)


def test_read_special_tokens(tmp_path):
    assert read_special_tokens(tmp_path) == {}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 5, "content": "<a>", "special": True}, {"id": 6, "content": "<b>"}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"7": {"content": "<b>"}}}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<c>": 9}))
    assert read_special_tokens(tmp_path) == {"<a>": 5, "<b>": 7, "<c>": 9}  # later files win
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<c>": "nine"}))
    with pytest.raises(ConfigError, match="added_tokens.json"):
        read_special_tokens(tmp_path)
    (tmp_path / "added_tokens.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot parse"):
        read_special_tokens(tmp_path)


def test_omni_config_from_hf_prefers_the_config_then_the_tokenizer():
    thinker = {"audio_token_index": 11, "vision_start_token_id": 12}
    tokenizer = {"<|AUDIO|>": 21, "<|vision_bos|>": 22, "<|im_start|>": 23, "<|audio_eos|>": 24}
    got = OmniConfig.from_hf(thinker, tokenizer)
    assert (got.audio_token_id, got.vision_start_token_id, got.im_start_token_id, got.audio_end_token_id) == \
        (11, 12, 23, 24)
    assert got.im_end_token_id == 151645 and got.video_token_id == 151656  # neither says: the release's
    assert OmniConfig.from_json(json.loads(json.dumps(got.to_json()))) == got


# ----------------------------------------------------------------------------------------- Qwen2.5-Omni end to end
torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
from tests._support import DATA, hf_models  # noqa: E402


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    config = Qwen2_5OmniThinkerConfig(
        text_config=hf_models.TEXT, audio_config=hf_models.AUDIO, vision_config=hf_models.VISION,
        audio_token_index=SHIFTED.audio_token_id, image_token_index=SHIFTED.image_token_id,
        video_token_index=SHIFTED.video_token_id, audio_start_token_id=SHIFTED.audio_start_token_id,
        audio_end_token_id=SHIFTED.audio_end_token_id, vision_start_token_id=SHIFTED.vision_start_token_id,
        vision_end_token_id=SHIFTED.vision_end_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    with torch.no_grad():  # sharp weights, so a feature on the wrong token or a wrong position shows
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.1 if name.startswith(("audio_tower.", "visual.")) else 0.2)
    return model


@pytest.fixture(scope="module")
def model(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("special_tokens")
    src = hf_models.save_full(hf, root / "hf")
    # The tokenizer's view: every special token (the chat markers are nowhere else).
    (src / "added_tokens.json").write_text(json.dumps({text: getattr(SHIFTED, f) for f, text in TOKEN_TEXT.items()}))
    return omnijax.load(convert_checkpoint(src, root / "omnijax", progress=False, log=lambda _: None))


def _media(seconds, seed):
    from omnijax.models.qwen2_5_omni import frontend
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (int(2 * seconds), 56, 84, 3), dtype=np.uint8),
            frontend.tone(seconds, 300.0 + 100 * seed, seed=seed))


def test_the_converted_checkpoint_carries_its_own_ids(model):
    assert model.omni == SHIFTED
    assert model.config.eos_token_ids == (SHIFTED.im_end_token_id,)  # the answer ends at its <|im_end|>


def test_frontend_session_uses_the_checkpoints_ids_and_matches_transformers(model, hf):
    from omnijax.models.encoders.log_mel import log_mel
    from omnijax.models.encoders.qwen_vl_preprocess import preprocess_video
    from omnijax.models.qwen2_5_omni import frontend

    S = SHIFTED
    text = lambda n, seed: np.random.default_rng(seed).integers(0, 256, n).tolist()  # noqa: E731
    chunks = [frontend.system(model, [S.im_start_token_id, *text(6, 0), S.im_end_token_id], unit=0)]
    media = [_media(2.0, seed) for seed in (1, 2)]
    for u, (frames, pcm) in enumerate(media):
        chunks.append(frontend.audiovisual_chunk(model, frames, pcm, unit=1 + u, fps=2.0))
    chunks.append(frontend.text(model, [S.im_start_token_id, *text(4, 3), S.im_end_token_id, S.im_start_token_id],
                                unit=3))
    av = np.asarray(chunks[1].token_ids[0])
    assert av[:2].tolist() == [S.vision_start_token_id, S.audio_start_token_id]
    assert av[-2:].tolist() == [S.audio_end_token_id, S.vision_end_token_id]
    assert set(av[2:-2].tolist()) == {S.video_token_id, S.audio_token_id}
    np.testing.assert_array_equal(np.asarray(chunks[1].embed_mask[0]), np.isin(av, [S.video_token_id,
                                                                                   S.audio_token_id]))
    ids, pos = token_layout(chunks)
    assert not np.isin(ids, RELEASE_IDS).any() and ids.max() < model.config.vocab_size
    assert np.asarray(chunks[-1].span[0])[-1] == q.SpanKind.BOUNDARY  # <|im_start|> is a marker here

    # transformers on the whole session, with its own ids in its config
    feats = [log_mel(pcm) for _, pcm in media]
    features = np.stack(feats).astype(np.float32)
    fmask = np.ones(features.shape[::2], np.int64)
    pixels, grids = zip(*(preprocess_video(frames) for frames, _ in media))
    grids = np.concatenate(grids)
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                  input_features=torch.as_tensor(features), feature_attention_mask=torch.as_tensor(fmask),
                  pixel_values_videos=torch.as_tensor(np.concatenate(pixels)),
                  video_grid_thw=torch.as_tensor(grids), video_second_per_grid=torch.as_tensor([1.0, 1.0]),
                  use_audio_in_video=True).logits.numpy()[0]
        hf_pos, _ = hf.get_rope_index(torch.as_tensor(ids[None]), None, torch.as_tensor(grids),
                                      torch.ones(1, len(ids), dtype=torch.long), True,
                                      torch.as_tensor(fmask.sum(1)), torch.as_tensor([1.0, 1.0]))
    np.testing.assert_array_equal(pos, hf_pos.numpy()[:, 0])
    length = max(c.length for c in chunks)
    from omnijax.chunks.chunk import pad_chunk
    result = omnijax.stream(model, stack_chunks([pad_chunk(c, length) for c in chunks]), page_size=16)
    ends = np.cumsum([c.length for c in chunks]) - 1
    np.testing.assert_allclose(np.asarray(result.logits[:, 0]), want[ends], atol=1e-4, rtol=0)


def test_a_served_frame_uses_the_checkpoints_ids_and_matches_transformers(model, hf):
    from omnijax.models.encoders.log_mel import log_mel
    from omnijax.retention import NoSlide
    from omnijax.serve import loadgen
    from omnijax.serve.audio_frames import AudioFrameEncoder, frame_tokens
    from omnijax.serve.engine.engine import Engine, EngineConfig

    pcm = loadgen.speech_like_pcm(0.25, seed=4)  # 4000 samples: 6 audio tokens + 2 markers
    T = frame_tokens(pcm.shape[0])
    encoder = AudioFrameEncoder(model, chunk_tokens=T, answer_tokens=1)
    chunk = encoder.encode(pcm, 0)
    ids = np.asarray(chunk.token_ids[0])
    S = SHIFTED
    assert ids.tolist() == [S.audio_start_token_id] + [S.audio_token_id] * (T - 2) + [S.audio_end_token_id]
    engine = Engine(model, EngineConfig(omnijax.StreamConfig(policy=NoSlide(), num_pages=8, page_size=16,
                                                             max_answer_tokens=1), chunk_tokens=T, buckets=(1,)))
    engine.open("a")
    engine.submit("a", chunk, 1)
    out = engine.tick().outputs["a"]
    features = log_mel(pcm.astype(np.float32) / 32768.0)[None]
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids[None]), attention_mask=torch.ones(1, T, dtype=torch.long),
                  input_features=torch.as_tensor(features),
                  feature_attention_mask=torch.ones(1, features.shape[-1], dtype=torch.long)).logits.numpy()[0, -1]
    np.testing.assert_allclose(np.asarray(out.logits), want, atol=1e-4, rtol=0)
    assert [int(t) for t in out.tokens] == [int(np.argmax(want))]
    engine.close("a")


def test_the_streamingbench_harness_builds_and_scores_sessions_with_the_checkpoints_ids(model):
    from omnijax.eval import annotations as ann
    from omnijax.eval import media as media_lib
    from omnijax.eval import sessions as sessions_lib
    from omnijax.eval import streamingbench as sb

    video = ann.Video("toy.json", "a.mp4", "", [ann.Question("T1", "q?", 1.0, ("w", "x", "y", "z"), "B", 0)])
    encoder = media_lib.ByteTextEncoder(model.config.vocab_size)
    builder = sessions_lib.ChunkBuilder(model, encoder)
    assert builder.features  # the frontend path (encoder features), not the layout-only one
    session = sessions_lib.build_session(video, media_lib.SyntheticMedia(seed=0), builder)
    ids = np.concatenate([np.asarray(c.token_ids[0]) for c in session.chunks])
    S = SHIFTED
    assert ids[0] == S.im_start_token_id and S.im_end_token_id in ids.tolist()
    assert {S.vision_start_token_id, S.audio_start_token_id, S.video_token_id, S.audio_token_id} <= set(ids.tolist())
    assert not np.isin(ids, RELEASE_IDS).any()
    question = np.asarray(session.chunks[session.asked[0].chunk].token_ids[0]).tolist()
    assert question[-len("assistant\n") - 1] == S.im_start_token_id  # ... <|im_start|>assistant\n
    report = sb.run(model, [video], [sb.parse_config("full", page_size=16)], encoder=encoder, batch_size=1,
                    progress=False)
    (record,) = report.records
    assert len(record["loglik"]) == 4 and np.isfinite(record["loglik"]).all()
    assert report.summary["full"]["accuracy"]["overall"]["n"] == 1


def test_demo_checkpoint_writer_shifts_the_ids(tmp_path):
    from omnijax.testing import checkpoints as demo
    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf", encoders=False, token_ids=SHIFTED.to_json())
    thinker = json.loads((src / "config.json").read_text())["thinker_config"]
    assert thinker["audio_token_index"] == 282 and thinker["vision_end_token_id"] == 286
    assert read_special_tokens(src)["<|im_end|>"] == 281
    loaded = omnijax.load(convert_checkpoint(src, tmp_path / "out", progress=False, log=lambda _: None))
    assert loaded.omni == SHIFTED and loaded.config.eos_token_ids == (281,)
    # Chat's unit builder marks the checkpoint's own chat markers as boundaries.
    from omnijax.chunks.spans import SpanKind
    from omnijax.models.frontend import units_for
    chunk = units_for(loaded).text([280, 5, 281], 0, SpanKind.TEXT)
    assert np.asarray(chunk.span[0]).tolist() == [SpanKind.BOUNDARY, SpanKind.TEXT, SpanKind.BOUNDARY]


def test_tiny_checkpoints_hold_their_special_ids_inside_their_vocabularies(tmp_path):
    """The tiny checkpoints (the converter and the loader refuse ids outside the vocabulary): the top ten ids of a
    small vocabulary, the release's in one that holds them; writer, tokenizer and transformers oracle agree."""
    from omnijax.testing import checkpoints as demo

    for vocab in (300, 512):
        ids = demo.tiny_token_ids(vocab)
        values = sorted(ids.boundary_ids | ids.placeholder_ids)
        assert values == list(range(vocab - 10, vocab - 3)) + [vocab - 2, vocab - 1]
        assert not set(values) & set(SPECIAL)
    assert demo.tiny_token_ids(151_936) == OmniConfig()  # the demo's vocabulary holds the release's ids
    with pytest.raises(ValueError, match="vocab_size=8"):
        demo.tiny_token_ids(8)
    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf", encoders=False)  # TINY_TEXT_CONFIG: 512 tokens
    demo.write_tiny_tokenizer(src, 512)
    loaded = omnijax.load(convert_checkpoint(src, tmp_path / "out", progress=False, log=lambda _: None))
    assert loaded.omni == demo.tiny_token_ids(512) and loaded.config.eos_token_ids == (511,)
    assert [loaded.tokenizer.token_id(text) for text in TOKEN_TEXT.values()] == \
        [getattr(loaded.omni, field) for field in TOKEN_TEXT]
    # the transformers oracle's config declares the same ids as the converted checkpoint reads
    assert OmniConfig.from_hf(hf_models.thinker_config().to_dict()) == demo.tiny_token_ids(hf_models.TEXT["vocab_size"])


# ---------------------------------------------------------------------------------------------------------- MiniCPM-o
GOLDEN = DATA / "minicpmo45"


def test_minicpmo_markers_come_from_the_checkpoints_tokenizer(tmp_path):
    from omnijax.models.minicpmo import layout as m
    from omnijax.models.minicpmo.duplex import DuplexTokens

    sp = json.loads((GOLDEN / "info.json").read_text())["special_token_ids_tiny"]
    src = tmp_path / "src"
    shutil.copytree(GOLDEN / "checkpoint", src)
    (src / "added_tokens.json").write_text(json.dumps(sp))
    model = omnijax.load(convert_checkpoint(src, tmp_path / "out", progress=False, log=lambda _: None))
    t = model.tokens
    assert (t.unit_start, t.unit_end, t.image_start, t.slice_start, t.listen, t.chunk_eos, t.im_start) == \
        (sp["<unit>"], sp["</unit>"], sp["<image>"], sp["<slice>"], sp["<|listen|>"], sp["<|chunk_eos|>"],
         sp["<|im_start|>"])
    assert t.image_placeholder == t.audio_placeholder == sp["<unk>"]
    assert DuplexTokens.of(model) == DuplexTokens(
        unit_start=sp["<unit>"], unit_end=sp["</unit>"], image_start=sp["<image>"], image_end=sp["</image>"],
        listen=sp["<|listen|>"], chunk_eos=sp["<|chunk_eos|>"], chunk_tts_eos=sp["<|chunk_tts_eos|>"])
    chunk = m.duplex_unit(0, tokens=model.tokens, tail="listen")
    ids = np.asarray(chunk.token_ids[0])
    assert ids[0] == sp["<unit>"] and ids[-2:].tolist() == [sp["<|listen|>"], sp["</unit>"]]
    assert ids.max() < model.config.vocab_size  # the release's 151k ids would not fit this 2048-token vocabulary
    # Without tokenizer files: the release's layout ids, and the duplex loop asks for explicit markers.
    bare = omnijax.load(convert_checkpoint(GOLDEN / "checkpoint", tmp_path / "bare", progress=False,
                                           log=lambda _: None))
    assert bare.special_tokens == {} and bare.tokens == m.MINICPMO_4_5
    with pytest.raises(ValueError, match="declares no id"):
        DuplexTokens.of(bare)
