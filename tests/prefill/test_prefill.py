"""TideKV prefill: layer-major equals one-shot prefill, selections equal the dense and post-prefill baselines, decoding
from the compressed cache equals decoding from the full cache gathered at the same indices, budgets sum exactly."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.kernels.streaming_topk import snapkv_scores_reference
from omnijax.kv import attention, paged
from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.prefill import (
    AdaKV,
    RecentTokens,
    SnapKV,
    decode_step,
    force,
    greedy,
    immediate_eviction_prefill,
    pyramid_budgets,
    tidekv_prefill,
    token_major_prefill,
    uniform_budgets,
)
from omnijax.prefill.cache import LayerCache, Selection, pack
from tests._support.compiled_model import compiled

S, B, CHUNK, PAGE, WINDOW = 150, 2, 64, 32, 16


@pytest.fixture(scope="module")
def model():
    """TINY_OMNI with sharpened attention (query/key weights scaled up) so SnapKV scores have no ties."""
    m = Decoder(TINY_OMNI.replace(num_layers=3))
    m.layers.q_proj[...] = m.layers.q_proj[...] * 12.0
    m.layers.k_proj[...] = m.layers.k_proj[...] * 12.0
    return m


@pytest.fixture(scope="module")
def prompt(model):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 300, (B, S)))
    x = model.embed_tokens(ids)
    # Distinct mrope axes (as for video tokens), increasing along the prompt.
    t = np.sort(rng.integers(0, S, (B, S)), axis=1)
    positions = jnp.asarray(np.stack([t, t + rng.integers(0, 3, (B, S)), t + rng.integers(0, 3, (B, S))]), jnp.int32)
    return x, positions


# The reference paths below (one-shot forward, a layer's window queries, single decode steps, dense scores) run
# compiled (tests/_support/compiled_model.py): eagerly, each of their primitives was a program of its own.
@compiled
def one_shot_hidden(model, x, positions):
    """The paged decoder's one-shot forward (the path checked against transformers), over the prompt `x [B, n, D]`."""
    c = model.config
    Bx, n = x.shape[:2]
    kv = paged.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_pages=2 * 5,
                    page_size=32, batch=Bx, position_axes=3)
    z = jnp.zeros((Bx, n), jnp.int32)
    kv, slots, q_order = paged.reserve(kv, jnp.ones((Bx, n), bool), paged.SlotMeta(pos=positions, unit=z, span=z,
                                                                                   offset=z))
    view = attention.CacheView.of(kv, slots, q_order)
    hidden, k, v, _ = model.run_layers(x, positions, view, kv.k, kv.v)
    return hidden


step = compiled(decode_step)
"""`decode_step`, compiled (one program per cache shape); the refusals are checked on `decode_step` itself."""
scores_reference = jax.jit(snapkv_scores_reference)


def test_layer_major_without_eviction_equals_one_shot_prefill(model, prompt):
    x, positions = prompt
    want = np.asarray(one_shot_hidden(model, x, positions))
    for impl in ("reference", "xla"):
        got = tidekv_prefill(model, x, positions, chunk=CHUNK, page=PAGE, impl=impl)
        np.testing.assert_allclose(np.asarray(got.hidden), want, atol=1e-5, rtol=0)
    chunked = token_major_prefill(model, x, positions, chunk=CHUNK, page=PAGE)
    np.testing.assert_allclose(np.asarray(chunked.hidden), want, atol=1e-5, rtol=0)
    assert int(got.cache.cells()[0]) == S * model.config.num_kv_heads * model.config.num_layers


def _selected(cache):
    """Per layer, per sequence, per head: the sorted prompt indices held."""
    out = []
    for layer in cache.layers:
        index, offset, length = map(np.asarray, (layer.index, layer.offset, layer.length))
        out.append([[sorted(index[b, offset[b, g]:offset[b, g] + length[b, g]].tolist())
                     for g in range(length.shape[1])] for b in range(index.shape[0])])
    return out


