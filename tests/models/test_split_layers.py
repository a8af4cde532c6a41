"""Per-layer weight storage (`Decoder.split_layers`, issue 38 item 3): the stacks cut into one array per layer and
parameter compute the stacked decoder's values bit for bit (one-shot logits, streamed chunks with H2O scores, a
hidden-state tap, DeepStack levels, quantised weights, a mixed dense/MoE stack, the unrolled loop), the compiled
step reads each layer's weights where they lie (no dynamic slice of a weight), and `omnijax.load` stores them split
on CPU. The oracle is the same weights in the stacked layout (itself checked against transformers in
`test_decoder.py` / `test_llm_families.py`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omnijax
from omnijax.checkpoint import format as checkpoint
from omnijax.chunks.chunk import split_text
from omnijax.kernels.quant import Int8PerChannel, QuantizedWeight, quantize
from omnijax.kv import attention as attention_lib
from omnijax.kv import paged as paged_lib
from omnijax.models import registry  # noqa: F401 - registers the families save_params checks
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder, DecoderLayers, SplitLayers, layer_rows
from omnijax.models.forward import forward, write_chunk_tapped
from omnijax.models.layers import padded_one_row_products
from omnijax.retention import H2O
from omnijax.streaming.step import chunk_step, init_state

CONFIGS = {
    "dense": DecoderConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                           num_kv_heads=2, head_dim=16, qk_norm=True),
    "mixed_moe": DecoderConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                               num_kv_heads=2, head_dim=16, qkv_bias=False, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=(3,)),
}
B, T = 2, 11


def _pair(name: str, quantized: bool = False) -> tuple[Decoder, Decoder]:
    """The same random weights twice: stacked, and split."""
    def build():
        d = Decoder(CONFIGS[name], rngs=nnx.Rngs(1))
        if quantized:
            for n in ("q_proj", "o_proj", "gate_proj", "down_proj", "expert_up"):
                if hasattr(d.layers, n):
                    getattr(d.layers, n).set_value(quantize(getattr(d.layers, n)[...], Int8PerChannel()))
        return d
    return build(), build().split_layers()


def _ids(config: DecoderConfig) -> np.ndarray:
    return np.random.default_rng(0).integers(0, config.vocab_size, (B, T))


def _forward(decoder: Decoder, deepstack=None) -> np.ndarray:
    graphdef, params = nnx.split(decoder)
    ids = jnp.asarray(_ids(decoder.config), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, B, T))
    return np.asarray(forward(graphdef, params, ids, jnp.ones((B, T), bool), positions, None, None, deepstack,
                              page_size=4))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_layers_cuts_each_stack_into_its_layers(name):
    stacked, split = _pair(name)
    want = stacked.layers.stacked()
    assert isinstance(split.layers, SplitLayers) and isinstance(stacked.layers, DecoderLayers)
    assert len(split.layers.rows) == split.config.num_layers
    for i, p in enumerate(split.layers.per_layer()):
        rows = layer_rows(split.config, want, i)
        assert sorted(p) == sorted(rows)  # its own MLP kind only
        for n, r in rows.items():
            np.testing.assert_array_equal(np.asarray(p[n]), np.asarray(want[n][r]))
    # no stack is left in the module: every parameter leaf is one layer's
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(split.layers)))
    assert leaves and all(str(path[0].key) == "rows" for path, _ in leaves)
    restacked = split.layers.stacked()
    assert sorted(restacked) == sorted(want)
    for n in want:
        np.testing.assert_array_equal(np.asarray(restacked[n]), np.asarray(want[n]))
    assert split.split_layers() is split and isinstance(split.layers, SplitLayers)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_decoder_gives_the_stacked_logits_bit_for_bit(name, quantized):
    stacked, split = _pair(name, quantized)
    if quantized:
        assert isinstance(split.layers.rows[0].q_proj[...], QuantizedWeight)
    want = _forward(stacked)
    assert np.abs(want).max() > 0.1
    np.testing.assert_array_equal(_forward(split), want)


def test_split_decoder_deepstack_tap_and_scores_equal_the_stacked():
    stacked, split = _pair("dense")
    c = stacked.config
    deepstack = jnp.asarray(np.random.default_rng(2).normal(size=(2, B, T, c.hidden_size)), jnp.float32)
    want = _forward(stacked, deepstack)
    assert np.abs(want - _forward(stacked)).max() > 1e-3  # the levels matter
    np.testing.assert_array_equal(_forward(split, deepstack), want)

    x = stacked.embed_tokens(jnp.asarray(_ids(c), jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, B, T))
    zeros = jnp.zeros((B, T), jnp.int32)
    meta = paged_lib.SlotMeta(pos=positions, unit=zeros, span=zeros, offset=zeros)
    for tap in (0, 2, c.num_layers):
        outs = []
        for d in (stacked, split):
            kv = paged_lib.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                num_pages=2 * B * 3, page_size=4, batch=B, max_pages=6, position_axes=1,
                                dtype=c.jnp_dtype)
            kv, hidden, tapped = write_chunk_tapped(d, kv, x, jnp.ones((B, T), bool), positions, meta,
                                                    track_scores=True, impl="reference", tap=tap)
            outs.append((np.asarray(hidden), np.asarray(tapped), np.asarray(kv.score), np.asarray(kv.k)))
        for got, want in zip(outs[1], outs[0]):
            np.testing.assert_array_equal(got, want)
        assert np.abs(outs[0][2]).max() > 0  # H2O's attention mass was accumulated


def test_split_stream_with_h2o_equals_the_stacked():
    stacked, split = _pair("mixed_moe")
    tokens = _ids(stacked.config)[0]
    runs = [omnijax.stream(d, split_text(tokens, 4), page_size=4, policy=H2O(heavy=2, recent=3, high_watermark=6),
                           impl="reference")
            for d in (stacked, split)]
    assert np.asarray(runs[0].stats.layout.retained_cells).max() <= 6  # H2O trimmed (by the scores)
    np.testing.assert_array_equal(np.asarray(runs[1].logits), np.asarray(runs[0].logits))


def test_unrolled_split_loop_equals_the_scanned_switch():
    _, split = _pair("mixed_moe")
    c = split.config
    x = split.embed_tokens(jnp.asarray(_ids(c), jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, B, T))
    zeros = jnp.zeros((B, T), jnp.int32)
    kv = paged_lib.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        num_pages=B * 3, page_size=4, batch=B, max_pages=3, position_axes=1, dtype=c.jnp_dtype)
    kv, slots, q_order = paged_lib.reserve(kv, jnp.ones((B, T), bool), paged_lib.SlotMeta(
        pos=positions, unit=zeros, span=zeros, offset=zeros))
    view = attention_lib.CacheView.of(kv, slots, q_order)
    scanned, unrolled = (split.run_layers(x, positions, view, kv.k, kv.v, unroll=u) for u in (False, True))
    for a, b in zip(scanned[:3], unrolled[:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def _weight_slices(decoder: Decoder) -> list[str]:
    """The compiled forward's dynamic slices (an instruction or a fusion of one) whose result is one layer's weight
    matrix."""
    c = decoder.config
    shapes = {f"f32[{c.hidden_size},{c.intermediate_size}]", f"f32[{c.intermediate_size},{c.hidden_size}]",
              f"f32[{c.hidden_size},{c.num_heads * c.head_dim}]"}
    graphdef, params = nnx.split(decoder)
    ids = jnp.zeros((1, 1), jnp.int32)
    text = forward.lower(graphdef, params, ids, jnp.ones((1, 1), bool), jnp.zeros((1, 1, 1), jnp.int32), None,
                         None, None, page_size=4).compile().as_text()
    # (XLA:CPU fuses the slice and its bitcast into a `dynamic-slice_bitcast_fusion` whose result the dot reads)
    return [line for line in text.splitlines()
            if "dynamic-slice" in line and any(f"= {s}" in line for s in shapes)]


def test_split_one_row_decode_equals_the_stacked_and_stays_one_row():
    """A greedy answer decodes one row at a time: the split loop's products stay one row (no row padded to two, the
    layout before), and the answer's tokens and logits are the stacked decoder's bit for bit."""
    stacked, split = _pair("dense")
    c = split.config
    tokens = _ids(c)[0]
    runs = [omnijax.stream(d, split_text(tokens, 2, answer_tokens=6), page_size=4, max_answer_tokens=6)
            for d in (stacked, split)]
    assert (np.asarray(runs[0].tokens) >= 0).sum() == 6
    np.testing.assert_array_equal(np.asarray(runs[1].tokens), np.asarray(runs[0].tokens))
    np.testing.assert_array_equal(np.asarray(runs[1].state.last_logits), np.asarray(runs[0].state.last_logits))
    graphdef, params = nnx.split(split)
    text = forward.lower(graphdef, params, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool),
                         jnp.zeros((1, 1, 1), jnp.int32), None, None, None, page_size=4).compile().as_text()
    products = [line for line in text.splitlines() if " dot(" in line and f",{c.hidden_size}]" in line]
    assert products and not [line for line in products if "= f32[2," in line], products


def test_padded_one_row_products_pad_the_decode_rows_and_keep_the_answer():
    """Inside `padded_one_row_products` (what the quick-compile step of `omnijax.streaming.quick_start` traces
    under), a one-row product over split layers runs padded to two rows (XLA:CPU's library matmul); the answer's
    tokens are the unpadded step's and its logits agree to float32 rounding. Each side is a function of its own, so
    neither reuses the other's trace."""
    _, split = _pair("dense")
    c = split.config
    graphdef, params = nnx.split(split)
    config = omnijax.StreamConfig(page_size=4, num_pages=16, max_answer_tokens=6)
    chunk = split_text(_ids(c)[0], 1, answer_tokens=6)
    chunk = jax.tree.map(lambda a: a[0], chunk)  # the one chunk, [1, T]
    state = init_state(c, num_pages=16, page_size=4)

    def unpadded(params, state, chunk):
        return chunk_step(nnx.merge(graphdef, params), state, chunk, config, shared_pages=False)

    def padded(params, state, chunk):
        with padded_one_row_products():
            return chunk_step(nnx.merge(graphdef, params), state, chunk, config, shared_pages=False)

    outs, texts = [], []
    for fn in (unpadded, padded):
        lowered = jax.jit(fn).lower(params, state, chunk)
        texts.append(lowered.compile().as_text())
        outs.append(jax.jit(fn)(params, state, chunk)[1])
    # the decode's products over the layers' weights (the lm_head's, vocabulary-wide, is no LayerWeight): one row,
    # or padded to two
    rows = [{int(m[1]) for m in re.finditer(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(", text)
             if int(m[1]) <= 2 and int(m[2]) != c.vocab_size} for text in texts]
    assert rows == [{1}, {2}], rows
    assert (np.asarray(outs[0].tokens) >= 0).sum() == 6
    np.testing.assert_array_equal(np.asarray(outs[1].tokens), np.asarray(outs[0].tokens))
    np.testing.assert_allclose(np.asarray(outs[1].logits), np.asarray(outs[0].logits), rtol=1e-5, atol=1e-5)


def test_split_decode_step_reads_each_layers_weights_in_place():
    stacked, split = _pair("dense")
    assert _weight_slices(stacked)  # the stacked scan copies weights out of the stacks (what the split removes)
    assert _weight_slices(split) == []


def test_load_stores_the_layers_split_on_cpu(tmp_path):
    stacked, _ = _pair("dense")
    c = stacked.config
    checkpoint.save_params(tmp_path, "llama", c, nnx.to_pure_dict(nnx.state(stacked)))
    with pytest.warns(UserWarning, match="tokenizer"):
        model = omnijax.load(tmp_path)
    assert isinstance(model.decoder.layers, SplitLayers) == (jax.default_backend() == "cpu")
    np.testing.assert_array_equal(_forward(model.decoder), _forward(stacked))
