"""The container images of docker/, built and run with podman for the image tests.

Built on the debootstrap Debian base (``make container-tools``) with Debian's Python and
PyTorch from the pip index, through ``docker/build`` (the same script as ``make images``),
and cached between test runs: each image is tagged with a hash of its Dockerfile, the
build script, the base image, the build arguments and every file of the build context,
and is rebuilt only when that hash changes. After a build, the layers that only earlier
builds reach are removed (`remove_stale_layers`). The settings this machine needs (runc,
explicit ulimits, the host's network) are the ones docs/test-cluster.md lists.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.processes import LoggedProcess, start_logged

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/kvserve-debian-base:bookworm"
# crun fails on this machine's hybrid cgroups; runc works.
PODMAN = ["podman", "--runtime", "runc"]
# podman's default ulimits exceed the machine's hard limits ("setrlimit: Operation not
# permitted"), so every build and run sets them.
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
BUILD_FLAGS = ["--network", "host", *ULIMITS]
# A cold engine build installs PyTorch with its CUDA libraries (several GB).
BUILD_TIMEOUT = 3600.0
# Free disk a build needs: the engine's first (6.45 GB image, ~0.5 GB of build-only
# layers, 2.9 GB of wheels kept for the next: docs/test-cluster.md, "Time and disk"), or
# a rebuild over cached layers (a new layer of dependencies at most: 470 MB).
COLD_ENGINE_BUILD_GB = 11.0
REBUILD_GB = 1.0


class NotBuildable(Exception):
    """The image is not built and the disk has no room to build it: its tests skip."""


# What a pod of the chart or of the operator runs with (charts/kvserve/values.yaml
# securityContext; kvserve_operator/render.py): uid/gid 1000, a read-only root
# filesystem with an emptyDir at /tmp, every capability dropped, no privilege
# escalation, the runtime's default seccomp profile (podman's default).
POD_SECURITY = [
    "--user", "1000:1000",
    "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777",
    "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
]  # fmt: skip


@dataclass(frozen=True)
class ImageSpec:
    name: str  # engine | operator
    dockerfile: Path
    build_args: tuple[str, ...]

    @property
    def repository(self) -> str:
        return f"localhost/kvserve-test-{self.name}"


ENGINE = ImageSpec(
    "engine",
    REPO / "docker" / "kvserve.Dockerfile",
    # TORCH_INDEX_URL="": PyTorch from the pip index (PyPI), which this machine reaches.
    (f"BASE_IMAGE={BASE_IMAGE}", "TORCH_INDEX_URL="),
)
OPERATOR = ImageSpec(
    "operator", REPO / "docker" / "operator.Dockerfile", (f"BASE_IMAGE={BASE_IMAGE}",)
)


def podman(
    *args: str, timeout: float = 120.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
    return proc


def unavailable() -> str | None:
    """Why the image tests cannot run here, or None when podman runs containers."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return (
                f"container image tests need podman and runc ({tool} not found; as root, "
                f"`make container-tools` installs them and builds the base image)"
            )
    try:
        if podman("image", "exists", BASE_IMAGE, check=False).returncode != 0:
            return (
                f"container image tests need the base image {BASE_IMAGE} (`make container-tools`)"
            )
        probe = podman("run", "--rm", *ULIMITS, BASE_IMAGE, "true", check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"container image tests: podman does not work here ({exc})"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"container image tests: podman cannot run a container here ({last})"
    return None


def _context_files() -> Iterator[Path]:
    """The build context as .dockerignore leaves it (tests/test_dockerfiles.py checks
    that file): pyproject.toml, README.md, service/ and operator/, without caches."""
    yield REPO / "pyproject.toml"
    yield REPO / "README.md"
    for top in ("service", "operator"):
        for path in sorted((REPO / top).rglob("*")):
            rel = path.relative_to(REPO).parts
            if path.is_dir() or "__pycache__" in rel or path.suffix == ".pyc":
                continue
            if any(part.endswith(".egg-info") for part in rel):
                continue
            yield path


def image_hash(spec: ImageSpec) -> str:
    h = hashlib.sha256()
    base_id = podman("image", "inspect", "--format", "{{.Id}}", BASE_IMAGE).stdout.strip()
    for item in (base_id, *spec.build_args, *BUILD_FLAGS):
        h.update(item.encode() + b"\0")
    for path in (spec.dockerfile, REPO / "docker" / "build", *_context_files()):
        h.update(str(path.relative_to(REPO)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    root = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One build at a time on this machine (two test sessions share the image cache)."""
    with open(_cache_root() / "images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_built(spec: ImageSpec) -> str:
    """The image's reference, building it first when no image has its current hash;
    older test tags of the same image are removed after a build."""
    ref = f"{spec.repository}:{image_hash(spec)}"
    with _build_lock():
        if podman("image", "exists", ref, check=False).returncode == 0:
            return ref
        _check_room(spec)
        args = [str(REPO / "docker" / "build"), " ".join(PODMAN), str(spec.dockerfile), ref]
        for arg in spec.build_args:
            args += ["--build-arg", arg]
        proc = start_logged([*args, *BUILD_FLAGS], f"build-{spec.name}-image", cwd=REPO)
        try:
            status = proc.wait(timeout=BUILD_TIMEOUT)
        finally:
            proc.stop()
        if status != 0:
            raise AssertionError(f"building {ref} failed (exit {status})\n{proc.tail()}")
        listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", spec.repository)
        for old in set(listed.stdout.split()) - {ref}:
            # Untags; the layers stay while the build cache (intermediate images) uses them.
            podman("rmi", old, check=False)
        _layers_file(spec).write_text("\n".join(build_steps(proc.log.read_text())) + "\n")
        remove_stale_layers()
    return ref


def _check_room(spec: ImageSpec) -> None:
    earlier = podman("images", "--quiet", spec.repository).stdout.split()
    need = COLD_ENGINE_BUILD_GB if spec is ENGINE and not earlier else REBUILD_GB
    free = shutil.disk_usage(_cache_root()).free / 1e9
    if free < need:
        raise NotBuildable(
            f"building the {spec.name} image needs about {need:.1f} GB free, "
            f"{free:.1f} GB is free: its container image tests are skipped"
        )


def _layers_file(spec: ImageSpec) -> Path:
    return _cache_root() / f"image-{spec.name}.layers"


def build_steps(log: str) -> list[str]:
    """The image ID of each step of a build (made or taken from the cache), from the
    output of `podman build`: "--> Using cache <id>" and "--> <short id>" lines."""
    return re.findall(r"^--> (?:Using cache )?([0-9a-f]{11,64})$", log, re.MULTILINE)


def remove_stale_layers(base_image: str = BASE_IMAGE, keep: set[str] | None = None) -> list[str]:
    """Removes the dangling images built on BASE_IMAGE that the last build of neither
    image used: the stages that only earlier builds reach. Returns their IDs.

    Each build after a code change leaves its predecessors' last stages behind, untagged
    and without children (~140 MB a rebuild of both images, measured 2026-12-06; a
    dependency change leaves the 470 MB layer of dependencies too), which nothing reads
    again and which filled the disk of machines that keep podman's store between runs.
    The last stages of the current builds are untagged as well (the `pip` and `build`
    stages, copied from), so each build's steps are kept in ``image-<name>.layers`` in
    the cache and spared (``keep``: image IDs or their prefixes, by default those);
    until both images' steps are kept, nothing is removed. Images not built on
    ``base_image`` are never touched.
    """
    protected = keep if keep is not None else _recorded_steps()
    if protected is None:
        return []
    base = podman("image", "inspect", "--format", "{{.Id}}", base_image).stdout.strip()
    removed: list[str] = []
    while True:  # removing a stage's last image can leave its parent dangling
        parents, dangling = _image_graph()
        stale = [
            image
            for image in dangling
            if _descends_from(image, base, parents)
            and not any(image.startswith(step) for step in protected)
        ]
        if not stale or set(stale) & set(removed):  # nothing left, or rmi did not remove
            return removed
        proc = podman("rmi", *stale, check=False)
        removed += stale
        if proc.returncode != 0:  # one is in use by a container, say: leave the rest
            return removed


def _recorded_steps() -> set[str] | None:
    """The steps of each image's last build, or None while one has not been recorded."""
    steps: set[str] = set()
    for spec in (ENGINE, OPERATOR):
        if not _layers_file(spec).exists():
            return None
        steps.update(_layers_file(spec).read_text().split())
    return steps


def _image_graph() -> tuple[dict[str, str], list[str]]:
    """Each image's parent ("" for none), and the dangling images (untagged, no child)."""
    listed = podman(
        "images", "--all", "--no-trunc", "--format", "{{.ID}} {{.ParentId}} {{.Dangling}}"
    )
    parents: dict[str, str] = {}
    dangling = []
    for line in listed.stdout.splitlines():
        image, parent, flag = line.split(" ")  # an image without a parent: "ID  false"
        image = image.removeprefix("sha256:")
        parents[image] = parent.removeprefix("sha256:")
        if flag == "true":
            dangling.append(image)
    return parents, dangling


def _descends_from(image: str, ancestor: str, parents: dict[str, str]) -> bool:
    seen: set[str] = set()
    while image and image not in seen:
        if image == ancestor:
            return True
        seen.add(image)
        image = parents.get(image, "")
    return False


def inspect(ref: str) -> dict[str, Any]:
    (info,) = json.loads(podman("image", "inspect", ref).stdout)
    return info  # type: ignore[no-any-return]


@dataclass
class Container:
    """A container started with ``podman run --rm`` (its output in ``proc.log``)."""

    name: str
    proc: LoggedProcess

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"container {self.name} exited with {self.proc.poll()}\n{self.proc.tail()}"
            )
        return True

    def signal(self, sig: str) -> None:
        podman("kill", "--signal", sig, self.name)

    def remove(self) -> None:
        """Kill and remove it if it still exists (``--rm`` removes it when it exits)."""
        podman("rm", "--force", "--time", "0", "--ignore", self.name, check=False)
        self.proc.stop()


def start(ref: str, args: Sequence[str], *, name: str, options: Sequence[str] = ()) -> Container:
    """``podman run --rm`` of ``ref`` on the host's network (so 127.0.0.1 is the host's)."""
    cname = f"kvserve-test-{name}-{uuid.uuid4().hex[:8]}"
    proc = start_logged(run_command(cname, ref, args, options), f"container-{name}")
    return Container(cname, proc)


def run_command(cname: str, ref: str, args: Sequence[str], options: Sequence[str]) -> list[str]:
    """``podman run --rm`` of ``ref`` named ``cname``, on the host's network."""
    return [
        *PODMAN,
        "run",
        "--rm",
        "--name",
        cname,
        "--network",
        "host",
        *ULIMITS,
        *options,
        ref,
        *args,
    ]


@contextlib.contextmanager
def running(
    ref: str, args: Sequence[str], *, name: str, options: Sequence[str] = ()
) -> Iterator[Container]:
    container = start(ref, args, name=name, options=options)
    try:
        yield container
    finally:
        container.remove()


def run(
    ref: str, args: Sequence[str], *, options: Sequence[str] = (), timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Runs a container to completion (removed after); returns its exit status and output."""
    cname = f"kvserve-test-run-{uuid.uuid4().hex[:8]}"
    try:
        return subprocess.run(
            run_command(cname, ref, args, options),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        podman("rm", "--force", "--time", "0", "--ignore", cname, check=False)


@contextlib.contextmanager
def volume() -> Iterator[str]:
    """An empty named volume, removed afterwards."""
    name = f"kvserve-test-{uuid.uuid4().hex[:8]}"
    podman("volume", "create", name)
    try:
        yield name
    finally:
        podman("volume", "rm", "--force", name, check=False)
