# k3serve — two commands on a fresh machine: `make run`, `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.k3serve-installed
# Never put the repository root on sys.path: `operator/` must not shadow the stdlib module.
export PYTHONSAFEPATH := 1
export K3SERVE_HOME ?= $(HOME)/.cache/k3serve
PYTEST_ARGS ?=
# test files run side by side on this many processes (pytest-xdist; each file stays on one process, so its
# module-scoped servers and simulations are started once); TEST_WORKERS=0 runs everything in this process
TEST_WORKERS ?= 2

.PHONY: install run test test-fast bench lint fmt clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

run: install
	$(BIN)/k3serve up

test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install
	$(BIN)/python benchmarks/run_all.py

lint: install
	$(BIN)/ruff check .

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean-venv:
	rm -rf $(VENV)
