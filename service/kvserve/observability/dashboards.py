"""The Grafana dashboards, generated: ``python -m kvserve.observability.dashboards``.

Two dashboards, ``kvserve / SLO overview`` (per model) and ``kvserve / replicas`` (per
engine pod, plus how the gateway spreads load). They are built here from plain
dataclasses rather than edited in Grafana, so that every query goes through the one set
of formulas (``queries``), every panel follows the same conventions (a ``datasource``
variable and no hard-coded datasource uid, ``namespace``/``model``/``pod`` variables,
``$__rate_interval``, a unit and a description on every panel, ratios guarded against
division by zero) and a test can check all of that plus that every metric queried is one
the code exports.

The JSON is committed (``dashboards/`` and the chart's ``charts/kvserve/files/
dashboards/``), as is the per-panel reference in ``docs/dashboards.md`` between its
generated markers. ``--check`` fails when any copy differs from what this module
generates, or when a query uses a metric or label kvserve does not export.

SLO thresholds are dashboard variables whose options are exactly the histogram's bucket
boundaries: attainment is read off the bucket at the threshold, which only exists for a
boundary. The defaults are the InferenceModel's SLO defaults (``SloSpec``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvserve.observability import metric_names
from kvserve.observability import queries as q
from kvserve.observability.generated import sync_files
from kvserve.observability.queries import E2E, FINISHED, ITL, QUEUE_TIME, TPOT, TTFT

DS: Final = {"type": "prometheus", "uid": "${datasource}"}
RATE: Final = "$__rate_interval"
RANGE: Final = "$__range"
SCHEMA_VERSION: Final = 39
TAG: Final = "kvserve"
QUANTILES: Final = ("0.5", "0.95", "0.99")
SLO_TARGETS: Final = ("0.9", "0.95", "0.99", "0.995", "0.999")
REPLICA_QUANTILES: Final = ("0.5", "0.9", "0.95", "0.99")

# Where the generated files go, relative to the repository root.
DASHBOARD_DIRS: Final = ("dashboards", "charts/kvserve/files/dashboards")
DOC: Final = "docs/dashboards.md"
DOC_BEGIN: Final = (
    "<!-- BEGIN GENERATED PANEL REFERENCE (python -m kvserve.observability.dashboards) -->"
)
DOC_END: Final = "<!-- END GENERATED PANEL REFERENCE -->"

GW_TTFT: Final = "kvserve_gateway_time_to_first_token_seconds"
GW_E2E: Final = "kvserve_gateway_e2e_request_latency_seconds"
GW_QUEUE_WAIT: Final = "kvserve_gateway_queue_wait_seconds"


# ---- the model -------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One panel. ``description`` says what it shows and how to read it (Grafana shows it
    on the panel's (i) icon and docs/dashboards.md repeats it)."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    stack: bool = False
    threshold: float | None = None  # stat colours / a dashed line on time series
    higher_is_better: bool = True  # colours: green above the threshold (else red above)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[dict[str, Any], ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = (TAG,)

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"

    def panels(self) -> Iterable[tuple[Row, Panel]]:
        for row in self.rows:
            for panel in row.panels:
                yield row, panel


@dataclass(frozen=True)
class Scope:
    """Which engine series a dashboard selects and how it groups them."""

    matchers: str  # inside the braces, for engine series
    by: tuple[str, ...]
    legend: str  # how one group is named in a legend
    gateway_matchers: str = 'model=~"$model"'  # for gateway series with a model label


# ---- SLO defaults and the threshold variables -----------------------------------------------


@dataclass(frozen=True)
class SloDefaults:
    ttft_seconds: float
    tpot_seconds: float
    attainment: float


def slo_defaults() -> SloDefaults:
    """The InferenceModel's SLO defaults (one Python copy: ``SloSpec``)."""
    from kvserve_operator.spec import SloSpec

    s = SloSpec()
    return SloDefaults(s.ttft_seconds, s.tpot_seconds, s.attainment)


def threshold_options(buckets: Sequence[float], default: float, what: str) -> list[str]:
    """The variable's options: the histogram's bucket boundaries as ``le`` values.

    Raises if the default is not a boundary: attainment at it could not be read off a
    bucket (add it to the bucket tuple in kvserve.telemetry.prometheus)."""
    options = [q.le_value(b) for b in buckets]
    if q.le_value(default) not in options:
        raise ValueError(
            f"the default {what} SLO {default} s is not a bucket boundary of its histogram "
            f"({', '.join(options)}); add it to the buckets in kvserve/telemetry/prometheus.py"
        )
    return options


def datasource_variable() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "Data source",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "description": "The Prometheus that scrapes the kvserve engines and gateway.",
    }


