# `make test` works on a fresh machine: it creates .venv, installs torch (the CPU wheel),
# the package with its test extras, and runs the whole test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: test venv lint fmt clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

test: venv
	$(PY) -m ruff check ddtree_cli tests benchmarks
	$(PY) -m ruff format --check ddtree_cli tests benchmarks
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check ddtree_cli tests benchmarks
	$(PY) -m ruff format --check ddtree_cli tests benchmarks

fmt: venv
	$(PY) -m ruff format ddtree_cli tests benchmarks
	$(PY) -m ruff check --fix ddtree_cli tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
