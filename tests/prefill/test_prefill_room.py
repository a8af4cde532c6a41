"""The compressed decode cache never loses a decoded token's key and value silently: `greedy` and `force` refuse
steps the room cannot keep, `with_room` grows it (decoding then equals a full-context forward), and a lone
`decode_step` past the room records the loss in the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kv import attention, paged
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.prefill import AdaKV, check_room, decode_step, force, greedy, tidekv_prefill, with_room

S, B, CHUNK, PAGE, WINDOW = 48, 2, 16, 16, 8


@pytest.fixture(scope="module")
def model():
    m = Decoder(TINY_OMNI.replace(num_layers=2))
    m.layers.q_proj[...] = m.layers.q_proj[...] * 12.0
    m.layers.k_proj[...] = m.layers.k_proj[...] * 12.0
    return m


@pytest.fixture(scope="module")
def prompt(model):
    rng = np.random.default_rng(1)
    x = model.embed_tokens(jnp.asarray(rng.integers(0, 300, (B, S))))
    t = np.sort(rng.integers(0, S, (B, S)), axis=1)
    positions = jnp.asarray(np.stack([t, t + rng.integers(0, 3, (B, S)), t + 1]), jnp.int32)
    return x, positions


def full_context_logits(model, x, positions, tokens):
    """The paged decoder's one-shot forward over the prompt plus `tokens [B, N]` (text positions continuing from the
    prompt's max + 1 on every axis): the logits after each of the tokens, `[B, N, V]`."""
    c = model.config
    N = tokens.shape[1]
    nxt = jnp.max(positions, axis=(0, 2)) + 1
    x2 = jnp.concatenate([x, model.embed_tokens(tokens)], axis=1)
    pos2 = jnp.concatenate([positions, jnp.broadcast_to((nxt[:, None] + jnp.arange(N))[None], (3, B, N))], axis=2)
    T = S + N
    kv = paged.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                    num_pages=B * -(-T // 16), page_size=16, batch=B, position_axes=3)
    z = jnp.zeros((B, T), jnp.int32)
    kv, slots, q_order = paged.reserve(kv, jnp.ones((B, T), bool), paged.SlotMeta(pos=pos2, unit=z, span=z, offset=z))
    assert not bool(kv.exhausted.any())
    hidden, _, _, _ = model.run_layers(x2, pos2, attention.CacheView.of(kv, slots, q_order), kv.k, kv.v)
    return model.logits(hidden[:, S:])


def test_greedy_and_force_past_the_room_are_refused_naming_the_fix(model, prompt):
    x, positions = prompt
    tide = tidekv_prefill(model, x, positions, chunk=CHUNK, page=PAGE, room=2)
    assert np.asarray(tide.cache.room()).tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"greedy: 5 decode steps .* has 2: prefill with room >= 5.*with_room"):
        greedy(model, tide.cache, tide.logits, 5)
    with pytest.raises(ValueError, match=r"force: 3 decode steps .* has 2: prefill with room >= 3"):
        force(model, tide.cache, jnp.zeros((B, 3), jnp.int32))
    # Exactly the room is fine, and keeps every token: the cache is then full, nothing dropped.
    tokens, logits, cache = greedy(model, tide.cache, tide.logits, 2)
    assert np.asarray(cache.room()).tolist() == [0, 0] and not bool(cache.exhausted.any())
    assert np.asarray(cache.dropped).tolist() == [0, 0]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_context_logits(model, x, positions, tokens)),
                               atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="greedy: 1 decode steps need 1 free entries"):
        greedy(model, cache, logits[:, -1], 1)


def test_with_room_keeps_every_decoded_token_equal_to_the_full_context_forward(model, prompt):
    x, positions = prompt
    tide = tidekv_prefill(model, x, positions, chunk=CHUNK, page=PAGE, room=2)
    grown = with_room(tide.cache, 7)
    assert np.asarray(grown.room()).tolist() == [7, 7]
    assert with_room(grown, 3) is grown  # already enough: unchanged
    tokens, logits, cache = greedy(model, grown, tide.logits, 7)
    assert np.asarray(cache.dropped).tolist() == [0, 0]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_context_logits(model, x, positions, tokens)),
                               atol=2e-5, rtol=0)
    # Every decoded token's key is held in every segment (write indices S .. S + 6), after the prompt's entries.
    for layer in cache.layers:
        index, offset, length = map(np.asarray, (layer.index, layer.offset, layer.length))
        for b in range(B):
            for g in range(layer.num_kv_heads):
                held = index[b, offset[b, g]:offset[b, g] + length[b, g]].tolist()
                assert held == list(range(S + 7))


def test_with_room_on_a_compressed_cache_equals_prefilling_with_that_room(model, prompt):
    # AdaKV gives heads unequal segments, so growing must move every segment by its own shift.
    x, positions = prompt
    selector = AdaKV(window=WINDOW, floor=0.25)
    small = tidekv_prefill(model, x, positions, selector=selector, budgets=20, chunk=CHUNK, page=PAGE, room=1)
    big = tidekv_prefill(model, x, positions, selector=selector, budgets=20, chunk=CHUNK, page=PAGE, room=5)
    assert any(len(set(np.asarray(layer.length)[0].tolist())) > 1 for layer in small.cache.layers)
    grown = with_room(small.cache, 5)
    for got, want in zip(jax.tree.leaves(grown), jax.tree.leaves(big.cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    tokens_a, logits_a, _ = greedy(model, grown, small.logits, 5)
    tokens_b, logits_b, _ = greedy(model, big.cache, big.logits, 5)
    np.testing.assert_array_equal(np.asarray(tokens_a), np.asarray(tokens_b))
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="room must be an int >= 0"):
        with_room(small.cache, -1)


def test_decode_step_past_the_room_records_the_loss_and_overwrites_nothing(model, prompt):
    x, positions = prompt
    tide = tidekv_prefill(model, x, positions, chunk=CHUNK, page=PAGE, room=1)
    token = jnp.argmax(tide.logits, axis=-1).astype(jnp.int32)
    step = jax.jit(lambda cache, token: decode_step(model, cache, token))  # the jitted step records, never raises
    _, one = step(tide.cache, token)
    assert np.asarray(one.exhausted).tolist() == [False, False] and np.asarray(one.dropped).tolist() == [0, 0]
    _, two = step(one, token)
    assert np.asarray(two.exhausted).tolist() == [True, True] and np.asarray(two.dropped).tolist() == [1, 1]
    _, three = step(two, token)
    assert np.asarray(three.exhausted).tolist() == [True, True] and np.asarray(three.dropped).tolist() == [2, 2]
    for full, over in zip(one.layers, three.layers):  # the full segments are left exactly as they were
        for name in ("k", "v", "index", "offset", "length"):
            np.testing.assert_array_equal(np.asarray(getattr(over, name)), np.asarray(getattr(full, name)))
    for decode in (lambda: greedy(model, three, tide.logits, 0), lambda: force(model, two, token[:, None]),
                   lambda: check_room(with_room(two, 4), 1)):
        with pytest.raises(ValueError, match=r"already dropped the keys and values of (\[1, 1\]|\[2, 2\])"):
            decode()
