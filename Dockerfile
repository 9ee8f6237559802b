# syntax=docker/dockerfile:1
# The k3serve image (CPU): every component the operator renders runs from it
# (entrypoint: the k3serve console script; the Mooncake master is /opt/k3serve/bin/mooncake_master).
# The install steps are scripts/install.sh's, minus the editable/test parts (tests/test_dockerfile.py
# checks that they stay the same). Build and push: docs/kubernetes.md ("Build the image").
#   docker build -t ghcr.io/k3serve/k3serve:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONSAFEPATH=1
RUN python -m venv /opt/k3serve
WORKDIR /src
COPY constraints.txt pyproject.toml setup.py README.md ./
COPY k3serve/ k3serve/
COPY workers/ workers/
COPY kernels/ kernels/
COPY router/ router/
COPY kvstore/ kvstore/
COPY operator/ operator/
RUN /opt/k3serve/bin/python -m pip install -q --upgrade "pip==26.3" "setuptools==84.2.1" "wheel==0.48.0"
# torch first, alone: the CPU wheel (an unpinned torch would pull a CUDA build).
RUN /opt/k3serve/bin/python -m pip install -q -c constraints.txt --index-url ${TORCH_INDEX_URL} "torch==2.13.0"
RUN /opt/k3serve/bin/python -m pip install -q -c constraints.txt "."
# NIXL without its declared deps: they would pull a CUDA torch; the CPU UCX backend needs none of them.
RUN /opt/k3serve/bin/python -m pip install -q --no-deps -c constraints.txt "nixl-cu12==1.5.1"
# the Ray launcher (--distributed-executor-backend ray; workers/engine/parallel/ray_launcher.py)
RUN /opt/k3serve/bin/python -m pip install -q -c constraints.txt "ray==2.60.0"
RUN /opt/k3serve/bin/python -m compileall -q /opt/k3serve/lib \
 && test -x /opt/k3serve/bin/k3serve && test -x /opt/k3serve/bin/mooncake_master

FROM ${PYTHON_IMAGE}
# libibverbs1: the Mooncake wheel imports nothing without it (as in scripts/install.sh).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libibverbs1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 k3serve \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /var/cache/k3serve --shell /usr/sbin/nologin k3serve \
 && mkdir -p /var/cache/k3serve /models /etc/k3serve \
 && chown 1000:1000 /var/cache/k3serve
COPY --from=build /opt/k3serve /opt/k3serve
# Read-only root filesystem: every write goes to /tmp or $K3SERVE_HOME (emptyDirs in the pods).
ENV PATH=/opt/k3serve/bin:$PATH \
    PYTHONSAFEPATH=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    K3SERVE_HOME=/var/cache/k3serve \
    XDG_CACHE_HOME=/var/cache/k3serve \
    HF_HOME=/var/cache/k3serve/huggingface \
    TRITON_CACHE_DIR=/var/cache/k3serve/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/k3serve/inductor \
    UCX_MEM_EVENTS=no
USER 1000:1000
WORKDIR /var/cache/k3serve
EXPOSE 8000 9100 50051
LABEL org.opencontainers.image.title="k3serve" \
      org.opencontainers.image.description="Kubernetes-native P/D-disaggregated serving for Kimi K3-class models (CPU)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["/opt/k3serve/bin/k3serve"]
CMD ["--help"]
