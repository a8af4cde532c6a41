"""Prefill baselines on the same code path as TideKV (TideKV §6): token-major prefill, chunked or one-shot.

`token_major_prefill` runs each chunk through every layer before the next chunk (the usual order), keeping every
layer's full KV until the whole prompt is in:
    chunk = prompt length, with a selector   one-shot prefill, then post-prefill selection (SnapKV as usually run)
    chunk < prompt length, no budgets        chunked prefill without eviction
`immediate_eviction_prefill` compresses every layer's KV to its budget after each chunk (online eviction), so later
chunks see only what earlier selections kept; its hidden states drift from the uncompressed ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from omnijax.kept_executables import cached_jit
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder, chunk_rotation, last_logits, layer_finish, layer_qkv, layer_scan_inputs
from omnijax.prefill.cache import CompressedCache, from_heads, keep_all, pack
from omnijax.prefill.layer_major import (
    PrefillResult,
    attend_prefix,
    check_budgets,
    padded_length,
    prefix_view,
    window_rows,
)
from omnijax.prefill.selectors import RecentTokens, Selector, topk_scores


@cached_jit(static_argnames=("config", "prompt_len", "chunk", "page", "impl", "window"))
def token_major(params: dict, x: jax.Array, positions: jax.Array, *, config: DecoderConfig, prompt_len: int,
                 chunk: int, page: int, impl: str, window: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """All chunks through all layers. Returns `(hidden [B, Spad, D], keys, values [L, B, Spad, G, d],
    q_obs [L, B, W, H, d])`."""
    c = config
    B, Spad, _ = x.shape
    L, G, d, H = c.num_layers, c.num_kv_heads, c.head_dim, c.num_heads
    k_all = jnp.zeros((L, B, Spad, G, d), c.jnp_dtype)  # every layer's full KV, all alive at once
    v_all = jnp.zeros((L, B, Spad, G, d), c.jnp_dtype)
    q_all = jnp.zeros((L, B, max(window, 1), H, d), c.jnp_dtype)
    layer_xs, ffn_of = layer_scan_inputs(c, params)

    def run_chunk(i, carry):
        hidden, k_all, v_all, q_all = carry
        start = i * chunk
        h = jax.lax.dynamic_slice_in_dim(hidden, start, chunk, axis=1)
        pos = jax.lax.dynamic_slice_in_dim(positions, start, chunk, axis=2)
        rot = chunk_rotation(c, pos)
        view = prefix_view(impl, Spad, B, page, start, chunk)  # once for all layers

        def layer(h, xs):
            p, k_buf, v_buf, q_obs = xs
            q, k, v = layer_qkv(c, p, h, rot)
            k_buf = jax.lax.dynamic_update_slice_in_dim(k_buf, k, start, axis=1)
            v_buf = jax.lax.dynamic_update_slice_in_dim(v_buf, v, start, axis=1)
            attn = attend_prefix(q, k_buf, v_buf, start, view, impl)  # as TideKV's layer step
            if window:
                q_obs = window_rows(q_obs, q, start, prompt_len)
            return layer_finish(c, p, h, attn, ffn_of(p)), (k_buf, v_buf, q_obs)

        h, (k_all, v_all, q_all) = jax.lax.scan(layer, h, (layer_xs, k_all, v_all, q_all))
        hidden = jax.lax.dynamic_update_slice_in_dim(hidden, h, start, axis=1)
        return hidden, k_all, v_all, q_all

    return jax.lax.fori_loop(0, -(-prompt_len // chunk), run_chunk, (x, k_all, v_all, q_all))


def _pad(model: Decoder, x, positions, chunk, page):
    B, S, _ = x.shape
    Spad = padded_length(S, chunk, page)
    positions = jnp.pad(jnp.asarray(positions, jnp.int32), ((0, 0), (0, 0), (0, Spad - S)), mode="edge")
    return jnp.pad(jnp.asarray(x, model.config.jnp_dtype), ((0, 0), (0, Spad - S), (0, 0))), positions


def token_major_prefill(model: Decoder, x: jax.Array, positions: jax.Array, *, chunk: int | None = None,
                        selector: Selector | None = None, budgets: int | Sequence[int] | None = None, page: int = 512,
                        impl: str = "xla",
                        room: int = 0, next_pos: jax.Array | None = None) -> PrefillResult:
    """Token-major prefill (`chunk=None`: one shot), then post-prefill selection of every layer if `budgets`."""
    c = model.config
    B, S, _ = x.shape
    chunk = S if chunk is None else chunk
    budgets = check_budgets(budgets, c.num_layers)
    window = selector.window if budgets is not None and selector.needs_window else 0
    xp, positions_p = _pad(model, x, positions, chunk, page)
    hidden, k_all, v_all, q_all = token_major(model.layers.stacked(), xp, positions_p, config=c, prompt_len=S,
                                               chunk=chunk, page=page, impl=impl, window=window)
    layers = []
    for layer in range(c.num_layers):
        keys, values = k_all[layer, :, :S], v_all[layer, :, :S]
        if budgets is None:
            selection = keep_all(B, S, c.num_kv_heads)
        else:
            selection = selector.select(q_all[layer] if window else None, keys, budgets[layer])
        layers.append(pack(keys, values, selection, room=room))
    hidden = hidden[:, :S]
    next_pos = jnp.max(jnp.asarray(positions), axis=(0, 2)) + 1 if next_pos is None else next_pos
    cache = CompressedCache.create(layers=tuple(layers), next_pos=next_pos.astype(jnp.int32),
                            next_index=jnp.full((B,), S, jnp.int32))
    return PrefillResult(cache=cache, logits=last_logits(model, hidden[:, -1]), hidden=hidden)


@cached_jit(static_argnames=("config", "budget", "window", "selector"))
def _immediate_chunk(params: dict, h: jax.Array, positions: jax.Array, start: jax.Array, cache_k: jax.Array,
                     cache_v: jax.Array, cache_index: jax.Array, *, config: DecoderConfig, budget: int, window: int,
                     selector: Selector):
    """One chunk through every layer against per-head compressed caches `[L, B, G, n, d]`, then each layer's
    cache (old entries + the chunk) is cut back to `budget` entries per head: by the selector's SnapKV scores, or to
    the most recent entries for `RecentTokens` (Table 8's two immediate-eviction controls differ only there)."""
    c = config
    B, C, _ = h.shape
    G, d, H = c.num_kv_heads, c.head_dim, c.num_heads
    R = H // G
    rot = chunk_rotation(c, positions)
    q_index = start + jnp.arange(C, dtype=jnp.int32)
    layer_xs, ffn_of = layer_scan_inputs(c, params)

    def layer(h, xs):
        p, old_k, old_v, old_index = xs
        q, k, v = layer_qkv(c, p, h, rot)
        keys = jnp.concatenate([old_k, k.transpose(0, 2, 1, 3)], axis=2)  # [B, G, n + C, d]
        values = jnp.concatenate([old_v, v.transpose(0, 2, 1, 3)], axis=2)
        index = jnp.concatenate([old_index, jnp.broadcast_to(q_index, (B, G, C))], axis=2)
        s = jnp.einsum("bcgrd,bgtd->bgrct", q.reshape(B, C, G, R, d), keys,
                       preferred_element_type=jnp.float32) * d ** -0.5
        visible = (index[:, :, None, None, :] <= q_index[None, None, None, :, None]) & (index >= 0)[:, :, None, None]
        probs = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1).astype(q.dtype)
        # float32 product: XLA:CPU has no bf16 x bf16 -> f32 dot for this batched layout.
        attn = jnp.einsum("bgrct,bgtd->bcgrd", probs.astype(jnp.float32), values.astype(jnp.float32))
        h = layer_finish(c, p, h, attn.reshape(B, C, H, d).astype(q.dtype), ffn_of(p))
        n = keys.shape[2]
        if n > budget and isinstance(selector, RecentTokens):  # static: keep the last `budget` entries
            keys, values, index = keys[:, :, n - budget:], values[:, :, n - budget:], index[:, :, n - budget:]
        elif n > budget:  # static: evict now, scoring the chunk's last `window` queries against every held entry
            prefix, _ = topk_scores(q[:, C - window:], keys.transpose(0, 2, 1, 3), budget - window,
                                    impl=selector.impl, block_size=selector.block_size,
                                    pool_kernel=selector.pool_kernel)  # [B, G, budget - W] entry positions
            keep = jnp.concatenate([prefix, jnp.broadcast_to(jnp.arange(n - window, n), (B, G, window))], axis=2)
            take = lambda x: jnp.take_along_axis(x, keep.reshape(keep.shape + (1,) * (x.ndim - 3)), axis=2)  # noqa
            keys, values, index = take(keys), take(values), take(index)
        return h, (keys, values, index)

    return jax.lax.scan(layer, h, (layer_xs, cache_k, cache_v, cache_index))


