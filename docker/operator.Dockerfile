# syntax=docker/dockerfile:1
# The kvserve operator image (kvserve-operator): slim Python, no PyTorch. From the
# repository root:
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvserve/kvserve-operator:0.1.0 .
#
# (or `make images`, which builds through docker/build; README.md, "Container images").
# The Helm chart uses ghcr.io/kvserve/kvserve-operator:<version> by default; its `helm
# test` job runs it too.
#
# BASE_IMAGE may also be a plain Debian or Ubuntu image without Python (the tests use a
# debootstrap Debian base): Python then comes from its apt repository. As in
# kvserve.Dockerfile, the building machine's pip settings, CA file and pip cache reach
# the build stage only (the secrets "pip-env" and "pip-cert", the build contexts
# "pip-cache" and "find-links"; docker/build passes them).

ARG BASE_IMAGE=python:3.12-slim-bookworm
ARG VERSION=0.1.0

# Empty unless docker/build (or --build-context NAME=DIR) supplies them.
FROM scratch AS pip-cache
FROM scratch AS find-links

# ---- build: a virtual environment with the project and the operator's dependencies --
FROM ${BASE_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
     && apt-get install -y --no-install-recommends python3 python3-venv \
     && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/venv
# Exactly the third-party packages kvserve_operator imports, with the project's version
# bounds, before the code is copied in (a code change reinstalls only the project).
# tests/test_dockerfiles.py keeps this list equal to what `import
# kvserve_operator.handlers` loads.
RUN --mount=type=bind,from=pip-cache,target=/root/.cache/pip,rw \
    --mount=type=bind,from=find-links,target=/run/find-links \
    --mount=type=secret,id=pip-cert \
    --mount=type=secret,id=pip-env \
    if [ -f /run/secrets/pip-env ]; then . /run/secrets/pip-env; fi \
 && if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && export PIP_FIND_LINKS="/run/find-links ${PIP_FIND_LINKS:-}" \
 && pip install --upgrade pip \
 && pip install "kopf>=1.45" "kubernetes>=37" "prometheus-client>=0.20" "urllib3>=1.26"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY operator/ operator/
# The project without its dependencies (they include torch and transformers, which the
# operator never imports).
RUN --mount=type=bind,from=pip-cache,target=/root/.cache/pip,rw \
    --mount=type=bind,from=find-links,target=/run/find-links \
    --mount=type=secret,id=pip-cert \
    --mount=type=secret,id=pip-env \
    if [ -f /run/secrets/pip-env ]; then . /run/secrets/pip-env; fi \
 && if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && export PIP_FIND_LINKS="/run/find-links ${PIP_FIND_LINKS:-}" \
 && pip install --no-deps .
# The demo model's weights are for the engine image only; no installer in the final image.
RUN rm -rf /opt/venv/lib/python*/site-packages/kvserve/demo_model/kvserve-travel-tiny \
 && pip uninstall --yes pip

# ---- final ----------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG VERSION
LABEL org.opencontainers.image.title="kvserve-operator" \
      org.opencontainers.image.description="kvserve operator: reconciles InferenceModel resources (kvserve.dev/v1alpha1)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvserve/kvserve" \
      org.opencontainers.image.licenses="Apache-2.0"
# Python itself when the base has none (a plain Debian base); python:*-slim has it.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
     && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
     && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 1000 kvserve \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvserve
COPY --from=build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 1000:1000
WORKDIR /tmp
# /healthz 8080, /metrics 8081 (the chart's --health-port and --metrics-port).
EXPOSE 8080 8081
ENTRYPOINT ["kvserve-operator"]
