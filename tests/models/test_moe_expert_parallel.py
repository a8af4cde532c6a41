"""Expert parallelism: `omnijax.evaluate` of a Qwen3-MoE decoder (MoE and dense layers mixed, interleaved M-RoPE) on
meshes whose `model` axis splits the experts (4x2, 2x4 over 8 simulated CPU devices) equals the unsharded run, and
the expert weights it places really are split over `model` along the expert axis.

As in `test_evaluate.py`, the 8 devices need `--xla_force_host_platform_device_count=8` before JAX starts and
conftest has already started JAX here, so the compiled comparisons run in one subprocess (`_WORKER`) whose JSON
summary the tests read. The worker records what `evaluate` places on the mesh by wrapping `distributed.put`, the one
call through which it places the parameters.
"""

import textwrap
import types

import pytest

from tests._support import multidevice

MESHES = [(4, 2), (2, 4)]
EXPERTS = 8

# A 3-layer decoder whose layers 0 and 2 are MoE (8 experts, 2 per token) and layer 1 dense, with Qwen3's attention
# (no qkv bias, q/k norm) and interleaved M-RoPE; 8 sessions of different lengths with audiovisual units (distinct
# h/w positions), questions answered with 2 tokens, and a pool small enough that OmniPick evicts and re-indexes.
_SETUP = textwrap.dedent(f"""
    import numpy as np
    from flax import nnx
    from omnijax.models.config import TINY_OMNI
    from omnijax.eval.runner import EvalConfig
    from omnijax.models.decoder import Decoder
    from omnijax.retention import OmniPick
    from omnijax.testing.synthetic import eval_sessions

    CONFIG = TINY_OMNI.replace(num_layers=3, vocab_size=256, num_experts={EXPERTS}, num_experts_per_tok=2,
                               moe_intermediate_size=32, mlp_only_layers=(1,), qkv_bias=False, qk_norm=True,
                               mrope_interleaved=True)
    MODEL = Decoder(CONFIG, rngs=nnx.Rngs(0))
    EVAL = EvalConfig("omnipick", policy=OmniPick(high_watermark=60, low_watermark=40, recent_units=1,
                      text_budget=8), max_answer_tokens=2, page_size=16, num_pages=12, keep_logits=True)

    SESSIONS = eval_sessions(CONFIG.vocab_size)
""")

