"""``kvserve chat`` against a real server on loopback and with the engine in-process."""

from __future__ import annotations

import http.server
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.chat import ChatParams, HTTPBackend, InProcessBackend, Repl
from kvserve.demo_model import bundled_model_calls_tools
from tests.support.engine_server import RunningServer, start_server, stop_server
from tests.support.net import free_port
from tests.support.prometheus import metric
from tests.support.waiting import wait_until

GREEDY = ("--temperature", "0")
CheckpointDir = Callable[[str], Path]


@pytest.fixture(scope="module")
def server(checkpoint_dir: CheckpointDir) -> Iterator[RunningServer]:
    srv = start_server(checkpoint_dir("llama"), block_size=4)
    yield srv
    stop_server(srv)


@pytest.fixture
def request_log(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict[str, Any]]]:
    """The server's per-request log lines (it runs in this process), oldest first."""
    caplog.set_level(logging.INFO, logger="kvserve.requests")

    def records() -> list[dict[str, Any]]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvserve.requests"]

    return records


def chat_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve", "chat", *args]


# UTF-8 both ways: the random model's text can hold any character, and the tests compare
# what was printed with what the server received.
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


def run_chat(*args: str, stdin: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        chat_cmd(*args), input=stdin.encode(), capture_output=True, timeout=60, env=ENV, check=False
    )


def answers(stdout: bytes) -> list[str]:
    """The assistant's answers, as printed (each ends with a newline)."""
    return [a.removesuffix("\n") for a in stdout.decode().split("assistant> ")[1:]]


def prompt_len(srv: RunningServer, messages: list[dict[str, str]]) -> int:
    """Prompt tokens of a conversation, rendered as the server renders it."""
    tok = srv.engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def test_url_mode_streams_answers_and_sends_the_history(
    server: RunningServer, request_log: Callable[[], list[dict[str, Any]]]
) -> None:
    out = run_chat(
        "--url", server.url, "--max-tokens", "8", *GREEDY, stdin="hello there\nand then?\n"
    )
    assert out.returncode == 0, out.stderr.decode()
    a1, a2 = answers(out.stdout)
    assert a1 and a2
    u1 = {"role": "user", "content": "hello there"}
    u2 = {"role": "user", "content": "and then?"}
    recs = request_log()
    assert [r["finish_reason"] for r in recs] == ["length", "length"]
    # The second request carried the whole conversation, first answer included.
    assert [r["prompt_tokens"] for r in recs] == [
        prompt_len(server, [u1]),
        prompt_len(server, [u1, {"role": "assistant", "content": a1}, u2]),
    ]


def test_commands_reset_help_and_system_prompt(
    server: RunningServer, request_log: Callable[[], list[dict[str, Any]]]
) -> None:
    out = run_chat(
        "--url",
        server.url,
        "--system",
        "be brief",
        "--max-tokens",
        "2",
        *GREEDY,
        stdin="/help\nhi\n/reset\n\nhi\n/exit\nnever sent\n",
    )
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout.decode()
    assert "/reset" in text and "/exit" in text  # the help
    assert "[history cleared]" in text
    assert len(answers(out.stdout)) == 2  # /exit stopped it before the last line
    system = {"role": "system", "content": "be brief"}
    first_turn = prompt_len(server, [system, {"role": "user", "content": "hi"}])
    assert [r["prompt_tokens"] for r in request_log()] == [first_turn, first_turn]


def test_server_errors_keep_the_repl_alive(server: RunningServer) -> None:
    out = run_chat("--url", server.url, "--served-model-name", "nope", stdin="hi\nagain\n")
    assert out.returncode == 0
    errors = out.stderr.decode().splitlines()
    assert (
        errors == ["error: HTTP 404: model 'nope' is not served here (available: 'tiny-llama')"] * 2
    )


def test_in_process_mode(checkpoint_dir: CheckpointDir) -> None:
    out = run_chat(
        "--model",
        str(checkpoint_dir("llama")),
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        *GREEDY,
        stdin="hello there\nand then?\n",
    )
    assert out.returncode == 0, out.stderr.decode()
    assert len(answers(out.stdout)) == 2
    assert all(answers(out.stdout))


