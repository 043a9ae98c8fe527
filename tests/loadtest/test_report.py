"""The report's figures on hand-worked cohorts, and its outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvserve.loadtest.records import RequestRecord
from kvserve.loadtest.report import (
    Slo,
    WindowRule,
    format_comparison,
    format_summary,
    read_summary,
    summarize,
    summarize_recent,
    write_summary,
)
from kvserve.telemetry import definitions as d
from tests.loadtest.helpers import T0, cohort_100, failed, timeline

SLO = Slo(ttft_ms=1000, tpot_ms=100, attainment=0.9)


def test_closed_cohort_worked_check() -> None:
    # 10 s closed cohort, 100 requests, 98 succeed, 95 meet the SLO.
    s = summarize(cohort_100(), SLO)
    assert s.window.rule == "cohort"
    assert s.window.seconds == pytest.approx(10.0)
    c = s.requests
    assert (c.attempted, c.succeeded, c.failed, c.cancelled, c.good, c.judged) == (
        100, 98, 2, 0, 95, 100,
    )  # fmt: skip
    assert s.request_throughput_rps == pytest.approx(9.8)
    assert s.goodput_rps == pytest.approx(9.5)
    assert s.error_rate == pytest.approx(0.02)
    assert s.attainment == pytest.approx(0.95)
    assert s.attainment_met
    assert not summarize(cohort_100(), Slo(1000, 100, attainment=0.96)).attainment_met
    assert s.errors == {"HTTP 503: overloaded": 2}
    assert "closed cohort" in s.window.description


def test_percentiles_are_the_definitions_on_the_raw_values() -> None:
    recs = cohort_100()
    s = summarize(recs, SLO)
    ok = [r for r in recs if r.ok]
    ttft_ms = [r.ttft() * 1000 for r in ok]  # type: ignore[operator]
    for q in (50, 90, 95, 99, 99.9):
        assert s.latency_ms["ttft"].percentiles[f"p{q:g}"] == pytest.approx(
            d.percentile(ttft_ms, q)
        )
    itls = [g * 1000 for r in ok for g in r.itls()]
    assert s.latency_ms["itl"].count == len(itls)
    assert s.latency_ms["itl"].percentiles["p99"] == pytest.approx(d.percentile(itls, 99))
    assert s.latency_ms["e2e"].count == 98
    # 92 of the 98 have TPOT 25 ms, 1 has 150 ms: p50 is 25 ms.
    assert s.latency_ms["tpot"].percentiles["p50"] == pytest.approx(25.0)
    assert s.cached_prompt_share == pytest.approx(0.4)


def test_cancelled_count_as_attempted_not_judged() -> None:
    recs = [
        timeline(0.0, 0.1, 0.02, 5),
        timeline(0.5, 0.1, 0.02, 5, status="cancelled", scenario="cancel"),
        failed(1.0),
        timeline(1.5, 0.1, 0.02, 5),
    ]
    recs[-1].end_s = 2.5  # done at T0 + 4.0: a 4 s cohort
    s = summarize(recs, SLO)
    c = s.requests
    assert (c.attempted, c.succeeded, c.failed, c.cancelled, c.good, c.judged) == (
        4, 2, 1, 1, 2, 3,
    )  # fmt: skip
    assert s.window.seconds == pytest.approx(4.0)
    assert s.goodput_rps == pytest.approx(0.5)
    assert s.error_rate == pytest.approx(0.25)  # failed / attempted
    assert s.attainment == pytest.approx(2 / 3)
    assert s.scenarios["cancel"] == {
        "attempted": 1, "succeeded": 0, "failed": 0, "cancelled": 1, "good": 0,
    }  # fmt: skip


def test_empty_answer_is_judged_on_its_completion_time() -> None:
    quick = RequestRecord(send_time=T0, status="ok", end_s=0.2, output_tokens=1,
                          finish_reason="stop")  # fmt: skip
    slow = RequestRecord(send_time=T0 + 1, status="ok", end_s=1.2, output_tokens=1,
                         finish_reason="stop")  # fmt: skip
    s = summarize([quick, slow], SLO)
    assert s.requests.good == 1  # 200 ms ≤ 1 s; 1.2 s > 1 s
    assert s.latency_ms["ttft"].count == 0  # no TTFT enters the distribution


def test_steady_window_counts_by_send_time() -> None:
    # Sends at 0..9 s; warm-up 2 s, cool-down 2 s → window [2, 7] s, requests sent 2..7.
    recs = [timeline(float(i), 0.1, 0.02, 3) for i in range(10)]
    recs[7] = timeline(7.0, 1.5, 0.02, 3)  # misses TTFT; finishes after the window: counted
    s = summarize(recs, SLO, WindowRule("steady", warmup_s=2, cooldown_s=2))
    assert s.window.rule == "steady"
    assert s.window.seconds == pytest.approx(5.0)
    assert s.requests.attempted == 6
    assert s.requests.good == 5
    assert s.goodput_rps == pytest.approx(1.0)
    assert s.request_throughput_rps == pytest.approx(1.2)
    assert "steady state" in s.window.description
    with pytest.raises(ValueError, match="empty"):
        summarize(recs, SLO, WindowRule("steady", warmup_s=5, cooldown_s=5))


def test_no_slo_means_success_only_and_empty_input_is_refused() -> None:
    s = summarize(cohort_100(), Slo())
    assert s.requests.good == 98 and s.attainment == pytest.approx(0.98)
    with pytest.raises(ValueError, match="no request records"):
        summarize([], SLO)
    with pytest.raises(ValueError):
        Slo(ttft_ms=0)
    with pytest.raises(ValueError):
        Slo(attainment=1.5)


def test_recent_view_uses_requests_done_in_the_last_seconds() -> None:
    recs = [timeline(float(i), 0.1, 0.02, 3) for i in range(10)]
    now = T0 + 10.0
    s = summarize_recent(recs, SLO, now, seconds=5.0)
    assert s is not None
    assert s.requests.attempted == 5  # done at 5.14 … 9.14
    assert s.goodput_rps == pytest.approx(1.0)
    assert summarize_recent([], SLO, now) is None


def test_text_json_csv(tmp_path: Path) -> None:
    s = summarize(cohort_100(), SLO)
    text = format_summary(s)
    for needle in ("TTFT ≤ 1000 ms", "goodput             9.50 req/s", "attainment          95.0%",
                   "error rate          2.0%", "MET", "p99.9", "closed cohort"):  # fmt: skip
        assert needle in text
    paths = write_summary(s, tmp_path, {"workload": "chat"})
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["format"] == "kvserve.loadtest.summary/1"
    assert data["run"] == {"workload": "chat"}
    assert data["goodput_rps"] == pytest.approx(9.5)
    assert read_summary(paths[0]) == s
    rows = dict(csv.reader((tmp_path / "summary.csv").open()))
    assert float(rows["goodput_rps"]) == pytest.approx(9.5)
    assert float(rows["latency_ms.ttft.percentiles.p50"]) == pytest.approx(190.0)


def test_comparison() -> None:
    a = summarize(cohort_100(), SLO)
    b = summarize([r for r in cohort_100() if r.ok], SLO)
    text = format_comparison(a, b, "a.jsonl", "b.jsonl")
    assert "A = a.jsonl" in text and "goodput req/s" in text
    rows = {line[:18].strip(): line[18:].split() for line in text.splitlines()[3:]}
    assert rows["error rate %"] == ["2.00", "0.00", "-2.00"]
    assert rows["attainment %"] == ["95.00", "96.94", "+1.94"]  # 95/100 → 95/98
