"""Quantised weights on the expert-parallel mesh (issue 41): `omnijax.evaluate` of a mixed dense/MoE Qwen3-MoE decoder
whose linear and expert weights are int8 (per channel) or int4 (groups of 32) equals the unsharded quantised run on
meshes whose `model` axis splits the experts (4x2, 2x4 over 8 simulated CPU devices); the unsharded quantised run
equals the dequantise-then-float decoder's (the oracle of the quantised matmul); and the expert stacks are placed
quantised (int8 / packed uint8 codes, never a float copy), codes, scales and offsets all split along the expert axis
over `model`, each device holding E / model experts.

As in `test_moe_expert_parallel.py`, the 8 devices need `--xla_force_host_platform_device_count=8` before JAX starts,
so the compiled comparisons run in one subprocess whose JSON summary the tests read; it records what `evaluate`
places by wrapping `distributed.put`.
"""

import textwrap

import pytest

from tests._support import multidevice

MESHES = [(4, 2), (2, 4)]
EXPERTS = 8
SCHEMES = ("int8", "int4_g32")

_WORKER = textwrap.dedent(f"""
    import json
    import jax
    import numpy as np
    from flax import nnx
    from omnijax import distributed
    from omnijax.eval.runner import EvalConfig, evaluate
    from omnijax.kernels.quant import Int4Grouped, Int8PerChannel, QuantizedWeight, dequantize, quantize
    from omnijax.models.config import TINY_OMNI
    from omnijax.models.decoder import Decoder
    from omnijax.retention import OmniPick
    from omnijax.testing.synthetic import eval_sessions

    CONFIG = TINY_OMNI.replace(num_layers=3, vocab_size=256, num_experts={EXPERTS}, num_experts_per_tok=2,
                               moe_intermediate_size=32, mlp_only_layers=(1,), qkv_bias=False, qk_norm=True,
                               mrope_interleaved=True)
    EVAL = EvalConfig("omnipick", policy=OmniPick(high_watermark=60, low_watermark=40, recent_units=1,
                      text_budget=8), max_answer_tokens=2, page_size=16, num_pages=12, keep_logits=True)
    QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "expert_gate",
                 "expert_up", "expert_down")
    EXPERT_STACKS = ("expert_gate", "expert_up", "expert_down")

    SESSIONS = eval_sessions(CONFIG.vocab_size)

    def decoders(scheme):
        # the quantised decoder (every linear and expert weight, x4 so logits are far from zero) and its
        # dequantised float copy (the oracle)
        graphdef, state = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))
        pure = nnx.to_pure_dict(state)
        for n in QUANTISED:
            pure["layers"][n] = pure["layers"][n] * 4
        nnx.replace_by_pure_dict(state, pure)
        original = nnx.merge(graphdef, state)  # float, before quantisation
        for n in QUANTISED:
            pure["layers"][n] = quantize(pure["layers"][n], scheme)
        _, state = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))
        nnx.replace_by_pure_dict(state, pure)
        dense = jax.tree.map(lambda a: dequantize(a) if isinstance(a, QuantizedWeight) else a, state,
                             is_leaf=lambda a: isinstance(a, QuantizedWeight))
        return nnx.merge(graphdef, state), nnx.merge(graphdef, dense), original

    placed = []
    _put = distributed.put

    def recording_put(tree, mesh, specs):
        out = _put(tree, mesh, specs)
        placed.append(out)
        return out

    distributed.put = recording_put

    def expert_placement(params):
        layers = nnx.to_pure_dict(params)["layers"]
        out = {{}}
        for name in EXPERT_STACKS:
            qw = layers[name]
            out[name] = {{"quantized": isinstance(qw, QuantizedWeight)}}
            if not isinstance(qw, QuantizedWeight):
                continue
            for part in ("values", "scales", "offsets"):
                x = getattr(qw, part)
                if x is None:
                    continue
                mesh = x.sharding.mesh
                spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
                held = {{}}
                for device, coords in zip(mesh.devices.flat, np.ndindex(mesh.devices.shape)):
                    shard = next(s for s in x.addressable_shards if s.device == device)
                    held.setdefault(int(coords[1]), set()).add(tuple(range(*shard.index[1].indices(x.shape[1]))))
                out[name][part] = {{"spec": [str(s) if s else None for s in spec], "dtype": str(x.dtype),
                                   "shape": list(x.shape),
                                   "shard_shapes": sorted({{tuple(s.data.shape) for s in x.addressable_shards}}),
                                   "experts_by_model_coord": {{k: sorted(v) for k, v in held.items()}}}}
        return out

    def flat(result):
        return [{{"logits": s.logits, "tokens": s.tokens, "stats": s.stats}} for s in result.sessions]

    def compare(ref, got):
        return {{"max_logit_diff": max(float(np.abs(a["logits"] - b["logits"]).max()) for a, b in zip(ref, got)),
                "tokens_equal": all((a["tokens"] == b["tokens"]).all() for a, b in zip(ref, got)),
                "stats_equal": all((a["stats"][k] == b["stats"][k]).all() for a, b in zip(ref, got)
                                   for k in a["stats"])}}

    out = {{"devices": jax.device_count(), "schemes": {{}}}}
    unquantised = None
    for label, scheme in (("int8", Int8PerChannel()), ("int4_g32", Int4Grouped(32))):
        model, dense, original = decoders(scheme)
        ref = flat(evaluate(model, SESSIONS, [EVAL], batch_size=8, progress=False)[EVAL.name])
        oracle = flat(evaluate(dense, SESSIONS, [EVAL], batch_size=8, progress=False)[EVAL.name])
        if unquantised is None:  # the float decoder before quantisation is the same for every scheme: run once
            unquantised = flat(evaluate(original, SESSIONS, [EVAL], batch_size=8, progress=False)[EVAL.name])
        row = {{"vs_dequantized": compare(oracle, ref), "vs_float": compare(unquantised, ref), "meshes": {{}},
               "peak_logit": max(float(np.abs(s["logits"]).max()) for s in ref),
               "evicted": int(sum(s["stats"]["evicted"].sum() for s in ref)),
               "answered": int(sum((s["tokens"] >= 0).sum() for s in ref))}}
        for shape in {MESHES!r}:
            placed.clear()
            result = evaluate(model, SESSIONS, [EVAL], mesh=distributed.make_mesh(*shape), batch_size=8,
                              progress=False)[EVAL.name]
            params = [t for t in placed if isinstance(t, nnx.State)]
            row["meshes"]["x".join(map(str, shape))] = dict(compare(ref, flat(result)), mesh=result.mesh_shape,
                                                            experts=expert_placement(params[0]))
        out["schemes"][label] = row
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded():
    return multidevice.run_worker(_WORKER)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_evaluation_equals_its_dequantized_decoder(sharded, scheme):
    """The unsharded quantised evaluation (eviction with re-indexing, greedy answers) equals the dequantise-then-float
    decoder's: logits within 1e-5 (peaks ~0.6), the same tokens and statistics; while the float decoder before
    quantisation gives logits 50x further off at least (the comparison sees quantisation)."""
    assert sharded["devices"] == 8
    row = sharded["schemes"][scheme]
    assert row["evicted"] > 0 and row["answered"] > 0 and row["peak_logit"] > 0.3
    got = row["vs_dequantized"]
    assert got["max_logit_diff"] <= 1e-5, got["max_logit_diff"]
    assert got["tokens_equal"] and got["stats_equal"]
    assert row["vs_float"]["max_logit_diff"] > 50 * max(got["max_logit_diff"], 1e-5), row["vs_float"]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_expert_parallel_equals_unsharded(sharded, scheme, shape):
    """Sharded over the mesh, the quantised evaluation's logits (1e-5), tokens and statistics equal the unsharded
    quantised run's."""
    got = sharded["schemes"][scheme]["meshes"]["x".join(map(str, shape))]
    assert got["max_logit_diff"] <= 1e-5, got["max_logit_diff"]
    assert got["tokens_equal"] and got["stats_equal"]
    assert got["mesh"] == {"data": shape[0], "model": shape[1]}


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_experts_are_split_over_the_model_axis(sharded, scheme, shape):
    """Each quantised expert stack stays quantised on the mesh (int8 codes, or uint8 bytes of two int4 codes), and
    its codes, scales and (int4) offsets `[Lm, E, ...]` are each split along E over `model`: E / model experts a
    device, the same ones for one model coordinate, disjoint blocks in order across coordinates."""
    m = shape[1]
    experts = sharded["schemes"][scheme]["meshes"]["x".join(map(str, shape))]["experts"]
    per_device = EXPERTS // m
    parts = ("values", "scales") if scheme == "int8" else ("values", "scales", "offsets")
    for name in ("expert_gate", "expert_up", "expert_down"):
        assert experts[name]["quantized"], name
        assert sorted(k for k in experts[name] if k != "quantized") == sorted(parts), (name, experts[name].keys())
        assert experts[name]["values"]["dtype"] == ("int8" if scheme == "int8" else "uint8")
        for part in parts:
            placement = experts[name][part]
            assert placement["spec"][:2] == [None, "model"] and set(placement["spec"][2:]) == {None}, (name, part)
            lead, total, *rest = placement["shape"]
            assert total == EXPERTS
            assert placement["shard_shapes"] == [[lead, per_device, *rest]], (name, part)
            held = placement["experts_by_model_coord"]
            assert sorted(held) == [str(i) for i in range(m)]
            assert all(len(v) == 1 for v in held.values())  # replicated over data
            assert [v[0] for _, v in sorted(held.items())] == [list(range(i * per_device, (i + 1) * per_device))
                                                               for i in range(m)]
