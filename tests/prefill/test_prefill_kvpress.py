"""ChunkKV and KeyDiff selectors: the kept index sets equal kvpress 0.5.5's presses on the same Qwen2 weights, each
selector equals a plain-Python reference on random keys and queries, the layer-major prefill runs and decodes with
them, and Table 8's recent-token immediate-eviction control."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omnijax.models.config import TINY_OMNI
from omnijax.models.decoder import Decoder
from omnijax.prefill import (
    IMMEDIATE_EVICTION,
    REGISTRY,
    ChunkKV,
    KeyDiff,
    RecentTokens,
    Selection,
    SnapKV,
    greedy,
    immediate_eviction,
    immediate_eviction_prefill,
    kvpress_budget,
    pyramid_budgets,
    recent_eviction_prefill,
    tidekv_prefill,
    token_major_prefill,
)
from omnijax.prefill.cache import pack
from tests.prefill.test_prefill import _selected

VOCAB, S_HF = 256, 77


kept_sets = _selected  # per layer, per sequence, per KV head: the sorted prompt indices a compressed cache holds


def selection_sets(selection: Selection, G: int):
    index, offset = np.asarray(selection.index), np.asarray(selection.offset)
    return [[index[b, offset[b, g]:offset[b, g + 1]].tolist() for g in range(G)] for b in range(index.shape[0])]


# ---------------------------------------------------------------------------------------------------------------------
# Against kvpress 0.5.5 on a tiny Qwen2 (transformers) and the same weights converted to omnijax
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="torch (the test extra) runs the kvpress reference")
    pytest.importorskip("kvpress", reason="kvpress (the test extra) is the reference")
    import transformers

    import omnijax
    from omnijax.convert import convert_checkpoint

    torch.manual_seed(5)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # larger weights: peaked attention, well separated scores
        for p in hf.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
    hf.eval()
    root = tmp_path_factory.mktemp("qwen2_kvpress")
    hf.save_pretrained(root / "hf", safe_serialization=True)
    with warnings.catch_warnings():  # no tokenizer files: the model takes token ids, all this test feeds it
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(convert_checkpoint(root / "hf", root / "out", progress=False))
    ids = np.random.default_rng(7).integers(0, VOCAB, (1, S_HF))
    return hf, model, ids, _hf_keys(hf, ids, None)


def _hf_keys(hf, ids, press):
    """Per layer `[B, G, n, d]` cache keys after a transformers prefill, under `press` if given."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode(), (press(hf) if press is not None else contextlib.nullcontext()):
        hf(input_ids=torch.as_tensor(ids), past_key_values=cache, use_cache=True)
    return [layer.keys.numpy() for layer in cache.layers]


def kvpress_kept(hf, ids, full_keys, press):
    """kvpress's kept prompt indices per layer, sequence and KV head, found by matching the kept keys (exact copies
    of cache rows) with the uncompressed cache's keys."""
    out = []
    for kept, full in zip(_hf_keys(hf, ids, press), full_keys):
        layer = []
        for b in range(kept.shape[0]):
            heads = []
            for g in range(kept.shape[1]):
                match = np.all(kept[b, g][:, None] == full[b, g][None], axis=-1)  # [n, S]
                assert (match.sum(axis=1) == 1).all()
                heads.append(sorted(match.argmax(axis=1).tolist()))
            layer.append(heads)
        out.append(layer)
    return out


@pytest.mark.parametrize("window, pool_kernel, chunk_length, ratios", [
    (8, 5, 8, (0.5, 0.9)),  # 77 = 9 chunks + 5: the short last chunk is all window
    (4, 3, 10, (0.25, 0.8)),  # 7 chunks + 7: the short last chunk straddles the window
    (8, 5, 7, (0.6,)),  # 11 whole chunks
    (8, 1, 100, (0.5,)),  # the prompt is shorter than one chunk: kvpress's SnapKV alone
])
def test_chunkkv_keeps_what_kvpress_keeps(qwen2, window, pool_kernel, chunk_length, ratios):
    from kvpress import ChunkKVPress, SnapKVPress

    hf, model, ids, full = qwen2
    for ratio in ratios:
        press = ChunkKVPress(press=SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=pool_kernel),
                             chunk_length=chunk_length)
        budget = kvpress_budget(ratio, S_HF, chunk_length=chunk_length)
        want = kvpress_kept(hf, ids, full, press)
        for impl in ("xla", "reference") if ratio == ratios[0] and chunk_length == 8 else ("xla",):
            selector = ChunkKV(window=window, pool_kernel=pool_kernel, chunk_length=chunk_length, impl=impl,
                               block_size=16)
            got = model.prefill(ids, selector=selector, budgets=budget, chunk=32, page=16)
            assert kept_sets(got.cache) == want, (ratio, impl)