def query_variable(name: str, label: str, query: str, description: str) -> dict[str, Any]:
    """A multi-value label variable with an ``All`` that matches anything (``.*``)."""
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "current": {},
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "description": description,
    }


def custom_variable(
    name: str, label: str, options: Sequence[str], default: str, description: str
) -> dict[str, Any]:
    if default not in options:
        raise ValueError(f"variable {name}: default {default} is not one of {options}")
    return {
        "type": "custom",
        "name": name,
        "label": label,
        "query": ",".join(options),
        "current": {"selected": True, "text": default, "value": default},
        "options": [{"selected": o == default, "text": o, "value": o} for o in options],
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "description": description,
    }


def common_variables(with_pod: bool) -> list[dict[str, Any]]:
    from kvserve.telemetry.prometheus import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS

    slo = slo_defaults()
    probe = "kvserve_num_requests_running"
    out = [
        datasource_variable(),
        query_variable(
            "namespace",
            "Namespace",
            f"label_values({probe}, namespace)",
            "Kubernetes namespace of the engine pods (added by the scrape config).",
        ),
        query_variable(
            "model",
            "Model",
            f'label_values({probe}{{namespace=~"$namespace"}}, model)',
            "Served model name (the engine's model label).",
        ),
    ]
    if with_pod:
        out.append(
            query_variable(
                "pod",
                "Pod",
                f'label_values({probe}{{namespace=~"$namespace", model=~"$model"}}, pod)',
                "Engine pod (replica).",
            )
        )
    out += [
        custom_variable(
            "ttft_slo",
            "TTFT SLO (s)",
            threshold_options(TTFT_BUCKETS, slo.ttft_seconds, "TTFT"),
            q.le_value(slo.ttft_seconds),
            "TTFT threshold in seconds. Only histogram bucket boundaries are offered: "
            "attainment is read off the bucket at the threshold.",
        ),
        custom_variable(
            "tpot_slo",
            "TPOT SLO (s)",
            threshold_options(TOKEN_LATENCY_BUCKETS, slo.tpot_seconds, "TPOT"),
            q.le_value(slo.tpot_seconds),
            "TPOT threshold in seconds. Only histogram bucket boundaries are offered.",
        ),
        custom_variable(
            "slo_target",
            "SLO target",
            SLO_TARGETS,
            str(slo.attainment),
            "Share of requests that must meet each SLO; 1 - target is the error budget.",
        ),
    ]
    return out


# ---- panel kinds ------------------------------------------------------------------------------


def slo_attainment_panels(s: Scope, window: str, stat: bool, target: float) -> list[Panel]:
    """TTFT and TPOT attainment (stat over the range, or time series)."""
    kind, width, height = ("stat", 6, 4) if stat else ("timeseries", 12, 8)
    period = "over the dashboard's time range" if stat else "per $__rate_interval window"
    panels = []
    for name, hist, var, what in (
        ("TTFT", TTFT, "$ttft_slo", "time to first token (engine arrival → first token)"),
        ("TPOT", TPOT, "$tpot_slo", "time per output token ((last − first token) / (O − 1))"),
    ):
        queries = [Query(q.slo_attainment(hist, var, s.matchers, s.by, window), s.legend)]
        extra = ""
        if name == "TTFT" and not stat and "pod" not in s.by:
            queries.append(
                Query(
                    q.slo_attainment(GW_TTFT, var, s.gateway_matchers, ("model",), window),
                    "at the gateway {{model}}",
                )
            )
            extra = (
                " The 'at the gateway' line is the same share for TTFT measured by the "
                "gateway (includes its admission queue and the hop to the replica)."
            )
        panels.append(
            Panel(
                f"{name} SLO attainment",
                f"Share of requests whose {what} was at or under {var} s, {period}. Read "
                f"off the histogram bucket at the threshold, so it is exact. Compare with the "
                f"SLO target ($slo_target): below it, the error budget is being spent faster "
                f"than allowed. No value means no requests in the window.{extra}",
                "percentunit",
                tuple(queries),
                kind=kind,
                width=width,
                height=height,
                min=None if stat else 0,
                max=1,
                threshold=target,
            )
        )
    return panels


def burn_rate_panel(s: Scope) -> Panel:
    queries = []
    for name, hist, var in (("TTFT", TTFT, "$ttft_slo"), ("TPOT", TPOT, "$tpot_slo")):
        for window, label in ((RATE, ""), ("1h", " (1h)")):
            bad = q.slo_bad_ratio(hist, var, s.matchers, s.by, window)
            queries.append(Query(q.burn_rate(bad, "$slo_target"), f"{name} {s.legend}{label}"))
    return Panel(
        "Error-budget burn rate",
        "How fast each SLO's error budget is spent: (share of requests over the threshold) / "
        "(1 − $slo_target), over $__rate_interval and over the last hour. 1 means the budget "
        "lasts exactly the SLO period; the page alerts fire at 14.4 (1h and 5m windows) and "
        "6 (6h and 30m), the tickets at 3 (1d and 2h) and 1 (3d and 6h).",
        "suffix:×",
        tuple(queries),
        min=0,
    )


