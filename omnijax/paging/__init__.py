"""Physical KV layout modes (docs/architecture.md, "Physical layout — OmniPage").

`Paging(mode=...)` picks what happens to the physical layout after a retention policy evicts:

    native          holes stay where eviction left them until new tokens refill them (first-fit, token by token);
                    the page table is never shortened
    tile_skip       OmniPage for tile-skipping kernels: class-aware placement (system-prefix tokens in MUST_KEEP
                    pages only, every other new token in RECENT pages only), selective migration within a class,
                    accepted only if active pages or subblocks decrease (`omnipage`)
    ordered_suffix  OmniPage for span-traversing kernels: pack the shortest suffix that shortens the page-rounded
                    span by at least `min_pages` pages, order preserved (`omnipage`)
    eager           pack every survivor after every eviction: the attention-time oracle (`eager`)

Every mode but `native` also drops emptied pages from the page table and returns them to the pool. Each mode
reports the slots it copied (`ChunkStats.moved`), which is its migration cost.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from omnijax.kv.paged import PagedKV
from omnijax.paging import eager, migration, omnipage

PAGING_MODES = ("native", "tile_skip", "ordered_suffix", "eager")


@dataclasses.dataclass(frozen=True)
class Paging:
    """A paging mode and its settings (static: part of the compiled program).

    Attributes:
        mode: one of `PAGING_MODES`.
        min_pages: `ordered_suffix` only: the least span reduction, in pages, worth a migration.
    """

    mode: str = "native"
    min_pages: int = 1

    def __post_init__(self):
        if self.mode not in PAGING_MODES:
            raise ValueError(f"unknown paging mode {self.mode!r}; available: {PAGING_MODES}")
        if self.min_pages < 1:
            raise ValueError(f"min_pages must be >= 1, got {self.min_pages}")

    @property
    def placement(self) -> str:
        """Which free slots new tokens take (`omnijax.kv.paged.reserve`): OmniPage's class-aware placement for
        `tile_skip`; every hole first-fit otherwise. `ordered_suffix` replaces class-based placement (OmniTide §6.2:
        it packs entries of any class), `native` is the contiguous-cache baseline and `eager` the packing oracle, so
        none of them keeps classes apart."""
        return "by_class" if self.mode == "tile_skip" else "first_fit"

    @property
    def extra_pages(self) -> int:
        """Pages per sequence a session may need beyond its tokens rounded up to pages, without eviction: one for
        `tile_skip`, whose system tokens and other tokens never share a page (so each group rounds up on its own),
        none for the first-fit modes."""
        return 1 if self.placement == "by_class" else 0


def as_paging(paging: str | Paging) -> Paging:
    """Accepts a mode name or a `Paging`."""
    return paging if isinstance(paging, Paging) else Paging(mode=paging)


def relayout(paging: Paging, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
    """Runs the mode after retention, only when some sequence evicted. Returns `(kv, moved [B] int32)`."""
    none = jnp.zeros(evicted.shape, jnp.int32)
    if paging.mode == "native":
        return kv, none
    run = {"tile_skip": lambda kv: omnipage.tile_skip(kv, subblock),
           "ordered_suffix": lambda kv: omnipage.ordered_suffix(kv, paging.min_pages),
           "eager": eager.compact}[paging.mode]
    return jax.lax.cond(jnp.any(evicted > 0), run, lambda kv: (kv, none), kv)


__all__ = ["PAGING_MODES", "Paging", "as_paging", "relayout", "eager", "migration", "omnipage"]
