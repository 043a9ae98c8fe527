"""InferenceModel manifests and object reads for the operator's tests on the real
control plane (tests/operator/*_e2e.py)."""

from __future__ import annotations

import json
from typing import Any

from tests.cluster.controlplane import Cluster


def inference_model(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    """An InferenceModel of the tiny file:// model served as "tiny", with ``spec``'s
    fields on top."""
    body: dict[str, Any] = {"model": {"source": "file:///opt/models/tiny", "servedName": "tiny"}}
    body.update(spec)
    return {
        "apiVersion": "kvserve.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": ns},
        "spec": body,
    }


def get_object(cluster: Cluster, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    """The object as JSON; None when it, or its kind (a CRD not installed), is absent."""
    proc = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr or "doesn't have a resource type" in proc.stderr, (
            proc.stderr
        )
        return None
    return json.loads(proc.stdout)  # type: ignore[no-any-return]
