"""`omnijax.evaluate`: sharded evaluation (8 simulated CPU devices, meshes 8x1, 4x2, 2x4) equals the unsharded one
and `omnijax.stream` run session by session; padding to one schedule; mesh and multi-host helpers.

The sharded runs need `--xla_force_host_platform_device_count=8` before JAX starts, and conftest has already
started JAX in this process, so every compiled comparison runs in one subprocess (`_WORKER`) whose JSON summary the
tests read. The two-process `jax.distributed` run on loopback is marked slow (about a minute here).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from tests._support import ROOT, multidevice

MESHES = [(8, 1), (4, 2), (2, 4)]

# Shared by the worker and the in-process tests: a tiny decoder whose kv heads (2) split over a model axis of 2 but
# not of 4, and sessions of different lengths (padding) with audiovisual units, questions answered with 2 tokens,
# and a pool and watermarks small enough that OmniPick evicts. (Native paging: a paging mode adds compile time and
# nothing that sharding could change.)
_SETUP = textwrap.dedent("""
    import numpy as np
    from flax import nnx
    from omnijax.models.config import TINY_OMNI
    from omnijax.eval.runner import EvalConfig
    from omnijax.models.decoder import Decoder
    from omnijax.retention import OmniPick
    from omnijax.testing.synthetic import eval_sessions

    CONFIG = TINY_OMNI.replace(vocab_size=256, intermediate_size=96)
    MODEL = Decoder(CONFIG, rngs=nnx.Rngs(0))
    EVAL = EvalConfig("omnipick", policy=OmniPick(high_watermark=60, low_watermark=40, recent_units=1,
                      text_budget=8), max_answer_tokens=2, page_size=16, num_pages=12,
                      keep_logits=True)

    SESSIONS = eval_sessions(CONFIG.vocab_size)
""")

_WORKER = _SETUP + textwrap.dedent("""
    import json, sys
    import jax
    import omnijax
    from omnijax import distributed
    from omnijax.eval.runner import evaluate, pad_sessions

    def flat(result):
        return [{"logits": s.logits, "tokens": s.tokens, "stats": s.stats} for s in result.sessions]

    def compare(ref, got):
        return {"max_logit_diff": max(float(np.abs(a["logits"] - b["logits"]).max()) for a, b in zip(ref, got)),
                "tokens_equal": all((a["tokens"] == b["tokens"]).all() for a, b in zip(ref, got)),
                "stats_equal": all((a["stats"][k] == b["stats"][k]).all() for a, b in zip(ref, got)
                                   for k in a["stats"]),
                "chunks": [len(b["tokens"]) for b in got]}

    # The reference: omnijax.stream session by session on one device (each session padded to the common schedule,
    # so one compiled program serves all of them; the padding is cut afterwards).
    padded, own = pad_sessions(SESSIONS)
    ref = []
    for s, n in enumerate(own):
        r = omnijax.stream(MODEL, jax.tree.map(lambda x: x[s], padded), policy=EVAL.policy, paging=EVAL.paging,
                           max_answer_tokens=2, page_size=16, num_pages=12)
        stats = {k: np.asarray(getattr(r.stats.layout, k)).reshape(len(r.logits), -1)[:n, 0]
                 for k in ("retained_cells", "physical_span", "active_pages", "active_subblocks", "table_pages",
                           "free_pages", "exhausted", "dropped")}
        stats.update({k: np.asarray(getattr(r.stats, k))[:n, 0] for k in ("evicted", "moved", "next_pos")})
        ref.append({"logits": np.asarray(r.logits[:n, 0]), "tokens": np.asarray(r.tokens[:n, 0]), "stats": stats})
    out = {"devices": jax.device_count(), "meshes": {}}
    for shape in [(8, 1), (4, 2), (2, 4)]:
        result = evaluate(MODEL, SESSIONS, [EVAL], mesh=distributed.make_mesh(*shape), batch_size=8,
                          progress=False)[EVAL.name]
        out["meshes"]["x".join(map(str, shape))] = dict(compare(ref, flat(result)), num_pages=result.num_pages,
                                                        mesh=result.mesh_shape)
    out["answer_chunks_ok"] = all(
        s.answers() and set(s.answers()) <= {i for i, c in enumerate(sess) if int(c.answer_tokens[0]) > 0}
        for s, sess in zip(result.sessions, SESSIONS))
    out["evicted"] = int(sum(s["stats"]["evicted"].sum() for s in ref))
    out["answered"] = int(sum((s["tokens"] >= 0).sum() for s in ref))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded():
    return multidevice.run_worker(_WORKER)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sharded_evaluation_equals_unsharded_sessions(sharded, shape):
    """Each session of a sharded `evaluate` equals `omnijax.stream` of that session alone on one device."""
    assert sharded["devices"] == 8
    got = sharded["meshes"]["x".join(map(str, shape))]
    assert got["max_logit_diff"] <= 1e-5
    assert got["tokens_equal"] and got["stats_equal"]
    assert got["chunks"] == [5, 7, 8, 10] * 2  # padding cut away per session
    assert got["num_pages"] == 12 and got["mesh"] == {"data": shape[0], "model": shape[1]}
    # The comparison covers eviction and greedy answers, each answer after a chunk that asked for one.
    assert sharded["evicted"] > 0 and sharded["answered"] > 0 and sharded["answer_chunks_ok"]


