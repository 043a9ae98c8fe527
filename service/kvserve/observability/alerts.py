"""The Prometheus alert rules, generated: ``python -m kvserve.observability.alerts``.

Writes one rules file (``groups:``) to ``dashboards/prometheus-rules.yaml`` for a plain
Prometheus (``rule_files:``) and the same text to ``charts/kvserve/files/
prometheus-rules.yaml``, which the chart wraps in a ``PrometheusRule``. ``--check``
fails when either copy is stale or a rule queries a series kvserve does not export.

The SLO alerts are the multi-window, multi-burn-rate alerts of the Google SRE workbook
(chapter "Alerting on SLOs"), built from one table (``BURN_WINDOWS``). The burn rate of
a window is (share of requests over the SLO threshold) / (1 − target); the share comes
from recording rules ``kvserve:<slo>_slo_bad_ratio:rate<window>`` built from the
histogram bucket at the threshold (``le="<threshold>"``), per namespace and model. An
alert fires when both its long window (enough budget spent to matter) and its short
window (still burning now, so it resolves soon after a fix) are over the factor.

Prometheus cannot know each InferenceModel's own SLO, so the rules use one threshold and
target for every model: the InferenceModel defaults unless given (``--ttft-seconds``,
``--tpot-seconds``, ``--target``, written with ``--out``). Thresholds must be bucket
boundaries of the histograms (checked here).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from kvserve.observability import metric_names
from kvserve.observability import queries as q
from kvserve.observability.dashboards import default_root, slo_defaults
from kvserve.observability.generated import sync_files

RULE_FILES: Final = (
    "dashboards/prometheus-rules.yaml",
    "charts/kvserve/files/prometheus-rules.yaml",
)
RUNBOOK: Final = "docs/runbooks.md"
SLO_PERIOD_DAYS: Final = 30  # the error budget's period the burn factors are sized for
SLO_KEYS: Final = ("namespace", "model")  # what SLO ratios and alerts are grouped by

SHED_REASONS: Final = "queue_full|queue_timeout|concurrency"


@dataclass(frozen=True)
class BurnWindow:
    """One row of the multi-window multi-burn-rate table."""

    long: str
    short: str
    factor: float
    severity: str
    for_: str


# SRE workbook, table 5-8 (30-day SLO): 2% of the budget in 1h, 5% in 6h (page), 10% in
# 1d, 10% in 3d (ticket).
BURN_WINDOWS: Final = (
    BurnWindow("1h", "5m", 14.4, "page", "2m"),
    BurnWindow("6h", "30m", 6.0, "page", "15m"),
    BurnWindow("1d", "2h", 3.0, "ticket", "1h"),
    BurnWindow("3d", "6h", 1.0, "ticket", "3h"),
)


@dataclass(frozen=True)
class Slo:
    key: str  # ttft / tpot
    name: str  # TTFT / TPOT
    histogram: str
    threshold: float
    what: str  # "to the first token"


@dataclass(frozen=True)
class AlertConfig:
    """The numbers the rules use. Defaults: the InferenceModel SLO defaults and the
    thresholds documented in docs/runbooks.md."""

    ttft_seconds: float = field(default_factory=lambda: slo_defaults().ttft_seconds)
    tpot_seconds: float = field(default_factory=lambda: slo_defaults().tpot_seconds)
    target: float = field(default_factory=lambda: slo_defaults().attainment)
    error_ratio: float = 0.05
    kv_cache_usage: float = 0.95
    queue_waiting: int = 10
    shed_ratio: float = 0.05
    runbook_base: str = RUNBOOK
    burn_windows: tuple[BurnWindow, ...] = BURN_WINDOWS

    def slos(self) -> tuple[Slo, ...]:
        return (
            Slo("ttft", "TTFT", q.TTFT, self.ttft_seconds, "to the first token"),
            Slo("tpot", "TPOT", q.TPOT, self.tpot_seconds, "per output token"),
        )


def validate(config: AlertConfig) -> None:
    """Refuse thresholds that are not histogram bucket boundaries, and odd targets."""
    from kvserve.telemetry.prometheus import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS

    for slo, buckets in zip(config.slos(), (TTFT_BUCKETS, TOKEN_LATENCY_BUCKETS), strict=True):
        if q.le_value(slo.threshold) not in {q.le_value(b) for b in buckets}:
            raise ValueError(
                f"the {slo.name} threshold {slo.threshold} s is not a bucket boundary of "
                f"{slo.histogram} (boundaries: {', '.join(q.le_value(b) for b in buckets)}); "
                "attainment can only be read exactly at a boundary"
            )
    if not 0 < config.target < 1:
        raise ValueError(f"the SLO target must be between 0 and 1, got {config.target}")


def bad_ratio_record(slo: Slo, window: str) -> str:
    return f"kvserve:{slo.key}_slo_bad_ratio:rate{window}"


def anchor(alert: str) -> str:
    """The GitHub-style anchor of a ``## <alert>`` heading in docs/runbooks.md."""
    return alert.lower()


