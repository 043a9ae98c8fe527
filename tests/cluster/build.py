"""Build (once) and cache the Kubernetes binaries of the test control plane.

Everything comes from the Go module proxy, at the versions pinned below, and lands in
``$KVSERVE_CACHE/k8s/<component>-<version>/bin`` (default ``~/.cache/kvserve``), outside
the clone, so CI runs and later sessions reuse it. Warm: nothing is built. Cold: the
four Kubernetes binaries take 15–30 minutes on 2 cores, GIE's endpoint picker a few more;
progress is printed.

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
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
    )


def go_available() -> bool:
    return shutil.which("go") is not None


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-buildvcs=false")
    return env


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
    workdir.mkdir(parents=True, exist_ok=True)
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
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for cmd, package in zip(KUBERNETES_COMMANDS, packages, strict=True):
        _run(
            [
                "go",
                "build",
                "-p",
                "2",
                "-trimpath",
                "-ldflags",
                ldflags,
                "-o",
                str(tmp / cmd),
                package,
            ],
            workdir,
            f"build {cmd} (cold: several minutes each on 2 cores)",
        )
    tmp.rename(out)


def _build_etcd(out: Path, workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "go.mod").write_text("module kvserve.dev/clusterbuild/etcd\n\ngo 1.26.0\n")
    _run(
        ["go", "get", f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}"],
        workdir,
        f"resolve etcd {ETCD_VERSION}",
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    _run(
        [
            "go",
            "build",
            "-p",
            "2",
            "-trimpath",
            "-o",
            str(tmp / "etcd"),
            "go.etcd.io/etcd/server/v3",
        ],
        workdir,
        "build etcd",
    )
    tmp.rename(out)


def _go_install(package: str, out: Path, workdir: Path, what: str, ldflags: str = "") -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    args = ["go", "install", "-p", "2", "-trimpath"]
    if ldflags:
        args += ["-ldflags", ldflags]
    env_gobin = ["env", f"GOBIN={tmp}"]
    _run([*env_gobin, *args, package], workdir, what)
    tmp.rename(out)


def _build_epp(out: Path, workdir: Path) -> None:
    """GIE's cmd/epp through a wrapper module, not `go install pkg@version`.

    `go install …@v1.3.0` first reads the module's version list (`@v/list`) for
    deprecations, and the proxy reachable here answers that list with 403 for this module
    ("loading deprecation … 403 Forbidden"); `go get` of an explicit version in a module
    of our own does not read it. The wrapper requires only GIE, so its dependencies
    resolve to the versions GIE's own go.mod selects.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "go.mod").write_text("module kvserve.dev/clusterbuild/epp\n\ngo 1.26.0\n")
    package = f"{GIE_MODULE}/cmd/epp"
    _run(["go", "get", f"{package}@{GIE_VERSION}"], workdir, f"resolve GIE {GIE_VERSION}")
    # What GIE's Dockerfile stamps; the EPP logs it at start-up.
    ldflags = f"-X {GIE_MODULE}/version.BuildRef={GIE_VERSION}"
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    _run(
        [
            "go",
            "build",
            "-p",
            "2",
            "-trimpath",
            "-ldflags",
            ldflags,
            "-o",
            str(tmp / "epp"),
            package,
        ],
        workdir,
        "build epp (cold: a few minutes on 2 cores)",
    )
    tmp.rename(out)


def _copy_kwok_stages(dest: Path, workdir: Path) -> None:
    out = _run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK_VERSION}"],
        workdir,
        "download kwok module",
    )
    source = Path(json.loads(out)["Dir"]) / "kustomize" / "stage"
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for relative in KWOK_STAGES:
        path = source / relative
        if not path.is_file():
            raise RuntimeError(f"kwok stage {relative} not found under {source}")
        shutil.copyfile(path, tmp / path.name)
    tmp.rename(dest)


def ensure_built() -> Binaries:
    """Build whatever is missing from the cache; return the binaries' paths."""
    if not go_available():
        raise RuntimeError("Go is not installed: install Go ≥ 1.26 to build the test control plane")
    bins = binaries()
    root = cache_root()
    work = root / "build"
    started = time.monotonic()
    kube_bin = bins.kubectl.parent
    if not kube_bin.is_dir():
        _log(f"building Kubernetes {KUBERNETES_VERSION} from the Go module proxy (cold: 15–30 min)")
        _build_kubernetes(kube_bin, work / f"kubernetes-{KUBERNETES_VERSION}")
    if not bins.etcd.parent.is_dir():
        _log(f"building etcd {ETCD_VERSION}")
        _build_etcd(bins.etcd.parent, work / f"etcd-{ETCD_VERSION}")
    if not bins.kwok.parent.is_dir():
        _log(f"building kwok {KWOK_VERSION}")
        _go_install(
            f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}",
            bins.kwok.parent,
            work / "kwok",
            "build kwok",
        )
    if not bins.kwok_stages.is_dir():
        _copy_kwok_stages(bins.kwok_stages, work / "kwok")
    if not bins.helm.parent.is_dir():
        _log(f"building helm {HELM_VERSION}")
        minor = KUBERNETES_VERSION.split(".")[1]
        _go_install(
            f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}",
            bins.helm.parent,
            work / "helm",
            "build helm",
            # Without these, `helm version` says v3.21 and `helm template` assumes k8s 1.20.
            ldflags=f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION} "
            f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}",
        )
    if not bins.epp.parent.is_dir():
        _log(f"building GIE's endpoint picker {GIE_VERSION}")
        _build_epp(bins.epp.parent, work / f"gie-epp-{GIE_VERSION}")
    if time.monotonic() - started > 1:
        _log(f"all binaries ready in {time.monotonic() - started:.0f} s under {root}")
    return bins


if __name__ == "__main__":
    try:
        built = ensure_built()
    except RuntimeError as error:
        sys.exit(f"error: {error}")
    for path in built.bin_dirs:
        print(path)