def test_chunkkv_short_last_chunk_case_is_exercised(qwen2):
    """The parity above covers kvpress keeping fewer tokens than the budget (a chosen short last chunk)."""
    hf, model, ids, full = qwen2
    got = model.prefill(ids, selector=ChunkKV(window=8, chunk_length=8), budgets=kvpress_budget(0.5, S_HF,
                                                                                               chunk_length=8))
    assert {len(h) for layer in kept_sets(got.cache) for seq in layer for h in seq} == {4 * 8 + 5}


def test_keydiff_keeps_what_kvpress_keeps(qwen2):
    from kvpress import KeyDiffPress

    hf, model, ids, full = qwen2
    for ratio in (0.1, 0.5, 0.95):
        want = kvpress_kept(hf, ids, full, KeyDiffPress(compression_ratio=ratio))
        budget = kvpress_budget(ratio, S_HF)
        assert budget == max(1, int(S_HF * (1 - ratio)))
        got = model.prefill(ids, selector=KeyDiff(), budgets=budget, chunk=32, page=16)
        assert kept_sets(got.cache) == want, ratio


def test_snapkv_keeps_what_kvpress_keeps(qwen2):
    """The same harness on SnapKV (the window always kept, top prefix scores per head)."""
    from kvpress import SnapKVPress

    hf, model, ids, full = qwen2
    for ratio in (0.75,):
        want = kvpress_kept(hf, ids, full, SnapKVPress(compression_ratio=ratio, window_size=8, kernel_size=5))
        got = model.prefill(ids, selector=SnapKV(window=8, block_size=16), budgets=kvpress_budget(ratio, S_HF),
                            chunk=32, page=16)
        assert kept_sets(got.cache) == want


def test_kvpress_budget():
    assert kvpress_budget(0.0, 77) == 77 and kvpress_budget(0.0, 77, chunk_length=8) == 77
    assert kvpress_budget(0.5, 77) == 38 and kvpress_budget(0.999, 77) == 1
    assert kvpress_budget(0.5, 77, chunk_length=8) == 5 * 8  # ceil(77 / 8) = 10 chunks
    assert kvpress_budget(0.9, 77, chunk_length=8) == 8  # int(10 * 0.0999..) = 0 -> at least one chunk
    assert kvpress_budget(0.5, 77, chunk_length=100) == 38
    with pytest.raises(ValueError, match="compression_ratio"):
        kvpress_budget(1.0, 77)


# ---------------------------------------------------------------------------------------------------------------------
# Plain-Python references on random keys and queries
# ---------------------------------------------------------------------------------------------------------------------


