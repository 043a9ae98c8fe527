"""The gateway's ``listen.metrics_port`` (and ``--metrics-port``): ``/metrics`` on a
listener of its own, the API port without it (docs/security.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import Gateway, gateway_command, start_gateway
from tests.support.net import free_port
from tests.support.processes import start_logged
from tests.support.prometheus import metric
from tests.support.replicas import REPLICA_MODEL, Replica
from tests.support.waiting import wait_until

GATEWAY_FAMILIES = {
    "kvserve_gateway_requests",
    "kvserve_gateway_rejections",
    "kvserve_gateway_replicas",
    "kvserve_gateway_queue_length",
    "kvserve_gateway_time_to_first_token_seconds",
}
COMPLETION = {"model": REPLICA_MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_without_a_metrics_port_the_api_port_serves_metrics(gateway: Gateway) -> None:
    r = httpx.get(f"{gateway.url}/metrics")
    assert r.status_code == 200, r.text
    assert families(r.text) >= GATEWAY_FAMILIES


def test_the_metrics_port_serves_metrics_and_the_api_port_does_not(
    replicas: list[Replica],
) -> None:
    metrics_port = free_port()
    gw = start_gateway(replicas, listen={"metrics_port": metrics_port})
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    try:
        r = httpx.get(f"{metrics_url}/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert families(r.text) >= GATEWAY_FAMILIES
        # Before any request, the model's latency histograms read 0 (not "No data").
        counts = {
            sample.name: sample.value
            for family in text_string_to_metric_families(r.text)
            for sample in family.samples
            if sample.name.endswith("_seconds_count") and sample.labels.get("model")
        }
        assert counts == {
            "kvserve_gateway_time_to_first_token_seconds_count": 0,
            "kvserve_gateway_e2e_request_latency_seconds_count": 0,
        }
        # The gauges are refreshed from the replica table on each scrape, there too.
        assert metric(metrics_url, "kvserve_gateway_replicas", state="healthy") == len(replicas)
        assert httpx.get(f"{metrics_url}/v1/models").status_code == 404

        api = httpx.get(f"{gw.url}/metrics")
        assert api.status_code == 404
        assert api.json()["error"]["message"] == "Not Found: no route GET /metrics"

        with gw.client() as client:
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        # Counted when the call closes, which may follow the response by a moment.
        wait_until(lambda: metric(metrics_url, "kvserve_gateway_requests_total", status="200") == 1)
    finally:
        gw.stop()
    # The listener stopped with the app.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{metrics_url}/metrics")


def test_the_command_takes_a_metrics_port_and_refuses_the_api_port(
    tmp_path: Path, replicas: list[Replica]
) -> None:
    port = free_port()
    kvserve = gateway_command(tmp_path, f"{{port: {port}}}", replicas[0].grpc_url)

    same = subprocess.run(
        [*kvserve, "--metrics-port", str(port)], capture_output=True, text=True, timeout=120
    )
    assert same.returncode == 2, same.stderr
    assert f"listen.metrics_port: {port} is also listen.port" in same.stderr, same.stderr

    metrics_port = free_port()
    proc = start_logged(
        [*kvserve, "--metrics-port", str(metrics_port), "--log-level", "warning"], "gateway"
    )
    api_url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"

    def answers(url: str) -> bool:
        assert proc.poll() is None, proc.tail()
        try:
            return httpx.get(url).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(lambda: answers(f"{api_url}/health"), timeout=120)
        assert answers(f"{metrics_url}/metrics")
        assert families(httpx.get(f"{metrics_url}/metrics").text) >= GATEWAY_FAMILIES
        assert httpx.get(f"{api_url}/metrics").status_code == 404
        # SIGTERM with nothing open: a clean shutdown, status 0 (not death by the signal
        # uvicorn re-raises), and no task left pending.
        proc.terminate()
        assert proc.wait(timeout=60) == 0, proc.tail()
        assert "Task was destroyed" not in proc.log.read_text(), proc.tail()
    finally:
        proc.stop()