@pytest.mark.parametrize("budgets", [40, "pyramid"])
def test_snapkv_selection_equals_dense_and_post_prefill(model, prompt, budgets):
    x, positions = prompt
    L = model.config.num_layers
    budgets = pyramid_budgets(40 * L, L, window=WINDOW) if budgets == "pyramid" else budgets
    tide = tidekv_prefill(model, x, positions, selector=SnapKV(window=WINDOW, block_size=32), budgets=budgets,
                          chunk=CHUNK, page=PAGE)
    post = token_major_prefill(model, x, positions, selector=SnapKV(window=WINDOW, impl="reference"),
                               budgets=budgets, page=PAGE)
    assert _selected(tide.cache) == _selected(post.cache)
    np.testing.assert_allclose(np.asarray(tide.hidden), np.asarray(post.hidden), atol=1e-5, rtol=0)
    # Independently: the dense straightforward SnapKV on the full layer keys and the window queries, per layer.
    full = token_major_prefill(model, x, positions, page=PAGE)
    per_layer = (budgets,) * L if isinstance(budgets, int) else budgets
    for layer_index, (layer, budget) in enumerate(zip(full.cache.layers, per_layer)):
        keys = full_keys(layer, S)
        q_obs = window_queries(model, x, positions, layer_index=layer_index)
        scores = np.asarray(scores_reference(q_obs, keys))  # [B, G, S - W]
        want = [[sorted(np.argsort(-scores[b, g], kind="stable")[:budget - WINDOW].tolist()
                        + list(range(S - WINDOW, S))) for g in range(scores.shape[1])] for b in range(B)]
        assert _selected(tide.cache)[layer_index] == want


def full_keys(layer: LayerCache, length: int) -> np.ndarray:
    """`[B, S, G, d]` keys of a keep-all layer cache (its segments may carry decode room after the prompt), on the
    host."""
    Bk, T, d = layer.k.shape
    G = layer.num_kv_heads
    return np.asarray(layer.k).reshape(Bk, G, T // G, d)[:, :, :length].transpose(0, 2, 1, 3)


@functools.partial(compiled, static_argnames=("layer_index",))
def window_queries(model, x, positions, *, layer_index):
    """Post-RoPE queries of the last WINDOW prompt tokens at one layer, from that layer's input hidden states."""
    from omnijax.models.decoder import chunk_rotation, layer_qkv
    from omnijax.prefill.layer_major import layer_params
    c = model.config
    h = x
    for i in range(layer_index):  # rerun the lower layers on the whole prompt (one-shot, reference attention)
        h = _one_layer(model, h, positions, i)
    rot = chunk_rotation(c, positions)
    q, _, _ = layer_qkv(c, layer_params(model, layer_index), h, rot)
    return q[:, S - WINDOW:]


def _one_layer(model, h, positions, layer_index):
    from omnijax.models.decoder import chunk_rotation, layer_finish, layer_qkv
    from omnijax.prefill.layer_major import layer_params
    c = model.config
    p = layer_params(model, layer_index)
    rot = chunk_rotation(c, positions)
    q, k, v = layer_qkv(c, p, h, rot)
    causal = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))  # write order = prompt index
    out = attention.dense_attention(q, k, v, jnp.ones((B, S), bool), causal, causal)
    return layer_finish(c, p, h, out)


pack_compiled = jax.jit(pack, static_argnames="room")  # `pack` as one program, not op by op


def test_decoding_from_compressed_cache_equals_gathered_full_cache(model, prompt):
    x, positions = prompt
    tide = tidekv_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budgets=40, chunk=CHUNK, page=PAGE,
                          room=5)
    full = token_major_prefill(model, x, positions, page=PAGE, room=5)
    # Gather the full prefill's keys and values at TideKV's indices into a cache of the same layout.
    gathered = []
    for tl, fl in zip(tide.cache.layers, full.cache.layers):
        keys, values = full_keys(fl, S), full_keys(LayerCache(fl.v, fl.v, fl.index, fl.offset, fl.length), S)
        G = tl.num_kv_heads
        t_index, t_offset, t_length = np.asarray(tl.index), np.asarray(tl.offset), np.asarray(tl.length)
        filled = t_offset[:, :G] + t_length
        index = np.stack([np.concatenate([t_index[b, t_offset[b, g]:filled[b, g]] for g in range(G)])
                          for b in range(B)])
        offset = np.concatenate([np.zeros((B, 1), np.int32), np.cumsum(t_length, axis=1, dtype=np.int32)], axis=1)
        gathered.append(pack_compiled(jnp.asarray(keys), jnp.asarray(values),
                             Selection(index=jnp.asarray(index), offset=jnp.asarray(offset)), room=5))
    other = dataclasses.replace(tide.cache, layers=tuple(gathered))
    tokens_a, logits_a, _ = greedy(model, tide.cache, tide.logits, 5)
    tokens_b, logits_b, _ = greedy(model, other, full.logits, 5)
    np.testing.assert_array_equal(np.asarray(tokens_a), np.asarray(tokens_b))
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), atol=1e-5, rtol=0)


