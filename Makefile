# The two commands of the quickstart: `make demo` and `make test`.
# Both create .venv (unless a virtualenv is already active), install what they need, then run.
PYTHON ?= python3
# The CPU build of torch; on this project's machines it installs from the local disk in seconds.
TORCH_CPU ?= torch==2.13.0
TRITON ?= triton>=3.2

ifdef VIRTUAL_ENV
BIN := $(VIRTUAL_ENV)/bin
STAMP := $(VIRTUAL_ENV)/.longtrain-installed
else
BIN := .venv/bin
STAMP := .venv/.longtrain-installed
endif

.PHONY: test demo doctor install lint clean

$(BIN)/python:
	$(PYTHON) -m venv .venv

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_CPU)" "$(TRITON)"
	$(BIN)/python -m pip install -q -e ".[test,demo]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/longtrain demo

doctor: $(STAMP)
	$(BIN)/longtrain doctor

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff
	$(BIN)/python -m ruff check src tests benchmarks
	$(BIN)/python -m ruff format --check src tests benchmarks

clean:
	rm -rf .venv build dist src/*.egg-info .pytest_cache .hypothesis
