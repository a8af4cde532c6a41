"""Random paged layouts for OmniPage's tests (tests/paging/test_omnipage_plans.py, test_omnipage_modes.py): shared
pools, full, empty and single-survivor pages, mixed classes, as numpy arrays for the plain-Python references
(tests/_support/reference_paging.py) and as a `PagedKV` for the jitted code; built once per shape and process."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.chunks.spans import SpanKind as K
from omnijax.kv import paged
from omnijax.kv.paged import PageClass
from tests._support import reference_paging as ref
from tests._support import soak

# (page size, batch) -> (pool pages N, page-table width M). With B = 3 the sequences compete for the pool.
SHAPES = {(4, 1): (10, 8), (4, 3): (16, 8), (8, 1): (8, 6), (8, 3): (12, 6)}
LAYOUTS = 60 * soak.factor()  # per shape: 240 layouts, 480 sequences (OMNIJAX_SOAK multiplies them)
CLASSES = (PageClass.MUST_KEEP, PageClass.SELECTED, PageClass.RECENT)
PAGE_KINDS = ("full", "empty", "single", "all_but_one", "random")
PAGE_KIND_P = (0.2, 0.15, 0.2, 0.1, 0.35)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A random cache as numpy arrays (for the references) and as a `PagedKV` (for the jitted code)."""

    table: np.ndarray  # [B, M]
    valid: np.ndarray  # [N, P]
    page_class: np.ndarray  # [N]
    span: np.ndarray  # [N, P]
    free: np.ndarray  # pages on the free stack
    fields: dict  # every slot field of the pool, for content checks
    kv: paged.PagedKV


@functools.cache
def _empty(P, B):
    N, M = SHAPES[(P, B)]
    return jax.jit(lambda: paged.init(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=N, page_size=P, batch=B,
                                      max_pages=M, position_axes=1))()


def _page_valid(rng, P, kind):
    if kind == "full":
        return np.ones(P, bool)
    if kind == "empty":
        return np.zeros(P, bool)
    if kind in ("single", "all_but_one"):
        out = np.full(P, kind == "all_but_one")
        out[rng.integers(P)] = kind == "single"
        return out
    return rng.random(P) < rng.uniform(0.1, 0.9)


def build(P, B, table, valid, page_class, span, rng):
    """A `PagedKV` whose tables, validity, classes and spans are given; the other slot fields are random and
    distinct, the free stack holds the pages in no table, each sequence's high-water mark lies in its last entry."""
    N, M = SHAPES[(P, B)]
    used = table[table >= 0]
    free = rng.permutation(np.setdiff1d(np.arange(N), used)).astype(np.int32)
    seq_slots = np.zeros(B, np.int32)
    for b in range(B):
        n = int(np.sum(table[b] >= 0))
        if n:
            last = max([j for j, x in enumerate(ref.live_slots(table[b], valid, P)) if x], default=-1)
            seq_slots[b] = rng.integers(max(last + 1, (n - 1) * P + 1), n * P + 1)
    fields = {
        "k": rng.standard_normal((1, N, P, 1, 2)).astype(np.float32),
        "v": rng.standard_normal((1, N, P, 1, 2)).astype(np.float32),
        "pos": rng.integers(0, 1000, (1, N, P)).astype(np.int32),
        "order": rng.permutation(N * P).reshape(N, P).astype(np.int32),
        "unit": rng.integers(0, 50, (N, P)).astype(np.int32),
        "span": span.astype(np.int8),
        "offset": rng.integers(0, 50, (N, P)).astype(np.int32),
        "score": rng.random((N, P)).astype(np.float32),
    }
    kv = _empty(P, B).replace(
        **{name: jnp.asarray(value) for name, value in fields.items()},
        valid=jnp.asarray(valid), page_table=jnp.asarray(table, jnp.int32),
        page_class=jnp.asarray(page_class, jnp.int8), seq_slots=jnp.asarray(seq_slots),
        next_order=jnp.full((B,), N * P, jnp.int32),
        free_stack=jnp.asarray(np.concatenate([free, rng.permutation(used)]).astype(np.int32)),
        num_free=jnp.asarray(len(free), jnp.int32))
    return Layout(table=table, valid=valid, page_class=page_class, span=span, free=free, fields=fields, kv=kv)


def random_layout(rng, P, B):
    N, M = SHAPES[(P, B)]
    pages = rng.permutation(N)
    table = np.full((B, M), -1, np.int32)
    used = 0
    for b in range(B):
        n = min(int(rng.integers(0, M + 1)), N - used)
        table[b, :n] = pages[used:used + n]
        used += n
    valid = np.zeros((N, P), bool)
    page_class = np.full(N, PageClass.FREE, np.int8)
    span = rng.choice([K.SYSTEM, K.TEXT, K.IMAGE], size=(N, P)).astype(np.int8)
    for b in range(B):
        one_class = CLASSES[rng.integers(3)] if rng.random() < 0.4 else None  # more same-class neighbours
        for page in table[b][table[b] >= 0]:
            valid[page] = _page_valid(rng, P, PAGE_KINDS[rng.choice(len(PAGE_KINDS), p=PAGE_KIND_P)])
            page_class[page] = one_class if one_class is not None else CLASSES[rng.integers(3)]
            if rng.random() < 0.3:
                span[page] = K.SYSTEM
    return build(P, B, table, valid, page_class, span, rng)


@functools.cache
def layouts(P, B):
    rng = np.random.default_rng(zlib.crc32(f"omnipage-{P}-{B}".encode()))
    return tuple(random_layout(rng, P, B) for _ in range(LAYOUTS))


def moves_of(dst_row) -> dict[int, int]:
    return {int(j): int(d) for j, d in enumerate(dst_row) if d >= 0}


def describe(layout, b, P) -> str:
    """One sequence's entries as `page:class:live bits`, for failure messages."""
    rows = []
    for page in layout.table[b]:
        if page < 0:
            break
        bits = "".join("1" if x else "0" for x in layout.valid[page])
        rows.append(f"{page}:{PageClass(int(layout.page_class[page])).name}:{bits}")
    return f"P={P} seq {b}: " + " ".join(rows)
