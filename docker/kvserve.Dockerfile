# syntax=docker/dockerfile:1
# The kvserve image: the engine (`kvserve serve`, and `kvserve model pull` in the engine
# pods' init container) and the gateway (`kvserve gateway`). From the repository root:
#
#   docker build -f docker/kvserve.Dockerfile -t ghcr.io/kvserve/kvserve:0.1.0 .
#
# (or `make images`, which builds through docker/build; README.md, "Container images").
# The Helm chart and the operator use ghcr.io/kvserve/kvserve:<version> by default.
#
# CUDA: PyTorch's cu128 wheels bring the CUDA 12.8 user-space libraries (cuBLAS, cuDNN,
# NCCL, … as nvidia-* wheels), so the default base is NVIDIA's CUDA 12.8 *base* image:
# the CUDA runtime and the environment the NVIDIA container toolkit reads
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES), without a second copy of those
# libraries (the -runtime/-cudnn-runtime tags would add ~3 GB). The driver comes from
# the node (NVIDIA device plugin or GPU operator).
#
# BASE_IMAGE may be any Debian or Ubuntu image (the tests use a debootstrap Debian base);
# Python comes from its apt repository. TORCH_INDEX_URL="" installs torch from the pip
# index (PyPI's Linux wheel, which brings its own CUDA libraries).
#
# Nothing of the building machine reaches the image, its layers or its history: its pip
# settings (PIP_INDEX_URL, …) arrive as the build secret "pip-env", its CA file as the
# secret "pip-cert", and its pip cache, a wheel directory kept between builds and its
# local find-links directory as the named build contexts "pip-cache", "wheels" and
# "find-links" (bind mounts, not layers). docker/build passes them all; a plain
# `docker build` needs none of them.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG VERSION=0.1.0

# Empty unless docker/build (or --build-context NAME=DIR) supplies them.
FROM scratch AS pip-cache
FROM scratch AS wheels
FROM scratch AS find-links

# ---- pip: a current pip's wheel, which the stages below run pip from ------------------
FROM ${BASE_IMAGE} AS pip
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
# A current pip: it reads the cache format the host's (current) pip writes. The stages
# below run it from its wheel (`python pip.whl/pip`), copied to /tmp/pip and removed
# after use: no pip in the image's environment.
RUN --mount=type=bind,from=pip-cache,target=/root/.cache/pip,rw \
    --mount=type=bind,from=find-links,target=/run/find-links \
    --mount=type=secret,id=pip-cert \
    --mount=type=secret,id=pip-env \
    if [ -f /run/secrets/pip-env ]; then . /run/secrets/pip-env; fi \
 && if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && export PIP_FIND_LINKS="/run/find-links ${PIP_FIND_LINKS:-}" \
 && python3 -m venv /opt/pip \
 && /opt/pip/bin/pip install --upgrade pip \
 && /opt/pip/bin/pip download --no-deps --dest /opt/pip-wheel pip \
 && mv /opt/pip-wheel/pip-*.whl /opt/pip-wheel/pip.whl

# ---- requirements: kvserve's dependency list alone, from pyproject.toml. The runtime
# stage copies just this file, so its layer of dependencies is rebuilt when the list
# changes, not when another part of pyproject.toml (a tool's settings) does.
FROM pip AS requirements
COPY pyproject.toml /tmp/deps/
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/deps/pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/deps/requirements.txt

# ---- runtime: Python, the user, and a virtual environment with torch and kvserve's
# dependencies: the final image's lower layers, built in place (no copy of ~6 GB), with
# only the dependency list as input, so they are rebuilt when the dependencies change,
# not when the code does.
FROM ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX_URL
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
# No pip in this environment (pip runs from the stage "pip"'s wheel). kvserve itself
# goes to /opt/kvserve/lib (stage "build"); this .pth file puts it on the path.
COPY --from=pip /opt/pip-wheel/pip.whl /tmp/pip/
RUN python3 -m venv --without-pip /opt/venv \
 && echo /opt/kvserve/lib > "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvserve.pth"
