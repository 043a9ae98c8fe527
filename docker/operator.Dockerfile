# syntax=docker/dockerfile:1
# The kvserve operator image (kvserve-operator): slim Python, no PyTorch. From the
# repository root:
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvserve/kvserve-operator:0.1.0 .
#
# (or `make images`; README.md, "Container images"). The Helm chart uses
# ghcr.io/kvserve/kvserve-operator:<version> by default; its `helm test` job runs it too.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG VERSION=0.1.0

# ---- build: a virtual environment with the project and the operator's dependencies --
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY operator/ operator/
# The project without its dependencies (they include torch and transformers, which the
# operator never imports), then exactly the third-party packages kvserve_operator
# imports, with the project's version bounds. tests/test_dockerfiles.py keeps this list
# equal to what `import kvserve_operator.handlers` loads.
RUN pip install --no-deps . \
 && pip install "kopf>=1.45" "kubernetes>=37" "prometheus-client>=0.20" "urllib3>=1.26"
# The demo model's weights are for the engine image only; no installer in the final image.
RUN rm -rf /opt/venv/lib/python*/site-packages/kvserve/demo_model/kvserve-travel-tiny \
 && pip uninstall --yes pip

# ---- final ----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG VERSION
LABEL org.opencontainers.image.title="kvserve-operator" \
      org.opencontainers.image.description="kvserve operator: reconciles InferenceModel resources (kvserve.dev/v1alpha1)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvserve/kvserve" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 1000 kvserve \
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
