"""Quantised weights in the decoder (issue 41): a checkpoint converted with `--quantize int8|int4` loads its linear
weights as `QuantizedWeight`s, and its logits (one-shot and streamed) equal those of the same model with every
quantised weight dequantised into a float parameter (the oracle: `dequantize`, then the float decoder) to float
tolerance; a mixed dense/MoE decoder with quantised experts likewise (both MoE impls)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.chunks.spans import SpanKind
from omnijax.convert import QuantizeOptions, convert_checkpoint
from omnijax.demo.passkey import configs
from omnijax.kernels.quant import Int4Grouped, Int8Grouped, Int8PerChannel, QuantizedWeight, dequantize, quantize
from omnijax.models import moe as moe_lib
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.models.forward import forward
from omnijax.models.frontend import units_for
from omnijax.testing import checkpoints as demo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPTIONS = {"int8": QuantizeOptions("int8"), "int8_g64": QuantizeOptions("int8", 64),
           "int4_g32": QuantizeOptions("int4"), "int4_g128": QuantizeOptions("int4", 128)}
SCHEMES = {"int8": Int8PerChannel(), "int8_g64": Int8Grouped(64), "int4_g32": Int4Grouped(32),
           "int4_g128": Int4Grouped(128)}
# The oracle's dequantisation (and the in-memory MoE weights' quantisation) as one program per shape and scheme: op
# by op, each call lowered its ten-odd primitives afresh per shape (~350 lowerings in this module).
_dequantize = jax.jit(dequantize, static_argnums=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny Qwen2.5-Omni thinker (hidden 128, MLP 256, 4 layers) and its float conversion."""
    root = tmp_path_factory.mktemp("quantized")
    src = demo.write_tiny_hf_checkpoint(root / "hf", encoders=False)
    return src, convert_checkpoint(src, root / "float", progress=False, log=lambda _: None)


def _convert(source, tmp_path, name):
    return convert_checkpoint(source[0], tmp_path / name, progress=False, log=lambda _: None,
                              quantize=OPTIONS[name])


def dequantized_copy(path):
    """The checkpoint at `path` loaded with every quantised parameter replaced by its dequantised float weight (the
    oracle)."""
    reference = omnijax.load(path)
    for _, param in nnx.iter_graph(reference.decoder.layers):  # stacked or split per layer alike
        if isinstance(param, nnx.Param) and isinstance(param[...], QuantizedWeight):
            param.set_value(_dequantize(param[...], reference.config.jnp_dtype))
    return reference