def goodput_panel(s: Scope, window: str = RATE, stat: bool = False) -> Panel:
    good = Query(
        q.goodput_lower_bound("$ttft_slo", "$tpot_slo", s.matchers, s.by, window),
        f"goodput {s.legend}" if not stat else s.legend,
    )
    queries: tuple[Query, ...] = (good,)
    if not stat:
        queries += (Query(q.succeeded_rate(s.matchers, s.by, window), f"succeeded {s.legend}"),)
    return Panel(
        "Goodput (lower bound)",
        "Requests per second that succeeded (stop or length) and met both the TTFT "
        "($ttft_slo s) and TPOT ($tpot_slo s) SLOs (docs/architecture.md §3). The two SLOs "
        "come from separate histograms, so the joint count is bounded from below: "
        "succeeded − over-TTFT − over-TPOT (clamped at 0); the true goodput is at least this."
        + (
            " Averaged over the dashboard's time range."
            if stat
            else " The gap to the 'succeeded' line is throughput that missed an SLO."
        ),
        "reqps",
        queries,
        kind="stat" if stat else "timeseries",
        width=6 if stat else 12,
        height=4 if stat else 8,
        min=0,
    )


def error_ratio_panel(s: Scope, window: str = RATE, stat: bool = False) -> Panel:
    queries = [Query(q.error_ratio(s.matchers, s.by, window), f"error {s.legend}")]
    if not stat:
        abort = q.rate_sum(FINISHED, q.join(s.matchers, 'finished_reason="abort"'), s.by, window)
        all_finished = q.rate_sum(FINISHED, s.matchers, s.by, window)
        queries.append(Query(q.ratio(abort, all_finished), f"cancelled {s.legend}"))
    return Panel(
        "Error ratio" if stat else "Error and cancellation ratio",
        "Share of finished requests that failed with an error (docs/architecture.md §3 error rate: "
        "failed / attempted)"
        + (
            ", and the share cancelled by the client (finish reason abort: the client "
            "disconnected or the gateway cancelled the call). Cancellations are not errors "
            "but a rising share often means clients time out waiting."
            if not stat
            else " over the dashboard's time range. The page alert fires above 5%."
        ),
        "percentunit",
        tuple(queries),
        kind="stat" if stat else "timeseries",
        width=6 if stat else 12,
        height=4 if stat else 8,
        min=0,
        max=1 if not stat else None,
    )


def finish_reason_panel(s: Scope, by: tuple[str, ...], legend: str) -> Panel:
    return Panel(
        "Requests by finish reason",
        "Finished requests per second by reason: stop (end of sequence, stop token or stop "
        "string), length (max_tokens or the context limit), abort (cancelled: the client went "
        "away or the gateway cancelled), error (failed with an exception). Stacked: the top "
        "is the total finished rate.",
        "reqps",
        (Query(q.rate_sum(FINISHED, s.matchers, by, RATE), legend),),
        stack=True,
        min=0,
    )


def latency_panel(
    title: str, hist: str, what: str, matchers: str, by: tuple[str, ...], legend: str
) -> Panel:
    """p50/p95/p99 of one latency histogram."""
    tail = f" {legend}" if legend else ""
    queries = tuple(
        Query(q.quantile(p, hist, matchers, by, RATE), f"p{_pct(p)}{tail}") for p in QUANTILES
    )
    return Panel(
        title,
        f"{what} Percentiles p50 / p95 / p99 over $__rate_interval, interpolated inside the "
        "histogram bucket that holds them (so they are approximate; the SLO attainment panels "
        "are exact). Watch p99 against the SLO threshold; p50 shows the typical request.",
        "s",
        queries,
        width=8,
        min=0,
    )


def replica_latency_panel(title: str, hist: str, what: str, s: Scope) -> Panel:
    """One latency quantile (the ``quantile`` variable) per pod."""
    return Panel(
        f"{title} at quantile $quantile",
        f"{what} The $quantile quantile per replica over $__rate_interval. A replica far above "
        "the others is the one to look at (hot prefix, noisy batch, slower node).",
        "s",
        (Query(q.quantile("$quantile", hist, s.matchers, s.by, RATE), s.legend),),
        width=8,
        min=0,
    )


