"""GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks repacked into omnijax's quantised weights
(`omnijax.convert.gguf_quant`): the dequantised repack equals the `gguf` package's own `gguf.quants.dequantize` of
the same bytes bit for bit in float32 (Q4_0: but for the sign of an exact zero), on random blocks (random codes,
sub-block scales and mins, and random float16 scales, zero, negative, subnormal and large ones included) and on blocks
gguf's own quantiser wrote (it writes no K-quants); the quantised matmul over the repack matches a float matmul of
gguf's output; bad sizes and unknown types are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.convert import gguf_quant as G
from omnijax.kernels import quant as Q

gguf = pytest.importorskip("gguf", reason="the gguf extra (pip install 'omnijax[gguf]') is part of the test extras")

TYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0,
         "Q4_1": gguf.GGMLQuantizationType.Q4_1, "Q4_K": gguf.GGMLQuantizationType.Q4_K,
         "Q6_K": gguf.GGMLQuantizationType.Q6_K}
LEGACY = ("Q4_0", "Q4_1", "Q8_0")  # blocks of 32 (the K-quants: super-blocks of 256)
# where a block's float16 fields sit (the other bytes are codes and, for the K-quants, 6- or 8-bit sub-block scales)
F16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_f16(rng, n):
    """float16 values of many magnitudes and both signs, with a zero, a subnormal and a large one among them."""
    v = (rng.normal(size=n) * 10.0 ** rng.integers(-4, 2, size=n)).astype(np.float16)
    v[:4] = [0.0, np.float16(3e-6), np.float16(-1.5e3), np.float16(-0.0)]
    return v


def random_blocks(kind, shape, seed):
    """Raw GGUF bytes `[..., out, in // block * bytes]` for a tensor of float shape `shape`: random codes (and
    sub-block scales and mins), random float16 scale (and min)."""
    rng = np.random.default_rng(seed)
    block = G.BLOCK_ELEMENTS[kind]
    n = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n, G.BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in F16_AT[kind]:
        raw[:, at:at + 2] = random_f16(rng, n).view(np.uint8).reshape(n, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * G.BLOCK_BYTES[kind])


def assert_bit_equal(qw, raw, kind):
    """Bit for bit in float32. For Q4_0 an exact zero may carry the other sign: gguf computes `d * (q - 8)` (-0.0
    where d < 0 and q = 8), the repack `q * d + (-8 d)` (+0.0); every other value is bit-equal."""
    want = np.asarray(gguf.quants.dequantize(raw, TYPES[kind]), np.float32)  # [..., out, in]
    got = np.swapaxes(np.asarray(Q.dequantize(qw, jnp.float32)), -1, -2)
    assert got.shape == want.shape
    if kind == "Q4_0":
        differ = got.view(np.uint32) != want.view(np.uint32)
        assert (want[differ] == 0).all() and (got[differ] == 0).all()
        got, want = got + np.float32(0), want + np.float32(0)  # -0.0 + 0.0 = +0.0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", LEGACY)
@pytest.mark.parametrize("shape", [(8, 32), (96, 576), (3, 40, 128)], ids=str)
def test_repack_equals_ggufs_dequantisation_bit_for_bit(kind, shape):
    raw = random_blocks(kind, shape, seed=sum(shape))
    qw = G.from_gguf(raw, shape, kind)
    assert qw.shape == (*shape[:-2], shape[-1], shape[-2])  # the decoder's [..., in, out]
    assert qw.scheme == (Q.Int8Grouped(32) if kind == "Q8_0" else Q.Int4Grouped(32))
    assert qw.scales.dtype == np.float16 and qw.nbytes <= raw.nbytes + (raw.size // G.BLOCK_BYTES[kind]) * 2
    assert_bit_equal(qw, raw, kind)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(8, 256), (40, 768), (3, 5, 512)], ids=str)
def test_k_quant_repack_equals_ggufs_dequantisation_bit_for_bit(kind, shape):
    """Q4_K -> int4 groups of 32 with float32 scales d*sc and offsets -(dmin*m); Q6_K -> int8 groups of 16 with
    float32 scales d*sc: products exact in float32, so equal to gguf's own dequantisation bit for bit, every 6-bit
    scale/min packing and every 2-bit high part of the random bytes exercised."""
    raw = random_blocks(kind, shape, seed=sum(shape))
    qw = G.from_gguf(raw, shape, kind)
    assert qw.shape == (*shape[:-2], shape[-1], shape[-2])
    assert qw.scheme == (Q.Int4Grouped(32) if kind == "Q4_K" else Q.Int8Grouped(16))
    assert qw.scales.dtype == np.float32 and (qw.offsets is None) == (kind == "Q6_K")
    # bits a value: Q4_K 4 + 2 * 32 / 32 = 6 (the file's 4.5); Q6_K 8 + 32 / 16 = 10 (the file's 6.56)
    assert qw.nbytes * 8 / np.prod(shape) == (6.0 if kind == "Q4_K" else 10.0)
    codes = np.asarray(Q.codes(qw))
    assert codes.min() >= (0 if kind == "Q4_K" else -32) and codes.max() <= (15 if kind == "Q4_K" else 31)
    assert_bit_equal(qw, raw, kind)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_qmatmul_matches_a_float_matmul_of_ggufs_weights(kind):
    """gguf-py cannot quantise K-quants, so the blocks are random bytes with realistic float16 scales: the quantised
    matmul over the repack matches a float64 matmul of gguf's dequantised weight."""
    rng = np.random.default_rng(2)
    raw = random_blocks(kind, (96, 512), seed=5)
    blocks = raw.reshape(-1, G.BLOCK_BYTES[kind])
    for at in F16_AT[kind]:
        blocks[:, at:at + 2] = (rng.normal(size=(blocks.shape[0], 1)) * 1e-3).astype(np.float16).view(np.uint8)
    qw = G.from_gguf(raw, (96, 512), kind)
    dense = np.asarray(gguf.quants.dequantize(raw, TYPES[kind]), np.float64)
    x = rng.normal(size=(16, 512)).astype(np.float32)
    got = np.asarray(jax.jit(Q.qmatmul)(jnp.asarray(x), qw))
    np.testing.assert_allclose(got, x @ dense.T, rtol=0, atol=1e-5 * np.abs(x).sum(-1).max() * np.abs(dense).max())


