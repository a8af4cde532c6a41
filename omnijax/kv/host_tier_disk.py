"""The on-disk spill tier under the host tier (issue 40): when the host budget is full, the oldest units' keys and
values move to files in a directory instead of being dropped; the directory has its own bytes budget, beyond which the
oldest spilled units are dropped (reported, never silent).

A spilled record (`UnitKV.on_disk`) is the same `UnitKV` whose `k` and `v` are read-only memory maps of two `.npy`
files (`numpy.load(mmap_mode="r")`); its summary and metadata stay in host memory. Everything that reads a record
(scoring, `omnijax.retention.recall.recall_into`, snapshots) reads the maps as arrays, so a spilled unit is
recalled exactly as it was stored, through the page cache. "mean" scoring reads the summaries only (no disk read);
"two_stage" reads the keys of its shortlist only; "mass" and "max" read every stored key, the spilled ones from disk.

Each session spills into its own subdirectory of `Recall(disk_dir=...)` (`open_disk`), removed when the session's
`DiskTier` is collected. A dropped (or recalled-and-kept) spilled unit's files are deleted; a snapshot that still
holds the record keeps reading it through its map (POSIX keeps an unlinked, mapped file's data).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import uuid
import weakref

import numpy as np

from omnijax.kv.host_tier import HostTier, UnitKV


@dataclasses.dataclass(frozen=True)
class DiskTier:
    """Where a session spills and how much it may hold there.

    Attributes:
        directory: the session's spill directory.
        budget_bytes: most bytes of spilled keys and values (> 0).
    """

    directory: str
    budget_bytes: int


def check_directory(path: str) -> None:
    """Refuses (ValueError naming the path and the reason) a spill directory that cannot be created or written."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".omnijax-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"Recall(disk_dir={path!r}): the spill directory is not writable ({e.strerror or e})") from e


def open_disk(parent: str, budget_bytes: int) -> DiskTier:
    """A fresh spill directory under `parent` (checked by `check_directory`), deleted with the returned object."""
    check_directory(parent)
    directory = tempfile.mkdtemp(prefix="omnijax-recall-", dir=parent)
    disk = DiskTier(directory=directory, budget_bytes=int(budget_bytes))
    weakref.finalize(disk, shutil.rmtree, directory, ignore_errors=True)
    return disk


def spill(unit: UnitKV, directory: str) -> UnitKV:
    """`unit` with its keys and values written to `directory` and read back as read-only memory maps."""
    stem = os.path.join(directory, f"u{unit.unit}-{uuid.uuid4().hex[:12]}")
    maps = {}
    for name in ("k", "v"):
        path = f"{stem}.{name}.npy"
        np.save(path, np.asarray(getattr(unit, name)))
        maps[name] = np.load(path, mmap_mode="r")
    return dataclasses.replace(unit, **maps)


def spill_files(unit: UnitKV) -> list[str]:
    """The spill files of a record (none for a record in host memory)."""
    if not unit.on_disk:
        return []
    return [str(a.filename) for a in (unit.k, unit.v) if isinstance(a, np.memmap) and a.filename]


def remove_files(unit: UnitKV) -> None:
    """Deletes a spilled record's files (those already gone are skipped)."""
    for path in spill_files(unit):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


@dataclasses.dataclass(frozen=True)
class SpillReport:
    """What one `add_spilling` did.

    Attributes:
        added: unit ids stored (in memory or spilled).
        spilled: unit ids moved to disk by this call.
        dropped: unit ids dropped (from disk, or from memory where the disk could not take them).
        dropped_bytes: their bytes.
    """

    added: tuple[int, ...]
    spilled: tuple[int, ...]
    dropped: tuple[int, ...]
    dropped_bytes: int


def add_spilling(tier: HostTier, disk: DiskTier, *new: UnitKV) -> tuple[HostTier, SpillReport]:
    """`HostTier.add` with a disk tier: `new` is stored as the newest units; while the host bytes exceed
    `tier.budget_bytes`, the oldest unit still in memory is spilled to disk (dropped instead when its keys and values
    alone exceed the disk budget); while the disk bytes exceed `disk.budget_bytes`, the oldest spilled unit is dropped
    and its files deleted; if the host budget is still exceeded (spilled records' summaries and metadata stay in
    memory), the oldest units are dropped. Storage order (oldest first) is kept. `tier` is unchanged (files of units
    it holds may be spilled anew, never altered)."""
    for u in new:
        if not isinstance(u, UnitKV):
            raise TypeError(f"add_spilling takes UnitKV records, got {type(u).__name__}")
    units = list(tier.units) + list(new)
    fresh = [False] * len(tier.units) + [True] * len(new)  # parallel to units: added by this call
    spilled, dropped, dropped_bytes, spilled_bytes = [], [], 0, 0

    def host() -> int:
        return sum(u.host_nbytes for u in units)

    def disk_used() -> int:
        return sum(u.disk_nbytes for u in units)

    def drop(i: int) -> None:
        nonlocal dropped_bytes
        gone = units.pop(i)
        fresh.pop(i)
        remove_files(gone)
        dropped.append(gone.unit)
        dropped_bytes += gone.nbytes

    while host() > tier.budget_bytes:
        i = next((i for i, u in enumerate(units) if not u.on_disk), None)
        if i is None:
            break
        if int(units[i].k.nbytes + units[i].v.nbytes) > disk.budget_bytes:
            drop(i)
            continue
        units[i] = spill(units[i], disk.directory)
        spilled.append(units[i].unit)
        spilled_bytes += units[i].disk_nbytes
        while disk_used() > disk.budget_bytes:
            drop(next(j for j, u in enumerate(units) if u.on_disk))
    while host() > tier.budget_bytes:
        drop(0)
    added = tuple(u.unit for u, f in zip(units, fresh) if f)
    report = SpillReport(added=added, spilled=tuple(spilled), dropped=tuple(dropped), dropped_bytes=dropped_bytes)
    out = dataclasses.replace(tier, units=tuple(units), dropped_units=tier.dropped_units + len(dropped),
                              dropped_bytes=tier.dropped_bytes + dropped_bytes,
                              spilled_units=tier.spilled_units + len(spilled),
                              spilled_bytes=tier.spilled_bytes + spilled_bytes)
    return out, report
