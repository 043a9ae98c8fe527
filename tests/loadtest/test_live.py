"""The live SLO rows, the custom Locust events, and the web UI tab (Flask, no Locust run)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvserve.loadtest import webui
from kvserve.loadtest.options import Settings, add_options
from kvserve.loadtest.run import LoadTestRun, calibrate, discover, timing_events
from tests.loadtest.helpers import T0, failed, timeline


def settings(tmp_path: Path, *argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    add_options(parser.add_argument)
    return Settings.from_namespace(parser.parse_args(["--out-dir", str(tmp_path), *argv]))


def test_timing_events_in_float_ms() -> None:
    rec = timeline(0.0, 0.1905, 0.0250015, 3)
    events = timing_events(rec)
    assert [(t, n) for t, n, _, _ in events] == [
        ("TTFT", "chat"), ("TPOT", "chat"), ("ITL", "chat"), ("ITL", "chat"), ("E2E", "chat"),
    ]  # fmt: skip
    ms = [m for _, _, m, _ in events]
    assert ms == pytest.approx([190.5, 25.0015, 25.002, 25.001, 240.503], abs=1e-6)
    assert events[-1][3] == 3  # E2E carries the output tokens as its "length"
    assert timing_events(failed(0.0)) == []


class FakeResp:
    def __init__(self, status: int, data: object) -> None:
        self.status_code, self.data, self.text = status, data, str(data)

    def json(self) -> object:
        return self.data


def test_discover_and_start(tmp_path: Path) -> None:
    seen = {}

    def get(url: str, headers: dict[str, str], timeout: float) -> FakeResp:
        seen.update(url=url, headers=headers)
        return FakeResp(200, {"data": [{"id": "tiny", "max_model_len": 512}]})

    info = discover("http://h:1/", {"authorization": "Bearer k"}, get)
    assert (info.model, info.context_tokens) == ("tiny", 512)
    assert seen["url"] == "http://h:1/v1/models"

    def post(
        url: str, json: dict[str, object], headers: dict[str, str], timeout: float
    ) -> FakeResp:
        seen.update(post=url, body=json)
        return FakeResp(200, {"usage": {"prompt_tokens": 400}})

    run = LoadTestRun(settings(tmp_path, "--workload", "rag"))
    run.start("http://h:1", get, post)
    assert run.model == "tiny" and run.workload is not None
    assert run.workload.context_tokens == 512
    words = len(seen["body"]["prompt"].split())  # type: ignore[index]
    assert run.workload.tokens_per_word == pytest.approx(round(1.1 * 400 / words, 3))
    assert seen["post"] == "http://h:1/v1/completions" and seen["body"]["max_tokens"] == 1  # type: ignore[index]
    assert calibrate("http://h:1", {}, "tiny", lambda *a, **k: FakeResp(500, {})) is None
    with pytest.raises(RuntimeError, match=r"HTTP 401.*--api-key"):
        discover("http://h:1", {}, lambda *a, **k: FakeResp(401, {}))
    with pytest.raises(RuntimeError, match="no model"):
        discover("http://h:1", {}, lambda *a, **k: FakeResp(200, {"data": []}))


def test_finish_writes_everything_and_sets_the_exit_code(tmp_path: Path) -> None:
    run = LoadTestRun(settings(tmp_path, "--slo-ttft-ms", "150", "--model", "m",
                               "--context-tokens", "1024", "--tokens-per-word", "1.5"))  # fmt: skip
    run.start("http://unused")
    for i in range(4):
        run.add(timeline(float(i), 0.1 if i else 0.2, 0.02, 4))
    summary = run.finish()
    assert summary is not None and summary.attainment == pytest.approx(0.75)
    assert run.exit_code == 1  # 75% < 90%
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latency_cdf.png", "latency_over_time.png", "records.jsonl",
                     "summary.csv", "summary.json"]  # fmt: skip
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 4


def test_live_rows_and_web_ui_tab(tmp_path: Path) -> None:
    from flask import Flask, jsonify

    run = LoadTestRun(settings(tmp_path, "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"))
    for i in range(10):
        run.records.append(timeline(float(i), 0.2, 0.02, 4))
    rows = {r["metric"]: r for r in run.live_rows(now=T0 + 10.0)}
    assert rows["goodput (req/s)"]["recent"] == "1.00"  # 5 done in the last 5 … 30 s
    assert rows["attainment"]["run"] == "100.0%" and rows["attainment"]["target"] == "≥ 90%"
    assert rows["TTFT p50 (ms)"]["run"] == "200.0" and rows["TTFT p50 (ms)"]["target"] == "≤ 1000"

    app = Flask("test")

    @app.route("/stats/requests")
    def stats():  # type: ignore[no-untyped-def]
        return jsonify({"stats": []})

    ui = SimpleNamespace(app=app, template_args={})
    webui.install(ui, run)
    assert ui.template_args["extendedTabs"] == [{"title": "SLO", "key": "kvserve-slo"}]
    client = app.test_client()
    data = client.get("/stats/requests").get_json()
    assert data["stats"] == []
    (extended,) = data["extendedStats"]
    assert extended["key"] == "kvserve-slo" and extended["data"][0]["metric"] == "requests done"
    assert client.get("/kvserve/slo").get_json()["rows"][0]["metric"] == "requests done"
    assert client.get("/kvserve/slo.csv").data.decode().startswith("metric,recent,run,target")