def _runbook(config: AlertConfig, alert: str) -> str:
    return f"{config.runbook_base}#{anchor(alert)}"


def _days(hours: float) -> str:
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.0f} hours"


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


def burn_alert_name(slo: Slo, w: BurnWindow) -> str:
    return f"Kvserve{slo.name}BudgetBurn{w.long}"


def recording_rules(config: AlertConfig, slo: Slo) -> list[dict[str, Any]]:
    """The SLO's bad ratio over every window the burn-rate table uses."""
    windows = sorted(
        {w for bw in config.burn_windows for w in (bw.long, bw.short)}, key=_window_seconds
    )
    return [
        {
            "record": bad_ratio_record(slo, window),
            "expr": q.slo_bad_ratio(slo.histogram, q.le_value(slo.threshold), "", SLO_KEYS, window),
        }
        for window in windows
    ]


def burn_rate_alerts(config: AlertConfig, slo: Slo) -> list[dict[str, Any]]:
    budget = 1 - config.target
    rules = []
    le = q.le_value(slo.threshold)
    for w in config.burn_windows:
        name = burn_alert_name(slo, w)
        target = f"{config.target:g}"
        long_burn = q.burn_rate(bad_ratio_record(slo, w.long), target)
        short_burn = q.burn_rate(bad_ratio_record(slo, w.short), target)
        lasts = _days(SLO_PERIOD_DAYS * 24 / w.factor)
        rules.append(
            {
                "alert": name,
                "expr": f"(\n{q.indent(long_burn)}\n) > {w.factor:g}\nand\n"
                f"(\n{q.indent(short_burn)}\n) > {w.factor:g}",
                "for": w.for_,
                "labels": {
                    "severity": w.severity,
                    "slo": slo.key,
                    "long_window": w.long,
                    "short_window": w.short,
                },
                "annotations": {
                    "summary": f"{{{{ $labels.model }}}}: {slo.name} error budget burning "
                    f"over {w.factor:g}× the sustainable rate ({w.long} and {w.short} "
                    "windows)",
                    "description": f"Model {{{{ $labels.model }}}} in namespace "
                    f"{{{{ $labels.namespace }}}}: over the last {w.long}, requests slower "
                    f"than {le} s {slo.what} used the error budget "
                    f'{{{{ $value | printf "%.1f" }}}}× faster than the SLO allows '
                    f"(target {_pct(config.target)} within {le} s, budget "
                    f"{_pct(budget)} of requests), and still over {w.factor:g}× in the "
                    f"last {w.short}. At {w.factor:g}× a {SLO_PERIOD_DAYS}-day budget "
                    f"lasts {lasts}.",
                    "runbook_url": _runbook(config, name),
                },
            }
        )
    return rules


