# SPDX-License-Identifier: Apache-2.0
# Two commands do everything on a fresh machine: `make setup`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
# tritonclient's gRPC client needs protobuf<7 (the service pins 7): a venv of its own.
TRITON_GRPC_VENV ?= .venv-triton-grpc
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check -q

.PHONY: setup build test lint cuda-check arm-check bench-codec bench-service proto

# Creates the venv, installs every pinned dependency, builds the native extension.
setup:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/dev.txt
	$(PIP) install --no-deps -r requirements/torchrec.txt
	$(PIP) install --no-deps -e clients/python
	$(PIP) install --no-deps -r requirements/triton.txt
	$(PYTHON) -m venv $(TRITON_GRPC_VENV)
	$(TRITON_GRPC_VENV)/bin/pip --disable-pip-version-check -q install --no-deps -r requirements/triton-grpc.txt
	$(MAKE) build

# Rebuilds ibpembed._C in place (incremental; ~1 min from scratch on 2 cores).
build:
	$(PIP) install --no-build-isolation --no-deps -e .

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

bench-codec:
	$(PIP) install --no-deps -r requirements/data.txt
	$(PY) -m benchmarks.codec

bench-service:
	$(PY) -m benchmarks.service

# Regenerates the gRPC stubs in clients/python from proto/ (a test checks they are fresh).
proto:
	$(PY) proto/generate.py

# nvcc compile check of the CUDA kernels (sm_80 + sm_90, -Xptxas -v; no link, no GPU needed).
cuda-check:
	PYTHON=$(PY) scripts/check_cuda_compile.sh

# aarch64 cross-compile check of the portable CPU build (Graviton, Grace); no link, no run.
arm-check:
	PYTHON=$(PY) scripts/check_aarch64_compile.sh
