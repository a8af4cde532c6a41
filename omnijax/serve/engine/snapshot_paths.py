"""Where session snapshots may live: a local (or mounted) POSIX directory, never an object-store URI.

`omnijax.serve.engine.snapshot` writes a snapshot as a directory made visible by one atomic rename, and
`omnijax.serve.realtime.snapshot_store` / `omnijax.serve.cluster.lease` keep generations whole and a resume token
single-owner with renames, hard links (an atomic create of a lease) and modification times (its heartbeat). An
object store (`gs://`, `s3://`) has no atomic directory rename and no hard links, so those guarantees would not
hold there. `pathlib.Path("gs://bucket/x")` would silently become the local folder `gs:/bucket/x`, so a URI is refused
by name instead (`local_path`).

What object stores would need (not built): a generation made visible by a commit object written last (one atomic
single-object write) rather than a rename; a lease created with a create-only precondition (GCS
`ifGenerationMatch=0`, S3 `If-None-Match: *`) and renewed with a generation precondition instead of a hard link and
an mtime; listing instead of directory scans; and orbax's arrays written through tensorstore's `gcs` / `s3` kvstore
drivers (installed) with etils' `gs://` / `s3://` paths, which need `gcsfs` / `s3fs` (not installed here). A
FUSE mount of a bucket (gcsfuse, s3fs-fuse) is not a substitute: it offers neither hard links nor atomic renames of
directories.

Why not built, checked against the installed stack (tensorstore 0.1.86, orbax-checkpoint 0.12.8, etils 1.15.0, no
network): tensorstore's own kvstores write `memory://` and `file://` URLs offline, but orbax does not reach them:
every orbax path goes through `etils.epath`, which has no `memory://` or `file://` backend (`epath.Path("memory://x")`
raises KeyError, so `StandardCheckpointer.save("memory://x/arrays", ...)` does) and imports gcsfs / s3fs for `gs://` /
`s3://` (ImportError: not installed; adding them adds network clients, and a `gs://` / `s3://` test would need a
local GCS or S3 emulator, none of which is installed). So no URL scheme is both writable by the snapshot format
(`omnijax.serve.engine.snapshot_format`, orbax) and testable here, and an object-store location built now would
ship untested. The way there: write a snapshot's arrays with tensorstore directly (a kvstore spec per location:
`memory://` / `file://` in tests, `gs://` / `s3://` through tensorstore's gcs / s3 drivers), keep the manifest and the
commit object as single kvstore writes, and make the lease a conditional kvstore write; the store and the leases
(`omnijax.serve.realtime.snapshot_store`, `omnijax.serve.cluster.lease`) then talk to that interface instead of
`pathlib`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

URI_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_STORE_UNSUPPORTED = (
    "snapshots live in a local or mounted POSIX directory only (atomic directory renames, hard-link leases and "
    "modification times keep them whole and single-owner; object stores have none of them, and the installed "
    "stack has no gs:// or s3:// filesystem for orbax: etils needs gcsfs or s3fs); give a directory path, for "
    "replicas one on a filesystem every replica mounts (NFS, CephFS, EFS, Filestore)")


def local_path(path: str | os.PathLike, what: str = "the snapshot path") -> Path:
    """`path` as an absolute local `Path`.

    Args:
        path: a directory path.
        what: how an error names it (a flag, for a command line's errors).

    Raises:
        ValueError: `path` is a URI (`gs://...`, `s3://...`, `memory://...`), naming its scheme.
    """
    text = os.fspath(path)
    m = URI_RE.match(text) if isinstance(text, str) else None
    if m:
        raise ValueError(f"{what} {text!r} is a {m.group(1)}:// URI: {OBJECT_STORE_UNSUPPORTED}")
    return Path(text).absolute()