def snapkv_scores_loop(q, k, window, kernel):
    """`[B, G, S - W]` SnapKV scores by loops: softmax per query head and window row (causal), mean over the window,
    zero-padded average pooling, mean over the group's query heads."""
    B, W, H, d = q.shape
    _, S, G, _ = k.shape
    R, P = H // G, S - window
    out = np.zeros((B, G, P))
    for b in range(B):
        for g in range(G):
            pooled_heads = []
            for r in range(R):
                col = np.zeros(P)
                for i in range(W):
                    visible = S - W + i + 1
                    logits = (k[b, :visible, g].astype(np.float64) @ q[b, i, g * R + r] / math.sqrt(d)).tolist()
                    top = max(logits)
                    e = [math.exp(x - top) for x in logits]
                    z = sum(e)
                    for j in range(P):
                        col[j] += e[j] / z / W
                pooled = [sum(col[j + o] for o in range(-(kernel // 2), kernel // 2 + 1) if 0 <= j + o < P) / kernel
                          for j in range(P)]
                pooled_heads.append(pooled)
            out[b, g] = np.mean(pooled_heads, axis=0)
    return out


def chunkkv_loop(q, k, window, kernel, length, budget):
    """ChunkKV by loops: `(kept [B][G] sorted lists, chunk scores, number of chunks kept)`."""
    B, S, G, _ = k.shape
    scores = snapkv_scores_loop(q, k, window, kernel)
    kept, all_scores = [], []
    n_keep = budget // length
    for b in range(B):
        top = scores[b].max() + 1
        token = [sum(scores[b, g, t] if t < S - window else top for g in range(G)) for t in range(S)]
        chunks = [token[s:s + length] for s in range(0, S, length)]
        chunk_score = [sum(c) / len(c) for c in chunks]
        order = sorted(range(len(chunks)), key=lambda c: (-chunk_score[c], c))[:n_keep]
        tokens = sorted(t for c in order for t in range(c * length, min((c + 1) * length, S)))
        kept.append([tokens] * G)
        all_scores.append(chunk_score)
    return kept, all_scores, n_keep


def keydiff_loop(k, budget):
    B, S, G, _ = k.shape
    kept = []
    for b in range(B):
        heads = []
        for g in range(G):
            rows = [k[b, t, g].astype(np.float64) for t in range(S)]
            anchor = sum(r / np.linalg.norm(r) for r in rows) / S
            score = [-float(np.dot(r, anchor) / (np.linalg.norm(r) * np.linalg.norm(anchor))) for r in rows]
            heads.append(sorted(sorted(range(S), key=lambda t: (-score[t], t))[:budget]))
        kept.append(heads)
    return kept


CHUNK_CASES = [  # (B, S, G, R, d, window, kernel, chunk_length, budget, impl)
    (1, 23, 2, 2, 4, 4, 3, 5, 10, "xla"),
    (2, 30, 1, 2, 4, 3, 5, 4, 13, "xla"),
    (2, 19, 2, 1, 4, 5, 1, 6, 12, "reference"),
    (1, 32, 2, 2, 4, 6, 3, 8, 24, "xla"),
    (2, 17, 2, 2, 4, 2, 3, 3, 7, "reference"),
    (1, 26, 1, 3, 4, 4, 5, 2, 9, "xla"),
    (2, 21, 2, 2, 4, 3, 3, 7, 14, "xla"),
    (1, 12, 2, 1, 4, 6, 1, 20, 8, "xla"),  # shorter than one chunk: SnapKV
]
DRAWS = 26


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunkkv_equals_plain_python(case):
    B, S, G, R, d, window, kernel, length, budget, impl = case
    selector = ChunkKV(window=window, pool_kernel=kernel, chunk_length=length, impl=impl, block_size=8)
    select = jax.jit(selector.select, static_argnums=2)  # one program for the case's draws, not one per primitive
    rng = np.random.default_rng(S * 100 + budget)
    near_ties = 0
    for _ in range(DRAWS):
        q = rng.normal(size=(B, window, G * R, d)).astype(np.float32) * 2
        k = rng.normal(size=(B, S, G, d)).astype(np.float32) * 2
        got = selection_sets(select(q, k, budget), G)
        if S < length:  # kvpress hands a prompt shorter than one chunk to SnapKV: the window + top prefix scores
            scores = snapkv_scores_loop(q, k, window, kernel)
            want = [[sorted(sorted(range(S - window), key=lambda t: (-scores[b, g, t], t))[:budget - window]
                            + list(range(S - window, S))) for g in range(G)] for b in range(B)]
            assert got == want
            continue
        want, chunk_scores, n_keep = chunkkv_loop(q, k, window, kernel, length, budget)
        for b in range(B):
            ranked = sorted(chunk_scores[b], reverse=True)
            if ranked[n_keep - 1] - ranked[n_keep] > 1e-5:
                assert got[b] == want[b]
            else:  # a tie at the cut (chunks wholly inside the window): any of the tied chunks is right
                near_ties += 1
                chosen = sorted({t // length for t in got[b][0]})
                assert len(chosen) == n_keep and all(h == got[b][0] for h in got[b])
                assert min(chunk_scores[b][c] for c in chosen) >= ranked[n_keep - 1] - 1e-5
    assert near_ties <= DRAWS // 2


KEYDIFF_CASES = [(1, 20, 2, 4, 7), (2, 33, 2, 8, 16), (2, 9, 1, 4, 1), (1, 40, 3, 4, 39), (2, 25, 2, 4, 25)]


@pytest.mark.parametrize("case", KEYDIFF_CASES)
def test_keydiff_equals_plain_python(case):
    B, S, G, d, budget = case
    rng = np.random.default_rng(S + budget)
    select = jax.jit(KeyDiff().select, static_argnums=2)  # one program for the case's draws
    for _ in range(45):
        k = (rng.normal(size=(B, S, G, d)) + rng.normal(size=(1, 1, G, d))).astype(np.float32)
        got = selection_sets(select(None, k, budget), G)
        assert got == keydiff_loop(k, min(budget, S))


def test_selectors_refuse_bad_settings():
    with pytest.raises(ValueError, match="chunk_length must be a positive int, got 0"):
        ChunkKV(chunk_length=0)
    with pytest.raises(ValueError, match="pool_kernel must be an odd positive int"):
        ChunkKV(pool_kernel=2)
    with pytest.raises(ValueError, match="holds no chunk"):
        ChunkKV(window=2, chunk_length=8).select(jnp.ones((1, 2, 2, 4)), jnp.ones((1, 30, 1, 4)), 7)
    assert REGISTRY["chunkkv"] is ChunkKV and REGISTRY["keydiff"] is KeyDiff


# ---------------------------------------------------------------------------------------------------------------------
# Layer-major prefill and decoding with the selectors; the recent-token immediate-eviction control
# ---------------------------------------------------------------------------------------------------------------------

S, B, CHUNK, PAGE, WINDOW = 90, 2, 32, 16, 8


@pytest.fixture(scope="module")
def tiny():
    m = Decoder(TINY_OMNI.replace(num_layers=2))
    m.layers.q_proj[...] = m.layers.q_proj[...] * 12.0
    m.layers.k_proj[...] = m.layers.k_proj[...] * 12.0
    rng = np.random.default_rng(0)
    x = m.embed_tokens(jnp.asarray(rng.integers(0, 300, (B, S))))
    t = np.sort(rng.integers(0, S, (B, S)), axis=1)
    positions = jnp.asarray(np.stack([t, t + rng.integers(0, 3, (B, S)), t + rng.integers(0, 3, (B, S))]), jnp.int32)
    return m, x, positions


pack_compiled = jax.jit(pack, static_argnames="room")  # `pack` as one program, not op by op


@pytest.mark.parametrize("selector, budgets, compare", [
    (ChunkKV(window=WINDOW, chunk_length=7, block_size=16), 35, True),
    (ChunkKV(window=WINDOW, chunk_length=8, block_size=16), "pyramid", False),
    (KeyDiff(), "pyramid", True),
])
def test_layer_major_prefill_with_selector_decodes(tiny, selector, budgets, compare):
    model, x, positions = tiny
    L = model.config.num_layers
    if budgets == "pyramid":
        budgets = pyramid_budgets(40 * L, L, window=getattr(selector, "chunk_length", 1))
    tide = tidekv_prefill(model, x, positions, selector=selector, budgets=budgets, chunk=CHUNK, page=PAGE, room=4)
    per_layer = (budgets,) * L if isinstance(budgets, int) else budgets
    for layer, budget in zip(kept_sets(tide.cache), per_layer):
        for seq in layer:
            assert all(len(h) <= budget for h in seq)
    tokens, logits, _ = greedy(model, tide.cache, tide.logits, 4)
    assert tokens.shape == (B, 4) and np.isfinite(np.asarray(logits)).all()
    if not compare:
        return
    post = token_major_prefill(model, x, positions, selector=selector, budgets=budgets, page=PAGE)
    assert kept_sets(tide.cache) == kept_sets(post.cache)  # layer-end selection sees what post-prefill does
    # Decoding equals decoding from the full cache gathered at the same indices into compact segments (ChunkKV's
    # short last chunk leaves unowned entries after the segments: they must be invisible).
    full = token_major_prefill(model, x, positions, page=PAGE)
    gathered = []
    for tl, fl in zip(tide.cache.layers, full.cache.layers):  # on the host: no eager programs
        G = tl.num_kv_heads
        keys = np.asarray(fl.k).reshape(B, G, S, -1).transpose(0, 2, 1, 3)
        values = np.asarray(fl.v).reshape(B, G, S, -1).transpose(0, 2, 1, 3)
        t_index, t_offset, t_length = np.asarray(tl.index), np.asarray(tl.offset), np.asarray(tl.length)
        filled = t_offset[:, :G] + t_length
        index = np.stack([np.concatenate([t_index[b, t_offset[b, g]:filled[b, g]] for g in range(G)])
                          for b in range(B)])
        offset = np.concatenate([np.zeros((B, 1), np.int32), np.cumsum(t_length, axis=1, dtype=np.int32)], axis=1)
        gathered.append(pack_compiled(jnp.asarray(keys), jnp.asarray(values),
                             Selection(index=jnp.asarray(index), offset=jnp.asarray(offset)), room=4))
    other = tide.cache.__class__.create(gathered, tide.cache.next_pos, tide.cache.next_index)
    tokens_b, logits_b, _ = greedy(model, other, full.logits, 4)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(tokens_b))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_b), atol=1e-5, rtol=0)


def test_chunkkv_short_last_chunk_layout(tiny):
    """90 = 12 chunks of 7 + 6 with the window at the end: the short chunk is kept, so each head holds 6 + 4 * 7
    tokens of a 35-token budget, and the selection ends in one unowned entry per head."""
    model, x, positions = tiny
    tide = tidekv_prefill(model, x, positions, selector=ChunkKV(window=WINDOW, chunk_length=7, block_size=16),
                          budgets=35, chunk=CHUNK, page=PAGE)
    for layer in tide.cache.layers:
        assert (np.asarray(layer.length) == 34).all() and layer.k.shape[1] == 2 * 35
        assert (np.asarray(layer.index)[:, -2:] == -1).all()


def test_recent_token_immediate_eviction_control(tiny):
    model, x, positions = tiny
    budget = 40
    assert IMMEDIATE_EVICTION["recent"] is recent_eviction_prefill
    assert IMMEDIATE_EVICTION["snapkv"] is immediate_eviction_prefill
    online = immediate_eviction(model, x, positions, selector=RecentTokens(), budget=budget, chunk=CHUNK, room=3)
    assert all(h == list(range(S - budget, S)) for layer in kept_sets(online.cache) for seq in layer for h in seq)
    # Never evicting, it is exactly the SnapKV control's code path with a whole-prompt budget.
    noevict = recent_eviction_prefill(model, x, positions, budget=S, chunk=CHUNK)
    same = immediate_eviction_prefill(model, x, positions, selector=SnapKV(window=WINDOW), budget=S, chunk=CHUNK)
    np.testing.assert_array_equal(np.asarray(noevict.hidden), np.asarray(same.hidden))
    # Chunks starting at or before the budget see their whole history; later ones drift.
    drift = np.abs(np.asarray(online.hidden) - np.asarray(noevict.hidden)).max(axis=(0, 2))
    assert drift[:2 * CHUNK].max() == 0.0
    assert drift[2 * CHUNK:].max() > 1e-3
    tokens, logits, _ = greedy(model, online.cache, online.logits, 3)
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="no immediate-eviction control"):
        immediate_eviction(model, x, positions, selector=KeyDiff(), budget=budget, chunk=CHUNK)
    with pytest.raises(TypeError, match="keeps recent tokens"):
        recent_eviction_prefill(model, x, positions, selector=SnapKV(), budget=budget, chunk=CHUNK)
