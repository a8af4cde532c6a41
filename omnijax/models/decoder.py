"""Qwen2-family decoder (Qwen2, Qwen2.5-Omni thinker LLM, Qwen3, Qwen3-MoE / the Qwen3-Omni thinker LLM; also
Llama-3.x and Mistral: no biases, 1D RoPE, Llama-3 scaled via `DecoderConfig.rope_scaling`) in Flax NNX over the
paged KV cache.

The module carries only its config and its parameters. Layer parameters are stacked along a leading `layers` axis
and the layers run in one `lax.scan`, so compile time does not grow with depth. Attention reads and writes the
paged cache through `omnijax.kv.attention`; the decoder itself never branches on traced values.

Parameter pytree (`nnx.state(model).to_pure_dict()`), shapes for L layers, D hidden, H heads, G kv heads, d head
dim, I intermediate, V vocab:

    embed        [V, D]
    layers:
      input_norm [L, D]         post_norm [L, D]
      q_proj     [L, D, H*d]    q_bias    [L, H*d]   (qkv_bias)
      k_proj     [L, D, G*d]    k_bias    [L, G*d]   (qkv_bias)
      v_proj     [L, D, G*d]    v_bias    [L, G*d]   (qkv_bias)
      o_proj     [L, H*d, D]
      q_norm     [L, d]         k_norm    [L, d]     (qk_norm)
      gate_proj  [Ld, D, I]     up_proj   [Ld, D, I] down_proj [Ld, I, D]            (Ld dense-MLP layers)
      router     [Lm, D, E]                                                      (Lm MoE layers, E experts)
      expert_gate [Lm, E, D, Ie] expert_up [Lm, E, D, Ie] expert_down [Lm, E, Ie, D]
    final_norm   [D]
    lm_head      [D, V]                              (unless tie_embeddings)

Which layers are MoE is `config.sparse_layers`. A decoder of one kind scans every parameter; a mixed one scans the
attention parameters and picks each layer's MLP from its kind's stack with `lax.cond` (one compiled body either way).

Per-layer storage (`Decoder.split_layers`, what `omnijax.load` does): the stacks are cut into one array per layer and
parameter (`layers.rows[i].<name>`, each layer holding its own MLP kind's), one copy at a time. The layer loop then
still runs once in a scan, but each layer's projections run inside `lax.switch` over the layers, every branch reading
its layer's arrays where they lie. Sliced from a stack instead, XLA:CPU materialises every layer's weights before the
matmul reads them (`bench/peers/decode_profile.py`: half of SmolLM2's decode time). `stacked()` of split layers
restacks them (a copy: for the paths that still slice stacks, never the streaming step).
DeepStack (Qwen3-Omni): `run_layers(..., deepstack=[n, B, T, D])` adds level i to the hidden states after layer i,
i < n; the levels are zero away from visual tokens, so only those change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.kept_executables import cached_jit
from omnijax.kv import attention as attention_lib
from omnijax.kv import rope as rope_lib
from omnijax.kv.paged import write_layer
from omnijax.models.config import DecoderConfig
from omnijax.models.layers import LayerWeight, linear, new_param, rms_norm
from omnijax.models.moe import moe_ffn

DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# Backends on which `omnijax.load` splits a decoder's layers (`Decoder.split_layers`): measured faster on XLA:CPU
# (`bench/peers/RESULTS.md`); unmeasured on GPU, where every `lax.switch` is a conditional the step must resolve.
SPLIT_LAYER_BACKENDS = ("cpu",)
MOE_MLP = ("router", "expert_gate", "expert_up", "expert_down")


def _proj(config: DecoderConfig, h: jnp.ndarray, p: dict, name: str) -> jnp.ndarray:
    out = linear(h, p[name + "_proj"], "btd,de->bte")
    if name + "_bias" in p:
        out = out + p[name + "_bias"].astype(jnp.float32)
    return out.astype(config.jnp_dtype)


def chunk_rotation(config: DecoderConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`(cos, sin)`, each `[B, T, d/2]` float32, of the RoPE angles of `positions [A, B, T]` (A = 1 or the mrope
    axes): computed once per chunk and passed to `layer_qkv` in every layer (`rope.rotation`)."""
    c = config
    return rope_lib.rotation(rope_lib.rope_angles(positions, c.head_dim, c.rope_base, c.mrope_section,
                                                  c.mrope_interleaved))


