"""Retention policy contract, registry, and the shared machinery that applies a plan to the cache.

A policy is a frozen dataclass of static hyperparameters (hashable, so it is part of the compiled program) with two
pure, vectorised methods over a `SequenceView` (each sequence's slots gathered in page-table order):

    trigger(view) -> [B] bool       trim this sequence now (e.g. retained cells above the high watermark)
    plan(view)    -> [B, S] bool    keep mask, a subset of `view.live` (read only where `trigger` is True)

and a class attribute `reindex`: whether survivors' positions are closed up after eviction. A policy that ranks by
the cached keys and values sets the class attribute `needs_kv = True`; its plan is then `plan(view, features)` with
`SlotFeatures` (the keys and value norms of the same slots, averaged over layers and KV heads), gathered only when it
trims. `trim` runs both inside
`lax.cond` (no work unless some sequence triggers) and `apply` writes the plan back: dropped slots become invalid
and, when re-indexing, every survivor's position is shifted down by the freed position values below it and its
cached key is re-rotated by the same delta (all layers; angles in float32; a uniform shift on Qwen's three axes is the
1D rotation). Causality is by write order, which re-indexing never changes.

Re-indexing rule (docs/architecture.md): a survivor occupies [min(p), max(p)] over its position components; every value
in [0, next_pos) covered by no survivor is freed; a survivor's delta is the number of freed values below its min(p);
`next_pos` drops by the total freed. For contiguous 1D positions that is the number of deleted tokens before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from omnijax.chunks.spans import SpanKind
from omnijax.kv import rope as rope_lib
from omnijax.kv.page_sharing import unshare
from omnijax.kv.paged import PagedKV, copy_rows, listed_first, table_slots
from omnijax.kv.quant_kv import dense
from omnijax.registry import Registry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceView:
    """Each sequence's slots in page-table order (S = max_pages * page_size); dead slots have `live` False.

    Attributes:
        live: `[B, S]` bool, slot holds a live token of the sequence.
        pos: `[A, B, S]` int32 positions.
        unit: `[B, S]` int32 unit ids.
        span: `[B, S]` int32 `SpanKind`.
        offset: `[B, S]` int32 offset within the span.
        order: `[B, S]` int32 write order: larger is newer. Use it (never the slot index) for age.
        score: `[B, S]` float32 accumulated attention mass received (H2O); zero where never tracked.
        retained: `[B]` int32 live slots.
    """

    live: jax.Array
    pos: jax.Array
    unit: jax.Array
    span: jax.Array
    offset: jax.Array
    order: jax.Array
    score: jax.Array
    retained: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotFeatures:
    """What the cache holds at each slot of a `SequenceView`, for policies with `needs_kv` (query-agnostic KV
    compression: InfiniPot-V, StreamMem).

    Attributes:
        key: `[B, S, d]` float32 cached (rotated) key, averaged over layers and KV heads.
        value_norm: `[B, S]` float32 L2 norm of the cached value, averaged over layers and KV heads.
    """

    key: jax.Array
    value_norm: jax.Array


def slot_features(kv: PagedKV) -> SlotFeatures:
    """Gathers `SlotFeatures` in page-table order (dead slots hold whatever their page holds: mask by `live`)."""
    flat, _ = table_slots(kv)
    L, N, P, G, d = kv.k.shape
    key = dense(kv.k, jnp.float32).mean(axis=(0, 3)).reshape(N * P, d)  # int8 pools dequantised
    value_norm = jnp.linalg.norm(dense(kv.v, jnp.float32), axis=-1).mean(axis=(0, 3)).reshape(N * P)
    return SlotFeatures(key=key[flat], value_norm=value_norm[flat])


class RetentionPolicy(Protocol):
    """What a retention policy has (module docstring); `REGISTRY` holds the ones omnijax ships."""

    name: ClassVar[str]
    reindex: ClassVar[bool]
    # Optional ClassVar `needs_scores = True`: the stream then accumulates attention mass into `kv.score`.
    # Optional method `max_untrimmed_cells() -> int`: retained cells up to which `trigger` is False for every
    # sequence, whatever the slots hold (a bound; `untrimmed_capacity`). Every policy omnijax ships has it.

    def trigger(self, view: SequenceView) -> jax.Array:
        """`[B]` bool: trim these sequences now."""

    def plan(self, view: SequenceView) -> jax.Array:
        """`[B, S]` bool keep mask (subset of `view.live`)."""


# Names the command lines accept for a registered policy.
ALIASES = {"full": "no_slide", "unbounded": "no_slide"}
# The retention policies by name (`omnijax.registry.Registry`): `register` adds a class under its `name`.
REGISTRY: Registry[RetentionPolicy] = Registry("retention policy", RetentionPolicy, aliases=ALIASES,
                                               hint="omnijax.retention.get_policy")
register = REGISTRY.register


NEVER_TRIMS = 2 ** 31 - 1  # `max_untrimmed_cells` of a policy that never trims (cell counts are int32)


def untrimmed_capacity(policy: RetentionPolicy) -> int:
    """Retained cells up to which `policy` never trims (its `max_untrimmed_cells()`; 0 for a policy without one, which
    may trim at any size). A stream whose cells stay within it can run a program without the trim
    (`omnijax.streaming.step.chunk_step(..., trim=False)`) and compute exactly what the trimming one does."""
    bound = getattr(policy, "max_untrimmed_cells", None)
    return 0 if bound is None else int(bound())


def check_policy(policy: Any) -> RetentionPolicy:
    """Returns `policy` if it is a retention policy object (with `trigger` and `plan`); refuses a policy's name, its
    class or anything else, with a hint."""
    return REGISTRY.check(policy, "policy")


def get_policy(spec: str, *, defaults: dict[str, dict] | None = None, **hyperparameters: Any) -> RetentionPolicy:
    """The one way a policy's name becomes a policy object (Python and command lines alike).

    `spec` is a registered name (`REGISTRY`; aliases `full` and `unbounded` are NoSlide), optionally followed by
    `:key=value,...` hyperparameters as a command line writes them (ints, floats, true/false, none); keyword
    `hyperparameters` are added to those. `defaults` maps a registered name to settings used when that policy is
    chosen and neither the spec nor the keywords set them (a command line's own flags, e.g. `--sink`).
    Example: `get_policy("omnipick:high_watermark=600,low_watermark=400")`.
    """
    if not isinstance(spec, str):
        raise TypeError(f"get_policy takes a policy name, got {spec!r}")
    return REGISTRY.create(spec, defaults=defaults, **hyperparameters)


def sequence_view(kv: PagedKV) -> SequenceView:
    """Gathers the slot metadata of every sequence in page-table order."""
    flat, exists = table_slots(kv)
    take = lambda field: field.reshape(-1)[flat]  # noqa: E731
    live = take(kv.valid) & exists
    return SequenceView(
        live=live, pos=jax.vmap(take)(kv.pos), unit=take(kv.unit), span=take(kv.span).astype(jnp.int32),
        offset=take(kv.offset), order=take(kv.order), score=take(kv.score),
        retained=jnp.sum(live, axis=1).astype(jnp.int32))


def freed_below(view: SequenceView, keep: jax.Array, next_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Re-indexing deltas: `(delta [B, S] int32, total freed [B] int32)` (see the module docstring).

    Survivors sorted by min(p); a running max of max(p) is the covered extent so far; the uncovered values just
    before survivor k number max(min(p)_k - extent_before_k - 1, 0), and their cumsum is k's delta. Values above
    the top survivor up to `next_pos` are freed too. Sort-based, so it needs no array as long as the position range.
    """
    lo = jnp.min(view.pos, axis=0)  # [B, S]
    hi = jnp.max(view.pos, axis=0)
    big = jnp.iinfo(jnp.int32).max

    def one(keep_b, lo_b, hi_b, next_b):
        # Covered values = union of [lo, hi] over survivors. Sort survivors by lo; a running max of hi gives the
        # covered extent so far; a gap before survivor k is lo_k - (running max hi before k + 1) when positive.
        lo_k = jnp.where(keep_b, lo_b, big)
        idx = jnp.argsort(lo_k)
        lo_s, hi_s, keep_s = lo_k[idx], jnp.where(keep_b, hi_b, -1)[idx], keep_b[idx]
        reach = jax.lax.cummax(hi_s)  # covered extent up to and including k
        before = jnp.concatenate([jnp.array([-1], reach.dtype), reach[:-1]])  # extent before k
        gap = jnp.where(keep_s, jnp.maximum(lo_s - before - 1, 0), 0)
        freed_before = jnp.cumsum(gap)  # freed values below lo of survivor k
        top = jnp.max(jnp.where(keep_s, reach, -1))
        total = freed_before[-1] + jnp.maximum(next_b - top - 1, 0)
        delta = jnp.zeros_like(lo_b).at[idx].set(freed_before.astype(lo_b.dtype))
        return jnp.where(keep_b, delta, 0), total.astype(jnp.int32)

    return jax.vmap(one)(keep, lo, hi, next_pos)


def apply(kv: PagedKV, keep: jax.Array, next_pos: jax.Array, *, reindex: bool, rope: tuple[float, tuple | None],
          view: SequenceView | None = None, shared_pages: bool = True) -> tuple[PagedKV, jax.Array, jax.Array]:
    """Applies a keep mask `[B, S]` (page-table order) to the cache.

    Args:
        kv: the cache.
        keep: slots to keep (dead slots are ignored).
        next_pos: `[B]` position cursor.
        reindex: close the freed position gaps, re-rotating cached keys.
        rope: `(theta, mrope_section)` of the model, for re-rotation.
        view: `sequence_view(kv)` when the caller has it already.
        shared_pages: (static) the cache may hold pages shared between rows (an engine's forked rows): they are
            copied before they change. False for a cache no row shares a page of (a `Session`'s, `stream`'s,
            `evaluate`'s: they never fork rows), whose program then has no copy-on-write (a third of compiling a
            trim).

    Returns:
        `(kv, next_pos, evicted [B] int32)`.
    """
    view = sequence_view(kv) if view is None else view
    keep = keep & view.live
    drop = view.live & ~keep
    delta, total = freed_below(view, keep, next_pos) if reindex else (None, None)
    shift = keep & (delta > 0) if reindex else jnp.zeros_like(keep)  # survivors whose key is re-rotated
    # Pages shared with other rows (n choices of one prompt) are copied before they change (`kv.page_sharing`).
    if shared_pages:
        kv, writable = unshare(kv, drop | shift, evicts=drop)
        drop, shift = drop & writable, shift & writable
    flat, _ = table_slots(kv)
    N, P = kv.num_pages, kv.page_size
    target = jnp.where(drop, flat, N * P).reshape(-1)
    valid = kv.valid.reshape(-1).at[target].set(False, mode="drop").reshape(N, P)
    evicted = jnp.sum(drop, axis=1).astype(jnp.int32)
    kv = kv.replace(valid=valid)
    if not reindex:
        return kv, next_pos, evicted
    moved = jnp.where(shift, flat, N * P).reshape(-1)  # only survivors that shift
    d = delta.reshape(-1)
    pos = jax.vmap(lambda p: p.reshape(-1).at[moved].add(-d, mode="drop").reshape(N, P))(kv.pos)
    # Re-rotate the shifted keys by -delta (the rotation by a position shift is the rotation at that negative
    # position), in place and only those: listed first, then read, rotated and written back over every layer
    # (int8 keys: dequantised, rotated in float32 and requantised with fresh per-token scales by `copy_rows`).
    theta, section = rope
    shifted, count = listed_first(moved < N * P, jnp.stack([moved, d]), N * P)  # [2, B*S]: slot, delta
    angles = rope_lib.rope_angles(-shifted[1][None], kv.k.shape[-1], theta, section)  # [B*S, d/2]
    L, G, hd = kv.k.shape[0], kv.k.shape[3], kv.k.shape[4]
    (k,) = copy_rows((kv.k.reshape(L, N * P, G, hd),), shifted[0], shifted[0], count, transform=rope_lib.apply_rope,
                     extra=angles)
    k = k.reshape(kv.k.shape)
    return kv.replace(pos=pos, k=k), next_pos - total, evicted


def trim(policy: RetentionPolicy, kv: PagedKV, next_pos: jax.Array, *, rope: tuple[float, tuple | None],
         active: jax.Array | None = None, shared_pages: bool = True) -> tuple[PagedKV, jax.Array, jax.Array]:
    """Runs a policy inside the compiled program: `lax.cond` on any sequence triggering, then plan and apply.

    `active [B]` bool: the sequences this step fed (default all); the others are never trimmed, so a sequence that
    sat out a batched step (a server's idle session) keeps exactly what it would have kept run alone.
    `shared_pages` (static): see `apply`. Returns `(kv, next_pos, evicted [B] int32)`.
    """
    view = sequence_view(kv)
    fire = policy.trigger(view)
    if active is not None:
        fire = fire & active

    def run(kv, next_pos):
        plan = policy.plan(view, slot_features(kv)) if getattr(policy, "needs_kv", False) else policy.plan(view)
        keep = jnp.where(fire[:, None], plan, view.live)
        return apply(kv, keep, next_pos, reindex=policy.reindex, rope=rope, view=view, shared_pages=shared_pages)

    def skip(kv, next_pos):
        return kv, next_pos, jnp.zeros(next_pos.shape, jnp.int32)

    return jax.lax.cond(jnp.any(fire), run, skip, kv, next_pos)


def is_system(view: SequenceView) -> jax.Array:
    """`[B, S]` live slots of the pinned system prefix."""
    return view.live & (view.span == SpanKind.SYSTEM)


@register
@dataclasses.dataclass(frozen=True)
class NoSlide:
    """Full context: never evicts."""

    name: ClassVar[str] = "no_slide"
    reindex: ClassVar[bool] = False

    def trigger(self, view: SequenceView) -> jax.Array:
        return jnp.zeros(view.retained.shape, bool)

    def max_untrimmed_cells(self) -> int:
        """Never trims: `NEVER_TRIMS`."""
        return NEVER_TRIMS

    def plan(self, view: SequenceView) -> jax.Array:
        return view.live
