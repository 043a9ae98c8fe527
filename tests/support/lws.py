"""The LeaderWorkerSet CRD, from its own Go module, for the tests that install it.

``lws_crd()`` downloads ``sigs.k8s.io/lws`` at ``LWS_VERSION`` through the Go module
proxy (``go mod download``, as tests/cluster/build.py gets the control plane) and keeps
its CRD file under ``$KVSERVE_CACHE/k8s/lws-VERSION/`` (default ``~/.cache/kvserve``),
so later runs read it from there. The file is the module's own, unchanged: the CRD the
LeaderWorkerSet controller installs in a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from kvserve_operator.constants import LWS_CRD_NAME
from tests.cluster.build import cache_root
from tests.cluster.controlplane import Cluster
from tests.support.waiting import poll

LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.7.0"
# Where the CRD lives inside the module (its controller-gen output).
CRD_IN_MODULE = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def lws_crd() -> Path:
    """The path of the cached CRD file, downloaded on first use (RuntimeError if Go or
    the module proxy cannot give it)."""
    dest = cache_root() / f"lws-{LWS_VERSION}" / Path(CRD_IN_MODULE).name
    if dest.is_file():
        return dest
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.run(
            ["go", "mod", "download", "-json", f"{LWS_MODULE}@{LWS_VERSION}"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"go mod download {LWS_MODULE}@{LWS_VERSION} failed:\n{proc.stdout}{proc.stderr}"
        )
    source = Path(json.loads(proc.stdout)["Dir"]) / CRD_IN_MODULE
    if not source.is_file():
        raise RuntimeError(f"{CRD_IN_MODULE} is not in {LWS_MODULE}@{LWS_VERSION}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final name and renamed: a concurrent run sees all of it or none.
    staging = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    staging.write_bytes(source.read_bytes())
    staging.replace(dest)
    return dest


def crd_established(cluster: Cluster) -> bool:
    """Whether the API server serves the LeaderWorkerSet CRD (condition Established)."""
    proc = cluster.kubectl("get", "crd", LWS_CRD_NAME, "-o", "json", check=False)
    if proc.returncode != 0:
        return False
    conditions = (json.loads(proc.stdout).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def install_crd(cluster: Cluster, crd_file: Path) -> None:
    """Apply the CRD and wait until it is served. Polled, not `kubectl wait`: that fails
    at once on a CRD with no conditions yet."""
    cluster.kubectl("apply", "--server-side", "-f", str(crd_file))
    poll("the LeaderWorkerSet CRD Established", lambda: crd_established(cluster))
