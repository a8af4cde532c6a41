"""Mixture-of-experts feed-forward (Qwen3-MoE): softmax router, top-k, experts as one grouped matmul.

For `N` tokens, `E` experts of width `I`, `k` experts per token:

1. router probabilities `softmax(x @ router)` in float32 `[N, E]`; the top-k experts per token and their weights
   (renormalised to sum to one when `norm_topk_prob`);
2. the `N * k` (token, expert) assignments sorted by expert, so each expert's rows are contiguous;
3. a grouped matmul runs the gate, up and down projections of every expert over its group of rows
   (`group_sizes [E]` = rows per expert), so the cost follows the `N * k` assignments, never `N * E`:
   - `impl="ragged_dot"`: `jax.lax.ragged_dot`, which XLA:GPU and XLA:TPU implement as one grouped kernel;
   - `impl="blocked"`: the sorted rows cut into blocks of `expert_block(N * k, E)` rows that each belong to one
     expert; a `fori_loop` with a dynamic trip count (the non-empty blocks, at most `N*k / m + E`) reads one
     expert's weights per block and runs three `[m, D] x [D, I]`-sized matmuls. XLA:CPU has no grouped kernel and
     lowers `ragged_dot` to a dense product against every expert (`bench.metronome.qwen3_omni_moe`: 1.6-6x slower than
     even the dense einsum), so this is the CPU default; a decode step reads exactly its k experts' weights;
4. each row scaled by its routing weight, the rows put back in token order and summed over the k experts.

Under `jax.vmap` (`omnijax.evaluate` maps the streaming step over sessions) the batch axis is folded into the tokens:
every token is routed on its own, so a batch of inputs over shared weights is one larger call, and the experts'
grouped matmuls still run once over all the rows. (`jax.lax.ragged_dot` has no batching rule for weights that are not
batched themselves; batching them would copy every expert once per session.) Weights mapped over as well run one call
per batch element (`lax.map`).

`moe_ffn_reference` computes the same with a dense einsum over all experts (every token through every expert, weights
zero for the experts not chosen): the oracle of the tests and the baseline of `bench.metronome.qwen3_omni_moe`, never on
a hot path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from omnijax.kernels.quant import QuantizedWeight, dequantize, qmatmul


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


IMPLS = ("ragged_dot", "blocked")


def default_impl() -> str:
    """`ragged_dot` where XLA has a grouped kernel (GPU, TPU), `blocked` elsewhere (CPU)."""
    return "ragged_dot" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "blocked"


def expert_block(assignments: int, num_experts: int) -> int:
    """Rows per block of `impl="blocked"` (a power of two, static): about the mean rows per expert, 8 to 128."""
    mean = max(1, assignments // max(1, num_experts))
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def moe_ffn(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, top_k: int,
            norm_topk_prob: bool, impl: str | None = None) -> jax.Array:
    """The MoE feed-forward of a layer as grouped matmuls.

    Args:
        x: `[..., D]` normalised hidden states (compute dtype).
        router: `[D, E]`; gate, up: `[E, D, I]`; down: `[E, I, D]` (float, or `QuantizedWeight`s of those shapes:
            the blocked impl dequantises one expert's weight per block, ragged_dot the whole stack).
        top_k: experts per token; norm_topk_prob: renormalise the chosen weights.
        impl: "ragged_dot" or "blocked" (see the module docstring); None: `default_impl()`, or "blocked" when the
            experts are quantised weights set to the Pallas kernel (`QuantizedWeight.kernel`), which only the blocked
            impl runs (ragged_dot dequantises the stack; asked for explicitly with such weights it is refused).

    Returns:
        `[..., D]` in `x.dtype`. Batchable with `jax.vmap` (see the module docstring).
    """
    pallas = any(isinstance(w, QuantizedWeight) and w.kernel == "pallas" for w in (gate, up, down))
    impl = ("blocked" if pallas else default_impl()) if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"moe_ffn impl must be one of {IMPLS}, got {impl!r}")
    if pallas and impl == "ragged_dot":
        raise ValueError("moe_ffn impl='ragged_dot' dequantises the expert stack whole, but the experts are set to "
                         "the Pallas int4 kernel (kernel='pallas'); use impl='blocked' (or None)")
    return _batchable_ffn(int(top_k), bool(norm_topk_prob), impl)(x, router, gate, up, down)


@functools.lru_cache(maxsize=None)
def _batchable_ffn(top_k: int, norm_topk_prob: bool, impl: str):
    """`_grouped_ffn` at fixed settings with its vmap rule: a batch over shared weights folds into the tokens."""

    @jax.custom_batching.custom_vmap
    def ffn(x, router, gate, up, down):
        return _grouped_ffn(x, router, gate, up, down, top_k=top_k, norm_topk_prob=norm_topk_prob, impl=impl)

    @ffn.def_vmap
    def _rule(axis_size, in_batched, x, router, gate, up, down):
        if not any(jax.tree.leaves(in_batched[1:])):  # tokens are routed independently: the batch is more tokens
            return ffn(x, router, gate, up, down), True  # (x is batched here: some input is)
        # (a quantised weight's flags are a pytree of its arrays' flags, broadcast leaf by leaf)
        args = tuple(jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + a.shape), arg, flags)
                     for arg, flags in zip((x, router, gate, up, down), in_batched))
        return jax.lax.map(lambda a: ffn(*a), args), True

    return ffn


def _grouped_ffn(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, top_k: int,
                 norm_topk_prob: bool, impl: str) -> jax.Array:
    """`moe_ffn` for one (unbatched) call."""
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
    if impl == "ragged_dot":
        # ragged_dot takes dense weights: quantised experts are dequantised whole here, inside the program
        gate, up, down = (dequantize(w, dt) if isinstance(w, QuantizedWeight) else w for w in (gate, up, down))
        g = jax.lax.ragged_dot(rows, gate, group_sizes, preferred_element_type=jnp.float32)  # [N*k, I]
        u = jax.lax.ragged_dot(rows, up, group_sizes, preferred_element_type=jnp.float32)
        h = jax.lax.ragged_dot(_swiglu(g, u, dt), down, group_sizes, preferred_element_type=jnp.float32)  # [N*k, D]
    else:
        h = _blocked_experts(rows, group_sizes, gate, up, down, expert_block(rows.shape[0], E))
    h = h.astype(dt) * jnp.take(weights.reshape(-1), order)[:, None].astype(dt)
    unsorted = jnp.zeros_like(h).at[order].set(h, unique_indices=True)  # back to assignment order
    out = jnp.sum(unsorted.reshape(N, top_k, D).astype(jnp.float32), axis=1)
    return out.astype(dt).reshape(shape)


def _dot(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """`x @ w` in float32: `jnp.dot`, or `qmatmul` for one expert's quantised weight."""
    if isinstance(w, QuantizedWeight):
        return qmatmul(x, w, preferred_element_type=jnp.float32)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _blocked_experts(rows: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                     block: int) -> jax.Array:
    """The experts' SwiGLU over rows sorted by expert (`[A, D]`, `group_sizes [E]`), `block` rows at a time.

    Block j belongs to one expert e: it covers sorted rows `[r, r + block)` from the start of e's group in steps of
    `block`, of which the first `min(block, end_e - r)` are e's (the rest are masked and add nothing). Only the
    non-empty blocks run. Returns `[A, D]` float32.
    """
    A, D = rows.shape
    dt = rows.dtype
    starts = jnp.cumsum(group_sizes) - group_sizes  # [E] first sorted row of each expert
    blocks = (group_sizes + block - 1) // block  # [E]
    last_block = jnp.cumsum(blocks)  # [E] one past each expert's last block
    padded = jnp.pad(rows, ((0, block), (0, 0)))
    lane = jnp.arange(block)

    def body(j, out):
        e = jnp.searchsorted(last_block, j, side="right").astype(jnp.int32)
        r = starts[e] + (j - (last_block[e] - blocks[e])) * block
        x = jax.lax.dynamic_slice_in_dim(padded, r, block)  # [m, D]
        w = [m.index(e) if isinstance(m, QuantizedWeight) else jax.lax.dynamic_index_in_dim(m, e, keepdims=False)
             for m in (gate, up, down)]
        g, u = _dot(x, w[0]), _dot(x, w[1])
        y = _dot(_swiglu(g, u, dt), w[2])  # [m, D]
        y = jnp.where((lane < starts[e] + group_sizes[e] - r)[:, None], y, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, r, block) + y, r, 0)

    out = jax.lax.fori_loop(0, last_block[-1], body, jnp.zeros((A + block, D), jnp.float32))
    return out[:A]


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
