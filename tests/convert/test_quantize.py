"""`omnijax convert --quantize int8|int4 --group-size N` and `--keep-quantized` (issue 41): the manifest records each
quantised weight's scheme, the stored arrays round-trip bit for bit, GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights kept
quantised
equal the float conversion's weights bit for bit and give transformers' logits of the same file (1e-4), other GGUF
types are dequantised (or requantised) and reported, and every bad option or manifest is refused by name with nothing
written. The decoder's numbers with quantised weights are in tests/models/test_quantized_decoder.py."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import omnijax
from omnijax.checkpoint import format as checkpoint
from omnijax.convert import QuantizeOptions, convert_checkpoint
from omnijax.convert.__main__ import main as convert_main
from omnijax.errors import ConvertError
from omnijax.kernels.quant import Int4Grouped, Int8Grouped, Int8PerChannel, QuantizedWeight, dequantize, quantize
from omnijax.testing import checkpoints as demo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
QUIET = dict(progress=False, log=lambda _: None)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny Qwen2.5-Omni thinker whose MLP is 96 wide (32 divides it, 64 does not)."""
    config = dict(demo.TINY_TEXT_CONFIG, intermediate_size=96, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    return demo.write_tiny_hf_checkpoint(tmp_path_factory.mktemp("q") / "hf", encoders=False, text_config=config)


def _nothing_written(tmp_path, dst):
    assert not dst.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}")] == []


def test_group_size_that_does_not_divide_a_width_is_refused(src, tmp_path):
    """--group-size 64 does not divide the down projection's input width 96: refused naming both, nothing written
    (the API and the command line)."""
    with pytest.raises(ConvertError, match=r"--group-size 64 does not divide the input width 96 of layers.down_proj"):
        convert_checkpoint(src, tmp_path / "out", **QUIET, quantize=QuantizeOptions("int4", 64))
    _nothing_written(tmp_path, tmp_path / "out")
    assert convert_main([str(src), str(tmp_path / "cli"), "--quantize", "int8", "--group-size", "64",
                         "--no-progress"]) == 1
    _nothing_written(tmp_path, tmp_path / "cli")


@pytest.mark.parametrize("options, needle", [
    (QuantizeOptions(None, 32), "--group-size 32 needs --quantize"),
    (QuantizeOptions("int3"), "--quantize must be one of"),
    (QuantizeOptions("int4", 48), "--group-size must be one of"),
    (QuantizeOptions(keep_quantized=True), "--keep-quantized applies to a GGUF source only"),
])
def test_bad_options_are_refused_by_name(src, tmp_path, options, needle):
    with pytest.raises(ConvertError, match=needle):
        convert_checkpoint(src, tmp_path / "out", **QUIET, quantize=options)
    _nothing_written(tmp_path, tmp_path / "out")


