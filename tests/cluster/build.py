"""Build (once) and cache the Kubernetes binaries of the test control plane.

Everything comes from the Go module proxy, at the versions pinned below, and lands in
``$KVSERVE_CACHE/k8s/<component>-<version>/bin`` (default ``~/.cache/kvserve``), outside
the clone, so CI runs and later sessions reuse it. Warm: nothing is built. Cold: the
four Kubernetes binaries take 15–30 minutes on 2 cores, GIE's endpoint picker a few more;
progress is printed. A build uses Go module and build caches of its own, removed when it
ends: only the binaries (~0.9 GB) stay, where Go's default caches kept another 9 GB.
Each directory appears whole, by an atomic rename, so two runs at once (a `make test`
and a manual run) may both build it and the first one's is kept.

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.21.4"
# The Gateway API Inference Extension's endpoint picker (EPP), unmodified, for
# tests/cluster/test_endpoint_picker.py; its InferencePool CRD is vendored in crds/.
GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION = "v1.3.0"
# Prometheus 2.54.1 (its Go module is tagged v0.54.1), for the test that scrapes pods
# through Kubernetes service discovery: Debian's prometheus package is built without it.
PROMETHEUS_VERSION = "v0.54.1"

# The "fast" stages: nodes Ready at once, pods Ready without simulated start-up delays.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve")) / "k8s"


@dataclass(frozen=True)
class Binaries:
    """Where each binary of the plane lives (after `ensure_built`)."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    kwok_stages: Path  # directory of kwok Stage YAML files
    helm: Path
    epp: Path  # GIE's endpoint picker
    prometheus: Path  # with Kubernetes service discovery (not on the plane's PATH)

    @property
    def bin_dirs(self) -> list[Path]:
        return sorted({p.parent for p in (self.etcd, self.kubectl, self.kwok, self.helm, self.epp)})


def binaries() -> Binaries:
    root = cache_root()
    kube = root / f"kubernetes-{KUBERNETES_VERSION}" / "bin"
    kwok = root / f"kwok-{KWOK_VERSION}"
    return Binaries(
        etcd=root / f"etcd-{ETCD_VERSION}" / "bin" / "etcd",
        kube_apiserver=kube / "kube-apiserver",
        kube_controller_manager=kube / "kube-controller-manager",
        kube_scheduler=kube / "kube-scheduler",
        kubectl=kube / "kubectl",
        kwok=kwok / "bin" / "kwok",
        kwok_stages=kwok / "stages",
        helm=root / f"helm-{HELM_VERSION}" / "bin" / "helm",
        epp=root / f"gie-epp-{GIE_VERSION}" / "bin" / "epp",
        prometheus=root / f"prometheus-{PROMETHEUS_VERSION}" / "bin" / "prometheus",
    )


# Free disk that a build needs at its peak: all the binaries, Kubernetes's among them
# (13.8 GB measured on 2026-12-06: Go's caches for one run, then the binaries), or the
# smaller ones alone (helm: 1.1 GB).
COLD_BUILD_GB = 15.0
PARTIAL_BUILD_GB = 4.0


class NotBuildable(RuntimeError):
    """The binaries are missing and cannot be built here: no Go, or too little disk.
    The cluster tests skip with this reason instead of failing."""


def go_available() -> bool:
    return shutil.which("go") is not None


def _check_buildable(bins: Binaries, root: Path) -> None:
    if not go_available():
        raise NotBuildable(
            "Kubernetes cluster tests need Go >= 1.26 on PATH (binaries are built from the "
            f"Go module proxy on first use, cached in {root})"
        )
    need = PARTIAL_BUILD_GB if bins.kubectl.parent.is_dir() else COLD_BUILD_GB
    probe = root if root.exists() else Path.home()
    free = shutil.disk_usage(probe).free / 1e9
    if free < need:
        raise NotBuildable(
            f"building the test control plane's binaries needs about {need:.0f} GB free "
            f"(Go's caches at the peak), {free:.1f} GB is free at {probe}: the Kubernetes "
            "cluster tests are skipped"
        )


# The folder of Go caches of the build in progress (`_private_go_caches`), if any.
_go_caches: Path | None = None


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-buildvcs=false")
    if _go_caches is not None:
        env.update(GOCACHE=str(_go_caches / "build"), GOMODCACHE=str(_go_caches / "mod"))
    return env


@contextlib.contextmanager
def _private_go_caches(work: Path) -> Iterator[None]:
    """Go's module and build caches in a folder of this build's, removed when it ends.

    A cold build fills Go's default caches with about 9 GB (measured 2026-12-06: 6.2 GB
    build cache, 3.0 GB modules) that nothing here reads again, since the binaries are
    cached themselves; on a machine that keeps its home folder between CI runs they
    would stay for good. Go's caches are safe for concurrent use, but each build gets
    its own folder so that removing it never pulls one from under another build.
    """
    global _go_caches
    work.mkdir(parents=True, exist_ok=True)
    caches = _go_caches = Path(tempfile.mkdtemp(prefix="go-caches.", dir=work))
    try:
        yield
    finally:
        _go_caches = None
        # The module cache is read-only; its folders must be writable to empty them.
        for folder, _, _ in os.walk(caches):
            os.chmod(folder, 0o755)
        shutil.rmtree(caches, ignore_errors=True)