def token_throughput_panel(s: Scope) -> Panel:
    return Panel(
        "Token throughput",
        "Prompt tokens and generated (output) tokens per second, counted when requests finish. "
        "Prompt tokens include those served from the prefix cache. A flat output rate while "
        "the waiting queue grows means the engine is at capacity.",
        "suffix: tok/s",
        (
            Query(
                q.rate_sum("kvserve_prompt_tokens_total", s.matchers, s.by, RATE),
                f"prompt {s.legend}",
            ),
            Query(
                q.rate_sum("kvserve_generation_tokens_total", s.matchers, s.by, RATE),
                f"output {s.legend}",
            ),
        ),
        width=8,
        min=0,
    )


def prefix_cache_panel(s: Scope) -> Panel:
    hit = q.rate_sum("kvserve_prefix_cache_hit_tokens_total", s.matchers, s.by, RATE)
    queried = q.rate_sum("kvserve_prefix_cache_queried_tokens_total", s.matchers, s.by, RATE)
    return Panel(
        "Prefix-cache hit ratio",
        "Share of looked-up prompt tokens served from the prefix cache (no prefill needed). "
        "High with shared system prompts and prefix-aware routing; a drop after a rollout or "
        "a routing change means prefixes no longer land where they are cached.",
        "percentunit",
        (Query(q.ratio(hit, queried), s.legend),),
        width=8,
        min=0,
        max=1,
    )


def kv_usage_panel(s: Scope) -> Panel:
    metric = "kvserve_kv_cache_usage_ratio"
    queries = [Query(q.gauge_sum(metric, s.matchers, s.by, "max"), f"max {s.legend}")]
    if "pod" not in s.by:
        queries.append(Query(q.gauge_sum(metric, s.matchers, s.by, "avg"), f"mean {s.legend}"))
    return Panel(
        "KV-cache usage",
        "Share of the KV-cache blocks in use"
        + (" (the fullest replica and the mean over replicas)" if "pod" not in s.by else "")
        + ". Near 100% the scheduler cannot admit more requests and preempts running ones; "
        "the KvserveKVCacheSaturated alert fires above 95% for 10 minutes.",
        "percentunit",
        tuple(queries),
        width=8,
        min=0,
        max=1,
        threshold=0.95,
        higher_is_better=False,
    )


def running_waiting_panel(s: Scope) -> Panel:
    return Panel(
        "Running and waiting requests",
        "Requests in the engine's running batch and requests waiting to be scheduled (new or "
        "preempted). Waiting above 0 for long means the replicas are saturated: add replicas "
        "or lower the load.",
        "short",
        (
            Query(
                q.gauge_sum("kvserve_num_requests_running", s.matchers, s.by),
                f"running {s.legend}",
            ),
            Query(
                q.gauge_sum("kvserve_num_requests_waiting", s.matchers, s.by),
                f"waiting {s.legend}",
            ),
        ),
        width=8,
        min=0,
    )


def preemptions_panel(s: Scope) -> Panel:
    return Panel(
        "Preemptions",
        "Running requests preempted per second because KV blocks ran out; each is recomputed "
        "later, which costs prefill time and raises TTFT/TPOT. Any sustained rate means the "
        "KV cache is too small for the batch: fewer max_num_seqs, more memory or more replicas.",
        "reqps",
        (Query(q.rate_sum("kvserve_num_preemptions_total", s.matchers, s.by, RATE), s.legend),),
        width=8,
        min=0,
    )


def rejections_panel() -> Panel:
    return Panel(
        "Gateway rejections by reason",
        "Requests the gateway refused before they reached a replica, per second by reason: "
        "unauthenticated / forbidden (401/403: keys), rate_limited_* (429: a tenant's limits), "
        "concurrency (429: a tenant's concurrent limit), queue_full / queue_timeout (503: the "
        "gateway shed load because every replica was at its in-flight limit), "
        "no_healthy_replica (503 at once: every replica of the model was unhealthy or "
        "draining), payload_too_large and invalid (413/400). Shedding (queue_*, "
        "concurrency) above 5% of requests raises KvserveGatewayShedding. All gateways, all "
        "models (the metric has no model label).",
        "reqps",
        (
            Query(
                q.rate_sum("kvserve_gateway_rejections_total", "", ("reason",), RATE), "{{reason}}"
            ),
        ),
        stack=True,
        min=0,
    )


def gateway_status_panel(s: Scope) -> Panel:
    return Panel(
        "Gateway responses by HTTP status",
        "Requests the gateway answered after admission, per second by HTTP status (200 ok, "
        "499 the client went away, 503 shed by the admission queue, 502/500 upstream "
        "failures). Stacked.",
        "reqps",
        (
            Query(
                q.rate_sum("kvserve_gateway_requests_total", s.gateway_matchers, ("status",), RATE),
                "{{status}}",
            ),
        ),
        stack=True,
        min=0,
    )


