"""Shared test setup: CPU only, float32 matmuls at full precision, a persistent compilation cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
_cache = os.environ.get("OMNIJAX_TEST_JAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
