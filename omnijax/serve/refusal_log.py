"""Rate-limited log lines of the requests `omnijax serve` refuses (401, 429 / overloaded, bad requests, slow
consumers), so a flood of bad requests cannot flood the log.

Each refusal site calls `refusals.refuse(reason, peer, message, *args)`. Lines are limited per (reason, peer address)
by a token bucket: the first `burst` refusals of a pair are logged, then one per `interval_s`; a second bucket over
all pairs (`global_burst`, `global_per_s`) bounds a flood spread over many peers. A refusal that is not logged is
counted, and the next line logged for its pair says how many were suppressed and over how long ("[37 similar refusals
suppressed over 12 s]"). At most `max_peers` pairs are tracked (the least recently refused is forgotten; the
refusals it had suppressed are reported with the next line logged for any pair).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable


@dataclasses.dataclass
class _Bucket:
    tokens: float
    at: float  # clock of the last refill
    suppressed: int = 0
    since: float = 0.0  # clock of the first suppressed refusal


class RefusalLog:
    """Rate-limited refusal lines (see the module docstring).

    Args:
        logger: where lines go.
        burst: lines a (reason, peer) pair may log at once.
        interval_s: after its burst, a pair logs one line per this many seconds.
        global_burst, global_per_s: the same over every pair together.
        max_peers: the most (reason, peer) pairs tracked.
        level: the lines' logging level.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, logger: logging.Logger, *, burst: int = 10, interval_s: float = 10.0,
                 global_burst: int = 100, global_per_s: float = 5.0, max_peers: int = 4096,
                 level: int = logging.WARNING, clock: Callable[[], float] = time.monotonic):
        if burst < 1 or global_burst < 1 or max_peers < 1 or not interval_s > 0 or not global_per_s > 0:
            raise ValueError(f"burst, global_burst and max_peers must be >= 1 and interval_s, global_per_s > 0, got "
                             f"{burst}, {global_burst}, {max_peers}, {interval_s}, {global_per_s}")
        self.logger, self.level, self.clock = logger, level, clock
        self.burst, self.interval_s, self.max_peers = burst, interval_s, max_peers
        self.global_burst, self.global_per_s = global_burst, global_per_s
        self.reset()

    def reset(self) -> None:
        """Forgets every pair and refills every bucket."""
        self._pairs: collections.OrderedDict[tuple[str, str], _Bucket] = collections.OrderedDict()
        self._global = _Bucket(float(self.global_burst), self.clock())
        self._forgotten = 0  # suppressed refusals of pairs no longer tracked, not reported yet
        self.logged = self.suppressed = 0  # totals

    def refuse(self, reason: str, peer: str, message: str, *args: object) -> bool:
        """Logs `message % args` for a refusal of `reason` to `peer` (the client's address, without its port: a
        flood comes from ever new ports) unless its pair or the whole log is over its rate; returns whether the line
        was logged."""
        now = self.clock()
        key = (reason, peer)
        bucket = self._pairs.get(key)
        if bucket is None:
            bucket = self._pairs[key] = _Bucket(float(self.burst), now)
            while len(self._pairs) > self.max_peers:
                self._forgotten += self._pairs.popitem(last=False)[1].suppressed
        else:
            self._pairs.move_to_end(key)
        _refill(bucket, now, 1.0 / self.interval_s, self.burst)
        _refill(self._global, now, self.global_per_s, self.global_burst)
        if bucket.tokens < 1 or self._global.tokens < 1:
            if bucket.suppressed == 0:
                bucket.since = now
            bucket.suppressed += 1
            self.suppressed += 1
            return False
        bucket.tokens -= 1
        self._global.tokens -= 1
        notes = []
        if bucket.suppressed:
            notes.append(f"{bucket.suppressed} similar refusals suppressed over {now - bucket.since:.0f} s")
            bucket.suppressed = 0
        if self._forgotten:
            notes.append(f"{self._forgotten} refusals of other peers suppressed")
            self._forgotten = 0
        text = message % args if args else message
        self.logger.log(self.level, "%s", text + (f" [{'; '.join(notes)}]" if notes else ""))
        self.logged += 1
        return True


def _refill(bucket: _Bucket, now: float, rate: float, cap: int) -> None:
    bucket.tokens = min(float(cap), bucket.tokens + max(0.0, now - bucket.at) * rate)
    bucket.at = now


log = logging.getLogger("omnijax.serve")
# The server's refusal log: every refusal site of `omnijax serve` uses it.
refusals = RefusalLog(log)

__all__ = ["RefusalLog", "refusals"]