@pytest.fixture(scope="module")
def setup():
    namespace = {}
    exec(_SETUP, namespace)
    return types.SimpleNamespace(**namespace)


def test_pad_sessions_pads_chunks_and_sessions(setup):
    from omnijax.eval.runner import pad_sessions

    chunks, own = pad_sessions(setup.SESSIONS[:2], num_sessions=4)
    assert own.tolist() == [5, 7]
    S, C, B, T = chunks.token_ids.shape
    assert (S, C, B) == (4, 7, 1) and T == max(c.length for s in setup.SESSIONS[:2] for c in s)
    assert chunks.positions.shape == (4, 7, 3, 1, T)
    valid = np.asarray(chunks.valid)
    assert not valid[0, 5:].any() and not valid[2:].any()  # schedule and session padding are empty
    assert (np.asarray(chunks.advance)[0, 5:] == 0).all() and (np.asarray(chunks.answer_tokens)[2:] == 0).all()
    with pytest.raises(ValueError, match="num_sessions"):
        pad_sessions(setup.SESSIONS[:2], num_sessions=1)


def test_evaluate_refuses_bad_arguments(setup):
    import omnijax
    from omnijax.eval.runner import EvalConfig

    with pytest.raises(ValueError, match="distinct"):
        omnijax.evaluate(setup.MODEL, setup.SESSIONS[:1], [setup.EVAL, setup.EVAL], progress=False)
    with pytest.raises(ValueError, match="score_ids"):
        omnijax.evaluate(setup.MODEL, setup.SESSIONS[:1], [setup.EVAL], score_ids=[999], progress=False)
    with pytest.raises(ValueError, match="max_answer_tokens"):
        EvalConfig("x", max_answer_tokens=-1)
    with pytest.raises(ValueError, match="no sessions to evaluate"):
        omnijax.evaluate(setup.MODEL, [], [setup.EVAL], progress=False)
    with pytest.raises(ValueError, match="no configurations to evaluate"):
        omnijax.evaluate(setup.MODEL, setup.SESSIONS[:1], [], progress=False)
    with pytest.raises(TypeError, match="get_policy\\('omnipick'\\)"):
        EvalConfig("x", policy="omnipick")
    with pytest.raises(ValueError, match="unknown attention impl 'triton'"):
        EvalConfig("x", impl="triton")
    with pytest.raises(ValueError, match="x: page_size must be a power of two, got 48"):
        EvalConfig("x", page_size=48)
    with pytest.raises(ValueError, match="x: num_pages must be a positive int"):
        EvalConfig("x", num_pages=0)


def test_evaluate_warns_when_a_pool_ran_out(setup):
    import omnijax
    from omnijax.eval.runner import EvalConfig

    tiny = EvalConfig("tiny pool", page_size=16, num_pages=1)  # NoSlide: the first session outgrows one page
    with pytest.warns(RuntimeWarning, match=r"tiny pool: the KV pool ran out in session\(s\) \[0\]"):
        result = omnijax.evaluate(setup.MODEL, setup.SESSIONS[:1], [tiny], progress=False)
    assert result["tiny pool"].sessions[0].stats["exhausted"][-1] and result["tiny pool"].sessions[0].stats[
        "dropped"][-1] > 0


