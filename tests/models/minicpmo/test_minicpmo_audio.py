"""MiniCPM-o 4.5 audio path (features, Whisper encoder, projector, pooling, streaming) against the official code's
golden vectors (cases 3 and 4 of `tests/_support/data/minicpmo45`).

Tolerances: log-mel features 5e-5 absolute (the reference runs the STFT in float32, this implementation in float64:
the observed difference is at most 2.5e-5, typically 1e-6); every encoder intermediate and output 1e-5 (observed
at most 2e-6), both from the golden features and end to end from the waveforms.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from omnijax.checkpoint.name_tables import param_shapes
from omnijax.errors import MissingTensorError
from omnijax.models.minicpmo import audio as A
from omnijax.models.minicpmo import audio_features as af
from omnijax.models.minicpmo import audio_stream as S
from tests._support import DATA

GOLDEN = DATA / "minicpmo45"
FEATURE_TOL = 5e-5
TOL = 1e-5


def maxdiff(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.fixture(scope="module")
def hf_config():
    return json.loads((GOLDEN / "checkpoint" / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors():
    return load_file(GOLDEN / "checkpoint" / "model.safetensors")


@pytest.fixture(scope="module")
def config(hf_config):
    return A.AudioConfig.from_hf(hf_config)


@pytest.fixture(scope="module")
def encoder(tensors, config):
    return A.encoder_from_checkpoint(tensors, config)


@pytest.fixture(scope="module")
def case3():
    return dict(np.load(GOLDEN / "case3_audio.npz"))


@pytest.fixture(scope="module")
def case4():
    return dict(np.load(GOLDEN / "case4_duplex.npz"))


@pytest.fixture(scope="module")
def case3_clips(case3):
    return [case3["audio_features"][i][:, :n] for i, n in enumerate(case3["audio_feature_lens"])]


# ------------------------------------------------------------------------------------------------------- config


def test_config_from_checkpoint(config):
    assert (config.num_mel_bins, config.d_model, config.encoder_layers, config.encoder_attention_heads,
            config.encoder_ffn_dim, config.max_source_positions, config.output_dim) == (80, 32, 2, 2, 128, 1500, 128)
    assert (config.chunk_length, config.chunk_frames, config.pool_step) == (1.0, 50, 5)
    assert A.AudioConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="unknown AudioConfig fields"):
        A.AudioConfig.from_json({**config.to_json(), "n_window": 50})


@pytest.mark.parametrize("change, match", [
    (lambda c: c["audio_config"].update(activation_function="relu"), "activation_function"),
    (lambda c: c["audio_config"].update(scale_embedding=True), "scale_embedding"),
    (lambda c: c["audio_config"].update(model_type="qwen2_audio_encoder"), "model_type"),
    (lambda c: c["audio_config"].update(num_hidden_layers=3), "num_hidden_layers"),
    (lambda c: c["audio_config"].update(layer_norm_eps=1e-6), "layer_norm_eps"),
    (lambda c: c.update(init_audio=False), "init_audio"),
    (lambda c: c.pop("audio_config"), "audio_config"),
])
def test_config_refuses_unsupported_math(hf_config, change, match):
    bad = json.loads(json.dumps(hf_config))
    change(bad)
    with pytest.raises(A.UnsupportedAudioConfigError, match=match):
        A.AudioConfig.from_hf(bad)


def test_config_refuses_inconsistent_sizes(hf_config):
    bad = json.loads(json.dumps(hf_config))
    bad["audio_config"]["encoder_ffn_dim"] = 96  # projector input would be 24, not d_model 32
    with pytest.raises(ValueError, match="encoder_ffn_dim // 4"):
        A.AudioConfig.from_hf(bad)


def test_token_counts():
    assert [A.audio_token_count(t) for t in (150, 73, 120, 102, 104, 9, 8, 1, 0, 3000)] == \
        [15, 7, 12, 10, 10, 1, 0, 0, 0, 300]


# ----------------------------------------------------------------------------------------------------- features


def test_offline_features_match_golden(case3, case4):
    for i, n in enumerate(case3["audio_feature_lens"]):
        feats = af.log_mel(case3[f"waveform_{i}"])
        assert feats.shape == (80, n) and feats.dtype == np.float32
        assert maxdiff(feats, case3["audio_features"][i][:, :n]) < FEATURE_TOL
    assert maxdiff(af.log_mel(case4["ref_audio_waveform"]), case4["ref_audio_features"][0]) < FEATURE_TOL
    batch, lengths = af.pad_features([af.log_mel(case3["waveform_0"]), af.log_mel(case3["waveform_1"])])
    assert batch.shape == (2, 80, 150) and lengths.tolist() == [150, 73]
    assert np.all(batch[1, :, 73:] == 0) and maxdiff(batch, case3["audio_features"]) < FEATURE_TOL


def test_streaming_features_match_golden(case4):
    wave = case4["stream_audio_waveform"]
    state = af.mel_stream_start()
    for i, (start, pending) in enumerate([(0, 80), (98, 80), (198, 80)]):
        before = state
        chunk, state = af.mel_stream_step(state, wave[16000 * i:16000 * (i + 1)])
        assert before.chunk_index == i  # the old state is untouched
        assert (chunk.index, chunk.start_frame, chunk.prefix_extra_frames, chunk.suffix_extra_frames) == \
            (i, start, 0 if i == 0 else 2, 2)
        assert maxdiff(chunk.features, case4[f"chunk{i}_mel"][0]) < FEATURE_TOL
        assert state.pending.size == pending and not state.pending.flags.writeable
    assert state.window.size == 560 + 3 * 16000 - 80  # 560 zeros of left padding, minus what is still pending


def test_streaming_features_wait_for_a_full_chunk(case4):
    wave = case4["stream_audio_waveform"]
    # Like the release, a short first piece is left-padded with zeros to 1035 ms and emitted at once.
    chunk, state = af.mel_stream_step(af.mel_stream_start(), wave[:8000])
    assert chunk.features.shape == (80, 102) and np.all(chunk.features[:, :50] == -1.5)  # log10 floor: silence
    assert state.pending.size == 80
    chunk, state = af.mel_stream_step(state, wave[8000:16000])  # 8080 < 16000 samples: nothing yet
    assert chunk is None and state.pending.size == 8080 and state.chunk_index == 1
    chunk, state = af.mel_stream_step(state, wave[16000:24000])
    assert chunk.features.shape == (80, 104) and chunk.start_frame == 98 and state.pending.size == 80


def test_audio_shorter_than_one_frame_is_refused():
    for n in (0, 1, 159):
        with pytest.raises(af.AudioTooShortError, match="one mel frame") as info:
            af.log_mel(np.zeros(n, np.float32))
        assert isinstance(info.value, ValueError)
    assert af.log_mel(np.zeros(160, np.float32)).shape == (80, 1)
    with pytest.raises(af.UnsupportedSampleRateError):
        af.log_mel(np.zeros(1600, np.float32), 8000)
    with pytest.raises(af.InvalidPcmError, match="integer PCM"):
        af.log_mel(np.zeros(1600, np.int16))


def test_long_audio_is_split_into_30s_clips():
    pcm = (0.1 * np.sin(np.arange(31 * 16000) * 0.05)).astype(np.float32)
    with pytest.raises(af.InvalidPcmError, match="log_mel_clips"):
        af.log_mel(pcm)
    clips = af.log_mel_clips(pcm)
    assert [c.shape for c in clips] == [(80, 3000), (80, 100)]
    np.testing.assert_array_equal(clips[1], af.log_mel(pcm[30 * 16000:]))


# ------------------------------------------------------------------------------------------------------ encoder


def test_offline_batch_matches_every_golden_intermediate(encoder, case3, case3_clips):
    tokens, x = A.encode_audio_batch(encoder, case3_clips, intermediates=True)
    np.testing.assert_array_equal(np.asarray(x["attention_masked"]), case3["apm_attention_mask_is_masked"][:, 0])
    assert maxdiff(x["conv2_out"], case3["apm_conv2_out"].transpose(0, 2, 1)) < TOL
    assert maxdiff(x["hidden_states"], case3["apm_hidden_states"]) < TOL
    assert maxdiff(x["projection"], case3["audio_projection_out"]) < TOL
    assert maxdiff(x["pooled"], case3["audio_pooled_out"]) < TOL
    assert maxdiff(tokens[0], case3["audio_embeds_0"]) < TOL
    assert maxdiff(tokens[1], case3["audio_embeds_1"]) < TOL


def test_padding_quirk_makes_short_clips_batch_dependent(encoder, case3, case3_clips):
    # Alone, the 73-frame clip has no padding frames to attend to; in the golden batch (padded to 150 frames) its
    # CNN frames 37..72 are computed from zeros and stay visible. The longest clip is the same either way.
    alone = A.encode_audio(encoder, case3_clips[1])
    assert maxdiff(alone, case3["audio_embeds_1"]) > 1e-2
    assert maxdiff(A.encode_audio(encoder, case3_clips[1], bucket=False), alone) < 1e-6  # bucket padding is inert
    assert maxdiff(A.encode_audio(encoder, case3_clips[0]), case3["audio_embeds_0"]) < TOL


def test_end_to_end_from_waveforms(encoder, case3, case4):
    ref = A.encode_audio(encoder, af.log_mel(case4["ref_audio_waveform"]))
    assert ref.shape == (12, 128) and maxdiff(ref, case4["ref_audio_embeds"]) < TOL
    assert maxdiff(A.encode_audio(encoder, af.log_mel(case3["waveform_0"])), case3["audio_embeds_0"]) < TOL
    tiny = A.encode_audio(encoder, af.log_mel(np.full(1200, 0.1, np.float32)))  # 8 mel frames: no full window
    assert tiny.shape == (0, 128)


def test_streaming_encoder_matches_golden(encoder, case4):
    mel_state, state = af.mel_stream_start(), None
    for i in range(3):
        chunk, mel_state = af.mel_stream_step(mel_state, case4["stream_audio_waveform"][16000 * i:16000 * (i + 1)])
        golden_chunk = chunk._replace(features=case4[f"chunk{i}_mel"][0])
        tokens, new_state, hidden = S.encode_audio_streaming(encoder, golden_chunk, state, intermediates=True)
        assert new_state.length == case4[f"chunk{i}_apm_attention_mask"].shape[-1] == 50 * (i + 1)
        assert not case4[f"chunk{i}_apm_attention_mask"].any()  # full attention over cache + chunk
        assert maxdiff(hidden, case4[f"chunk{i}_apm_hidden_states"][:, 0]) < TOL
        assert maxdiff(tokens, case4[f"chunk{i}_audio_embeds"]) < TOL
        e2e, e2e_state, _ = S.encode_audio_streaming(encoder, chunk, state, intermediates=True)
        assert maxdiff(e2e, case4[f"chunk{i}_audio_embeds"]) < TOL
        assert (state.length if state is not None else 0) == 50 * i  # the previous state is untouched
        state = new_state


def test_stream_state_is_a_pytree_and_resets_like_the_release(encoder, config, case4):
    empty = S.AudioStreamState.empty(config)
    leaves, treedef = jax.tree_util.tree_flatten(empty)
    assert len(leaves) == 2 and leaves[0].shape == (2, 1, 1500, 2, 16)
    assert jax.tree_util.tree_unflatten(treedef, leaves).length == 0
    # 1449 cached frames + 52 CNN frames of the next chunk reach the 1500 positions: the cache restarts.
    full = S.AudioStreamState(keys=empty.keys, values=empty.values, length=1449)
    chunk = af.MelChunk(case4["chunk1_mel"][0], 2, 2, 1, 98)
    tokens, state = S.encode_audio_streaming(encoder, chunk, full)
    fresh, fresh_state = S.encode_audio_streaming(encoder, chunk, empty)
    assert state.length == fresh_state.length == 50
    assert maxdiff(tokens, fresh) == 0.0
    _, kept = S.encode_audio_streaming(encoder, chunk, S.AudioStreamState(empty.keys, empty.values, length=1447))
    assert kept.length == 1497


def test_feature_errors(encoder):
    with pytest.raises(A.FeatureShapeError, match="no frames"):
        A.encode_audio(encoder, np.zeros((80, 0), np.float32))
    with pytest.raises(A.FeatureShapeError, match="transposed"):
        A.encode_audio(encoder, np.zeros((20, 80), np.float32))
    with pytest.raises(A.FeatureShapeError, match="30 s"):
        A.encode_audio(encoder, np.zeros((80, 3001), np.float32))


# --------------------------------------------------------------------------------------------------- conversion


def test_parameter_tree_matches_the_conversion_tables(encoder, config):
    tree = nnx.to_pure_dict(nnx.state(encoder))
    shapes = jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)
    audio, projection = A.audio_components(config)
    assert (audio.prefix, projection.prefix) == ("apm.", "audio_projection_layer.")
    assert shapes["projection"] == param_shapes(projection)
    assert {k: v for k, v in shapes.items() if k != "projection"} == param_shapes(audio)


def test_checkpoint_missing_audio_tensors(tensors, config):
    partial = {k: v for k, v in tensors.items() if k != "apm.layers.1.fc1.weight"}
    with pytest.raises(MissingTensorError, match=r"apm\.layers\.1\.fc1\.weight"):
        A.encoder_from_checkpoint(partial, config)
    partial = {k: v for k, v in tensors.items() if k != "audio_projection_layer.linear2.bias"}
    with pytest.raises(MissingTensorError, match=r"audio_projection_layer\.linear2\.bias"):
        A.encoder_from_checkpoint(partial, config)
    no_audio = {k: v for k, v in tensors.items() if not k.startswith("apm.")}
    with pytest.raises(MissingTensorError, match=r"no audio encoder tensors \(apm\.\*\)"):
        A.encoder_from_checkpoint(no_audio, config)
