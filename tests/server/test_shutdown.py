"""SIGTERM drains: in-flight requests finish, new ones get 503, the process exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import create_app
from kvserve.server.shutdown import DrainingServer
from kvserve.server.state import ServerState
from kvserve.telemetry.prometheus import EngineMetrics
from tests.support.cli_server import sigterm_mid_stream, start_cli_server
from tests.support.net import free_port
from tests.support.prometheus import metric
from tests.support.waiting import wait_until


@pytest.mark.slow
def test_sigterm_drains_then_exits_zero(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    # The drain timeout is a bound, not a wait: 900 tokens took over a minute on a busy
    # machine, and a drain cut short by it is not what this test is about.
    proc, url, _port = start_cli_server(checkpoint_dir("llama"), "--drain-timeout", "600")
    try:
        body = {
            "model": "m",
            "prompt": "drain me",
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            sigterm_mid_stream(proc, url, lines)
            refused = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "new"})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable"
            not_ready = httpx.get(f"{url}/ready")  # as every error body, with the request id
            assert not_ready.status_code == 503
            assert not_ready.json()["error"]["request_id"] == not_ready.headers["x-request-id"]
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "length"  # completed, not cut off
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_drain_timeout_aborts_the_rest(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """At the drain timeout the requests still running end as a second signal ends them:
    each answer complete, with finish reason "abort" (it was uvicorn's cancellation: a
    plain-text 500, a stream cut off without [DONE], tracebacks in the log)."""
    proc, url, port = start_cli_server(
        checkpoint_dir("llama"), "--drain-timeout", "0.2", "--max-num-seqs", "1"
    )
    try:
        # Two long requests, streamed and not; with max_num_seqs=1 the second waits.
        socks = []
        for prompt, stream in (("first", True), ("second", False)):
            payload = json.dumps(
                {
                    "model": "m",
                    "prompt": prompt,
                    "max_tokens": 1000,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": stream,
                }
            ).encode()
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            socks.append(s)
        # Both admitted (one running, one queued) before the signal.
        wait_until(
            lambda: (
                metric(url, "kvserve_num_requests_running") == 1
                and metric(url, "kvserve_num_requests_waiting") == 1
            )
        )
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - start < 30  # did not wait for 2,000 tokens to finish
        streamed, whole = (_read_all(s).decode() for s in socks)
        assert streamed.startswith("HTTP/1.1 200"), streamed[:300]
        events = [line for line in streamed.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", streamed[-300:]
        assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"
        assert whole.startswith("HTTP/1.1 200"), whole[:300]
        answer = json.loads(whole.split("\r\n\r\n", 1)[1])
        assert answer["choices"][0]["finish_reason"] == "abort"
        log = proc.log.read_text()
        assert "drain timeout" in log
        assert "Traceback" not in log and "CancelledError" not in log, proc.tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_taken_in_but_not_yet_in_the_engine_is_drained(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """A request on its way to the engine when SIGTERM comes (its body still arriving here;
    a batch of long prompts being tokenized, in life) is drained as one in the engine:
    the drain used to see nothing in flight and shut the server down under it (a
    plain-text 500). Its head came before the signal, so it is served; one whose head
    comes after is refused at once, its body unread. In this process, to see the request
    taken in before the signal."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint_dir("llama")), dtype="float32"))
    app = create_app(engine, "m", metrics=EngineMetrics("m"))
    state: ServerState = app.state.kvserve
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = DrainingServer(config, state, drain_timeout=600)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=60)
    body = json.dumps({"model": "m", "prompt": "drain me", "max_tokens": 3}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )

    def answer(sock: socket.socket) -> tuple[int, Any]:
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())

    with socket.create_connection(("127.0.0.1", port)) as taken_in:
        taken_in.sendall(head + body[:8])
        wait_until(lambda: state.preparing == 1)
        server.handle_exit(signal.SIGTERM, None)
        wait_until(lambda: not state.admitting)
        with socket.create_connection(("127.0.0.1", port)) as late:
            late.sendall(head)  # and no body: refused without waiting for it
            status, refused = answer(late)
        assert status == 503 and "shutting down" in refused["error"]["message"], refused
        taken_in.sendall(body[8:])
        status, served = answer(taken_in)
    assert status == 200, served
    assert served["usage"]["completion_tokens"] == 3
    thread.join(timeout=60)
    assert not thread.is_alive() and server.exit_code == 0


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sent before it closed the connection."""
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


@pytest.mark.slow
def test_a_second_signal_ends_the_drain_quietly(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    proc, url, _port = start_cli_server(
        checkpoint_dir("llama"), "--drain-timeout", "600", grpc=True
    )
    try:
        body = {"model": "m", "prompt": "drain me", "max_tokens": 900, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            sigterm_mid_stream(proc, url, lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "abort"  # ended now, not finished
        assert proc.wait(timeout=60) == 0
        log = proc.log.read_text()
        assert "ending the drain" in log
        assert "Traceback" not in log and "CancelledError" not in log, proc.tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