def test_compiled_greedy_equals_decode_steps_one_by_one(model, prompt):
    # `greedy` runs its steps as one compiled scan; the same steps called one at a time must agree.
    x, positions = prompt
    tide = tidekv_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budgets=40, chunk=CHUNK, page=PAGE,
                          room=6)
    tokens, logits, cache = greedy(model, tide.cache, tide.logits, 6)
    assert tokens.shape == (B, 6) and logits.shape == (B, 6, model.config.vocab_size)
    step_logits, step_cache = tide.logits, tide.cache
    for i in range(6):
        token = np.argmax(np.asarray(step_logits), axis=-1).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(tokens)[:, i], token)
        step_logits, step_cache = step(model, step_cache, token)
        np.testing.assert_allclose(np.asarray(logits)[:, i], np.asarray(step_logits), atol=1e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(step_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert greedy(model, tide.cache, tide.logits, 0)[0].shape == (B, 0)


def test_teacher_forced_decoding_equals_decode_steps_one_by_one(model, prompt):
    # `force` feeds given tokens as one compiled scan: fed greedy's own tokens it reproduces greedy's logits (both
    # give the logits after each token), and its cache equals decode_step's one at a time.
    x, positions = prompt
    tide = tidekv_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budgets=40, chunk=CHUNK, page=PAGE,
                          room=6)
    tokens, greedy_logits, greedy_cache = greedy(model, tide.cache, tide.logits, 5)
    logits, cache = force(model, tide.cache, tokens)
    assert logits.shape == (B, 5, model.config.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(greedy_logits), atol=1e-5, rtol=0)
    step_cache = tide.cache
    for i in range(5):
        step_logits, step_cache = step(model, step_cache, np.asarray(tokens)[:, i])
        np.testing.assert_allclose(np.asarray(logits)[:, i], np.asarray(step_logits), atol=1e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(step_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(greedy_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="integer array"):
        force(model, tide.cache, np.zeros((B, 2), np.float32))
    with pytest.raises(ValueError, match="sequences"):
        force(model, tide.cache, np.zeros((B + 1, 2), np.int32))
    # A cache of another model (here: one layer short) would decode through its layers only, silently.
    short = dataclasses.replace(tide.cache, layers=tide.cache.layers[:-1])
    for decode in (lambda: greedy(model, short, tide.logits, 2), lambda: force(model, short, tokens),
                   lambda: decode_step(model, short, tokens[:, 0])):
        with pytest.raises(ValueError, match=f"not made for this model: {model.config.num_layers - 1} layers"):
            decode()


@compiled
def last_logits(model, x, positions, token, nxt):
    """The one-shot forward's logits at the last token of the prompt followed by `token [B]` at positions `nxt`."""
    x2 = jnp.concatenate([x, model.embed_tokens(token[:, None])], axis=1)
    pos2 = jnp.concatenate([positions, jnp.broadcast_to(nxt[None, :, None], (3, B, 1)).astype(jnp.int32)], axis=2)
    return model.logits(one_shot_hidden(model, x2, pos2)[:, -1])


def test_decode_on_full_cache_equals_paged_decoder(model, prompt):
    """decode_step over a keep-all compressed cache equals the paged decoder fed the prompt plus the token."""
    x, positions = prompt
    full = token_major_prefill(model, x, positions, page=PAGE, room=1)
    token = np.argmax(np.asarray(full.logits), axis=-1).astype(np.int32)
    logits, cache = step(model, full.cache, token)
    nxt = np.asarray(positions).max(axis=(0, 2)) + 1
    want = last_logits(model, x, positions, token, nxt)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5, rtol=0)
    assert int(np.asarray(cache.next_pos)[0]) == int(nxt[0]) + 1
    assert int(np.asarray(cache.layers[0].length)[0, 0]) == S + 1


def test_budget_schedules_sum_to_the_total():
    for total, L in [(40 * 3, 3), (1000, 7), (64 * 28 + 5, 28), (2048 * 28, 28)]:
        pyramid = pyramid_budgets(total, L, window=16 if total < 1000 else 64)
        assert sum(pyramid) == total and len(pyramid) == L
        assert all(a >= b for a, b in zip(pyramid, pyramid[1:]))  # lower layers get more
        assert sum(uniform_budgets(total, L)) == total
    with pytest.raises(ValueError, match="window"):
        pyramid_budgets(10, 3, window=16)
    with pytest.raises(ValueError, match="beta >= 1"):
        pyramid_budgets(1000, 4, window=8, beta=0.4)  # would give the bottom layer a negative share
    with pytest.raises(ValueError, match="at least one token per layer, got total 2 over 4 layers"):
        uniform_budgets(2, 4)


def test_adakv_budgets_are_head_adaptive_and_sum_to_the_layer_budget(model, prompt):
    x, positions = prompt
    budget = 40
    selector = AdaKV(window=WINDOW, floor=0.25)
    tide = tidekv_prefill(model, x, positions, selector=selector, budgets=budget, chunk=CHUNK, page=PAGE)
    full = token_major_prefill(model, x, positions, page=PAGE)
    G = model.config.num_kv_heads
    share = budget - WINDOW
    for layer_index, (layer, fl) in enumerate(zip(tide.cache.layers, full.cache.layers)):
        length = np.asarray(layer.length)
        assert layer.k.shape[1] == G * budget  # real storage: exactly the layer's budget, no padding to a maximum
        np.testing.assert_array_equal(length.sum(axis=1), G * budget)
        assert (length >= WINDOW + int(0.25 * share)).all()
        # Plain-Python AdaKV on the dense scores.
        scores = np.asarray(scores_reference(window_queries(model, x, positions, layer_index=layer_index),
                                             full_keys(fl, S)))
        for b in range(B):
            kept = {g: set(np.argsort(-scores[b, g], kind="stable")[:int(0.25 * share)].tolist()) for g in range(G)}
            rest = sorted(((-scores[b, g, j], g, j) for g in range(G) for j in range(S - WINDOW)
                           if j not in kept[g]))
            for _, g, j in rest[:G * share - sum(len(v) for v in kept.values())]:
                kept[g].add(j)
            want = [sorted(kept[g] | set(range(S - WINDOW, S))) for g in range(G)]
            assert _selected(tide.cache)[layer_index][b] == want
    assert len({tuple(r) for r in np.asarray(tide.cache.layers[0].length)}) >= 1
    assert any(len(set(np.asarray(layer.length)[0].tolist())) > 1 for layer in tide.cache.layers)


def test_recent_selector_and_immediate_eviction(model, prompt):
    x, positions = prompt
    recent = tidekv_prefill(model, x, positions, selector=RecentTokens(), budgets=30, chunk=CHUNK, page=PAGE)
    assert all(h == list(range(S - 30, S)) for layer in _selected(recent.cache) for seq in layer for h in seq)
    full = tidekv_prefill(model, x, positions, chunk=CHUNK, page=PAGE)
    online = immediate_eviction_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budget=40, chunk=CHUNK)
    assert all(len(h) == 40 for layer in _selected(online.cache) for seq in layer for h in seq)
    drift = np.abs(np.asarray(online.hidden) - np.asarray(full.hidden)).max(axis=(0, 2))  # per prompt index
    assert drift[:CHUNK].max() < 1e-5  # the first chunk sees its whole history
    assert drift[CHUNK:].max() > 1e-3  # later chunks see only what was kept: hidden states drift
    np.testing.assert_allclose(np.asarray(recent.hidden), np.asarray(full.hidden), atol=0)  # eviction is layer-end


def test_bad_budgets_are_refused(model, prompt):
    x, positions = prompt
    with pytest.raises(ValueError, match="selector"):
        tidekv_prefill(model, x, positions, budgets=40)
    with pytest.raises(ValueError, match="one positive budget per layer"):
        tidekv_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budgets=(40, 40))
    with pytest.raises(ValueError, match="must exceed its window"):
        tidekv_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budgets=WINDOW, chunk=CHUNK, page=PAGE)
    with pytest.raises(TypeError, match="selector must be a selector object"):
        tidekv_prefill(model, x, positions, selector="snapkv", budgets=40)
    with pytest.raises(ValueError, match="chunk must be a positive int, got 0"):
        tidekv_prefill(model, x, positions, chunk=0, page=PAGE)
    with pytest.raises(ValueError, match="page must be a power of two, got 48"):
        tidekv_prefill(model, x, positions, chunk=CHUNK, page=48)


@pytest.mark.parametrize("build, message", [
    (lambda: SnapKV(window=0), "SnapKV: window must be a positive int, got 0"),
    (lambda: SnapKV(pool_kernel=4), "pool_kernel must be an odd positive int, got 4"),
    (lambda: SnapKV(impl="triton"), "unknown scoring impl 'triton'"),
    (lambda: AdaKV(block_size=48), "AdaKV: block_size must be a power of two, got 48"),
    (lambda: AdaKV(floor=1.5), r"floor must lie in \[0, 1\], got 1.5"),
])
def test_selectors_refuse_bad_settings_when_built(build, message):
    with pytest.raises(ValueError, match=message):
        build()
