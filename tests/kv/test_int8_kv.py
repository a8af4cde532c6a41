"""int8 KV pool (`kv_dtype="int8"`): quantisation error, attention over int8 pages against plain numpy attention over
the dequantised keys and values, migration and re-rotation on quantised pages, a streamed session against float,
bytes per cell, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omnijax
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.kv import attention, paged, quant_kv
from omnijax.kv import rope as rope_lib
from omnijax.kv.quant_kv import QuantPages
from omnijax.models.config import TINY_OMNI
from omnijax.paging.migration import apply_moves
from omnijax.retention import H2O, OmniPick, SinkWindow
from omnijax.retention.recall import Recall
from tests._support import kv_ops as ops

G, D, H = 2, 16, 4  # kv heads, head dim, query heads
# The streams of this module and tests/kv/test_int8_kv_matrix.py share one shape (12 chunks of 10 tokens, 16 pages of
# 8, subblock 4) so that their programs compile once per suite; the OmniPick streams also share tau 4.
CHUNKS = 12
OMNIPICK_STREAM = dict(policy=OmniPick(high_watermark=40, low_watermark=25, recent_units=1, text_budget=6),
                       page_size=8, num_pages=16, subblock=4, max_answer_tokens=4)


def _np_quantize(x):
    """The scheme read plainly: per-vector absmax / 127, round half to even, codes in [-127, 127]."""
    x = np.asarray(x, np.float64)
    scale = np.abs(x).max(axis=-1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(x / safe[..., None]), -127, 127).astype(np.int8), scale


def _np_attention(q, k, v, q_index):
    """Causal grouped-query attention in float64: `q [T, H, d]` at absolute indices `q_index`, `k, v [S, G, d]`."""
    R = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, R, axis=1), np.repeat(v, R, axis=1)  # [S, H, d]
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.arange(k.shape[0])[None, None, :] <= np.asarray(q_index)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


def test_quantise_dequantise_error_is_at_most_half_a_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, G, D)).astype(np.float32) * rng.choice([1e-3, 1.0, 40.0], (64, G, 1))
    x[3, 1] = 0.0  # an all-zero vector: scale 0, exact zeros back
    x[5, 0, 7] = 500.0  # an outlier sets its vector's scale
    q, scale = quant_kv.quantize(jnp.asarray(x))
    want_q, want_scale = _np_quantize(x)
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
    assert np.abs(np.asarray(q).astype(np.int32) - want_q).max() <= 1  # round-half ties may differ by one code
    back = np.asarray(quant_kv.dequantize(q, scale))
    err = np.abs(back.astype(np.float64) - x)
    assert (err <= np.asarray(scale, np.float64)[..., None] * (0.5 + 1e-5)).all()
    assert np.abs(np.asarray(q)).max() == 127 and (back[3, 1] == 0).all()
    assert err.max() > 0  # the check above is not vacuous


def test_write_layer_stores_codes_and_scales_of_each_token_and_head():
    rng = np.random.default_rng(1)
    pages = quant_kv.zeros((3, 4, 8, G, D), jnp.float32)  # [L, N, P, G, d]
    values = rng.standard_normal((2, 5, G, D)).astype(np.float32)  # [B, T, G, d]
    slots = np.array([[0, 9, 17, -1, 31], [2, 3, 8, 16, 24]], np.int32)
    got = ops.write_layer(pages, slots, values, layer=jnp.int32(1))
    want_q, want_scale = _np_quantize(values)
    codes, scales = np.asarray(got.values), np.asarray(got.scale)
    for b in range(2):
        for t in range(5):
            s = slots[b, t]
            if s < 0:
                continue
            assert np.abs(codes[1, s // 8, s % 8].astype(int) - want_q[b, t]).max() <= 1
            np.testing.assert_allclose(scales[1, s // 8, s % 8], want_scale[b, t], rtol=1e-6)
    assert not codes[[0, 2]].any() and not scales[[0, 2]].any()  # other layers untouched
    assert int((np.abs(codes[1]).sum(axis=(2, 3)) > 0).sum()) == 9  # only the nine written slots


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas"])
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_over_int8_pages_equals_attention_over_dequantised_values(impl, seed):
    rng = np.random.default_rng(seed)
    B, P, L = 2, 4, 2
    kv = paged.init(num_layers=L, num_kv_heads=G, head_dim=D, num_pages=16, page_size=P, batch=B, max_pages=8,
                    position_axes=1, kv_dtype="int8")
    kv = kv.replace(free_stack=jnp.asarray(rng.permutation(16).astype(np.int32)))
    ks, vs = [], []
    for T in (5, 3):  # 8 tokens per sequence over permuted pages
        k = (rng.standard_normal((L, B, T, G, D)) * 3).astype(np.float32)
        v = rng.standard_normal((L, B, T, G, D)).astype(np.float32)
        kv, _ = ops.append(kv, k, v, np.ones((B, T), bool), ops.meta(B, T, start=sum(x.shape[2] for x in ks)))
        ks.append(k)
        vs.append(v)
    assert isinstance(kv.k, QuantPages) and kv.k.values.dtype == jnp.int8
    T = 6
    k_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    v_new = rng.standard_normal((B, T, G, D)).astype(np.float32)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv, slots, q_order = ops.reserve(kv, np.ones((B, T), bool), ops.meta(B, T, start=8))
    view = attention.CacheView.of(kv, slots, q_order)

    @jax.jit
    def write_and_attend(k_stack, v_stack):  # layer 1 of the stack, as a model's layer loop does
        k_stack = paged.write_layer(k_stack, slots, k_new, layer=jnp.int32(1))
        v_stack = paged.write_layer(v_stack, slots, v_new, layer=jnp.int32(1))
        return attention.attend(q, k_stack, v_stack, view, impl=impl, layer=jnp.int32(1))

    out = np.asarray(write_and_attend(kv.k, kv.v))
    for b in range(B):
        k_all = np.concatenate([ks[0][1, b], ks[1][1, b], k_new[b]])
        v_all = np.concatenate([vs[0][1, b], vs[1][1, b], v_new[b]])
        dq = [c.astype(np.float64) * s[..., None] for c, s in (_np_quantize(k_all), _np_quantize(v_all))]
        want = _np_attention(q[b].astype(np.float64), dq[0], dq[1], 8 + np.arange(T))
        np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=1e-5)
        # ... and not attention over the float values: the check sees the quantisation.
        assert np.abs(out[b] - _np_attention(q[b].astype(np.float64), k_all, v_all, 8 + np.arange(T))).max() > 1e-4


def test_migration_moves_codes_and_scales_bit_for_bit():
    rng = np.random.default_rng(3)
    kv = paged.init(num_layers=2, num_kv_heads=G, head_dim=D, num_pages=6, page_size=4, position_axes=1,
                    kv_dtype="int8")
    n = 20
    kv, _ = ops.append(kv, rng.standard_normal((2, 1, n, G, D)).astype(np.float32),
                       rng.standard_normal((2, 1, n, G, D)).astype(np.float32), np.ones((1, n), bool),
                       ops.meta(1, n))
    src = jnp.asarray([5, 9, 13, 19], jnp.int32)
    dst = jnp.asarray([1, 2, 3, 4], jnp.int32)
    moved = jax.jit(apply_moves)(kv, src, dst)
    for before, after in ((kv.k, moved.k), (kv.v, moved.v)):
        for field in ("values", "scale"):
            b = np.asarray(getattr(before, field)).reshape((2, 24) + getattr(before, field).shape[3:])
            a = np.asarray(getattr(after, field)).reshape(b.shape)
            np.testing.assert_array_equal(a[:, np.asarray(dst)], b[:, np.asarray(src)])
            rest = np.setdiff1d(np.arange(24), np.asarray(dst))
            np.testing.assert_array_equal(a[:, rest], b[:, rest])


@jax.jit
def _rerotate(pages, angles):
    """Every row of `[L, R, G, d]` pages rotated by `angles [R, d/2]`, through `copy_rows` as retention does."""
    R = pages.shape[1]
    rows = jnp.arange(R, dtype=jnp.int32)
    (out,) = paged.copy_rows((pages,), rows, rows, jnp.int32(R), transform=rope_lib.apply_rope, extra=angles)
    return out


def rerotation_drift(steps: tuple[int, ...] = (1, 10, 100), seed: int = 0) -> dict[int, tuple[float, float]]:
    """`{N: (max abs error, max scale)}` of int8 keys after N re-rotations by random position shifts (1 to 8, mixed
    signs) against the same rotations of float32 keys, both from the same start (the int8 pool starts as the
    quantised float keys, so N=0 would be the one-off quantisation error)."""
    rng = np.random.default_rng(seed)
    L, R = 2, 64
    x = jnp.asarray(rng.standard_normal((L, R, G, D)).astype(np.float32) * 4)
    exact, quant = x, QuantPages.of(x)
    out, done = {}, 0
    for n in sorted(steps):
        for _ in range(n - done):
            shift = jnp.asarray(rng.integers(1, 9, R) * rng.choice([-1, 1], R), jnp.int32)
            angles = rope_lib.rope_angles(shift[None], D, 1e4, None)  # [R, d/2]
            exact, quant = _rerotate(exact, angles), _rerotate(quant, angles)
        done = n
        err = float(jnp.max(jnp.abs(quant.dense(jnp.float32) - exact)))
        out[n] = (err, float(jnp.max(quant.scale)))
    return out


def test_rerotation_requantises_and_the_drift_stays_within_its_bound():
    drift = rerotation_drift()
    print("int8 key drift after N re-rotations (max abs err, max scale):", drift)
    for n, (err, scale) in drift.items():
        # Each requantisation adds at most scale/2 per element; a rotation keeps each pair's error norm, so after
        # N steps (plus the first quantisation) an element is off by at most (N + 1) * sqrt(2) * scale / 2.
        assert 0 < err <= (n + 1) * np.sqrt(2) * scale / 2 * 1.01
    assert drift[100][0] < 0.2 * 4 * 3  # far below the keys' own magnitude (std 4, |max| ~ 12+)


def test_streamed_session_with_int8_kv_is_close_to_float():
    model = omnijax.Decoder(TINY_OMNI)
    rng = np.random.default_rng(0)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i, answer_tokens=4 if i % 3 == 2 else 0)
                           for i in range(CHUNKS)])
    ref = omnijax.stream(model, chunks, **OMNIPICK_STREAM)  # OmniPick re-indexes: re-rotation
    got = omnijax.stream(model, chunks, kv_dtype="int8", **OMNIPICK_STREAM)
    assert isinstance(got.state.kv.k, QuantPages) and not isinstance(ref.state.kv.k, QuantPages)
    np.testing.assert_array_equal(np.asarray(got.stats.evicted), np.asarray(ref.stats.evicted))  # trims did run
    assert int(np.asarray(ref.stats.evicted).sum()) > 0
    diff = float(jnp.max(jnp.abs(got.logits - ref.logits)))
    span = float(jnp.max(ref.logits) - jnp.min(ref.logits))
    print(f"int8 KV vs float logits: max abs diff {diff:.3g} over a logit range of {span:.3g}")
    # Every cached element is off by at most 1/254 of its vector's largest one (0.4 %); attention averages values
    # and the tiny model's few layers do not amplify that beyond a few times: 2 % of the logit range is a bound the
    # scheme must meet (measured ~0.1 %), and far below what a wrong dequantisation gives.
    assert 0 < diff <= 0.02 * span
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    assert (np.asarray(ref.tokens) >= 0).sum() >= 8  # answers were generated and compared


@pytest.mark.parametrize("dtype,per_value", [(jnp.float32, 4), (jnp.bfloat16, 2)])
def test_kv_bytes_per_cell_from_array_sizes(dtype, per_value):
    L, N, P, Gk, d = 3, 5, 8, 4, 128
    shape = dict(num_layers=L, num_kv_heads=Gk, head_dim=d, num_pages=N, page_size=P, dtype=dtype)
    float_kv, int8_kv = paged.init(**shape), paged.init(kv_dtype="int8", **shape)
    cells = N * P
    float_cell = (float_kv.k.nbytes + float_kv.v.nbytes) / cells
    int8_cell = (int8_kv.k.nbytes + int8_kv.v.nbytes) / cells
    assert float_cell == 2 * L * Gk * d * per_value == quant_kv.kv_bytes_per_cell(L, Gk, d, "float", per_value)
    assert int8_cell == 2 * L * Gk * (d + 4) == quant_kv.kv_bytes_per_cell(L, Gk, d, "int8")
    assert int8_kv.k.values.dtype == jnp.int8 and int8_kv.k.scale.dtype == jnp.float32
    assert int8_kv.k.dtype == dtype and int8_kv.k.shape == float_kv.k.shape  # dequantises to the model's dtype
    assert float_cell / int8_cell == pytest.approx(per_value * d / (d + 4))  # 1.94x vs bf16 at d=128


def test_bad_kv_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_dtype"):
        paged.init(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=2, page_size=4, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype"):
        omnijax.StreamConfig(kv_dtype="fp8")
    # recall with an int8 pool runs (tests/streaming/test_recall_int8.py); its pool check still applies
    with pytest.raises(ValueError, match="budget"):
        omnijax.StreamConfig(kv_dtype="int8", recall=Recall(budget=9), num_pages=2, page_size=4)
    assert omnijax.StreamConfig().kv_dtype == "float"
    kv = paged.init(num_layers=1, num_kv_heads=G, head_dim=D, num_pages=2, page_size=4, kv_dtype="int8")
    view = attention.CacheView(write_slots=np.zeros((1, 1), np.int32), page_table=kv.page_table,
                               slot_valid=kv.valid, slot_order=kv.order, q_order=np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="pallas.*both int8"):  # int8 keys beside float values
        attention.attend(jnp.zeros((1, 1, H, D)), kv.k, kv.v.dense(), view, impl="pallas", layer=0)


@pytest.fixture(scope="module")
def tiny():
    return omnijax.Decoder(TINY_OMNI)


def test_every_paging_mode_streams_int8_like_int8_native(tiny):
    # Migration moves codes and scales as they are, so an int8 pool under any paging mode attends to exactly what
    # the int8 native layout holds (as float pools do, tests/paging/test_paging.py).
    from omnijax.paging import PAGING_MODES, Paging

    rng = np.random.default_rng(1)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i) for i in range(CHUNKS)])
    common = dict(OMNIPICK_STREAM, kv_dtype="int8")
    native = omnijax.stream(tiny, chunks, **common)
    assert int(np.asarray(native.stats.evicted).sum()) > 0  # trims ran
    for mode in PAGING_MODES[1:]:
        other = omnijax.stream(tiny, chunks, paging=Paging(mode), **common)
        np.testing.assert_allclose(np.asarray(other.logits), np.asarray(native.logits), atol=1e-5, rtol=0)
        assert int(np.asarray(other.stats.moved).sum()) > 0, mode


@pytest.mark.parametrize("policy,impl", [(SinkWindow(sink=4, window=30), "xla"),  # the matrix module's policies
                                         (H2O(heavy=10, recent=20, high_watermark=40), "reference")])
def test_retention_policies_stream_int8_close_to_float(tiny, policy, impl):
    rng = np.random.default_rng(2)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i) for i in range(CHUNKS)])
    common = dict(policy=policy, page_size=8, num_pages=16, subblock=4, impl=impl)
    ref = omnijax.stream(tiny, chunks, **common)
    got = omnijax.stream(tiny, chunks, kv_dtype="int8", **common)
    assert int(np.asarray(ref.stats.evicted).sum()) > 0
    span = float(jnp.max(ref.logits) - jnp.min(ref.logits))
    assert float(jnp.max(jnp.abs(got.logits - ref.logits))) <= 0.02 * span  # the bound of the OmniPick test
    if impl == "xla":  # H2O ranks by attention mass, which int8 keys shift slightly: its evictions may differ
        np.testing.assert_array_equal(np.asarray(got.stats.evicted), np.asarray(ref.stats.evicted))


def test_pallas_streams_an_int8_pool_like_xla(tiny):
    # The kernel (interpreted on CPU) reads the int8 codes and scales that xla dequantises: the same stream, with
    # re-indexing trims (re-rotated, requantised keys) and answers, gives the same logits and tokens.
    rng = np.random.default_rng(4)
    chunks = stack_chunks([text_chunk(rng.integers(0, 300, 10), unit=i, answer_tokens=3 if i % 4 == 3 else 0)
                           for i in range(CHUNKS)])
    common = dict(OMNIPICK_STREAM, kv_dtype="int8")
    xla = omnijax.stream(tiny, chunks, impl="xla", **common)
    pallas = omnijax.stream(tiny, chunks, impl="pallas", **common)
    assert isinstance(pallas.state.kv.k, QuantPages) and int(np.asarray(xla.stats.evicted).sum()) > 0
    np.testing.assert_allclose(np.asarray(pallas.logits), np.asarray(xla.logits), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(pallas.tokens), np.asarray(xla.tokens))
    assert (np.asarray(xla.tokens) >= 0).sum() >= 4


def test_session_feeds_an_int8_pool_like_stream(tiny):
    rng = np.random.default_rng(3)
    chunks = [text_chunk(rng.integers(0, 300, 10), unit=i) for i in range(4)]
    session = omnijax.Session(tiny, kv_dtype="int8", page_size=8, num_pages=16)
    logits = [np.asarray(session.feed(c).logits) for c in chunks]
    assert isinstance(session.state.kv.k, QuantPages)
    streamed = omnijax.stream(tiny, stack_chunks(chunks), kv_dtype="int8", page_size=8, num_pages=16)
    np.testing.assert_allclose(np.stack(logits), np.asarray(streamed.logits), atol=1e-5, rtol=0)  # [C, 1, V]
