"""Peak anonymous memory of the test process while a block runs, sampled from `/proc/self/status`.

tracemalloc is not usable around code whose native threads enter Python (TensorStore's pool, XLA callbacks): on
Python 3.11 a thread that first takes the GIL while tracemalloc traces crashes the process in `traceback_new` (seen
as a segmentation fault in a `ts_pool_worker` thread during a conversion). Anonymous resident memory (`RssAnon`) counts
the heap and every malloc'd buffer but not memory-mapped files, so a source read through `np.memmap` is not counted.
Sampling can miss a peak shorter than the interval, so it bounds peaks from below: use it to show that something
large (a staging copy of a whole tree) is *not* held, not to measure a short spike.
"""

from __future__ import annotations

import threading
import time


def anonymous_bytes() -> int:
    """Anonymous resident bytes of this process now (`RssAnon`)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line (Linux only)")


class AnonymousPeak:
    """`with AnonymousPeak() as peak: ...` then `peak.growth`: the largest `RssAnon` seen while the block ran, minus
    its value at entry, sampled every `interval` seconds by a thread."""

    def __init__(self, interval: float = 0.0005):
        self.interval = interval
        self.growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, anonymous_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "AnonymousPeak":
        self._base = self._peak = anonymous_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.growth = max(self._peak, anonymous_bytes()) - self._base
