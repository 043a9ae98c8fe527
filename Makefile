# kvserve — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest bench clean cluster-bins prometheus-tools

# Create .venv and install kvserve with its test extras (all from PyPI, by name).
# PyPI's Linux torch wheel brings its CUDA libraries (the virtualenv is ~6.3 GB):
# scripts/install_venv.py installs with uv, whose cache makes a second virtualenv on this
# machine take under a minute (mostly compiling bytecode) and almost no disk, and stops
# before installing when the disk is short (MIN_FREE_GB=0 tries anyway).
MIN_FREE_GB ?=
$(STAMP): pyproject.toml scripts/install_venv.py
	$(PYTHON) scripts/install_venv.py $(VENV) $(if $(MIN_FREE_GB),--min-free-gb $(MIN_FREE_GB)) -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# Serves the bundled demo model on http://127.0.0.1:8000 (Ctrl-C stops it), with its demo
# LoRA adapter as a second model, "travel-table" (README.md, "LoRA adapters").
DEMO_ADAPTER := travel-table=$(CURDIR)/service/kvserve/demo_model/adapters/travel-table
run: install
	$(BIN)/kvserve serve --enable-lora --lora-modules $(DEMO_ADAPTER)

lint: install
	$(BIN)/ruff check service operator tests loadtests scripts
	$(BIN)/ruff format --check service operator tests loadtests scripts

# mypy's cache outside the clone, shared by every clone on this machine (a cold run here
# takes about 70 s, a warm one 2 s): mypy checks each cached file's hash, so a cache
# written by another clone or commit is reused only where the sources are the same.
MYPY_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvserve/mypy
typecheck: install
	$(BIN)/mypy --cache-dir $(MYPY_CACHE_DIR)

# With Go on PATH, build (once; cached in ~/.cache/kvserve/k8s) the Kubernetes control
# plane the cluster tests use, GIE's endpoint picker and a Prometheus with Kubernetes
# service discovery, with progress shown; without Go those tests skip.
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

pytest: install cluster-bins prometheus-tools container-tools
	$(BIN)/python -m pytest

# The whole suite: lint, types, tests.
test: lint typecheck pytest

bench: install
	$(BIN)/kvserve bench suite --out bench-results

# Container images (docker/; README.md "Container images"): docker or podman, built
# through docker/build, which passes this machine's pip settings, CA file and pip cache
# at build time only. With podman the defaults below are what podman needs on the test
# machines (runc: crun fails on hybrid cgroups; explicit ulimits: podman's defaults
# exceed the hard limits; the host's network for apt and pip); docker gets none of them.
# IMAGE_BASE=debian builds on the debootstrap base of `make container-tools` with
# Debian's Python and PyTorch from the pip index, where NVIDIA's CUDA image cannot be
# pulled (the default base stays the CUDA one).
# docker when its daemon answers, else podman (a docker client without a daemon, as on
# the test machines, does not count).
ifeq ($(origin CONTAINER_ENGINE),undefined)
CONTAINER_ENGINE := $(shell if docker info >/dev/null 2>&1; then command -v docker; \
  else command -v podman 2>/dev/null || command -v docker 2>/dev/null; fi)
endif
REGISTRY         ?= ghcr.io/kvserve
VERSION          ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IS_PODMAN        := $(findstring podman,$(notdir $(firstword $(CONTAINER_ENGINE))))
PODMAN_RUNTIME   ?= $(if $(shell command -v runc 2>/dev/null),--runtime runc)
CONTAINER_FLAGS  ?= $(if $(IS_PODMAN),$(PODMAN_RUNTIME))
CONTAINER_BUILD_FLAGS ?= $(if $(IS_PODMAN),--network host --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
DEBIAN_BASE_IMAGE ?= localhost/kvserve-debian-base:bookworm
DEBIAN_SUITE     ?= bookworm
IMAGE_BASE       ?=
KVSERVE_BUILD_ARGS  ?= $(if $(filter debian,$(IMAGE_BASE)),--build-arg BASE_IMAGE=$(DEBIAN_BASE_IMAGE) --build-arg TORCH_INDEX_URL=)
OPERATOR_BUILD_ARGS ?= $(if $(filter debian,$(IMAGE_BASE)),--build-arg BASE_IMAGE=$(DEBIAN_BASE_IMAGE))

.PHONY: images push-images container-tools

images: $(if $(filter debian,$(IMAGE_BASE)),container-tools)
	@test -n "$(CONTAINER_ENGINE)" || { echo "make images: needs docker or podman on PATH" >&2; exit 1; }
	docker/build "$(CONTAINER_ENGINE) $(CONTAINER_FLAGS)" docker/kvserve.Dockerfile $(REGISTRY)/kvserve:$(VERSION) \
	  --build-arg VERSION=$(VERSION) $(KVSERVE_BUILD_ARGS) $(CONTAINER_BUILD_FLAGS)
	docker/build "$(CONTAINER_ENGINE) $(CONTAINER_FLAGS)" docker/operator.Dockerfile $(REGISTRY)/kvserve-operator:$(VERSION) \
	  --build-arg VERSION=$(VERSION) $(OPERATOR_BUILD_ARGS) $(CONTAINER_BUILD_FLAGS)
	$(CONTAINER_ENGINE) $(CONTAINER_FLAGS) image inspect --format '{{.Size}} bytes' $(REGISTRY)/kvserve:$(VERSION)

push-images: images
	$(CONTAINER_ENGINE) $(CONTAINER_FLAGS) push $(REGISTRY)/kvserve:$(VERSION)
	$(CONTAINER_ENGINE) $(CONTAINER_FLAGS) push $(REGISTRY)/kvserve-operator:$(VERSION)

# podman, runc, debootstrap, uidmap and fuse-overlayfs (Debian packages; installed with
# apt-get as root), then, once, the Debian base image the image tests build on (a
# debootstrap minbase, ~40 s, ~200 MB: container registries may be unreachable, the
# Debian mirror is not). Without them (and without root) the image tests skip.
container-tools:
	@command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    pkgs="podman runc debootstrap uidmap fuse-overlayfs"; \
	    apt-get install -y --no-install-recommends $$pkgs >/dev/null \
	    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends $$pkgs >/dev/null; } \
	    || echo "could not install $$pkgs: container image tests will skip"; \
	  else echo "podman not found (Debian: apt-get install podman runc debootstrap uidmap fuse-overlayfs): container image tests will skip"; fi; }
	@if command -v podman >/dev/null 2>&1 && ! podman image exists $(DEBIAN_BASE_IMAGE); then \
	  if [ "$$(id -u)" = 0 ] && command -v debootstrap >/dev/null 2>&1; then \
	    rootfs=$$(mktemp -d) && trap 'rm -rf "$$rootfs"' EXIT && \
	    echo "building the base image $(DEBIAN_BASE_IMAGE) with debootstrap (~40 s)" && \
	    if debootstrap --variant=minbase $(DEBIAN_SUITE) "$$rootfs" >"$$rootfs.log" 2>&1; then \
	      tar -C "$$rootfs" -c . | podman import - $(DEBIAN_BASE_IMAGE) >/dev/null; \
	    else tail -20 "$$rootfs.log"; echo "debootstrap failed: container image tests will skip"; fi; \
	    rm -f "$$rootfs.log"; \
	  else echo "no base image $(DEBIAN_BASE_IMAGE) (debootstrap needs root): container image tests will skip"; fi; fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
