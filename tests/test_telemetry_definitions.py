"""The fixed metric definitions (DESIGN.md §3), with its worked check."""

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
    assert d.queue_time(2.0, 2.5) == pytest.approx(0.5)