def serving_alerts(config: AlertConfig) -> list[dict[str, Any]]:
    keys = SLO_KEYS
    gw_state = "kvserve_gateway_replicas"
    waiting = "kvserve_num_requests_waiting"
    pod_keys = (*SLO_KEYS, "pod")
    return [
        {
            "alert": "KvserveHighErrorRatio",
            "expr": f"{q.error_ratio('', keys, '5m')}\n> {config.error_ratio:g}",
            "for": "5m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.model }}: over "
                f"{_pct(config.error_ratio)} of requests fail",
                "description": "Model {{ $labels.model }} in namespace {{ $labels.namespace }}: "
                "{{ $value | humanizePercentage }} of the requests that finished in the last 5m "
                f"failed with an error (threshold {_pct(config.error_ratio)}, for 5m). "
                "Cancellations (abort) are not counted as failures.",
                "runbook_url": _runbook(config, "KvserveHighErrorRatio"),
            },
        },
        {
            "alert": "KvserveNoReadyReplica",
            "expr": f'max by (namespace, model) ({gw_state}{{state="healthy"}}) == 0',
            "for": "2m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.model }}: the gateway has no healthy replica",
                "description": "No gateway can reach a healthy replica of model "
                "{{ $labels.model }} (gateway namespace {{ $labels.namespace }}) for 2m "
                "(healthy replicas: {{ $value }}): every request for it fails with 503.",
                "runbook_url": _runbook(config, "KvserveNoReadyReplica"),
            },
        },
        {
            "alert": "KvserveReplicasNotReady",
            "expr": f'max by (namespace, model) ({gw_state}{{state="unhealthy"}}) > 0',
            "for": "10m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "{{ $labels.model }}: {{ $value }} replica(s) unreachable",
                "description": "The gateway (namespace {{ $labels.namespace }}) has failed to "
                "reach {{ $value }} replica(s) of model {{ $labels.model }} for 10m (load polls "
                "or calls fail); it routes around them, with that much less capacity.",
                "runbook_url": _runbook(config, "KvserveReplicasNotReady"),
            },
        },
        {
            "alert": "KvserveKVCacheSaturated",
            "expr": f"max by ({', '.join(pod_keys)}) (kvserve_kv_cache_usage_ratio) > "
            f"{config.kv_cache_usage:g}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "{{ $labels.pod }}: KV cache {{ $value | humanizePercentage }} full",
                "description": "Replica {{ $labels.pod }} of model {{ $labels.model }} "
                "(namespace {{ $labels.namespace }}) has had {{ $value | humanizePercentage }} "
                f"of its KV-cache blocks in use for 10m (threshold "
                f"{_pct(config.kv_cache_usage)}): new requests wait and running ones may be "
                "preempted.",
                "runbook_url": _runbook(config, "KvserveKVCacheSaturated"),
            },
        },
        {
            "alert": "KvserveQueueGrowing",
            "expr": f"max by ({', '.join(pod_keys)}) ({waiting}) > {config.queue_waiting}\n"
            f"and\nmax by ({', '.join(pod_keys)}) (deriv({waiting}[15m])) > 0",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "{{ $labels.pod }}: {{ $value }} requests waiting, and growing",
                "description": "Replica {{ $labels.pod }} of model {{ $labels.model }} "
                "(namespace {{ $labels.namespace }}) has {{ $value }} requests waiting to be "
                f"scheduled (threshold {config.queue_waiting}) and the queue has grown over "
                "the last 15m: arrivals outpace what the replica serves.",
                "runbook_url": _runbook(config, "KvserveQueueGrowing"),
            },
        },
    ]


def gateway_alerts(config: AlertConfig) -> list[dict[str, Any]]:
    rejections = "kvserve_gateway_rejections_total"
    shed = q.rate_sum(rejections, f'reason=~"{SHED_REASONS}"', ("namespace",), "5m")
    # Requests past the tenant checks (queue rejections included: the admission queue
    # answers them) plus those refused by a tenant's concurrency limit before that point.
    answered = q.rate_sum("kvserve_gateway_requests_total", "", ("namespace",), "5m")
    concurrency = q.rate_sum(rejections, 'reason="concurrency"', ("namespace",), "5m")
    attempted = f"{answered}\n+ {concurrency}"
    return [
        {
            "alert": "KvserveGatewayShedding",
            "expr": f"{q.ratio(shed, attempted)}\n> {config.shed_ratio:g}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "The gateway sheds {{ $value | humanizePercentage }} of requests",
                "description": "The gateway in namespace {{ $labels.namespace }} has refused "
                "{{ $value | humanizePercentage }} of requests over the last 5m because every "
                "replica was at its in-flight limit (queue_full, queue_timeout) or a tenant hit "
                f"its concurrency limit (threshold {_pct(config.shed_ratio)}, for 10m).",
                "runbook_url": _runbook(config, "KvserveGatewayShedding"),
            },
        },
    ]


def operator_alerts(config: AlertConfig) -> list[dict[str, Any]]:
    errors = q.rate_sum(
        "kvserve_operator_reconcile_errors_total", "", ("namespace", "reason"), "5m"
    )
    return [
        {
            "alert": "KvserveOperatorReconcileErrors",
            "expr": f"{errors} > 0",
            "for": "15m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "The kvserve operator keeps failing to reconcile ({{ $labels.reason }})",
                "description": "The operator in namespace {{ $labels.namespace }} has failed "
                "reconciles with reason {{ $labels.reason }} for 15m "
                '({{ $value | printf "%.3f" }} per second over the last 5m): InferenceModels '
                "may not match their spec.",
                "runbook_url": _runbook(config, "KvserveOperatorReconcileErrors"),
            },
        },
    ]