def layer_qkv(config: DecoderConfig, p: dict, h: jnp.ndarray,
              rot: tuple[jnp.ndarray, jnp.ndarray]) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One layer's attention inputs for a chunk: `(q [B, T, H, d], k [B, T, G, d], v [B, T, G, d])`, q and k rotated.

    Args:
        config: the decoder config.
        p: one layer's parameters (the stacked dict sliced at a layer).
        h: `[B, T, D]` the layer's input hidden states.
        rot: `(cos, sin)`, each `[B, T, d/2]`, of the chunk's RoPE angles (`chunk_rotation`), computed once for
            all layers.
    """
    c = config
    B, T, _ = h.shape
    normed = rms_norm(h, p["input_norm"], c.rms_norm_eps)
    q = _proj(c, normed, p, "q").reshape(B, T, c.num_heads, c.head_dim)
    k = _proj(c, normed, p, "k").reshape(B, T, c.num_kv_heads, c.head_dim)
    v = _proj(c, normed, p, "v").reshape(B, T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
    return rope_lib.rotate(q, rot), rope_lib.rotate(k, rot), v


def mlp(config: DecoderConfig, p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """One layer's feed-forward on normalised `x [B, T, D]`: the dense SwiGLU MLP, or the mixture of experts when
    `p` holds a router (`omnijax.models.moe.moe_ffn`, a grouped matmul over the chosen experts)."""
    c, dt = config, config.jnp_dtype
    if "router" in p:
        return moe_ffn(x, p["router"], p["expert_gate"], p["expert_up"], p["expert_down"],
                       top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob)
    gate = linear(x, p["gate_proj"], "btd,di->bti")
    up = linear(x, p["up_proj"], "btd,di->bti")
    act = jax.nn.silu(gate.astype(dt)) * up.astype(dt)
    return linear(act, p["down_proj"], "bti,id->btd").astype(dt)


def layer_finish(config: DecoderConfig, p: dict, h: jnp.ndarray, attn: jnp.ndarray,
                 ffn: Callable[[jnp.ndarray], jnp.ndarray] | None = None) -> jnp.ndarray:
    """The rest of a layer after attention: output projection and residual, then the MLP and residual.

    Args:
        h: `[B, T, D]` the layer's input hidden states; attn: `[B, T, H, d]` attention outputs.
        ffn: the feed-forward applied to the normalised states (default `mlp(config, p, .)`).
    """
    c, dt = config, config.jnp_dtype
    B, T, _ = h.shape
    attn = attn.reshape(B, T, c.num_heads * c.head_dim)
    h = h + linear(attn, p["o_proj"], "bte,ed->btd").astype(dt)
    normed = rms_norm(h, p["post_norm"], c.rms_norm_eps)
    return h + (mlp(c, p, normed) if ffn is None else ffn(normed))


class DecoderLayers(nnx.Module):
    """All decoder layers' parameters, stacked along a leading `layers` axis."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        L, D, I = c.num_layers, c.hidden_size, c.intermediate_size
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_norm = new_param((L, D), dt, rngs, ones=True)
        self.post_norm = new_param((L, D), dt, rngs, ones=True)
        self.q_proj = new_param((L, D, qd), dt, rngs)
        self.k_proj = new_param((L, D, kvd), dt, rngs)
        self.v_proj = new_param((L, D, kvd), dt, rngs)
        self.o_proj = new_param((L, qd, D), dt, rngs)
        if c.qkv_bias:
            self.q_bias = new_param((L, qd), dt, rngs, zeros=True)
            self.k_bias = new_param((L, kvd), dt, rngs, zeros=True)
            self.v_bias = new_param((L, kvd), dt, rngs, zeros=True)
        if c.qk_norm:
            self.q_norm = new_param((L, c.head_dim), dt, rngs, ones=True)
            self.k_norm = new_param((L, c.head_dim), dt, rngs, ones=True)
        Lm = sum(c.sparse_layers)
        Ld = L - Lm
        if Ld:
            self.gate_proj = new_param((Ld, D, I), dt, rngs)
            self.up_proj = new_param((Ld, D, I), dt, rngs)
            self.down_proj = new_param((Ld, I, D), dt, rngs)
        if Lm:
            E, Ie = c.num_experts, c.moe_intermediate_size
            self.router = new_param((Lm, D, E), dt, rngs)
            self.expert_gate = new_param((Lm, E, D, Ie), dt, rngs)
            self.expert_up = new_param((Lm, E, D, Ie), dt, rngs)
            self.expert_down = new_param((Lm, E, Ie, D), dt, rngs)

    def stacked(self) -> dict[str, jnp.ndarray]:
        """The stacked parameter arrays as a plain dict (scanned over in `Decoder.run_layers`)."""
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}


