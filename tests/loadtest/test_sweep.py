"""The sweep's logic with a fake Locust: steps, early stop, max goodput rate, outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvserve.loadtest.records import write_records
from kvserve.loadtest.report import Slo, WindowRule
from kvserve.loadtest.sweep import format_table, parse_rates, sweep, write_outputs
from tests.loadtest.helpers import timeline

SLO = Slo(ttft_ms=1000, tpot_ms=100, attainment=0.9)


def fake_locust(calls: list[float]):  # type: ignore[no-untyped-def]
    """A 'server' that keeps up to 3 req/s: above it, TTFT grows past the SLO."""

    def run(rate: float, step_dir: Path) -> int:
        calls.append(rate)
        n = int(rate * 10)
        recs = []
        for i in range(n):
            slow = rate > 3 and i % 2 == 0  # half the requests queue past 1 s
            recs.append(timeline(i / rate, 1.5 if slow else 0.2, 0.02, 5))
        step_dir.mkdir(parents=True)
        write_records(step_dir / "records.jsonl", recs)
        return 0 if rate <= 3 else 1

    return run


def test_parse_rates() -> None:
    assert parse_rates("4,1,2,0.5") == [0.5, 1.0, 2.0, 4.0]
    assert parse_rates("1:3:0.5") == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert parse_rates("0:2:1, 5") == [1.0, 2.0, 5.0]
    for bad in ("", "0", "-1", "1:2", "1:2:0", "inf", "nan", "1:inf:1", "1:1e9:1", "1:1001:1"):
        with pytest.raises(ValueError):  # 1:1e9:1 was built whole: 2.4 GB before a step
            parse_rates(bad)


def test_sweep_finds_the_max_goodput_rate_and_stops(tmp_path: Path) -> None:
    calls: list[float] = []
    lines: list[str] = []
    result = sweep(
        [1, 2, 3, 4, 5, 6], fake_locust(calls), tmp_path, SLO, WindowRule(), progress=lines.append
    )
    assert calls == [1, 2, 3, 4]  # stopped after the first step below the target
    assert result.max_goodput_rate == 3
    assert [s.met for s in result.steps] == [True, True, True, False]
    assert result.steps[3].summary.attainment == pytest.approx(0.5)
    assert any("stopping" in line for line in lines)
    table = format_table(result)
    assert "max goodput rate: 3 req/s" in table and "MISSED" in table

    calls.clear()
    everything = sweep([1, 4, 6], fake_locust(calls), tmp_path / "all", SLO, WindowRule(), 0)
    assert calls == [1, 4, 6] and everything.max_goodput_rate == 1

    paths = write_outputs(result, tmp_path / "out")
    assert [p.name for p in paths] == ["sweep.json", "sweep.csv", "sweep.png"]
    data = json.loads(paths[0].read_text())
    assert data["max_goodput_rate_rps"] == 3
    assert [s["rate_rps"] for s in data["steps"]] == [1, 2, 3, 4]
    rows = list(csv.DictReader(paths[1].open()))
    assert [float(r["rate_rps"]) for r in rows] == [1, 2, 3, 4]
    assert float(rows[3]["attainment"]) == pytest.approx(0.5)
    assert [r["met"] for r in rows] == ["True", "True", "True", "False"]
    assert paths[2].stat().st_size > 1000


def test_no_step_meets_the_target(tmp_path: Path) -> None:
    result = sweep([4, 5], fake_locust([]), tmp_path, SLO, WindowRule(), 0)
    assert result.max_goodput_rate is None
    assert "none of the steps met the target" in format_table(result)


def test_a_broken_step_stops_the_sweep(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exit code 2"):
        sweep([1], lambda rate, d: 2, tmp_path, SLO, WindowRule())
