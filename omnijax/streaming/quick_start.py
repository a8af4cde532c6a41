"""A session's first step without the trim, while its full step compiles in another thread (`QuickStart`).

From an empty compilation cache, a new process's first token waits for XLA to compile the step. The retention
policy's trim is about a fifth of that compile (SmolLM2-135M with OmniPick 512 / 384: 19.3 against 24.9 CPU s from
`load` to the first token, medians of three), and a session's first step cannot trim when its chunk holds no more
cells than the policy keeps untrimmed (`omnijax.retention.base.untrimmed_capacity`). The first step then runs
`chunk_step(..., trim=False)`, which computes what the full step computes whenever the trim does not fire (the
trim is a `lax.cond` that passes the cache through; logits and tokens bit-equal on SmolLM2 and in
`tests/streaming/test_quick_start.py`), and a worker thread compiles the full step meanwhile
(`CachedJit.precompile` from the arguments' shapes: the arrays themselves are donated to the first step). Every
later step runs the full step, waiting for that compile where it has not ended. A process that finds the full step
kept (`CachedJit.ready`: held, or on disk as a serialised executable) runs it from the first step.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from omnijax.chunks import Chunk
from omnijax.kept_executables import CachedJit, abstract_arguments

_workers: list[threading.Thread] = []  # every compile a QuickStart started, for `wait_all`
_workers_lock = threading.Lock()


def wait_all(timeout: float | None = None) -> bool:
    """Waits for every full-step compile a `QuickStart` started in this process; True when none is left running.
    A caller about to change jax's settings or drop compiled programs (`compilation_cache.clear_in_memory`) calls
    it first, so no compile spans the change (the test suite does, between modules)."""
    with _workers_lock:
        running = [worker for worker in _workers if worker.is_alive()]
        _workers[:] = running
    for worker in running:
        worker.join(timeout)
    return not any(worker.is_alive() for worker in running)


class QuickStart:
    """Decides whether a session's first step runs untrimmed (`first_step_untrimmed`), and compiles the full step in
    a worker thread when it does.

    Args:
        full: the session's full step (`CachedJit`; the trimming program).
        capacity: retained cells the policy holds without trimming (`untrimmed_capacity`).
    """

    def __init__(self, full: CachedJit, capacity: int):
        self.full = full
        self.capacity = capacity
        self.untrimmed: bool | None = None  # what the first step ran (None: not run yet)
        self.worker: threading.Thread | None = None
        self.errors: list[BaseException] = []  # what the worker's compile raised (the step then compiles itself)

    def first_step_untrimmed(self, chunk: Chunk, args: tuple, kwargs: dict) -> bool:
        """True when the first step should run without the trim: its chunk's cells fit the capacity (the session
        starts empty) and the full step is not ready. The full step's compile then starts in a worker thread, from
        the shapes of `args` / `kwargs` (the full step's arguments for this chunk)."""
        if self.untrimmed is not None:
            raise RuntimeError("first_step_untrimmed decides the first step only; it was decided already")
        cells = int(np.asarray(chunk.valid).sum(axis=1).max(initial=0))
        self.untrimmed = cells <= self.capacity and not self.full.ready(*args, **kwargs)
        if not self.untrimmed:
            return False
        shapes, kw_shapes = abstract_arguments((args, kwargs))
        self.worker = threading.Thread(target=self._compile, args=(shapes, kw_shapes), daemon=True,
                                       name="omnijax-full-step-compile")
        with _workers_lock:
            _workers.append(self.worker)
        self.worker.start()
        return True

    def _compile(self, args: Any, kwargs: Any) -> None:
        try:
            self.full.precompile(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - the next step compiles the full step itself and raises
            self.errors.append(error)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the worker's compile (if one started); True when none is running."""
        if self.worker is not None:
            self.worker.join(timeout)
            return not self.worker.is_alive()
        return True
