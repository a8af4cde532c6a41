"""The dense attention oracle every attention implementation and test is checked against (`dense_attention`), and
the dense layout of a paged cache it reads (`gather_pages`).

Imports jax only, as every kernel module does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Gathered", "dense_attention", "gather_pages"]


class Gathered(NamedTuple):
    """Each sequence's page-table entries laid out densely (`gather_pages`); S = M * P, entry j * P + s is slot s
    of `page_table[b, j]`.

    Attributes:
        k, v: `[B, S, G, d]` keys and values as stored (a dead slot's may be anything, NaN included).
        live: `[B, S]` bool, the slot is valid and its page-table entry is not -1.
        order: `[B, S]` int32 write order of each slot (meaningless where not live).
        slot: `[B, S]` int32 flat slot index `page * P + s` into `[N * P]` (of the clipped page where the entry is -1).
    """

    k: jax.Array
    v: jax.Array
    live: jax.Array
    order: jax.Array
    slot: jax.Array


def gather_pages(k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, slot_valid: jax.Array,
                 slot_order: jax.Array, *, layer: int | jax.Array | None = None) -> Gathered:
    """Every page-table entry of each sequence, gathered in page-table order (one gather per array).

    `k_pages`/`v_pages` are `[N, P, G, d]`, or with `layer` (int scalar) `[L, N, P, G, d]` stacks of which only that
    layer is read; `page_table [B, M]`, `slot_valid`/`slot_order [N, P]`.
    """
    N, P, G, d = k_pages.shape[-4:]
    B, M = page_table.shape
    pages = jnp.clip(page_table, 0, N - 1)
    read = (lambda x: x[pages]) if layer is None else (lambda x: x[layer, pages])  # noqa: E731
    live = (slot_valid[pages] & (page_table >= 0)[..., None]).reshape(B, M * P)
    slot = (pages[:, :, None] * P + jnp.arange(P, dtype=pages.dtype)).reshape(B, M * P)
    return Gathered(k=read(k_pages).reshape(B, M * P, G, d), v=read(v_pages).reshape(B, M * P, G, d), live=live,
                    order=slot_order[pages].reshape(B, M * P), slot=slot.astype(jnp.int32))


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, key_order: jax.Array,
                    q_order: jax.Array, *, precision: lax.PrecisionLike = None,
                    return_probs: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Dense masked softmax attention: the one oracle every attention implementation and test is checked against.

    Shapes: `q [B, T, H, d]`; `k`, `v [B, S, G, d]` with H a multiple of G (grouped-query attention: query head h
    reads kv head `h // (H // G)`); `key_valid [B, S]` bool; `key_order [B, S]` and `q_order [B, T]` integer write
    orders.

    Query t of sequence b sees key s iff `key_valid[b, s]` and `key_order[b, s] <= q_order[b, t]`: causal masking by
    write order (for a contiguous causal prompt, orders are the positions 0..S-1 of keys and queries). Scores are
    `q . k * d**-0.5` in float32 (`precision` for both dots; None is the backend's default), softmaxed over the
    visible keys only (`jax.nn.softmax` with `where`); probabilities are cast to `q.dtype` before the value product,
    which accumulates in float32; the output is in `q.dtype`.

    Keys and values of slots that are not valid may hold anything, NaN and inf included: they are zeroed before any
    arithmetic, so they never reach the output (a masked probability is exactly 0 and never meets a NaN). A query that
    sees no key returns zeros (and all-zero probabilities).

    Returns `out [B, T, H, d]`, or with `return_probs` `(out, probs [B, H, T, S])` (in `q.dtype`, 0 where not seen).
    """
    B, T, H, d = q.shape
    S, G = k.shape[1], k.shape[2]
    if k.shape != (B, S, G, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be [B, S, G, d] = {(B, S, G, d)}, got {k.shape} and {v.shape}")
    if G == 0 or H % G:
        raise ValueError(f"query heads {H} not a multiple of kv heads {G}")
    if key_valid.shape != (B, S) or key_order.shape != (B, S) or q_order.shape != (B, T):
        raise ValueError(f"key_valid/key_order must be [B, S] = {(B, S)} and q_order [B, T] = {(B, T)}, got "
                         f"{key_valid.shape}, {key_order.shape}, {q_order.shape}")
    k = jnp.where(key_valid[..., None, None], k, jnp.zeros((), k.dtype))
    v = jnp.where(key_valid[..., None, None], v, jnp.zeros((), v.dtype))
    visible = key_valid[:, None, :] & (key_order[:, None, :] <= q_order[:, :, None])  # [B, T, S]
    mask = jnp.broadcast_to(visible[:, None, None], (B, G, H // G, T, S))
    qg = q.reshape(B, T, G, H // G, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, precision=precision,
                        preferred_element_type=jnp.float32) * (float(d) ** -0.5)
    probs = jax.nn.softmax(scores, axis=-1, where=mask).astype(q.dtype)  # rows that see nothing: all 0
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v, precision=precision, preferred_element_type=jnp.float32)
    out = out.reshape(B, T, H, d).astype(q.dtype)
    return (out, probs.reshape(B, H, T, S)) if return_probs else out
