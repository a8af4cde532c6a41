"""The converted tiny Qwen2.5-Omni thinker with its encoders against transformers: audio, image, video and
audio-in-video logits, positions equal to `get_rope_index`, and an audiovisual session streamed as 2 s units."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chunks.builders import token_layout  # noqa: E402
from omnijax.chunks.chunk import stack_chunks  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.models.encoders import whisper as audio  # noqa: E402
from omnijax.models.encoders.log_mel import log_mel  # noqa: E402
from omnijax.models.encoders.qwen_vl_preprocess import preprocess_images, preprocess_video  # noqa: E402
from omnijax.models.qwen2_5_omni import layout as q  # noqa: E402
from omnijax.models.qwen2_5_omni import positions, thinker, vision  # noqa: E402
from tests._support import hf_models  # noqa: E402

VOCAB = 151_936  # real special-token ids fit
RNG = np.random.default_rng(0)
TEXT = lambda n: RNG.integers(0, 1000, n).tolist()  # noqa: E731


@pytest.fixture(scope="module")
def hf():
    model = hf_models.build_thinker(seed=0, scale=0.2, vocab_size=VOCAB)
    with torch.no_grad():  # sharper encoders too, so a misplaced feature shows in the logits
        for name, p in model.named_parameters():
            if name.startswith(("audio_tower.", "visual.")) and p.ndim > 1:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def model(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinker")
    hf_models.save_full(hf, root / "hf")
    return omnijax.load(convert_checkpoint(root / "hf", root / "out", progress=False))


def tone(seconds, freq=440.0):
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.01 * RNG.standard_normal(t.shape)).astype(np.float32)


def frames(n, h=56, w=84):
    return RNG.integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def compare(model, hf, ids, **media):
    """Our logits and positions against transformers' for one batch-1 sequence with its media."""
    ids = np.asarray(ids)[None]
    mask = np.ones_like(ids)
    torch_media = {k: torch.as_tensor(np.asarray(v)) for k, v in media.items()
                   if v is not None and k != "use_audio_in_video"}
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                  use_audio_in_video=media.get("use_audio_in_video", False), **torch_media).logits.numpy()
    got = np.asarray(model(input_ids=ids, attention_mask=mask, **media))
    assert np.abs(got - want).max() <= 1e-4
    return got, want


def audio_inputs(clips):
    feats = [log_mel(c) for c in clips]
    T = max(f.shape[1] for f in feats)
    features = np.zeros((len(feats), 128, T), np.float32)
    fmask = np.zeros((len(feats), T), np.int32)
    for i, f in enumerate(feats):
        features[i, :, :f.shape[1]] = f
        fmask[i, :f.shape[1]] = 1
    return features, fmask, [positions.audio_token_count(f.shape[1]) for f in feats]


def test_encoders_loaded(model):
    assert isinstance(model.audio, audio.AudioEncoder) and isinstance(model.vision, vision.VisionEncoder)
    assert model.omni.audio_token_id == q.AUDIO


def test_audio_only(model, hf):
    features, fmask, (n,) = audio_inputs([tone(2.7)])
    ids = TEXT(5) + [q.AUDIO_BOS] + [q.AUDIO] * n + [q.AUDIO_EOS] + TEXT(4)
    compare(model, hf, ids, input_features=features, feature_attention_mask=fmask)


def test_image(model, hf):
    pixels, grid = preprocess_images([frames(1, 100, 73)[0]])
    n = int(np.prod(grid[0])) // 4
    ids = TEXT(3) + [q.VISION_BOS] + [q.IMAGE] * n + [q.VISION_EOS] + TEXT(6)
    compare(model, hf, ids, pixel_values=pixels, image_grid_thw=grid)


def test_video_and_positions(model, hf):
    pixels, grid = preprocess_video(frames(6))
    n = int(np.prod(grid[0])) // 4
    ids = np.asarray(TEXT(2) + [q.VISION_BOS] + [q.VIDEO] * n + [q.VISION_EOS] + TEXT(3))[None]
    compare(model, hf, ids[0], pixel_values_videos=pixels, video_grid_thw=grid, video_second_per_grid=[1.0])
    with torch.no_grad():
        want, _ = hf.get_rope_index(torch.as_tensor(ids), None, torch.as_tensor(grid), torch.ones_like(
            torch.as_tensor(ids)), False, None, torch.as_tensor([1.0]))
    got = thinker.rope_index(ids, np.ones_like(ids), model.omni, video_grid_thw=grid, second_per_grids=[1.0])
    np.testing.assert_array_equal(got, want.numpy())


