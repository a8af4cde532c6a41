"""A session's first steps without the trim, while its full step compiles in another thread (`QuickStart`).

From an empty compilation cache, a new process's first token waits for XLA to compile the step, and the retention
policy's trim is part of that compile. A session's steps cannot trim while no row holds more cells than the policy
keeps untrimmed (`omnijax.retention.base.untrimmed_capacity`; a chat's system prompt and first question): those
steps run `chunk_step(..., trim=False)`, which computes what the full step computes whenever the trim does not fire
(the trim is a `lax.cond` that passes the cache through; logits and tokens bit-equal on SmolLM2 and in
`tests/streaming/test_quick_start.py`). After each such step, once its outputs are computed, a worker thread
compiles the full step for its arguments (`CachedJit.precompile` from their shapes: the arrays themselves are
donated to the steps); started before, it competed with the step for the cores. A step whose full program is ready
(`CachedJit.ready`: held, or kept on disk as a serialised executable) runs it, and so does every step once the cells
may exceed the capacity, waiting for the worker's compile where it has not ended. Without kept executables there is
no quick start (a worker could not hold the full step for the next call).

Measured (`bench/peers/first_token.py --quick-start` against the default, SmolLM2-135M, OmniPick 512 / 384, back to
back on 2 cores, 2026-12-07): the untrimmed step compiles in 5.2-6.6 s against 6.9-7.6 s for the full step; a
process with an empty cache reached its first token in 15.1-17.2 s / 20.2-22.8 CPU s with quick start against
16.1-17.3 s / 22.0-23.8 CPU s without (about 2 CPU s, the wall within noise). One bench run of the kept side, after
a priming process that used quick start, aborted at exit ("terminate called after throwing an instance of ''") and
was not reproduced since. So `Chat` leaves it off by default.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from omnijax.chunks import Chunk
from omnijax.kept_executables import CachedJit, abstract_arguments, executables_dir

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
    """Decides, step by step, whether a session's step runs untrimmed (`untrimmed_step`), and compiles the full step
    in a worker thread after each untrimmed one (`compile_after`).

    A step may run untrimmed while no row can hold more cells than the policy keeps untrimmed: `held` bounds the
    cells any row holds (every chunk's tokens and every answer's asked tokens, summed from the empty session; trims
    only lower it, and none can have happened while it stays within the capacity).

    Args:
        full: the session's full step (`CachedJit`; the trimming program).
        capacity: retained cells the policy holds without trimming (`untrimmed_capacity`).
        answer_cap: the most answer tokens a step writes (`StreamConfig.max_answer_tokens`).
    """

    def __init__(self, full: CachedJit, capacity: int, answer_cap: int):
        self.full = full
        self.capacity = capacity
        self.answer_cap = answer_cap
        self.held = 0  # a bound on the cells any row holds
        self.untrimmed_steps = 0  # steps run untrimmed so far
        self.workers: list[threading.Thread] = []
        self._shapes: tuple | None = None  # the last untrimmed step's full-step arguments, as shapes
        self.errors: list[BaseException] = []  # what a worker's compile raised (the step then compiles itself)

    def untrimmed_step(self, chunk: Chunk, args: tuple, kwargs: dict) -> bool:
        """Whether this step runs without the trim: after its chunk no row can hold more cells than the capacity,
        kept executables are on, and the full step for these arguments (`args` / `kwargs`, its arguments for this
        chunk) is not ready (held, or kept on disk). Counts the chunk's cells and asked answer tokens in `held`."""
        valid, asked = np.asarray(chunk.valid), np.asarray(chunk.answer_tokens)
        cells = int(valid.sum(axis=1).max(initial=0))
        answer = int(np.minimum(asked, self.answer_cap).max(initial=0))
        # without kept executables (`OMNIJAX_EXECUTABLE_CACHE=off`, no cache directory) a worker could not hold the
        # full step for the next call: an untrimmed step would only add a program
        untrimmed = (self.held + cells <= self.capacity and executables_dir() is not None
                     and not self.full.ready(*args, **kwargs))
        self.held += cells + answer
        self._shapes = abstract_arguments((args, kwargs)) if untrimmed else None
        self.untrimmed_steps += untrimmed
        return untrimmed

    def compile_after(self, outputs: Any) -> None:
        """Compiles the full step for the last untrimmed step's arguments in a worker thread, once `outputs` (that
        step's) are computed: started at once, it took one of a 2-core machine's cores from the step's own run."""
        if self._shapes is None:
            return
        # not a daemon: a process that ends while XLA compiles in a daemon thread aborts ("terminate called after
        # throwing an instance of ''": the first_token bench's kept side); the interpreter waits for this one
        worker = threading.Thread(target=self._compile, args=(outputs, *self._shapes), daemon=False,
                                  name="omnijax-full-step-compile")
        self._shapes = None
        self.workers.append(worker)
        with _workers_lock:
            _workers.append(worker)
        worker.start()

    def _compile(self, outputs: Any, args: Any, kwargs: Any) -> None:
        try:
            jax.block_until_ready(outputs)
            self.full.precompile(*args, **kwargs)  # held already (an earlier worker's): returns at once
        except BaseException as error:  # noqa: BLE001 - the next step compiles the full step itself and raises
            self.errors.append(error)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the workers' compiles; True when none is running."""
        for worker in self.workers:
            worker.join(timeout)
        return not any(worker.is_alive() for worker in self.workers)
