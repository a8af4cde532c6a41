"""The compressed initial decode cache prefill compression builds, and greedy or teacher-forced decoding on it.

Each layer keeps, per KV head, its own set of prompt tokens (SnapKV selects per head; AdaKV even gives heads
different budgets), so a layer's cache is one flattened row per sequence with a segment per KV head:

    k, v     [B, T, d]      T = sum over heads of (selected tokens + decode room); real memory, no masking
    index    [B, T] int32   prompt index (decoding: absolute write index) of each entry, -1 = empty
    offset   [B, G + 1]     segment g of sequence b is [offset[b, g], offset[b, g + 1])
    length   [B, G]         filled entries of each segment

A segment's free entries are its decode room. A decode step whose token finds some segment full cannot keep that
token's key and value there: the cache records it (`exhausted`, `dropped`, as `PagedKV` does) and never overwrites.
`greedy` and `force` know their steps and refuse up front a cache without room for them; `with_room` grows it.

Layers may differ in T (PyramidKV budgets), so the cache is a tuple of `LayerCache`, one per layer, and decoding
loops over layers in Python (unrolled under jit). Keys are stored after RoPE at their true absolute positions, and
decoding continues from the prompt's true next position, never from the shortened cache length.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.decoding import DecodingStrategy, Greedy, check_decoding, sampling_keys, seed_of, split_keys
from omnijax.kept_executables import cached_jit
from omnijax.models.config import DecoderConfig
from omnijax.models.decoder import Decoder, chunk_rotation, layer_finish, layer_qkv, layer_slice


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """Which prompt tokens a layer keeps: `index [B, K]` in per-KV-head segments `offset [B, G + 1]`.

    Within a segment the indices are ascending. Usually `K = offset[:, -1]` for every sequence; a selector whose kept
    count depends on the data (ChunkKV keeping a short last chunk, as kvpress does) leaves slots past
    `offset[:, -1]` with index -1: they belong to no head, and packing and decoding ignore them.
    """

    index: jax.Array
    offset: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    k: jax.Array
    v: jax.Array
    index: jax.Array
    offset: jax.Array
    length: jax.Array

    @property
    def num_kv_heads(self) -> int:
        return self.length.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedCache:
    """Per-layer caches, the next absolute position `next_pos [B]` and the next write index `next_index [B]`.

    `exhausted [B] bool` (sticky) says a decoded token's key and value found a full segment in some layer and head,
    and `dropped [B] int32` counts such tokens: the cache no longer holds every decoded token.
    """

    layers: tuple[LayerCache, ...]
    next_pos: jax.Array
    next_index: jax.Array
    exhausted: jax.Array
    dropped: jax.Array

    @classmethod
    def create(cls, layers: Iterable[LayerCache], next_pos: jax.Array, next_index: jax.Array) -> "CompressedCache":
        """A cache that has dropped nothing yet."""
        B = next_pos.shape[0]
        return cls(layers=tuple(layers), next_pos=next_pos, next_index=next_index,
                   exhausted=jnp.zeros((B,), bool), dropped=jnp.zeros((B,), jnp.int32))

    def room(self) -> jax.Array:
        """`[B]` int32: decode steps every segment (all layers, all heads) can still keep."""
        return functools.reduce(jnp.minimum, (jnp.min(layer.offset[:, 1:] - layer.offset[:, :-1] - layer.length,
                                                      axis=1) for layer in self.layers))

    def cells(self) -> jax.Array:
        """`[B]` int32: filled entries over all layers and heads."""
        return sum(jnp.sum(layer.length, axis=1) for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes held by keys and values (allocated, filled or not)."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)


def segment_owner(offset: jax.Array, size: int) -> jax.Array:
    """`[B, size]` int32: the KV head whose segment holds each flattened entry."""
    t = jnp.arange(size)
    # Segments ending at or before t, counted directly (G is small; a binary search would be a loop).
    return jnp.sum(offset[:, None, 1:] <= t[None, :, None], axis=-1).astype(jnp.int32)


def pack(keys: jax.Array, values: jax.Array, selection: Selection, *, room: int = 0) -> LayerCache:
    """Gathers one layer's selected entries into a `LayerCache`, leaving `room` empty entries per head for decoding.

    Args:
        keys, values: `[B, S, G, d]` the layer's full prompt keys (post-RoPE) and values.
        selection: the kept prompt indices per head.
        room: decode capacity appended to every head's segment.
    """
    B, S, G, d = keys.shape
    K = selection.index.shape[1]
    owner = segment_owner(selection.offset, K)  # [B, K]
    rows = jnp.arange(B)[:, None]
    k_sel = keys[rows, selection.index, owner]  # [B, K, d]
    v_sel = values[rows, selection.index, owner]
    counts = selection.offset[:, 1:] - selection.offset[:, :-1]  # [B, G]
    offset = selection.offset + room * jnp.arange(G + 1)[None, :]
    dest = jnp.arange(K)[None, :] + room * owner  # entry k of head g shifts by g * room
    T = K + G * room
    put = lambda x, fill: jnp.full((B, T) + x.shape[2:], fill, x.dtype).at[rows, dest].set(x)  # noqa: E731
    return LayerCache(k=put(k_sel, 0), v=put(v_sel, 0), index=put(selection.index.astype(jnp.int32), -1),
                      offset=offset.astype(jnp.int32), length=counts.astype(jnp.int32))


def from_heads(keys: jax.Array, values: jax.Array, index: jax.Array, *, room: int = 0) -> LayerCache:
    """A `LayerCache` from per-head rectangular entries `keys, values [B, G, n, d]`, `index [B, G, n]`."""
    B, G, n, d = keys.shape
    pad = ((0, 0), (0, 0), (0, room))
    k = jnp.pad(keys, pad + ((0, 0),)).reshape(B, G * (n + room), d)
    v = jnp.pad(values, pad + ((0, 0),)).reshape(B, G * (n + room), d)
    index = jnp.pad(index.astype(jnp.int32), pad, constant_values=-1).reshape(B, G * (n + room))
    offset = jnp.broadcast_to(jnp.arange(G + 1, dtype=jnp.int32) * (n + room), (B, G + 1))
    return LayerCache(k=k, v=v, index=index, offset=offset, length=jnp.full((B, G), n, jnp.int32))


def keep_all(batch: int, length: int, num_kv_heads: int) -> Selection:
    """Every prompt token in every head (no compression)."""
    index = jnp.tile(jnp.arange(length, dtype=jnp.int32), num_kv_heads)
    index = jnp.broadcast_to(index, (batch, num_kv_heads * length))
    offset = jnp.broadcast_to(jnp.arange(num_kv_heads + 1, dtype=jnp.int32) * length, (batch, num_kv_heads + 1))
    return Selection(index=index, offset=offset)


def attend_segments(q: jax.Array, layer: LayerCache) -> jax.Array:
    """One decode query per sequence `q [B, H, d]` against each head's filled segment. Returns `[B, H, d]`."""
    B, H, d = q.shape
    G = layer.num_kv_heads
    T = layer.k.shape[1]
    owner = segment_owner(layer.offset, T)  # [B, T]
    filled = jnp.arange(T)[None, :] - jnp.take_along_axis(layer.offset, owner, axis=1) < jnp.take_along_axis(
        layer.length, owner, axis=1)
    head_of_q = jnp.arange(H) // (H // G)  # [H]
    visible = filled[:, None, :] & (owner[:, None, :] == head_of_q[None, :, None])  # [B, H, T]
    s = jnp.einsum("bhd,btd->bht", q, layer.k, preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(visible, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(visible, p, 0.0).astype(q.dtype)
    return jnp.einsum("bht,btd->bhd", p, layer.v, preferred_element_type=jnp.float32).astype(q.dtype)


def check_cache(config: DecoderConfig, cache: CompressedCache) -> None:
    """Refuses a compressed cache made for another model (layer count, kv heads, head dim): decoding would run only
    the cache's layers, silently."""
    layers = cache.layers
    got = (len(layers), {layer.num_kv_heads for layer in layers}, {layer.k.shape[-1] for layer in layers})
    want = (config.num_layers, {config.num_kv_heads}, {config.head_dim})
    if got != want:
        raise ValueError(f"the cache was not made for this model: {got[0]} layers, kv heads {sorted(got[1])}, head dim "
                         f"{sorted(got[2])}; the model has {config.num_layers} layers, {config.num_kv_heads} kv heads, "
                         f"head dim {config.head_dim}")


def _grow_layer(layer: LayerCache, extra: int) -> LayerCache:
    """Every segment of `layer` gets `extra` more empty entries at its end (entries keep their order)."""
    B, T, d = layer.k.shape
    G = layer.num_kv_heads
    owner = segment_owner(layer.offset, T)
    dest = jnp.arange(T)[None, :] + extra * owner  # entry t of head g shifts by g * extra: always < T + G * extra
    rows = jnp.arange(B)[:, None]
    size = T + G * extra
    put = lambda x, fill: jnp.full((B, size) + x.shape[2:], fill, x.dtype).at[rows, dest].set(  # noqa: E731
        x, mode="promise_in_bounds")
    return LayerCache(k=put(layer.k, 0), v=put(layer.v, 0), index=put(layer.index, -1),
                      offset=(layer.offset + extra * jnp.arange(G + 1)[None, :]).astype(jnp.int32),
                      length=layer.length)


@cached_jit(static_argnames=("extra",))
def _grow(cache: CompressedCache, *, extra: int) -> CompressedCache:
    return dataclasses.replace(cache, layers=tuple(_grow_layer(layer, extra) for layer in cache.layers))


def _traced(cache: CompressedCache) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(cache))


def with_room(cache: CompressedCache, room: int) -> CompressedCache:
    """`cache` with at least `room` free entries in every segment of every layer: segments short of it grow (new
    arrays, a new compiled shape; `cache` is left intact), the kept entries unchanged. Reads the fill levels on the
    host, so call it outside `jit`."""
    if not isinstance(room, (int, np.integer)) or room < 0:
        raise ValueError(f"room must be an int >= 0, got {room!r}")
    if _traced(cache):
        raise TypeError("with_room reads the cache's fill levels on the host: call it outside jit")
    extra = int(room) - int(np.min(np.asarray(cache.room())))
    return _grow(cache, extra=extra) if extra > 0 else cache


def check_room(cache: CompressedCache, steps: int, *, caller: str = "decoding") -> None:
    """Refuses, before any work, `steps` decode steps that a segment of `cache` could not keep, and a cache that
    has already dropped decoded tokens (see `CompressedCache.exhausted`). Reads the cache on the host; under an
    outer `jit` (a traced cache) it checks nothing, and exhaustion is only recorded in the returned cache."""
    if _traced(cache):
        return
    dropped = np.asarray(cache.dropped)
    if dropped.any():
        raise ValueError(f"{caller}: the cache already dropped the keys and values of {dropped.tolist()} decoded "
                         f"tokens (per sequence) for lack of room; decoding on would attend without them. Prefill "
                         f"with a larger room, or grow the cache with omnijax.prefill.with_room before it fills")
    room = int(np.min(np.asarray(cache.room())))
    if steps > room:
        raise ValueError(f"{caller}: {steps} decode steps need {steps} free entries in every KV head's segment, the "
                         f"cache has {room}: prefill with room >= {steps} (plus any steps already decoded from it), "
                         f"or grow it with omnijax.prefill.with_room(cache, {steps})")


def decode_step(model: Decoder, cache: CompressedCache, token: jax.Array) -> tuple[jax.Array, CompressedCache]:
    """Feeds one token `[B]` at the cache's next position; returns `(logits [B, V] float32, cache)`.

    The token's key and value are appended to every head's segment of every layer. A full segment keeps nothing
    (no wrap, no overwrite) and the step records it in the returned cache (`exhausted`, `dropped`); size the room
    with `prefill(..., room=N)` or `with_room`. Text positions move all position axes together.
    """
    c = model.config
    check_cache(c, cache)
    B = token.shape[0]
    h = model.embed_tokens(token[:, None])
    positions = jnp.broadcast_to(cache.next_pos[None, :, None], (c.position_axes, B, 1))
    rot = chunk_rotation(c, positions)
    stacked = model.layers.stacked()
    layers = []
    lost = jnp.zeros((B,), bool)
    for i, layer in enumerate(cache.layers):
        p = layer_slice(c, stacked, i)
        q, k, v = layer_qkv(c, p, h, rot)  # [B, 1, H, d], [B, 1, G, d]
        G = layer.num_kv_heads
        T = layer.k.shape[1]
        slot = layer.offset[:, :G] + layer.length  # [B, G]
        full = slot >= layer.offset[:, 1:]
        lost = lost | jnp.any(full, axis=1)
        slot = jnp.where(full, T, slot)  # a full segment writes nothing (recorded below)
        rows = jnp.arange(B)[:, None]
        layer = LayerCache(
            k=layer.k.at[rows, slot].set(k[:, 0], mode="drop"), v=layer.v.at[rows, slot].set(v[:, 0], mode="drop"),
            index=layer.index.at[rows, slot].set(jnp.broadcast_to(cache.next_index[:, None], (B, G)), mode="drop"),
            offset=layer.offset, length=jnp.minimum(layer.length + 1, layer.offset[:, 1:] - layer.offset[:, :G]))
        attn = attend_segments(q[:, 0], layer)
        h = layer_finish(c, p, h, attn[:, None])
        layers.append(layer)
    logits = model.logits(h[:, 0])
    return logits, CompressedCache(layers=tuple(layers), next_pos=cache.next_pos + 1,
                                   next_index=cache.next_index + 1, exhausted=cache.exhausted | lost,
                                   dropped=cache.dropped + lost.astype(jnp.int32))


@cached_jit(static_argnames=("graphdef", "steps", "decoding"))
def _decode(graphdef, params, cache: CompressedCache, first_logits: jax.Array, key: jax.Array, *, steps: int,
            decoding):
    model = nnx.merge(graphdef, params)
    B = first_logits.shape[0]

    def step(carry, i):
        logits, cache, key, history = carry
        draw, key = split_keys(key)
        token = decoding.select(logits, history, draw)
        history = history.at[:, i].set(token)
        logits, cache = decode_step(model, cache, token)
        return (logits, cache, key, history), (token, logits)

    init = (first_logits.astype(jnp.float32), cache, key, jnp.full((B, max(steps, 1)), -1, jnp.int32))
    (_, cache, _, _), (tokens, logits) = jax.lax.scan(step, init, jnp.arange(steps))
    return jnp.moveaxis(tokens, 0, 1), jnp.moveaxis(logits, 0, 1), cache


def decode(model: Decoder, cache: CompressedCache, first_logits: jax.Array, steps: int, *,
           decoding: DecodingStrategy | None = None) -> tuple[jax.Array, jax.Array, CompressedCache]:
    """Decoding with a strategy (`omnijax.decoding`; default `Greedy()`): `(tokens [B, steps], logits [B, steps, V],
    cache)`; the first token comes from `first_logits` (the prompt's last logits). Exactly `steps` tokens are decoded
    (stop ids end streamed answers, not these); `Sampling` draws with keys split off its seed, one per sequence, and
    its repetition penalty sees the decoded tokens.

    One compiled program per (model structure, cache shapes, steps, strategy): the steps run as a `lax.scan` of
    `decode_step`, the cache in its carry. `cache` is left intact. A cache without room for `steps` is refused up
    front (see `check_room`, `with_room`).
    """
    return _run_decode(model, cache, first_logits, steps, Greedy() if decoding is None else decoding, "decode")


def _run_decode(model, cache, first_logits, steps: int, decoding, caller: str):
    check_decoding(decoding)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    check_room(cache, int(steps), caller=caller)
    graphdef, params = nnx.split(model)
    keys = sampling_keys(seed_of(decoding), cache.next_pos.shape[0])
    return _decode(graphdef, params, cache, jnp.asarray(first_logits), keys, steps=int(steps), decoding=decoding)


def greedy(model: Decoder, cache: CompressedCache, first_logits: jax.Array, steps: int
           ) -> tuple[jax.Array, jax.Array, CompressedCache]:
    """Greedy decoding, `decode(..., decoding=Greedy())`: `(tokens [B, steps], logits [B, steps, V], cache)`."""
    return _run_decode(model, cache, first_logits, steps, Greedy(), "greedy")


@cached_jit(static_argnames=("graphdef",))
def _force(graphdef, params, cache: CompressedCache, tokens: jax.Array):
    model = nnx.merge(graphdef, params)

    def step(cache, token):
        logits, cache = decode_step(model, cache, token)
        return cache, logits

    cache, logits = jax.lax.scan(step, cache, jnp.moveaxis(tokens, 1, 0))
    return jnp.moveaxis(logits, 0, 1), cache


def force(model: Decoder, cache: CompressedCache, tokens: jax.Array) -> tuple[jax.Array, CompressedCache]:
    """Teacher-forced decoding: feeds `tokens [B, N]` one position at a time; returns `(logits [B, N, V], cache)`,
    `logits[:, i]` being the prediction after `tokens[:, i]`.

    One compiled program per (model structure, cache shapes, N), a `lax.scan` of `decode_step`. `cache` is left
    intact. A cache without room for N steps is refused up front (see `check_room`, `with_room`).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [batch, steps], got {tokens.dtype} {tokens.shape}")
    batch = cache.next_pos.shape[0]
    if tokens.shape[0] != batch:
        raise ValueError(f"tokens hold {tokens.shape[0]} sequences, the cache {batch}")
    check_room(cache, tokens.shape[1], caller="force")
    graphdef, params = nnx.split(model)
    return _force(graphdef, params, cache, tokens.astype(jnp.int32))
