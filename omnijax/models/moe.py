"""Mixture-of-experts feed-forward (Qwen3-MoE): softmax router, top-k, experts as one grouped matmul.

For `N` tokens, `E` experts of width `I`, `k` experts per token:

1. router probabilities `softmax(x @ router)` in float32 `[N, E]`; the top-k experts per token and their weights
   (renormalised to sum to one when `norm_topk_prob`);
2. the `N * k` (token, expert) assignments sorted by expert, so each expert's rows are contiguous;
3. `jax.lax.ragged_dot` runs the gate, up and down projections of every expert over its group of rows at once
   (`group_sizes [E]` = rows per expert): the cost follows the `N * k` assignments, never `N * E`;
4. each row scaled by its routing weight, the rows put back in token order and summed over the k experts.

`moe_ffn_reference` computes the same with a dense einsum over all experts (every token through every expert,
weights zero for the experts not chosen): the oracle of the tests and the baseline of `bench/moe_layer.py`, never on a
hot path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token.

    Args:
        x: `[N, D]` normalised hidden states.
        router: `[D, E]` router weights.
        top_k: experts per token.
        norm_topk_prob: renormalise the chosen probabilities to sum to one.

    Returns:
        `(weights [N, k] float32, experts [N, k] int32)`, experts in descending probability.
    """
    logits = jnp.einsum("nd,de->ne", x, router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)  # float32
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    return jax.nn.silu(gate.astype(dtype)) * up.astype(dtype)


def moe_ffn(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, top_k: int,
            norm_topk_prob: bool) -> jax.Array:
    """The MoE feed-forward of a layer as grouped matmuls.

    Args:
        x: `[..., D]` normalised hidden states (compute dtype).
        router: `[D, E]`; gate, up: `[E, D, I]`; down: `[E, I, D]`.
        top_k: experts per token; norm_topk_prob: renormalise the chosen weights.

    Returns:
        `[..., D]` in `x.dtype`.
    """
    shape, dt = x.shape, x.dtype
    D = shape[-1]
    E = router.shape[-1]
    flat = x.reshape(-1, D)  # [N, D]
    N = flat.shape[0]
    weights, experts = route(flat, router, top_k, norm_topk_prob)  # [N, k]
    expert_of = experts.reshape(-1)  # [N*k], assignment a = token * k + slot
    order = jnp.argsort(expert_of, stable=True)  # assignments grouped by expert
    token_of = order // top_k
    group_sizes = jnp.bincount(expert_of, length=E).astype(jnp.int32)  # [E]
    rows = jnp.take(flat, token_of, axis=0)  # [N*k, D]
    g = jax.lax.ragged_dot(rows, gate, group_sizes, preferred_element_type=jnp.float32)  # [N*k, I]
    u = jax.lax.ragged_dot(rows, up, group_sizes, preferred_element_type=jnp.float32)
    h = jax.lax.ragged_dot(_swiglu(g, u, dt), down, group_sizes, preferred_element_type=jnp.float32)  # [N*k, D]
    h = h.astype(dt) * jnp.take(weights.reshape(-1), order)[:, None].astype(dt)
    unsorted = jnp.zeros_like(h).at[order].set(h, unique_indices=True)  # back to assignment order
    out = jnp.sum(unsorted.reshape(N, top_k, D).astype(jnp.float32), axis=1)
    return out.astype(dt).reshape(shape)


def moe_ffn_reference(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *,
                      top_k: int, norm_topk_prob: bool) -> jax.Array:
    """`moe_ffn` as a dense einsum over all `E` experts (cost `N * E`): the oracle and the benchmark baseline."""
    shape, dt = x.shape, x.dtype
    flat = x.reshape(-1, shape[-1])
    weights, experts = route(flat, router, top_k, norm_topk_prob)
    dense_w = jnp.zeros((flat.shape[0], router.shape[-1]), jnp.float32)
    dense_w = jax.vmap(lambda w, e, row: row.at[e].add(w))(weights, experts, dense_w)  # [N, E]
    g = jnp.einsum("nd,edi->nei", flat, gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("nd,edi->nei", flat, up, preferred_element_type=jnp.float32)
    h = jnp.einsum("nei,eid->ned", _swiglu(g, u, dt), down, preferred_element_type=jnp.float32)  # [N, E, D]
    h = h.astype(dt) * dense_w[..., None].astype(dt)
    return jnp.sum(h.astype(jnp.float32), axis=1).astype(dt).reshape(shape)
