"""The suite's own setup: the quick-to-compile XLA flags reach this process and the workers it starts, once; LLVM
optimisation is off in every module but the execution-bound ones; the benchmarks get the settings from before."""

import os
import re
from pathlib import Path

import jax

from tests._support import multidevice, xla_flags


def test_apply_appends_the_flags_once_and_keeps_the_users():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_flags.apply(env) == xla_flags.DEFAULT
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {xla_flags.DEFAULT}".strip()
    child = dict(env)  # a subprocess whose conftest applies them again
    xla_flags.apply(child)
    assert child["XLA_FLAGS"] == env["XLA_FLAGS"]
    child[xla_flags.JAX_ENV] = "1"
    production = xla_flags.production_env(child)
    assert production["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and xla_flags.JAX_ENV not in production


def test_the_flags_can_be_replaced_or_turned_off():
    env = {xla_flags.ENV: "--xla_cpu_enable_fast_math=false"}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    off = {xla_flags.ENV: "", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    xla_flags.apply(off)
    assert off["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    bare: dict[str, str] = {}
    xla_flags.apply(bare)
    assert "XLA_FLAGS" not in xla_flags.production_env(bare)  # none before: none for the benchmarks


def test_this_process_and_its_workers_use_the_flags():
    flags = xla_flags.test_flags()
    assert os.environ["XLA_FLAGS"].endswith(flags)
    worker = multidevice.env(4)["XLA_FLAGS"]
    assert worker.startswith("--xla_force_host_platform_device_count=4") and worker.endswith(flags)


def test_llvm_optimisation_is_off_but_in_execution_bound_modules():
    assert xla_flags.wants_quick_compile("paging/test_paging.py", {})
    assert xla_flags.wants_quick_compile("serve/engine/test_serve_engine.py", {})
    assert not xla_flags.wants_quick_compile("serve/test_fault_injection.py", {})
    assert not xla_flags.wants_quick_compile("streaming/test_endurance.py", {})
    assert not xla_flags.wants_quick_compile("paging/test_paging.py", {xla_flags.QUICK_ENV: "0"})
    # This module compiles quickly, and the subprocesses it starts would too.
    quick = xla_flags.wants_quick_compile("test_suite_setup.py")
    assert jax.config.read("jax_disable_most_optimizations") is quick
    assert os.environ[xla_flags.JAX_ENV] == ("1" if quick else "0")


def test_the_execution_bound_modules_exist():
    """Each execution-bound entry names a test module that exists (a renamed one would silently compile quickly)."""
    tests_dir = Path(__file__).parent
    assert [m for m in xla_flags.EXECUTION_BOUND if not (tests_dir / m).is_file()] == []


def test_the_slow_first_table_names_existing_modules_and_make_test_keeps_its_order():
    """tests/conftest.py's SLOW_FIRST names test modules that exist (a renamed one would silently fall back to the
    end), each once, and `make test` keeps the collection order (xdist's default reorders modules by test count)."""
    from tests import conftest

    tests_dir = Path(conftest.__file__).parent
    assert [m for m in conftest.SLOW_FIRST if not (tests_dir / m).is_file()] == []
    assert len(set(conftest.SLOW_FIRST)) == len(conftest.SLOW_FIRST)
    makefile = (tests_dir.parent / "Makefile").read_text()
    recipe = makefile.split("\ntest:")[1].split("\n\n")[0]
    # the recipe's `$(PYTEST_ARGS)`, as make expands it (a `NAME := value` line of the Makefile)
    recipe = recipe.replace("$(PYTEST_ARGS)", re.search(r"^PYTEST_ARGS :=(.*)$", makefile, re.M).group(1))
    assert "--dist loadfile --no-loadscope-reorder" in recipe, recipe
    assert "--max-worker-restart 0" in recipe, recipe  # a crashed worker fails the run instead of hanging it
