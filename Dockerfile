# SPDX-License-Identifier: Apache-2.0
# ibpembed's images, from one build stage: the server (the default target, last) and, as target
# `triton`, NVIDIA Triton Inference Server with ibpembed's Python-backend model. CUDA kernels for
# sm_80 / sm_90, CPU path picked at run time. BuildKit (Docker's builder since 23.0) builds only
# the stages a target needs, so the server image never pulls Triton's.
#
#   docker build -t ibpembed:0.1.0 .
#   docker run --gpus all -p 50051:50051 -p 9464:9464 -v "$PWD/tables:/tables:ro" \
#     ibpembed:0.1.0 serve --tables /tables
#
#   docker build --target triton -t ibpembed-triton:0.1.0 .      # see deploy/triton/README.md
#   ibpembed triton-repo tables/ -o model_repository/          # on the host, once per table set
#   docker run --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#     -v "$PWD/tables:$PWD/tables:ro" -v "$PWD/model_repository:/models:ro" \
#     ibpembed-triton:0.1.0 tritonserver --model-repository=/models
#
# NVIDIA driver: the CUDA 13 base images need a host driver >= 580 (the images set
# NVIDIA_REQUIRE_CUDA, so the NVIDIA container runtime refuses to start the container on an
# older driver, e.g. R535/R550 fleets). PyPI's torch==2.13.0 is built against CUDA 13
# (cuda-toolkit 13.0.x), so CUDA_TAG must stay 13.x; a CUDA 12 image would need torch from a
# cu12x index. Without a GPU (or with a failing CUDA self-test) the server serves on the CPU.
#
# Layers: the pinned requirements are installed before any source is copied, so a source edit
# rebuilds only the (small) package layers, not the ~3 GB of torch and CUDA wheels. Each runtime
# stage gets only requirements/runtime.txt and the two built wheels: no compiler, no dev or test
# pins, no source tree, no editable install. The build stage uses the Ubuntu of both runtime
# bases (24.04), so the wheels match their python3 (pip refuses them otherwise).

ARG CUDA_TAG=13.0.1
ARG TRITON_TAG=25.10-py3

FROM nvidia/cuda:${CUDA_TAG}-devel-ubuntu24.04 AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's own builds of these track security updates within the release: not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
    && rm -rf /var/lib/apt/lists/*
# No GPU at build time: name the architectures instead of probing for them.
ENV TORCH_CUDA_ARCH_LIST="8.0;9.0" \
    MAX_JOBS=4 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/runtime.txt requirements/base.txt requirements/
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install -r requirements/base.txt
COPY pyproject.toml setup.py README.md LICENSE ./
COPY csrc csrc
COPY service service
COPY clients/python clients/python
# The extension needs the torch it compiles against: no build isolation.
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /wheels . clients/python

# Target triton: the wheels in a venv on Triton's image (no second tritonserver). Triton's Python
# backend embeds that image's python3 and its stub does not apply PYTHONPATH: the model's
# model.py puts PYTHONPATH's entries (here the venv's site-packages, linked to a path without
# the Python version in it) first on sys.path.
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG} AS triton
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home ibpembed
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements/runtime.txt /tmp/runtime.txt
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -r /tmp/runtime.txt \
    && rm /tmp/runtime.txt \
    && ln -s "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
        /opt/venv/site-packages
COPY --from=build /wheels /tmp/wheels
RUN /opt/venv/bin/pip install --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONPATH="/opt/venv/site-packages" \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
# HTTP, gRPC and metrics (Triton's own metrics and the model's ibpembed_* ones).
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/v2/health/ready"]
CMD ["tritonserver", "--model-repository=/models"]

# The server, the default target: last, so that a plain `docker build .` builds it.
FROM nvidia/cuda:${CUDA_TAG}-runtime-ubuntu24.04 AS server
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home ibpembed
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements/runtime.txt /tmp/runtime.txt
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -r /tmp/runtime.txt \
    && rm /tmp/runtime.txt
COPY --from=build /wheels /tmp/wheels
RUN /opt/venv/bin/pip install --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    IBPEMBED_HOST=0.0.0.0 \
    IBPEMBED_PORT=50051 \
    IBPEMBED_METRICS_PORT=9464
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 9464
# Asks the lookup service's gRPC health status (SERVING once the tables are loaded and the
# device checked; NOT_SERVING while loading and draining), through the torch-free client.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys; from ibpembed_client import LookupClient; c = LookupClient('127.0.0.1:' + os.environ['IBPEMBED_PORT']); sys.exit(0 if c.is_serving('ibpembed.v1.EmbeddingLookup', timeout=4) else 1)"]
ENTRYPOINT ["ibpembed"]
CMD ["serve"]
