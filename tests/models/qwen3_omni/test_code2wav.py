"""Qwen3-Omni Code2Wav against transformers' `Qwen3OmniMoeCode2Wav`, one shot and in chunks (streamed with carried
state, or re-decoded with left context), and the boundary trap of upstream's fixed-offset trimming."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from omnijax.checkpoint.name_tables import convert_in_memory, param_shapes
from omnijax.errors import MissingTensorError, UnsupportedConfigError
from omnijax.models.qwen3_omni.code2wav import (
    Code2Wav,
    Code2WavConfig,
    Code2WavConfigError,
    code2wav_component,
    code2wav_from_params,
    output_length,
)
from omnijax.models.qwen3_omni.code2wav_decode import (
    Code2WavStream,
    decode,
    decode_chunked,
    decode_streamed,
    earliest_frame,
    min_left_context,
)

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig  # noqa: E402
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav  # noqa: E402

# The release's upsampling (2, 2) x (8, 5, 4, 3) = 1,920 samples a frame, at tiny widths; GQA; a window of 4 frames so
# that 40 frames cross it many times. The second config: attention biases, other rates, one upsampling stage.
TINY = dict(codebook_size=16, num_quantizers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            sliding_window=4, intermediate_size=48, num_hidden_layers=2, decoder_dim=32)
CONFIGS = {"release_rates": dict(TINY, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2)),
           "biases_other_rates": dict(TINY, attention_bias=True, sliding_window=3, num_hidden_layers=3,
                                      upsample_rates=(4, 3), upsampling_ratios=(3,), decoder_dim=16)}
TOL = 1e-4  # of the signal's peak


def seeded_reference(kwargs: dict, seed: int = 0) -> Qwen3OmniMoeCode2Wav:
    """transformers' module with weights that keep the signal in range: variance-preserving convs and linears, the
    residual branches and the last conv scaled down (random weights otherwise grow ~2x a block and clamp every
    sample), and every 1-D parameter (norms, scales, biases, Snake alpha/beta) moved off its initial value."""
    torch.manual_seed(seed)
    model = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**kwargs)).eval()
    last = f"decoder.{len(kwargs['upsample_rates']) + 2}."
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
                continue
            transposed = (name.startswith("upsample.") and ".0.conv" in name) or ".block.1.conv" in name
            fan = p.shape[0] * (2 if ".block.1.conv" in name else 1) if transposed else math.prod(p.shape[1:])
            gain = 0.03 if name.startswith(last) else 0.3 if ("conv2" in name or "pwconv2" in name) else 1.0
            p.normal_(0.0, gain / math.sqrt(fan))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    """(transformers module, omnijax model) with the same weights, converted through the name table."""
    ref = seeded_reference(CONFIGS[request.param])
    config = Code2WavConfig.from_hf(ref.config.to_dict())
    tensors = {"code2wav." + k: v.numpy() for k, v in ref.state_dict().items()}
    params = convert_in_memory(tensors, [code2wav_component(config)], strip_prefix="")["code2wav"]
    return ref, code2wav_from_params(config, params)


def codes_for(config: Code2WavConfig, frames: int, batch: int = 2, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.codebook_size, (batch, config.num_quantizers, frames))


_REFERENCES: dict = {}  # (module id, codes' bytes) -> transformers' waveform: the 40-frame decode four tests compare


@pytest.fixture(scope="module", autouse=True)
def _forget_references():
    yield
    _REFERENCES.clear()


def reference(ref, codes: np.ndarray) -> np.ndarray:
    """transformers' waveform of `codes`, computed once per module and codes (the array is read-only)."""
    key = (id(ref), codes.shape, codes.tobytes())
    if key not in _REFERENCES:
        with torch.no_grad():
            wave = ref(torch.from_numpy(codes)).numpy()[:, 0]
        wave.flags.writeable = False
        _REFERENCES[key] = (ref, wave)  # `ref` kept alive so that its id is not reused
    return _REFERENCES[key][1]


def assert_close(ours, want):
    ours, want = np.asarray(ours), np.asarray(want)
    assert ours.shape == want.shape
    peak = np.abs(want).max()
    assert peak > 0.1, "the oracle's signal is (near) silent: the test would prove nothing"
    assert np.abs(ours - want).max() <= TOL * peak