def _log(message: str) -> None:
    print(f"[cluster build] {message}", file=sys.stderr, flush=True)


def _run(args: list[str], cwd: Path, what: str) -> str:
    """Run a go command, printing a heartbeat so a long cold build shows it is alive."""
    started = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(60):
            _log(f"  … {what}: {time.monotonic() - started:.0f} s")

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        proc = subprocess.run(args, cwd=cwd, env=_go_env(), capture_output=True, text=True)
    finally:
        done.set()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(args)}):\n{proc.stdout}{proc.stderr}")
    _log(f"  {what}: done in {time.monotonic() - started:.0f} s")
    return proc.stdout


def _staging_replaces(workdir: Path) -> list[str]:
    """`replace` lines that point k8s.io/kubernetes's staging modules at their releases."""
    out = _run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
        workdir,
        "download k8s.io/kubernetes go.mod",
    )
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.MULTILINE)
    if not staging:
        raise RuntimeError("found no staging modules in k8s.io/kubernetes's go.mod")
    release = "v0." + KUBERNETES_VERSION.removeprefix("v1.")
    return [f"replace {name} => {name} {release}" for name in sorted(set(staging))]


def _build_kubernetes(out: Path, workdir: Path) -> None:
    (workdir / "go.mod").write_text("module kvserve.dev/clusterbuild/kubernetes\n\ngo 1.26.0\n")
    replaces = _staging_replaces(workdir)
    (workdir / "go.mod").write_text(
        "module kvserve.dev/clusterbuild/kubernetes\n\ngo 1.26.0\n\n" + "\n".join(replaces) + "\n"
    )
    packages = [f"k8s.io/kubernetes/cmd/{cmd}" for cmd in KUBERNETES_COMMANDS]
    _run(
        ["go", "get", *(f"{p}@{KUBERNETES_VERSION}" for p in packages)],
        workdir,
        f"resolve k8s.io/kubernetes {KUBERNETES_VERSION} ({len(replaces)} staging modules)",
    )
    minor = KUBERNETES_VERSION.split(".")[1]
    ldflags = " ".join(
        f"-X k8s.io/component-base/version.{key}={value}"
        for key, value in (
            ("gitVersion", KUBERNETES_VERSION),
            ("gitMajor", "1"),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
        )
    )
    for cmd, package in zip(KUBERNETES_COMMANDS, packages, strict=True):
        _go_build(
            package,
            out / cmd,
            workdir,
            f"build {cmd} (cold: several minutes each on 2 cores)",
            ldflags,
        )


def _build_etcd(out: Path, workdir: Path) -> None:
    (workdir / "go.mod").write_text("module kvserve.dev/clusterbuild/etcd\n\ngo 1.26.0\n")
    _run(
        ["go", "get", f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}"],
        workdir,
        f"resolve etcd {ETCD_VERSION}",
    )
    _go_build("go.etcd.io/etcd/server/v3", out / "etcd", workdir, "build etcd")


def _go_args(verb: str, ldflags: str) -> list[str]:
    args = ["go", verb, "-p", "2", "-trimpath"]
    return [*args, "-ldflags", ldflags] if ldflags else args


def _go_build(package: str, binary: Path, workdir: Path, what: str, ldflags: str = "") -> None:
    _run([*_go_args("build", ldflags), "-o", str(binary), package], workdir, what)


def _go_install(package: str, what: str, ldflags: str = "") -> Callable[[Path, Path], None]:
    """A build for `_build_into`: `go install package@version`, its binary into ``out``."""

    def build(out: Path, workdir: Path) -> None:
        _run(["env", f"GOBIN={out}", *_go_args("install", ldflags), package], workdir, what)

    return build


