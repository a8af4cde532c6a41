"""The converted tiny Qwen3-Omni thinker against transformers: text, audio, image, video, audio in video, long audio,
interleaved M-RoPE, streaming and greedy answers, conversion (full / thinker-only, single / sharded), bad input.

The tiny thinker mixes MoE and dense layers, has one KV head and taps two DeepStack levels (`qwen3_omni_models`).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chunks.chunk import split_text  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.errors import ConvertError, UnsupportedConfigError  # noqa: E402
from omnijax.models.qwen3_omni import positions as P  # noqa: E402
from omnijax.models.qwen3_omni.thinker import ThinkerInputError  # noqa: E402
from tests._support import qwen3_omni_models as Q  # noqa: E402

IDS = Q.IDS
PATCH = 3 * 2 * 16 * 16  # channels * temporal patch * patch side ** 2
MEL = Q.AUDIO["num_mel_bins"]


@pytest.fixture(scope="module")
def hf():
    return Q.build_thinker(seed=0)


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_omni")
    full = convert_checkpoint(Q.save_full(hf, root / "full"), root / "full_out", progress=False)
    sharded = convert_checkpoint(Q.save_thinker(hf, root / "thinker", max_shard_size="100KB"), root / "thinker_out",
                                 progress=False)
    return {"full": full, "sharded": sharded, "root": root}


@pytest.fixture(scope="module")
def model(converted):
    return omnijax.load(converted["full"])


def _hf_logits(hf, **inputs):
    with torch.no_grad():
        return hf(**{k: torch.as_tensor(v) for k, v in inputs.items()}).logits.float().numpy()


def _ids(*parts) -> np.ndarray:
    return np.asarray([np.concatenate([np.asarray(p, np.int64) for p in parts])])


def _group(segment) -> np.ndarray:
    return np.asarray(P.StreamPositions(P.Qwen3OmniConfig(**{k: v for k, v in IDS.items()})).feed(segment).token_ids)


def _compare(model, hf, atol=1e-4, **inputs):
    inputs.setdefault("attention_mask", np.ones_like(inputs["input_ids"]))
    want = _hf_logits(hf, **inputs)
    got = np.asarray(model(**inputs))
    assert np.abs(got - want).max() <= atol, np.abs(got - want).max()
    return got


def _pixels(patches: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((patches, PATCH)).astype(np.float32)


def _mel(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, MEL, frames)).astype(np.float32)


def test_loaded_model(model):
    c = model.config
    assert c.num_experts == 8 and c.sparse_layers == (True, False, True) and c.mrope_interleaved
    assert c.qk_norm and not c.qkv_bias and c.num_kv_heads == 1
    assert model.model_type == "qwen3_omni" and model.omni.audio_token_id == IDS["audio_token_id"]
    assert model.vision.config.deepstack_visual_indexes == (0, 1)


def test_text_logits_with_padding(model, hf):
    tokens = np.random.default_rng(0).integers(0, 280, (2, 19))
    mask = np.ones_like(tokens)
    mask[1, :4] = 0
    want = _hf_logits(hf, input_ids=tokens, attention_mask=mask)
    got = np.asarray(model(input_ids=tokens, attention_mask=mask))
    assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-4


def test_interleaved_mrope_matches_the_reference_rotary_table(hf):
    from omnijax.kv import rope as rope_lib

    pos = np.random.default_rng(1).integers(0, 50, (3, 1, 9)).astype(np.float32)
    pos[0] += 0.5  # fractional temporal ids rotate too
    with torch.no_grad():
        cos, _ = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.as_tensor(pos))
    c = Q.TEXT["rope_parameters"]
    angles = rope_lib.rope_angles(pos, Q.TEXT["head_dim"], c["rope_theta"], tuple(c["mrope_section"]), True)
    np.testing.assert_allclose(np.cos(np.asarray(angles))[0], cos[0, :, :Q.TEXT["head_dim"] // 2].numpy(), atol=1e-6)
    contiguous = rope_lib.rope_angles(pos, Q.TEXT["head_dim"], c["rope_theta"], tuple(c["mrope_section"]), False)
    assert np.abs(np.asarray(contiguous) - np.asarray(angles)).max() > 0.1


def test_logits_with_distinct_position_axes(model, hf):
    tokens = np.random.default_rng(2).integers(0, 280, (1, 15))
    t = np.arange(15)
    positions = np.stack([t, 3 + (t * 5) % 11, 2 * t])[:, None]
    want = _hf_logits(hf, input_ids=tokens, position_ids=positions)
    assert np.abs(np.asarray(model(input_ids=tokens, position_ids=positions)) - want).max() <= 1e-4


def test_image_with_deepstack(model, hf):
    grid = np.asarray([[1, 4, 6]])
    ids = _ids([5, 6], _group(P.ImageGroup((1, 4, 6))), [7, 8])
    _compare(model, hf, input_ids=ids, pixel_values=_pixels(24, 0), image_grid_thw=grid)


@pytest.mark.parametrize("spg", [1.0, 2 / 3])
def test_video_and_image_together(model, hf, spg):
    ids = _ids([5], _group(P.VideoGroup((2, 4, 4), spg)), [9, 10], _group(P.ImageGroup((1, 2, 4))), [11])
    _compare(model, hf, input_ids=ids, pixel_values=_pixels(8, 1), image_grid_thw=np.asarray([[1, 2, 4]]),
             pixel_values_videos=_pixels(32, 2), video_grid_thw=np.asarray([[2, 4, 4]]),
             video_second_per_grid=np.asarray([spg]))


def test_audio(model, hf):
    frames = 137
    ids = _ids([5, 6], _group(P.AudioGroup(P.audio_token_count(frames))), [7])
    _compare(model, hf, input_ids=ids, input_features=_mel(frames, 3),
             feature_attention_mask=np.ones((1, frames), np.int64))


def test_audio_longer_than_one_window_is_windowed(model, hf):
    frames = 530  # n_window_infer = 200 frames: three windows
    ids = _ids([5], _group(P.AudioGroup(P.audio_token_count(frames))), [7, 8])
    inputs = dict(input_ids=ids, input_features=_mel(frames, 4), feature_attention_mask=np.ones((1, frames), int))
    with Q.windowed_audio(hf.audio_tower):
        got = _compare(model, hf, **inputs)
    eager = _hf_logits(hf, attention_mask=np.ones_like(ids), **inputs)  # attends across the whole clip
    assert np.abs(eager - got).max() > 1e-3


def test_audio_in_video(model, hf):
    frames = 230
    group = P.AudioInVideoGroup((2, 4, 4), 1.0, P.audio_token_count(frames))
    ids = _ids([5], _group(group), [6, 7])
    with Q.windowed_audio(hf.audio_tower):  # 230 frames: two attention windows
        _compare(model, hf, input_ids=ids, input_features=_mel(frames, 5),
                 feature_attention_mask=np.ones((1, frames), int),
                 pixel_values_videos=_pixels(32, 6), video_grid_thw=np.asarray([[2, 4, 4]]),
                 video_second_per_grid=np.asarray([1.0]), use_audio_in_video=True)


def test_streamed_text_equals_one_shot_and_greedy_equals_generate(model, hf):
    tokens = np.random.default_rng(5).integers(0, 280, (1, 20))
    full = np.asarray(model(input_ids=tokens))[0]
    result = omnijax.stream(model, split_text(tokens[0], 3, position_axes=3, answer_tokens=5), max_answer_tokens=6,
                            page_size=4)
    ends = np.cumsum([len(p) for p in np.array_split(tokens[0], 3)]) - 1
    np.testing.assert_allclose(np.asarray(result.logits[:, 0]), full[ends], atol=1e-5, rtol=0)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.as_tensor(tokens), attention_mask=torch.ones(1, 20, dtype=int),
                          max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert np.asarray(result.tokens[-1, 0]).tolist()[:5] == out[0, 20:].numpy().tolist()


def test_conversion_full_single_equals_thinker_sharded(converted, model):
    import jax
    from flax import nnx

    a, b = model, omnijax.load(converted["sharded"])  # (`model` is the full single-file conversion, loaded)
    assert len(list((converted["root"] / "thinker").glob("*.safetensors"))) > 1
    for x, y in ((a.decoder, b.decoder), (a.audio, b.audio), (a.vision, b.vision)):
        jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(x)), nnx.to_pure_dict(nnx.state(y)))
    assert a.omni == b.omni


def test_bad_inputs_are_refused(model):
    frames = 150
    ids = _ids([5], _group(P.AudioGroup(P.audio_token_count(frames))), [7])
    with pytest.raises(ThinkerInputError, match="no frame"):
        model(input_ids=ids, input_features=_mel(frames, 0), feature_attention_mask=np.zeros((1, frames), int))
    # A video whose audio does not fit the placeholders laid out for it.
    group = P.AudioInVideoGroup((2, 4, 4), 1.0, P.audio_token_count(230))
    with pytest.raises(ThinkerInputError, match="audio"):
        model(input_ids=_ids([5], _group(group), [6]), input_features=_mel(330, 1),
              feature_attention_mask=np.ones((1, 330), int), pixel_values_videos=_pixels(32, 6),
              video_grid_thw=np.asarray([[2, 4, 4]]), video_second_per_grid=np.asarray([1.0]),
              use_audio_in_video=True)


def _write_config(directory, config: dict):
    import json

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("change, error, match", [
    ({"shared_expert_intermediate_size": 64}, UnsupportedConfigError, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 9}, ConvertError, "num_experts_per_tok"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, UnsupportedConfigError,
     "rope"),
    ({"hidden_act": "gelu"}, UnsupportedConfigError, "hidden_act"),
])
def test_router_and_config_attributes_it_does_not_implement_are_refused(converted, tmp_path, change, error, match):
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(converted["root"] / "thinker", src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"].update(change)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=match):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


@pytest.mark.parametrize("model_type", ["qwen3_omni_moe_talker", "qwen4_omni_moe"])
def test_talker_only_or_unknown_architecture_is_refused(tmp_path, model_type):
    src = _write_config(tmp_path / "src", {"model_type": model_type})
    with pytest.raises(ConvertError, match=model_type):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_units_streamed_one_by_one_equal_the_one_shot_forward(model):
    """System text, an image, text, an audio clip, two audiovisual units and a question, each a streaming unit (with
    its encoder outputs and DeepStack levels), give the one-shot forward's logits at every unit's last token."""
    from omnijax.chunks.chunk import stack_chunks
    from omnijax.models.qwen3_omni import audio as audio_lib
    from omnijax.models.qwen3_omni import layout as A
    from omnijax.models.qwen3_omni import vision as vision_lib

    D, levels, t = model.config.hidden_size, 2, model.omni
    image, image_grid = _pixels(24, 10), (1, 4, 6)
    clip = _mel(120, 11)[0]
    av = [(_pixels(32, 12 + i), _mel(200, 14 + i)[0]) for i in range(2)]  # 2 s units: 2 frames, 200 mel frames
    av_grid = (2, 4, 4)

    img_out, img_levels = vision_lib.encode_vision(model.vision, image, np.asarray([image_grid]))
    text = dict(hidden_size=D, deepstack_levels=levels, tokens=t)
    units = [A.system_unit([1, 2, 3, 4], 0, **text),
             A.image_unit(image_grid, 1, np.asarray(img_out), np.asarray(img_levels), tokens=t),
             A.text_unit([10, 11, 12], 2, **text),
             A.audio_unit(P.audio_token_count(120), 3, np.asarray(audio_lib.encode_audio(model.audio, clip)),
                          deepstack_levels=levels, tokens=t)]
    for i, (pixels, mel) in enumerate(av):
        v, lv = vision_lib.encode_vision(model.vision, pixels, np.asarray([av_grid]))
        a = audio_lib.encode_audio(model.audio, mel)
        units.append(A.audiovisual_unit(av_grid, P.audio_token_count(200), 1.0, 4 + i, np.asarray(v), np.asarray(a),
                                        np.asarray(lv), tokens=t))
    units.append(A.text_unit([20, 21, 22, 23], 6, **text))
    result = omnijax.stream(model, stack_chunks(units), page_size=8)

    ids = np.concatenate([np.asarray(u.token_ids)[0] for u in units])[None]
    mels = [clip] + [m for _, m in av]
    frames = max(m.shape[1] for m in mels)
    feats = np.stack([np.pad(m, ((0, 0), (0, frames - m.shape[1]))) for m in mels])
    feature_mask = np.stack([np.arange(frames) < m.shape[1] for m in mels]).astype(np.int64)
    full = np.asarray(model(input_ids=ids, attention_mask=np.ones_like(ids), input_features=feats,
                            feature_attention_mask=feature_mask, pixel_values=image,
                            image_grid_thw=np.asarray([image_grid]),
                            pixel_values_videos=np.concatenate([p for p, _ in av]),
                            video_grid_thw=np.asarray([av_grid] * 2), video_second_per_grid=np.asarray([1.0, 1.0]),
                            use_audio_in_video=True))[0]
    ends = np.cumsum([u.length for u in units]) - 1
    np.testing.assert_allclose(np.asarray(result.logits[:, 0]), full[ends], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="fractional"):
        A.video_unit(av_grid, 2 / 3, 9, hidden_size=D, tokens=t)


def _av_session(model, units: int, seed: int):
    """A system prompt, `units` 2 s audiovisual units with real encoder outputs, and a question, stacked."""
    from omnijax.chunks.chunk import stack_chunks
    from omnijax.models.qwen3_omni import audio as audio_lib
    from omnijax.models.qwen3_omni import layout as A
    from omnijax.models.qwen3_omni import vision as vision_lib

    t, grid = model.omni, (2, 4, 4)
    text = dict(hidden_size=model.config.hidden_size, deepstack_levels=2, tokens=t)
    chunks = [A.system_unit([1, 2, 3], 0, **text)]
    for k in range(units):
        v, levels = vision_lib.encode_vision(model.vision, _pixels(32, seed + k), np.asarray([grid]))
        a = audio_lib.encode_audio(model.audio, _mel(200, seed + 100 + k)[0])
        chunks.append(A.audiovisual_unit(grid, P.audio_token_count(200), 1.0, 1 + k, np.asarray(v), np.asarray(a),
                                         np.asarray(levels), tokens=t))
    chunks.append(A.text_unit([20, 21, 22], units + 1, 4, **text))
    return stack_chunks(chunks)


def test_omnipick_and_omnipage_run_a_qwen3_omni_session(model):
    """OmniPick trims a Qwen3-Omni audiovisual session to its watermarks; OmniPage's tile_skip moves slots only, so
    it gives the native layout's logits and answer."""
    from omnijax.retention import OmniPick

    chunks = _av_session(model, units=6, seed=20)
    pick = OmniPick(high_watermark=96, low_watermark=64, recent_units=1, text_budget=8)
    runs = {mode: omnijax.stream(model, chunks, omnijax.StreamConfig(policy=pick, paging=mode, num_pages=40,
                                                                     page_size=8, max_answer_tokens=4))
            for mode in ("native", "tile_skip")}  # the other modes run the same code paths on other models' tests
    base = runs["native"]
    retained = np.asarray(base.stats.layout.retained_cells[:, 0])
    assert retained.max() <= 96 + 60 and int(np.asarray(base.stats.evicted).sum()) > 0  # trims, bounded
    for mode, run in runs.items():
        np.testing.assert_allclose(np.asarray(run.logits), np.asarray(base.logits), atol=1e-5, rtol=0, err_msg=mode)
        assert np.asarray(run.tokens).tolist() == np.asarray(base.tokens).tolist(), mode
    fed = int(np.asarray(chunks.valid).sum()) + 4  # every token and the answer
    assert retained[-1] < fed / 2