# Each install below gets the pip settings of the building machine (the CA secret when
# given; the mounted find-links directory) and two build mounts, never layers: the host's
# pip cache, and a wheel directory ("wheels"): `pip download` fills it (skipping the
# files it already has) and pip installs from it alone, so that a rebuild after a
# dependency change downloads only what is new, also from an index whose responses pip's
# HTTP cache does not keep. Its subdirectory is per torch index: 2.x+cu128 must not
# shadow PyPI's 2.x. PyTorch comes first (built for CUDA 12.8 by default); the
# dependencies then keep it (torch>=2.5 holds).
RUN --mount=type=bind,from=pip-cache,target=/root/.cache/pip,rw \
    --mount=type=bind,from=wheels,target=/run/wheels,rw \
    --mount=type=bind,from=find-links,target=/run/find-links \
    --mount=type=secret,id=pip-cert \
    --mount=type=secret,id=pip-env \
    if [ -f /run/secrets/pip-env ]; then . /run/secrets/pip-env; fi \
 && if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && wheels=/run/wheels/torch-$(printf %s "${TORCH_INDEX_URL:-pip}" | sha256sum | cut -c1-12) \
 && mkdir -p "$wheels" \
 && export PIP_FIND_LINKS="$wheels /run/find-links ${PIP_FIND_LINKS:-}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
 && pip() { /opt/venv/bin/python /tmp/pip/pip.whl/pip "$@"; } \
 && pip download --dest "$wheels" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch \
 && pip install --no-index torch
COPY --from=requirements /tmp/deps/requirements.txt /tmp/deps/
# The wheel directory (kept on the host between builds) keeps only the versions this
# environment holds: the rest (earlier versions, from builds before) would pile up.
RUN --mount=type=bind,from=pip-cache,target=/root/.cache/pip,rw \
    --mount=type=bind,from=wheels,target=/run/wheels,rw \
    --mount=type=bind,from=find-links,target=/run/find-links \
    --mount=type=secret,id=pip-cert \
    --mount=type=secret,id=pip-env \
    if [ -f /run/secrets/pip-env ]; then . /run/secrets/pip-env; fi \
 && if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && wheels=/run/wheels/torch-$(printf %s "${TORCH_INDEX_URL:-pip}" | sha256sum | cut -c1-12) \
 && export PIP_FIND_LINKS="$wheels /run/find-links ${PIP_FIND_LINKS:-}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
 && pip() { /opt/venv/bin/python /tmp/pip/pip.whl/pip "$@"; } \
 && pip download --dest "$wheels" -r /tmp/deps/requirements.txt \
 && pip install --no-index -r /tmp/deps/requirements.txt \
 && /opt/venv/bin/python -c 'import importlib.metadata as md, pathlib, re, sys; key = lambda name, version: (re.sub(r"[-_.]+", "_", name).lower(), version); have = {key(d.metadata["Name"], d.version) for d in md.distributions()}; old = [p for p in pathlib.Path(sys.argv[1]).glob("*.whl") if key(*p.name.split("-")[:2]) not in have]; [p.unlink() for p in old]; print(f"wheel directory: removed {len(old)} wheels of versions not installed")' "$wheels" \
 && rm -rf /tmp/deps /tmp/pip

# ---- build: kvserve itself, in /opt/kvserve (a small layer of the final image) -------
FROM runtime AS build
COPY --from=pip /opt/pip-wheel/pip.whl /tmp/pip/
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY operator/ operator/
# The install command of README.md ("Container images"), pip run by the environment's
# Python (so the scripts in /opt/kvserve/lib/bin start /opt/venv/bin/python);
# tests/test_dockerfiles.py checks that both say the same.
# `pip check`: the runtime stage has every dependency kvserve declares.
RUN --mount=type=bind,from=pip-cache,target=/root/.cache/pip,rw \
    --mount=type=bind,from=find-links,target=/run/find-links \
    --mount=type=secret,id=pip-cert \
    --mount=type=secret,id=pip-env \
    if [ -f /run/secrets/pip-env ]; then . /run/secrets/pip-env; fi \
 && if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && export PIP_FIND_LINKS="/run/find-links ${PIP_FIND_LINKS:-}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
 && pip() { /opt/venv/bin/python /tmp/pip/pip.whl/pip "$@"; } \
 && pip install --no-deps --target /opt/kvserve/lib . \
 && pip check \
 && rm -rf /tmp/pip
# The bundled demo model at a fixed path: an InferenceModel can serve it with
# source file:///opt/kvserve/demo-model (no download, no GPU needed).
RUN ln -s /opt/kvserve/lib/kvserve/demo_model/kvserve-travel-tiny /opt/kvserve/demo-model \
 && test -f /opt/kvserve/demo-model/config.json \
 && PATH=/opt/kvserve/lib/bin:/opt/venv/bin:$PATH kvserve --help >/dev/null

# ---- final: the runtime stage plus kvserve; nothing to build or install with --------
FROM runtime
ARG VERSION
LABEL org.opencontainers.image.title="kvserve" \
      org.opencontainers.image.description="kvserve LLM engine (kvserve serve) and gateway (kvserve gateway), CUDA 12.8" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvserve/kvserve" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kvserve /opt/kvserve
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/kvserve/lib/bin:/opt/venv/bin:$PATH \
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