def gateway_replicas_panel(s: Scope) -> Panel:
    return Panel(
        "Replicas by state (gateway's view)",
        "Replicas the gateway routes to (healthy), cannot reach (unhealthy: load polls or "
        "calls fail) and is draining (removed from discovery, finishing in-flight requests). "
        "Unhealthy above 0 for 10 minutes raises KvserveReplicasNotReady; no healthy replica "
        "raises KvserveNoReadyReplica.",
        "short",
        (
            Query(
                q.gauge_sum(
                    "kvserve_gateway_replicas", s.gateway_matchers, ("model", "state"), "max"
                ),
                "{{model}} {{state}}",
            ),
        ),
        width=8,
        min=0,
    )


def gateway_queue_panel() -> Panel:
    return Panel(
        "Gateway admission queue",
        "Requests waiting in the gateway for a free replica slot (every replica at "
        "max_in_flight_per_replica). A queue that stays up means the fleet is too small; when "
        "it is full, requests are shed with 503 queue_full.",
        "short",
        (Query(q.gauge_sum("kvserve_gateway_queue_length", "", ()), "queued"),),
        width=8,
        min=0,
    )


# ---- the dashboards ---------------------------------------------------------------------------

_ENGINE = 'namespace=~"$namespace", model=~"$model"'


def slo_overview() -> Dashboard:
    s = Scope(_ENGINE, ("model",), "{{model}}")
    engine = (s.matchers, s.by, s.legend)
    target = slo_defaults().attainment
    return Dashboard(
        uid="kvserve-slo-overview",
        title="kvserve / SLO overview",
        description="SLO attainment, error budget, goodput, traffic, latency and capacity per "
        "model. Generated by kvserve.observability.dashboards; edit the generator, not "
        "this JSON.",
        variables=tuple(common_variables(with_pod=False)),
        rows=(
            Row(
                "SLO summary (dashboard time range)",
                (
                    *slo_attainment_panels(s, RANGE, stat=True, target=target),
                    goodput_panel(s, RANGE, stat=True),
                    error_ratio_panel(s, RANGE, stat=True),
                ),
            ),
            Row(
                "SLOs and error budget",
                (
                    *slo_attainment_panels(s, RATE, stat=False, target=target),
                    burn_rate_panel(s),
                    goodput_panel(s),
                ),
            ),
            Row(
                "Traffic",
                (
                    finish_reason_panel(s, ("finished_reason",), "{{finished_reason}}"),
                    error_ratio_panel(s),
                    rejections_panel(),
                    gateway_status_panel(s),
                ),
            ),
            Row(
                "Latency",
                (
                    latency_panel(
                        "TTFT",
                        TTFT,
                        "Time to first token at the engine: arrival → first "
                        "output token (queueing + prefill).",
                        *engine,
                    ),
                    latency_panel(
                        "TPOT",
                        TPOT,
                        "Time per output token: (last − first token) / (O − 1), "
                        "one value per request with more than one token.",
                        *engine,
                    ),
                    latency_panel(
                        "ITL",
                        ITL,
                        "Inter-token latency: every gap between consecutive "
                        "streamed outputs (a distribution, not a per-request mean).",
                        *engine,
                    ),
                    latency_panel(
                        "E2E latency",
                        E2E,
                        "End-to-end latency at the engine: arrival → last output token.",
                        *engine,
                    ),
                    latency_panel(
                        "Queue time",
                        QUEUE_TIME,
                        "Engine queue time: arrival → first "
                        "scheduled (waiting for batch room or KV blocks).",
                        *engine,
                    ),
                    latency_panel(
                        "TTFT at the gateway",
                        GW_TTFT,
                        "TTFT as the gateway sees it: request "
                        "received → first text chunk handed to the client (adds gateway "
                        "admission, routing and the gRPC hop to the engine's TTFT).",
                        s.gateway_matchers,
                        ("model",),
                        "{{model}}",
                    ),
                ),
            ),
            Row(
                "Throughput and capacity",
                (
                    token_throughput_panel(s),
                    prefix_cache_panel(s),
                    kv_usage_panel(s),
                    running_waiting_panel(s),
                    preemptions_panel(s),
                    gateway_replicas_panel(s),
                    gateway_queue_panel(),
                    latency_panel(
                        "Gateway admission wait",
                        GW_QUEUE_WAIT,
                        "Time requests waited in the "
                        "gateway's admission queue for a replica slot (0 when a slot was free; "
                        "all models).",
                        "",
                        (),
                        "",
                    ),
                ),
            ),
        ),
    )


