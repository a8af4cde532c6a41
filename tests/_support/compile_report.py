"""A pytest plugin that counts what each test compiles: `pytest -p tests._support.compile_report ...`.

For every test (setup, call and teardown together) it records, from `jax.monitoring`'s events:
  - programs: XLA programs handed to the backend (persistent-cache hits included),
  - misses: of those, the ones the persistent compilation cache did not hold (really compiled),
  - compile_s: seconds spent in backend compilation (a hit costs its read only),
  - trace_s / lower_s: seconds tracing jaxprs and lowering them to MLIR.
At the end it prints the totals per module and the tests with the longest compile time. Misses and programs are
noise-free figures beside wall time on a shared machine: compare them cold (an empty `OMNIJAX_TEST_JAX_CACHE`).
`OMNIJAX_COMPILE_REPORT_TOP` sets how many tests to list (default 15).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
from jax import monitoring

_BACKEND = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"

_FIELDS = ("programs", "misses", "compile_s", "trace_s", "lower_s")


class _Counter:
    """Accumulates the compile events of the current test."""

    def __init__(self) -> None:
        self.current: collections.Counter[str] = collections.Counter()
        self.per_test: dict[str, collections.Counter[str]] = {}

    def on_event(self, event: str, **_: Any) -> None:
        if event == _REQUESTS:
            self.current["requests"] += 1
        elif event == _HITS:
            self.current["hits"] += 1

    def on_duration(self, event: str, seconds: float, **_: Any) -> None:
        if event == _BACKEND:
            self.current["programs"] += 1
            self.current["compile_s"] += seconds
        elif event == _TRACE:
            self.current["trace_s"] += seconds
        elif event == _LOWER:
            self.current["lower_s"] += seconds

    def take(self, nodeid: str) -> None:
        counts = self.current
        counts["misses"] = counts["requests"] - counts["hits"]
        self.per_test[nodeid] = counts
        self.current = collections.Counter()


_COUNTER = _Counter()


def pytest_configure(config: pytest.Config) -> None:
    monitoring.register_event_listener(_COUNTER.on_event)
    monitoring.register_event_duration_secs_listener(_COUNTER.on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _COUNTER.current = collections.Counter()
    yield
    _COUNTER.take(item.nodeid)


def _row(name: str, counts: collections.Counter[str]) -> str:
    return (f"{counts['programs']:6d} {counts['misses']:6d} {counts['compile_s']:9.1f} {counts['trace_s']:7.1f} "
            f"{counts['lower_s']:7.1f}  {name}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _COUNTER.per_test:
        return
    header = f"{'progs':>6} {'misses':>6} {'compile_s':>9} {'trace_s':>7} {'lower_s':>7}  test"
    modules: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for nodeid, counts in _COUNTER.per_test.items():
        modules[nodeid.split("::")[0]].update({k: counts[k] for k in _FIELDS})
    write = terminalreporter.write_line
    terminalreporter.section("compile report: per module")
    write(header)
    for name, counts in sorted(modules.items(), key=lambda kv: -kv[1]["compile_s"]):
        write(_row(name, counts))
    top = int(os.environ.get("OMNIJAX_COMPILE_REPORT_TOP", "15"))
    terminalreporter.section(f"compile report: {top} tests with the longest compile time")
    write(header)
    ranked = sorted(_COUNTER.per_test.items(), key=lambda kv: -kv[1]["compile_s"])[:top]
    for nodeid, counts in ranked:
        write(_row(nodeid, counts))