class LayerParams(nnx.Module):
    """One decoder layer's parameters (its MLP kind's only), one array per name: a row of `SplitLayers`."""

    def __init__(self, arrays: dict[str, jnp.ndarray]):
        for name, value in arrays.items():
            setattr(self, name, nnx.Param(value))

    def params(self) -> dict[str, jnp.ndarray]:
        """The layer's arrays as a plain dict (what `layer_qkv` / `layer_finish` take)."""
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}


class SplitLayers(nnx.Module):
    """All decoder layers' parameters, one `LayerParams` per layer (`Decoder.split_layers`)."""

    def __init__(self, layers: list[dict[str, jnp.ndarray]]):
        self.rows = nnx.List([LayerParams(arrays) for arrays in layers])

    def per_layer(self) -> tuple[dict[str, jnp.ndarray], ...]:
        """Each layer's parameters, in layer order."""
        return tuple(row.params() for row in self.rows)

    def stacked(self) -> dict[str, jnp.ndarray]:
        """The `DecoderLayers.stacked()` layout rebuilt by stacking the layers (a copy of every weight: for the
        paths that slice stacks, never the streaming step). Each MLP kind's stack is its layers in layer order."""
        layers = self.per_layer()
        names = dict.fromkeys(name for p in layers for name in p)
        return {name: jax.tree.map(lambda *a: jnp.stack(a), *[p[name] for p in layers if name in p])
                for name in names}


def mlp_rows(config: DecoderConfig) -> tuple[int, ...]:
    """Per layer, its row in the stack of its MLP kind (the dense MLPs' or the MoE layers')."""
    count, rows = {False: 0, True: 0}, []
    for sparse in config.sparse_layers:
        rows.append(count[sparse])
        count[sparse] += 1
    return tuple(rows)


def layer_rows(config: DecoderConfig, names: Iterable[str], layer: int) -> dict[str, int]:
    """Which row of each stacked parameter in `names` is layer `layer`'s (a Python int): the shared ones at
    `layer`, its MLP kind's at `mlp_rows(config)[layer]`; the other kind's parameters are left out."""
    kind = MOE_MLP if config.sparse_layers[layer] else DENSE_MLP
    row = mlp_rows(config)[layer]
    return {k: row if k in kind else layer for k in names if k in kind or k not in DENSE_MLP + MOE_MLP}


def layer_slice(config: DecoderConfig, stacked: dict[str, jnp.ndarray], layer: int) -> dict[str, jnp.ndarray]:
    """Layer `layer`'s parameters (`layer_rows`), so `layer_finish(config, p, ...)` runs the right MLP."""
    return {k: stacked[k][r] for k, r in layer_rows(config, stacked, layer).items()}


