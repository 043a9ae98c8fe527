"""An exception inside the engine fails the requests of that step only; the server goes on."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.server.app import create_app
from kvserve.structured import matcher
from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import start_server, stop_server
from tests.support.net import free_port
from tests.support.waiting import wait_until


class FaultyEngine(LLMEngine):
    """A real engine whose step fails once while a request with a marked client id is in it
    (fault injection: the code under test is the server's isolation of the failure)."""

    failed = False

    def step(self) -> list[RequestOutput]:
        marked = [r for r in self.requests.values() if (r.external_id or "").startswith("boom")]
        if not self.failed and marked:
            self.failed = True
            self.last_schedule = self.scheduler.schedule()  # the batch that fails
            raise RuntimeError("injected failure")
        return super().step()


def test_engine_error_fails_only_that_batch(checkpoint_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="kvserve.requests")
    engine = FaultyEngine(
        EngineConfig(model=str(checkpoint_dir("llama")), dtype="float32", device="cpu")
    )
    app = create_app(engine, MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_until(lambda: server.started, timeout=30)
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True}
        bad = httpx.post(
            f"{url}/v1/completions", json=body, headers={"x-request-id": "boom-1"}, timeout=60
        )
        assert bad.status_code == 500
        err = bad.json()["error"]
        assert set(err) == {"message", "type", "param", "code", "request_id"}
        assert err["request_id"] == "boom-1" and "boom-1" in err["message"]
        assert bad.headers["x-request-id"] == "boom-1"
        # The server carries on with other requests, concurrently too.
        with ThreadPoolExecutor(4) as pool:
            codes = list(
                pool.map(
                    lambda i: (
                        httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
                    ),
                    range(4),
                )
            )
        assert codes == [200] * 4
        metrics = httpx.get(f"{url}/metrics").text
        assert (
            'kvserve_requests_finished_total{finished_reason="error",model="tiny-llama"} 1.0'
            in metrics
        )
        assert httpx.get(f"{url}/health").status_code == 200
        # Its request-log line, as every request gets one (the runbooks' first look).
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvserve.requests"]
        failed = [line for line in lines if line["request_id"] == "boom-1"]
        assert len(failed) == 1 and failed[0]["finish_reason"] == "error", lines
        assert failed[0]["prompt_tokens"] > 0
        pool_ = engine.kv.pool
        wait_until(lambda: pool_.num_free_blocks == pool_.num_blocks)
    finally:
        server.should_exit = True


def test_a_constraint_too_costly_to_enforce_fails_its_request_alone(
    checkpoint_dir, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A token mask is filled on the engine's thread, so a grammar whose masks cost tens
    of milliseconds (a large exact repetition) delayed every request of every step: its
    request now fails, naming the cost, and the others run on. (The limit is lowered
    here, far under what the pattern costs, so the test does not hang on the machine's
    speed; an ordinary regex's mask costs a hundredth of it.)"""
    monkeypatch.setattr(matcher, "MAX_MASK_CPU_SECONDS", 0.002)
    srv = start_server(checkpoint_dir("llama"))
    try:
        with srv.client() as c, ThreadPoolExecutor(2) as pool:

            def constrained(regex: str) -> httpx.Response:
                body = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": regex}}
                return c.post("/v1/completions", json={"model": MODEL, **body})

            costly = pool.submit(constrained, "a{100000}")
            ordinary = pool.submit(constrained, "[a-z ]{1,20}")
            refused, served = costly.result(), ordinary.result()
    finally:
        stop_server(srv)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "costs too much to enforce" in error["message"], error
    assert error["param"] == "structured_outputs"
    assert served.status_code == 200, served.text
