# kvserve — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench clean cluster-bins prometheus-tools

# Create .venv and install kvserve with its test extras (all from PyPI, by name).
# PyPI's Linux torch wheel brings its CUDA libraries: the virtualenv is ~6.5 GB, and pip
# needs ~3.5 GB more for the downloads while it installs, so check before downloading.
MIN_FREE_GB ?= 10
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import shutil, sys; free, need = shutil.disk_usage(".").free / 1e9, float(sys.argv[1]); \
	  free >= need or sys.exit(f"make: {free:.1f} GB free here, the install needs about {need:.0f} GB " \
	    "(PyTorch with its CUDA libraries); free some space, or MIN_FREE_GB=0 to try anyway")' \
	  $(if $(wildcard $(BIN)/python),1,$(MIN_FREE_GB))
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# Serves the bundled demo model on http://127.0.0.1:8000 (Ctrl-C stops it), with its demo
# LoRA adapter as a second model, "travel-table" (README.md, "LoRA adapters").
DEMO_ADAPTER := travel-table=$(CURDIR)/service/kvserve/demo_model/adapters/travel-table
run: install
	$(BIN)/kvserve serve --enable-lora --lora-modules $(DEMO_ADAPTER)

lint: install
	$(BIN)/ruff check service operator tests loadtests
	$(BIN)/ruff format --check service operator tests loadtests

typecheck: install
	$(BIN)/mypy

# With Go on PATH, build (once; cached in ~/.cache/kvserve/k8s) the Kubernetes control
# plane the cluster tests use, with progress shown; without Go those tests skip.
cluster-bins:
	@if command -v go >/dev/null 2>&1; then python3 tests/cluster/build.py >/dev/null; \
	else echo "go not found: the Kubernetes cluster tests will be skipped"; fi

# Prometheus and promtool (Debian package `prometheus`) for the alert-rule and dashboard
# tests; without them (and without root to install them) those tests skip.
prometheus-tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y --no-install-recommends prometheus >/dev/null \
	    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends prometheus >/dev/null; }; \
	  else echo "promtool not found (Debian: apt-get install prometheus): Prometheus tests will skip"; fi; }

pytest: install cluster-bins prometheus-tools
	$(BIN)/python -m pytest

# The whole suite: lint, types, tests.
test: lint typecheck pytest

bench: install
	$(BIN)/kvserve bench suite --out bench-results

# Container images (docker/; README.md "Container images"): docker or podman.
CONTAINER_ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)
REGISTRY         ?= ghcr.io/kvserve
VERSION          ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: images push-images

images:
	@test -n "$(CONTAINER_ENGINE)" || { echo "make images: needs docker or podman on PATH" >&2; exit 1; }
	$(CONTAINER_ENGINE) build -f docker/kvserve.Dockerfile --build-arg VERSION=$(VERSION) -t $(REGISTRY)/kvserve:$(VERSION) .
	$(CONTAINER_ENGINE) build -f docker/operator.Dockerfile --build-arg VERSION=$(VERSION) -t $(REGISTRY)/kvserve-operator:$(VERSION) .

push-images: images
	$(CONTAINER_ENGINE) push $(REGISTRY)/kvserve:$(VERSION)
	$(CONTAINER_ENGINE) push $(REGISTRY)/kvserve-operator:$(VERSION)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
