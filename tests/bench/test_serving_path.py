"""The suite's serving-path section at smoke sizes: a real replica and gateway process.

Only the section's structure and the consistency of its figures are checked; timings never
are (they depend on the machine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.bench.results import Section, Table
from kvserve.bench.suite import SuiteContext, run_sections


def _children() -> list[int]:
    """This process's live (not zombie) child processes."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _table(section: Section, title: str) -> list[dict[str, Any]]:
    (table,) = [t for t in section.tables if t.title.startswith(title)]
    assert isinstance(table, Table)
    return [dict(zip([c.header for c in table.columns], row, strict=True)) for row in table.rows]


@pytest.mark.slow
def test_serving_path_section(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    before = set(_children())
    ctx = SuiteContext(out_dir=tmp_path, work_dir=tmp_path / "work", smoke=True)
    (section,) = run_sections(ctx, ["serving_path"])

    assert set(_children()) <= before  # the replica and the gateway are stopped
    assert torch.get_num_threads() == threads  # the section's thread count is undone
    assert section.name == "serving_path" and section.targets == []
    setup = section.setup
    assert setup["concurrency"] >= 1 and setup["prefix_caching"] == "off"
    assert setup["rounds"] == ctx.rounds
    for table in section.tables:  # every numeric column carries a unit
        for col, value in zip(table.columns, table.rows[0], strict=True):
            if isinstance(value, float):
                assert col.unit, (table.title, col.name)

    rows = _table(section, "Throughput and latency")
    assert [r["path"] for r in rows] == ["offline engine", "gateway + server"]
    for r in rows:
        # ignore_eos: every request succeeds and produces exactly the tokens it asked for.
        assert r["requests ok"] == setup["prompts"] and r["requests failed"] == 0
        assert r["output tokens (tokens)"] == setup["output_tokens"]
        wall = r["wall (s)"]
        assert isinstance(wall, float) and wall > 0
        assert _rate_of(r["output (tok/s)"], setup["output_tokens"], wall, rate_digits=1)
        assert _rate_of(r["requests (req/s)"], setup["prompts"], wall, rate_digits=3)
        for p50_col, p99_col in (
            ("TTFT p50, steady (ms)", "TTFT p99, steady (ms)"),
            ("TPOT p50 (ms)", "TPOT p99 (ms)"),
        ):
            p50, p99 = r[p50_col], r[p99_col]
            assert isinstance(p50, float) and isinstance(p99, float)
            assert 0 < p50 <= p99

    (cmp,) = _table(section, "Serving path vs offline")
    off, srv = rows
    ratio = srv["output (tok/s)"] / off["output (tok/s)"]
    assert cmp["output throughput, serving / offline (×)"] == pytest.approx(ratio, rel=0.01)
    assert cmp["TTFT p50, serving − offline (ms)"] == pytest.approx(
        srv["TTFT p50, steady (ms)"] - off["TTFT p50, steady (ms)"],
        abs=0.02,
    )

    rounds = _table(section, "Every round")
    assert [r["path"] for r in rounds] == ["offline", "serving"] * ctx.rounds
    for side, row in (("offline", off), ("serving", srv)):
        best = max(r["output (tok/s)"] for r in rounds if r["path"] == side)
        assert row["output (tok/s)"] == best

    cpu = _table(section, "CPU time")
    assert [r["path"] for r in cpu] == ["offline engine", "gateway + server"]
    for r in cpu:
        for name, value in r.items():
            if name != "path":
                assert isinstance(value, float) and value >= 0
        ours = sum(
            r[f"{p} (CPU s)"] for p in ("this process", "replica process", "gateway process")
        )
        per_token = ours / setup["output_tokens"] * 1000
        # The table's CPU seconds are rounded to 0.01 s: up to 0.015 s off in the sum.
        slack = 0.015 / setup["output_tokens"] * 1000 + 0.001
        assert r["CPU per output token (ms)"] == pytest.approx(per_token, abs=slack)
    assert cpu[1]["replica process (CPU s)"] > 0  # the replica did the serving side's work
    cpu_ratio = cpu[1]["CPU per output token (ms)"] / cpu[0]["CPU per output token (ms)"]
    assert cmp["CPU per output token, serving / offline (×)"] == pytest.approx(cpu_ratio, rel=0.05)


def _rate_of(rate: float, count: int, wall: float, rate_digits: int) -> bool:
    """Whether ``rate`` is ``count`` over the unrounded wall time, given the table's
    rounding (wall to 3 decimals, the rate to ``rate_digits``). Smoke-size walls are a
    few hundredths of a second, where the wall's rounding alone moves the rate by ~2%."""
    half_wall, half_rate = 0.0005, 0.5 * 10.0**-rate_digits
    lo, hi = count / (wall + half_wall), count / max(wall - half_wall, 1e-9)
    return lo - half_rate <= rate <= hi + half_rate
