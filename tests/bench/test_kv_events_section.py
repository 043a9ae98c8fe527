"""``kvserve bench suite --only kv_events`` in smoke mode: the section runs end to end
with a real subscriber process and reports both modes and the events' own share (never
checked for speed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.bench_sections import run_smoke_section

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("rounds", [1, 2])
def test_kv_events_section_reports_both_modes_and_every_batch_arrives(
    tmp_path: Path, rounds: int
) -> None:
    section = run_smoke_section(tmp_path, "kv_events", rounds=rounds)
    assert section.error is None
    per_round, own = section.tables
    rows = {row[0]: row[1:] for row in per_round.rows}
    assert set(rows) == {
        "engine thread's CPU in step()",
        "process CPU, all threads",
        "wall time in step()",
    }
    for off_ms, on_ms, _total, _median, q1, q3 in rows.values():
        assert off_ms > 0 and on_ms > 0
        assert (q1 is None) == (q3 is None) == (rounds == 1)  # quartiles need two pairs
    assert [row[0] for row in own.rows] == [
        "engine thread in the events' calls (record, encode, queue)",
        "publisher thread",
    ]
    assert own.rows[0][1] > 0  # the engine thread recorded events
    (target,) = section.targets
    assert target.measured is not None and 0 < target.measured < 100
    # Every batch the engine published reached the subscriber process, none dropped.
    found = re.search(r"published (\d+), dropped (\d+), received by the subscriber (\d+)",
                      section.notes[0])  # fmt: skip
    assert found is not None
    published, dropped, received = map(int, found.groups())
    assert published > 0 and dropped == 0 and received == published
    assert section.setup["rounds per mode"] == rounds