def test_command_line_group_size_choices(src, tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert_main([str(src), str(tmp_path / "out"), "--quantize", "int4", "--group-size", "48"])
    assert "--group-size" in capsys.readouterr().err
    _nothing_written(tmp_path, tmp_path / "out")
    assert convert_main([str(src), str(tmp_path / "ok"), "--quantize", "int8", "--group-size", "32",
                         "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "ok" / "omnijax.json").read_text())
    assert manifest["quantization"]["layers.down_proj"] == {"scheme": "int8_grouped", "group_size": 32,
                                                            "scale_dtype": "float32"}
    assert sorted(manifest["source"]["quantization"]) == sorted(f"layers.{n}" for n in LINEAR)


def test_stored_quantized_arrays_round_trip_bit_for_bit(tmp_path):
    """`save_params` of a tree with QuantizedWeight leaves (float32 and float16 scales) and `load_params` against
    `quantized_abstract` give back the same codes, scales and offsets bit for bit, and the manifest the schemes."""
    from omnijax.models.config import DecoderConfig
    from omnijax.models.qwen2_5_omni.convert import param_shapes

    config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=32, rope_theta=1e4, mrope_section=None, rms_norm_eps=1e-6)
    rng = np.random.default_rng(0)
    shapes = param_shapes(config)
    tree = jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), shapes, is_leaf=lambda s: isinstance(s, tuple))
    layers = tree["layers"]
    layers["q_proj"] = quantize(layers["q_proj"], Int4Grouped(32))
    layers["up_proj"] = quantize(layers["up_proj"], Int8PerChannel())
    g = quantize(layers["gate_proj"], Int8Grouped(64))
    layers["gate_proj"] = QuantizedWeight(g.values, g.scales.astype(np.float16), None, g.scheme)
    layers = {k: jax.tree.map(np.asarray, v) for k, v in layers.items()}
    tree["layers"] = layers
    checkpoint.save_params(tmp_path / "ck", "qwen2", config, tree)
    manifest = checkpoint.read_manifest_dict(tmp_path / "ck")
    quant = checkpoint.read_quantization(manifest)
    assert {k: v[0] for k, v in quant.items()} == {"layers.q_proj": Int4Grouped(32), "layers.up_proj": Int8PerChannel(),
                                                   "layers.gate_proj": Int8Grouped(64)}
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), shapes,
                            is_leaf=lambda s: isinstance(s, tuple))
    stored = checkpoint.load_params(tmp_path / "ck", checkpoint.quantized_abstract(abstract, quant))
    back = checkpoint.as_quantized(stored, quant)
    for name in ("q_proj", "up_proj", "gate_proj"):
        a, b = layers[name], back["layers"][name]
        assert isinstance(b, QuantizedWeight) and b.scheme == a.scheme
        for part in ("values", "scales", "offsets"):
            x, y = getattr(a, part), getattr(b, part)
            assert (x is None) == (y is None)
            if x is not None:
                assert np.asarray(y).dtype == x.dtype
                np.testing.assert_array_equal(np.asarray(y), x)
    np.testing.assert_array_equal(np.asarray(back["layers"]["o_proj"]), layers["o_proj"])


