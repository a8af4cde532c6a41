"""How the test processes compile: quickly, except in the modules whose programs run long or against a clock.

A cold run of the suite is mostly XLA:CPU compiling tiny programs that then run a few times. Two settings trade run
time for compile time (a streamed session of the tiny decoder, CPU seconds to compile / to run):

- `--xla_cpu_use_fusion_emitters=false` (an XLA flag, fixed when jax starts): about 1.5x quicker to compile, 1.5x
  slower to run. `apply()` (tests/conftest.py, before jax starts) appends it to `XLA_FLAGS`, so every subprocess a
  test starts inherits it and shares the suite's cache keys. `OMNIJAX_TEST_XLA_FLAGS` replaces it (empty: none).
- `jax_disable_most_optimizations` (LLVM optimisation off; a jax setting read at every compile): with the flag above,
  about 3x quicker to compile than XLA's defaults, 3x slower to run. `quick_compile(on)` switches it, for this
  process and the subprocesses it starts; the conftest turns it on for every module but the EXECUTION_BOUND ones
  (`OMNIJAX_TEST_QUICK_COMPILE=0`: off everywhere).

Benchmarks measure speed: `production_env()` gives them the settings the process had before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

DEFAULT = "--xla_cpu_use_fusion_emitters=false"
ENV = "OMNIJAX_TEST_XLA_FLAGS"  # the test flags (set by the user to override, or by apply())
BASE_ENV = "OMNIJAX_TEST_BASE_XLA_FLAGS"  # XLA_FLAGS as they were before apply()
QUICK_ENV = "OMNIJAX_TEST_QUICK_COMPILE"  # "0": never turn LLVM optimisation off
JAX_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"  # how a subprocess's jax reads `jax_disable_most_optimizations`

# Test modules (paths under tests/) whose programs run long enough, or against a clock, that they keep LLVM
# optimisation: the servers whose tests assert a latency, a frame cadence or how many frames a tick batched (a tick
# ~3x slower changes those figures), the hour-long sessions, and the real-model modules (SmolLM2-135M's 30 layers
# decode ~4x slower without it, and they compile only a few programs), and the modules whose servers decode many
# ticks over the demo model's 152K vocabulary: serve/test_structured.py (some 1,000 sampled tokens; warm, 40 CPU s
# quick-compiled, 23 s optimised, 13 s more to compile cold) and the scripted tool servers' (test_openai_tools.py 66
# -> 38 CPU s, realtime/test_realtime_tools.py 35 -> 24 s). Every other serving module compiles quickly:
# its tests compare answers with an oracle, however long a tick takes (serve/test_speech_written.py cold: 202 CPU s
# with optimisation, 123 s without; warm 52 s without). Not tests/test_bench_smoke.py: its `--smoke` scripts check
# that a script runs, they measure nothing, and run with the quick settings whatever this says (its `_env`).
EXECUTION_BOUND = (
    "serve/test_fault_injection.py", "serve/test_serve_traffic.py", "serve/test_serve_slow_consumer.py",
    "serve/test_serve_server.py", "serve/test_serve_restarts.py", "serve/engine/test_per_token.py",
    "serve/realtime/test_realtime_churn.py", "serve/native/test_native_periodic.py",
    "serve/cluster/test_ray_replicas.py", "streaming/test_endurance.py", "convert/test_gguf_smollm2.py",
    "test_readme_and_demo.py", "serve/test_structured.py", "serve/test_openai_tools.py",
    "serve/realtime/test_realtime_tools.py",
)

def apply(environ: MutableMapping[str, str] = os.environ) -> str:
    """Appends the test flags to `environ["XLA_FLAGS"]` (once: a child that applies them again changes nothing).

    Returns:
        The test flags (`$OMNIJAX_TEST_XLA_FLAGS`, default `DEFAULT`).
    """
    flags = environ.get(ENV, DEFAULT)
    base = environ.get(BASE_ENV, environ.get("XLA_FLAGS", ""))
    environ[ENV], environ[BASE_ENV] = flags, base
    environ["XLA_FLAGS"] = " ".join(part for part in (base.strip(), flags.strip()) if part)
    return flags


def test_flags(environ: Mapping[str, str] = os.environ) -> str:
    """The test flags this process applied (`DEFAULT` when `apply` has not run)."""
    return environ.get(ENV, DEFAULT)


def wants_quick_compile(module: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the test module at `module` (a path relative to tests/, `/`-separated) compiles quickly."""
    return environ.get(QUICK_ENV, "1") != "0" and module not in EXECUTION_BOUND


def quick_compile(on: bool, environ: MutableMapping[str, str] = os.environ) -> None:
    """Turns LLVM optimisation off (`on`) or on for what this process compiles next and the subprocesses it starts."""
    import jax

    jax.config.update("jax_disable_most_optimizations", on)
    environ[JAX_ENV] = "1" if on else "0"


def production_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of `environ` with the XLA flags from before `apply()` and jax's optimisations on (for processes that
    measure speed)."""
    env = dict(environ)
    base = env.pop(BASE_ENV, None)
    env.pop(ENV, None)
    env.pop(JAX_ENV, None)
    if base is not None:
        if base:
            env["XLA_FLAGS"] = base
        else:
            env.pop("XLA_FLAGS", None)
    return env
