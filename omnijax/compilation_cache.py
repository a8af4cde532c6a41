"""A persistent JAX compilation cache, so a second run of a script, the demo or the tests does not compile again.

The command lines (`omnijax ...`, `make demo`, the evaluation harnesses) and the test suite call `enable()`; a
library user calls `omnijax.enable_compilation_cache()` (importing omnijax changes nothing process-wide). Compiled
programs are then written to and read from

    $OMNIJAX_COMPILATION_CACHE            when set to a directory,
    $XDG_CACHE_HOME/omnijax/jax           otherwise (XDG_CACHE_HOME defaults to ~/.cache),

unless the process already chose a cache directory itself (`jax.config.update("jax_compilation_cache_dir", ...)`
before importing omnijax), which is left as it is. `OMNIJAX_COMPILATION_CACHE=off` (or `0`, `false`, `none`) turns
it off. Entries are keyed by the program, the jax/jaxlib version and the backend, so a stale entry is never used;
delete the directory to reclaim its space.

Beside XLA's cache, the programs omnijax runs most (a session's step and scan, the engine's ticks) are kept whole as
serialised executables (`CachedJit`, under `<cache dir>/executables/`): a later process loads one without tracing or
lowering the Python function again, which on a small model was most of a warm start (the SmolLM2 demo spent 44 % of
its time tracing and 17 % lowering with every program already in XLA's cache). `OMNIJAX_EXECUTABLE_CACHE=off` turns
that part off (XLA's cache stays on). They are `omnijax.kept_executables`, whose names this module re-exports.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

# The serialised executables (`omnijax.kept_executables`), re-exported: callers name them from here.
from omnijax.kept_executables import (  # noqa: F401
    EXECUTABLE_ENV,
    EXECUTABLE_FORMAT,
    KEEP_BYTES,
    KEEP_VERSIONS,
    OFF,
    XLA_CACHE_HIT_EVENT,
    CachedJit,
    cached_jit,
    clear_in_memory,
    executables_dir,
    process_key,
    source_graph,
)

ENV = "OMNIJAX_COMPILATION_CACHE"


def default_dir() -> Path:
    """Where the cache lives when `OMNIJAX_COMPILATION_CACHE` names no directory."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "omnijax" / "jax"


def enable(directory: str | os.PathLike | None = None) -> Path | None:
    """Turns the persistent cache on; returns its directory, or None when it is off.

    Args:
        directory: the cache directory; default `$OMNIJAX_COMPILATION_CACHE` or `default_dir()`. Given
            explicitly it replaces a directory the process chose earlier.
    """
    if directory is None:
        setting = os.environ.get(ENV, "").strip()
        if setting.lower() in OFF:
            return None
        current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a flag jax's stubs omit
        if current and not setting:
            return Path(current)  # the process chose its own cache; keep it
        directory = setting or default_dir()
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program: the small ones of a streamed session add up to most of a short run's time.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax_cache.reset_cache()  # a cache opened earlier in this process is reopened at the new directory
    return path


def disable() -> None:
    """Stops reading and writing the persistent cache in this process."""
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cache.reset_cache()


def cache_dir() -> Path | None:
    """The directory in use, or None."""
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # a flag jax's stubs omit
    return Path(current) if current else None
