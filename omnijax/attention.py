"""Attention over the paged KV cache, with explicit implementations and no silent fallback.

`attend(q, k_pages, v_pages, cache, impl=...)`:
    impl="reference": dense jnp over every page-table entry of each sequence, masked by slot validity and write
        order (the oracle every other implementation is tested against).

A key slot is visible to a query when the slot holds a live token of the query's sequence (`valid`, reached through
the page table) and was written no later than the query (`order <= q_order`), which is causal masking that survives
position re-indexing. A query that sees no key returns zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("reference",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
    """What a chunk's attention needs from the cache, shared by all layers.

    Attributes:
        write_slots: `[B, T]` int32 flat slot each token is written to (-1: not written).
        page_table: `[B, M]` int32 physical pages in span order, -1 = none.
        slot_valid: `[N, P]` bool live slots (after this chunk's reservation).
        slot_order: `[N, P]` int32 per-sequence write order of each slot.
        q_order: `[B, T]` int32 write order of each query token.
    """

    write_slots: jax.Array
    page_table: jax.Array
    slot_valid: jax.Array
    slot_order: jax.Array
    q_order: jax.Array



def validate(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, cache: CacheView) -> None:
    """Shape checks shared by every implementation (static shapes only, so it is free under jit)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, d], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k/v pages must both be [N, P, G, d], got {k_pages.shape} and {v_pages.shape}")
    B, T, H, d = q.shape
    N, P, G, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, keys have {dk}")
    if H % G:
        raise ValueError(f"query heads {H} not a multiple of kv heads {G}")
    if cache.page_table.shape[0] != B or cache.q_order.shape != (B, T):
        raise ValueError(f"cache view batch/shape mismatch: page_table {cache.page_table.shape}, "
                         f"q_order {cache.q_order.shape}, q {q.shape}")
    if cache.slot_valid.shape != (N, P) or cache.slot_order.shape != (N, P):
        raise ValueError(f"slot metadata must be [N, P] = {(N, P)}, got {cache.slot_valid.shape}")


def attend_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, cache: CacheView, *,
                     with_mass: bool = False):
    """Dense masked attention over each sequence's gathered pages. Returns `[B, T, H, d]` in `q.dtype`.

    With `with_mass`, also returns `[N, P]` float32: the attention probability each slot received, summed over the
    chunk's written queries and averaged over heads (the accumulated-attention signal of H2O).
    """
    validate(q, k_pages, v_pages, cache)
    B, T, H, d = q.shape
    N, P, G, _ = k_pages.shape
    M = cache.page_table.shape[1]
    table = cache.page_table  # [B, M]
    has_page = table >= 0
    pages = jnp.clip(table, 0, N - 1)
    k = k_pages[pages].reshape(B, M * P, G, d)  # [B, S, G, d]
    v = v_pages[pages].reshape(B, M * P, G, d)
    live = (cache.slot_valid[pages] & has_page[..., None]).reshape(B, M * P)  # [B, S]
    order = cache.slot_order[pages].reshape(B, M * P)
    # Dirty slots may hold anything (even NaN): zero them so masked probabilities cannot meet NaN values.
    k = jnp.where(live[..., None, None], k, 0)
    v = jnp.where(live[..., None, None], v, 0)
    visible = live[:, None, :] & (order[:, None, :] <= cache.q_order[:, :, None])  # [B, T, S]

    qg = q.reshape(B, T, G, H // G, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    mask = visible[:, None, None, :, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(denom > 0, denom, 1.0)).astype(q.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(B, T, H, d).astype(q.dtype)
    if not with_mass:
        return out
    written = (cache.write_slots >= 0)[:, None, None, :, None]  # padding queries do not vote
    per_slot = jnp.sum(jnp.where(written, probs.astype(jnp.float32), 0.0), axis=(1, 2, 3)) / H  # [B, S]
    flat = (pages[:, :, None] * P + jnp.arange(P)).reshape(B, M * P)
    target = jnp.where(live, flat, N * P).reshape(-1)
    mass = jnp.zeros((N * P,), jnp.float32).at[target].add(per_slot.reshape(-1), mode="drop")
    return out, mass.reshape(N, P)


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, cache: CacheView, *,
           impl: str = "reference", with_mass: bool = False):
    """Causal attention of a chunk's queries `[B, T, H, d]` over the paged cache of one layer.

    With `with_mass`, returns `(out, mass [N, P])` (see `attend_reference`).
    """
    if impl == "reference":
        return attend_reference(q, k_pages, v_pages, cache, with_mass=with_mass)
    raise ValueError(f"unknown attention impl {impl!r}; available: {IMPLEMENTATIONS}")
