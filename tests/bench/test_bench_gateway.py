"""``kvserve bench gateway`` end to end at tiny sizes: real replica and gateway processes.

Only the report's structure and the consistency of its counts are checked; timings never
are (they depend on the machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_gateway_reports_every_phase(
    checkpoint_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    streams, requests, max_tokens, rounds = 4, 8, 4, 1
    replicas, agents, questions = 2, 2, 2
    cap_streams, cap_requests = 3, 7
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvserve", "bench", "gateway",
            "--model", str(checkpoint_dir("llama")),
            "--streams", str(streams), "--requests", str(requests),
            "--max-tokens", str(max_tokens), "--prompt-len", "8", "--rounds", str(rounds),
            "--replicas", str(replicas), "--agents", str(agents),
            "--questions", str(questions), "--system-tokens", "40",
            "--routing-max-tokens", "4", "--lone-pairs", "3",
            "--capacity-streams", str(cap_streams), "--capacity-requests", str(cap_requests),
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "added by the gateway" in proc.stdout
    assert "round_robin" in proc.stdout
    report = json.loads(out.read_text())

    o = report["overhead"]
    assert (o["streams"], o["requests"], o["rounds"]) == (streams, requests, rounds)
    # The default spread of output lengths: max_tokens × (1 ± 0.5).
    assert 2 <= o["output_tokens_min"] <= o["output_tokens_max"] <= 6
    assert len(o["passes"]) == 2 * rounds
    assert {p["path"] for p in o["passes"]} == {"direct", "gateway"}
    for side in ("direct", "gateway"):
        stats = o[side]
        assert stats["requests_ok"] == requests * rounds
        assert stats["requests_failed"] == 0
        # ignore_eos: every request generates its tokens, shown in at most as many chunks
        assert 0 < stats["chunks"] <= o["output_tokens_per_pass"] * rounds
        # Every request is found in the replica's request log (same clock on Linux).
        assert stats["split_requests"] == requests * rounds
        assert stats["engine_ttft_p50_ms"] > 0 and stats["gap_added_p50_ms"] is not None
        for name in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms"):
            assert stats[name] is not None and stats[name] >= 0
    # Both paths stream the same greedy tokens of the same prompts: the same chunks.
    assert o["gateway"]["chunks"] == o["direct"]["chunks"] == o["gateway_chunks"]
    # The bare gRPC client read the same greedy streams: one message per text chunk.
    assert o["grpc_client_messages"] == o["gateway_chunks"]
    assert o["grpc_client_cpu_seconds"] > 0
    assert o["gateway_cpu_seconds"] >= 0
    for name in (
        "ttft_p50_added_ms",
        "itl_p50_added_ms",
        "ttft_outside_engine_added_ms",
        "gap_added_by_gateway_ms",
    ):
        assert isinstance(o[name], float)
    # Lone pairs: both requests of each pair succeed (greedy, ignore_eos, 4 tokens: gaps).
    assert o["lone_pairs"] == 3
    for name in ("lone_ttft_added", "lone_itl_added"):
        q1, median, q3 = (o[f"{name}{part}_ms"] for part in ("_q1", "", "_q3"))
        assert all(isinstance(x, float) for x in (q1, median, q3))
        assert q1 <= median <= q3
    assert "lone requests (3 pairs" in proc.stdout
    assert o["target_ttft_added_ms"] == 5.0 and o["target_itl_added_ms"] == 0.5

    c = report["capacity"]
    assert (c["streams"], c["requests"], c["max_tokens"]) == (cap_streams, cap_requests, max_tokens)
    assert len(c["rounds"]) == rounds
    for x in c["rounds"]:
        assert (x["requests_ok"], x["requests_failed"]) == (cap_requests, 0)
        # The stub replica sends max_tokens tokens per request, each a text chunk.
        assert x["chunks"] == cap_requests * max_tokens
        assert x["seconds"] > 0 and x["gateway_cpu_seconds"] >= 0
    assert c["first_error"] is None
    assert c["target_chunks_per_second"] == 10_000
    two_cpus = len(os.sched_getaffinity(0)) >= 2
    assert c["gateway_alone"] is two_cpus
    assert c["placement"].startswith("separate: the gateway alone on CPU" if two_cpus else "shared")
    assert o["placement"] == c["placement"]
    assert "gateway capacity: 3 streams" in proc.stdout

    r = report["routing"]
    assert (r["replicas"], r["agents"], r["questions"]) == (replicas, agents, questions)
    assert r["history"] is True
    assert r["system_prompt_tokens"] >= 40
    assert [p["policy"] for p in r["policies"]] == ["prefix", "round_robin"]
    for p in r["policies"]:
        assert p["requests_ok"] == agents * questions and p["requests_failed"] == 0
        assert len(p["requests_per_replica"]) == replicas
        assert sum(p["requests_per_replica"]) == agents * questions
        assert p["prompt_tokens"] >= agents * questions * r["system_prompt_tokens"]
        assert 0 <= p["cached_tokens"] <= p["prompt_tokens"]
        assert 0.0 <= p["cached_ratio"] <= 1.0
        assert p["ttft_mean_ms"] is not None and p["ttft_mean_ms"] > 0
    # Round-robin alternates strictly over the replicas.
    assert r["policies"][1]["requests_per_replica"] == [agents * questions // replicas] * replicas
