"""Cross-replica leases of resume tokens in an object store (`--snapshot-dir gs://...`, `s3://...`, `file:///...`,
`memory://...`): what `omnijax.serve.cluster.lease.LeaseDir` does with files, done with conditional kvstore writes
(`omnijax.serve.engine.snapshot_kv`), for `SharedSnapshotStore` over a `KvStorage`. Same interface, same rules:

    <url>.leases/<token>     {"owner", "host", "pid", "id", "since", "beat", "closing"}: who holds it, or
                             {"released": true, ...}: nobody (given back)

Every change is one conditional write of the whole object, never a conditional delete: tensorstore's `if_equal`
becomes GCS `ifGenerationMatch` (atomic for writes and deletes), S3 `If-None-Match: *` / `If-Match` on the PUT
(atomic on AWS; its conditional *delete* is a HEAD then a DELETE, which another replica's write can slip between), and
the file driver's lock file (atomic across processes).

- **Taking**: a create-only write when there is no object (the generation of a missing key), else a
  compare-and-swap over a released or stale lease's generation: of two replicas racing for a token exactly one
  write succeeds; the other reads the winner.
- **Heartbeat**: each replica's daemon thread rewrites the leases it holds every `heartbeat_s` (`beat`: its own
  clock's time) and at once when the connection starts closing (`closing`), each a compare-and-swap on the
  generation it last wrote; a swap that fails means the lease was broken as stale by another replica (logged, let go).
- **Giving back**: a compare-and-swap to a released record; one that fails leaves the lease to whoever broke it.
- **Stale leases** are broken: a holder on this host whose process is gone at once; any holder whose `beat` is older
  than `stale_s`. Breaking is the taking compare-and-swap itself, on the generation judged stale, so a lease renewed
  or retaken in between is never overwritten. Clocks: the age is the local clock minus the holder's `beat`, so nodes'
  clocks must agree to well within `stale_s` (as for `LeaseDir`'s mtimes).
- GCS allows one write per second to one object: on `gs://` the heartbeat is at least `GCS_MIN_HEARTBEAT_S`.
- Lease objects stay after they are given back (one small object per token that was ever resumed).

A `memory://` location is one process's memory: leases there are seen by the stores of that process only (tests).
Replicas in several processes need `gs://`, `s3://` or `file://` (one path every process sees).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from omnijax.serve.cluster.lease import LEASE_DIR, Holder, pid_alive
from omnijax.serve.engine.snapshot_kv import KvLocation, KvStoreError

log = logging.getLogger("omnijax.serve")
GCS_MIN_HEARTBEAT_S = 2.0


class KvLeases:
    """The lease objects of one replica (module docstring); the interface of `LeaseDir`.

    Args:
        location: the store's kvstore location (the leases live under `.leases/` in it).
        owner: this replica's id (named in the refusals of other replicas' clients).
        heartbeat_s: how often the held leases are rewritten (at least `GCS_MIN_HEARTBEAT_S` on `gs://`).
        stale_s: a lease not rewritten for this long is broken; > 2 x `heartbeat_s`.
        host, pid: who this replica is (tests pretend to be others).
        clock: wall-clock seconds (written as `beat`, compared with other holders' `beat`).
    """

    def __init__(self, location: KvLocation, owner: str, *, heartbeat_s: float = 1.0, stale_s: float = 10.0,
                 host: str | None = None, pid: int | None = None, clock: Callable[[], float] = time.time):
        if location.url.scheme == "gs" and heartbeat_s < GCS_MIN_HEARTBEAT_S:
            log.info("lease heartbeat %.1f s raised to %.1f s on gs:// (one write per second per object)",
                     heartbeat_s, GCS_MIN_HEARTBEAT_S)
            heartbeat_s = GCS_MIN_HEARTBEAT_S
        if not (heartbeat_s > 0 and stale_s > 2 * heartbeat_s):
            raise ValueError(f"a lease's stale_s must exceed 2 x heartbeat_s > 0, got heartbeat_s={heartbeat_s}, "
                             f"stale_s={stale_s}")
        self.location = location
        self.owner, self.heartbeat_s, self.stale_s, self.clock = owner, float(heartbeat_s), float(stale_s), clock
        self.host = host if host is not None else socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self._lock = threading.Lock()  # guards `_mine`
        self._io = threading.Lock()  # one rewrite or give-back at a time: a give-back never races its own beat
        # token -> [lease id, is the connection closing, the generation last written, the JSON last written]
        self._mine: dict[str, list] = {}
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="omnijax-kv-lease-heartbeat", daemon=True)
        self._beat.start()

    @staticmethod
    def _key(token: str) -> str:
        return f"{LEASE_DIR}/{token}"

    # ------------------------------------------------------------------------------------------------- reading
    def _read(self, token: str) -> tuple[Holder | None, bytes]:
        data, generation = self.location.read(self._key(token))
        if data is None:
            return None, generation
        try:
            got = json.loads(data.decode("utf-8"))
            if got.get("released"):
                return None, generation
            owner, host, pid, lid = str(got["owner"]), str(got["host"]), int(got["pid"]), str(got["id"])
            beat, closing = float(got["beat"]), bool(got["closing"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # written whole: damaged by hand
            log.warning("lease of %s... is unreadable (%s): treated as stale", token[:8], e)
            return Holder("?", "?", 0, "?", False, float("inf"), True), generation
        age = max(0.0, self.clock() - beat)
        dead = host == self.host and pid != self.pid and not pid_alive(pid)
        return Holder(owner, host, pid, lid, closing, age, dead or age > self.stale_s), generation

    def holder(self, token: str) -> Holder | None:
        """The token's holder, or None when nobody holds it."""
        return self._read(token)[0]

    def held_elsewhere(self, token: str) -> bool:
        """Whether another replica holds a live (not stale) lease on the token."""
        holder = self.holder(token)
        with self._lock:
            mine = self._mine.get(token, [""])[0]
        return holder is not None and not holder.stale and holder.id != mine

    # ------------------------------------------------------------------------------------------------- taking
    def _record(self, lid: str, since: float, closing: bool) -> dict:
        return {"owner": self.owner, "host": self.host, "pid": self.pid, "id": lid, "since": since,
                "beat": self.clock(), "closing": closing}

    def take(self, token: str, closing: Callable[[], bool] = lambda: False) -> Holder | None:
        """Takes the token's lease (breaking a stale one); None when taken, else the live holder in the way.

        Args:
            token: the resume token.
            closing: tells whether the connection this lease is for is closing (read by the heartbeat).
        """
        for _ in range(3):  # a race lost to another taker or breaker: look again
            holder, seen = self._read(token)
            if holder is not None and not holder.stale:
                return holder
            lid = secrets.token_hex(8)
            record = self._record(lid, self.clock(), False)
            generation = self.location.write(self._key(token), json.dumps(record).encode("utf-8"), if_equal=seen)
            if generation is not None:
                with self._lock:
                    self._mine[token] = [lid, closing, generation, record]
                if holder is not None:
                    log.warning("lease of %s... held by replica %s (pid %d on %s, heartbeat %.1f s ago) broken: %s",
                                token[:8], holder.owner, holder.pid, holder.host, holder.age_s,
                                "its process is gone" if holder.age_s <= self.stale_s else "stale")
                return None
        holder = self.holder(token)
        return holder if holder is not None else Holder("?", "?", 0, "?", True, 0.0, False)

    def give_back(self, token: str) -> None:
        """Ends this replica's lease on the token (idempotent; a lease broken meanwhile is left to its new
        holder)."""
        with self._io:
            with self._lock:
                mine = self._mine.pop(token, None)
            if mine is None:
                return
            released = {"released": True, "owner": self.owner, "id": mine[0], "at": self.clock()}
            if self.location.write(self._key(token), json.dumps(released).encode("utf-8"), if_equal=mine[2]) is None:
                log.info("lease of %s... was broken before it was given back: left to its new holder", token[:8])

    def close(self) -> None:
        """Stops the heartbeat (leases still held go stale)."""
        self._stop.set()

    # ------------------------------------------------------------------------------------------------ heartbeat
    def beat(self, touch: bool = True) -> None:
        """The heartbeat thread's step: rewrites the held leases whose connection started closing and (`touch`)
        every held lease, each conditioned on the generation last written."""
        with self._lock:
            tokens = list(self._mine)
        for token in tokens:
            with self._io:
                with self._lock:
                    mine = self._mine.get(token)
                if mine is None:
                    continue
                lid, closing, generation, record = mine
                marking = not record["closing"] and closing()
                if not (touch or marking):
                    continue
                record = {**record, "beat": self.clock(), "closing": record["closing"] or marking}
                written = self.location.write(self._key(token), json.dumps(record).encode("utf-8"),
                                              if_equal=generation)
                with self._lock:
                    if written is None:
                        self._mine.pop(token, None)
                        log.error("lease of %s... (this replica's) is gone: broken as stale by another replica",
                                  token[:8])
                    elif token in self._mine:
                        self._mine[token] = [lid, closing, written, record]

    def _heartbeat(self) -> None:
        last = 0.0
        while not self._stop.wait(min(0.1, self.heartbeat_s)):  # closing marks within 0.1 s
            touch = time.monotonic() - last >= self.heartbeat_s
            last = time.monotonic() if touch else last
            try:
                self.beat(touch)
            except KvStoreError as e:  # the store unreachable for a moment: the next beat tries again
                log.warning("lease heartbeat failed: %s", e)