def layer_scan_inputs(config: DecoderConfig, stacked: dict[str, jnp.ndarray]
                      ) -> tuple[dict[str, jnp.ndarray], Callable[[dict], Callable[[jnp.ndarray], jnp.ndarray]]]:
    """What the layer scan slices per layer, and how a layer finds its MLP.

    Returns:
        `(xs, ffn_of)`: `xs` the per-layer scan inputs; `ffn_of(p)` the feed-forward of the layer whose slice is `p`
        (a function of the normalised states). A decoder of one MLP kind scans every parameter; a mixed one scans the
        attention parameters with two per-layer ints (is MoE, index in its kind's stack), and the layer's MLP is taken
        from its kind's stack inside `lax.cond`.
    """
    c = config
    sparse = c.sparse_layers
    if all(sparse) or not any(sparse):
        return stacked, lambda p: (lambda x: mlp(c, p, x))
    dense = {k: stacked[k] for k in DENSE_MLP}
    moe = {k: stacked[k] for k in MOE_MLP}
    xs = {k: v for k, v in stacked.items() if k not in DENSE_MLP + MOE_MLP}
    xs["_sparse"] = jnp.asarray(sparse, jnp.bool_)
    xs["_index"] = jnp.asarray(mlp_rows(c), jnp.int32)

    def ffn_of(p):
        def pick(stack):
            return {k: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, p["_index"], keepdims=False), v)
                    for k, v in stack.items()}  # (a QuantizedWeight is indexed leaf by leaf)
        return lambda x: jax.lax.cond(p["_sparse"], lambda: mlp(c, pick(moe), x), lambda: mlp(c, pick(dense), x))

    return xs, ffn_of


def head_logits(config: DecoderConfig, hidden: jnp.ndarray, final_norm: jnp.ndarray, head: jnp.ndarray
                ) -> jnp.ndarray:
    """Final norm and lm head, `[..., D]` -> `[..., V]` float32, with `head` the stored weight
    (`Decoder.head_weight`). A tied head contracts the embedding `[V, D]` on its last axis as it lies: written as
    `embed.T` instead, XLA:CPU copied the transposed table (113 MB on SmolLM2) into every one-row program (a decode
    step of one sequence, the prefill's last token), and eagerly the transpose was a copy of its own. Run it eagerly
    through `last_logits` (one compiled call)."""
    h = rms_norm(hidden, final_norm, config.rms_norm_eps)
    spec = "...d,vd->...v" if config.tie_embeddings else "...d,dv->...v"
    return jnp.einsum(spec, h, head, preferred_element_type=jnp.float32)


_head_logits_jit = cached_jit(head_logits, static_argnames="config")


def last_logits(model: Decoder, hidden: jnp.ndarray) -> jnp.ndarray:
    """`model.logits(hidden)` as one compiled call, for eager callers (no transposed copy of a tied head)."""
    return _head_logits_jit(model.config, hidden, model.final_norm[...], model.head_weight())


def _row(a: jax.Array, row: int) -> jax.Array:
    """`a[row]` as its own array. On one CPU device, a numpy view of the stack's host buffer handed to jax, which
    adopts an aligned buffer without copying it: the layers share the stack's memory (a copy per layer held the
    weights 1.4x over after load, `tests/models/test_load_memory.py`), and no slice program is compiled per
    parameter shape (an eager `a[row]` compiled one, ~0.5 s each on a loaded machine)."""
    if a.is_fully_addressable and len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu":
        return jax.device_put(np.asarray(a)[row], a.sharding)
    return a[row]


LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def split_layer_views(config: DecoderConfig, per_layer: tuple[dict[str, jnp.ndarray], ...]
                      ) -> tuple[tuple[dict, ...], Callable[[jnp.ndarray], tuple[dict, Callable | None]]]:
    """How a layer loop over split layers (`SplitLayers.per_layer()`) reads layer `i` (traced).

    Returns:
        `(per_layer, view)`: `view(i)` is `(p, ffn)`: `p` the layer's parameters for `layer_qkv` / `layer_finish`,
        its projection weights `LayerWeight`s (each matmul a `lax.switch` whose branches read one layer's array in
        place, a single product each, so compile time grows little with depth) and its small parameters (norms,
        biases) sliced from a stack of them built once per call; `ffn` None for a dense decoder (its MLP reads the
        `LayerWeight`s), else the MLP of the layer's own kind in a `lax.switch` (MoE experts are not sliced).
    """
    dense = not any(config.sparse_layers)
    shared = [n for n in per_layer[0] if all(n in q for q in per_layer) and (dense or n not in DENSE_MLP + MOE_MLP)]
    small = {n: jnp.stack([q[n] for q in per_layer]) for n in shared if n not in LINEAR}

    def view(i):
        p = {n: LayerWeight(i, tuple(q[n] for q in per_layer)) for n in shared if n in LINEAR}
        p.update({n: jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for n, a in small.items()})
        if dense:
            return p, None
        return p, lambda x: jax.lax.switch(i, [functools.partial(mlp, config, q) for q in per_layer], x)

    return per_layer, view


