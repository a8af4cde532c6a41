"""Cross-replica leases of resume tokens: files in the shared `--snapshot-dir`, so one token is resumed by one replica
at a time even when two replicas are asked for it at once (the router's stats lag a connection by up to one report).

A replica's `SnapshotStore` leases a token to one of its own connections; `LeaseDir` adds a lease every replica sees:

    <snapshot dir>/.leases/<token>                   {"owner", "host", "pid", "id", "since"}: who holds it
    <snapshot dir>/.leases/<token>.<id>.closing      present once that holder's connection ends (its last write
                                                     follows; the next holder waits for it instead of refusing)

- **Taking** is atomic: the lease is written whole to a temp file and hard-linked to its name (`os.link` fails when
  the name exists), so of two replicas racing for a token exactly one gets it, and a reader never sees half a lease.
- **Heartbeat**: each replica's daemon thread touches (mtime) the leases it holds every `heartbeat_s` and marks the
  closing ones.
- **Stale leases** are broken: a holder on this host whose process is gone (a SIGKILLed replica) at once; any
  holder whose heartbeat is older than `stale_s` (a replica on a node that died, whose process cannot be checked).
  Breaking renames the lease away (one breaker wins), checks the renamed lease is the one judged stale and puts it
  back otherwise. Clocks: the age is the local clock minus the file's mtime, so nodes' clocks (or the file server's)
  must agree to well within `stale_s`.

Only the standard library; no Ray (the store is tested without a cluster).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("omnijax.serve")
LEASE_DIR = ".leases"


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a token's lease: `owner` (a replica id), `host`, `pid`, the lease `id`, whether its connection is
    `closing`, the seconds since its last heartbeat (`age_s`) and whether it is `stale` (breakable)."""

    owner: str
    host: str
    pid: int
    id: str
    closing: bool
    age_s: float
    stale: bool


