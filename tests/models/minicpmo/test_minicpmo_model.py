"""MiniCPM-o 4.5 end to end: `omnijax-convert` of the golden checkpoint (release tensor layout), `omnijax.load`, and
the turn-based omni prompt of golden case 5 (image source + slices, audio, text) against the official logits."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import omnijax
from omnijax.convert import convert_checkpoint
from omnijax.errors import MissingTensorError, UnsupportedConfigError
from omnijax.models.minicpmo.model import MiniCPMOInputError, MiniCPMOModel
from tests._support import DATA

GOLDEN = DATA / "minicpmo45"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("minicpmo") / "converted"
    convert_checkpoint(GOLDEN / "checkpoint", out, progress=False)
    manifest = json.loads((out / "omnijax.json").read_text())
    assert manifest["model_type"] == "minicpmo"
    assert {"vpm", "resampler", "audio", "audio_projection"} <= set(manifest)
    return omnijax.load(out)


def test_loaded_model_has_every_part(model):
    assert isinstance(model, MiniCPMOModel) and model.vision is not None and model.audio is not None
    assert model.config.qk_norm and model.config.vocab_size == 2048


def test_case1_text(model):
    case = np.load(GOLDEN / "case1_text.npz")
    np.testing.assert_allclose(np.asarray(model(case["input_ids"])), case["logits"], atol=1e-4, rtol=0)


def test_case5_image_audio_text_prompt(model):
    case, vision = np.load(GOLDEN / "case5_chat.npz"), np.load(GOLDEN / "case2_vision.npz")
    media = dict(pixel_values=[vision[f"pixel_values_{i}"] for i in range(3)], tgt_sizes=case["tgt_sizes"],
                 image_bound=case["image_bound"], audio_features=case["audio_features"],
                 audio_feature_lens=case["audio_feature_lens"], audio_bounds=case["audio_bounds"])
    np.testing.assert_allclose(np.asarray(model.embed(case["input_ids"], **media))[0], case["inputs_embeds"][0],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(model(case["input_ids"], **media)), case["logits"], atol=1e-4, rtol=0)
    with pytest.raises(MiniCPMOInputError, match="image_bound span"):
        model(case["input_ids"], **{**media, "image_bound": case["image_bound"] + 300})
    with pytest.raises(MiniCPMOInputError, match="cover"):
        model(case["input_ids"], **{**media, "image_bound": case["image_bound"][:2]})
    with pytest.raises(MiniCPMOInputError, match="integer token ids"):
        model(case["input_ids"].astype(np.float64), **media)


def _copy_checkpoint(tmp_path, drop_prefix=None, config_edit=None):
    src = tmp_path / "src"
    shutil.copytree(GOLDEN / "checkpoint", src)
    if drop_prefix:
        tensors = load_file(src / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if not k.startswith(drop_prefix)}, src / "model.safetensors")
    if config_edit:
        config = json.loads((src / "config.json").read_text())
        config_edit(config)
        (src / "config.json").write_text(json.dumps(config))
    return src


def test_checkpoint_missing_the_resampler_is_refused(tmp_path):
    src = _copy_checkpoint(tmp_path, drop_prefix="resampler.")
    with pytest.raises(MissingTensorError, match="resampler"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_math_changing_config_attributes_are_refused(tmp_path):
    src = _copy_checkpoint(tmp_path, config_edit=lambda c: c.update(use_sliding_window=True))
    with pytest.raises(UnsupportedConfigError, match="use_sliding_window"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    src2 = tmp_path / "src2"
    shutil.copytree(src, src2)
    (src2 / "config.json").write_text(json.dumps({**json.loads((GOLDEN / "checkpoint" / "config.json").read_text()),
                                                  "vision_config": {**json.loads(
                                                      (GOLDEN / "checkpoint" / "config.json").read_text())[
                                                      "vision_config"], "hidden_act": "relu"}}))
    with pytest.raises(UnsupportedConfigError, match="hidden_act"):
        convert_checkpoint(src2, tmp_path / "out", progress=False)


def test_case4_duplex_session_from_raw_frames_and_audio(model):
    """The whole 4.5 duplex flow from the raw inputs: system prompt with the reference clip, three units of frames
    and streamed audio; every decoded token equals the release's, and the decision logits match."""
    from omnijax.models.minicpmo.duplex import DuplexDecodeRule, DuplexTokens
    from omnijax.streaming.duplex import DuplexSession
    case = np.load(GOLDEN / "case4_duplex.npz")
    meta = json.loads((GOLDEN / "case4_duplex.json").read_text())["meta"]
    sp = json.loads((GOLDEN / "info.json").read_text())["special_token_ids_tiny"]
    ids = case["input_ids"][0]
    tokens = DuplexTokens(unit_start=sp["<unit>"], unit_end=sp["</unit>"], image_start=sp["<image>"],
                          image_end=sp["</image>"], listen=sp["<|listen|>"], chunk_eos=sp["<|chunk_eos|>"],
                          chunk_tts_eos=sp["<|chunk_tts_eos|>"])
    rule = DuplexDecodeRule(chunk_eos=sp["<|chunk_eos|>"], turn_eos=sp["<|turn_eos|>"], listen=sp["<|listen|>"],
                            tts_bos=sp["<|tts_bos|>"], forbidden=tuple(meta["decoder_forbidden_token_ids"]))
    duplex = DuplexSession(model, tokens=tokens, rule=rule, max_speak_tokens=meta["max_new_speak_tokens_per_chunk"],
                           force_listen=meta["force_listen_count"], num_pages=8, page_size=32)
    kind = case["position_kind"][0]
    ref_start = int(np.argmax(kind == 1))
    duplex.prepare(ids[:ref_start].tolist(), ids[ref_start + 12:ref_start + 14].tolist(), case["ref_audio_waveform"])
    frames = {0: case["frame0_uint8"], 2: case["frame1_uint8"]}
    audio = case["stream_audio_waveform"]
    results = [duplex.step(audio[16000 * u:16000 * (u + 1)], frames.get(u)) for u in range(3)]
    assert [r.listened for r in results] == [u["is_listen"] for u in meta["units"]]
    assert duplex.decoded == meta["decoder_generated_tokens_history"]
    # The speaking units' decision logits, as the release computed them on its KV cache.
    positions = list(case["incremental_logits_positions"])
    got = [r.logits[i] for r in results[1:] for i in range(3)]
    want = [case["incremental_logits"][positions.index(p)] for p in (111, 112, 113, 193, 194, 195)]
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-4, rtol=0)
    assert int(duplex.session.state.next_pos[0]) == meta["seq_len"]  # exactly the release's 199 fed positions


