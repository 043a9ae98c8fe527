"""The load-test report: SLO goodput and latency percentiles from request records.

Every figure comes from :mod:`kvserve.telemetry.definitions` (docs/architecture.md §3)
applied to the records of :mod:`kvserve.loadtest.records`; this module only chooses which
requests count (the window rule) and lays the numbers out (text table, JSON, CSV).

Counting, for both window rules:

* attempted = every request in the window, whatever happened to it;
* succeeded = status ``ok``; failed = status ``error`` (HTTP errors, error events, broken
  streams, requests the run's end cut off); cancelled = the client disconnected on purpose
  (the ``cancel`` workload) -- attempted, but neither a success nor a failure;
* good = succeeded and met every SLO (``definitions.meets_slo``); a successful answer with
  no visible text has no TTFT and is judged on its completion time instead;
* judged = succeeded + failed: attainment = good / judged (a failure never meets the SLO;
  a cancelled request is not judged, it never got the chance to finish);
* request throughput = succeeded / window s; goodput = good / window s;
  error rate = failed / attempted;
* latency percentiles are over the successful requests; ITL pools every gap of every one.

Window rules:

* ``cohort`` (closed cohort, the default): every request of the run; the window runs from
  the first send to the moment the last request was done, so every request was sent and
  finished inside it and nothing crosses a boundary. Locust stops sending at the run time
  and waits (``--stop-timeout``) for requests in flight, which is what makes it closed.
* ``steady`` (steady-state window): only requests *sent* between first send + warm-up and
  last send − cool-down; the window is that span. A request belongs to the window it was
  sent in, however late it finished; one cut off by the end of the run counts as failed.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvserve.loadtest.records import RequestRecord
from kvserve.telemetry import definitions

SUMMARY_FORMAT = "kvserve.loadtest.summary/1"
PERCENTILES: tuple[float, ...] = (50, 90, 95, 99, 99.9)
FIGURES = ("ttft", "tpot", "itl", "e2e")
WindowKind = Literal["cohort", "steady"]


@dataclass(frozen=True)
class Slo:
    """The SLO targets; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "attainment"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise ValueError(f"the SLO's {name} must be a number, got {value!r}")
        if not 0 < self.attainment <= 1:  # NaN fails this too
            raise ValueError(f"the attainment target must be in (0, 1], got {self.attainment}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(
                    f"the {name.removesuffix('_ms').upper()} SLO must be > 0 ms and finite, "
                    f"got {value}"
                )

    def met_by(self, rec: RequestRecord) -> bool:
        """Succeeded and met every SLO.

        A successful answer with no visible text at all (e.g. the model stopped at once) has
        no TTFT; it is judged by when it was complete (``end_s``) instead: that is when the
        user had the whole, empty, answer.
        """
        ttft = rec.ttft()
        if ttft is None and rec.ok:
            ttft = rec.end_s
        return rec.ok and definitions.meets_slo(
            ttft,
            rec.tpot(),
            ttft_slo_s=None if self.ttft_ms is None else self.ttft_ms / 1000,
            tpot_slo_s=None if self.tpot_ms is None else self.tpot_ms / 1000,
        )

    def describe(self) -> str:
        parts = []
        if self.ttft_ms is not None:
            parts.append(f"TTFT ≤ {self.ttft_ms:g} ms")
        if self.tpot_ms is not None:
            parts.append(f"TPOT ≤ {self.tpot_ms:g} ms")
        slos = " and ".join(parts) or "no latency SLO (success only)"
        return f"{slos}, attainment target {self.attainment:.0%}"


