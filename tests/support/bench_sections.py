"""Running one ``kvserve bench suite`` section in smoke mode, and the checks every
decode-throughput section's table must pass (never checked for speed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.bench.results import Section, Table
from kvserve.bench.suite import SuiteContext, run_sections


def run_smoke_section(tmp_path: Path, name: str, rounds: int = 1) -> Section:
    """The section ``name``, end to end on tiny random checkpoints."""
    ctx = SuiteContext(
        out_dir=tmp_path / "out", work_dir=tmp_path / "work", smoke=True, rounds=rounds
    )
    (section,) = run_sections(ctx, [name])
    assert section.name == name
    return section


def decode_rows(
    decode: Table, *, side: str, base: str, vs_base: str, batches: set[int]
) -> list[dict[str, Any]]:
    """The rows of a "Decode, one step at a time" table, by header, after checking that
    every batch size is there, every point decoded, and the baseline (``base`` in column
    ``side``) compares as 1.0 to itself in column ``vs_base``."""
    headers = [c.header for c in decode.columns]
    rows = [dict(zip(headers, row, strict=True)) for row in decode.rows]
    assert {r["batch"] for r in rows} == batches
    for r in rows:
        assert r["decode tok/s"] > 0
        if r[side] == base:
            assert r[vs_base] == 1.0
    assert sum(r[side] == base for r in rows) == len(batches)
    return rows
