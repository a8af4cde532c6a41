"""The paged-KV operations the tests call, each compiled once per shape and static setting and reused.

Called eagerly, `omnijax.kv.paged.reserve`, `append`, `attend` and friends dispatch op by op: every primitive of
their bodies is its own XLA program, compiled again for each new shape. A test of a few appends and one attention
paid for hundreds of tiny programs (tests/kv/test_kv.py: 1,912 programs, cold and warm alike in tracing and
lowering). The wrappers below run the very same package functions under `jax.jit` (as `cached_jit`, so a later run
loads each program without tracing it), so a test compiles one program per operation and shape; `write_and_attend`
does a chunk's whole "write layer 0, attend" in one program.

`SlotMeta` is a plain dataclass (not a pytree), so the wrappers take and rebuild it around the jitted call.
"""

from __future__ import annotations

import jax
import numpy as np

from omnijax.kept_executables import cached_jit
from omnijax.kv import attention, layout, paged
from omnijax.kv.paged import PagedKV, SlotMeta

init = cached_jit(paged.init, static_argnames=("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size",
                                            "batch", "max_pages", "position_axes", "dtype"))
"""`paged.init`, one program per shape (its argument checks run before tracing, as in the package)."""

release_pages = cached_jit(paged.release_pages, static_argnames=("holding_live",))
layout_stats = cached_jit(layout.layout_stats, static_argnames=("subblock",))
write_layer = cached_jit(paged.write_layer)
listed_first = cached_jit(paged.listed_first, static_argnames=("none",))


@cached_jit(static_argnames=("placement",))
def _reserve(kv: PagedKV, token_valid: jax.Array, pos: jax.Array, unit: jax.Array, span: jax.Array,
             offset: jax.Array, placement: str) -> tuple[PagedKV, jax.Array, jax.Array]:
    return paged.reserve(kv, token_valid, SlotMeta(pos=pos, unit=unit, span=span, offset=offset),
                         placement=placement)


def reserve(kv: PagedKV, token_valid: jax.Array | np.ndarray, meta: SlotMeta, *,
            placement: str = "first_fit") -> tuple[PagedKV, jax.Array, jax.Array]:
    """`paged.reserve`, compiled."""
    return _reserve(kv, token_valid, meta.pos, meta.unit, meta.span, meta.offset, placement=placement)


@cached_jit
def _append(kv: PagedKV, k_new: jax.Array, v_new: jax.Array, token_valid: jax.Array, pos: jax.Array,
            unit: jax.Array, span: jax.Array, offset: jax.Array) -> tuple[PagedKV, jax.Array]:
    return paged.append(kv, k_new, v_new, token_valid, SlotMeta(pos=pos, unit=unit, span=span, offset=offset))


def append(kv: PagedKV, k_new: jax.Array | np.ndarray, v_new: jax.Array | np.ndarray,
           token_valid: jax.Array | np.ndarray, meta: SlotMeta) -> tuple[PagedKV, jax.Array]:
    """`paged.append`, compiled."""
    return _append(kv, k_new, v_new, token_valid, meta.pos, meta.unit, meta.span, meta.offset)


attend = cached_jit(attention.attend, static_argnames=("impl", "with_mass"))
"""`attention.attend`, compiled per implementation (its shape checks run while tracing, so they still raise)."""


@cached_jit(static_argnames=("impl", "with_mass"))
def write_and_attend(kv: PagedKV, slots: jax.Array, q_order: jax.Array, q: jax.Array, k_new: jax.Array,
                     v_new: jax.Array, *, impl: str,
                     with_mass: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """One chunk's layer 0 in one program: writes `k_new`, `v_new` `[B, T, G, d]` to `slots` of layer 0's pages and
    attends `q` `[B, T, H, d]` over them (`paged.write_layer`, `CacheView.of`, `attention.attend`)."""
    k_pages = paged.write_layer(kv.k[0], slots, k_new)
    v_pages = paged.write_layer(kv.v[0], slots, v_new)
    view = attention.CacheView.of(kv, slots, q_order)
    return attention.attend(q, k_pages, v_pages, view, impl=impl, with_mass=with_mass)


@cached_jit(static_argnames=("precision",))
def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, key_order: jax.Array,
                    q_order: jax.Array, *, precision: jax.lax.Precision | None = None) -> jax.Array:
    """The shared oracle `attention.dense_attention`, compiled."""
    return attention.dense_attention(q, k, v, key_valid, key_order, q_order, precision=precision)


def contiguous_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_index: np.ndarray) -> np.ndarray:
    """The oracle `attention.dense_attention` over one sequence's contiguous keys `[S, G, d]` (write order = index)
    for queries `[T, H, d]` at indices `q_index`, at full precision."""
    S = k.shape[0]
    out = dense_attention(np.asarray(q)[None], np.asarray(k)[None], np.asarray(v)[None], np.ones((1, S), bool),
                          np.arange(S, dtype=np.int32)[None], np.asarray(q_index, np.int32)[None],
                          precision=jax.lax.Precision.HIGHEST)
    return np.asarray(out[0])


def meta(B: int, T: int, start: int = 0, axes: int = 1) -> SlotMeta:
    """Metadata of `B` sequences of `T` tokens at positions `start..start+T-1` (unit, span and offset 0), as host
    arrays (no eager program)."""
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(start, start + T, dtype=np.int32), (axes, B, T)))
    z = np.zeros((B, T), np.int32)
    return SlotMeta(pos=pos, unit=z, span=z, offset=z)


active_pages = cached_jit(attention.active_pages)
index_pages = cached_jit(attention.index_pages)
copy_rows = cached_jit(paged.copy_rows, static_argnames=("chunk", "transform"))
