"""``kvserve bench serve`` end to end with the smallest settings (figures, not targets):
a real ``kvserve serve`` process, its request log, and the offline engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.bench import serving
from kvserve.bench.launcher import read_request_log
from kvserve.bench.sse_client import ClientRecord


@pytest.mark.slow
def test_bench_serve_json_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model-size=tiny",
            "--num-prompts=8",
            "--concurrency=4",
            "--prompt-len",
            "8",
            "48",
            "--output-len",
            "4",
            "24",
            "--ttft-requests=4",
            "--json",
        ]
    )
    assert serving.run(args) == 0
    res = json.loads(capsys.readouterr().out)

    assert res["num_prompts"] == 8 and res["concurrency"] == 4
    assert res["serving_requests_completed"] == 8
    assert res["serving_requests_failed"] == 0
    assert res["serving_output_tokens"] == res["output_tokens"] > 0
    for key in (
        "offline_seconds",
        "serving_seconds",
        "offline_output_tok_s",
        "serving_output_tok_s",
        "throughput_ratio",
        "serving_ttft_p50_ms",
        "serving_ttft_p99_ms",
        "serving_e2e_p50_ms",
        "ttft_server_p50_ms",
        "ttft_engine_p50_ms",
        "ttft_compute_p50_ms",
    ):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])
    assert len(res["throughput_ratio_per_round"]) == res["rounds"]
    # Every lone server request was found in the server's request log (same clock).
    assert res["ttft_pairs"] == 4 and res["ttft_decomposed_requests"] == 4
    # The parts are each request's instants in order; their sum is the client's TTFT.
    assert res["ttft_to_engine_p50_ms"] >= 0
    for key in ("ttft_overhead_ms", "ttft_http_in_p50_ms", "ttft_http_out_p50_ms"):
        assert isinstance(res[key], float), key  # differences of clocks: either sign
    # server_added is the median of the pairs' (client TTFT − compute), not the difference
    # of the two medians: with 4 pairs on a busy machine those differ by more than any
    # fixed tolerance; the per-pair parts are checked by the test below.
    assert isinstance(res["ttft_server_added_p50_ms"], float)
    # The offline engine's own time outside compute: scheduling and handing the token over.
    assert isinstance(res["ttft_engine_own_p50_ms"], float) and res["ttft_engine_own_p50_ms"] > 0
    assert isinstance(res["ttft_server_net_p50_ms"], float)


@pytest.mark.parametrize(("visible_at", "token"), [(0, 1.4), (2, 1.45)])
def test_decomposition_splits_the_client_ttft_into_the_servers_instants(
    visible_at: int, token: float
) -> None:
    rec = ClientRecord(send=1.0, first=1.5, chunk_times=[1.5])
    pair = serving.TtftPair(offline=0.3, offline_compute=0.2, server=0.5)
    log = {
        "r1": {
            "request_id": "r1",
            "arrival_time": 1.1,
            "first_scheduled_time": 1.2,
            "first_token_time": 1.4,
            "last_token_time": 1.45,
        }
    }
    serving.decompose([pair], [("r1", rec)], visible_at, log)
    assert pair.http_in == pytest.approx(0.1)
    assert pair.to_engine == pytest.approx(0.1)
    assert pair.compute == pytest.approx(token - 1.2)
    assert pair.http_out == pytest.approx(1.5 - token)
    assert pair.http_in + pair.to_engine + pair.compute + pair.http_out == pytest.approx(0.5)


def test_request_log_lines_are_found_among_other_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "INFO:     Started server process [1]\n"
        '2026-11-30 01:02:03,456 INFO kvserve.requests {"request_id":"a","arrival_time":1.0}\n'
        "2026-11-30 01:02:03,457 INFO uvicorn.access 127.0.0.1 - POST /v1/completions 200\n"
        "2026-11-30 01:02:03,458 INFO kvserve.requests {not json\n"
    )
    assert read_request_log(log) == {"a": {"request_id": "a", "arrival_time": 1.0}}
