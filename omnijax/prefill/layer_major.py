"""TideKV: layer-major chunked prefill with delayed, layer-end eviction (TideKV §4–§5).

For each layer in turn, the prompt streams through that layer chunk by chunk against the layer's accumulated
uncompressed KV; only after the last chunk is the layer's KV scored, compressed to its budget and packed, and the
full KV released; the chunk outputs, written back over the chunk inputs, are the hidden-state bridge to the next
layer. So the uncompressed KV of one layer and the activations of one chunk are the only prompt-sized transients
(the bridge is `[B, S, D]`, the prompt's hidden states).

Memory is the point, so it is made true by construction: a host loop over layers runs each layer as two jitted
programs, `layer_forward`, which donates the bridge (updated in place) and returns the layer's full KV, and
`layer_compress`, which returns the layer's packed cache; the full KV is released as soon as it is packed, so one
layer's is alive at a time. The split keeps the forward budget-independent: PyramidKV's per-layer budgets compile
the small compression program once per budget and the forward once. Within the forward, a `fori_loop` over chunks
attends each chunk to the KV written so far: impl "xla" with `attention.attend_contiguous` (blocked dense causal
attention over the contiguous buffers: query blocks of up to 512 rows, key blocks of up to 1,024 slots, only the
blocks a row block can see), "reference" and "pallas" through `omnijax.kv.attention` on a contiguous paged view
(`attend_prefix`).

Without eviction (`budgets=None`) the bridge equals one-shot prefill's hidden states; eviction never changes them,
only what the decode cache keeps.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from omnijax._checks import check_power_of_two
from omnijax.kept_executables import cached_jit
from omnijax.kv import attention as attention_lib
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import (
    Decoder,
    SplitLayers,
    chunk_rotation,
    last_logits,
    layer_finish,
    layer_qkv,
    layer_rows,
)
from omnijax.prefill.cache import CompressedCache, LayerCache, keep_all, pack
from omnijax.prefill.selectors import Selector


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """`cache` for decoding, the prompt's last-token `logits [B, V]` and final `hidden [B, S, D]` states."""

    cache: CompressedCache
    logits: jax.Array
    hidden: jax.Array


def contiguous_view(length: int, batch: int, page: int, start: jax.Array, chunk: int, written: jax.Array
                    ) -> attention_lib.CacheView:
    """A paged `CacheView` over contiguous per-sequence buffers `[B, length]` cut into pages of `page` slots.

    Slots `< written` are live; a query at absolute index i sees slots j <= i (write order = index). The view comes
    indexed (`attention.index_pages`), so the layers that attend through it share one page index.
    """
    pages = length // page
    table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    slot = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)).reshape(batch * pages, page)
    q_order = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
    return attention_lib.index_pages(attention_lib.CacheView(
        write_slots=jnp.zeros((batch, chunk), jnp.int32), page_table=table, slot_valid=slot < written, slot_order=slot,
        q_order=q_order))


def prefix_view(impl: str, length: int, batch: int, page: int, start: jax.Array, chunk: int
                ) -> attention_lib.CacheView | None:
    """What `attend_prefix` needs for a chunk at `start`: a `contiguous_view` for the paged implementations
    ("reference", "pallas"), None for "xla" (it reads the buffers directly). Build it once per chunk, for all layers."""
    return None if impl == "xla" else contiguous_view(length, batch, page, start, chunk, start + chunk)


def attend_prefix(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, start: jax.Array,
                  view: attention_lib.CacheView | None, impl: str) -> jax.Array:
    """A chunk's queries `[B, C, H, d]` (absolute indices start..) attending causally to contiguous buffers
    `[B, S, G, d]`: blocked dense attention (`attention.attend_contiguous`) under "xla", else `impl` over the
    buffers cut into the pages of `view` (`prefix_view`)."""
    if view is None:
        return attention_lib.attend_contiguous(q, k_buf, v_buf, start)
    G, d, page = k_buf.shape[2], k_buf.shape[3], view.slot_valid.shape[1]
    return attention_lib.attend(q, k_buf.reshape(-1, page, G, d), v_buf.reshape(-1, page, G, d), view, impl=impl)


