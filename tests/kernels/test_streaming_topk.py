"""SnapKV streaming top-k: blockwise jnp and Pallas (interpret mode) vs the dense reference vs a numpy float64 oracle,
validation, Triton lowering for cuda on CPU, and S-independent temporary memory of the blockwise path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from omnijax.kernels.lowering import TRITON_CALL_TARGET, has_triton_call, lower_for_cuda
from omnijax.kernels.streaming_topk import (
    _init_topk,
    _merge_topk,
    _validate,
    snapkv_scores_reference,
    streaming_topk,
    streaming_topk_blockwise,
    streaming_topk_reference,
)

# The same suite runs the kernel interpreted on CPU and compiled (Triton) on a GPU.
INTERPRET = jax.default_backend() == "cpu"

# Scores are compared relative to the largest selected score (scores are means of probabilities, ~1/S).
# float32: every path computes the same float32 math (HIGHEST-precision dots, float32 softmax); only the summation
# order differs (streaming log-sum-exp rescaling, blocked column sums, pooling order): a few float32 ulps.
# bfloat16: inputs are upcast (reference, blockwise) or multiplied with float32 accumulation (kernel dot), so every
# product is exact and the computation is the float32 one on bf16-representable inputs: same tolerance.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-5}


def make_case(seed, *, B, S, W, G, R, d, dtype=jnp.float32, scale=2.0):
    """Random post-RoPE-like queries/keys. The scale makes attention non-uniform, so scores have no ties; much larger
    scales make it so peaked that pooling gives a dominant key's neighbours near-equal scores (near-ties again)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, W, G * R, d)) * scale
    k = rng.standard_normal((B, S, G, d)) * scale
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype)


def dense_topk(q, k, kk, pool_kernel):
    """The dense oracle `streaming_topk_reference` (indices ascending, their scores), plus the dense scores."""
    idx, vals = streaming_topk_reference(q, k, k=kk, pool_kernel=pool_kernel)
    return np.asarray(idx), np.asarray(vals), snapkv_scores_reference(q, k, pool_kernel=pool_kernel)


def check(got, q, k, kk, pool_kernel):
    idx, vals = got
    ref_idx, ref_vals, scores = dense_topk(q, k, kk, pool_kernel)
    B, G = k.shape[0], k.shape[2]
    assert idx.shape == (B, G, kk) and idx.dtype == jnp.int32
    assert vals.shape == (B, G, kk) and vals.dtype == jnp.float32
    tol = TOL[jnp.dtype(q.dtype)]
    # The selection is well defined at this tolerance: scores within tol of the dense ones cannot swap the k-th and
    # (k+1)-th dense scores (otherwise exact index equality would test rounding, not the algorithm).
    srt = -np.sort(-np.asarray(scores), axis=-1)
    if kk < srt.shape[-1]:
        assert np.all(srt[..., kk - 1] - srt[..., kk] > 2 * tol * srt[..., 0]), "near-tie: pick another seed"
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert np.all(np.diff(np.asarray(idx), axis=-1) > 0)
    np.testing.assert_allclose(np.asarray(vals), ref_vals, rtol=tol, atol=tol * float(np.max(ref_vals)))


# (seed, B, S, W, G, R, d, dtype, ks, blockwise block, pallas block, pool_kernel). S is never a multiple of the
# blocks. Seeds are ones whose k-th/(k+1)-th score gap is well above the tolerance (`check` asserts it). The
# blockwise path merges a running top-k when 4 (k + block) < S - W (s300 k=1, the pool7 case) and takes one top-k
# of the whole score row otherwise (the other ks): both are checked here.
CASES = {
    "s300_w8_gqa4": (0, 2, 300, 8, 2, 4, 16, jnp.float32, (1, 17, 292), 64, 64, 5),
    "s517_w32_mha": (0, 1, 517, 32, 2, 1, 16, jnp.float32, (17,), 128, 128, 5),
    "s517_w32_gqa4_bf16_all": (0, 1, 517, 32, 1, 4, 32, jnp.bfloat16, (485,), 512, 64, 5),
    "s300_w8_d8_pool7": (5, 1, 300, 8, 2, 4, 8, jnp.float32, (17,), 32, 16, 7),  # head_dim padded for Triton
    "short_prompt_pool1": (3, 1, 40, 8, 1, 1, 16, jnp.float32, (1,), 16, 64, 1),  # S < pallas block: padded keys
}


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_topk(case, impl):
    seed, B, S, W, G, R, d, dtype, ks, bs_bw, bs_pl, pool = CASES[case]
    q, k = make_case(seed, B=B, S=S, W=W, G=G, R=R, d=d, dtype=dtype)
    for kk in ks:
        if impl == "blockwise":
            got = streaming_topk_blockwise(q, k, k=kk, block_size=bs_bw, pool_kernel=pool)
        else:
            got = streaming_topk(q, k, k=kk, block_size=bs_pl, pool_kernel=pool, interpret=INTERPRET)
        check(got, q, k, kk, pool)


