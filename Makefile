# Developer entry points. On a fresh machine `make demo` or `make test` first builds .venv:
# python3 -m venv, upgrade pip, torch==2.13.0 (installed before anything that depends on torch, so
# the resolver keeps that build), then this package in editable mode with its dev extras, at the
# versions of constraints.txt.
#
#   make PYTHON=python3.11 test          # pick the interpreter that creates .venv
#   make TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu' venv
#                                        # where the default index would serve a CUDA build of torch

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
DEMO_ARGS ?=

.PHONY: venv demo test test-slow lint

venv: $(VENV)/.stamp

# Rebuilt only when pyproject.toml or constraints.txt changes (or the stamp is missing); otherwise
# `make venv` is a no-op. constraints.txt: the exact versions behind the committed numbers.
$(VENV)/.stamp: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/python -m recipes.translation.demo $(DEMO_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

test: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q

# The tests marked slow (end-to-end benchmark commands, end-to-end runs that repeat a default path
# through another optimizer, the full chaos and soak runs): CI runs them after `make test`.
test-slow: venv
	$(BIN)/pytest -q -m slow
