"""An engine with recall warmed up (`recall_warmup.warm_up_recall`, what `omnijax serve` runs) answers a session's
first question without compiling anything: no program is handed to XLA from the question's submit to its answer
(jax's own compile events, counted from any thread, the recall executor's too; a program loaded from the persistent
compilation cache counts too). Control: the same question on an engine of the same settings that was not warmed,
after the process dropped every compiled program it held (as the suite does between modules), compiles or loads
programs (so the count can fail). The settings are `test_engine_recall`'s (its programs compile once per suite); the
warm-up leaves no session open and the pool as it was, and is refused by name without recall or with sessions
open."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
from jax import monitoring

from omnijax import compilation_cache
from omnijax.chunks.chunk import text_chunk
from omnijax.serve.engine.engine import Engine, EngineConfig
from omnijax.serve.engine.recall_warmup import warm_up_recall
from omnijax.streaming.config import StreamConfig
from tests._support import recall_setup
from tests.serve.engine.test_engine_recall import PAGE, POLICIES, T, _config

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class _Compiles:
    """Counts the programs jax hands to its backend (from any thread) while registered."""

    def __init__(self):
        self.count, self._lock = 0, threading.Lock()

    def __call__(self, event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.count += 1

    def __enter__(self) -> "_Compiles":
        monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *_) -> None:
        monitoring.unregister_event_duration_listener(self)


@pytest.fixture(scope="module")
def model():
    return recall_setup.decoder()


def _engine(model):
    return Engine(model, EngineConfig(stream=_config(POLICIES["omnipick"]), chunk_tokens=T, buckets=(1, 2, 4)))


def _first_question(engine) -> tuple[int, list[int]]:
    """A session fed context, then its first question: (programs compiled from the question's submit to its answer,
    the answer's tokens)."""
    rng = np.random.default_rng(3)
    engine.open("real")
    for i in range(8):
        engine.submit("real", text_chunk(rng.integers(3, 290, int(rng.integers(5, T + 1))), length=T, unit=2 * i), 0)
        engine.tick()
    assert engine.recall_stats("real").stored_units > 0
    with _Compiles() as compiles:
        engine.submit("real", text_chunk(rng.integers(3, 290, 7), length=T, unit=500, answer_tokens=3), 3)
        report = engine.tick()
        while report.recalling:
            concurrent.futures.wait(engine.recall.futures(), 120)
            report = engine.tick()
    assert engine.recall_stats("real").recalled_cells > 0
    return compiles.count, report.outputs["real"].tokens


def test_a_first_question_after_warm_up_compiles_nothing(model):
    compilation_cache.clear_in_memory()  # nothing of the settings in memory: the warm-up compiles or loads it all
    engine = _engine(model)
    free = engine.free_pages
    warmed = warm_up_recall(engine, [1])
    assert warmed["questions"] == 1 and warmed["writes"] == 7 and warmed["gathers"] >= 9, warmed
    assert engine.sessions == [] and engine.free_pages == free
    compiled, tokens = _first_question(engine)
    assert compiled == 0 and tokens, compiled

    # control: not warmed, the process's programs dropped (so none of these settings is in memory), the same
    # question compiles or loads programs
    compilation_cache.clear_in_memory()
    cold = _engine(model)
    compiled, cold_tokens = _first_question(cold)
    assert compiled > 0 and cold_tokens == tokens, compiled


def test_warm_up_is_refused_without_recall_or_with_sessions_open(model):
    engine = _engine(model)
    engine.open("x")
    with pytest.raises(ValueError, match="runs before serving; sessions are open"):
        warm_up_recall(engine, [1])
    plain = Engine(model, EngineConfig(stream=StreamConfig(num_pages=8, page_size=PAGE, max_answer_tokens=3),
                                       chunk_tokens=T))
    with pytest.raises(ValueError, match="needs an engine with StreamConfig\\(recall"):
        warm_up_recall(plain, [1])