def pid_alive(pid: int) -> bool:
    """Whether a process of that id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class LeaseDir:
    """The lease files of one replica (module docstring).

    Args:
        root: the shared snapshot directory (its `.leases` folder is created, mode 0700).
        owner: this replica's id (named in the refusals of other replicas' clients).
        heartbeat_s: how often the held leases are touched.
        stale_s: a lease not touched for this long is broken; > 2 x `heartbeat_s`.
        host, pid: who this replica is (tests pretend to be others).
        clock: wall-clock seconds (compared with the files' mtimes).
    """

    def __init__(self, root: str | os.PathLike, owner: str, *, heartbeat_s: float = 1.0, stale_s: float = 10.0,
                 host: str | None = None, pid: int | None = None, clock: Callable[[], float] = time.time):
        if not (heartbeat_s > 0 and stale_s > 2 * heartbeat_s):
            raise ValueError(f"a lease's stale_s must exceed 2 x heartbeat_s > 0, got heartbeat_s={heartbeat_s}, "
                             f"stale_s={stale_s}")
        self.dir = Path(root) / LEASE_DIR
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.owner, self.heartbeat_s, self.stale_s, self.clock = owner, float(heartbeat_s), float(stale_s), clock
        self.host = host if host is not None else socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self._lock = threading.Lock()
        self._mine: dict[str, tuple[str, Callable[[], bool]]] = {}  # token -> (lease id, is the connection closing)
        self._marked: set[str] = set()  # lease ids marked closing
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="omnijax-lease-heartbeat", daemon=True)
        self._beat.start()

    # ------------------------------------------------------------------------------------------------- reading
    def _path(self, token: str) -> Path:
        return self.dir / token

    def holder(self, token: str) -> Holder | None:
        """The token's holder, or None when nobody holds it."""
        path = self._path(token)
        try:
            mtime = path.stat().st_mtime
            data = json.loads(path.read_text())
            owner, host, pid, lid = str(data["owner"]), str(data["host"]), int(data["pid"]), str(data["id"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:  # written whole by a link: damaged by hand
            log.warning("lease of %s... is unreadable (%s): treated as stale", token[:8], e)
            return Holder("?", "?", 0, "?", False, float("inf"), True)
        age = max(0.0, self.clock() - mtime)
        dead = host == self.host and pid != self.pid and not pid_alive(pid)
        closing = (self.dir / f"{token}.{lid}.closing").exists()
        return Holder(owner, host, pid, lid, closing, age, dead or age > self.stale_s)

    def held_elsewhere(self, token: str) -> bool:
        """Whether another replica holds a live (not stale) lease on the token."""
        holder = self.holder(token)
        return holder is not None and not holder.stale and holder.id != self._mine.get(token, ("",))[0]

    # ------------------------------------------------------------------------------------------------- taking
    def take(self, token: str, closing: Callable[[], bool] = lambda: False) -> Holder | None:
        """Takes the token's lease (breaking a stale one); None when taken, else the live holder in the way.

        Args:
            token: the resume token.
            closing: tells whether the connection this lease is for is closing (read by the heartbeat).
        """
        for _ in range(3):  # a stale lease broken, then taken; a race lost to another breaker: look again
            lid = secrets.token_hex(8)
            tmp = self.dir / f".{token}.{lid}.tmp"
            tmp.write_text(json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid, "id": lid,
                                       "since": self.clock()}))
            try:
                os.link(tmp, self._path(token))
            except FileExistsError:
                pass
            else:
                with self._lock:
                    self._mine[token] = (lid, closing)
                return None
            finally:
                tmp.unlink(missing_ok=True)
            holder = self.holder(token)
            if holder is None:
                continue  # released meanwhile
            if not holder.stale:
                return holder
            self._break(token, holder)
        holder = self.holder(token)
        return holder if holder is not None else Holder("?", "?", 0, "?", True, 0.0, False)

    def _break(self, token: str, stale: Holder) -> None:
        aside = self.dir / f".{token}.{secrets.token_hex(8)}.broken"
        try:
            os.rename(self._path(token), aside)
        except FileNotFoundError:
            return  # another replica broke or its holder released it
        try:
            got = json.loads(aside.read_text()).get("id")
        except (OSError, ValueError, AttributeError):
            got = stale.id
        if got != stale.id:  # a fresh lease replaced the stale one between the look and the rename: put it back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self._path(token))
        else:
            log.warning("lease of %s... held by replica %s (pid %d on %s, heartbeat %.1f s ago) broken: %s",
                        token[:8], stale.owner, stale.pid, stale.host, stale.age_s,
                        "its process is gone" if stale.age_s <= self.stale_s else "stale")
            (self.dir / f"{token}.{stale.id}.closing").unlink(missing_ok=True)
        aside.unlink(missing_ok=True)

    def give_back(self, token: str) -> None:
        """Ends this replica's lease on the token (idempotent; a lease broken meanwhile is left to its new
        holder)."""
        with self._lock:
            mine = self._mine.pop(token, None)
        if mine is None:
            return
        holder = self.holder(token)
        if holder is not None and holder.id == mine[0]:
            self._path(token).unlink(missing_ok=True)
        (self.dir / f"{token}.{mine[0]}.closing").unlink(missing_ok=True)
        self._marked.discard(mine[0])

    def close(self) -> None:
        """Stops the heartbeat (leases still held go stale)."""
        self._stop.set()

    # ------------------------------------------------------------------------------------------------ heartbeat
    def beat(self, touch: bool = True) -> None:
        """The heartbeat thread's step: marks the held leases whose connection is closing and (`touch`) touches every
        held lease."""
        with self._lock:
            mine = list(self._mine.items())
        for token, (lid, closing) in mine:
            if lid not in self._marked and closing():
                (self.dir / f"{token}.{lid}.closing").touch()
                self._marked.add(lid)
            if touch:
                try:
                    os.utime(self._path(token))
                except FileNotFoundError:
                    log.error("lease of %s... (this replica's) is gone: broken as stale by another replica",
                              token[:8])

    def _heartbeat(self) -> None:
        last = 0.0
        while not self._stop.wait(min(0.1, self.heartbeat_s)):  # closing marks within 0.1 s
            touch = time.monotonic() - last >= self.heartbeat_s
            last = time.monotonic() if touch else last
            try:
                self.beat(touch)
            except OSError as e:  # the shared directory unreachable for a moment: the next beat tries again
                log.warning("lease heartbeat failed: %s", e)
