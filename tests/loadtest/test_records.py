"""The JSONL record: the docs/architecture.md §3 figures from it, and its versioned format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.loadtest.records import (
    FORMAT,
    RecordWriter,
    RequestRecord,
    read_records,
    write_records,
)
from kvserve.telemetry import definitions as d
from tests.loadtest.helpers import T0, timeline


def test_worked_timeline_from_a_record() -> None:
    # 150 tokens, first at 190 ms, 25 ms gaps → E2E 3,915 ms, TPOT 25 ms.
    rec = timeline(0.0, 0.190, 0.025, 150)
    assert rec.ttft() == pytest.approx(0.190)
    assert rec.e2e() == pytest.approx(3.915)
    assert rec.tpot() == pytest.approx(0.025)
    assert rec.itls() == pytest.approx([0.025] * 149)
    assert rec.first_token_s is not None and rec.last_token_s is not None
    assert d.decode_rate(rec.first_token_s, rec.last_token_s, 150) == pytest.approx(40.0, abs=5e-3)
    assert d.whole_request_rate(0.0, rec.last_token_s, 150) == pytest.approx(38.31, abs=5e-3)


def test_output_tokens_come_from_usage_else_chunks() -> None:
    rec = timeline(0.0, 0.1, 0.01, 5)
    rec.output_tokens = 9  # usage counts tokens; a chunk may carry several
    assert rec.tpot() == pytest.approx(0.04 / 8)
    rec.output_tokens = None
    assert rec.num_output_tokens == 5
    assert rec.tpot() == pytest.approx(0.01)


def test_no_text_means_no_latency_figures() -> None:
    rec = RequestRecord(send_time=T0, status="error", end_s=0.2, error="HTTP 500: boom")
    assert rec.ttft() is None and rec.e2e() is None and rec.tpot() is None
    assert rec.itls() == []
    assert rec.end_time == pytest.approx(T0 + 0.2)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    recs = [timeline(0.0, 0.1, 0.02, 3), timeline(1.0, 0.2, 0.03, 2, status="cancelled")]
    path = tmp_path / "r.jsonl"
    write_records(path, recs)
    assert read_records(path) == recs
    first = json.loads(path.read_text().splitlines()[0])
    assert first["format"] == FORMAT == "kvserve.loadtest/1"
    w = RecordWriter(path)  # appends, one line each, flushed
    w.write(recs[0])
    assert len(path.read_text().splitlines()) == 3
    w.close()
    assert read_records(path, path)[3:] == [*recs, recs[0]]


def test_reader_checks_the_format(tmp_path: Path) -> None:
    good = json.loads(timeline(0.0, 0.1, 0.02, 3).to_json())
    newer_minor = {**good, "format": "kvserve.loadtest/1.3", "new_field": 1}
    assert RequestRecord.from_dict(newer_minor).output_tokens == 3  # unknown fields ignored
    for bad in ({**good, "format": "kvserve.loadtest/2"}, {**good, "status": "maybe"}):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
            read_records(path)