def test_retention_and_omnipage_on_minicpmo_duplex_sessions(model):
    """OmniPick (source image whole, slice and audio sinks), the official unit window and OmniPage on 4.5 duplex units
    with high-resolution slices, through the converted MiniCPM-o LLM: bounded, and paging never changes the logits."""
    from omnijax.chunks.spans import SpanKind
    from omnijax.retention import OfficialUnitWindow, OmniPick
    from omnijax.testing import synthetic
    chunks = synthetic.minicpm_duplex_session(20, vocab_size=model.config.vocab_size, slices_every=2)
    high, low = 1200, 800
    omnipick = OmniPick(high_watermark=high, low_watermark=low, source_image_whole=True)
    native = omnijax.stream(model.decoder, chunks, policy=omnipick, num_pages=56, page_size=32, impl="xla")
    paged = omnijax.stream(model.decoder, chunks, policy=omnipick, num_pages=56, page_size=32, impl="xla",
                           subblock=16, paging="tile_skip")
    np.testing.assert_allclose(np.asarray(paged.logits), np.asarray(native.logits), atol=1e-5, rtol=0)
    retained = np.asarray(native.stats.layout.retained_cells[:, 0])
    assert int(np.asarray(native.stats.evicted).sum()) > 0 and retained.max() <= high + chunks.valid.shape[-1]
    assert int(np.asarray(paged.stats.moved).sum()) > 0
    # Over the session OmniPage keeps fewer pages active (a single chunk may differ: placement differs).
    assert np.asarray(paged.stats.layout.active_pages).mean() < np.asarray(native.stats.layout.active_pages).mean()
    # Older units keep their source image whole and only the sink prefix of each slice and of the audio.
    from omnijax.retention.base import sequence_view
    view = sequence_view(native.state.kv)
    live, unit, span = (np.asarray(a[0]) for a in (view.live, view.unit, view.span))
    newest = unit[live].max()
    old_units = sorted(set(unit[live & (span == SpanKind.SLICE)].tolist()) - {newest, newest - 1})
    assert old_units, "no older unit with slices survived"
    for u in old_units:
        here = live & (unit == u)
        assert int((here & (span == SpanKind.IMAGE)).sum()) == 64
        assert int((here & (span == SpanKind.SLICE)).sum()) < 4 * 64
    official = omnijax.stream(model.decoder, chunks, policy=OfficialUnitWindow(high_watermark=high,
                                                                               low_watermark=low),
                              num_pages=56, page_size=32, impl="xla")
    assert np.asarray(official.stats.layout.retained_cells).max() <= high + chunks.valid.shape[-1]
