"""Every request's KV block ids as the rows of one integer tensor, kept in step with the
KV cache manager's block lists.

The model runner reads a step's block tables and slot mapping with a few indexing ops on
this tensor. Keeping it in step costs Python work in proportion to the blocks that
change (a request gains one every ``block_size`` tokens), where rebuilding the tables
from lists each step would cost work in proportion to every token held
(docs/engine.md, "The step").

Invariant: for every request holding blocks, ``table[row(rid), :length(rid)]`` are the
ids of its blocks in order. The rest of a row is stale: ids of blocks it held before, or
0 — always a valid block index, so a padded gather never leaves the cache; attention
masks keep whatever they hold out of every result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockTable:
    def __init__(self, num_rows: int = 16, num_cols: int = 64) -> None:
        self.table = torch.zeros(num_rows, num_cols, dtype=torch.long)
        self._row: dict[str, int] = {}
        self._length: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def extend(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Append blocks to the request's row (giving it a row on its first blocks)."""
        if not block_ids:
            return
        row = self._row.get(request_id)
        if row is None:
            row = self._row[request_id] = self._take_row()
            self._length[request_id] = 0
        start = self._length[request_id]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.long)
        self._length[request_id] = end

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """Keep only the request's first ``num_blocks`` blocks."""
        if request_id in self._length:
            self._length[request_id] = min(self._length[request_id], num_blocks)

    def remove(self, request_id: str) -> None:
        """Forget the request's row (its blocks were released)."""
        row = self._row.pop(request_id, None)
        if row is not None:
            del self._length[request_id]
            self._free_rows.append(row)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids as held here (for checks; the runner reads tensors)."""
        row = self._row.get(request_id)
        return [] if row is None else self.table[row, : self._length[request_id]].tolist()

    def rows(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The row index of each request, as a tensor."""
        return torch.tensor([self._row[rid] for rid in request_ids], dtype=torch.long)

    def gather(self, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[len(rows), num_blocks]: the first ``num_blocks`` entries of each row (``rows``
        from ``rows()``; past a request's own blocks: stale entries, see the module's
        invariant). ``extend`` made the table wide enough for every block held."""
        return self.table[rows, :num_blocks]

    def slots(self, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """The cache slot of each (row, position): its block's id × block_size + offset."""
        return self.table[rows, positions // block_size] * block_size + positions % block_size

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, num_rows: int, num_cols: int) -> None:
        grown = torch.zeros(num_rows, num_cols, dtype=torch.long)
        grown[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = grown
