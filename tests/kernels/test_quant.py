"""Weight-only int8 / int4 quantisation (`omnijax.kernels.quant`): the quantised matmul equals a
dequantise-then-matmul (and a plain-numpy dequantisation computed here from the codes), quantisation errors stay
within half a scale, the int4 packing round-trips, bad shapes and schemes are refused by name, and the weight passes
through jit as an argument of integer codes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kernels import quant as Q

SCHEMES = [Q.Int8PerChannel(), Q.Int8Grouped(32), Q.Int8Grouped(128), Q.Int4Grouped(32), Q.Int4Grouped(64),
           Q.Int4Grouped(128)]


def weight(shape, seed=0, scale=0.05):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape).astype(np.float32) * scale
    w[..., :3, :] *= 20  # a few outlier rows, so groups differ in scale
    return w


def numpy_dequantize(qw):
    """The dense weight from the arrays alone, in numpy (nibbles unpacked by hand)."""
    values, scales = np.asarray(qw.values), np.asarray(qw.scales, np.float32)
    if qw.scheme.bits == 4:
        *lead, half, cols = values.shape
        g = qw.scheme.size
        p = values.reshape(*lead, 2 * half // g, g // 2, cols)
        q = np.concatenate([p & 0x0F, p >> 4], axis=-2).astype(np.float32)  # rows j and j + g/2 of each group
    else:
        *lead, rows, cols = values.shape
        g = rows if isinstance(qw.scheme, Q.Int8PerChannel) else qw.scheme.size
        q = values.reshape(*lead, rows // g, g, cols).astype(np.float32)
    w = q * scales[..., None, :]
    if qw.offsets is not None:
        w = w + np.asarray(qw.offsets, np.float32)[..., None, :]
    return w.reshape(*w.shape[:-3], -1, w.shape[-1])


@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
def test_quantisation_error_is_within_half_a_scale(scheme):
    w = weight((256, 96))
    qw = Q.quantize(w, scheme)
    dense = np.asarray(Q.dequantize(qw))
    np.testing.assert_array_equal(dense, numpy_dequantize(qw))
    g = scheme.group_size(256)
    scale = np.repeat(np.asarray(qw.scales), g, axis=0)  # [in, out], the scale of each element's group
    err = np.abs(dense - w)
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-6 * np.abs(w).max()).all(), (err / scale).max()
    assert (err > 0).any()  # it did quantise
    if scheme.bits == 4:  # asymmetric: every group's min and max are representable within the bound, 16 levels
        assert np.asarray(Q.codes(qw)).max() == 15 and np.asarray(Q.codes(qw)).min() == 0
        assert qw.values.shape == (128, 96) and qw.values.dtype == jnp.uint8 and qw.offsets.shape == (256 // g, 96)
    else:
        assert np.abs(np.asarray(qw.values)).max() == 127 and qw.offsets is None
        assert qw.scales.shape == ((1, 96) if isinstance(scheme, Q.Int8PerChannel) else (256 // g, 96))
    # a finer grid is never worse: int8 per group beats int4 per group of the same size
    if isinstance(scheme, Q.Int4Grouped):
        assert np.abs(np.asarray(Q.dequantize(Q.quantize(w, Q.Int8Grouped(scheme.size)))) - w).max() < err.max()


@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
@pytest.mark.parametrize("batch", [(1,), (16,), (2, 3)])
def test_qmatmul_equals_dequantise_then_matmul(scheme, batch):
    w = weight((128 * 3, 200), seed=1)
    x = np.random.default_rng(2).normal(size=(*batch, w.shape[0])).astype(np.float32)
    qw = Q.quantize(w, scheme)
    ref = x @ numpy_dequantize(qw).astype(np.float64)
    scale = np.abs(x).sum(-1, keepdims=True) * np.abs(w).max()
    # the dense formulation in one piece, in tiles (the last one partial), the default tile; the grouped one; auto
    for method, out_block in (("dense", None), ("dense", 64), ("dense", 2048), ("grouped", 2048), ("auto", 64)):
        got = np.asarray(jax.jit(lambda x, qw, b=out_block, m=method: Q.qmatmul(x, qw, out_block=b, method=m))(x, qw))
        assert got.shape == (*batch, 200) and got.dtype == np.float32
        assert np.abs(got - ref).max() <= 1e-6 * scale.max(), (method, out_block)
    np.testing.assert_allclose(np.asarray(Q.qmatmul_reference(jnp.asarray(x), qw)), ref, rtol=0,
                               atol=1e-6 * scale.max())


def test_qmatmul_in_bfloat16_matches_the_bfloat16_reference():
    w = weight((128, 64), seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 128)), jnp.bfloat16)
    qw = Q.quantize(w, Q.Int4Grouped(64))
    got = Q.qmatmul(x, qw, preferred_element_type=jnp.float32)
    ref = jnp.matmul(x, Q.dequantize(qw, jnp.bfloat16), preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert Q.qmatmul(x, qw).dtype == jnp.bfloat16


def test_int4_packing_round_trips():
    """Codes written into the packing come back out, in place: row j of a group in the low nibble of byte row j,
    row j + g/2 in the high nibble."""
    rng = np.random.default_rng(5)
    for g in (32, 64, 128):
        codes = rng.integers(0, 16, size=(3, 2 * g, 40)).astype(np.uint8)  # [layers, in, out]
        # weights whose per-group min and max are 0 and 15 make quantize keep exactly these codes
        codes[:, ::g, :], codes[:, 1::g, :] = 0, 15
        qw = Q.quantize(codes.astype(np.float32), Q.Int4Grouped(g))
        np.testing.assert_array_equal(np.asarray(Q.codes(qw)), codes)
        np.testing.assert_array_equal(np.asarray(Q.dequantize(qw)), codes.astype(np.float32))
        packed = np.asarray(qw.values).reshape(3, 2, g // 2, 40)
        grouped = codes.reshape(3, 2, g, 40)
        np.testing.assert_array_equal(packed & 0x0F, grouped[:, :, : g // 2])
        np.testing.assert_array_equal(packed >> 4, grouped[:, :, g // 2:])


def test_stacked_weights_and_index():
    """A `[layers, in, out]` stack quantises per layer; `index` (also traced, as a layer scan or an expert pick
    does) gives that layer's weight."""
    w = weight((4, 64, 48), seed=6)
    qw = Q.quantize(w, Q.Int4Grouped(32))
    assert qw.shape == (4, 64, 48) and qw.values.shape == (4, 32, 48) and qw.scales.shape == (4, 2, 48)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(5, 64)), jnp.float32)
    pick = jax.jit(lambda x, qw, i: Q.qmatmul(x, qw.index(i)))
    for i in range(4):
        one = Q.quantize(w[i], Q.Int4Grouped(32))
        np.testing.assert_array_equal(np.asarray(qw.index(i).values), np.asarray(one.values))
        np.testing.assert_array_equal(np.asarray(qw[i].scales), np.asarray(one.scales))
        np.testing.assert_allclose(np.asarray(pick(x, qw, i)), np.asarray(Q.qmatmul(x, one)), rtol=1e-5, atol=1e-5)

    assert qw[...] is qw
    for bad in (slice(0, 2), (0, 1)):
        with pytest.raises(TypeError, match="takes one index on its leading"):
            qw[bad]
    with pytest.raises(TypeError, match="takes one index on its leading"):
        qw[0][0]

    def body(h, layer):  # a lax.scan over the stack slices every leaf of the pytree
        return h, Q.qmatmul(h, layer)
    stack = Q.quantize(w, Q.Int8Grouped(32))
    _, ys = jax.lax.scan(body, x, stack)
    assert ys.shape == (4, 5, 48)
    for i in range(4):
        np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(x) @ numpy_dequantize(stack)[i], rtol=1e-5,
                                   atol=1e-5)


