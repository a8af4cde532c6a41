"""Giving the allocator's free heap pages back to the system (glibc's `malloc_trim`).

XLA's compiler and a tokenizer's JSON parser free their working memory into glibc's arenas, which keep it resident:
measured on SmolLM2-135M, compiling a session's step left ~140 MB resident beside 513 MB of weights, and reading its
`tokenizer.json` ~34 MB. omnijax returns it where that is cheap (milliseconds, after work that took seconds): after
`omnijax.load` reads the tokenizer, and after a `Session` step or empty state compiles (`omnijax.streaming.session`).

Elsewhere than glibc (macOS, musl) `trim_heap` does nothing. Bounding the number of arenas (`MALLOC_ARENA_MAX`) is read
when the process starts, so a library cannot set it; it did not lower the compile's peak here (measured: 1, 2 and the
default gave the same peak within 30 MB).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own policy
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Returns the free pages of every heap arena to the system; True when some were returned (glibc only).

    Live memory is untouched: only pages no allocation uses are released, so resident memory falls by what the
    allocator kept after earlier frees."""
    malloc_trim = _malloc_trim()
    return bool(malloc_trim(0)) if malloc_trim is not None else False