_WORKER = _SETUP + textwrap.dedent("""
    import json
    import jax
    from omnijax import distributed
    from omnijax.eval.runner import evaluate

    placed = []
    _put = distributed.put

    def recording_put(tree, mesh, specs):  # evaluate places its parameters (and score ids) through this
        out = _put(tree, mesh, specs)
        placed.append(out)
        return out

    distributed.put = recording_put

    def expert_placement(params):
        layers = nnx.to_pure_dict(params)["layers"]
        out = {}
        for name in ("expert_gate", "expert_up", "expert_down", "router"):
            x = layers[name]
            mesh = x.sharding.mesh
            spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
            # the experts (axis 1) each device holds, gathered by its coordinate on the model axis
            held = {}
            for device, coords in zip(mesh.devices.flat, np.ndindex(mesh.devices.shape)):
                shard = next(s for s in x.addressable_shards if s.device == device)
                held.setdefault(int(coords[1]), set()).add(tuple(range(*shard.index[1].indices(x.shape[1]))))
            out[name] = {"spec": spec, "mesh": dict(mesh.shape), "shape": list(x.shape),
                         "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards}),
                         "experts_by_model_coord": {k: sorted(v) for k, v in held.items()}}
        return out

    def flat(result):
        return [{"logits": s.logits, "tokens": s.tokens, "stats": s.stats} for s in result.sessions]

    def compare(ref, got):
        return {"max_logit_diff": max(float(np.abs(a["logits"] - b["logits"]).max()) for a, b in zip(ref, got)),
                "tokens_equal": all((a["tokens"] == b["tokens"]).all() for a, b in zip(ref, got)),
                "stats_equal": all((a["stats"][k] == b["stats"][k]).all() for a, b in zip(ref, got)
                                   for k in a["stats"]),
                "chunks": [len(b["tokens"]) for b in got]}

    ref_result = evaluate(MODEL, SESSIONS, [EVAL], batch_size=8, progress=False)[EVAL.name]
    ref = flat(ref_result)
    out = {"devices": jax.device_count(), "sparse_layers": list(CONFIG.sparse_layers), "meshes": {},
           "placed_without_mesh": len(placed), "ref_chunks": [len(s["tokens"]) for s in ref],
           "evicted": int(sum(s["stats"]["evicted"].sum() for s in ref)),
           "answered": int(sum((s["tokens"] >= 0).sum() for s in ref)),
           "finite": all(np.isfinite(s["logits"]).all() for s in ref)}
    for shape in [(4, 2), (2, 4)]:
        placed.clear()
        result = evaluate(MODEL, SESSIONS, [EVAL], mesh=distributed.make_mesh(*shape), batch_size=8,
                          progress=False)[EVAL.name]
        params = [t for t in placed if isinstance(t, nnx.State)]
        out["meshes"]["x".join(map(str, shape))] = dict(
            compare(ref, flat(result)), mesh=result.mesh_shape, placed_param_trees=len(params),
            experts=expert_placement(params[0]))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded():
    return multidevice.run_worker(_WORKER)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_expert_parallel_evaluation_equals_unsharded(sharded, shape):
    """Every session's per-chunk logits (1e-5), greedy answers and retention/paging statistics of the sharded
    evaluation equal the unsharded one's."""
    assert sharded["devices"] == 8
    assert sharded["sparse_layers"] == [True, False, True]  # MoE and dense layers mixed in one scan
    got = sharded["meshes"]["x".join(map(str, shape))]
    assert got["max_logit_diff"] <= 1e-5, got["max_logit_diff"]
    assert got["tokens_equal"] and got["stats_equal"]
    assert got["chunks"] == sharded["ref_chunks"] == [5, 7, 8, 10] * 2  # padding cut away per session
    assert got["mesh"] == {"data": shape[0], "model": shape[1]}
    # The comparison covers eviction (with re-indexing) and greedy answers (single-token MoE steps).
    assert sharded["evicted"] > 0 and sharded["answered"] > 0 and sharded["finite"]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_evaluate_places_the_experts_split_over_the_model_axis(sharded, shape):
    """The parameters `evaluate` placed: each expert stack `[Lm, E, ...]` is split along E over `model`, each device
    holding E / model experts, the devices of one model coordinate the same ones, different coordinates disjoint
    ones; the router stays whole."""
    m = shape[1]
    got = sharded["meshes"]["x".join(map(str, shape))]
    assert sharded["placed_without_mesh"] == 0 and got["placed_param_trees"] == 1
    per_device = EXPERTS // m
    for name, dims in (("expert_gate", (2, EXPERTS, 64, 32)), ("expert_up", (2, EXPERTS, 64, 32)),
                       ("expert_down", (2, EXPERTS, 32, 64))):
        placement = got["experts"][name]
        assert placement["spec"] == [None, "model", None, None], (name, placement["spec"])
        assert placement["mesh"] == {"data": shape[0], "model": m} and placement["shape"] == list(dims)
        assert placement["shard_shapes"] == [[dims[0], per_device, *dims[2:]]]
        held = placement["experts_by_model_coord"]
        assert sorted(held) == [str(i) for i in range(m)]
        assert all(len(v) == 1 for v in held.values())  # replicated over data
        blocks = [v[0] for _, v in sorted(held.items())]
        assert blocks == [list(range(i * per_device, (i + 1) * per_device)) for i in range(m)]
    router = got["experts"]["router"]
    assert router["spec"] == [None, None, None] and router["shard_shapes"] == [[2, 64, EXPERTS]]


def test_expert_specs_follow_divisibility():
    """`decoder_param_specs` splits the experts only when the model axis divides E (else they stay whole)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from omnijax.eval import mesh as distributed

    namespace = {}
    exec(_SETUP, namespace)
    setup = types.SimpleNamespace(**namespace)
    _, params = nnx.split(setup.MODEL)
    for model_axis, split in ((2, True), (4, True), (8, True), (3, False), (1, False)):
        mesh = types.SimpleNamespace(shape={"data": 1, "model": model_axis})
        layers = nnx.to_pure_dict(distributed.decoder_param_specs(params, setup.CONFIG, mesh))["layers"]
        for name in ("expert_gate", "expert_up", "expert_down"):
            assert layers[name] == (P(None, "model", None, None) if split else P()), (model_axis, name)
        assert layers["router"] == P()
    # a decoder split into per-layer arrays (what omnijax.load gives on CPU): each MoE layer's [E, in, out] splits on E
    _, split_params = nnx.split(setup.Decoder(setup.CONFIG, rngs=nnx.Rngs(0)).split_layers())
    mesh = types.SimpleNamespace(shape={"data": 1, "model": 2})
    rows = nnx.to_pure_dict(distributed.decoder_param_specs(split_params, setup.CONFIG, mesh))["layers"]["rows"]
    moe_rows = [row for row in rows.values() if "expert_gate" in row]
    assert len(moe_rows) == sum(setup.CONFIG.sparse_layers) > 0
    for row in moe_rows:
        for name in ("expert_gate", "expert_up", "expert_down"):
            assert row[name] == P("model", None, None), name
