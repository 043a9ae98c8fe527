"""``kvserve bench suite --only quantization`` in smoke mode: the section runs end to end
on a tiny random checkpoint and its tables agree with each other (never checked for
speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.suite import SuiteContext, run_sections

pytestmark = pytest.mark.slow


def test_quantization_section_reports_every_side_and_batch(tmp_path: Path) -> None:
    ctx = SuiteContext(out_dir=tmp_path / "out", work_dir=tmp_path / "work", smoke=True, rounds=1)
    (section,) = run_sections(ctx, ["quantization"])
    assert section.name == "quantization"
    decode, weights = section.tables
    headers = [c.header for c in decode.columns]
    rows = [dict(zip(headers, row, strict=True)) for row in decode.rows]
    sides = {r["side"] for r in rows}
    assert {"fp32", "int8 (fp32 model)"} <= sides
    assert {r["batch"] for r in rows} == {1, 4, 16}
    for r in rows:
        assert r["decode tok/s"] > 0
        if r["side"] == "fp32":
            assert r["vs fp32 (×)"] == 1.0
    # int8 stores the projections in a quarter of fp32's bytes: the model shrinks.
    stored = {row[0]: row[1] for row in weights.rows}
    assert stored["int8 (fp32 model)"] < stored["fp32"]
    (target,) = section.targets
    assert target.name == "int8 / fp32 decode tokens/s, batch 1" and target.measured
