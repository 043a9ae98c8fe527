"""The fixed metric definitions (docs/architecture.md §3), with its worked check."""

from __future__ import annotations

import pytest

from kvserve.telemetry import definitions as d


def test_worked_check() -> None:
    # 150 output tokens, f = 190 ms, fixed 25 ms gaps → e = 3,915 ms.
    s, f = 0.0, 0.190
    times = [f + 0.025 * i for i in range(150)]
    e = times[-1]
    assert e == pytest.approx(3.915)
    assert d.ttft(s, f) == pytest.approx(0.190)
    assert d.tpot(f, e, 150) == pytest.approx(0.025)
    assert d.decode_rate(f, e, 150) == pytest.approx(40.00, abs=0.005)
    assert d.whole_request_rate(s, e, 150) == pytest.approx(38.31, abs=0.005)
    assert d.itls(times) == pytest.approx([0.025] * 149)
    assert d.e2e(s, e) == pytest.approx(3.915)


def test_undefined_cases() -> None:
    assert d.tpot(1.0, 1.0, 1) is None
    assert d.decode_rate(1.0, 1.0, 1) is None
    assert d.itls([1.0]) == []
    # A step that streamed three tokens at once (accepted drafts): one output, and no gap
    # between its tokens.
    assert d.output_times([1.0, 1.5, 1.5, 1.5, 2.0]) == [1.0, 1.5, 2.0]
    assert d.itls(d.output_times([1.0, 1.5, 1.5, 1.5, 2.0])) == pytest.approx([0.5, 0.5])
    assert d.queue_time(2.0, 2.5) == pytest.approx(0.5)


def test_closed_cohort_worked_check() -> None:
    # A 10 s closed cohort of 100 requests: 98 succeed, 95 of those meet the SLO.
    window, attempted, succeeded, good = 10.0, 100, 98, 95
    assert d.request_throughput(succeeded, window) == pytest.approx(9.8)
    assert d.goodput(good, window) == pytest.approx(9.5)
    assert d.error_rate(attempted - succeeded, attempted) == pytest.approx(0.02)
    # The two failures are judged too (a failure never meets an SLO): 95 / 100.
    assert d.slo_attainment(good, attempted) == pytest.approx(0.95)


def test_rates_need_a_window_and_requests() -> None:
    with pytest.raises(ValueError):
        d.goodput(1, 0.0)
    with pytest.raises(ValueError):
        d.request_throughput(1, -1.0)
    assert d.error_rate(0, 0) is None
    assert d.slo_attainment(0, 0) is None


def test_meets_slo() -> None:
    slo = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1}
    assert d.meets_slo(0.190, 0.025, **slo)
    assert d.meets_slo(1.0, 0.1, **slo)  # the bound itself meets it
    assert not d.meets_slo(1.001, 0.025, **slo)
    assert not d.meets_slo(0.190, 0.101, **slo)
    assert d.meets_slo(0.5, None, **slo)  # one output token: no TPOT to miss
    assert not d.meets_slo(None, None, **slo)  # no visible output: no first token
    assert d.meets_slo(5.0, 5.0)  # no SLOs given


def test_percentile_hand_worked() -> None:
    xs = [float(i) for i in range(1, 11)]  # 1 … 10; position (n − 1)·q/100 = 9q/100
    assert d.percentile(xs, 50) == pytest.approx(5.5)  # between 5 and 6
    assert d.percentile(xs, 90) == pytest.approx(9.1)  # 9 + 0.1·(10 − 9)
    assert d.percentile(xs, 99) == pytest.approx(9.91)
    assert d.percentile(xs, 99.9) == pytest.approx(9.991)
    assert d.percentile(list(reversed(xs)), 0) == 1.0
    assert d.percentile(xs, 100) == 10.0
    assert d.percentile([7.0], 99) == 7.0
    assert d.percentile([], 50) is None
    with pytest.raises(ValueError):
        d.percentile(xs, 101)


def test_max_goodput_rate() -> None:
    steps = [(1.0, 1.0), (2.0, 0.97), (4.0, 0.91), (8.0, 0.42), (16.0, None)]
    assert d.max_goodput_rate(steps, 0.9) == 4.0
    assert d.max_goodput_rate(steps, 0.95) == 2.0
    assert d.max_goodput_rate(steps, 1.01) is None
