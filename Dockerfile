# syntax=docker/dockerfile:1
# nextn: OpenAI-compatible Qwen3.5 server with exact MTP speculative decoding.
#
#   docker build -t nextn .                                 CPU (default): Python slim + the CPU torch wheel
#   docker build -t nextn:cuda --build-arg VARIANT=cuda .   GPU: CUDA base + CUDA torch and triton
#
#   docker run -p 8000:8000 nextn                           serves the bundled demo model
#   docker run --gpus all -p 8000:8000 -v /models/Qwen3.5-0.8B:/model nextn:cuda /model
#
# Arguments after the image name are `nextn serve` arguments (MODEL_DIR, --num-speculative-tokens ...);
# every setting also reads NEXTN_* variables (docker run -e NEXTN_MAX_NUM_SEQS=4 ...). The install steps
# are docker/install.sh; tests/test_docker.py runs this file's RUN lines that call it in a fresh venv.

ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base-cpu
# A C compiler for nextn's CPU kernels (engine/model/ops/cpu_*.c, built on first start; without one the decode
# and verify steps run as torch ops, slower per token and not batch-invariant: bench/RESULTS.md).
# Unpinned: the versions are whatever this pinned base release's Debian archive carries.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The CUDA libraries come with torch as pip wheels; the base adds the driver hookup (NVIDIA_* variables,
# the CUDA >= 13.0 driver requirement that PyPI's torch 2.13.0 wheels are built for). Ubuntu ships no Python
# in it; triton compiles a small C launcher on first use, so the compiler and Python headers stay.
FROM nvidia/cuda:13.0.2-base-ubuntu24.04 AS base-cuda
# Unpinned: the versions are whatever this pinned base release's Ubuntu archive carries.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# One of the two stages above (hadolint cannot resolve a stage name built from an ARG).
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 --user-group nextn
WORKDIR /opt/nextn

# Dependencies first (torch is most of the image), from pyproject.toml alone: source edits keep this layer.
COPY pyproject.toml ./
COPY docker/ docker/
RUN sh docker/install.sh deps "$VARIANT"
COPY . .
RUN sh docker/install.sh nextn

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "/opt/nextn/docker/healthcheck.py"]
ENTRYPOINT ["nextn", "serve", "--host", "0.0.0.0"]
