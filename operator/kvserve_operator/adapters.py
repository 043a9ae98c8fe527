"""Which LoRA adapters each engine replica serves, read from its ``GET /v1/models``.

The adapter-sync container in each pod loads and unloads adapters (docs/inference-model.md,
"Adapters"); the operator only observes the result, to count in status how many replicas
have each adapter loaded. It reads the pods over the same network path as the
autoscaler's metrics, and only for InferenceModels that list adapters.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve_operator.autoscaler import pod_metrics_url
from kvserve_operator.render import HTTP_PORT

MODELS_URL_TEMPLATE = f"http://{{pod_ip}}:{HTTP_PORT}/v1/models"
FETCH_TIMEOUT_S = 2.0
_MAX_PARALLEL = 16


def served_adapters(url: str, timeout: float = FETCH_TIMEOUT_S) -> frozenset[str] | None:
    """The adapters one replica lists (entries of /v1/models with a parent), or None when
    it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.loads(response.read().decode())
    except (OSError, ValueError):
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return None
    return frozenset(
        str(m["id"]) for m in models if isinstance(m, dict) and m.get("parent") and "id" in m
    )


def replicas_adapters(
    pods: Sequence[Mapping[str, Any]],
    template: str = MODELS_URL_TEMPLATE,
    timeout: float = FETCH_TIMEOUT_S,
) -> list[frozenset[str]]:
    """The adapter sets of the ready pods that answered, read in parallel (one slow pod
    costs one timeout, not one per pod)."""
    urls = [u for u in (pod_metrics_url(template, p) for p in pods) if u]
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(len(urls), _MAX_PARALLEL)) as pool:
        found = list(pool.map(lambda u: served_adapters(u, timeout), urls))
    return [s for s in found if s is not None]
