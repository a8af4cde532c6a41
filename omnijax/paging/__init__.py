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
reports the slots it copied (`ChunkStats.moved`), which is its migration cost. Each is a `PagingMode`
(`omnijax.paging.modes`), registered by name in `MODES`; `Paging(mode=name)` names one with its settings.
"""

from __future__ import annotations

import dataclasses

import jax

from omnijax.kv.paged import PagedKV
from omnijax.paging import eager, migration, omnipage
from omnijax.paging.modes import MODES, Eager, Native, OrderedSuffix, PagingMode, TileSkip

PAGING_MODES = tuple(MODES)  # the names of the modes omnijax ships: ("native", "tile_skip", "ordered_suffix", "eager")


@dataclasses.dataclass(frozen=True)
class Paging:
    """A paging mode by name and its settings (static: part of the compiled program); `mode_object` is the
    `PagingMode` it stands for.

    Attributes:
        mode: a registered mode name (`MODES`; those omnijax ships are `PAGING_MODES`).
        min_pages: `ordered_suffix` only: the least span reduction, in pages, worth a migration.
    """

    mode: str = "native"
    min_pages: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown paging mode {self.mode!r}; available: {MODES.names()}")
        if self.min_pages < 1:
            raise ValueError(f"min_pages must be >= 1, got {self.min_pages}")

    @property
    def mode_object(self) -> PagingMode:
        """The registered mode with this record's settings (those of its fields it has)."""
        cls = MODES[self.mode]
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        return cls(**({"min_pages": self.min_pages} if "min_pages" in fields else {}))

    @property
    def placement(self) -> str:
        """Which free slots new tokens take (`omnijax.kv.paged.reserve`): OmniPage's class-aware placement for
        `tile_skip`; every hole first-fit otherwise. `ordered_suffix` replaces class-based placement (OmniTide §6.2:
        it packs entries of any class), `native` is the contiguous-cache baseline and `eager` the packing oracle, so
        none of them keeps classes apart."""
        return self.mode_object.placement

    @property
    def extra_pages(self) -> int:
        """Pages per sequence a session may need beyond its tokens rounded up to pages, without eviction: one for
        `tile_skip`, whose system tokens and other tokens never share a page (so each group rounds up on its own),
        none for the first-fit modes."""
        return self.mode_object.extra_pages


def as_paging(paging: str | Paging) -> Paging:
    """Accepts a mode name or a `Paging`."""
    return paging if isinstance(paging, Paging) else Paging(mode=paging)


def relayout(paging: Paging, kv: PagedKV, evicted: jax.Array, subblock: int) -> tuple[PagedKV, jax.Array]:
    """Runs the mode after retention, only when some sequence evicted. Returns `(kv, moved [B] int32)`."""
    return paging.mode_object.relayout(kv, evicted, subblock)


__all__ = ["MODES", "PAGING_MODES", "Eager", "Native", "OrderedSuffix", "Paging", "PagingMode", "TileSkip",
           "as_paging", "relayout", "eager", "migration", "omnipage"]
