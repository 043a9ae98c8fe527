# syntax=docker/dockerfile:1
# The kvserve image: the engine (`kvserve serve`, and `kvserve model pull` in the engine
# pods' init container) and the gateway (`kvserve gateway`). From the repository root:
#
#   docker build -f docker/kvserve.Dockerfile -t ghcr.io/kvserve/kvserve:0.1.0 .
#
# (or `make images`; README.md, "Container images"). The Helm chart and the operator use
# ghcr.io/kvserve/kvserve:<version> by default.
#
# CUDA: PyTorch's cu128 wheels bring the CUDA 12.8 user-space libraries (cuBLAS, cuDNN,
# NCCL, … as nvidia-* wheels), so the base is NVIDIA's CUDA 12.8 *base* image: the CUDA
# runtime and the environment the NVIDIA container toolkit reads
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES), without a second copy of those
# libraries (the -runtime/-cudnn-runtime tags would add ~3 GB). The driver comes from
# the node (NVIDIA device plugin or GPU operator).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG VERSION=0.1.0

# ---- build: a virtual environment with torch and kvserve ----------------------------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX_URL
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
# PyTorch first, built for CUDA 12.8; the install below then keeps it (torch>=2.5 holds).
RUN pip install --index-url ${TORCH_INDEX_URL} torch
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY operator/ operator/
# The install command of README.md ("Container images"); tests/test_dockerfiles.py
# checks that both say the same.
RUN pip install .
# The bundled demo model at a fixed path: an InferenceModel can serve it with
# source file:///opt/kvserve/demo-model (no download, no GPU needed).
RUN mkdir -p /opt/kvserve \
 && ln -s "$(python -c 'import kvserve, pathlib; print(pathlib.Path(kvserve.__file__).parent / "demo_model" / "kvserve-travel-tiny")')" /opt/kvserve/demo-model \
 && test -f /opt/kvserve/demo-model/config.json
# No installer in the final image.
RUN pip uninstall --yes pip

# ---- final: Python and the environment, nothing to build with -----------------------
FROM ${CUDA_IMAGE}
ARG VERSION
LABEL org.opencontainers.image.title="kvserve" \
      org.opencontainers.image.description="kvserve LLM engine (kvserve serve) and gateway (kvserve gateway), CUDA 12.8" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvserve/kvserve" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# Ubuntu 24.04 images ship a user "ubuntu" with uid 1000; kvserve takes that uid (the
# operator's engine pods and the chart run as 1000:1000).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && if getent group ubuntu >/dev/null; then groupdel ubuntu; fi \
 && groupadd --gid 1000 kvserve \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvserve /opt/kvserve
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 1000:1000
WORKDIR /tmp
# Engine: HTTP 8000, gRPC 50051. Gateway: 8080.
EXPOSE 8000 50051 8080
ENTRYPOINT ["kvserve"]
# Without arguments: the bundled demo model on 0.0.0.0:8000 (the operator and the chart
# set their own command).
CMD ["serve", "--host", "0.0.0.0"]
