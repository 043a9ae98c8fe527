"""``kvserve bench suite --only quantization`` in smoke mode: the section runs end to end
on a tiny random checkpoint and its tables agree with each other (never checked for
speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_sections import decode_rows, run_smoke_section

pytestmark = pytest.mark.slow


def test_quantization_section_reports_every_side_and_batch(tmp_path: Path) -> None:
    section = run_smoke_section(tmp_path, "quantization")
    decode, weights = section.tables
    rows = decode_rows(decode, side="side", base="fp32", vs_base="vs fp32 (×)", batches={1, 4, 16})
    assert {"fp32", "int8 (fp32 model)"} <= {r["side"] for r in rows}
    # int8 stores the projections in a quarter of fp32's bytes: the model shrinks.
    stored = {row[0]: row[1] for row in weights.rows}
    assert stored["int8 (fp32 model)"] < stored["fp32"]
    (target,) = section.targets
    assert target.name == "int8 / fp32 decode tokens/s, batch 1" and target.measured
