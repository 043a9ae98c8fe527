"""``kvserve bench suite --only tensor_parallel`` in smoke mode: the section runs both
sides end to end and reports every batch (never checked for speed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.bench_sections import decode_rows, run_smoke_section

pytestmark = pytest.mark.slow


def test_tensor_parallel_section_reports_both_sides(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    section = run_smoke_section(tmp_path, "tensor_parallel")
    [decode] = section.tables
    rows = decode_rows(decode, side="side", base="TP=1", vs_base="vs TP=1 (×)", batches={1, 16})
    assert {r["side"] for r in rows} == {"TP=1", "TP=2"}
    assert torch.get_num_threads() == threads  # the section put the thread count back