def test_reference_is_dense_topk():
    seed, B, S, W, G, R, d, dtype, _, _, _, pool = CASES["s300_w8_gqa4"]
    q, k = make_case(seed, B=B, S=S, W=W, G=G, R=R, d=d, dtype=dtype)
    idx, vals = streaming_topk_reference(q, k, k=17, pool_kernel=pool)
    # numpy's top-k of the dense scores (stable argsort, no ties in this case), indices ascending.
    scores = np.asarray(snapkv_scores_reference(q, k, pool_kernel=pool))
    want = np.sort(np.argsort(-scores, axis=-1, kind="stable")[..., :17], axis=-1)
    np.testing.assert_array_equal(np.asarray(idx), want)
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(scores, want, -1))
    assert idx.dtype == jnp.int32 and vals.dtype == jnp.float32


def numpy_snapkv_scores(q, k, pool_kernel):
    """Plain float64 SnapKV scores with explicit loops: [B, G, S - W]."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, W, H, d = q.shape
    S, G = k.shape[1], k.shape[2]
    R, prefix = H // G, S - W
    out = np.zeros((B, G, prefix))
    for b in range(B):
        for h in range(H):
            g = h // R
            col = np.zeros(prefix)
            for i in range(W):
                seen = S - W + i + 1  # keys 0 .. S - W + i
                logits = np.array([q[b, i, h] @ k[b, j, g] for j in range(seen)]) / np.sqrt(d)
                w = np.exp(logits - logits.max())
                col += (w / w.sum())[:prefix] / W
            # Average pooling with zero padding: a centred moving sum over an odd kernel.
            out[b, g] += np.convolve(col, np.ones(pool_kernel), mode="same") / pool_kernel / R
    return out


def test_numpy_oracle():
    # Same shapes and static arguments as the "s300_w8_d8_pool7" case, so the jitted functions are reused.
    seed, B, S, W, G, R, d, dtype, (kk,), bs_bw, bs_pl, pool = CASES["s300_w8_d8_pool7"]
    q, k = make_case(seed, B=B, S=S, W=W, G=G, R=R, d=d, dtype=dtype)
    oracle = numpy_snapkv_scores(q, k, pool)
    np.testing.assert_allclose(np.asarray(snapkv_scores_reference(q, k, pool_kernel=pool)), oracle, rtol=1e-5,
                               atol=1e-5 * oracle.max())
    want = np.sort(np.argsort(-oracle, axis=-1, kind="stable")[..., :kk], axis=-1)
    for idx, vals in (streaming_topk_blockwise(q, k, k=kk, block_size=bs_bw, pool_kernel=pool),
                      streaming_topk(q, k, k=kk, block_size=bs_pl, pool_kernel=pool, interpret=INTERPRET)):
        np.testing.assert_array_equal(np.asarray(idx), want)
        np.testing.assert_allclose(np.asarray(vals), np.take_along_axis(oracle, want, -1), rtol=1e-5,
                                   atol=1e-5 * oracle.max())


def test_running_merge_prefers_lower_index_on_ties():
    # Exact ties across and within blocks: the streamed merge must return what lax.top_k returns on the whole row.
    scores = jnp.array([[[1.0, 3.0, 2.0, 3.0, 3.0, 0.0, 2.0, 3.0, 1.0, 2.0, 3.0, 0.5]]], jnp.float32)
    for kk in (1, 3, 5, 8, 12):
        run_s, run_i = _init_topk(1, 1, kk, 12)
        for j0 in range(0, 12, 4):
            run_s, run_i = _merge_topk(run_s, run_i, scores[..., j0:j0 + 4], jnp.arange(j0, j0 + 4), kk)
        want_s, want_i = lax.top_k(scores, kk)
        np.testing.assert_array_equal(np.asarray(run_i), np.asarray(want_i))
        np.testing.assert_array_equal(np.asarray(run_s), np.asarray(want_s))


def test_validation_is_shared():
    q, k = make_case(5, B=1, S=40, W=8, G=2, R=2, d=16)
    bad = [
        ((q[0], k), 5, 64, 5, "q_obs must be"),
        ((q, k[0]), 5, 64, 5, "keys must be"),
        ((q[..., :8], k), 5, 64, 5, "head_dim mismatch"),
        ((q[:, :, :3], k), 5, 64, 5, "multiple of kv heads"),
        ((jnp.zeros((1, 41, 4, 16)), k), 5, 64, 5, "W <= S"),
        ((q.astype(jnp.float16), k.astype(jnp.float16)), 5, 64, 5, "float32 or bfloat16"),
        ((q, k.astype(jnp.bfloat16)), 5, 64, 5, "share a dtype"),
        ((q, k), 0, 64, 5, r"k must be an int in \[1, S - W\] = \[1, 32\]"),
        ((q, k), 33, 64, 5, r"\[1, 32\]"),
        ((q, k), 5, 48, 5, "block_size must be a power of two"),
        ((q, k), 5, 64, 4, "pool_kernel must be an odd"),
    ]
    for args, kk, bs, pool, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _validate(*args, kk, bs, pool)
        with pytest.raises(ValueError, match=msg):
            streaming_topk_blockwise(*args, k=kk, block_size=bs, pool_kernel=pool)
        with pytest.raises(ValueError, match=msg):
            streaming_topk(*args, k=kk, block_size=bs, pool_kernel=pool, interpret=INTERPRET)
        if "block_size" not in msg:
            with pytest.raises(ValueError, match=msg):
                streaming_topk_reference(*args, k=kk, pool_kernel=pool)
    with pytest.raises(ValueError, match="block_size must be >= 16"):
        streaming_topk(q, k, k=5, block_size=8, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        streaming_topk(q, k, k=5, block_rows=8, interpret=True)
    with pytest.raises(ValueError, match="S - W"):
        snapkv_scores_reference(q, k[:, :8])  # no prefix to score


@pytest.mark.parametrize("dtype,d,S,W,R,bs", [
    (jnp.float32, 16, 300, 8, 4, 64),
    (jnp.bfloat16, 128, 517, 32, 1, 128),
    (jnp.float32, 8, 40, 8, 1, 64),  # padded head_dim and a prompt shorter than one block
], ids=["f32", "bf16_d128", "f32_padded"])
def test_lowers_to_triton_for_cuda(dtype, d, S, W, R, bs):
    q = jax.ShapeDtypeStruct((2, W, 2 * R, d), dtype)
    k = jax.ShapeDtypeStruct((2, S, 2, d), dtype)
    text = lower_for_cuda(lambda a, b: streaming_topk(a, b, k=5, block_size=bs), q, k)
    calls = [line for line in text.splitlines() if TRITON_CALL_TARGET in line]
    assert any("streaming_topk_pass1" in line for line in calls), "pass-1 kernel did not reach Triton"
    assert any("streaming_topk_pass2" in line for line in calls), "pass-2 kernel did not reach Triton"
    interp = lower_for_cuda(lambda a, b: streaming_topk(a, b, k=5, block_size=bs, interpret=True), q, k)
    assert not has_triton_call(interp)


def test_blockwise_temp_memory_independent_of_prompt_length():
    B, W, G, R, d, bs, kk = 1, 32, 2, 2, 16, 256, 64
    dense_bytes = {}  # the [B, H, W, S] float32 score tensor the streaming path must avoid
    temp = {}
    for S in (4096, 8192):
        q = jax.ShapeDtypeStruct((B, W, G * R, d), jnp.float32)
        k = jax.ShapeDtypeStruct((B, S, G, d), jnp.float32)
        dense_bytes[S] = B * G * R * W * S * 4
        for name, fn in (("blockwise", lambda a, b: streaming_topk_blockwise(a, b, k=kk, block_size=bs)),
                         ("dense", lambda a, b: streaming_topk_reference(a, b, k=kk))):
            temp[name, S] = jax.jit(fn).lower(q, k).compile().memory_analysis().temp_size_in_bytes
    # Doubling S adds (next to) nothing to the blockwise temporaries ...
    assert temp["blockwise", 8192] - temp["blockwise", 4096] < dense_bytes[4096] / 64
    assert temp["blockwise", 8192] < dense_bytes[8192] / 4
    # ... while the dense reference holds the score tensor and grows with S.
    assert temp["dense", 8192] >= dense_bytes[8192]
    assert temp["dense", 8192] >= 8 * temp["blockwise", 8192]
    if jax.default_backend() == "cpu":  # XLA:GPU reuses one workspace for both lengths (H200: 4.20 vs 4.33 MB)
        assert temp["dense", 8192] - temp["dense", 4096] >= dense_bytes[4096]