def av_session(model, units=3):
    """System text, `units` audiovisual 2 s units (4 frames at 2 fps + 2 s of audio), a question."""
    chunks, media = [q.system_unit(TEXT(6), 0, hidden_size=64)], {"pix": [], "grid": [], "clips": []}
    for u in range(units):
        pixels, grid = preprocess_video(frames(4))
        clip = tone(2.0, 300 + 100 * u)
        feats = log_mel(clip)
        video_embeds = np.asarray(vision.encode_vision(model.vision, pixels, grid))
        audio_embeds = np.asarray(audio.encode_audio(model.audio, feats))
        chunks.append(q.audiovisual_unit(grid[0], audio_embeds.shape[0], 1.0, u + 1,
                                         video_embeds=video_embeds, audio_embeds=audio_embeds))
        media["pix"].append(pixels)
        media["grid"].append(grid[0])
        media["clips"].append(clip)
    chunks.append(q.text_unit(TEXT(5), units + 1, hidden_size=64))
    return chunks, media


def test_audiovisual_session_streamed_as_units_equals_one_shot(model, hf):
    chunks, media = av_session(model)
    ids, pos = token_layout(chunks)
    features, fmask, _ = audio_inputs(media["clips"])
    grids = np.stack(media["grid"])
    one_shot, want = compare(model, hf, ids, input_features=features, feature_attention_mask=fmask,
                             pixel_values_videos=np.concatenate(media["pix"]), video_grid_thw=grids,
                             video_second_per_grid=[1.0] * len(grids), use_audio_in_video=True)
    # The adapters' streamed positions are transformers' positions for the whole session.
    with torch.no_grad():
        hf_pos, _ = hf.get_rope_index(torch.as_tensor(ids[None]), None, torch.as_tensor(grids),
                                      torch.ones(1, len(ids), dtype=torch.long), True,
                                      torch.as_tensor(fmask.sum(1)), torch.as_tensor([1.0] * len(grids)))
    np.testing.assert_array_equal(pos, hf_pos.numpy()[:, 0])
    result = omnijax.stream(model, stack_chunks(chunks), page_size=16)
    np.testing.assert_allclose(np.asarray(result.logits[-1, 0]), want[0, -1], atol=1e-4, rtol=0)
    # impl 'xla' (the default) is an online softmax over 16-slot pages, the one-shot forward a dense softmax: the
    # same math in another float32 summation order (1.06e-5 seen here).
    np.testing.assert_allclose(np.asarray(result.logits[-1, 0]), one_shot[0, -1], atol=3e-5, rtol=0)
    assert int(result.stats.layout.retained_cells[-1, 0]) == len(ids)


def test_mismatched_inputs_are_refused(model):
    features, fmask, (n,) = audio_inputs([tone(1.0)])
    ids = np.asarray([[q.AUDIO_BOS] + [q.AUDIO] * (n + 1) + [q.AUDIO_EOS]])
    with pytest.raises(thinker.ThinkerInputError, match="placeholder tokens"):
        model(input_ids=ids, input_features=features, feature_attention_mask=fmask)
    pixels, grid = preprocess_images([frames(1)[0]])
    with pytest.raises(thinker.ThinkerInputError, match="image_grid_thw"):
        model(input_ids=ids, pixel_values=pixels)


def test_tidekv_prefill_of_an_audiovisual_prompt(model, hf):
    """Layer-major prefill of the thinker (multimodal embeddings, TMRoPE) ends at transformers' last logits and its
    compressed cache decodes from the true next position."""
    from omnijax.prefill import SnapKV, greedy
    chunks, media = av_session(model, units=2)
    ids, _ = token_layout(chunks)
    features, fmask, _ = audio_inputs(media["clips"])
    grids = np.stack(media["grid"])
    inputs = dict(input_ids=ids[None], input_features=features, feature_attention_mask=fmask,
                  pixel_values_videos=np.concatenate(media["pix"]), video_grid_thw=grids,
                  video_second_per_grid=[1.0] * len(grids), use_audio_in_video=True)
    _, want = compare(model, hf, ids, **{k: v for k, v in inputs.items() if k != "input_ids"})
    full = model.prefill(chunk=32, page=16, room=3, **inputs)
    np.testing.assert_allclose(np.asarray(full.logits[0]), want[0, -1], atol=1e-4, rtol=0)
    compressed = model.prefill(chunk=32, page=16, room=3, selector=SnapKV(window=8, block_size=16), budgets=24,
                               **inputs)
    np.testing.assert_allclose(np.asarray(compressed.logits), np.asarray(full.logits), atol=1e-5, rtol=0)
    assert int(compressed.cache.next_pos[0]) == int(full.cache.next_pos[0]) > 0
    tokens, logits, cache = greedy(model.decoder, compressed.cache, compressed.logits, 3)
    assert tokens.shape == (1, 3) and np.isfinite(np.asarray(logits)).all()
    assert int(cache.layers[0].length[0, 0]) == 24 + 3
    with pytest.raises(ValueError, match="unpadded"):
        model.prefill(input_ids=ids[None], attention_mask=np.r_[0, np.ones(len(ids) - 1)][None])
