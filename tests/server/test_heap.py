"""The start-up heap freeze of the server and gateway processes."""

from __future__ import annotations

import gc

from kvserve.heap import freeze_startup_heap


def test_freeze_moves_the_live_heap_out_of_the_collectors_way() -> None:
    assert gc.get_freeze_count() == 0
    try:
        frozen = freeze_startup_heap()
        # At least the imported modules' objects. A frozen object that dies is dropped from
        # the count, and threads that earlier tests left behind may free some meanwhile.
        assert 1000 < gc.get_freeze_count() <= frozen
        # Objects created afterwards are still collected.
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
