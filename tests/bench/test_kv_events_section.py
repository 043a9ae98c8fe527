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
    # Every batch the engine published once the subscriber process had joined reached it,
    # none dropped.
    pattern = (
        r"published (\d+), dropped (\d+), received by the subscriber (\d+), "
        r"the first of them number (\d+)"
    )
    found = re.search(pattern, section.notes[0])
    assert found is not None
    published, dropped, received, first = map(int, found.groups())
    assert dropped == 0 and 0 < received == published - first
    assert section.setup["rounds per mode"] == rounds