def test_in_process_repl_keeps_the_history_and_aborts(checkpoint_dir: CheckpointDir) -> None:
    backend = InProcessBackend(checkpoint_dir("llama"), dtype="float32", device="cpu")
    try:
        lines = iter(["hello there", "and then?"])

        def read_line(prompt: str) -> str:
            try:
                return next(lines)
            except StopIteration:
                raise EOFError from None

        out = io.StringIO()
        repl = Repl(backend, ChatParams(temperature=0, max_tokens=4), read_line=read_line, out=out)
        assert repl.run() == 0
        a1, a2 = answers(out.getvalue().encode())
        assert repl.history == [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": a2},
        ]

        # Abort mid-answer: the request leaves the engine and its KV blocks are freed.
        stream = backend.stream(
            [{"role": "user", "content": "tell me a long story"}],
            ChatParams(temperature=0, max_tokens=500),
        )
        assert next(stream) and next(stream)
        backend.abort()
        assert list(stream) == []  # the stream ends cleanly
        engine = backend.engine
        wait_until(lambda: engine.num_in_flight == 0 and not engine.engine.requests)
        assert engine.engine.stats().num_running == 0
        pool = engine.engine.kv.pool
        wait_until(lambda: pool.num_free_blocks == pool.num_blocks)
    finally:
        backend.close()


