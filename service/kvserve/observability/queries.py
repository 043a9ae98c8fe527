"""The PromQL formulas of the dashboards and the alert rules, each written once.

docs/architecture.md §3 fixes the definitions (TTFT, TPOT, goodput, error rate); this module fixes
how each is computed from the exported series, so a dashboard panel and the alert that
pages on the same thing cannot drift apart. Every function returns an expression string;
``matchers`` is the inside of a selector's braces (``namespace=~"$namespace"``), ``by``
the labels to keep, ``window`` a range (``5m`` or ``$__rate_interval``).

SLO attainment is read off a histogram: the share of observations at or under the SLO
threshold is ``bucket{le="<threshold>"} / count``. That is exact only when the threshold
is a bucket boundary, so thresholds are formatted exactly as the exposition writes ``le``
(``le_value``) and the generators refuse values that are not boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from prometheus_client.utils import floatToGoString

# Engine series (server-side timeline, docs/architecture.md §3).
TTFT: Final = "kvserve_time_to_first_token_seconds"
TPOT: Final = "kvserve_time_per_output_token_seconds"
ITL: Final = "kvserve_inter_token_latency_seconds"
E2E: Final = "kvserve_e2e_request_latency_seconds"
QUEUE_TIME: Final = "kvserve_request_queue_time_seconds"
FINISHED: Final = "kvserve_requests_finished_total"
SUCCEEDED_REASONS: Final = "stop|length"  # finished_reason values of a successful request


def le_value(threshold: float) -> str:
    """``threshold`` as the ``le`` label value prometheus_client writes (2 → ``2.0``)."""
    return str(floatToGoString(threshold))


def indent(expr: str, by: str = "  ") -> str:
    """Every line of ``expr`` indented (nested expressions stay readable in YAML/Grafana)."""
    return "\n".join(by + line for line in expr.splitlines())


def join(*matchers: str) -> str:
    """Matchers joined with commas, empty ones left out."""
    return ", ".join(m for m in matchers if m)


def selector(metric: str, matchers: str = "") -> str:
    return f"{metric}{{{matchers}}}" if matchers else metric


def by_clause(by: Sequence[str]) -> str:
    return f"by ({', '.join(by)}) " if by else ""


def rate_sum(metric: str, matchers: str, by: Sequence[str], window: str) -> str:
    """Per-second rate of a counter (or histogram part), summed over what ``by`` drops."""
    return f"sum {by_clause(by)}(rate({selector(metric, matchers)}[{window}]))"


def gauge_sum(metric: str, matchers: str, by: Sequence[str], agg: str = "sum") -> str:
    return f"{agg} {by_clause(by)}({selector(metric, matchers)})"


def ratio(numerator: str, denominator: str, matching: str = "") -> str:
    """``numerator / denominator`` with no result (not NaN or ±Inf) where the denominator
    is 0: a window without requests has no attainment rather than a fake 0 or 100%.
    ``matching`` is a vector-matching clause (``ignoring (pod) group_left``)."""
    op = f"/ {matching}" if matching else "/"
    return f"({numerator})\n{op}\n({denominator} > 0)"


def slo_attainment(hist: str, threshold: str, matchers: str, by: Sequence[str], window: str) -> str:
    """Share of observations at or under ``threshold`` (an ``le`` value or a variable)."""
    good = rate_sum(f"{hist}_bucket", join(matchers, f'le="{threshold}"'), by, window)
    total = rate_sum(f"{hist}_count", matchers, by, window)
    return ratio(good, total)


def slo_bad_ratio(hist: str, threshold: str, matchers: str, by: Sequence[str], window: str) -> str:
    """Share of observations over the threshold: 1 − attainment (the budget spent)."""
    return f"1 - (\n{indent(slo_attainment(hist, threshold, matchers, by, window))}\n)"


def burn_rate(bad_ratio: str, target: str) -> str:
    """Error-budget burn rate: bad share / allowed bad share (1 − target). 1 = the budget
    lasts exactly the SLO period; 14.4 = a 30-day budget is gone in ~2 days."""
    return f"({bad_ratio})\n/\n(1 - {target})"


def slo_bad_rate(hist: str, threshold: str, matchers: str, by: Sequence[str], window: str) -> str:
    """Requests per second over the threshold: count − bucket{le=threshold}."""
    total = rate_sum(f"{hist}_count", matchers, by, window)
    good = rate_sum(f"{hist}_bucket", join(matchers, f'le="{threshold}"'), by, window)
    return f"({total} - {good})"


def succeeded_rate(matchers: str, by: Sequence[str], window: str) -> str:
    """Successful requests per second (finished with stop or length)."""
    return rate_sum(FINISHED, join(matchers, f'finished_reason=~"{SUCCEEDED_REASONS}"'), by, window)


def goodput_lower_bound(
    ttft_threshold: str, tpot_threshold: str, matchers: str, by: Sequence[str], window: str
) -> str:
    """Goodput (docs/architecture.md §3: requests that succeeded AND met every SLO, per second), as
    the largest value the separate histograms guarantee.

    The TTFT and TPOT histograms are separate, so the number of requests that met both
    cannot be read from them. By the union bound, requests that succeeded and met both
    ≥ succeeded − over-TTFT − over-TPOT, clamped at 0. The bound is exact when no request
    misses both SLOs and no failed or aborted request missed one; otherwise it is low,
    never high. (``min`` of the good rates would be an upper bound, not a safe figure.)
    Requests with no output token have no TTFT and those with one token no TPOT; they
    count as meeting that SLO, as docs/architecture.md leaves the figure undefined for them.
    """
    bad_ttft = slo_bad_rate(TTFT, ttft_threshold, matchers, by, window)
    bad_tpot = slo_bad_rate(TPOT, tpot_threshold, matchers, by, window)
    return f"clamp_min(\n{succeeded_rate(matchers, by, window)}\n- {bad_ttft}\n- {bad_tpot},\n0)"


def error_ratio(matchers: str, by: Sequence[str], window: str) -> str:
    """docs/architecture.md §3 error rate: failed / attempted. Attempted = every finished request
    (stop, length, abort, error); failed = finished with ``error``. Client cancellations
    (abort) are attempted but not failed."""
    failed = rate_sum(FINISHED, join(matchers, 'finished_reason="error"'), by, window)
    return ratio(failed, rate_sum(FINISHED, matchers, by, window))


def quantile(q: str, hist: str, matchers: str, by: Sequence[str], window: str) -> str:
    """The q-quantile of a histogram over the window (linear inside the bucket)."""
    return f"histogram_quantile({q}, {rate_sum(f'{hist}_bucket', matchers, ('le', *by), window)})"
