# syntax=docker/dockerfile:1
# ffn-serve image, CPU or CUDA from this one file:
#   docker build -t ffn-serve:cpu .
#   docker build --build-arg VARIANT=cuda -t ffn-serve:cuda .
# VARIANT picks the base stage below, and with it the PyTorch wheel index torch comes from. Both
# bases are python:3.11-slim by default: the CUDA wheels of torch carry the CUDA libraries they need, so the
# host needs only the NVIDIA driver and container toolkit. CUDA_BASE can name another base with
# Python 3.11 (its `python` and `pip` are used as they are).
# Weights and config.toml go in a volume mounted at /models; with none there, the built-in `demo`.
# The load tester has a small image of its own, without torch: docker build --target loadtest.

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0

# Each base stage installs torch from its variant's index first, so that no later requirement
# pulls another build. The index is a build argument, not an ENV: it is not in the image's
# environment nor in its containers' (BuildKit still records it in `docker history`: never put
# credentials in the URL).
FROM ${CPU_BASE} AS base-cpu
ARG TORCH_VERSION
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --disable-pip-version-check "torch==${TORCH_VERSION}" --index-url "${CPU_TORCH_INDEX}"

FROM ${CUDA_BASE} AS base-cuda
ARG TORCH_VERSION
ARG CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN pip install --no-cache-dir --disable-pip-version-check "torch==${TORCH_VERSION}" --index-url "${CUDA_TORCH_INDEX}"

# ffn-loadtest alone: the ffn-client distribution and its loadtest extra (rich, matplotlib,
# prometheus-client), no torch and no server. docker-compose.yml's `loadtest` service runs it.
FROM ${CPU_BASE} AS loadtest
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp MPLCONFIGDIR=/tmp/matplotlib
WORKDIR /opt/ffn-client
COPY client/pyproject.toml client/
COPY ffn_client ffn_client
RUN pip install "./client[loadtest]" && rm -rf client/build ./*.egg-info client/*.egg-info
USER 10001:10001

# The server (the last stage: what `docker build` builds without --target).
# hadolint ignore=DL3006
FROM base-${VARIANT}
# OCI annotations: what the image is, which release, from which commit (REVISION: `--build-arg
# REVISION=$(git rev-parse HEAD)`; deploy/docker_check.py passes it). VERSION follows pyproject.toml.
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="ffn-serve" \
      org.opencontainers.image.description="A transformer's position-wise feed-forward network over HTTP and gRPC (KServe V2, Triton's protocol), micro-batched." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="MIT"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The other dependencies, read from pyproject.toml alone: this layer is rebuilt only when the
# dependencies change, not when the code does.
WORKDIR /opt/ffn-serve
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(p['build-system']['requires'] + p['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The code, installed without touching the dependencies above.
COPY README.md ./
COPY ffn_core ./ffn_core
COPY app ./app
COPY ffn_client ./ffn_client
RUN pip install --no-deps --no-build-isolation . \
 && rm -rf build ./*.egg-info

COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/ffn-entrypoint
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/ffn-healthcheck

RUN groupadd --system --gid 10001 ffn \
 && useradd --system --uid 10001 --gid ffn --create-home --home-dir /home/ffn --shell /usr/sbin/nologin ffn \
 && mkdir -p /models
USER 10001:10001
WORKDIR /home/ffn

# Inside the container only: listen on every interface. The port stays ffn-serve's default (8000)
# unless FFN_PORT or the config file says otherwise; the health check follows either.
ENV FFN_HOST=0.0.0.0 \
    MODELS_DIR=/models
# 8000 HTTP, 8001 gRPC (FFN_GRPC_PORT; FFN_GRPC=false turns it off), 8002 /metrics without the
# API key where FFN_METRICS_PORT=8002 (compose and the manifests set it).
EXPOSE 8000 8001 8002

# Ready = every model loaded and warm; loading large weights can take a while, hence start-period.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["ffn-healthcheck"]

# The entry script execs the command, so ffn-serve runs as PID 1 and gets SIGTERM itself: it stops
# taking work, answers what it accepted, and exits within FFN_DRAIN_TIMEOUT_S (20 s by default).
ENTRYPOINT ["ffn-entrypoint"]
CMD ["ffn-serve"]
