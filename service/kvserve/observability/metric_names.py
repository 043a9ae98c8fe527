"""What kvserve exports to Prometheus, read from the real metric classes, and the metric
names a PromQL expression uses.

The dashboards and alert rules are checked against this (``--check``): a panel or rule
that queries a series no code exports would show "No data" forever, and such a typo is
invisible until someone looks at the panel during an incident. The names are read from
the metric classes themselves (each instantiated into a fresh registry) rather than
listed here, so renaming a metric in the code makes the check fail instead of going
stale with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry

# Labels that Prometheus adds when it scrapes (job/instance) and that the Kubernetes
# scrape config adds from the pod (namespace/pod). Queries may match on them; the code
# never sets them.
SCRAPE_LABELS: Final = frozenset({"job", "instance", "namespace", "pod"})

# The sample names a family of each type is exposed under (prometheus_client strips the
# ``_total`` of counters from the family name; ``_created`` is left out on purpose: no
# dashboard or rule should depend on it).
_SUFFIXES: Final[Mapping[str, tuple[str, ...]]] = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "unknown": ("",),
}


@dataclass(frozen=True)
class ExportedMetric:
    """One sample name as Prometheus stores it, its family's type and its labels."""

    name: str
    family: str
    type: str
    labels: frozenset[str]


def _registry_metrics(registry: CollectorRegistry) -> dict[str, ExportedMetric]:
    out: dict[str, ExportedMetric] = {}
    for family in registry.collect():
        # A labelled metric with no child yet has no samples; its label names are then
        # only on the collector, so read them from there (prometheus_client has no public
        # accessor for a registry's collectors).
        labels: set[str] = set()
        for sample in family.samples:
            labels.update(k for k in sample.labels if k != "le")
        collector = registry._names_to_collectors.get(family.name)
        labels.update(getattr(collector, "_labelnames", ()))
        for suffix in _SUFFIXES.get(family.type, ("",)):
            sample_labels = labels | {"le"} if suffix == "_bucket" else labels
            out[family.name + suffix] = ExportedMetric(
                family.name + suffix, family.name, family.type, frozenset(sample_labels)
            )
    return out


def engine_metrics() -> dict[str, ExportedMetric]:
    """The engine's (``kvserve serve``) metrics, from ``EngineMetrics``."""
    from kvserve.telemetry.prometheus import EngineMetrics

    registry = CollectorRegistry()
    EngineMetrics("model", registry=registry)
    return _registry_metrics(registry)


def gateway_metrics() -> dict[str, ExportedMetric]:
    """The gateway's (``kvserve gateway``) metrics, from ``GatewayMetrics``."""
    from kvserve.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    GatewayMetrics(registry=registry)
    return _registry_metrics(registry)


def operator_metrics() -> dict[str, ExportedMetric]:
    """The operator's metrics: its module registers into its own module-level registry."""
    from kvserve_operator.metrics import REGISTRY

    return _registry_metrics(REGISTRY)


def exported_metrics() -> dict[str, ExportedMetric]:
    """Every sample name kvserve's engine, gateway and operator export."""
    merged: dict[str, ExportedMetric] = {}
    for part in (engine_metrics(), gateway_metrics(), operator_metrics()):
        for name, metric in part.items():
            if name in merged and merged[name] != metric:
                raise RuntimeError(f"metric {name} is exported twice with different labels")
            merged[name] = metric
    return dict(sorted(merged.items()))


# ---- PromQL: which metrics and labels an expression uses -----------------------------------

_KEYWORDS: Final = frozenset(
    {
        "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
        "and", "or", "unless", "atan2", "inf", "nan",
    }
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_IDENT = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w])(\s*\()?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(\"(?:[^\"\\]|\\.)*\")")
_NUMBER_UNIT = re.compile(r"\b\d+(?:\.\d+)?(?:ms|s|m|h|d|w|y)\b")


@dataclass(frozen=True)
class Selector:
    """A metric name and the label names its matchers use (``{a="x"}`` → {"a"})."""

    metric: str
    labels: frozenset[str]


def selectors(expr: str) -> list[Selector]:
    """The metric selectors in a PromQL expression, in order.

    A small scanner, not a parser: enough for the expressions this package writes
    (functions, aggregations with ``by``/``on``/``group_left``, matchers, ranges). It
    finds every identifier that is not a function, keyword or grouping label, and the
    label names of the ``{...}`` right after it. Grafana variables (``$model``) are left
    alone: they appear inside strings or ranges only.
    """
    found: list[Selector] = []
    # Matchers first (their quoted values may hold anything), then blank them out.
    matchers: dict[int, frozenset[str]] = {}

    def keep_selector(m: re.Match[str]) -> str:
        key = len(matchers)
        matchers[key] = frozenset(x[0] for x in _MATCHER.findall(m.group(2)))
        name = m.group(1) or ""
        return f"{name} __SEL{key}__ "

    text = _SELECTOR.sub(keep_selector, expr)
    text = _STRING.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER_UNIT.sub(" ", text)
    tokens = list(_IDENT.finditer(text))
    for i, tok in enumerate(tokens):
        name, call = tok.group(1), tok.group(2)
        if call or name in _KEYWORDS or name.startswith("__SEL"):
            continue
        labels: frozenset[str] = frozenset()
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if nxt is not None and nxt.group(1).startswith("__SEL"):
            between = text[tok.end() : nxt.start()]
            if between.strip() == "":
                labels = matchers[int(nxt.group(1)[5:-2])]
        found.append(Selector(name, labels))
    # A bare {...} selector without a metric name would select across all metrics.
    for tok in tokens:
        name = tok.group(1)
        if name.startswith("__SEL"):
            prev_end = tok.start()
            before = text[:prev_end].rstrip()
            if not re.search(r"[a-zA-Z0-9_:]$", before):
                raise ValueError(f"selector without a metric name in {expr!r}")
    return found


def problems(
    exprs: Iterable[tuple[str, str]],
    exported: Mapping[str, ExportedMetric],
    also_allowed: Iterable[str] = (),
) -> list[str]:
    """What is wrong with ``(where, expr)`` pairs: unknown metrics or label names.

    ``also_allowed`` holds names that are not exported by the code but legitimately
    queried (recording rules defined next to the alerts).
    """
    extra = set(also_allowed)
    out: list[str] = []
    for where, expr in exprs:
        try:
            sels = selectors(expr)
        except ValueError as exc:
            out.append(f"{where}: {exc}")
            continue
        if not sels:
            out.append(f"{where}: queries no metric: {expr!r}")
        for sel in sels:
            if sel.metric in extra:
                continue
            metric = exported.get(sel.metric)
            if metric is None:
                out.append(
                    f"{where}: queries {sel.metric}, which kvserve does not export "
                    "(see kvserve.observability.metric_names.exported_metrics)"
                )
                continue
            unknown = sel.labels - metric.labels - SCRAPE_LABELS
            if unknown:
                out.append(
                    f"{where}: {sel.metric} has no label {', '.join(sorted(unknown))} "
                    f"(it has: {', '.join(sorted(metric.labels)) or 'none'})"
                )
    return out
