# Two commands do all set-up on a fresh machine with Python 3.11, pip and venv:
#   make serve   creates .venv, installs moemesh, starts every service on the default model
#   make test    installs the test dependencies and runs the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# pytest-xdist workers for `make test` (2 fits the 2-core CI machine; TEST_WORKERS=0 runs serially)
TEST_WORKERS ?= 2

.PHONY: serve test test-long install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(VENV)/bin/moemesh serve

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=20 -m "not long_context" tests

# the long-context oracle comparisons (16K and 32K tokens against transformers; several minutes on 2 cores)
test-long: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m long_context tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
