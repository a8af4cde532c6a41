"""The converted tiny thinker against transformers: logits, mrope positions, streaming, greedy answers, bfloat16."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chunks.chunk import split_text  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from tests._support import hf_models  # noqa: E402

SEQ = 21


@pytest.fixture(scope="module")
def hf_thinker():
    return hf_models.build_thinker(seed=0, scale=0.2)


@pytest.fixture(scope="module")
def converted(hf_thinker, tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder")
    src = hf_models.save_full(hf_thinker, root / "hf")
    return {dtype: convert_checkpoint(src, root / dtype, dtype=dtype, progress=False)
            for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def model(converted):
    return omnijax.load(converted["float32"])


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, hf_models.TEXT["vocab_size"], (2, SEQ))


def _hf_logits(hf, **inputs):
    with torch.no_grad():
        return hf(**{k: torch.as_tensor(v) for k, v in inputs.items()}).logits.float().numpy()


def test_loaded_config(model):
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert c.mrope_section == (2, 3, 3) and c.qkv_bias and not c.tie_embeddings


def test_logits_match_transformers_with_padding(model, hf_thinker, tokens):
    mask = np.ones_like(tokens)
    mask[1, :5] = 0  # left padding
    want = _hf_logits(hf_thinker, input_ids=tokens, attention_mask=mask)
    got = np.asarray(model(input_ids=tokens, attention_mask=mask))
    keep = mask.astype(bool)
    assert np.abs(got - want)[keep].max() <= 1e-4


def test_logits_match_transformers_with_mrope_positions(model, hf_thinker, tokens):
    t = np.arange(SEQ)
    positions = np.stack([t, 3 + (t * 5) % 11, 2 * t])[:, None].repeat(2, axis=1)  # distinct t/h/w axes
    want = _hf_logits(hf_thinker, input_ids=tokens, position_ids=positions)
    got = np.asarray(model(input_ids=tokens, position_ids=positions))
    assert np.abs(got - want).max() <= 1e-4
    flat = np.asarray(model(input_ids=tokens))
    assert np.abs(flat - got).max() > 1e-3  # the three axes really matter


@pytest.mark.parametrize("num_chunks", [1, 3, 7])
def test_streamed_chunks_equal_one_shot(model, tokens, num_chunks):
    one_shot = np.asarray(model(input_ids=tokens[:1]))[0, -1]
    result = omnijax.stream(model, split_text(tokens[0], num_chunks), page_size=4)
    assert result.logits.shape == (num_chunks, 1, model.config.vocab_size)
    np.testing.assert_allclose(np.asarray(result.logits[-1, 0]), one_shot, atol=1e-5, rtol=0)
    # Every chunk's last-position logits equal the one-shot logits at that position.
    ends = np.cumsum([len(p) for p in np.array_split(tokens[0], num_chunks)]) - 1
    full = np.asarray(model(input_ids=tokens[:1]))[0]
    np.testing.assert_allclose(np.asarray(result.logits[:, 0]), full[ends], atol=1e-5, rtol=0)
    assert np.asarray(result.stats.layout.retained_cells[:, 0]).tolist() == (ends + 1).tolist()


def test_greedy_answer_equals_transformers_generate(model, hf_thinker, tokens):
    tau = 6
    result = omnijax.stream(model, split_text(tokens[0], 3, answer_tokens=tau), max_answer_tokens=8, page_size=8)
    with torch.no_grad():
        out = hf_thinker.generate(input_ids=torch.as_tensor(tokens[:1]), attention_mask=torch.ones(1, SEQ, dtype=int),
                                  max_new_tokens=tau, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, SEQ:].numpy().tolist()
    got = np.asarray(result.tokens[-1, 0]).tolist()
    assert got[:tau] == want and got[tau:] == [-1, -1]
    assert np.asarray(result.tokens[:-1]).max() == -1  # no answer asked for earlier
    # The answer is fed back: the cache holds the prompt and all tau response tokens.
    assert int(result.stats.layout.retained_cells[-1, 0]) == SEQ + tau
    assert int(result.stats.next_pos[-1, 0]) == SEQ + tau


def test_session_steps_equal_the_scan(model, tokens):
    chunks = split_text(tokens[0], 3, answer_tokens=4)
    scanned = omnijax.stream(model, chunks, max_answer_tokens=4, num_pages=16, page_size=4)
    session = omnijax.Session(model, max_answer_tokens=4, num_pages=16, page_size=4)
    import jax
    for i in range(3):
        out = session.feed(jax.tree.map(lambda x: x[i], chunks))
        np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(scanned.logits[i]))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(scanned.tokens[i]))
    np.testing.assert_array_equal(np.asarray(session.state.kv.k), np.asarray(scanned.state.kv.k))


def test_bfloat16_computes_in_bfloat16(converted, hf_thinker, tokens):
    import jax.numpy as jnp

    model16 = omnijax.load(converted["bfloat16"])
    assert model16.config.dtype == "bfloat16"
    assert model16.decoder.layers.stacked()["q_proj"].dtype == jnp.bfloat16
    got = np.asarray(model16(input_ids=tokens))
    want32 = _hf_logits(hf_thinker, input_ids=tokens)
    want16 = _hf_logits(hf_thinker.to(torch.bfloat16), input_ids=tokens)
    hf_thinker.to(torch.float32)
    err16 = np.abs(got - want16).max()
    err32 = np.abs(got - want32).max()
    scale = np.abs(want32).max()
    # bfloat16 keeps ~3 significant digits: both references agree to a few bf16 ulps of the logit scale.
    assert err16 <= 0.05 * scale and err32 <= 0.05 * scale
    # Computing (not only storing) in bfloat16 moves the logits measurably away from the float32 result.
    assert err32 > 1e-4
    # The float32 load of the bfloat16 checkpoint sees the same rounded weights but computes in float32.
    upcast = np.asarray(omnijax.load(converted["bfloat16"], dtype="float32")(input_ids=tokens))
    assert np.abs(upcast - got).max() > 1e-4


def test_tied_embeddings(tmp_path, tokens):
    hf = hf_models.build_thinker(seed=1, scale=0.2, tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    src = hf_models.save_full(hf, tmp_path / "hf")
    model = omnijax.load(convert_checkpoint(src, tmp_path / "out", progress=False))
    assert model.config.tie_embeddings
    np.testing.assert_allclose(np.asarray(model(input_ids=tokens)), _hf_logits(hf, input_ids=tokens), atol=1e-4)


def test_model_rejects_bad_inputs(model, tokens):
    with pytest.raises(ValueError, match="input_ids must be"):
        model(input_ids=tokens[0])
    with pytest.raises(ValueError, match="must lie in"):
        model(input_ids=tokens + 1000)
    with pytest.raises(TypeError, match="integer token ids, got dtype float32"):
        model(input_ids=tokens.astype(np.float32))
    with pytest.raises(ValueError, match="at least one token"):
        model(input_ids=tokens[:, :0])
    with pytest.raises(ValueError, match=r"only 0 and 1, got values \[2\]"):
        model(input_ids=tokens, attention_mask=np.full(tokens.shape, 2))
    np.testing.assert_array_equal(np.asarray(model(input_ids=tokens, attention_mask=np.ones(tokens.shape, bool))),
                                  np.asarray(model(input_ids=tokens)))  # a boolean mask is a mask of 0 and 1
    with pytest.raises(ValueError, match="attention_mask shape"):
        model(input_ids=tokens, attention_mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="image_grid_thw"):
        model(input_ids=tokens, pixel_values=np.zeros((4, 1176)))
    with pytest.raises(TypeError, match="unexpected keyword"):
        model(input_ids=tokens, bogus=1)


def test_chunks_of_embeddings_equal_chunks_of_tokens(model, tokens):
    import dataclasses

    chunks = split_text(tokens[0], 3)
    table = np.asarray(model.decoder.embed[...])
    mask = np.zeros(chunks.token_ids.shape, bool)
    mask[:, :, ::2] = True  # every other token arrives as an embedding, its id zeroed
    embedded = dataclasses.replace(
        chunks, token_ids=np.where(mask, 0, chunks.token_ids), embeds=table[chunks.token_ids], embed_mask=mask)
    want = omnijax.stream(model, chunks, page_size=4)
    got = omnijax.stream(model, embedded, page_size=4)
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    wrong = dataclasses.replace(embedded, embeds=np.zeros_like(embedded.embeds))
    assert np.abs(np.asarray(omnijax.stream(model, wrong, page_size=4).logits) - np.asarray(want.logits)).max() > 1e-3


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_attention_impls_stream_like_the_reference(model, tokens, impl):
    # The reference run is test_session_steps_equal_the_scan's (same chunks and cache shape): compiled once.
    chunks = split_text(tokens[0], 3, answer_tokens=4)
    ref = omnijax.stream(model, chunks, max_answer_tokens=4, num_pages=16, page_size=4)
    got = omnijax.stream(model, chunks, max_answer_tokens=4, num_pages=16, page_size=4, impl=impl)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))


def test_unrolled_layer_loop_equals_the_scan(model, tokens):
    # `run_layers(unroll=True)` is the same computation in straight-line code: same hidden states, same cache.
    import jax
    import jax.numpy as jnp

    from omnijax.kv import attention, paged
    from omnijax.streaming.step import init_state

    decoder = model.decoder
    c = decoder.config
    ids = jnp.asarray(tokens[:, :SEQ])
    B, T = ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (c.position_axes, B, T))
    meta = paged.SlotMeta(pos=positions, unit=jnp.zeros((B, T), jnp.int32), span=jnp.ones((B, T), jnp.int32),
                          offset=jnp.zeros((B, T), jnp.int32))
    kv, slots, q_order = paged.reserve(init_state(c, num_pages=4, page_size=8, batch=B).kv,
                                       jnp.ones((B, T), bool), meta)
    view = attention.CacheView.of(kv, slots, q_order)
    x = decoder.embed_tokens(ids)
    scanned, unrolled = (jax.jit(lambda x, k, v, unroll=unroll: decoder.run_layers(
        x, positions, view, k, v, impl="xla", unroll=unroll)[:3])(x, kv.k, kv.v) for unroll in (False, True))
    for got, want in zip(unrolled, scanned):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    assert np.abs(np.asarray(scanned[1])).max() > 0  # the cache was written
