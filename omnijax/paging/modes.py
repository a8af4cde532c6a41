"""Paging modes as implementations of one protocol, `PagingMode`, registered by name in `MODES`.

A mode says where new tokens go (`placement`: which free slots `omnijax.kv.paged.reserve` fills), how many pages a
sequence may need beyond its tokens rounded up (`extra_pages`), and what happens to the physical layout after a
retention policy evicts (`relayout`, which reports the slots it copied: its migration cost). Modes are frozen
dataclasses of static settings, part of the compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV
from omnijax.paging import eager, omnipage
from omnijax.registry import Registry

__all__ = ["MODES", "Eager", "Native", "OrderedSuffix", "PagingMode", "TileSkip", "register"]


class PagingMode(Protocol):
    """What a paging mode has (module docstring); `MODES` holds the ones omnijax ships."""

    name: ClassVar[str]

    @property
    def placement(self) -> str:
        """`"by_class"` (OmniPage's class-aware placement) or `"first_fit"` (every hole in table order)."""
        ...

    @property
    def extra_pages(self) -> int:
        """Pages per sequence a session may need beyond its tokens rounded up to pages, without eviction."""
        ...

    def relayout(self, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
        """After retention (`evicted [B]`: slots each sequence dropped): `(kv, moved [B] int32)`."""
        ...


# The paging modes by name (`omnijax.registry.Registry`): `register` adds a class under its `name`.
MODES: Registry[PagingMode] = Registry("paging mode", PagingMode, hint="omnijax.paging.Paging")
register = MODES.register


def _when_evicted(run, kv: PagedKV, evicted: jax.Array) -> tuple[PagedKV, jax.Array]:
    """`run(kv)` only when some sequence evicted (`lax.cond`); otherwise nothing moves."""
    none = jnp.zeros(evicted.shape, jnp.int32)
    return jax.lax.cond(jnp.any(evicted > 0), run, lambda kv: (kv, none), kv)


@register
@dataclasses.dataclass(frozen=True)
class Native:
    """Holes stay where eviction left them until new tokens refill them (first-fit, token by token); the page table
    is never shortened: the contiguous-cache baseline."""

    name: ClassVar[str] = "native"
    placement: ClassVar[str] = "first_fit"
    extra_pages: ClassVar[int] = 0

    def relayout(self, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
        return kv, jnp.zeros(evicted.shape, jnp.int32)


@register
@dataclasses.dataclass(frozen=True)
class TileSkip:
    """OmniPage for tile-skipping kernels: class-aware placement (system-prefix tokens in MUST_KEEP pages only, every
    other new token in RECENT pages only), selective migration within a class, accepted only if active pages or
    subblocks decrease. System tokens and the others never share a page, so each group rounds up to pages on its
    own: one extra page per sequence."""

    name: ClassVar[str] = "tile_skip"
    placement: ClassVar[str] = "by_class"
    extra_pages: ClassVar[int] = 1

    def relayout(self, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
        return _when_evicted(lambda kv: omnipage.tile_skip(kv, subblock), kv, evicted)


@register
@dataclasses.dataclass(frozen=True)
class OrderedSuffix:
    """OmniPage for span-traversing kernels: packs the shortest suffix that shortens the page-rounded span by at least
    `min_pages` pages, order preserved. It packs entries of any class, so it places first-fit (OmniTide §6.2).

    Attributes:
        min_pages: the least span reduction, in pages, worth a migration (>= 1).
    """

    min_pages: int = 1
    name: ClassVar[str] = "ordered_suffix"
    placement: ClassVar[str] = "first_fit"
    extra_pages: ClassVar[int] = 0

    def __post_init__(self):
        if isinstance(self.min_pages, bool) or not isinstance(self.min_pages, int) or self.min_pages < 1:
            raise ValueError(f"min_pages must be >= 1, got {self.min_pages}")

    def relayout(self, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
        return _when_evicted(lambda kv: omnipage.ordered_suffix(kv, self.min_pages), kv, evicted)


@register
@dataclasses.dataclass(frozen=True)
class Eager:
    """Packs every survivor after every eviction: the attention-time oracle."""

    name: ClassVar[str] = "eager"
    placement: ClassVar[str] = "first_fit"
    extra_pages: ClassVar[int] = 0

    def relayout(self, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
        return _when_evicted(eager.compact, kv, evicted)
