# make demo: create .venv, install omnijax, run the demo (tiny embedded model, no download).
# make test: create .venv, install omnijax with its test extras, run the test suite.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

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

test: $(VENV)/.test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) demo_out .jax_cache .pytest_cache