@dataclass(frozen=True)
class WindowRule:
    kind: WindowKind = "cohort"
    warmup_s: float = 0.0
    cooldown_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("cohort", "steady"):
            raise ValueError(f"the window rule must be cohort or steady, got {self.kind!r}")
        for name in ("warmup_s", "cooldown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"the window's {name} must be a number, got {value!r}")
            if not 0 <= value < math.inf:  # NaN fails this too
                raise ValueError(f"the window's {name} must be ≥ 0 s and finite, got {value}")


@dataclass
class Distribution:
    count: int
    mean: float | None
    max: float | None
    percentiles: dict[str, float | None]  # "p50" … "p99.9"


@dataclass
class Window:
    rule: WindowKind
    start: float  # Unix seconds
    end: float
    seconds: float
    description: str
    # The steady rule's warm-up and cool-down (0 for a cohort): saved in summary.json, so
    # that a report of the run's records applies the run's own rule.
    warmup_s: float = 0.0
    cooldown_s: float = 0.0


@dataclass
class Counts:
    attempted: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    good: int = 0
    judged: int = 0


@dataclass
class Summary:
    window: Window
    slo: Slo
    requests: Counts
    request_throughput_rps: float | None
    goodput_rps: float | None
    error_rate: float | None
    attainment: float | None
    attainment_met: bool
    offered_rate_rps: float | None  # attempted / span of send times
    output_tokens_per_s: float | None  # successful requests' output tokens / window
    cached_prompt_share: float | None  # cached / prompt tokens over successful requests
    latency_ms: dict[str, Distribution]
    errors: dict[str, int] = field(default_factory=dict)  # most common reasons
    scenarios: dict[str, dict[str, int]] = field(default_factory=dict)
    format: str = SUMMARY_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pkey(q: float) -> str:
    return f"p{q:g}"


def distribution_ms(values_s: Sequence[float]) -> Distribution:
    ms = [v * 1000 for v in values_s]
    return Distribution(
        count=len(ms),
        mean=sum(ms) / len(ms) if ms else None,
        max=max(ms) if ms else None,
        percentiles={pkey(q): definitions.percentile(ms, q) for q in PERCENTILES},
    )


# ---- choosing the requests -------------------------------------------------------------------
def select(
    records: Sequence[RequestRecord], rule: WindowRule
) -> tuple[list[RequestRecord], Window]:
    """The requests that count under ``rule``, and the window they count over."""
    if not records:
        raise ValueError("no request records to report on")
    first_send = min(r.send_time for r in records)
    last_send = max(r.send_time for r in records)
    if rule.kind == "cohort":
        end = max(r.end_time for r in records)
        desc = (
            f"closed cohort: all {len(records)} requests of the run, window = first send to "
            f"the last request done ({end - first_send:.3f} s); nothing crosses the window's "
            "edges. Cancelled requests count as attempted, not as failures, and are not "
            "judged for attainment; requests the run's end cut off count as failed."
        )
        return list(records), Window("cohort", first_send, end, end - first_send, desc)
    start, end = first_send + rule.warmup_s, last_send - rule.cooldown_s
    if end <= start:
        raise ValueError(
            f"the steady-state window is empty: sends span {last_send - first_send:.1f} s, "
            f"less than warm-up {rule.warmup_s:g} s + cool-down {rule.cooldown_s:g} s"
        )
    chosen = [r for r in records if start <= r.send_time <= end]
    desc = (
        f"steady state: the {len(chosen)} requests sent between first send + "
        f"{rule.warmup_s:g} s and last send − {rule.cooldown_s:g} s ({end - start:.3f} s); a "
        "request belongs to the window it was sent in, however late it finished. Cancelled "
        "requests count as attempted, not as failures, and are not judged for attainment; "
        "requests the run's end cut off count as failed."
    )
    return chosen, Window("steady", start, end, end - start, desc, rule.warmup_s, rule.cooldown_s)


# ---- the figures -------------------------------------------------------------------------
def summarize(
    records: Sequence[RequestRecord], slo: Slo, rule: WindowRule | None = None
) -> Summary:
    chosen, window = select(records, rule or WindowRule())
    return summarize_window(chosen, slo, window)


def summarize_window(
    records: Sequence[RequestRecord], slo: Slo, window: Window, itl: bool = True
) -> Summary:
    """Every figure for ``records`` over ``window`` (already chosen by a rule).

    ``itl=False`` leaves the ITL distribution empty: the live view skips pooling every gap
    of every request, which would stall Locust's event loop on long runs.
    """
    ok = [r for r in records if r.ok]
    c = Counts(
        attempted=len(records),
        succeeded=len(ok),
        failed=sum(r.status == "error" for r in records),
        cancelled=sum(r.status == "cancelled" for r in records),
        good=sum(slo.met_by(r) for r in ok),
    )
    c.judged = c.succeeded + c.failed
    has_window = window.seconds > 0
    attainment = definitions.slo_attainment(c.good, c.judged)
    sends = [r.send_time for r in records]
    span = max(sends) - min(sends) if len(sends) > 1 else 0.0
    out_tokens = sum(r.num_output_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    lat: dict[str, list[float]] = {name: [] for name in FIGURES}
    for r in ok:
        for name, value in (("ttft", r.ttft()), ("tpot", r.tpot()), ("e2e", r.e2e())):
            if value is not None:
                lat[name].append(value)
        if itl:
            lat["itl"].extend(r.itls())
    errors = Counter(_error_kind(r.error) for r in records if r.status == "error")
    scenarios: dict[str, dict[str, int]] = {}
    for r in records:
        row = scenarios.setdefault(
            r.scenario, {"attempted": 0, "succeeded": 0, "failed": 0, "cancelled": 0, "good": 0}
        )
        row["attempted"] += 1
        row["succeeded" if r.ok else "failed" if r.status == "error" else "cancelled"] += 1
        row["good"] += slo.met_by(r)
    return Summary(
        window=window,
        slo=slo,
        requests=c,
        request_throughput_rps=(
            definitions.request_throughput(c.succeeded, window.seconds) if has_window else None
        ),
        goodput_rps=definitions.goodput(c.good, window.seconds) if has_window else None,
        error_rate=definitions.error_rate(c.failed, c.attempted),
        attainment=attainment,
        attainment_met=attainment is not None and attainment >= slo.attainment,
        offered_rate_rps=(len(sends) - 1) / span if span > 0 else None,
        output_tokens_per_s=out_tokens / window.seconds if has_window else None,
        cached_prompt_share=cached / prompt if prompt else None,
        latency_ms={name: distribution_ms(values) for name, values in lat.items()},
        errors=dict(errors.most_common(5)),
        scenarios=dict(sorted(scenarios.items())),
    )


def summarize_recent(
    records: Sequence[RequestRecord], slo: Slo, now: float, seconds: float = 30.0
) -> Summary | None:
    """The live view: requests *done* in the last ``seconds`` (or since the first send)."""
    if not records:
        return None
    start = max(now - seconds, min(r.send_time for r in records))
    recent = [r for r in records if start <= r.end_time <= now]
    if not recent or now <= start:
        return None
    desc = f"requests done in the last {now - start:.0f} s"
    window = Window("steady", start, now, now - start, desc)
    return summarize_window(recent, slo, window, itl=False)


def _error_kind(error: str | None) -> str:
    """Errors grouped by their first line, without request-specific numbers at the end."""
    return (error or "unknown").splitlines()[0][:120]


def summary_from_dict(data: dict[str, Any]) -> Summary:
    """A summary read back from its JSON (to compare runs)."""
    if data.get("format") != SUMMARY_FORMAT:
        raise ValueError(f"not a {SUMMARY_FORMAT} summary (format {data.get('format')!r})")
    return Summary(
        **{
            **data,
            "window": Window(**data["window"]),
            "slo": Slo(**data["slo"]),
            "requests": Counts(**data["requests"]),
            "latency_ms": {k: Distribution(**v) for k, v in data["latency_ms"].items()},
        }
    )


# ---- output ---------------------------------------------------------------------------------
def _num(value: float | None, fmt: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, fmt)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def format_summary(s: Summary) -> str:
    """The report as text: the verdict, the rates, the latency table, the rule used."""
    c = s.requests
    verdict = "MET" if s.attainment_met else "NOT MET"
    lines = [
        f"SLO: {s.slo.describe()}",
        f"window: {s.window.description}",
        "",
        f"requests   attempted {c.attempted}  succeeded {c.succeeded}  failed {c.failed}  "
        f"cancelled {c.cancelled}  good {c.good}",
        f"offered rate        {_num(s.offered_rate_rps)} req/s (sends)",
        f"request throughput  {_num(s.request_throughput_rps)} req/s",
        f"goodput             {_num(s.goodput_rps)} req/s",
        f"error rate          {_pct(s.error_rate)}",
        f"attainment          {_pct(s.attainment)} (target {s.slo.attainment:.0%}: {verdict})",
        f"output tokens       {_num(s.output_tokens_per_s, '.1f')} tok/s"
        + (
            f"   cached prompt share {_pct(s.cached_prompt_share)}"
            if s.cached_prompt_share is not None
            else ""
        ),
        "",
        f"{'ms':<6}{'count':>8}{'mean':>10}"
        + "".join(f"{pkey(q):>10}" for q in PERCENTILES)
        + f"{'max':>10}",
    ]
    for name in FIGURES:
        d = s.latency_ms[name]
        lines.append(
            f"{name.upper():<6}{d.count:>8}{_num(d.mean):>10}"
            + "".join(f"{_num(d.percentiles[pkey(q)]):>10}" for q in PERCENTILES)
            + f"{_num(d.max):>10}"
        )
    if s.errors:
        lines += ["", "errors:"] + [f"  {n:>6} × {msg}" for msg, n in s.errors.items()]
    return "\n".join(lines)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (``latency_ms.ttft.percentiles.p99``), for CSV."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def write_summary(s: Summary, out_dir: Path, extra: dict[str, Any] | None = None) -> list[Path]:
    """``summary.json`` (with ``extra``: how the run was made) and ``summary.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**s.to_dict(), "run": extra or {}}
    js = out_dir / "summary.json"
    js.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    cs = out_dir / "summary.csv"
    with cs.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["metric", "value"])
        for key, value in flatten(s.to_dict()).items():
            w.writerow([key, "" if value is None else value])
    return [js, cs]


def read_summary(path: Path) -> Summary:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("run", None)
    return summary_from_dict(data)


def format_comparison(a: Summary, b: Summary, a_name: str, b_name: str) -> str:
    """Two runs' key figures side by side (same SLO and window rule), with B − A."""

    def rows(s: Summary) -> list[float | None]:
        lat = [s.latency_ms[fig].percentiles[pkey(q)] for fig in FIGURES for q in (50, 99)]
        att = None if s.attainment is None else s.attainment * 100
        err = None if s.error_rate is None else s.error_rate * 100
        return [s.request_throughput_rps, s.goodput_rps, att, err, *lat]

    names = ["throughput req/s", "goodput req/s", "attainment %", "error rate %"] + [
        f"{fig.upper()} p{q} ms" for fig in FIGURES for q in (50, 99)
    ]
    lines = [f"A = {a_name}", f"B = {b_name}", f"{'':<18}{'A':>12}{'B':>12}{'B − A':>12}"]
    for name, x, y in zip(names, rows(a), rows(b), strict=True):
        delta = None if x is None or y is None else y - x
        lines.append(f"{name:<18}{_num(x):>12}{_num(y):>12}{_num(delta, '+.2f'):>12}")
    return "\n".join(lines)