def test_tidekv_prefill_with_deepstack_equals_the_forward_and_compresses(model):
    """Layer-major prefill adds the DeepStack levels inside its layer loop: without eviction its last logits equal
    the forward's; with SnapKV budgets it keeps that many tokens per KV head and decodes on."""
    from omnijax.prefill import SnapKV, decode_step

    ids = _ids([5, 6], _group(P.ImageGroup((1, 4, 6))), np.arange(10, 40))
    media = dict(pixel_values=_pixels(24, 30), image_grid_thw=np.asarray([[1, 4, 6]]))
    full = np.asarray(model(input_ids=ids, **media))[0, -1]
    kept_all = model.prefill(ids, chunk=16, page=16, **media)
    np.testing.assert_allclose(np.asarray(kept_all.logits[0]), full, atol=1e-4, rtol=0)
    compressed = model.prefill(ids, selector=SnapKV(window=4), budgets=20, chunk=16, page=16, room=2, **media)
    assert [int(np.asarray(layer.length).max()) for layer in compressed.cache.layers] == [20] * 3
    logits, _ = decode_step(model.decoder, compressed.cache, np.asarray([int(np.argmax(compressed.logits[0]))]))
    assert np.isfinite(np.asarray(logits)).all()


def test_speech_tensors_of_a_release_without_audio_output_are_skipped_with_a_message(converted, model, tmp_path):
    """A full release with audio output (the default) has its talker and Code2Wav converted (`test_speech`); one
    whose config sets `enable_audio_output` false converts its thinker only, and one line says how many speech
    tensors were skipped and why. The thinker-only and audio-less conversions load as before, without speech."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(converted["root"] / "full", src)
    assert json.loads((src / "config.json").read_text())["enable_audio_output"] is False
    tensors = load_file(src / "model.safetensors")
    tensors.update({"talker.model.layers.0.mlp.gate_proj.weight": np.zeros((4, 4), np.float32),
                    "talker.codec_head.weight": np.zeros((4, 4), np.float32),
                    "code2wav.decoder.0.weight": np.zeros((2, 2), np.float32)})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    said = []
    out = convert_checkpoint(src, tmp_path / "out", progress=False, log=said.append)
    assert any("skipped 3 speech-output tensors" in line and "talker.: 2" in line and "code2wav.: 1" in line
               and "enable_audio_output false" in line for line in said), said
    loaded = omnijax.load(out)
    assert loaded.config == model.config and loaded.speech is None  # `model`: converted["full"] loaded
    assert json.loads((out / "omnijax.json").read_text())["source"]["speech_output"] is False
    assert omnijax.load(converted["sharded"]).speech is None  # a thinker-only release
