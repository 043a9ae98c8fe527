"""``kvserve bench suite --only kv_dtype`` in smoke mode: the section runs end to end on a
random checkpoint and reports every side and batch (never checked for speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_sections import decode_rows, run_smoke_section

pytestmark = pytest.mark.slow


def test_kv_dtype_section_reports_every_side_and_batch(tmp_path: Path) -> None:
    section = run_smoke_section(tmp_path, "kv_dtype")
    decode, profile = section.tables
    rows = decode_rows(
        decode, side="KV cache", base="fp32", vs_base="vs fp32 cache (×)", batches={1, 16}
    )
    assert {r["KV cache"] for r in rows} == {"fp32", "fp8_e4m3", "fp8_e5m2"}
    assert len(profile.rows) == len(decode.rows)
    assert [t.name for t in section.targets] == [
        "fp8_e4m3 / fp32 cache decode tokens/s, batch 1",
        "fp8_e4m3 / fp32 cache decode tokens/s, batch 16",
    ]
