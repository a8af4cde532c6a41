"""Writing tokens through every decoder layer: `write_chunk` (one streamed chunk into a paged cache, what
`omnijax.streaming.chunk_step` runs; `write_chunk_tapped` also returns one layer's hidden states) and `forward` (a
one-shot forward through a temporary cache, what `Model()` runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from omnijax.chunks.spans import SpanKind
from omnijax.compilation_cache import cached_jit
from omnijax.kv import attention as attention_lib
from omnijax.kv import paged as paged_lib
from omnijax.models.decoder import Decoder


def write_chunk(model: Decoder, kv: paged_lib.PagedKV, x: jax.Array, valid: jax.Array, positions: jax.Array,
                meta: paged_lib.SlotMeta, *, impl: str = "xla", track_scores: bool = False,
                placement: str = "first_fit", deepstack: jax.Array | None = None
                ) -> tuple[paged_lib.PagedKV, jax.Array]:
    """Writes a chunk `[B, T]` (embeddings `x [B, T, D]`, absolute `positions [A, B, T]`) through every layer.

    With `track_scores`, the attention mass each slot receives is added to `kv.score` (H2O); `placement` picks the
    free slots new tokens take (`omnijax.kv.paged.PLACEMENTS`; the paging mode decides it); `deepstack [n, B, T, D]`
    (Qwen3-Omni) is added after the first n layers (`Decoder.run_layers`).
    Returns `(kv, hidden [B, T, D])`.
    """
    kv, hidden, _ = write_chunk_tapped(model, kv, x, valid, positions, meta, impl=impl, track_scores=track_scores,
                                       placement=placement, deepstack=deepstack)
    return kv, hidden


def write_chunk_tapped(model: Decoder, kv: paged_lib.PagedKV, x: jax.Array, valid: jax.Array, positions: jax.Array,
                       meta: paged_lib.SlotMeta, *, impl: str = "xla", track_scores: bool = False,
                       placement: str = "first_fit", deepstack: jax.Array | None = None, tap: int | None = None
                       ) -> tuple[paged_lib.PagedKV, jax.Array, jax.Array | None]:
    """`write_chunk`, also returning transformers' `hidden_states[tap]` of the chunk's tokens `[B, T, D]` when the
    static `tap` asks (`Decoder.run_layers_tapped`; None: no tap, the same program as `write_chunk`).
    Returns `(kv, hidden [B, T, D], tapped or None)`."""
    kv, slots, q_order = paged_lib.reserve(kv, valid, meta, placement=placement)
    view = attention_lib.CacheView.of(kv, slots, q_order)
    hidden, k, v, mass, tapped = model.run_layers_tapped(x, positions, view, kv.k, kv.v, impl=impl,
                                                         track_scores=track_scores, deepstack=deepstack, tap=tap)
    kv = kv.replace(k=k, v=v)
    if mass is not None:
        kv = kv.replace(score=kv.score + mass)
    return kv, hidden, tapped


@cached_jit(static_argnames=("graphdef", "page_size"))
def forward(graphdef: nnx.GraphDef, params: nnx.State, token_ids: jax.Array, valid: jax.Array, positions: jax.Array,
            embeds: jax.Array | None, embed_mask: jax.Array | None, deepstack: jax.Array | None, *,
            page_size: int) -> jax.Array:
    """One-shot forward of a batch `[B, T]` through a temporary paged cache: `[B, T, V]` logits.

    `valid [B, T]` marks real tokens, `positions [A, B, T]` their absolute positions; `embeds [B, T, D]` replaces
    the token embeddings where `embed_mask [B, T]` is set (encoder outputs on placeholders); `deepstack [n, B, T, D]`
    (Qwen3-Omni) is added after the first n layers.
    """
    decoder = nnx.merge(graphdef, params)
    c = decoder.config
    B, T = token_ids.shape
    pages = -(-T // page_size)
    kv = paged_lib.init(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        num_pages=B * pages, page_size=page_size, batch=B, max_pages=pages,
                        position_axes=c.position_axes, dtype=c.jnp_dtype)
    zeros = jnp.zeros((B, T), jnp.int32)
    # Slots record whole positions; the rotation uses the exact (possibly fractional, Qwen3-Omni) ones.
    meta = paged_lib.SlotMeta(pos=jnp.floor(positions).astype(jnp.int32), unit=zeros,
                              span=zeros + int(SpanKind.TEXT), offset=zeros)
    x = decoder.embed_tokens(token_ids)
    if embeds is not None:
        x = jnp.where(embed_mask[..., None], embeds.astype(x.dtype), x)
    _, hidden = write_chunk(decoder, kv, x, valid, positions, meta, deepstack=deepstack)
    return decoder.logits(hidden)