class Decoder(nnx.Module):
    """Qwen2-family causal LM over a paged KV cache."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config, config.jnp_dtype
        self.config = config
        self.embed = new_param((c.vocab_size, c.hidden_size), dt, rngs)
        self.layers = DecoderLayers(config, rngs=rngs)
        self.final_norm = new_param((c.hidden_size,), dt, rngs, ones=True)
        if not c.tie_embeddings:
            self.lm_head = new_param((c.hidden_size, c.vocab_size), dt, rngs)

    def split_layers(self) -> Decoder:
        """Stores the layers one array per layer and parameter (`SplitLayers`) instead of stacked, in place; returns
        the decoder. Each stack is cut and dropped before the next is read, so at most one stack is held twice (the
        module must hold the only reference to its stacks for them to be freed). Computes the same values; the
        decode step stops copying every layer's weights out of the stacks (module docstring). A split decoder
        stays split."""
        if isinstance(self.layers, SplitLayers):
            return self
        c, stacks = self.config, self.layers
        layers: list[dict[str, jnp.ndarray]] = [{} for _ in range(c.num_layers)]
        for name in [n for n, v in vars(stacks).items() if isinstance(v, nnx.Param)]:
            stack = getattr(stacks, name)[...]
            for i, p in enumerate(layers):
                row = layer_rows(c, (name,), i).get(name)
                if row is not None:
                    p[name] = jax.tree.map(functools.partial(_row, row=row), stack)
            delattr(stacks, name)
            del stack
        self.layers = SplitLayers(layers)
        return self

    def embed_tokens(self, token_ids: jnp.ndarray) -> jnp.ndarray:
        """`[B, T]` ids -> `[B, T, D]` embeddings in the compute dtype."""
        return jnp.take(self.embed[...], token_ids, axis=0)

    def logits(self, hidden: jnp.ndarray) -> jnp.ndarray:
        """Final norm and lm head: `[..., D]` -> `[..., V]` float32 logits (`head_logits`)."""
        return head_logits(self.config, hidden, self.final_norm[...], self.head_weight())

    def head_weight(self) -> jnp.ndarray:
        """The lm head's weight as stored: `embed [V, D]` when tied, else `lm_head [D, V]` (`head_logits`)."""
        return self.embed[...] if self.config.tie_embeddings else self.lm_head[...]

    def run_layers(self, x: jnp.ndarray, positions: jnp.ndarray, cache: attention_lib.CacheView,
                   k_pages: jnp.ndarray, v_pages: jnp.ndarray, *, impl: str = "xla",
                   track_scores: bool = False, unroll: bool = False, deepstack: jnp.ndarray | None = None
                   ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray | None]:
        """`run_layers_tapped` without a tap (the program every caller compiled before the tap existed)."""
        return self.run_layers_tapped(x, positions, cache, k_pages, v_pages, impl=impl, track_scores=track_scores,
                                      unroll=unroll, deepstack=deepstack)[:4]

    def run_layers_tapped(self, x: jnp.ndarray, positions: jnp.ndarray, cache: attention_lib.CacheView,
                          k_pages: jnp.ndarray, v_pages: jnp.ndarray, *, impl: str = "xla",
                          track_scores: bool = False, unroll: bool = False, deepstack: jnp.ndarray | None = None,
                          tap: int | None = None
                          ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray | None, jnp.ndarray | None]:
        """Runs every layer on a chunk, writing its keys/values into the paged cache and attending over it.

        Args:
            x: `[B, T, D]` input embeddings (compute dtype).
            positions: `[A, B, T]` absolute positions (A = config.position_axes, or 1 to drive all mrope axes).
            cache: slot bookkeeping shared by all layers (where the chunk's tokens are written, what is visible).
            k_pages, v_pages: `[L, num_pages, page_size, G, d]` cached keys (post-RoPE) and values.
            impl: attention implementation (see `omnijax.kv.attention.attend`).
            track_scores: also return the attention mass each slot received, averaged over layers and heads.
            unroll: unroll the layer scan into straight-line code (static weight slices, no loop; compile time grows
                with depth). The default scan slices each layer's weights from the stacked arrays, which XLA:GPU
                does with a device copy per weight; unrolled, its prefill reads them in place. Which is faster is
                backend-dependent (`bench.omnitide.layer_loop`; on CPU the scan). Split layers (`split_layers`):
                the scan picks each layer's own arrays with `lax.switch`; unrolled, a Python loop runs over them.
            deepstack: optional `[n, B, T, D]` DeepStack features (Qwen3-Omni), zero away from visual tokens: level i
                is added to the hidden states after layer i, for i < n.
            tap: static; also return transformers' `hidden_states[tap]` of the chunk (`output_hidden_states`): 0 the
                input embeddings, k in 1 .. L-1 layer k-1's output (before a DeepStack level is added to it, as
                transformers records it), L the final-normed output. None (default): no tap, no extra work.

        Returns:
            `(hidden [B, T, D], k_pages, v_pages, mass [N, P] float32 or None, tapped [B, T, D] or None)` with the
            chunk's keys and values written into every layer.
        """
        c = self.config
        dt = c.jnp_dtype
        rot = chunk_rotation(c, positions)  # once for all layers, as the page index below
        cache = attention_lib.index_pages(cache)  # once for all layers (see `omnijax.kv.attention`)

        # The K/V stacks ride in the scan's carry: each layer writes its rows in place and attends to its own pages
        # of the stack. (Scanned as inputs and outputs instead, every call would rewrite both stacks whole.)
        if isinstance(self.layers, SplitLayers):
            xs, (per_layer, layer_view) = None, split_layer_views(c, self.layers.per_layer())
            ffn_of = None
        else:
            (xs, ffn_of), per_layer = layer_scan_inputs(c, self.layers.stacked()), None

        if tap is not None and not 0 <= tap <= c.num_layers:
            raise ValueError(f"tap must be a hidden_states index in [0, {c.num_layers}], got {tap}")
        inner = tap is not None and 0 < tap < c.num_layers  # a layer's output rides in the carry

        def layer(carry, p):
            h, k_pages, v_pages, i = carry[:4]
            # a stack's slice (scanned), a layer's own arrays (unrolled), or every layer's picked by i (split)
            p, ffn = (p, None if ffn_of is None else ffn_of(p)) if p is not None else layer_view(i)
            q, k, v = layer_qkv(c, p, h, rot)
            k_pages = write_layer(k_pages, cache.write_slots, k, layer=i)
            v_pages = write_layer(v_pages, cache.write_slots, v, layer=i)
            attn = attention_lib.attend(q, k_pages, v_pages, cache, impl=impl, with_mass=track_scores, layer=i)
            attn, mass = attn if track_scores else (attn, None)  # [B, T, H, d], [N, P]
            h = layer_finish(c, p, h, attn, ffn)
            tapped = (jnp.where(i == tap - 1, h, carry[4]),) if inner else ()
            if deepstack is not None:
                n = deepstack.shape[0]
                level = jax.lax.dynamic_index_in_dim(deepstack, jnp.minimum(i, n - 1), keepdims=False)
                h = jnp.where(i < n, h + level.astype(dt), h)
            return (h, k_pages, v_pages, i + 1, *tapped), mass

        # The layer number rides in the carry too: scanned as an input, it would be sliced from an array every layer.
        x = x.astype(dt)
        carry = (x, k_pages, v_pages, jnp.int32(0), *((jnp.zeros_like(x),) if inner else ()))
        if per_layer is not None and unroll:  # straight-line code over the layers' own arrays
            masses = []
            for p in per_layer:
                carry, m = layer(carry, p)
                masses.append(m)
            mass = None if masses[0] is None else jnp.stack(masses)
        else:
            carry, mass = jax.lax.scan(layer, carry, xs, length=c.num_layers, unroll=bool(unroll))
        h, k_pages, v_pages = carry[:3]
        tapped = None if tap is None else (x if tap == 0 else carry[4] if inner else
                                           rms_norm(h, self.final_norm[...], c.rms_norm_eps))
        return h, k_pages, v_pages, None if mass is None else jnp.mean(mass, axis=0), tapped
