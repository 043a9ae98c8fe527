"""``kvserve bench serve`` end to end with the smallest settings (figures, not targets)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench import serving


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
        "ttft_server_engine_p50_ms",
    ):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])
    assert res["ttft_requests_server"] > 0 and res["ttft_requests_engine"] > 0
    for key in ("ttft_overhead_ms", "ttft_overhead_engine_thread_ms", "ttft_overhead_http_ms"):
        assert isinstance(res[key], float), key  # differences: either sign
