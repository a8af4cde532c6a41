"""The int4 Pallas kernel as the decoder's matmul (`omnijax.models.quant_kernel`, `QuantizedWeight.kernel`): a
decoder whose int4 weights (attention, dense MLP, experts) are set to "pallas" gives the XLA formulation's logits on
CPU (the kernel interpreted), its forward lowered for cuda calls Triton on the packed codes (and never does without
the setting), and models the kernel cannot run are refused by name, unchanged."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.convert import QuantizeOptions, convert_checkpoint
from omnijax.kernels.lowering import TRITON_CALL_TARGET, lower_for_cuda
from omnijax.kernels.quant import Int4Grouped, QuantizedWeight, quantize, with_kernel
from omnijax.models import moe as moe_lib
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder
from omnijax.models.forward import forward
from omnijax.models.quant_kernel import matmul_kernels, set_matmul_kernel
from omnijax.testing import checkpoints as demo

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERTS = ("expert_gate", "expert_up", "expert_down")


def _moe_int4():
    """A random decoder (layers 0 and 2 dense, 1 and 3 MoE of 4 experts, top 2), every projection int4 g32."""
    config = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=16, rope_theta=1e4, mrope_section=None, rms_norm_eps=1e-6,
                           qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           decoder_sparse_step=2, norm_topk_prob=True, dtype="float32")
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(5)))
    pure = nnx.to_pure_dict(state)
    for n in (*LINEAR, *EXPERTS):
        pure["layers"][n] = quantize(pure["layers"][n] * 10, Int4Grouped(32))  # x10: logits far from zero
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


def _inputs(B=2, T=12):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (B, T)), jnp.int32)
    return ids, jnp.ones((B, T), bool), jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, B, T))


def _forward(graphdef):
    def run(params, ids, valid, positions):
        return forward(graphdef, params, ids, valid, positions, None, None, None, page_size=8)
    return run


def test_pallas_decoder_equals_xla_and_lowers_to_triton():
    graphdef, state = _moe_int4()
    pallas = with_kernel(state, "pallas")
    leaves = jax.tree_util.tree_leaves(pallas, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    assert sum(isinstance(a, QuantizedWeight) and a.kernel == "pallas" for a in leaves) == 10
    run = jax.jit(_forward(graphdef))
    args = _inputs()
    want, got = np.asarray(run(state, *args)), np.asarray(run(pallas, *args))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    text = lower_for_cuda(_forward(graphdef), pallas, *args)
    # one Triton call per distinct weight shape (the layer scan's body and functions are shared), each reading its
    # packed codes: q/o and an expert's gate/up/down [64 -> 64], k/v [64 -> 32], gate/up [64 -> 128], down [128 -> 64]
    calls = [line for line in text.splitlines() if TRITON_CALL_TARGET in line and "custom_call" in line]
    codes = {m for line in calls for m in re.findall(r"tensor<(\d+x\d+)xui8>", line)}
    assert {"32x64", "32x32", "32x128", "64x64"} <= codes, (codes, len(calls))
    assert TRITON_CALL_TARGET not in lower_for_cuda(_forward(graphdef), state, *args)


def test_pallas_experts_refuse_ragged_dot_by_name():
    graphdef, state = _moe_int4()
    layer = with_kernel(nnx.to_pure_dict(state)["layers"], "pallas")
    gate, up, down = (layer[n].index(1) for n in EXPERTS)
    x = jnp.ones((3, 64), jnp.float32)
    router = jnp.ones((64, 4), jnp.float32)
    with pytest.raises(ValueError, match="impl='ragged_dot' dequantises the expert stack.*kernel='pallas'"):
        moe_lib.moe_ffn(x, router, gate, up, down, top_k=2, norm_topk_prob=True, impl="ragged_dot")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_kernel")
    src = demo.write_tiny_hf_checkpoint(root / "hf", encoders=False)
    return {name: convert_checkpoint(src, root / name, progress=False, log=lambda _: None, quantize=options)
            for name, options in (("float", QuantizeOptions()), ("int4", QuantizeOptions("int4", 32)),
                                  ("int8", QuantizeOptions("int8")))}


def test_loaded_int4_model_runs_alike_on_the_kernel(checkpoints):
    """`omnijax.load` (layers split per layer on CPU: each projection a `lax.switch` branch) then
    `set_matmul_kernel(model, "pallas")`: the same logits (1e-4) as on XLA's formulation; "xla" puts every weight
    back. (A Session's step multiplies through the same `layers.linear`; it is not compiled twice more here.)"""
    model = omnijax.load(checkpoints["int4"])
    kernels = matmul_kernels(model)
    assert set(kernels.values()) == {"xla"} and len(kernels) == 4 * len(LINEAR)  # 4 layers, split
    ids = (np.arange(40) * 37 % 500)[None]
    want = np.asarray(model(input_ids=ids))
    assert set_matmul_kernel(model, "pallas") is model
    assert set(matmul_kernels(model).values()) == {"pallas"}
    got = np.asarray(model(input_ids=ids))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    set_matmul_kernel(model, "xla")
    assert set(matmul_kernels(model).values()) == {"xla"}


def test_models_the_kernel_cannot_run_are_refused_unchanged(checkpoints):
    int8 = omnijax.load(checkpoints["int8"])
    with pytest.raises(ValueError, match=r"Int4Grouped weights only; these are not: .*q_proj.* \(Int8PerChannel\)"):
        set_matmul_kernel(int8, "pallas")
    assert set(matmul_kernels(int8).values()) == {"xla"}
    with pytest.raises(ValueError, match="holds none .*--quantize int4"):
        set_matmul_kernel(omnijax.load(checkpoints["float"]), "pallas")
    with pytest.raises(ValueError, match=r"kernel must be one of \('xla', 'pallas'\), got 'cuda'"):
        set_matmul_kernel(int8, "cuda")
    with pytest.raises(TypeError, match="takes a loaded model"):
        set_matmul_kernel(object(), "xla")