def immediate_eviction_prefill(model: Decoder, x: jax.Array, positions: jax.Array, *, selector: Selector,
                               budget: int, chunk: int, room: int = 0, next_pos: jax.Array | None = None
                               ) -> PrefillResult:
    """Chunked token-major prefill that evicts every layer to `budget` tokens per head after each chunk.

    Each chunk attends only to what earlier evictions kept (plus itself), so its hidden states differ from
    uncompressed prefill: the drift layer-major delayed eviction avoids. Scoring uses the SnapKV rule with the
    chunk's last `selector.window` queries (`chunk` must be at least the window); a `RecentTokens` selector keeps the
    most recent tokens instead (Table 8's recent-token control). One uniform budget for all layers.
    """
    c = model.config
    B, S, _ = x.shape
    window = getattr(selector, "window", 0)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (budget, chunk)):
        raise ValueError(f"need a positive int budget and chunk, got budget {budget!r}, chunk {chunk!r}")
    if not isinstance(selector, RecentTokens) and (chunk < window or budget <= window):
        raise ValueError(f"need chunk >= window and budget > window, got chunk {chunk}, budget {budget}, "
                         f"window {window}")
    L, G, d = c.num_layers, c.num_kv_heads, c.head_dim
    dt = c.jnp_dtype
    cache_k = jnp.zeros((L, B, G, 0, d), dt)
    cache_v = jnp.zeros((L, B, G, 0, d), dt)
    cache_index = jnp.zeros((L, B, G, 0), jnp.int32)
    x = jnp.asarray(x, dt)
    positions = jnp.asarray(positions, jnp.int32)
    params = model.layers.stacked()
    outputs = []
    for start in range(0, S, chunk):
        stop = min(start + chunk, S)
        h, (cache_k, cache_v, cache_index) = _immediate_chunk(
            params, x[:, start:stop], positions[:, :, start:stop], jnp.asarray(start, jnp.int32), cache_k, cache_v,
            cache_index, config=c, budget=budget, window=min(window, stop - start), selector=selector)
        outputs.append(h)
    hidden = jnp.concatenate(outputs, axis=1)
    layers = tuple(from_heads(cache_k[i], cache_v[i], cache_index[i], room=room) for i in range(L))
    next_pos = jnp.max(positions, axis=(0, 2)) + 1 if next_pos is None else next_pos
    cache = CompressedCache.create(layers=layers, next_pos=next_pos.astype(jnp.int32),
                            next_index=jnp.full((B,), S, jnp.int32))
    return PrefillResult(cache=cache, logits=last_logits(model, hidden[:, -1]), hidden=hidden)
