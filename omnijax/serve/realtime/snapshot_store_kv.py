"""The snapshot store's object-store side (`omnijax serve --snapshot-dir gs://bucket/prefix`, `s3://...`, and
`file:///...` / `memory://...` for tests and emulation): `KvStorage`, the interface of
`omnijax.serve.realtime.snapshot_store.DirStorage` over a tensorstore kvstore (`omnijax.serve.engine.snapshot_kv`).

Layout under the URL, one object per generation:

    <url><token>/000000000007.<written ms>.<bytes>.snapshot   the newest generation (`snapshot_blob`'s encoding)
    <url><token>/000000000006.<written ms>.<bytes>.snapshot   the previous one, deleted once its successor is durable
    <url>.leases/<token>                                      the cross-replica lease (`cluster.kv_lease`)

- **Atomic visibility**: a generation is one object, written with one kvstore write (a GCS / S3 PUT, a rename in
  tensorstore's file driver), created only if absent; a reader sees the newest whole generation, never part of one,
  and a kill mid-write leaves no object (so there is nothing to clean at open but a probe object of a killed start).
- **Generations**: as in a directory, each write is a new object and the older ones are deleted only after it
  returned (tensorstore resolves a write once it is durable, as far as the driver guarantees).
- **Listing only**: an object's write time (the writer's clock, in milliseconds) and size are in its name, so the
  size cap and the expiry need one listing, not a read of every object.

Not possible here as in a directory: the 0700 mode (access is the bucket's IAM policy: give the server's account
alone read and write on the prefix).
"""

from __future__ import annotations

import logging
import re

from omnijax.serve.engine.snapshot import SessionSnapshot
from omnijax.serve.engine.snapshot_blob import decode, encode
from omnijax.serve.engine.snapshot_kv import PROBE_PREFIX, KvLocation, KvStoreError, open_location
from omnijax.serve.engine.snapshot_paths import KvUrl

log = logging.getLogger("omnijax.serve")
OBJECT_RE = re.compile(r"([0-9]{12})\.([0-9]+)\.([0-9]+)\.snapshot")
TOKEN_RE = re.compile(r"[0-9a-f]{32}")  # a resume token (`snapshot_store.TOKEN_RE`)


class KvStorage:
    """Snapshots in an object store (module docstring).

    Args:
        location: the opened kvstore location.
    """

    def __init__(self, location: KvLocation):
        self.location = location
        self.url = location.url.url
        self.root = self.url  # what `SnapshotStore.root` names (a str: the URL)

    @classmethod
    def open(cls, url: KvUrl, *, probe_timeout_s: float | None = None) -> "KvStorage":
        """Opens the location and checks it can be written (`snapshot_kv.open_location`; ValueError)."""
        kw = {} if probe_timeout_s is None else {"probe_timeout_s": probe_timeout_s}
        return cls(open_location(url, "--snapshot-dir", **kw))

    def clean(self) -> int:
        """Deletes the probe objects of starts killed between writing and deleting them; how many."""
        probes = self.location.list(PROBE_PREFIX)
        for key in probes:
            self.location.delete(key)
            log.warning("snapshot store: removed %s%s, left by an interrupted start", self.url, key)
        return len(probes)

    def _objects(self, prefix: str = "") -> dict[str, list[tuple[int, float, int, str]]]:
        """`{token: [(number, written s, bytes, key), ...] oldest first}` of the objects under `prefix`."""
        found: dict[str, list[tuple[int, float, int, str]]] = {}
        for key in self.location.list(prefix):
            token, _, name = key.partition("/")
            m = OBJECT_RE.fullmatch(name)
            if TOKEN_RE.fullmatch(token) and m:
                found.setdefault(token, []).append((int(m.group(1)), int(m.group(2)) / 1000, int(m.group(3)), key))
        return {t: sorted(v) for t, v in found.items()}

    def scan(self) -> dict[str, tuple[int, float]]:
        """Every token with a snapshot: its bytes and the time of its newest generation."""
        return {token: (sum(o[2] for o in objects), objects[-1][1])
                for token, objects in self._objects().items()}

    def generations(self, token: str) -> list[str]:
        """The URLs of the token's generations, oldest first."""
        return [self.url + o[3] for o in self._objects(f"{token}/").get(token, [])]

    def _key(self, generation: str) -> str:
        if not generation.startswith(self.url):
            raise ValueError(f"{generation} is not an object of the snapshot store {self.url}")
        return generation[len(self.url):]

    def number(self, generation: str) -> int:
        """A generation's number."""
        return int(self._key(generation).partition("/")[2][:12])

    def write(self, token: str, number: int, snapshot: SessionSnapshot, now: float) -> str:
        """Writes generation `number` of `token` as one object, created only if absent; its URL once durable.

        Raises:
            KvStoreError: the write failed or the object exists (another writer of this token: never, under a lease).
        """
        data = encode(snapshot)
        key = f"{token}/{number:012d}.{int(now * 1000)}.{len(data)}.snapshot"
        if self.location.create(key, data) is None:
            raise KvStoreError(f"{self.url}{key} exists already: another writer of this resume token")
        return self.url + key

    def read(self, generation: str) -> SessionSnapshot:
        """The snapshot of a generation (`SnapshotFormatError`, a ValueError, when damaged; OSError when gone)."""
        data, _ = self.location.read(self._key(generation))
        if data is None:
            raise FileNotFoundError(f"{generation}: the snapshot object is gone (replaced by a newer one, evicted or "
                                    f"expired)")
        return decode(data, generation)

    def drop(self, generation: str) -> None:
        """Deletes one generation (a failure is logged: the next write deletes it)."""
        try:
            self.location.delete(self._key(generation))
        except KvStoreError as e:
            log.warning("snapshot store: an older generation was not deleted (%s); the next write tries again", e)

    def remove(self, token: str) -> None:
        """Deletes every generation of a token (a failure is logged; the next scan still counts what is left)."""
        try:
            self.location.delete_prefix(f"{token}/")
        except KvStoreError as e:
            log.warning("snapshot store: the snapshots of %s... were not deleted (%s)", token[:8], e)

    def token_bytes(self, token: str) -> int:
        """The bytes a token's snapshots take."""
        return sum(o[2] for o in self._objects(f"{token}/").get(token, []))