# ----------------------------------------------------------------------------------------------- config, table


def test_release_numbers():
    config = Code2WavConfig()
    assert config.samples_per_frame == 1920  # 80 ms at 24 kHz
    assert config.lag == 555  # 8 -> 45 -> 184 -> 555 over the four decoder blocks
    assert output_length(config, 25) == 25 * 1920 - 555
    assert min_left_context(config) == 578  # 8 layers x 71 frames of attention, plus the convs' reach


def test_from_hf_reads_the_release_style_config():
    hf = Qwen3OmniMoeCode2WavConfig(**CONFIGS["release_rates"]).to_dict()
    hf.update(codebook_dim=512, num_semantic_quantizers=1, semantic_codebook_size=4096,
              vector_quantization_hidden_dimension=128)  # what releases carry; the reference never reads them
    config = Code2WavConfig.from_hf(hf)
    assert (config.head_dim, config.rope_theta, config.upsample_rates) == (8, 10000.0, (8, 5, 4, 3))
    for bad, attribute in ((dict(hidden_act="gelu"), "hidden_act"), (dict(use_flux=True), "use_flux"),
                           (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_parameters")):
        with pytest.raises(UnsupportedConfigError, match=attribute):
            Code2WavConfig.from_hf({**hf, **bad})
    with pytest.raises(Code2WavConfigError, match="num_key_value_heads"):
        Code2WavConfig.from_hf({**hf, "num_key_value_heads": 3})


def test_table_fills_the_module_tree(pair):
    _, model = pair
    want = jax.tree_util.tree_map(np.shape, nnx.to_pure_dict(nnx.state(Code2Wav(model.config, rngs=nnx.Rngs(0)))))
    assert param_shapes(code2wav_component(model.config)) == want


def test_table_reports_missing_tensors(pair):
    ref, model = pair
    tensors = {"code2wav." + k: v.numpy() for k, v in ref.state_dict().items() if k != "decoder.1.block.3.act2.beta"}
    with pytest.raises(MissingTensorError, match=r"decoder\.1\.block\.3\.act2\.beta"):
        convert_in_memory(tensors, [code2wav_component(model.config)], strip_prefix="")


# ------------------------------------------------------------------------------------------------ one shot


@pytest.mark.parametrize("frames", [1, 3, 40])
def test_one_shot_equals_transformers(pair, frames):
    ref, model = pair
    codes = codes_for(model.config, frames)
    want = reference(ref, codes)
    assert want.shape[1] == output_length(model.config, frames)
    if frames > 1:
        assert_close(decode(model, codes), want)
    else:  # one frame: the signal may be too short to be loud; compare absolutely
        assert np.abs(np.asarray(decode(model, codes)) - want).max() <= TOL


def test_bad_codes_are_refused(pair):
    _, model = pair
    codes = codes_for(model.config, 5)
    codes[1, 2, 4] = model.config.codebook_size
    with pytest.raises(ValueError, match=r"code 16 at \(batch 1, codebook 2, frame 4\)"):
        decode(model, codes)
    with pytest.raises(ValueError, match="num_quantizers"):
        decode(model, codes[:, :2])
    with pytest.raises(ValueError, match="integers"):
        decode(model, codes.astype(np.float32))


# ------------------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("first_chunk, chunk", [(4, 25), (1, 3)])
def test_streamed_chunks_equal_one_shot(pair, first_chunk, chunk):
    ref, model = pair
    config, F = model.config, model.config.samples_per_frame
    codes = codes_for(config, 40)
    parts = [np.asarray(w) for w in decode_streamed(model, codes, first_chunk=first_chunk, chunk=chunk)]
    sizes = [first_chunk] + [min(chunk, 40 - first_chunk - i) for i in range(0, 40 - first_chunk, chunk)]
    assert [p.shape[1] for p in parts] == [sizes[0] * F - config.lag] + [n * F for n in sizes[1:]]
    whole = np.asarray(decode(model, codes))
    assert np.abs(np.concatenate(parts, axis=1) - whole).max() <= TOL  # every sample, absolutely
    assert_close(np.concatenate(parts, axis=1), reference(ref, codes))


def test_stream_refuses_bad_push_unchanged(pair):
    _, model = pair
    stream = Code2WavStream(model, batch=2)
    codes = codes_for(model.config, 6)
    first = np.asarray(stream.push(codes[..., :4]))
    with pytest.raises(ValueError, match="batch 1"):
        stream.push(codes[:1, :, 4:])
    bad = codes[..., 4:].copy()
    bad[0, 0, 0] = -1
    with pytest.raises(ValueError, match="outside"):
        stream.push(bad)
    assert stream.frames == 4
    rest = np.asarray(stream.push(codes[..., 4:]))
    assert np.abs(np.concatenate([first, rest], axis=1) - np.asarray(decode(model, codes))).max() <= TOL


def test_left_context_chunks_equal_one_shot_where_fixed_offset_trimming_leaves_holes(pair):
    """The boundary trap: a decode of n frames returns n * F - lag samples, so keeping everything after
    `left_context * F` (transformers' `chunked_decode`) loses `lag` samples at every boundary; keeping the last
    `n * F` equals the one-shot decode."""
    ref, model = pair
    config, F, lag = model.config, model.config.samples_per_frame, model.config.lag
    context, chunk, frames = min_left_context(config), 7, 40
    codes = codes_for(config, frames)
    want = reference(ref, codes)
    with torch.no_grad():
        naive = ref.chunked_decode(torch.from_numpy(codes), chunk_size=chunk, left_context_size=context).numpy()[:, 0]
    boundaries = math.ceil(frames / chunk) - 1
    assert naive.shape[1] == want.shape[1] - boundaries * lag  # a hole of `lag` samples per boundary
    assert np.abs(naive[:, :chunk * F - lag] - want[:, :chunk * F - lag]).max() <= TOL * np.abs(want).max()
    assert np.abs(naive[:, chunk * F - lag:] - want[:, chunk * F - lag:naive.shape[1]]).max() > 0.01

    ours = np.concatenate([np.asarray(w) for w in decode_chunked(model, codes, first_chunk=chunk, chunk=chunk,
                                                                 left_context=context)], axis=1)
    assert_close(ours, want)
    assert np.abs(ours - np.asarray(decode(model, codes))).max() <= TOL


def test_left_context_below_the_receptive_field_is_refused(pair):
    _, model = pair
    need = min_left_context(model.config)
    with pytest.raises(ValueError, match=f"left_context >= {need} frames"):
        decode_chunked(model, codes_for(model.config, 8), left_context=need - 1)
    for name in ("first_chunk", "chunk"):
        with pytest.raises(ValueError, match=name):
            decode_chunked(model, codes_for(model.config, 8), **{name: 0})


def test_receptive_field_is_what_the_outputs_depend_on(pair):
    """`min_left_context` walks the network backwards (`earliest_frame`). Against the decode itself: changing frame
    f leaves every sample whose walk starts after f bit-equal (the bound is sound), and for most samples the walk's
    earliest frame does move them (it is tight; the faintest paths -- two attention hops to the window's far end --
    fall below float32 rounding, so one frame less of left context is not measurably worse on this model)."""
    _, model = pair
    config, frames, F = model.config, 24, model.config.samples_per_frame
    codes = codes_for(config, frames, batch=1)
    base = np.asarray(decode(model, codes))[0]
    earliest_changed = np.full(base.shape, frames)
    for f in range(frames - 1, -1, -1):
        moved = codes.copy()
        moved[0, :, f] = (moved[0, :, f] + 1) % config.codebook_size
        earliest_changed[np.asarray(decode(model, moved))[0] != base] = f  # outside the field: bit-equal
    walk = np.array([max(earliest_frame(config, m), 0) for m in range(base.size)])
    assert (earliest_changed >= walk).all()
    assert (earliest_changed == walk).mean() > 0.5  # not exactly 1: float32 rounding swallows the faintest paths

    need, start, n = min_left_context(config), frames - 4, 4
    window = np.asarray(decode(model, codes[..., start - need:start + n]))[0, -n * F:]
    assert np.abs(window - base[start * F - config.lag:(start + n) * F - config.lag]).max() <= TOL
