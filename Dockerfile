# SPDX-License-Identifier: Apache-2.0
# ibpembed server image: CUDA kernels for sm_80 / sm_90, CPU path picked at run time.
#
#   docker build -t ibpembed:0.1.0 .
#   docker run --gpus all -p 50051:50051 -p 9464:9464 -v "$PWD/tables:/tables:ro" \
#     ibpembed:0.1.0 serve --tables /tables
#
# The build stage runs `make setup`, the same command CI's .ci/run runs, so the image holds the
# environment CI tested; PyPI's torch==2.13.0 is the CUDA build, and the devel image's nvcc
# builds the CUDA kernels into ibpembed._C next to the CPU ones.

ARG CUDA_TAG=13.0.1

FROM nvidia/cuda:${CUDA_TAG}-devel-ubuntu24.04 AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's own builds of these track security updates within the release: not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ make \
    && rm -rf /var/lib/apt/lists/*
# No GPU at build time: name the architectures instead of probing for them.
ENV TORCH_CUDA_ARCH_LIST="8.0;9.0" \
    MAX_JOBS=4 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY . .
RUN make setup PYTHON=python3 VENV=/opt/venv

FROM nvidia/cuda:${CUDA_TAG}-runtime-ubuntu24.04
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home ibpembed
# The venv's editable installs point at /src/service and /src/clients/python: same paths here.
COPY --from=build /opt/venv /opt/venv
COPY --from=build /src/service /src/service
COPY --from=build /src/clients/python /src/clients/python
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    IBPEMBED_HOST=0.0.0.0 \
    IBPEMBED_PORT=50051 \
    IBPEMBED_METRICS_PORT=9464
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 9464
# Asks the lookup service's gRPC health status (SERVING once tables are loaded; NOT_SERVING
# while draining), through the torch-free client.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys; from ibpembed_client import LookupClient; c = LookupClient('127.0.0.1:' + os.environ['IBPEMBED_PORT']); sys.exit(0 if c.is_serving('ibpembed.v1.EmbeddingLookup', timeout=4) else 1)"]
ENTRYPOINT ["ibpembed"]
CMD ["serve"]
