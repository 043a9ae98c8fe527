"""The block-table tensor: rows appended, trimmed, freed and reused; it grows as needed."""

from __future__ import annotations

import torch

from kvserve.engine.block_table import BlockTable


def test_rows_follow_extend_truncate_and_remove_and_are_reused() -> None:
    t = BlockTable(num_rows=2, num_cols=2)
    t.extend("a", [7, 3])
    t.extend("b", [5])
    t.extend("a", [9, 1, 4])  # past the columns: the table grows
    assert t.block_ids("a") == [7, 3, 9, 1, 4] and t.block_ids("b") == [5]
    t.truncate("a", 2)
    assert t.block_ids("a") == [7, 3]
    t.extend("c", [8])  # a third row: the table grows again
    t.remove("b")
    t.extend("d", [6, 2])  # takes b's row back; b's stale 5 is overwritten
    assert t.block_ids("b") == [] and t.block_ids("d") == [6, 2] and t.block_ids("c") == [8]
    assert t.gather(t.rows(["d", "a"]), 3)[:, :2].tolist() == [[6, 2], [7, 3]]


def test_slots_are_block_id_times_block_size_plus_offset() -> None:
    t = BlockTable()
    t.extend("a", [3, 0, 5])
    t.extend("b", [1])
    rows = t.rows(["a", "a", "a", "b"])
    positions = torch.tensor([0, 17, 33, 2])
    assert t.slots(rows, positions, block_size=16).tolist() == [48, 1, 81, 18]
