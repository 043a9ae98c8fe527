"""The locustfile, headless for a few seconds, against a real ``kvserve serve`` replica.

Each run's report is recomputed here from its records.jsonl and must equal the run's own
summary.json; Locust's CSV must hold the custom TTFT/TPOT/ITL/E2E events. No timing is
asserted: the SLOs are either far above anything a loopback run takes, or impossible.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.loadtest import cli
from kvserve.loadtest.records import read_records
from kvserve.loadtest.report import Slo, WindowRule, read_summary, summarize
from kvserve.loadtest.sweep import locust_runner, sweep
from tests.support.net import free_port
from tests.support.processes import start_logged
from tests.support.replicas import Replica
from tests.support.waiting import wait_until

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtests" / "locustfile.py"
GENEROUS = ["--slo-ttft-ms", "120000", "--slo-tpot-ms", "60000"]


@pytest.fixture(scope="module")
def replica(shared_replicas: list[Replica]) -> Replica:
    return shared_replicas[0]


def locust(host: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-H", host, "--out-dir", str(out), "--ignore-eos", "--seed", "1", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)


def locust_stats(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def test_constant_users_run_and_report(replica: Replica, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = locust(
        replica.http, out, "-u", "3", "-r", "3", "-t", "4s", "--max-tokens", "8",
        "--csv", str(tmp_path / "locust"), *GENEROUS,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_records(out / "records.jsonl")
    assert len(records) >= 3
    assert {r.status for r in records} == {"ok"}, [r.error for r in records]
    assert {r.output_tokens for r in records} == {8}  # usage chunk, ignore_eos
    assert all(r.chunk_times_s and r.request_id for r in records)
    assert {r.scenario for r in records} <= {"chat", "completion"}

    # The report, recomputed from the records, is the run's own summary.
    slo = Slo(ttft_ms=120000, tpot_ms=60000, attainment=0.9)
    again = summarize(records, slo, WindowRule())
    assert read_summary(out / "summary.json") == again
    assert again.requests.good == len(records) and again.attainment == 1.0
    assert "closed cohort" in proc.stderr  # the printed report states its window rule
    assert (out / "latency_cdf.png").is_file() and (out / "latency_over_time.png").is_file()

    # Locust's own CSV has the custom events, one TTFT/TPOT/E2E per request, ITL per gap.
    stats = locust_stats(tmp_path / "locust")
    ok = {name: [r for r in records if r.scenario == name] for name in ("chat", "completion")}
    for name, recs in ok.items():
        if not recs:
            continue
        for kind in ("TTFT", "TPOT", "E2E"):
            assert int(stats[(kind, name)]["Request Count"]) == len(recs)
        itl_count = sum(len(r.itls()) for r in recs)
        assert int(stats[("ITL", name)]["Request Count"]) == itl_count

    # The same records as a CI gate: an impossible SLO fails it.
    assert cli.main(["report", str(out / "records.jsonl"), "--slo-ttft-ms", "0.001"]) == 1


@pytest.mark.slow
def test_poisson_cancellation_mix_gates_on_attainment(replica: Replica, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = locust(
        replica.http, out, "--load-shape", "poisson", "--rate", "6", "-t", "4s",
        "--workload", "cancel", "--slo-ttft-ms", "0.001",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-4000:]  # attainment below target
    assert "is below the target 90% → exit code 1" in proc.stderr
    records = read_records(out / "records.jsonl")
    assert records
    for r in records:  # the client disconnects exactly when the workload says so
        expected = "cancelled" if r.cancel_after_chunks is not None else "ok"
        assert r.status == expected, r.error
        if r.cancel_after_chunks is not None:
            assert len(r.chunk_times_s) == r.cancel_after_chunks
    summary = read_summary(out / "summary.json")
    assert summary.requests.attempted == len(records)
    assert summary.requests.judged == sum(r.ok for r in records)
    assert summary == summarize(records, Slo(ttft_ms=0.001), WindowRule())


@pytest.mark.slow
def test_tiny_sweep(replica: Replica, tmp_path: Path) -> None:
    runner = locust_runner(
        LOCUSTFILE, replica.http, 3, ["--max-tokens", "8", "--ignore-eos", *GENEROUS], 60
    )
    result = sweep([1, 2], runner, tmp_path, Slo(120000, 60000), WindowRule())
    assert [s.rate for s in result.steps] == [1, 2]
    assert all(s.locust_exit_code == 0 and s.met for s in result.steps)
    assert result.max_goodput_rate == 2
    for step in result.steps:
        assert read_summary(step.out_dir / "summary.json") == step.summary


def test_ctrl_c_ends_a_run_with_its_report(replica: Replica, tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the process group) reaches Locust too: the run
    stops and still writes its summary and plots. subprocess.run killed Locust a quarter
    second after the interrupt, and the run's outputs were lost."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "kvserve", "loadtest", "run", "-H", replica.http, "-u", "2",
        "-t", "120s", "--max-tokens", "8", "--out-dir", str(out), *GENEROUS,
    ]  # fmt: skip
    proc = start_logged(
        cmd,
        "loadtest-run",
        start_new_session=True,
        # A suite started in the background (``cmd &``) has SIGINT ignored, which stays
        # ignored across exec: the default disposition back, as a terminal has it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        records = out / "records.jsonl"
        wait_until(lambda: records.is_file() and records.read_text().count("\n") >= 2, 120)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, proc.tail()
    finally:
        proc.stop()
    assert (out / "summary.json").is_file(), proc.tail()
    assert read_summary(out / "summary.json").requests.succeeded >= 2
    assert (out / "latency_cdf.png").is_file(), proc.tail()  # the plots come last


def test_a_run_that_cannot_start_is_one_error(tmp_path: Path) -> None:
    """Nothing listens at --host: the run ends with kvserve's error and exit code 2. Locust
    also printed a greenlet traceback per user ("Tried to stop User in an unexpected
    state"): the locustfile and Locust's end of a shape test both stopped the users."""
    host = f"http://127.0.0.1:{free_port()}"
    cmd = [
        sys.executable, "-m", "kvserve", "loadtest", "run", "-H", host, "-u", "2", "-t", "30s",
        "--out-dir", str(tmp_path / "run"), "--no-plots",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"cannot reach {host}/v1/models" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_host_that_is_no_url_is_refused_before_locust_starts() -> None:
    cmd = [sys.executable, "-m", "kvserve", "loadtest", "run", "-H", "127.0.0.1:8000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "kvserve loadtest run: error: argument -H/--host: '127.0.0.1:8000': not an http(s) "
        "URL such as http://127.0.0.1:8000"
    ), proc.stderr
    assert "Starting Locust" not in proc.stderr, proc.stderr
