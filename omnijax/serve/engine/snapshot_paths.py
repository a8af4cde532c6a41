"""Where session snapshots may live: a local (or mounted) POSIX directory, or an object store through a tensorstore
kvstore URL (`gs://bucket/prefix`, `s3://bucket/prefix`; `memory://prefix` and `file:///path` for tests and
emulation).

A directory holds snapshots as directories (`omnijax.serve.engine.snapshot_format`: orbax arrays and a manifest, made
visible by one atomic rename) and leases as hard-linked files with an mtime heartbeat (`omnijax.serve.cluster.lease`).
An object store has no atomic directory rename and no hard links, so a URL location is written differently, through
tensorstore's kvstore API directly (`omnijax.serve.engine.snapshot_kv`): one object per snapshot generation (atomic
visibility is the store's own single-object write; `omnijax.serve.engine.snapshot_blob` is its encoding), leases as
objects created and renewed with generation preconditions (`omnijax.serve.cluster.kv_lease`).

`pathlib.Path("gs://bucket/x")` would silently become the local folder `gs:/bucket/x`: every URL is told apart here
(`location`) and an unknown scheme is refused by name, listing the accepted ones.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

URI_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# The URL schemes a snapshot location accepts, and tensorstore's kvstore driver for each.
KV_SCHEMES = {"gs": "gcs", "s3": "s3", "file": "file", "memory": "memory"}
ACCEPTED = ("a directory path, or a tensorstore kvstore URL: gs://BUCKET/PREFIX, s3://BUCKET/PREFIX, file:///PATH, "
            "memory://PREFIX (one process only: tests)")


@dataclasses.dataclass(frozen=True)
class KvUrl:
    """A kvstore URL location: `url` (normalised to end in `/`), its `scheme` and tensorstore `driver`."""

    url: str
    scheme: str
    driver: str

    def __str__(self) -> str:
        return self.url


def location(path: str | os.PathLike, what: str = "the snapshot location") -> Path | KvUrl:
    """A snapshot location: an absolute local `Path`, or a `KvUrl` for a kvstore URL.

    Args:
        path: a directory path or a URL (module docstring).
        what: how an error names it (a flag, for a command line's errors).

    Raises:
        ValueError: a URL of a scheme not accepted (named, with the accepted forms), or one without a bucket.
    """
    text = os.fspath(path)
    m = URI_RE.match(text) if isinstance(text, str) else None
    if not m:
        return Path(text).absolute()
    scheme = m.group(1).lower()
    if scheme not in KV_SCHEMES:
        raise ValueError(f"{what} {text!r} is a {m.group(1)}:// URL, which is not a snapshot location; give "
                         f"{ACCEPTED}")
    rest = text[m.end():]
    if scheme in ("gs", "s3") and not rest.split("/", 1)[0]:
        raise ValueError(f"{what} {text!r} names no bucket; give {scheme}://BUCKET/PREFIX")
    if scheme == "file" and not rest.startswith("/"):
        raise ValueError(f"{what} {text!r}: a file:// URL takes an absolute path (file:///PATH)")
    url = f"{scheme}://{rest}"
    return KvUrl(url if url.endswith("/") else url + "/", scheme, KV_SCHEMES[scheme])


def local_path(path: str | os.PathLike, what: str = "the snapshot path") -> Path:
    """`path` as an absolute local `Path` (what `save_snapshot` / `load_snapshot` write and read: a directory).

    Raises:
        ValueError: `path` is a URL (`gs://...`, `memory://...`), naming its scheme: a snapshot *directory* cannot
            live there (`omnijax.serve.realtime.snapshot_store.SnapshotStore` takes kvstore URLs, and
            `omnijax.serve.engine.snapshot_blob` encodes one snapshot as one object).
    """
    text = os.fspath(path)
    m = URI_RE.match(text) if isinstance(text, str) else None
    if m:
        raise ValueError(f"{what} {text!r} is a {m.group(1)}:// URL, but a snapshot directory is a local or mounted "
                         f"POSIX path (atomic renames); for an object store give the URL to the snapshot store "
                         f"(--snapshot-dir), which writes each snapshot as one object")
    return Path(text).absolute()
