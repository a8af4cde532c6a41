"""A session's first steps without the trim and compiled quickly, while its full step compiles in another thread
(`QuickStart`).

From an empty compilation cache, a new process's first token waits for XLA to compile the step: on SmolLM2-135M
(30 split layers) ~2 CPU s tracing, ~1 s lowering and ~10.6 CPU s of XLA:CPU compile, most of it LLVM optimising
and emitting a matrix-vector kernel for each layer's one-row products (a decode step). A session's steps cannot trim
while no row holds more cells than the policy keeps untrimmed (`omnijax.retention.base.untrimmed_capacity`; a chat's
system prompt and first question): those steps run `chunk_step(..., trim=False)`, which computes what the full step
computes whenever the trim does not fire (the trim is a `lax.cond` that passes the cache through), and that program
is compiled for a quick start rather than speed (`QUICK_COMPILE`: LLVM's optimisation and XLA:CPU's fusion emitters
off; its one-row products padded to two rows, `omnijax.models.layers.padded_one_row_products`, so XLA:CPU calls its
library matmul instead of emitting a kernel per layer and projection): 3.1 instead of 10.6 CPU s to compile the
SmolLM2 step, ~1.5x its run time. Its code differs, not its computation: tokens equal, logits and cached
keys / values to float32 rounding (`tests/streaming/test_quick_start.py`; SmolLM2's answers equal in the bench).

Once an untrimmed step that decodes an answer has computed its outputs (the first answer block is out), or after the
second untrimmed step without one (`DEFER_STEPS`), a worker thread at the lowest scheduling priority compiles the
full step for that step's arguments (`CachedJit.precompile` from their shapes: the arrays themselves are donated to
the steps). Started after every step, as before, the worker of a chat's system-prompt step traced and compiled the
full step while the question's step ran. A step whose full program is ready (`CachedJit.ready`: held, or kept on
disk as a serialised executable) runs it, and so does every step once the cells may exceed the capacity, waiting for
the worker's compile where it has not ended (or compiling it, where no worker has started). Without kept executables
there is no quick start (a worker could not hold the full step for the next call). A process that ends while the
worker compiles waits for it (the full step is then kept for the next process).

Measured: see `bench/peers/RESULTS.md` (first_token, `--quick-start`). On by default in `omnijax chat` (always a
fresh process; `--no-quick-start`), off by default in `Chat` and `Session`: a session that starts with it compiles
two programs instead of one where its full step is not kept yet (a test suite's sessions with an empty cache), its
results differ from the default's by float32 rounding (greedy tokens of a tiny random model can flip where two
logits tie that closely; the suite compares them with transformers'), it refuses recall, and its process exits only
once the worker's compile has ended (on SmolLM2 at load 9 on 2 cores, ~60 s from start against ~15 s to the first
token; ~10 CPU s of compile at nice 19). A new process that wants its first token sooner asks for it
(`Chat(quick_start=True)`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax
import numpy as np

from omnijax.chunks import Chunk
from omnijax.kept_executables import CachedJit, abstract_arguments, executables_dir

# How the untrimmed step compiles, by platform (`CachedJit`'s `compiler_options`): on XLA:CPU without LLVM's
# optimisation and fusion emitters (the test suite's quick settings, `tests/_support/xla_flags.py`); its one-row
# products are padded to the library matmul (`omnijax.models.layers.padded_one_row_products`) at trace time.
QUICK_COMPILE = {"cpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                         "xla_cpu_use_fusion_emitters": False}}

# Untrimmed steps without an answer after which the full step's compile starts all the same (a chat's system prompt
# is its first step and the question its second: the worker starts after the question's answer block, not between
# them; a stream of media units starts it after its second unit).
DEFER_STEPS = 2

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


def _lower_priority() -> None:
    """Gives the calling thread (a worker) the lowest scheduling priority (Linux: a thread's own nice value, 19), so
    the session's next steps, which run the untrimmed program meanwhile, are not slowed by its compile on a machine
    with few cores; where that is not possible it runs at the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or refused: the same compile, at the process's priority
        pass


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
        self._answers = False  # whether the last untrimmed step decodes an answer
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
        self._answers = answer > 0
        self.untrimmed_steps += untrimmed
        return untrimmed

    def compile_after(self, outputs: Any) -> None:
        """Compiles the full step for the last untrimmed step's arguments in a worker thread, once `outputs` (that
        step's) are computed: started at once, it took one of a 2-core machine's cores from the step's own run.
        Deferred (nothing started) after an untrimmed step that decodes no answer, unless it is the
        `DEFER_STEPS`-th: the next untrimmed step's worker compiles the full step for its own arguments."""
        if self._shapes is None or (not self._answers and self.untrimmed_steps < DEFER_STEPS):
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
        _lower_priority()
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
