"""Running compiled comparisons on several CPU devices: the test process has started JAX already (conftest), so the
work runs in a subprocess with forced host devices, sharing the suite's compilation cache, and reports one
`RESULT {json}` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests._support import ROOT, xla_flags


def env(devices: int) -> dict:
    """The worker's environment: `devices` CPU devices and the suite's quick-to-compile settings (`xla_flags`: its
    XLA flags, and LLVM optimisation off as in the calling module; these tiny programs then compile several times
    faster, what dominates here); sharded and unsharded runs share them, so comparisons are fair."""
    flags = f"--xla_force_host_platform_device_count={devices} {xla_flags.test_flags()}".strip()
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=str(ROOT))


def prelude() -> str:
    """Code every worker starts with: full-precision matmuls and the suite's persistent compilation cache (the
    directory the conftest chose)."""
    cache = os.path.abspath(os.environ["OMNIJAX_COMPILATION_CACHE"])
    return textwrap.dedent(f"""
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
        jax.config.update("jax_compilation_cache_dir", {cache!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    """)


def run_worker(code: str, devices: int = 8, timeout: int = 600) -> dict:
    """Runs `prelude() + code` on `devices` CPU devices; returns the JSON of its last `RESULT ` line."""
    run = subprocess.run([sys.executable, "-c", prelude() + code], env=env(devices), capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
