"""``kvserve serve --metrics-port``: ``/metrics`` on a listener of its own, the API port
without it, through a drain to the process's exit (docs/security.md); flags that cannot work (ports,
names, a --model that is no directory) fail before the model loads."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cli_server import sigterm_mid_stream, start_cli_server
from tests.support.engine_server import RunningServer
from tests.support.net import free_port
from tests.support.prometheus import metric

ENGINE_FAMILIES = {
    "kvserve_requests_finished",
    "kvserve_time_to_first_token_seconds",
    "kvserve_num_requests_running",
    "kvserve_kv_cache_usage_ratio",
    "kvserve_cache_config_info",
}


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_without_a_metrics_port_the_api_port_serves_metrics(server: RunningServer) -> None:
    with server.client() as client:
        r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert families(r.text) >= ENGINE_FAMILIES


@pytest.mark.slow
def test_the_metrics_port_serves_metrics_through_the_drain(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    metrics_port = free_port()
    proc, url, _port = start_cli_server(
        checkpoint_dir("llama"), "--metrics-port", str(metrics_port), "--drain-timeout", "60"
    )
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    try:
        r = httpx.get(f"{metrics_url}/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert families(r.text) >= ENGINE_FAMILIES
        assert httpx.head(f"{metrics_url}/metrics").status_code == 200
        # Only /metrics there; and the API port answers it as a path it does not have.
        assert httpx.get(f"{metrics_url}/v1/models").status_code == 404
        assert httpx.post(f"{metrics_url}/metrics").status_code == 405
        api = httpx.get(f"{url}/metrics")
        assert api.status_code == 404
        assert api.json()["error"]["message"] == "Not Found: no route GET /metrics"

        body = {"model": "m", "prompt": "count me", "max_tokens": 2, "temperature": 0}
        body |= {"ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert metric(metrics_url, "kvserve_requests_finished_total", finished_reason="length") == 1

        # SIGTERM mid-stream: the drain runs, and Prometheus can still watch it.
        stream = {**body, "prompt": "drain me", "max_tokens": 900, "stream": True}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/completions", json=stream) as r,
        ):
            lines = r.iter_lines()
            sigterm_mid_stream(proc, url, lines)
            assert metric(metrics_url, "kvserve_num_requests_running") == 1
        # The client left: its request is aborted, which ends the drain (however fast
        # this machine generates), and the process exits.
        assert proc.wait(timeout=60) == 0
        # The listener stopped with the server.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{metrics_url}/metrics")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--port", "8123", "--metrics-port", "8123"], "--metrics-port 8123 is also --port"),
        (["--grpc-port", "8124", "--metrics-port", "8124"], "is also --grpc-port"),
        (["--metrics-port", "70000"], "argument --metrics-port: a port is 1-65535, got 70000"),
        # 70000 would have bound port 4464 and been reported as 70000
        (["--port", "70000"], "argument --port: a port is 1-65535, got 70000"),
        (["--grpc-port", "0"], "argument --grpc-port: a port is 1-65535, got 0"),
        # It loaded the model, then uvicorn failed on the port gRPC had taken.
        (["--port", "8125", "--grpc-port", "8125"], "--grpc-port 8125 is also --port"),
        # A port for a listener that is not started was taken silently.
        (["--no-grpc", "--grpc-port", "8126"], "--grpc-port with --no-grpc"),
        # A traceback (logging's "Unknown level"), and a drain "up to -3 s".
        (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'loud'"),
        (["--drain-timeout", "-3"], "argument --drain-timeout: must be a finite number"),
        # The engine's bounds (the CRD's), named as the flag (it said "block_size ...").
        (["--block-size", "-1"], "argument --block-size: must be >= 1 and <= 256, got -1"),
    ],
)
def test_flags_that_cannot_work_fail_before_loading(flags: list[str], expected: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", *flags, "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr, out.stderr
    assert "loading" not in out.stderr


def test_a_port_in_use_fails_before_loading() -> None:
    """A taken port is one line in a second, not a traceback after the model loaded."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--port", "--grpc-port", "--metrics-port"):
            others = [f for f in ("--port", "--grpc-port") if f != flag]
            command = [sys.executable, "-m", "kvserve", "serve", flag, str(port)]
            command += [arg for f in others for arg in (f, str(free_port()))]
            out = subprocess.run(
                [*command, "--model", "/nonexistent"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 2, out.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
            assert f"(choose another with {flag})" in out.stderr
            assert "loading" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("name", ["two words", "line\nbreak", "*"])
def test_a_served_name_that_is_not_a_model_name_fails_before_loading(
    name: str, tmp_path: Path
) -> None:
    """The served name follows the rule of every model name (kvserve.names), whether
    given or taken from the model directory's name."""
    for flags in (["--served-model-name", name, "--model", "/nonexistent"],
                  ["--model", str(tmp_path / name)]):  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "kvserve", "serve", *flags, "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert "kvserve serve: error: served model name" in out.stderr, out.stderr
        assert "(name it with --served-model-name)" in out.stderr
        assert "loading" not in out.stderr and "Traceback" not in out.stderr


def test_a_tokenizer_flag_naming_no_tokenizer_fails_before_loading(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """An explicit --tokenizer without one was ignored: the server came up ready and
    refused every text request as if the client had sent something wrong."""
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--model", str(checkpoint_dir("llama")),
         "--tokenizer", "/nonexistent", "--port", str(free_port()), "--no-grpc"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "kvserve serve: error: tokenizer '/nonexistent': no tokenizer there" in out.stderr
    assert "loading" not in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("model", "what"), [("/nonexistent", "does not exist"), (__file__, "is a file")]
)
def test_a_model_that_is_no_directory_fails_before_loading(model: str, what: str) -> None:
    """A mistyped --model was reported after torch and the engine had been imported."""
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--model", model, "--port", str(free_port()),
         "--no-grpc"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"kvserve serve: error: model directory {model!r} {what}" in out.stderr, out.stderr
    assert "loading" not in out.stderr and "Traceback" not in out.stderr, out.stderr
