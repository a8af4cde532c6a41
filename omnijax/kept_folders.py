"""The folders of the executables `omnijax.kept_executables` keeps: one folder per jax version and settings under
`<cache dir>/executables/`, the least recently used folders and files removed (`version_dir`, `bound_size`), and
more names of one file (`link`: an executable kept by its source key and by its traced program, `PROGRAMS_DIR`)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

KEEP_VERSIONS = 16  # folders of executables kept past a day unused: the most recently used jax versions and settings
# (one run of the test suite uses seven or more -- LLVM optimisation on and off, subprocesses with production flags, 8
# devices, the benchmarks' settings -- and with six kept, its first-used folder was removed during every run)
KEEP_UNUSED_SECONDS = 24 * 3600  # a folder used more recently than this is never removed (a running process's)
PROGRAMS_DIR = "programs"  # a version folder's executables by traced program (`kept_executables.CachedJit`): more
# names of its files kept by source key
KEEP_BYTES = 2 << 30  # a folder's executables past this size: the least recently used removed (`version_dir`)

_pruned: set = set()
_prune_lock = threading.Lock()


def version_dir(base: Path, name: str) -> Path:
    """`base/name`: the executables of one jax version and its settings (`kept_executables.process_key`). The first
    call of a process marks the folder used and removes all but the `KEEP_VERSIONS` most recently used folders beside
    it that are unused for `KEEP_UNUSED_SECONDS` (one in use by a running process stays), and in its own folder the
    least recently used executables past `KEEP_BYTES` (an edit to omnijax's sources makes new keys for the programs
    that reach it, so without this a developer's or CI's cache would only grow)."""
    folder = base / name
    if folder in _pruned:
        return folder
    with _prune_lock:
        if folder not in _pruned:
            _pruned.add(folder)
            try:
                folder.mkdir(parents=True, exist_ok=True)
                os.utime(folder)
                used = []
                for entry in base.iterdir():
                    try:
                        if entry.is_dir():
                            used.append((entry.stat().st_mtime, entry))
                        elif entry.suffix == ".exe":  # a flat file of the first format
                            entry.unlink()
                    except OSError:  # removed meanwhile by another process
                        continue
                stale = time.time() - KEEP_UNUSED_SECONDS
                for mtime, old in sorted(used, reverse=True)[KEEP_VERSIONS:]:
                    if old != folder and mtime < stale:
                        shutil.rmtree(old, ignore_errors=True)
                bound_size(folder, KEEP_BYTES)
            except OSError:  # an unwritable cache: programs are compiled and not kept
                pass
    return folder


def bound_size(folder: Path, limit: int) -> None:
    """Removes the least recently used executables of `folder` (by modification time, which a load renews), by
    source key and by program (`PROGRAMS_DIR`: more names of the same files), until the files left hold at most
    `limit` bytes (a file's bytes count once, and are freed when its last name goes)."""
    names, names_left, sizes = [], {}, {}
    for entry in (*folder.glob("*.exe"), *(folder / PROGRAMS_DIR).glob("*.exe")):
        try:
            stat = entry.stat()
        except OSError:  # removed meanwhile by another process
            continue
        names.append((stat.st_mtime, stat.st_ino, entry))
        names_left[stat.st_ino] = names_left.get(stat.st_ino, 0) + 1
        sizes[stat.st_ino] = stat.st_size
    total = sum(sizes.values())
    for _, inode, entry in sorted(names, key=lambda item: item[0]):
        if total <= limit:
            break
        entry.unlink(missing_ok=True)
        names_left[inode] -= 1
        if not names_left[inode]:
            total -= sizes[inode]


def link(source: Path, link: Path) -> None:
    """`link` becomes another name of the file `source` (nothing is copied; the file's bytes stay while either name
    does). Best effort: a link that exists, or a folder that cannot hold one, is left as it is."""
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, link)
    except OSError:  # exists already (another process linked it), or no hard links here
        pass