def replicas() -> Dashboard:
    s = Scope(_ENGINE + ', pod=~"$pod"', ("pod",), "{{pod}}")
    target = slo_defaults().attainment
    variables = common_variables(with_pod=True)
    variables.append(
        custom_variable(
            "quantile",
            "Quantile",
            REPLICA_QUANTILES,
            "0.95",
            "Latency quantile shown per replica.",
        )
    )
    finished = q.rate_sum(FINISHED, s.matchers, ("pod",), RATE)
    finished_total = q.rate_sum(FINISHED, s.matchers, (), RATE)
    busy = f"avg_over_time(kvserve_num_requests_running{{{s.matchers}}}[{RATE}])"
    decisions = "kvserve_gateway_routing_decisions_total"
    overrides = "kvserve_gateway_routing_overrides_total"
    gm = s.gateway_matchers
    return Dashboard(
        uid="kvserve-replicas",
        title="kvserve / replicas",
        description="The SLO overview per engine replica (pod), plus how evenly the gateway "
        "spreads load and how often prefix routing is overridden. Generated by "
        "kvserve.observability.dashboards; edit the generator, not this JSON.",
        variables=tuple(variables),
        rows=(
            Row(
                "SLOs per replica",
                (
                    *slo_attainment_panels(s, RATE, stat=False, target=target),
                    burn_rate_panel(s),
                    goodput_panel(s),
                ),
            ),
            Row(
                "Traffic per replica",
                (
                    Panel(
                        "Requests per replica",
                        "Finished requests per second on each replica, stacked: the top is the "
                        "model's total. Uneven bands mean uneven load (see Load balance).",
                        "reqps",
                        (Query(finished, s.legend),),
                        stack=True,
                        min=0,
                    ),
                    finish_reason_panel(
                        s, ("pod", "finished_reason"), "{{pod}} {{finished_reason}}"
                    ),
                    error_ratio_panel(s),
                ),
            ),
            Row(
                "Latency per replica",
                (
                    replica_latency_panel("TTFT", TTFT, "Time to first token at the engine.", s),
                    replica_latency_panel("TPOT", TPOT, "Time per output token.", s),
                    replica_latency_panel("ITL", ITL, "Inter-token latency.", s),
                    replica_latency_panel("E2E latency", E2E, "End-to-end latency.", s),
                    replica_latency_panel("Queue time", QUEUE_TIME, "Engine queue time.", s),
                ),
            ),
            Row(
                "Capacity per replica",
                (
                    token_throughput_panel(s),
                    prefix_cache_panel(s),
                    kv_usage_panel(s),
                    running_waiting_panel(s),
                    preemptions_panel(s),
                ),
            ),
            Row(
                "Load balance and routing",
                (
                    Panel(
                        "Request share per replica",
                        "Each replica's share of the finished requests of the selected "
                        "replicas. With N replicas an even spread is 1/N each; prefix routing "
                        "deliberately skews it towards the replicas holding hot prefixes, "
                        "within the gateway's load bound.",
                        "percentunit",
                        (
                            Query(
                                q.ratio(finished, finished_total, "ignoring (pod) group_left ()"),
                                s.legend,
                            ),
                        ),
                        min=0,
                        max=1,
                    ),
                    Panel(
                        "Load imbalance (max / mean)",
                        "The busiest replica against the mean: for finished requests per "
                        "second, and for the running batch averaged over $__rate_interval. "
                        "1 is perfectly even; the gateway's prefix routing keeps in-flight "
                        "load under load_factor (default 1.25) × the mean.",
                        "suffix:×",
                        (
                            Query(q.ratio(f"max({finished})", f"avg({finished})"), "requests"),
                            Query(q.ratio(f"max({busy})", f"avg({busy})"), "running batch"),
                        ),
                        min=0,
                    ),
                    Panel(
                        "Routing decisions per replica (gateway)",
                        "Requests the gateway sent to each replica address per second, by "
                        "routing policy (prefix, least_load, round_robin). The gateway names "
                        "replicas by their gRPC address, not by pod.",
                        "reqps",
                        (
                            Query(
                                q.rate_sum(decisions, gm, ("replica", "policy"), RATE),
                                "{{replica}} {{policy}}",
                            ),
                        ),
                        stack=True,
                        min=0,
                    ),
                    Panel(
                        "In-flight requests per replica (gateway)",
                        "Requests the gateway has sent to each replica and not yet finished "
                        "(its exact count, used for routing and admission). A replica pinned "
                        "at max_in_flight_per_replica is full; requests then queue at the "
                        "gateway.",
                        "short",
                        (
                            Query(
                                q.gauge_sum("kvserve_gateway_in_flight_requests", gm, ("replica",)),
                                "{{replica}}",
                            ),
                        ),
                        min=0,
                    ),
                    Panel(
                        "Routing overrides",
                        "Prefix-routed requests sent to another replica than their prefix's "
                        "home (the home was over the load bound or full, or a retry), and "
                        "LoRA-adapter requests sent past the replicas that serve their "
                        "adapter, per second. Overrides trade prefix-cache hits for balance: "
                        "a high rate means one prefix is hotter than one replica can take.",
                        "reqps",
                        (Query(q.rate_sum(overrides, gm, ("model",), RATE), "{{model}}"),),
                        min=0,
                    ),
                    Panel(
                        "Routing override share",
                        "Overrides as a share of all routing decisions. Near 0 with prefix "
                        "routing: requests stay on the replica that caches their prefix.",
                        "percentunit",
                        (
                            Query(
                                q.ratio(
                                    q.rate_sum(overrides, gm, ("model",), RATE),
                                    q.rate_sum(decisions, gm, ("model",), RATE),
                                ),
                                "{{model}}",
                            ),
                        ),
                        min=0,
                        max=1,
                    ),
                    gateway_replicas_panel(s),
                ),
            ),
        ),
    )


