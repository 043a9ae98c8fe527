"""``kvserve bench suite --only speculative`` in smoke mode: the section runs end to end on
the demo model and reports every side at both concurrencies (never checked for speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_sections import run_smoke_section

pytestmark = pytest.mark.slow


def test_speculative_section_reports_both_methods_at_both_concurrencies(tmp_path: Path) -> None:
    section = run_smoke_section(tmp_path, "speculative")
    (runs,) = section.tables
    headers = [c.header for c in runs.columns]
    rows = [dict(zip(headers, row, strict=True)) for row in runs.rows]
    sides = {(r["concurrency"], r["side"]) for r in rows}
    assert sides == {
        (1, "off"),
        (1, "ngram"),
        (1, "suffix"),
        (16, "off"),
        (16, "ngram"),
        (16, "suffix"),
        (16, "ngram, no threshold"),
    }
    assert all(r["output tok/s"] > 0 for r in rows)
    assert all(r["vs off"] == 1.0 for r in rows if r["side"] == "off")
    assert [t.name for t in section.targets] == [
        "ngram / off, concurrency 1",
        "ngram / off, concurrency 16",
        "suffix / off, concurrency 1",
        "suffix / off, concurrency 16",
    ]