def rule_groups(config: AlertConfig | None = None) -> dict[str, Any]:
    config = config or AlertConfig()
    validate(config)
    return {
        "groups": [
            # Each SLO's recording rules and alerts share a group: rules in a group run in
            # order, so the alerts always read the ratios of the same evaluation.
            *(
                {
                    "name": f"kvserve-slo-{slo.key}",
                    "rules": recording_rules(config, slo) + burn_rate_alerts(config, slo),
                }
                for slo in config.slos()
            ),
            {"name": "kvserve-serving", "rules": serving_alerts(config)},
            {"name": "kvserve-gateway", "rules": gateway_alerts(config)},
            {"name": "kvserve-operator", "rules": operator_alerts(config)},
        ]
    }


def alert_names(groups: dict[str, Any]) -> list[str]:
    return [r["alert"] for g in groups["groups"] for r in g["rules"] if "alert" in r]


def _window_seconds(window: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    return int(window[:-1]) * units[window[-1]]


# ---- YAML --------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Block style (``|``) for multi-line strings, so expressions stay readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

HEADER: Final = """\
# kvserve SLO recording and alert rules. Generated by
#   python -m kvserve.observability.alerts
# from service/kvserve/observability/alerts.py: edit that, not this file.
# A plain Prometheus loads this file with rule_files:; the Helm chart wraps the same
# groups in a PrometheusRule. Runbooks: docs/runbooks.md.
"""


def to_yaml(groups: dict[str, Any]) -> str:
    # No line folding: a folded annotation could split a {{ template }} across lines.
    body = yaml.dump(groups, Dumper=_Dumper, sort_keys=False, width=1 << 16, allow_unicode=True)
    return HEADER + body


# ---- checks and the command ------------------------------------------------------------------


def query_problems(groups: dict[str, Any]) -> list[str]:
    recorded = [r["record"] for g in groups["groups"] for r in g["rules"] if "record" in r]
    exprs = [
        (f"{g['name']} / {r.get('alert') or r.get('record')}", r["expr"])
        for g in groups["groups"]
        for r in g["rules"]
    ]
    return metric_names.problems(exprs, metric_names.exported_metrics(), recorded)


def main(argv: Sequence[str] | None = None) -> int:
    defaults = AlertConfig()
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.observability.alerts",
        description="Generate the kvserve Prometheus rules (dashboards/prometheus-rules.yaml "
        "and the Helm chart's copy).",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail if a copy is stale or a rule queries a "
        "series kvserve does not export",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="write the rules to this file only (use with the SLO options for your own thresholds)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="repository root (default: the checkout this module is in)",
    )
    parser.add_argument(
        "--ttft-seconds",
        type=float,
        default=defaults.ttft_seconds,
        help="TTFT SLO threshold; must be a TTFT bucket boundary",
    )
    parser.add_argument(
        "--tpot-seconds",
        type=float,
        default=defaults.tpot_seconds,
        help="TPOT SLO threshold; must be a TPOT bucket boundary",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=defaults.target,
        help="share of requests that must meet each SLO (e.g. 0.99)",
    )
    parser.add_argument(
        "--runbook-base",
        default=defaults.runbook_base,
        help="runbook URL prefix (e.g. your docs site's runbooks page)",
    )
    args = parser.parse_args(argv)
    config = AlertConfig(
        ttft_seconds=args.ttft_seconds,
        tpot_seconds=args.tpot_seconds,
        target=args.target,
        runbook_base=args.runbook_base,
    )
    custom = config != defaults
    try:
        groups = rule_groups(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bad = query_problems(groups)
    if bad:
        print("rules query series kvserve does not export:", file=sys.stderr)
        for line in bad:
            print(f"  - {line}", file=sys.stderr)
        return 1
    text = to_yaml(groups)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out} ({len(alert_names(groups))} alerts)")
        return 0
    if custom:
        print(
            "error: the repository copies use the defaults; write custom thresholds with "
            "--out FILE",
            file=sys.stderr,
        )
        return 2
    root = args.root or default_root()
    files = {root / p: text for p in RULE_FILES}
    if not sync_files(
        files, root, check=args.check, regenerate="python -m kvserve.observability.alerts"
    ):
        return 1
    if args.check:
        print(f"rules up to date: {len(files)} files, {len(alert_names(groups))} alerts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
