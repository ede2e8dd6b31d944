# SPDX-License-Identifier: Apache-2.0
# Two commands on a fresh machine: `make serve` (the embedded demo) and `make test`. Both set
# the venv up on first use and rebuild the extension when csrc/ changed.
PYTHON ?= python3
VENV ?= .venv
# tritonclient's gRPC client needs protobuf<7 (the service pins 7): a venv of its own.
TRITON_GRPC_VENV ?= .venv-triton-grpc
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
DEPS_STAMP := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.extension-built
REQUIREMENTS := $(wildcard requirements/*.txt) pyproject.toml clients/python/pyproject.toml
CSRC := $(shell find csrc -type f) setup.py

.PHONY: help setup build serve test lint bench bench-quick reliability cuda-check gpu-run arm-check proto

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(DEPS_STAMP): $(REQUIREMENTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/dev.txt
	$(PIP) install --no-deps -r requirements/data.txt
	$(PIP) install --no-deps -r requirements/torchrec.txt
	$(PIP) install --no-deps -e clients/python
	$(PIP) install --no-deps -r requirements/triton.txt
	$(PYTHON) -m venv $(TRITON_GRPC_VENV)
	$(TRITON_GRPC_VENV)/bin/pip --disable-pip-version-check -q install --no-deps -r requirements/triton-grpc.txt
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(CSRC)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

setup: $(BUILD_STAMP)  ## venv in .venv, pinned deps, ibpembed._C built in place (minutes, once)

build:  ## rebuild ibpembed._C now (incremental)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $(BUILD_STAMP)

serve: $(BUILD_STAMP)  ## serve the embedded demo table set on 127.0.0.1:50051
	$(VENV)/bin/ibpembed serve

lint: $(DEPS_STAMP)  ## ruff, mypy (the service and the client), clang-format --dry-run (C++, CUDA)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	git ls-files -z '*.cpp' '*.h' '*.cu' '*.cuh' | xargs -0 $(VENV)/bin/clang-format --dry-run -Werror

test: $(BUILD_STAMP) lint  ## lint, then every test (tests/, benchmarks/tests/, reliability/tests/)
	$(PY) -m pytest -q

bench: $(BUILD_STAMP)  ## every benchmark at full size, then BENCHMARKS.md (about 20 min)
	$(PY) -m benchmarks

bench-quick: $(BUILD_STAMP)  ## every benchmark at smoke size (minutes; not results)
	$(PY) -m benchmarks --quick --out benchmarks/.cache/quick --report benchmarks/.cache/quick/BENCHMARKS.md

reliability: $(BUILD_STAMP)  ## the campaigns at their documented sizes, then reliability/README.md's figures
	$(PY) -m reliability

proto: $(DEPS_STAMP)  ## regenerate the gRPC stubs in clients/python from proto/
	$(PY) proto/generate.py

cuda-check: $(DEPS_STAMP)  ## nvcc compile check of the CUDA kernels (sm_80 + sm_90; no GPU)
	PYTHON=$(PY) scripts/check_cuda_compile.sh

gpu-run:  ## on a GPU machine: build there, check and time the CUDA path (under 9 min; docs/cuda.md)
	scripts/gpu_run.sh

arm-check: $(DEPS_STAMP)  ## aarch64 cross-compile check of the portable CPU build
	PYTHON=$(PY) scripts/check_aarch64_compile.sh