def dashboards() -> tuple[Dashboard, ...]:
    return (slo_overview(), replicas())


# ---- rendering ----------------------------------------------------------------------------------


def _pct(p: str) -> str:
    return f"{float(p) * 100:g}"


def _target(ref: str, query: Query, instant: bool) -> dict[str, Any]:
    return {
        "refId": ref,
        "datasource": DS,
        "editorMode": "code",
        "expr": query.expr,
        "legendFormat": query.legend,
        "range": not instant,
        "instant": instant,
    }


def _thresholds(threshold: float | None, higher_is_better: bool) -> dict[str, Any]:
    if threshold is None:
        return {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
    low, high = ("red", "green") if higher_is_better else ("green", "red")
    return {
        "mode": "absolute",
        "steps": [{"color": low, "value": None}, {"color": high, "value": threshold}],
    }


def render_panel(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    instant = panel.kind == "stat"
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "color": {"mode": "thresholds" if instant else "palette-classic"},
        "thresholds": _thresholds(panel.threshold, panel.higher_is_better),
    }
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    options: dict[str, Any]
    if instant:
        options = {
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "value_and_name",
        }
    else:
        defaults["custom"] = {
            "drawStyle": "line",
            "fillOpacity": 20 if panel.stack else 5,
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if panel.stack else "none"},
            "thresholdsStyle": {"mode": "dashed" if panel.threshold is not None else "off"},
        }
        options = {
            "legend": {
                "calcs": ["mean", "max", "lastNotNull"],
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    refs = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": grid,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [_target(refs[i], t, instant) for i, t in enumerate(panel.queries)],
    }


def render(d: Dashboard) -> dict[str, Any]:
    """The Grafana dashboard JSON model (schemaVersion 39, Grafana ≥ 10)."""
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for row in d.rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + line_height
                line_height = 0
            grid = {"h": panel.height, "w": panel.width, "x": x, "y": y}
            panels.append(render_panel(panel, next_id, grid))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": list(d.tags),
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "version": 1,
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "title": "kvserve dashboards",
                "tags": [TAG],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "targetBlank": False,
                "icon": "external link",
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": list(d.variables)},
        "panels": panels,
    }