def window_rows(q_obs: jax.Array, q: jax.Array, start: jax.Array, prompt_len: int) -> jax.Array:
    """Copies the rows of chunk queries `q [B, C, H, d]` (absolute indices start..) that fall in the observation
    window (the prompt's last W indices) into `q_obs [B, W, H, d]`."""
    W = q_obs.shape[1]
    C = q.shape[1]
    target = start + jnp.arange(C) - (prompt_len - W)
    target = jnp.where((target >= 0) & (target < W), target, W)
    return q_obs.at[:, target].set(q, mode="drop")


def padded_length(prompt_len: int, chunk: int, page: int) -> int:
    """The buffer length: the prompt rounded up to whole chunks and whole pages."""
    step = math.lcm(chunk, page)
    return -(-prompt_len // step) * step


@cached_jit(static_argnames=("config", "prompt_len", "chunk", "page", "impl", "window"), donate_argnames="bridge")
def layer_forward(p: dict, bridge: jax.Array, positions: jax.Array, *, config: DecoderConfig, prompt_len: int,
                  chunk: int, page: int, impl: str, window: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One layer over the whole prompt, chunk by chunk: the budget-independent half of a layer step.

    Compiled once per shape, whatever the layer's budget: PyramidKV's per-layer budgets recompile only
    `layer_compress`.

    Args:
        p: the layer's parameters.
        bridge: `[B, Spad, D]` the layer's input hidden states (donated; returned holding its outputs).
        positions: `[A, B, Spad]` absolute positions.
        prompt_len: S, the real prompt length (rows beyond it are padding, never visible to real tokens).
        window: observation-window rows to capture for the selector (0 when it needs none).

    Returns:
        `(bridge, keys [B, Spad, G, d], values [B, Spad, G, d], q_obs [B, max(window, 1), H, d])`: the layer's
        full KV and its observation-window queries, for `layer_compress`.
    """
    c = config
    B, Spad, _ = bridge.shape
    G, d, H = c.num_kv_heads, c.head_dim, c.num_heads
    k_buf = jnp.zeros((B, Spad, G, d), c.jnp_dtype)  # the layer's full KV: released once it is compressed
    v_buf = jnp.zeros((B, Spad, G, d), c.jnp_dtype)
    q_obs = jnp.zeros((B, max(window, 1), H, d), c.jnp_dtype)

    def run_chunk(i, carry):
        bridge, k_buf, v_buf, q_obs = carry
        start = i * chunk
        h = jax.lax.dynamic_slice_in_dim(bridge, start, chunk, axis=1)
        pos = jax.lax.dynamic_slice_in_dim(positions, start, chunk, axis=2)
        rot = chunk_rotation(c, pos)
        q, k, v = layer_qkv(c, p, h, rot)
        k_buf = jax.lax.dynamic_update_slice_in_dim(k_buf, k, start, axis=1)
        v_buf = jax.lax.dynamic_update_slice_in_dim(v_buf, v, start, axis=1)
        attn = attend_prefix(q, k_buf, v_buf, start, prefix_view(impl, Spad, B, page, start, chunk), impl)
        if window:
            q_obs = window_rows(q_obs, q, start, prompt_len)
        bridge = jax.lax.dynamic_update_slice_in_dim(bridge, layer_finish(c, p, h, attn), start, axis=1)
        return bridge, k_buf, v_buf, q_obs

    return jax.lax.fori_loop(0, -(-prompt_len // chunk), run_chunk, (bridge, k_buf, v_buf, q_obs))


@cached_jit(static_argnames=("prompt_len", "selector", "budget", "window", "room"))
def layer_compress(k_buf: jax.Array, v_buf: jax.Array, q_obs: jax.Array, *, prompt_len: int,
                   selector: Selector | None, budget: int | None, window: int, room: int) -> LayerCache:
    """Layer-end compression, the budget-dependent half of a layer step: `selector` picks `budget` prompt tokens
    per KV head from `layer_forward`'s full KV, packed with `room` decode slots per head.

    Args:
        k_buf, v_buf: `[B, Spad, G, d]` the layer's full keys and values (rows from `prompt_len` on are padding).
        q_obs: `[B, W, H, d]` the observation window's queries (read only when `window` > 0).
        budget: tokens kept per KV head; None keeps every token.
    """
    B, G = k_buf.shape[0], k_buf.shape[2]
    keys, values = k_buf[:, :prompt_len], v_buf[:, :prompt_len]
    if budget is None:
        selection = keep_all(B, prompt_len, G)
    else:
        selection = selector.select(q_obs if window else None, keys, budget)
    return pack(keys, values, selection, room=room)


def run_layer(p: dict, bridge: jax.Array, positions: jax.Array, *, config: DecoderConfig, prompt_len: int,
              chunk: int, page: int, impl: str, selector: Selector | None, budget: int | None, window: int,
              room: int) -> tuple[jax.Array, LayerCache]:
    """One layer step as `tidekv_prefill` runs it: `layer_forward` (donates `bridge`), then `layer_compress` (the
    layer's full KV is dropped as soon as it is packed).

    Args:
        p: the layer's parameters.
        bridge: `[B, Spad, D]` the layer's input hidden states (donated; returned holding its outputs).
        positions: `[A, B, Spad]` absolute positions.
        prompt_len: S, the real prompt length (rows beyond it are padding, never visible to real tokens).
        budget: tokens kept per KV head; None keeps every token.
        window: observation-window rows to capture for the selector (0 when it needs none).
        room: decode capacity per head in the packed cache.

    Returns:
        `(bridge, layer_cache)`.
    """
    bridge, k_buf, v_buf, q_obs = layer_forward(p, bridge, positions, config=config, prompt_len=prompt_len,
                                                chunk=chunk, page=page, impl=impl, window=window)
    return bridge, layer_compress(k_buf, v_buf, q_obs, prompt_len=prompt_len, selector=selector, budget=budget,
                                  window=window, room=room)


# `run_layer` as one program (the same arithmetic), for ahead-of-time analysis of a whole layer step (compiled
# memory, profiles). Its budget is static, so each budget compiles the forward again: `tidekv_prefill` runs the two.
layer_step = cached_jit(run_layer, static_argnames=("config", "prompt_len", "chunk", "page", "impl", "selector",
                                                   "budget", "window", "room"), donate_argnames="bridge")


@cached_jit
def _slice_rows(stacked: dict, rows: dict) -> dict:
    return {name: value[rows[name]] for name, value in stacked.items()}


def layer_params(model: Decoder, layer: int) -> dict:
    """One layer's parameters sliced out of the stacked arrays (one jitted call: slicing a dozen arrays one eager
    op at a time cost more than a short prompt's whole layer step; the rows are traced, so one compile per MLP
    kind serves every layer). Split layers (`Decoder.split_layers`) are the layer's own arrays, no copy."""
    if isinstance(model.layers, SplitLayers):
        return model.layers.rows[layer].params()
    stacked = model.layers.stacked()
    rows = layer_rows(model.config, stacked, layer)
    return _slice_rows({k: stacked[k] for k in rows}, {k: jnp.int32(r) for k, r in rows.items()})


def check_budgets(budgets: int | Sequence[int] | None, num_layers: int) -> tuple[int, ...] | None:
    if budgets is None:
        return None
    budgets = (budgets,) * num_layers if isinstance(budgets, int) else tuple(int(b) for b in budgets)
    if len(budgets) != num_layers or min(budgets) < 1:
        raise ValueError(f"need one positive budget per layer ({num_layers}), got {budgets}")
    return budgets


def tidekv_prefill(model: Decoder, x: jax.Array, positions: jax.Array, *, selector: Selector | None = None,
                   budgets: int | Sequence[int] | None = None, chunk: int = 2048, page: int = 512, impl: str = "xla",
                   room: int = 0, next_pos: jax.Array | None = None, progress: bool = False,
                   deepstack: jax.Array | None = None) -> PrefillResult:
    """Layer-major delayed-eviction prefill of a prompt's embeddings.

    Args:
        model: the decoder (for Qwen2.5-Omni, `model.decoder` with `x` from the thinker's multimodal embeddings).
        x: `[B, S, D]` prompt embeddings.
        positions: `[A, B, S]` absolute positions (A = 1 drives every mrope axis).
        selector: compression selector (`omnijax.prefill.selectors`); required with `budgets`.
        budgets: tokens kept per KV head, one int for every layer or one per layer (`uniform_budgets`,
            `pyramid_budgets`); None keeps everything (layer-major prefill without eviction).
        chunk: prompt chunk length C (at most the prompt rounded up to whole pages).
        page: page length of the contiguous attention view (a power of two).
        impl: attention implementation for the chunks.
        room: decode capacity per head in the returned cache.
        next_pos: `[B]` the position decoding continues from (default: max prompt position + 1).
        progress: print one line per layer to stderr.
        deepstack: optional `[n, B, S, D]` DeepStack levels (Qwen3-Omni; zero away from visual tokens), level i
            added to the hidden states after layer i, inside the layer-major loop.
    """
    c = model.config
    B, S, D = x.shape
    budgets = check_budgets(budgets, c.num_layers)
    if budgets is not None and selector is None:
        raise ValueError("budgets need a selector")
    if selector is not None and not callable(getattr(selector, "select", None)):
        raise TypeError(f"selector must be a selector object such as omnijax.prefill.SnapKV(), got {selector!r}")
    if not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    check_power_of_two("page", page)
    window = getattr(selector, "window", 0) if budgets is not None and selector.needs_window else 0
    if window > S:
        raise ValueError(f"observation window {window} longer than the prompt ({S})")
    chunk = min(chunk, -(-S // page) * page)  # a short prompt is not padded to a whole long chunk
    Spad = padded_length(S, chunk, page)
    positions = jnp.asarray(positions)
    positions = positions.astype(jnp.float32 if jnp.issubdtype(positions.dtype, jnp.floating) else jnp.int32)
    if next_pos is None:
        top = jnp.max(positions, axis=(0, 2))
        if jnp.issubdtype(top.dtype, jnp.floating) and bool(jnp.any(top != jnp.floor(top))):  # no sync for ints
            raise ValueError("the prompt's last position is fractional (a Qwen3-Omni video at a fractional second "
                             "per grid): pass next_pos, the whole position decoding continues from")
        next_pos = top.astype(jnp.int32) + 1
    pad = Spad - S
    positions = jnp.pad(positions, ((0, 0), (0, 0), (0, pad)), mode="edge")
    bridge = jnp.pad(jnp.asarray(x, c.jnp_dtype), ((0, 0), (0, pad), (0, 0)))
    if deepstack is not None:
        if deepstack.shape[1:] != (B, S, D):
            raise ValueError(f"deepstack must be [levels, B, S, D] with (B, S, D) = {(B, S, D)}, got "
                             f"{deepstack.shape}")
        deepstack = jnp.pad(jnp.asarray(deepstack, c.jnp_dtype), ((0, 0), (0, 0), (0, pad), (0, 0)))
    layers = []
    for layer in range(c.num_layers):
        start = time.perf_counter()
        bridge, cache = run_layer(layer_params(model, layer), bridge, positions, config=c, prompt_len=S,
                                  chunk=chunk, page=page, impl=impl, selector=selector,
                                  budget=None if budgets is None else budgets[layer], window=window, room=room)
        layers.append(cache)
        if deepstack is not None and layer < deepstack.shape[0]:
            bridge = bridge + deepstack[layer]
        if progress:
            jax.block_until_ready(bridge)
            print(f"  layer {layer + 1}/{c.num_layers}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    hidden = bridge[:, :S]
    cache = CompressedCache.create(layers=tuple(layers), next_pos=next_pos.astype(jnp.int32),
                            next_index=jnp.full((B,), S, jnp.int32))
    return PrefillResult(cache=cache, logits=last_logits(model, hidden[:, -1]), hidden=hidden)