@pytest.mark.parametrize("kind", LEGACY)
def test_repack_of_blocks_ggufs_quantiser_wrote(kind):
    """Realistic blocks (gguf's own quantiser over a float weight): bit-equal again, and the quantised matmul over the
    repack matches a float matmul of gguf's dequantised weight."""
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(192, 320)) * 0.05).astype(np.float32)  # [out, in], HF layout
    raw = gguf.quants.quantize(w, TYPES[kind])
    qw = G.from_gguf(raw, w.shape, kind)
    assert_bit_equal(qw, raw, kind)
    dense = np.asarray(gguf.quants.dequantize(raw, TYPES[kind]), np.float64)
    x = rng.normal(size=(16, 320)).astype(np.float32)
    got = np.asarray(jax.jit(Q.qmatmul)(jnp.asarray(x), qw))
    np.testing.assert_allclose(got, x @ dense.T, rtol=0, atol=1e-5 * np.abs(x).sum(-1).max() * np.abs(dense).max())


def test_q4_0_offsets_stay_exact_where_float16_would_overflow():
    """-8 d overflows float16 for |d| > 8188: the offsets are then kept in float32, still bit-equal."""
    raw = random_blocks("Q4_0", (4, 64), seed=3)
    blocks = raw.reshape(8, 18)
    blocks[0, :2] = np.array([9000.0], np.float16).view(np.uint8)
    qw = G.from_gguf_q4_0(raw, (4, 64))
    assert qw.offsets.dtype == np.float32
    assert_bit_equal(qw, raw, "Q4_0")
    assert G.from_gguf_q4_0(random_blocks("Q4_0", (4, 64), seed=3), (4, 64)).offsets.dtype == np.float16


def test_bad_input_is_refused_by_name():
    raw = random_blocks("Q8_0", (4, 64), seed=4)
    with pytest.raises(ValueError, match="Q8_0: raw_blocks holds 272 bytes; shape \\(4, 96\\) needs 408"):
        G.from_gguf_q8_0(raw, (4, 96))
    with pytest.raises(ValueError, match="Q4_1: the input width 48 is not a multiple of the block size 32"):
        G.from_gguf_q4_1(np.zeros(60, np.uint8), (2, 48))
    with pytest.raises(ValueError, match="raw_blocks must be uint8"):
        G.from_gguf_q4_0(raw.astype(np.int16), (4, 64))
    with pytest.raises(ValueError, match="GGUF type 'Q5_K' cannot be repacked without a float round trip"):
        G.from_gguf(raw, (4, 64), "Q5_K")
    with pytest.raises(ValueError, match="Q6_K: the input width 128 is not a multiple of the block size 256"):
        G.from_gguf(np.zeros(210, np.uint8), (2, 128), "Q6_K")
    with pytest.raises(ValueError, match="Q4_K: raw_blocks holds 144 bytes; shape \\(2, 256\\) needs 288"):
        G.from_gguf_q4_k(np.zeros(144, np.uint8), (2, 256))
    with pytest.raises(ValueError, match="shape must be \\[..., out, in\\]"):
        G.from_gguf_q8_0(raw, (272,))


def test_a_stack_mixing_k_quants_is_not_repacked_and_says_why():
    """A Q4_K_M file stores some layers of a weight in Q6_K and the others in Q4_K: no one scheme holds both exactly
    (Q4_K needs an offset, Q6_K six bits), so the stack is left to the float path with the reason; one type for all
    layers is repacked into a stack."""
    from types import SimpleNamespace

    from omnijax.convert import quantize as convert_quantize

    def tensor(kind, seed):  # a GGUF tensor as the reader gives it: numpy-reversed shape [in, out], raw bytes
        return SimpleNamespace(tensor_type=SimpleNamespace(name=kind), shape=np.array([256, 8]),
                               data=random_blocks(kind, (8, 256), seed))

    config = SimpleNamespace(num_layers=2)
    mixed = SimpleNamespace(tensors={"blk.0.ffn_down.weight": tensor("Q4_K", 0), "blk.1.ffn_down.weight":
                                     tensor("Q6_K", 1)})
    qw, why = convert_quantize._repack_stack(mixed, "layers.down_proj", config, False)
    assert qw is None and "GGUF type(s) ['Q4_K', 'Q6_K'] are not repacked" in why and "one type for all layers" in why
    same = SimpleNamespace(tensors={"blk.0.ffn_down.weight": tensor("Q6_K", 0), "blk.1.ffn_down.weight":
                                    tensor("Q6_K", 1)})
    qw, why = convert_quantize._repack_stack(same, "layers.down_proj", config, False)
    assert qw.scheme == Q.Int8Grouped(16) and qw.shape == (2, 256, 8) and "repacked from GGUF Q6_K" in why
    for i in range(2):
        want = np.asarray(gguf.quants.dequantize(same.tensors[f"blk.{i}.ffn_down.weight"].data, TYPES["Q6_K"]))
        np.testing.assert_array_equal(np.asarray(Q.dequantize(qw.index(i))).T, want)