@pytest.mark.parametrize("name", list(OPTIONS))
def test_quantized_checkpoint_equals_its_dequantized_float_model(source, tmp_path, name):
    """Every linear weight is stored quantised with the asked scheme (manifest and loaded leaves), equals the float
    conversion's weight to half its scale, and the model's logits equal the dequantise-then-float model's (one shot,
    and streamed through a Session) to 1e-4, while differing from the float model's by more (quantisation happened)."""
    path = _convert(source, tmp_path, name)
    entries = json.loads((path / "omnijax.json").read_text())["quantization"]
    assert sorted(entries) == sorted(f"layers.{n}" for n in LINEAR)
    model, flt = omnijax.load(path), omnijax.load(source[1])
    for n in LINEAR:
        qw = model.decoder.layers.stacked()[n]
        assert isinstance(qw, QuantizedWeight) and qw.scheme == SCHEMES[name]
        w = np.asarray(flt.decoder.layers.stacked()[n])
        scale = np.repeat(np.asarray(qw.scales), w.shape[-2] // qw.scales.shape[-2], axis=-2)
        assert np.all(np.abs(np.asarray(_dequantize(qw, jnp.float32)) - w) <= scale / 2 + 1e-6)
        assert qw.nbytes < w.nbytes / (3 if qw.scheme.bits == 8 else 5)
    assert isinstance(model.decoder.embed[...], jax.Array)  # the embedding and the head stay float
    reference = dequantized_copy(path)
    assert all(isinstance(reference.decoder.layers.stacked()[n], jax.Array) for n in LINEAR)
    ids = (np.arange(40) * 37 % 500)[None]
    got = _assert_alike(model, reference, ids)
    assert np.abs(got - np.asarray(flt(input_ids=ids))).max() > 1e-3


def _assert_alike(model, reference, ids):
    """One-shot logits equal to 1e-4; two sessions, one per model, fed the same two text units: logits equal to
    1e-4 and answers equal. Returns the model's one-shot logits."""
    got, want = np.asarray(model(input_ids=ids)), np.asarray(reference(input_ids=ids))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    config = configs(128)["NoSlide"]
    units = units_for(model)
    streamed = []
    half = ids.shape[1] // 2  # two units padded alike: one compiled step per model
    for m in (model, reference):
        session = omnijax.Session(m, config)
        out = session.feed(units.pad(units.text(ids[0, :half], 0, SpanKind.TEXT, answer_tokens=4)))
        out2 = session.feed(units.pad(units.text(ids[0, half:], 1, SpanKind.TEXT, answer_tokens=4)))
        streamed.append((np.asarray(out.logits), np.asarray(out2.logits), np.asarray(out2.tokens)))
    np.testing.assert_allclose(streamed[0][0], streamed[1][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(streamed[0][1], streamed[1][1], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(streamed[0][2], streamed[1][2])
    return got


def test_quantized_tiny_qwen3_omni_streams_like_its_dequantized_model(tmp_path):
    """The tiny Qwen3-Omni thinker (MoE layers of 8 experts beside a dense one) converted with `--quantize int4`:
    attention, dense MLP and expert weights are quantised, and its logits (one shot and streamed) equal the
    dequantise-then-float model's."""
    pytest.importorskip("torch", reason="torch (the test extra) builds the tiny Hugging Face thinker")
    from tests._support import qwen3_omni_models as Q

    src = Q.save_thinker(Q.build_thinker(seed=0), tmp_path / "hf")
    path = convert_checkpoint(src, tmp_path / "q4", progress=False, log=lambda _: None,
                              quantize=QuantizeOptions("int4", 32))
    entries = json.loads((path / "omnijax.json").read_text())["quantization"]
    assert sorted(entries) == sorted(f"layers.{n}" for n in (*LINEAR, "expert_gate", "expert_up", "expert_down"))
    model = omnijax.load(path)
    assert isinstance(model.decoder.layers.stacked()["expert_down"], QuantizedWeight)
    ids = (np.arange(40) * 7 % 280)[None]
    got = _assert_alike(model, dequantized_copy(path), ids)
    assert np.abs(got).max() > 0.1


def test_load_refuses_a_dtype_cast_of_quantized_weights(source, tmp_path):
    """A quantised checkpoint loaded with `dtype=` (which would recast its scales) is refused naming the option."""
    path = _convert(source, tmp_path, "int4_g32")
    with pytest.raises(ValueError, match="dtype='bfloat16'.*quantised"):
        omnijax.load(path, dtype="bfloat16")


@functools.cache
def _moe_float():
    """The random mixed decoder (layers 0 and 2 dense, 1 and 3 MoE of 4 experts, top 2) in float, initialised once
    (op by op): `(config, decoder)`; callers copy it."""
    config = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=16, rope_theta=1e4, mrope_section=None, rms_norm_eps=1e-6,
                           qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           decoder_sparse_step=2, norm_topk_prob=True, dtype="float32")
    return config, Decoder(config, rngs=nnx.Rngs(3))


@functools.partial(jax.jit, static_argnums=1)
def _quantize_x10(w, scheme):
    return quantize(w * 10, scheme)  # x10: logits far from zero


@functools.cache
def _moe_decoder(scheme):
    """`_moe_float`'s decoder with every linear and expert weight quantised in memory, and its dequantised float
    twin (the oracle): `(config, graphdef, state, dense)`, built once per scheme (the tests only read them)."""
    config, decoder = _moe_float()
    graphdef, state = nnx.split(nnx.clone(decoder))
    pure = nnx.to_pure_dict(state)
    for n in (*LINEAR, "expert_gate", "expert_up", "expert_down"):
        pure["layers"][n] = _quantize_x10(pure["layers"][n], scheme)
    nnx.replace_by_pure_dict(state, pure)
    dense = jax.tree.map(lambda a: _dequantize(a, jnp.float32) if isinstance(a, QuantizedWeight) else a, state,
                         is_leaf=lambda a: isinstance(a, QuantizedWeight))
    return config, graphdef, state, dense


@functools.partial(jax.jit, static_argnums=0, static_argnames="impl")
def _moe_forward(graphdef, params, ids, valid, positions, *, impl):
    """`forward` traced once per `impl` (a static argument: `forward` reads `moe_lib.default_impl()` while tracing,
    so a trace keyed without it would serve the other impl's program); the plain function, jitted here."""
    return forward.__wrapped__(graphdef, params, ids, valid, positions, None, None, None, page_size=8)


@pytest.mark.parametrize("impl", moe_lib.IMPLS)
@pytest.mark.parametrize("scheme", [Int8PerChannel(), Int4Grouped(32)], ids=["int8", "int4"])
def test_quantized_moe_experts_equal_dequantized(impl, scheme, monkeypatch):
    """A mixed dense/MoE decoder with quantised experts (per-expert dequantisation in the blocked impl, the whole
    stack in ragged_dot's) gives the dequantised float decoder's logits to 1e-4."""
    traced = []
    monkeypatch.setattr(moe_lib, "default_impl", lambda: traced.append(impl) or impl)
    config, graphdef, state, dense = _moe_decoder(scheme)
    B, T = 2, 12
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, B, T))
    valid = jnp.ones((B, T), bool)

    got = np.asarray(_moe_forward(graphdef, state, ids, valid, positions, impl=impl))
    assert traced, f"the quantised decoder was not traced with impl={impl!r}"  # its own program, not another impl's
    want = np.asarray(_moe_forward(graphdef, dense, ids, valid, positions, impl=impl))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
