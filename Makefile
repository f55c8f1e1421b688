# The two commands of the quickstart: `make demo` and `make test`.
# Both create .venv (unless a virtualenv is already active), install what they need, then run.
PYTHON ?= python3
# The CPU build of torch; on this project's machines it installs from the local disk in seconds.
TORCH_CPU ?= torch==2.13.0
TRITON ?= triton>=3.2
# The lent GPU machine's Triton, beside the environment (not importable from it): the SM90 kernels' register checks
# compile with it too (tests/dsa/_sm90_compile.py); where it cannot be installed those tests skip.
GPU_TRITON ?= triton==3.6.0
# torchtitan for tests/integrations/test_torchtitan.py: the package and the few modules its model code imports, without
# its training-job dependencies (datasets, wandb, tensorboard). It needs Python 3.11+; on 3.10 those tests skip.
TORCHTITAN ?= "torchtitan==0.3.0; python_version>='3.11'" "spmd_types==0.2.3; python_version>='3.11'" \
	"tyro; python_version>='3.11'" "einops; python_version>='3.11'" "torch_checkpointing; python_version>='3.11'" \
	"docstring_parser; python_version>='3.11'" "typeguard; python_version>='3.11'"

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
	$(BIN)/python -m pip install -q --no-deps $(TORCHTITAN)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target "$$($(BIN)/python -c 'import sys; print(sys.prefix)')/triton-gpu" \
		"$(GPU_TRITON)" || echo "$(GPU_TRITON) not installed: the checks compiled with the GPU machine's Triton will skip"
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
