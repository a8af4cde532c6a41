"""The immediate-eviction controls of TideKV's prompt-encoding fidelity study (seed 001 §6.5, Table 8), by selector.

Table 8 sets two immediate-eviction controls beside layer-major delayed eviction: chunked token-major prefill that
cuts every layer's KV back to the budget after each chunk, scoring it with SnapKV ("Block-SnapKV",
`baselines.immediate_eviction_prefill`) or keeping the most recent tokens ("recent-token eviction",
`recent_eviction_prefill` here). Both are in `IMMEDIATE_EVICTION` under their selector's registered name
(`SnapKV.name`, `RecentTokens.name`) with one signature, and `immediate_eviction` picks by the selector it is given.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from omnijax.config import DecoderConfig
from omnijax.models.decoder import Decoder, chunk_rotation, layer_finish, layer_qkv, layer_scan_inputs
from omnijax.prefill.baselines import immediate_eviction_prefill
from omnijax.prefill.cache import CompressedCache, from_heads
from omnijax.prefill.layer_major import PrefillResult
from omnijax.prefill.selectors import RecentTokens, Selector


@functools.partial(jax.jit, static_argnames=("config", "budget"))
def _recent_chunk(params: dict, h: jax.Array, positions: jax.Array, start: jax.Array, cache_k: jax.Array,
                  cache_v: jax.Array, cache_index: jax.Array, *, config: DecoderConfig, budget: int):
    """One chunk through every layer against per-head caches `[L, B, G, n, d]` of the most recent tokens; each
    layer's cache (held entries + the chunk, in index order) is then cut back to its last `budget` entries.

    The attention arithmetic is `baselines._immediate_chunk`'s, so the two controls differ only in what they keep.
    """
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
        attn = jnp.einsum("bgrct,bgtd->bcgrd", probs.astype(jnp.float32), values.astype(jnp.float32))
        h = layer_finish(c, p, h, attn.reshape(B, C, H, d).astype(q.dtype), ffn_of(p))
        n = keys.shape[2]
        if n > budget:  # static: keep the last `budget` entries, the most recent tokens
            keys, values, index = keys[:, :, n - budget:], values[:, :, n - budget:], index[:, :, n - budget:]
        return h, (keys, values, index)

    return jax.lax.scan(layer, h, (layer_xs, cache_k, cache_v, cache_index))


def recent_eviction_prefill(model: Decoder, x: jax.Array, positions: jax.Array, *, budget: int, chunk: int,
                            selector: Selector | None = None, room: int = 0, next_pos: jax.Array | None = None
                            ) -> PrefillResult:
    """Table 8's recent-token immediate-eviction control: chunked token-major prefill that keeps, after each chunk,
    only every layer's last `budget` tokens per KV head.

    A token in the chunk starting at s therefore attends to tokens `max(0, s - budget) ..` itself: chunks starting
    at or before `budget` see their whole history, later ones drift from uncompressed prefill. The final cache holds
    the prompt's last `budget` tokens in every layer and head, what `RecentTokens` keeps at layer end, reached
    without the full history.

    Args:
        model: the decoder.
        x: `[B, S, D]` prompt embeddings.
        positions: `[A, B, S]` absolute positions.
        budget: tokens kept per KV head (one for all layers); `budget >= S` never evicts.
        chunk: prompt chunk length.
        selector: None or a `RecentTokens` (the signature of `IMMEDIATE_EVICTION`'s entries).
        room: decode capacity per head in the returned cache.
        next_pos: `[B]` the position decoding continues from (default: max prompt position + 1).
    """
    if selector is not None and not isinstance(selector, RecentTokens):
        raise TypeError(f"recent_eviction_prefill keeps recent tokens; got selector {selector!r}")
    if not all(isinstance(n, numbers.Integral) and n >= 1 for n in (budget, chunk)):
        raise ValueError(f"need a positive int budget and chunk, got budget {budget!r}, chunk {chunk!r}")
    c = model.config
    B, S, _ = x.shape
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
        h, (cache_k, cache_v, cache_index) = _recent_chunk(
            params, x[:, start:stop], positions[:, :, start:stop], jnp.asarray(start, jnp.int32), cache_k, cache_v,
            cache_index, config=c, budget=int(budget))
        outputs.append(h)
    hidden = jnp.concatenate(outputs, axis=1)
    layers = tuple(from_heads(cache_k[i], cache_v[i], cache_index[i], room=room) for i in range(L))
    next_pos = jnp.max(positions, axis=(0, 2)) + 1 if next_pos is None else next_pos
    cache = CompressedCache.create(layers=layers, next_pos=next_pos.astype(jnp.int32),
                                   next_index=jnp.full((B,), S, jnp.int32))
    return PrefillResult(cache=cache, logits=model.logits(hidden[:, -1]), hidden=hidden)


IMMEDIATE_EVICTION = {"snapkv": immediate_eviction_prefill, "recent": recent_eviction_prefill}


def immediate_eviction(model: Decoder, x: jax.Array, positions: jax.Array, *, selector: Selector, budget: int,
                       chunk: int, room: int = 0, next_pos: jax.Array | None = None) -> PrefillResult:
    """The immediate-eviction control for `selector` (`IMMEDIATE_EVICTION[selector.name]`): SnapKV scoring after
    every chunk for a `SnapKV`, the most recent tokens for a `RecentTokens`.

    Raises:
        ValueError: for a selector with no immediate-eviction control.
    """
    name = getattr(selector, "name", None)
    if name not in IMMEDIATE_EVICTION:
        raise ValueError(f"no immediate-eviction control for selector {selector!r}; available: "
                         f"{sorted(IMMEDIATE_EVICTION)}")
    return IMMEDIATE_EVICTION[name](model, x, positions, selector=selector, budget=budget, chunk=chunk, room=room,
                                    next_pos=next_pos)
