# make demo: create .venv, install omnijax, run the demo (tiny embedded model, no download).
# make test: create .venv, install omnijax with its test extras, run the whole test suite on both cores.
# make test-fast: the quick tier of the suite (pytest -m fast), for the inner loop.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@

demo: $(VENV)/.base
	$(PY) -m pip install --quiet -e ".[video,plot]"
	$(PY) -m omnijax.demo

# pytest-xdist: one module per worker (a module's compiled programs stay in its worker). The persistent compilation
# cache lives outside the clone (~/.cache/omnijax-tests/jax; OMNIJAX_TEST_JAX_CACHE overrides), so reruns are warm.
test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(VENV)/.test
	$(PY) -m pytest -q -n 2 --dist loadfile -m fast

clean:
	rm -rf $(VENV) demo_out .pytest_cache
