"""The suite's roofline section at smoke sizes.

Only the section's structure and the internal consistency of its figures are checked;
timings never are (they depend on the machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench.results import Section, SuiteResult
from kvserve.bench.suite import SuiteContext, run_sections


def _rows(section: Section, title: str) -> list[dict[str, Any]]:
    (table,) = [t for t in section.tables if t.title == title]
    return [dict(zip([c.header for c in table.columns], row, strict=True)) for row in table.rows]


def _close(a: float, b: float) -> bool:
    """Equal up to the rounding of the table's cells (three significant digits)."""
    return abs(a - b) <= 0.02 * abs(b)


@pytest.fixture(scope="module")
def section(tmp_path_factory: pytest.TempPathFactory) -> tuple[Section, Path]:
    out = tmp_path_factory.mktemp("roofline")
    ctx = SuiteContext(out_dir=out, work_dir=out / "work", smoke=True)
    (section,) = run_sections(ctx, ["roofline"])
    return section, out


def test_structure(section: tuple[Section, Path]) -> None:
    s, out = section
    assert s.name == "roofline"
    assert [t.title for t in s.tables] == ["Machine", "Decode", "Prefill"]
    assert s.setup["dtype"] == "bfloat16 and float32" and s.setup["device"] == "cpu"
    (machine,) = _rows(s, "Machine")
    assert machine["streaming read (GB/s)"] == s.setup["streaming read (GB/s)"] > 0
    assert machine["fp32 matmul peak (GFLOP/s)"] > 0 and machine["bf16 matmul peak (GFLOP/s)"] > 0
    decode = _rows(s, "Decode")
    assert [(r["dtype"], r["batch"]) for r in decode] == [
        (d, b) for d in ("bfloat16", "float32") for b in (1, 8, 32)
    ]
    assert [r["dtype"] for r in _rows(s, "Prefill")] == ["bfloat16", "float32"]
    assert [(t.target, t.unit, t.op) for t in s.targets] == [(60.0, "%", ">="), (50.0, "%", ">=")]
    assert all("bf16" in t.name for t in s.targets)
    for table in s.tables:  # every numeric column but the counts carries a unit
        for col, value in zip(table.columns, table.rows[0], strict=True):
            if isinstance(value, float):
                assert col.unit, (table.title, col.name)
    if s.plots:  # matplotlib is optional
        assert s.plots == ["roofline.png"] and (out / "roofline.png").stat().st_size > 0
    # The section serialises (results.json) like every other.
    result = SuiteResult(date="d", command="c", hardware={}, smoke=True, sections=[s])
    assert json.loads(result.to_json())["sections"][0]["name"] == "roofline"


def test_decode_figures_are_consistent(section: tuple[Section, Path]) -> None:
    s, _ = section
    decode = _rows(s, "Decode")
    for r in decode:
        step, bound = r["step (ms)"], r["bandwidth bound (ms)"]
        assert step > 0 and r["steps timed"] >= 1
        assert _close(r["fraction of bound (%)"], 100 * bound / step), r
        assert _close(r["achieved (GB/s)"], r["bytes/step (MB)"] / step), r
    for dtype in ("bfloat16", "float32"):
        rows = [r for r in decode if r["dtype"] == dtype]
        # More requests read more KV (the weights are read once per step whatever the batch).
        tokens = [r["KV tokens read/step"] for r in rows]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3
        assert tokens[0] >= s.setup["decode prompt tokens"]
        mb = [r["bytes/step (MB)"] for r in rows]
        assert mb == sorted(mb)
        assert rows[0]["compute bound (ms)"] <= rows[-1]["compute bound (ms)"]
    # The same schedule in fp32 reads twice bf16's bytes (weights and KV alike).
    by = {(r["dtype"], r["batch"]): r["bytes/step (MB)"] for r in decode}
    for batch in (1, 8, 32):
        assert _close(by[("float32", batch)], 2 * by[("bfloat16", batch)])


def test_prefill_and_targets_match_the_tables(section: tuple[Section, Path]) -> None:
    s, _ = section
    prefill = _rows(s, "Prefill")
    for r in prefill:
        assert r["tokens"] == s.setup["prefill tokens"] and r["runs"] >= 1
        assert _close(r["fraction of bound (%)"], 100 * r["matmul bound (ms)"] / r["step (ms)"])
    decode_target, prefill_target = s.targets
    bf16_decode_1 = _rows(s, "Decode")[0]
    assert decode_target.measured == bf16_decode_1["fraction of bound (%)"]
    assert prefill_target.measured == prefill[0]["fraction of bound (%)"]
    # Every target not met comes with a note on why.
    if decode_target.met is False:
        assert any(n.startswith("Decode at batch 1 in bf16") for n in s.notes)
    if prefill_target.met is False:
        assert any(n.startswith("Prefill in bf16") for n in s.notes)
    assert any(n.startswith("fp32, for information only") for n in s.notes)