@pytest.mark.parametrize("edit, needle", [
    (lambda q: q["layers.q_proj"].update(scheme="int3"), "scheme 'int3', which this omnijax does not know"),
    (lambda q: q["layers.q_proj"].update(group_size=48), "group size must be one of"),
    (lambda q: q["layers.q_proj"].update(scale_dtype="int8"), "scale/offset dtypes"),
    (lambda q: q.update({"layers.nope": {"scheme": "int8", "scale_dtype": "float32"}}), "nope"),
    (lambda q: q["layers.down_proj"].update(group_size=64), "group size 64 does not divide its input width 96"),
    (lambda q: q.update({"final_norm": {"scheme": "int8", "scale_dtype": "float32"}}),
     "'final_norm' of shape .* is not a matrix"),
])
def test_load_refuses_an_unknown_scheme_by_name(src, tmp_path, edit, needle):
    """A manifest naming a scheme (or group size, dtype, parameter) this omnijax does not know is refused by name
    before any parameter is read; reading the same checkpoint unedited works."""
    out = convert_checkpoint(src, tmp_path / "q", **QUIET, quantize=QuantizeOptions("int4", 32))
    omnijax.load(out)
    manifest = json.loads((out / "omnijax.json").read_text())
    edit(manifest["quantization"])
    (out / "omnijax.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointFormatError, match=needle):
        omnijax.load(out)


# ------------------------------------------------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module")
def gguf_helpers():
    pytest.importorskip("gguf", reason="the gguf package (the omnijax[gguf] / test extra) writes the test files")
    pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
    from tests.convert import test_gguf

    return test_gguf


KEPT_SCHEMES = {
    "Q8_0": {"scheme": "int8_grouped", "group_size": 32, "scale_dtype": "float16"},
    "Q4_0": {"scheme": "int4", "group_size": 32, "scale_dtype": "float16", "offset_dtype": "float16"},
    "Q4_1": {"scheme": "int4", "group_size": 32, "scale_dtype": "float16", "offset_dtype": "float16"},
    "Q4_K": {"scheme": "int4", "group_size": 32, "scale_dtype": "float32", "offset_dtype": "float32"},
    "Q6_K": {"scheme": "int8_grouped", "group_size": 16, "scale_dtype": "float32"},
}


@pytest.mark.parametrize("qtype", sorted(KEPT_SCHEMES))
def test_gguf_blocks_kept_quantized(gguf_helpers, qtype, tmp_path_factory, tmp_path):
    """Llama (q/k rows permuted by llama.cpp) with every matrix in `qtype`, `--keep-quantized`: every linear weight is
    repacked (manifest: `KEPT_SCHEMES`; the K-quants' sub-block scales folded into float32 group scales), dequantises
    to the float conversion's weight bit for bit, and the model's logits equal transformers' loading the same file to
    1e-4 (the K-quant blocks are random bytes with small float16 scales: gguf-py cannot quantise them)."""
    h = gguf_helpers
    vocab = h.tiny_vocab(tmp_path_factory.mktemp("vocab"))
    path = h.write_gguf(tmp_path / f"tiny-{qtype}.gguf", "llama", h.hf_weights(np.random.default_rng(0), tied=False),
                        *vocab, qtype=qtype)
    flt = convert_checkpoint(path, tmp_path / "float", **QUIET)
    kept = convert_checkpoint(path, tmp_path / "kept", **QUIET, quantize=QuantizeOptions(keep_quantized=True))
    manifest = json.loads((kept / "omnijax.json").read_text())
    assert manifest["quantization"] == {f"layers.{n}": KEPT_SCHEMES[qtype] for n in LINEAR}
    assert all("repacked from GGUF " + qtype in why for why in manifest["source"]["quantization"].values())
    a, b = omnijax.load(flt), omnijax.load(kept)
    for n in LINEAR:
        qw = b.decoder.layers.stacked()[n]
        assert isinstance(qw, QuantizedWeight)
        np.testing.assert_array_equal(np.asarray(dequantize(qw)), np.asarray(a.decoder.layers.stacked()[n]))
    ids = np.random.default_rng(1).integers(3, h.VOCAB, (1, 24))
    got, ref = np.asarray(b(input_ids=ids)), h.transformers_logits(path, ids)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_gguf_other_types_dequantized_or_requantized_and_reported(gguf_helpers, tmp_path_factory, tmp_path):
    """Q5_K weights are not repacked: with `--keep-quantized` alone they are dequantised (the manifest has no
    quantisation and the report says so); with `--quantize int8` as well they are requantised and reported."""
    h = gguf_helpers
    vocab = h.tiny_vocab(tmp_path_factory.mktemp("vocab"))
    path = h.write_gguf(tmp_path / "tiny-q5k.gguf", "llama", h.hf_weights(np.random.default_rng(0)), *vocab,
                        qtype="Q5_K")
    notes: list[str] = []
    out = convert_checkpoint(path, tmp_path / "kept", progress=False, log=notes.append,
                             quantize=QuantizeOptions(keep_quantized=True))
    manifest = json.loads((out / "omnijax.json").read_text())
    assert "quantization" not in manifest
    assert all("['Q5_K'] are not repacked" in w and w.endswith("dequantised to float")
               for w in manifest["source"]["quantization"].values())
    assert any(line.startswith("layers.q_proj: GGUF type(s) ['Q5_K']") for line in notes)
    out = convert_checkpoint(path, tmp_path / "requant", **QUIET,
                             quantize=QuantizeOptions("int8", keep_quantized=True))
    manifest = json.loads((out / "omnijax.json").read_text())
    assert {v["scheme"] for v in manifest["quantization"].values()} == {"int8"}
    assert all("requantised as Int8PerChannel" in w for w in manifest["source"]["quantization"].values())