def test_under_jit_the_weight_is_an_integer_argument_and_no_whole_float_copy_with_tiles():
    """The compiled program takes the codes (int8 / uint8) and the scales as arguments; with `out_block` tiles the
    dense formulation's temporaries stay below one float copy of the weight, and the grouped one makes no float weight
    at all (at most a byte per value: the unpacked nibbles)."""
    w = weight((512, 4096), seed=8)
    qw = Q.quantize(w, Q.Int4Grouped(128))
    x = jnp.ones((1, 512), jnp.float32)
    def tiles(x, qw):
        return Q.qmatmul(x, qw, out_block=256, method="dense")
    inputs = [(v.aval.dtype, v.aval.shape) for v in jax.make_jaxpr(tiles)(x, qw).jaxpr.invars]
    assert inputs == [(jnp.float32, (1, 512)), (jnp.uint8, (256, 4096)), (jnp.float32, (4, 4096)),
                      (jnp.float32, (4, 4096))], inputs
    float_copy = w.size * 4

    def temp(fn, x):
        analysis = jax.jit(fn).lower(x, qw).compile().memory_analysis()
        if analysis is None:
            pytest.fail("this jax build gives no memory analysis of a compiled CPU program")
        return analysis.temp_size_in_bytes

    tiled = temp(tiles, x)
    whole = temp(lambda x, qw: Q.qmatmul(x, qw, out_block=None, method="dense"), x)
    assert tiled < float_copy // 4 < whole, (tiled, whole)
    for rows in (1, 2, 8):  # the grouped formulation, whatever out_block says
        grouped = temp(lambda x, qw: Q.qmatmul(x, qw, out_block=None, method="grouped"),
                       jnp.ones((rows, 512), jnp.float32))
        # XLA:CPU writes the two nibble planes as bytes before its fused multiply-reduce: one byte a value at most
        assert grouped <= w.size + 65536 < float_copy // 3, (rows, grouped)
    # auto follows GROUPED_ROWS (0 today: dense, one float piece with out_block=None)
    auto = temp(lambda x, qw: Q.qmatmul(x, qw, out_block=None), jnp.ones((1, 512), jnp.float32))
    assert (auto > float_copy // 4) == (Q.GROUPED_ROWS[4] < 1), auto
    assert qw.nbytes < float_copy / 6  # 4 bits a value + 2 float32 per 128 values: 0.53 bytes a value


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="group size 64 does not divide the input width 96"):
        Q.quantize(np.zeros((96, 8), np.float32), Q.Int4Grouped(64))
    with pytest.raises(ValueError, match="group size 128 does not divide the input width 200"):
        Q.quantize(np.zeros((200, 8), np.float32), Q.Int8Grouped(128))
    for cls in (Q.Int4Grouped, Q.Int8Grouped):
        with pytest.raises(ValueError, match=r"group size must be one of \(32, 64, 128\), got 48"):
            cls(48)
    with pytest.raises(ValueError, match="unknown quantisation scheme"):
        Q.quantize(np.zeros((64, 8), np.float32), "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="w must be a float"):
        Q.quantize(np.zeros((64, 8), np.int32), Q.Int8PerChannel())
    with pytest.raises(ValueError, match="w must be a float"):
        Q.quantize(np.zeros((64,), np.float32), Q.Int8PerChannel())
    qw = Q.quantize(np.ones((64, 8), np.float32), Q.Int4Grouped(32))
    with pytest.raises(ValueError, match="x's last axis 32 does not match the weight's input width 64"):
        Q.qmatmul(jnp.ones((1, 32)), qw)
    with pytest.raises(ValueError, match="qmatmul takes a 2-D weight"):
        Q.qmatmul(jnp.ones((1, 64)), Q.quantize(np.ones((2, 64, 8), np.float32), Q.Int4Grouped(32)))
    with pytest.raises(ValueError, match="out_block must be a positive int"):
        Q.qmatmul(jnp.ones((1, 64)), qw, out_block=0)
    one_of = r"method must be one of \('auto', 'grouped', 'dense', 'pallas'\), got 'fused'"
    with pytest.raises(ValueError, match=one_of):
        Q.qmatmul(jnp.ones((1, 64)), qw, method="fused")
    with pytest.raises(ValueError, match="method='grouped' takes float32 x .* got bfloat16"):
        Q.qmatmul(jnp.ones((1, 64), jnp.bfloat16), qw, method="grouped")
    with pytest.raises(ValueError, match="offsets must have shape"):
        Q.dequantize(Q.QuantizedWeight(qw.values, qw.scales, None, qw.scheme))
    with pytest.raises(ValueError, match="values of Int8Grouped must be int8"):
        Q.dequantize(Q.QuantizedWeight(qw.values, qw.scales, None, Q.Int8Grouped(32)))


def test_constant_groups_do_not_divide_by_zero():
    """All-zero groups stay zero in every scheme; a constant group stays that constant in int4 (its offset)."""
    w = np.zeros((64, 4), np.float32)
    for scheme in SCHEMES[:2] + SCHEMES[3:4]:
        np.testing.assert_array_equal(np.asarray(Q.dequantize(Q.quantize(w, scheme))), w)
    w[32:, 1] = 0.75
    np.testing.assert_array_equal(np.asarray(Q.dequantize(Q.quantize(w, Q.Int4Grouped(32)))), w)
