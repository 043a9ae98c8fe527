"""``kvserve bench suite --only kv_dtype`` in smoke mode: the section runs end to end on a
random checkpoint and reports every side and batch (never checked for speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.suite import SuiteContext, run_sections

pytestmark = pytest.mark.slow


def test_kv_dtype_section_reports_every_side_and_batch(tmp_path: Path) -> None:
    ctx = SuiteContext(out_dir=tmp_path / "out", work_dir=tmp_path / "work", smoke=True, rounds=1)
    (section,) = run_sections(ctx, ["kv_dtype"])
    assert section.name == "kv_dtype"
    decode, profile = section.tables
    headers = [c.header for c in decode.columns]
    rows = [dict(zip(headers, row, strict=True)) for row in decode.rows]
    assert {r["KV cache"] for r in rows} == {"fp32", "fp8_e4m3", "fp8_e5m2"}
    assert {r["batch"] for r in rows} == {1, 16}
    for r in rows:
        assert r["decode tok/s"] > 0
        if r["KV cache"] == "fp32":
            assert r["vs fp32 cache (×)"] == 1.0
    assert len(profile.rows) == len(decode.rows)
    assert [t.name for t in section.targets] == [
        "fp8_e4m3 / fp32 cache decode tokens/s, batch 1",
        "fp8_e4m3 / fp32 cache decode tokens/s, batch 16",
    ]
