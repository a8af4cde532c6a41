"""This process's compilation caches (XLA's and the kept executables) pointed at an empty directory for a test, with
no program held in memory, then back at the suite's: `with empty_compilation_cache(path, monkeypatch): ...`, or as
a pytest fixture body (`yield from`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnijax import compilation_cache


@contextlib.contextmanager
def empty_compilation_cache(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Yields `path`, the cache directory while the block runs (kept executables on: `OMNIJAX_EXECUTABLE_CACHE`)."""
    compilation_cache.clear_in_memory()  # a compile jax's in-memory cache answers is not written
    before = compilation_cache.cache_dir()
    monkeypatch.setenv(compilation_cache.EXECUTABLE_ENV, "on")
    compilation_cache.enable(path)
    try:
        yield path
    finally:
        if before is None:
            compilation_cache.disable()
        else:
            compilation_cache.enable(before)