def to_json(d: Dashboard) -> str:
    """Deterministic text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(render(d), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ---- reading a rendered dashboard -------------------------------------------------------


def iter_targets(model: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(row title, panel, target) for every query of a rendered dashboard."""
    row = ""
    for panel in model["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel.get("targets", []):
            yield row, panel, target


def one_line(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).replace("( ", "(").replace(" )", ")").strip()


def summary(model: dict[str, Any]) -> str:
    """A short text rendering of a dashboard: variables, rows, panels, units, queries."""
    lines = [f"{model['title']}  (uid {model['uid']})"]
    var_texts = []
    for v in model["templating"]["list"]:
        default = v.get("current", {}).get("value")
        var_texts.append(f"{v['name']}={default}" if default else v["name"])
    lines.append("  variables: " + ", ".join(var_texts))
    for panel in model["panels"]:
        if panel["type"] == "row":
            lines.append(f"  ▸ {panel['title']}")
            continue
        unit = panel["fieldConfig"]["defaults"]["unit"]
        lines.append(f"    [{panel['type']}, {unit}] {panel['title']}")
        for t in panel["targets"]:
            lines.append(f"        {t['refId']} {t['legendFormat']!r}: {one_line(t['expr'])}")
    return "\n".join(lines)


def panel_reference(ds: Sequence[Dashboard]) -> str:
    """The generated part of docs/dashboards.md: every panel, its unit, reading, queries."""
    out: list[str] = []
    for d in ds:
        model = render(d)
        out.append(f"### {d.title}\n")
        out.append(f"`dashboards/{d.filename}` (uid `{d.uid}`). {d.description}\n")
        for panel in model["panels"]:
            if panel["type"] == "row":
                out.append(f"#### Row: {panel['title']}\n")
                continue
            unit = panel["fieldConfig"]["defaults"]["unit"]
            out.append(
                f"**{panel['title']}** ({panel['type']}, unit `{unit}`). {panel['description']}\n"
            )
            out.append("```promql")
            for t in panel["targets"]:
                out.append(f"# {t['legendFormat']}")
                out.append(one_line(t["expr"]))
            out.append("```\n")
    return "\n".join(out)


# ---- checks and the command ------------------------------------------------------------------


def query_problems(ds: Sequence[Dashboard]) -> list[str]:
    """Queries that use a metric or label kvserve does not export."""
    exported = metric_names.exported_metrics()
    exprs: list[tuple[str, str]] = []
    for d in ds:
        model = render(d)
        for row, panel, target in iter_targets(model):
            exprs.append(
                (f"{d.uid} / {row} / {panel['title']} / {target['refId']}", target["expr"])
            )
        for v in model["templating"]["list"]:
            if v["type"] == "query":
                inner = re.fullmatch(r"label_values\((.*), *\w+\)", v["definition"])
                expr = inner.group(1) if inner else v["definition"]
                exprs.append((f"{d.uid} / variable {v['name']}", expr))
    return metric_names.problems(exprs, exported)


def default_root() -> Path:
    """The repository root (this file is service/kvserve/observability/dashboards.py)."""
    return Path(__file__).resolve().parents[3]


def expected_files(root: Path, ds: Sequence[Dashboard]) -> dict[Path, str]:
    """Every generated file and its content (the doc with its generated part replaced)."""
    files: dict[Path, str] = {}
    for d in ds:
        text = to_json(d)
        for folder in DASHBOARD_DIRS:
            files[root / folder / d.filename] = text
    doc = root / DOC
    current = doc.read_text(encoding="utf-8") if doc.exists() else ""
    files[doc] = splice_doc(current, panel_reference(ds))
    return files


def splice_doc(doc: str, generated: str) -> str:
    """``doc`` with the text between its markers replaced (markers appended if absent)."""
    block = f"{DOC_BEGIN}\n\n{generated.rstrip()}\n\n{DOC_END}"
    if DOC_BEGIN in doc and DOC_END in doc:
        head, rest = doc.split(DOC_BEGIN, 1)
        _, tail = rest.split(DOC_END, 1)
        return head + block + tail
    return (doc.rstrip() + "\n\n" if doc.strip() else "") + block + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.observability.dashboards",
        description="Generate the kvserve Grafana dashboards (dashboards/*.json, the Helm "
        "chart's copies and the panel reference in docs/dashboards.md).",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail if a generated file is stale or a query "
        "uses a metric kvserve does not export",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="write only the dashboard JSON files into this directory "
        "(e.g. a Grafana provisioning folder)",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="repository root (default: the checkout this module is in)",
    )
    parser.add_argument(
        "--summary", action="store_true", help="print a text summary of each dashboard and exit"
    )
    args = parser.parse_args(argv)
    ds = dashboards()
    if args.summary:
        print("\n\n".join(summary(render(d)) for d in ds))
        return 0
    bad = query_problems(ds)
    if bad:
        print("dashboards query series kvserve does not export:", file=sys.stderr)
        for line in bad:
            print(f"  - {line}", file=sys.stderr)
        return 1
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for d in ds:
            (args.out / d.filename).write_text(to_json(d), encoding="utf-8")
            print(f"wrote {args.out / d.filename}")
        return 0
    root = args.root or default_root()
    files = expected_files(root, ds)
    if not sync_files(
        files, root, check=args.check, regenerate="python -m kvserve.observability.dashboards"
    ):
        return 1
    if args.check:
        print(
            f"dashboards up to date: {len(files)} files, {sum(1 for _ in _all_targets(ds))} "
            "queries, every metric exported"
        )
    return 0


def _all_targets(ds: Sequence[Dashboard]) -> Iterable[dict[str, Any]]:
    for d in ds:
        for _, _, target in iter_targets(render(d)):
            yield target


if __name__ == "__main__":
    sys.exit(main())
