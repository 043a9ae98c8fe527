"""One streamed request against fake responses: what is timed, and what counts as what."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvserve.loadtest.client import INTERRUPTED, stream_request
from kvserve.loadtest.records import RequestRecord
from kvserve.loadtest.workloads import RequestSpec

SPEC = RequestSpec("chat", "chat", 16, messages=(("user", "hi"),))


class FakeClock:
    """Advances by a fixed step at every reading, so every timestamp is known."""

    def __init__(self, step: float = 0.010) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class FakeResponse:
    def __init__(self, status: int, lines: list[str], raise_after: int | None = None) -> None:
        self.status_code = status
        self.headers = {"x-request-id": "rid-1"}
        self.lines = lines
        self.raise_after = raise_after
        self.closed = False
        self.text = lines[0] if status != 200 and lines else ""
        self.marked: tuple[str, str | None] | None = None

    def iter_lines(self, chunk_size: int | None = None) -> Iterator[bytes]:
        for i, line in enumerate(self.lines):
            if self.raise_after is not None and i == self.raise_after:
                raise ConnectionError("connection reset by peer")
            yield line.encode()

    def close(self) -> None:
        self.closed = True


def chunk(text: str, finish: str | None = None) -> str:
    body = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return "data: " + json.dumps(body)


def usage(completion: int, prompt: int = 12, cached: int = 8) -> str:
    u = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return "data: " + json.dumps({"choices": [], "usage": u})


def run(
    resp: FakeResponse, spec: RequestSpec = SPEC, **kw: Any
) -> tuple[RequestRecord, list[RequestRecord], dict[str, Any]]:
    sent: dict[str, Any] = {}
    sunk: list[RequestRecord] = []

    @contextmanager
    def post(path: str, body: dict[str, Any]) -> Iterator[FakeResponse]:
        sent.update(path=path, body=body)
        yield resp

    def mark(r: Any, status: str, error: str | None) -> None:
        r.marked = (status, error)

    rec = stream_request(
        post, spec, "m", mark=mark, sink=sunk.append, clock=FakeClock(), wall=lambda: 5000.0, **kw
    )
    return rec, sunk, sent


def test_ok_stream_is_timed_per_chunk_with_text() -> None:
    lines = [
        chunk(""),  # role-only first chunk: no visible text
        "",
        chunk("Hel"),
        "",
        ": keep-alive comment",
        chunk("lo"),
        chunk("!"),
        chunk("", finish="stop"),
        usage(4),
        "data: [DONE]",
    ]
    resp = FakeResponse(200, lines)
    rec, sunk, sent = run(resp, user="u1")
    # Clock readings: 100.01 at send, then one per line read (+0.01 each).
    assert rec.status == "ok" and rec.error is None
    assert rec.chunk_times_s == pytest.approx([0.03, 0.06, 0.07])
    assert rec.first_token_s == pytest.approx(0.03) and rec.last_token_s == pytest.approx(0.07)
    assert rec.end_s == pytest.approx(0.10)  # [DONE]
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (4, 12, 8)
    assert rec.finish_reason == "stop" and rec.http_status == 200
    assert rec.request_id == "rid-1" and rec.user == "u1" and rec.send_time == 5000.0
    assert rec.tpot() == pytest.approx(0.04 / 3)  # O from usage, not the 3 chunks
    assert sunk == [rec] and resp.marked == ("ok", None)
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["stream_options"] == {"include_usage": True}


def test_completions_text_field() -> None:
    spec = RequestSpec("completion", "completions", 4, prompt="x")
    body = {"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}]}
    rec, _, sent = run(FakeResponse(200, ["data: " + json.dumps(body), "data: [DONE]"]), spec)
    assert rec.status == "ok" and len(rec.chunk_times_s) == 1
    assert rec.output_tokens is None and rec.num_output_tokens == 1
    assert sent["path"] == "/v1/completions"


def test_cancel_after_k_chunks_closes_the_stream() -> None:
    spec = RequestSpec("cancel", "chat", 64, messages=(("user", "hi"),), cancel_after_chunks=2)
    lines = [chunk("a"), chunk("b"), chunk("c"), chunk("", "stop"), "data: [DONE]"]
    resp = FakeResponse(200, lines)
    rec, _, _ = run(resp, spec)
    assert rec.status == "cancelled" and rec.error is None
    assert len(rec.chunk_times_s) == 2 and resp.closed
    assert rec.cancel_after_chunks == 2
    assert resp.marked == ("cancelled", None)


@pytest.mark.parametrize(
    ("resp", "error"),
    [
        (FakeResponse(429, ['{"error": {"message": "rate limit exceeded"}}']),
         "HTTP 429: rate limit exceeded"),
        (FakeResponse(502, ["<html>bad gateway</html>"]), "HTTP 502: <html>bad gateway</html>"),
        (FakeResponse(200, [chunk("a"), 'data: {"error": {"message": "engine died"}}',
                            "data: [DONE]"]), "error event: engine died"),
        (FakeResponse(200, [chunk("a"), chunk("b")]), "the stream ended without [DONE]"),
        (FakeResponse(200, [chunk("a"), "data: [DONE]"]), "no finish_reason in the stream"),
        (FakeResponse(200, [chunk("a"), chunk("b")], raise_after=1),
         "ConnectionError: connection reset by peer"),
        (FakeResponse(0, []), "no response: connection failed"),
    ],
)  # fmt: skip
def test_failures(resp: FakeResponse, error: str) -> None:
    rec, sunk, _ = run(resp)
    assert rec.status == "error"
    assert rec.error == error
    assert sunk == [rec] and resp.marked == ("error", error)


def test_post_raising_is_a_failure() -> None:
    @contextmanager
    def post(path: str, body: dict[str, Any]) -> Iterator[Any]:
        raise OSError("connection refused")
        yield  # pragma: no cover

    rec = stream_request(post, SPEC, "m")
    assert rec.status == "error" and rec.error == "OSError: connection refused"


class Stop(BaseException):
    """Like gevent's GreenletExit: Locust stopping the user mid-request."""


def test_interrupted_request_is_recorded_then_propagates() -> None:
    class Interrupting(FakeResponse):
        def iter_lines(self, chunk_size: int | None = None) -> Iterator[bytes]:
            yield chunk("a").encode()
            raise Stop

    sunk: list[RequestRecord] = []

    @contextmanager
    def post(path: str, body: dict[str, Any]) -> Iterator[FakeResponse]:
        yield Interrupting(200, [])

    with pytest.raises(Stop):
        stream_request(post, SPEC, "m", sink=sunk.append)
    assert len(sunk) == 1
    assert sunk[0].status == "error" and sunk[0].error == INTERRUPTED
    assert len(sunk[0].chunk_times_s) == 1
