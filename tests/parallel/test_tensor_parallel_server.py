"""``kvserve serve --tensor-parallel-size 2`` as real processes: it answers like one
rank; a worker killed mid-request fails the replica fast (the stream ends with an
error, the server exits non-zero, no process is left); SIGTERM stops every rank, and a
SIGINT to the whole process group drains as with one rank; and
a group spread over two nodes (two ``kvserve serve`` processes on loopback, the
second with ``--node-rank 1``) serves from node 0 while node 1 answers /health."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.support.cli_server import start_cli_server
from tests.support.net import free_port
from tests.support.processes import LoggedProcess, start_logged
from tests.support.waiting import wait_until

PROMPT = "the quick brown fox"
EXIT_TIMEOUT = 60  # seconds for a failed replica to exit (it should take about one)


def children(pid: int) -> list[int]:
    """The process's direct children (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found += [int(c) for c in text.split()]
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers signal 0 until its parent reaps it.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")


def one_rank_completion(model: Path, max_tokens: int) -> str:
    with LLM(str(model), dtype="float32", device="cpu") as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return llm.generate([PROMPT], params)[0].outputs[0].text


def completion(url: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    out = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


@pytest.fixture
def tp_server(checkpoint_dir):  # type: ignore[no-untyped-def]
    model = checkpoint_dir("llama")
    proc, url, _ = start_cli_server(model, "--tensor-parallel-size", "2")
    try:
        yield model, proc, url
    finally:
        proc.stop()


def test_a_killed_worker_fails_the_replica_fast(tp_server) -> None:  # type: ignore[no-untyped-def]
    _, proc, url = tp_server
    [worker] = children(proc.pid)
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data: "):  # the request is running
            pass
        os.kill(worker, signal.SIGKILL)
        rest = list(lines)  # the stream ends (it does not hang) ...
    assert any('"error"' in line for line in rest), rest[-5:]  # ... with an error event
    code = proc.wait(timeout=EXIT_TIMEOUT)
    assert code == 1, proc.tail()
    assert "tensor-parallel worker rank 1" in proc.log.read_text(errors="replace")


def test_two_ranks_serve_what_one_rank_computes_and_sigterm_stops_every_rank(tp_server) -> None:  # type: ignore[no-untyped-def]
    """One server's life (a start of two ranks is ~8 s of the suite): it answers as one
    rank does, then SIGTERM ends both ranks."""
    model, proc, url = tp_server
    [worker] = children(proc.pid)
    assert completion(url, 12) == one_rank_completion(model, 12), proc.tail()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=EXIT_TIMEOUT) == 0, proc.tail()
    wait_until(lambda: gone(worker), timeout=EXIT_TIMEOUT)


def test_a_signal_to_the_whole_process_group_drains(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C in a terminal (SIGINT) reaches every process of the group, workers too: the
    request in flight still finishes and the server exits 0, as with one rank. Workers
    that died of it failed the replica mid-drain (an error event, exit 1)."""
    proc, url, _ = start_cli_server(
        checkpoint_dir("llama"), "--tensor-parallel-size", "2", new_session=True
    )
    try:
        [worker] = children(proc.pid)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 64, "stream": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data: "):  # the request is running
                pass
            os.killpg(proc.pid, signal.SIGINT)
            rest = list(lines)
        assert not any('"error"' in line for line in rest), rest[-5:]
        assert '"finish_reason": "length"' in "".join(rest), rest[-5:]
        assert proc.wait(timeout=EXIT_TIMEOUT) == 0, proc.tail()
        wait_until(lambda: gone(worker), timeout=EXIT_TIMEOUT)
    finally:
        proc.stop()


def test_a_group_over_two_nodes_serves_from_node_zero(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint_dir("qwen3")
    master, health = free_port(), free_port()
    group = [
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master),
    ]
    # Node 1 first: it waits at the rendezvous for node 0, as a LeaderWorkerSet's worker
    # pod may start before its leader.
    node1: LoggedProcess = start_logged(
        [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--port",
            str(health),
            "--node-rank",
            "1",
            *group,
        ],
        "kvserve-node1",
    )
    try:
        proc, url, _ = start_cli_server(model, "--node-rank", "0", *group)
        try:
            assert httpx.get(f"http://127.0.0.1:{health}/health").status_code == 200, node1.tail()
            assert httpx.get(f"http://127.0.0.1:{health}/v1/models").status_code == 404
            assert completion(url, 12) == one_rank_completion(model, 12), proc.tail()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=EXIT_TIMEOUT) == 0, proc.tail()
            # node 0 stopped the group: node 1's ranks leave, and so does it, with 0
            assert node1.wait(timeout=EXIT_TIMEOUT) == 0, node1.tail()
        finally:
            proc.stop()
    finally:
        node1.stop()