def _build_into(out: Path, work: Path, build: Callable[[Path, Path], None]) -> None:
    """Fill ``out`` with ``build(staging, workdir)``: it builds into a fresh staging
    directory next to ``out``, from a fresh work directory under ``work``, and the staging
    directory is then renamed to ``out``.

    Two processes may build at once (a `make test` and a manual run, two CI jobs on one
    cache): with their own directories neither rewrites the other's go.mod nor renames
    onto a directory the other has filled (which failed with "Directory not empty").
    The rename is atomic, so ``out`` is absent or complete, never half-built; when
    another process's rename came first, its copy is as good as ours and ours is dropped.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{out.name}.", suffix=".tmp", dir=out.parent))
    workdir = Path(tempfile.mkdtemp(prefix=f"{out.name}.", dir=work))
    try:
        build(staging, workdir)
        staging.chmod(0o755)  # mkdtemp's 0700, as a plain mkdir would have made it
        try:
            staging.rename(out)
        except OSError:
            if not out.is_dir():
                raise
            _log(f"  {out.name}: another process built it first; using that one")
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed
        shutil.rmtree(workdir, ignore_errors=True)


def _build_epp(out: Path, workdir: Path) -> None:
    """GIE's cmd/epp through a wrapper module, not `go install pkg@version`.

    `go install …@v1.3.0` first reads the module's version list (`@v/list`) for
    deprecations, and the proxy reachable here answers that list with 403 for this module
    ("loading deprecation … 403 Forbidden"); `go get` of an explicit version in a module
    of our own does not read it. The wrapper requires only GIE, so its dependencies
    resolve to the versions GIE's own go.mod selects.
    """
    (workdir / "go.mod").write_text("module kvserve.dev/clusterbuild/epp\n\ngo 1.26.0\n")
    package = f"{GIE_MODULE}/cmd/epp"
    _run(["go", "get", f"{package}@{GIE_VERSION}"], workdir, f"resolve GIE {GIE_VERSION}")
    # What GIE's Dockerfile stamps; the EPP logs it at start-up.
    ldflags = f"-X {GIE_MODULE}/version.BuildRef={GIE_VERSION}"
    _go_build(package, out / "epp", workdir, "build epp (cold: a few minutes on 2 cores)", ldflags)


def _build_prometheus(out: Path, workdir: Path) -> None:
    """Prometheus's cmd/prometheus through a wrapper module: `go install …@version`
    refuses a module whose go.mod has `replace` directives, so the wrapper copies
    Prometheus's two (its klog shims), which its main package needs to build."""
    (workdir / "go.mod").write_text(
        "module kvserve.dev/clusterbuild/prometheus\n\ngo 1.26.0\n\n"
        "replace (\n"
        "\tk8s.io/klog => github.com/simonpasquier/klog-gokit v0.3.0\n"
        "\tk8s.io/klog/v2 => github.com/simonpasquier/klog-gokit/v3 v3.3.0\n"
        ")\n"
    )
    package = "github.com/prometheus/prometheus/cmd/prometheus"
    _run(["go", "get", f"{package}@{PROMETHEUS_VERSION}"], workdir, "resolve Prometheus")
    version = "2." + PROMETHEUS_VERSION.removeprefix("v0.")
    ldflags = f"-X github.com/prometheus/common/version.Version={version}"
    what = "build prometheus (cold: several minutes on 2 cores)"
    _go_build(package, out / "prometheus", workdir, what, ldflags)


def _copy_kwok_stages(dest: Path, workdir: Path) -> None:
    out = _run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK_VERSION}"],
        workdir,
        "download kwok module",
    )
    source = Path(json.loads(out)["Dir"]) / "kustomize" / "stage"
    for relative in KWOK_STAGES:
        path = source / relative
        if not path.is_file():
            raise RuntimeError(f"kwok stage {relative} not found under {source}")
        shutil.copyfile(path, dest / path.name)


def ensure_built() -> Binaries:
    """Build whatever is missing from the cache; return the binaries' paths.
    NotBuildable when something is missing that cannot be built here."""
    bins = binaries()
    root = cache_root()
    work = root / "build"
    if all(folder.is_dir() for folder, _, _ in _builds(bins)):
        return bins
    _check_buildable(bins, root)
    started = time.monotonic()
    with _private_go_caches(work):
        _build_missing(bins, work)
    if time.monotonic() - started > 1:
        _log(f"all binaries ready in {time.monotonic() - started:.0f} s under {root}")
    return bins


def _builds(bins: Binaries) -> list[tuple[Path, str, Callable[[Path, Path], None]]]:
    """Each cached folder, what its build logs, and its build (for `_build_into`): every
    folder is built whole, and only when absent."""
    minor = KUBERNETES_VERSION.split(".")[1]
    helm_ldflags = (  # without these, `helm version` says v3.21, `helm template` k8s 1.20
        f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION} "
        f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}"
    )
    return [
        (bins.kubectl.parent,
         f"building Kubernetes {KUBERNETES_VERSION} from the Go module proxy (cold: 15–30 min)",
         _build_kubernetes),
        (bins.etcd.parent, f"building etcd {ETCD_VERSION}", _build_etcd),
        (bins.kwok.parent, f"building kwok {KWOK_VERSION}",
         _go_install(f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}", "build kwok")),
        (bins.kwok_stages, "copying kwok's stages", _copy_kwok_stages),
        (bins.helm.parent, f"building helm {HELM_VERSION}",
         _go_install(f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}", "build helm", helm_ldflags)),
        (bins.epp.parent, f"building GIE's endpoint picker {GIE_VERSION}", _build_epp),
        (bins.prometheus.parent,
         f"building Prometheus {PROMETHEUS_VERSION} (with Kubernetes service discovery)",
         _build_prometheus),
    ]  # fmt: skip


def _build_missing(bins: Binaries, work: Path) -> None:
    for folder, message, build in _builds(bins):
        if not folder.is_dir():
            _log(message)
            _build_into(folder, work, build)


if __name__ == "__main__":
    try:
        built = ensure_built()
    except NotBuildable as reason:
        _log(str(reason))
        sys.exit(0)  # the tests skip, saying why
    except RuntimeError as error:
        sys.exit(f"error: {error}")
    for path in built.bin_dirs:
        print(path)