def test_param_specs_split_heads_mlp_and_vocab_over_the_model_axis(setup):
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from omnijax.eval import mesh as distributed

    _, params = nnx.split(setup.MODEL)
    for model_axis, kv in ((2, "model"), (4, None)):
        mesh = types.SimpleNamespace(shape={"data": 8 // model_axis, "model": model_axis})
        specs = nnx.to_pure_dict(distributed.decoder_param_specs(params, setup.CONFIG, mesh))
        layers = specs["layers"]
        assert layers["q_proj"] == P(None, None, "model") and layers["o_proj"] == P(None, "model", None)
        assert layers["gate_proj"] == P(None, None, "model") and layers["down_proj"] == P(None, "model", None)
        assert layers["k_proj"] == (P(None, None, "model") if kv else P()) and layers["input_norm"] == P()
        assert specs["lm_head"] == P(None, "model") and specs["embed"] == P()
        assert distributed.kv_heads_axis(setup.CONFIG, mesh) == kv


def test_cluster_flags_and_environment():
    from omnijax.eval import mesh as distributed

    assert distributed.cluster_from_env({}) is None
    env = {"OMNIJAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "OMNIJAX_NUM_PROCESSES": "4", "OMNIJAX_PROCESS_ID": "3"}
    assert distributed.cluster_from_env(env) == distributed.ClusterSpec("10.0.0.1:1234", 4, 3)
    with pytest.raises(ValueError, match="OMNIJAX_PROCESS_ID"):
        distributed.cluster_from_env({"OMNIJAX_COORDINATOR_ADDRESS": "h:1", "OMNIJAX_NUM_PROCESSES": "2"})
    parser = argparse.ArgumentParser()
    distributed.add_cluster_flags(parser)
    args = parser.parse_args(["--process-id", "1", "--local-device-ids", "0,1"])
    assert distributed.cluster_from_args(args, env) == distributed.ClusterSpec("10.0.0.1:1234", 4, 1, (0, 1))
    assert distributed.cluster_from_args(parser.parse_args([]), {}) is None
    assert distributed.cluster_from_args(parser.parse_args(["--auto-cluster"]), {}) == "auto"
    with pytest.raises(ValueError, match="coordinator"):
        distributed.cluster_from_args(parser.parse_args(["--num-processes", "2"]), {})
    with pytest.raises(ValueError, match="process_id"):
        distributed.ClusterSpec("h:1", 2, 2)
    assert distributed.initialize(None) is False or "OMNIJAX_COORDINATOR_ADDRESS" in os.environ


_MULTIHOST = textwrap.dedent("""
    import json, sys
    import jax
    from omnijax import distributed
    distributed.initialize(distributed.ClusterSpec(sys.argv[1], 2, int(sys.argv[2])))  # before any JAX work
""") + _SETUP + textwrap.dedent("""
    import hashlib
    from omnijax.eval.runner import evaluate
    mesh = distributed.make_mesh(4, 2)
    got = evaluate(MODEL, SESSIONS, [EVAL], mesh=mesh, batch_size=8, progress=False)[EVAL.name].sessions
    out = {"processes": jax.process_count(), "devices": jax.device_count(), "got": hashlib.sha256(b"".join(
        np.ascontiguousarray(x).tobytes() for s in got for x in (s.logits, s.tokens, *(s.stats[k] for k in
                                                                                        sorted(s.stats))))).hexdigest()}
    if jax.process_index() == 0:  # the unsharded reference, once (see the test)
        ref = evaluate(MODEL, SESSIONS, [EVAL], batch_size=8, progress=False)[EVAL.name].sessions
        out["max_logit_diff"] = max(float(np.abs(a.logits - b.logits).max()) for a, b in zip(ref, got))
        out["same"] = all((a.tokens == b.tokens).all() and all((a.stats[k] == b.stats[k]).all() for k in a.stats)
                          for a, b in zip(ref, got))
    print("RESULT " + json.dumps(out))
""")


def test_two_processes_on_loopback_equal_one():
    """Two processes x 4 CPU devices joined by `jax.distributed` (gloo collectives) on a 4x2 mesh. Process 0
    compares the sharded results with the unsharded run; process 1's sharded results must be the same bytes as
    process 0's (logits, tokens, stats: a digest), so they equal the unsharded run too. (Process 1's unsharded run
    was the same comparison again, on a program its process never writes to the compilation cache: compiled every
    time.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    code = multidevice.prelude() + _MULTIHOST
    procs = [subprocess.Popen([sys.executable, "-c", code, address, str(i)], env=multidevice.env(4), cwd=ROOT,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:]))
        assert results[-1]["processes"] == 2 and results[-1]["devices"] == 8
    assert results[0]["max_logit_diff"] <= 1e-5 and results[0]["same"]
    assert results[1]["got"] == results[0]["got"] and "same" not in results[1]