class _BurstHandler(http.server.BaseHTTPRequestHandler):
    """A server whose whole answer, six content events and [DONE], is one socket write."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects between requests

    def do_GET(self) -> None:
        self._send(b"application/json", json.dumps({"data": [{"id": "burst"}]}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
        self._send(
            b"text/event-stream",
            f"data: {json.dumps(chunk)}\n\n".encode() * 6 + b"data: [DONE]\n\n",
        )

    def _send(self, content_type: bytes, body: bytes) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
        self.wfile.write(head % (content_type, len(body)) + body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_abort_drops_the_events_already_read() -> None:
    # httpx reads the whole burst at once; closing the response must not let the lines
    # already in its decoder through (a fresh clone once saw two pieces after abort()).
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BurstHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    backend = HTTPBackend(f"http://127.0.0.1:{httpd.server_address[1]}")
    try:
        stream = backend.stream([{"role": "user", "content": "hi"}], ChatParams())
        assert next(stream) == "x"
        backend.abort()
        assert list(stream) == []
        # Without the abort the same answer is all six pieces.
        assert "".join(backend.stream([{"role": "user", "content": "hi"}], ChatParams())) == "x" * 6
    finally:
        backend.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_abort_closes_the_stream_and_the_server_aborts(server: RunningServer) -> None:
    aborts = metric(server.url, "kvserve_requests_finished_total", finished_reason="abort")
    backend = HTTPBackend(server.url)
    try:
        assert backend.model == "tiny-llama"
        stream = backend.stream(
            [{"role": "user", "content": "tell me a long story"}],
            ChatParams(temperature=0, max_tokens=500),
        )
        assert next(stream) and next(stream)  # mid-answer
        backend.abort()
        assert list(stream) == []
        wait_until(
            lambda: (
                metric(server.url, "kvserve_requests_finished_total", finished_reason="abort")
                == aborts + 1
            )
        )
        wait_until(lambda: metric(server.url, "kvserve_num_requests_running") == 0)
        assert server.engine.stats().num_running == 0
        # The backend is still usable for the next turn.
        again = backend.stream([{"role": "user", "content": "hi"}], ChatParams(max_tokens=2))
        assert "".join(again)
    finally:
        backend.close()


def test_ctrl_c_stops_the_answer_and_keeps_it(
    server: RunningServer, request_log: Callable[[], list[dict[str, Any]]], tmp_path: Path
) -> None:
    aborts = metric(server.url, "kvserve_requests_finished_total", finished_reason="abort")
    stdin = tmp_path / "stdin"
    stdin.write_text("tell me a long story\nand then?\n")
    with stdin.open("rb") as f:
        proc = subprocess.Popen(
            # A long answer (600 steps, the model has 1,024 positions): it must still be
            # streaming when the signal lands, even on a slow or busy machine.
            chat_cmd("--url", server.url, "--max-tokens", "600", *GREEDY),
            stdin=f,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
            # A shell starts background jobs with SIGINT ignored, and an ignored signal
            # stays ignored across exec: give the chat the default disposition back, as
            # a terminal would have it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        assert proc.stdout is not None
        seen = b""
        # Wait until the first answer is streaming, then press Ctrl-C.
        while not seen.partition(b"assistant> ")[2]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, "chat exited before answering"
            seen += chunk
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    stdout = seen + rest
    partial, _, after = stdout.decode().partition("\n[stopped]\n")
    assert partial.startswith("assistant> ") and after.startswith("assistant> ")
    wait_until(
        lambda: (
            metric(server.url, "kvserve_requests_finished_total", finished_reason="abort")
            == aborts + 1
        )
    )
    first, second = request_log()
    assert first["finish_reason"] == "abort"
    # The partial answer stayed in the history that the second turn sent.
    u2 = {"role": "user", "content": "and then?"}
    assert second["prompt_tokens"] >= first["prompt_tokens"] + prompt_len(server, [u2])


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # e.g. reset while the server shuts down: not gone yet, poll again
        return False
    return False


def test_server_gone_mid_session_is_one_line_and_the_repl_goes_on(
    checkpoint_dir: CheckpointDir,
) -> None:
    srv = start_server(checkpoint_dir("llama"), block_size=4)
    backend = HTTPBackend(srv.url)
    lines = iter(["hi", "after the server stopped", "still here"])

    def read_line(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        if line == "after the server stopped":
            stop_server(srv)
            wait_until(lambda: refuses_connections(srv.port))
        return line

    out, err = io.StringIO(), io.StringIO()
    try:
        repl = Repl(
            backend,
            ChatParams(temperature=0, max_tokens=2),
            read_line=read_line,
            out=out,
            err=err,
        )
        assert repl.run() == 0
    finally:
        backend.close()
        stop_server(srv)
    errors = err.getvalue().splitlines()
    assert len(errors) == 2
    assert all(e.startswith("error: ") and srv.url in e for e in errors)
    # Only the turn that got an answer is in the history.
    assert [m["role"] for m in repl.history] == ["user", "assistant"]


def test_unreachable_server_exits_1() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = run_chat("--url", url, stdin="hi\n")
    assert out.returncode == 1
    assert out.stderr.decode().startswith(f"kvserve chat: error: cannot reach {url}")
    assert b"assistant>" not in out.stdout


@pytest.mark.skipif(
    not bundled_model_calls_tools(),
    reason="the bundled checkpoint is not trained for tools (kvserve train-demo --no-tools)",
)
def test_tools_run_a_local_agent_loop_with_the_demo_model() -> None:
    # The bundled model, offered search_hotels: a call, its result (run here, over the
    # demo's world model), then the answer built from the result.
    out = run_chat(
        "--tools",
        "--dtype",
        "float32",
        *GREEDY,
        stdin="Ryokans in Kyoto under $200 with an onsen?\n",
    )
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    call = '[call] search_hotels({"city": "Kyoto", "max_price": 200, "kind": "ryokan", '
    assert lines[0] == "assistant> " + call + '"amenities": ["onsen"]})', lines
    # The result (run here over the world model), its lines aligned under the first ...
    assert lines[1] == "[result] 3 ryokans in Kyoto under $200 a night, all with onsen:", lines
    indent = " " * len("[result] ")
    assert all(line.startswith(indent + f"{i}. ") for i, line in enumerate(lines[2:5], 1)), lines
    places = [line.removeprefix(indent) for line in lines[2:5]]
    # ... and the answer from it: the result's places, copied.
    assert lines[5:] == ["assistant> I found 3 ryokans:", *places, "All of them have an onsen."]


def test_tools_need_the_in_process_engine() -> None:
    out = run_chat("--tools", "--url", "http://127.0.0.1:9", stdin="")
    assert out.returncode == 2
    assert "--tools" in out.stderr.decode()
