"""Reading a server's ``/metrics``."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
