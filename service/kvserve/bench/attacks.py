"""``kvserve bench attacks``: what hostile clients cost the other clients of a replica
(docs/bench-methods.md, "kvserve bench attacks")."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.cpu import cpu_list, running_on, split_cpus
from kvserve.bench.launcher import Launcher, LaunchSettings, metric_samples
from kvserve.bench.processes import Proc
from kvserve.bench.results import text_row
from kvserve.bench.sse_client import (
    COMPLETIONS,
    MODEL_NAME,
    Connection,
    completion_body,
    run_on_uvloop,
)
from kvserve.config import DTYPES
from kvserve.openai.http_limits import HttpLimits
from kvserve.openai.refusal_pacing import REPLICA_REFUSALS_PER_SECOND
from kvserve.telemetry import definitions

STOPS = [f"{i:02d}" + "q" * 254 for i in range(16)]
HUGE_PROMPT_WORDS = 760_000  # "word " × this ≈ 3.8 MB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--attackers", type=int, default=4, help="attacker processes per phase")
    p.add_argument("--victim-tokens", type=int, default=150, help="tokens per victim stream")
    p.add_argument("--victim-streams", type=int, default=3, help="victim streams per phase")
    p.add_argument("--flood-mb", type=int, default=32, help="MB of header per flood connection")
    p.add_argument("--stalled-streams", type=int, default=60, help="streams that stop reading")
    p.add_argument(
        "--stalled-tokens", type=int, default=450, help="tokens of each stream that stops reading"
    )
    p.add_argument(
        "--refusals-per-second",
        type=float,
        default=REPLICA_REFUSALS_PER_SECOND,
        help="the replica's pace of refusals (kvserve serve's flag; 0: unpaced) "
        f"(default: {REPLICA_REFUSALS_PER_SECOND:g})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HttpLimits.head_timeout,
        help="the replica's seconds for a request head (kvserve serve's flag), which the "
        f"head sent a byte a second runs into (default: {HttpLimits.head_timeout:g})",
    )


@dataclass
class Phase:
    name: str
    itl_p50_ms: float
    tpot_ms: float
    health_p99_ms: float
    idle_cpu_pct: float  # the replica's CPU with only the attackers and the prober running


def _victim_itl(url: str, tokens: int) -> tuple[float, float]:
    """ITL p50 and TPOT (ms) of one greedy stream of ``tokens`` tokens (the TPOT shows
    bursts that the p50 hides: docs/bench-methods.md)."""
    conn = Connection(url)
    try:
        rec = run_on_uvloop(conn.stream(COMPLETIONS, completion_body("Plan a trip to", tokens)))
    finally:
        conn.close()
    if not rec.ok:
        raise RuntimeError(f"the victim's stream failed: {rec.error}")
    first, last, n = rec.chunk_times[0], rec.chunk_times[-1], len(rec.chunk_times)
    tpot = definitions.tpot(first, last, n) or 0.0
    return statistics.median(definitions.itls(rec.chunk_times)) * 1000, tpot * 1000


def _attack(url: str, kind: str, stop: Any) -> None:  # in an attacker process
    os.nice(19)  # the victim and the prober, on the same CPUs, come first
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100}
    body["ignore_eos"] = True
    if kind == "stops":
        body["stop"] = STOPS
    elif kind == "huge":
        body = {"model": MODEL_NAME, "prompt": "word " * HUGE_PROMPT_WORDS, "max_tokens": 2}
    elif kind == "flood":
        body = {"model": "no-such-model", "prompt": "word", "max_tokens": 2}
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if kind == "flood":  # a new connection each time, as a refused huge body gets
        headers["connection"] = "close"
    with httpx.Client(timeout=300) as c:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):  # a refused huge body: closed
                c.post(url + "/v1/completions", content=content, headers=headers)


def _phase(url: str, replica: Proc, kind: str | None, args: argparse.Namespace) -> Phase:
    stop = mp.get_context("fork").Event()
    latencies: list[float] = []

    def probe() -> None:
        with httpx.Client(timeout=60) as c:
            while True:  # at least one probe, however short the phase
                start = time.perf_counter()
                c.get(url + "/health")
                latencies.append((time.perf_counter() - start) * 1000)
                if stop.wait(0.02):
                    return

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    procs = []
    if kind is not None:
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_attack, args=(url, kind, stop)) for _ in range(args.attackers)]
        for proc in procs:
            proc.start()
        time.sleep(1.0)  # the attack under way before the victim starts (not a sync point)
    # What the attack alone costs the replica, before the victim's stream keeps it busy.
    cpu, start = replica.cpu_seconds(), time.perf_counter()
    time.sleep(1.0)
    idle_cpu = 100 * (replica.cpu_seconds() - cpu) / (time.perf_counter() - start)
    try:
        runs = [_victim_itl(url, args.victim_tokens) for _ in range(args.victim_streams)]
    finally:
        stop.set()
        prober.join(timeout=60)
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    latencies.sort()
    itl, tpot = (statistics.median(figures) for figures in zip(*runs, strict=True))
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    return Phase(kind or "baseline", itl, tpot, p99, idle_cpu)


def _peak_mb(proc: Proc) -> float:
    peak = proc.peak_rss_bytes()
    if peak is None:
        raise RuntimeError(f"cannot read the peak memory of {proc.name}")
    return peak / 2**20


def _unfinished_requests(url: str) -> float:
    names = ("kvserve_num_requests_running", "kvserve_num_requests_waiting")
    return sum(sample.value for sample in metric_samples(url) if sample.name in names)


def _stalled_streams(url: str, port: int, streams: int, tokens: int) -> None:
    """Open ``streams`` chats that never read their answer; return once the replica has
    generated every token (their outputs wait), then close them."""
    body = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hotels in Kyoto"}],
        "max_tokens": tokens, "ignore_eos": True, "stream": True,
        "logprobs": True, "top_logprobs": 20,
    }  # fmt: skip
    content = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(content)}\r\n\r\n"
    ).encode()
    socks = []
    try:
        for _ in range(streams):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # stalls soon
            sock.connect(("127.0.0.1", port))
            sock.sendall(head + content)
            socks.append(sock)
        deadline = time.monotonic() + 600
        time.sleep(1.0)  # the requests reach the engine (the poll below is the sync point)
        while _unfinished_requests(url) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for sock in socks:
            sock.close()


def _header_flood(port: int, megabytes: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Long: ")
            for _ in range(megabytes):
                sock.sendall(b"a" * (1 << 20))
        except OSError:
            pass  # closed by the replica


def _dribbled_head_seconds(port: int) -> tuple[float, str]:
    """Seconds until a head sent a byte a second is answered, and the answer's status."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.setblocking(False)
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n" * 10:
            try:
                answer = sock.recv(4096)
                return time.perf_counter() - start, answer.split(b"\r\n")[0].decode()
            except BlockingIOError:
                pass
            sock.send(bytes([byte]))
            time.sleep(1.0)
    return time.perf_counter() - start, "never answered"


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        from kvserve.demo_model import default_model_dir

        args.model = str(default_model_dir())
    settings = LaunchSettings(model=args.model, dtype=args.dtype)
    # The replica on CPUs of its own, the clients on the others (docs/bench-methods.md).
    placement = split_cpus(True)
    replica_cpus, client_cpus = placement.others, placement.gateway
    with (
        tempfile.TemporaryDirectory(prefix="kvserve-attacks-") as tmp,
        Launcher(settings, Path(tmp)) as launcher,
        running_on(client_cpus),
    ):
        (replica,) = launcher.start_replicas(
            1,
            grpc=False,
            cpus=replica_cpus,
            extra_flags=[
                "--refusals-per-second",
                str(args.refusals_per_second),
                "--header-timeout",
                str(args.header_timeout),
            ],
        )
        url, port = replica.http_url, int(replica.http_url.rsplit(":", 1)[1])
        _victim_itl(url, 8)  # warm-up
        phases = [
            _phase(url, replica.proc, kind, args)
            for kind in (None, "load", "stops", "huge", "flood")
        ]
        unread = _peak_mb(replica.proc)
        _stalled_streams(url, port, args.stalled_streams, args.stalled_tokens)
        before = _peak_mb(replica.proc)
        floods = [
            threading.Thread(target=_header_flood, args=(port, args.flood_mb)) for _ in range(4)
        ]
        for flood in floods:
            flood.start()
        for flood in floods:
            flood.join(timeout=120)
        after = _peak_mb(replica.proc)
        dribble_s, dribble_status = _dribbled_head_seconds(port)
    by = {p.name: p for p in phases}
    if client_cpus is None or replica_cpus is None:
        print("placement: none (one CPU): the attackers' own work shares the replica's CPU")
    else:
        print(
            f"placement: the replica on CPU {cpu_list(replica_cpus)}, the clients on CPU "
            f"{cpu_list(client_cpus)} (attackers at nice 19)"
        )
    print(f"refusals paced to {args.refusals_per_second:g} a second (0: unpaced)")
    widths = (10, 12, 10, 16, 20)
    print(
        text_row(
            ["phase", "ITL p50 ms", "TPOT ms", "/health p99 ms", "replica CPU, idle %"], widths
        )
    )
    for p in phases:
        row = [p.name, p.itl_p50_ms, p.tpot_ms, p.health_p99_ms, p.idle_cpu_pct]
        print(text_row(row, widths, ".2f .2f .1f .1f"))

    def times(x: float, y: float) -> str:
        # On a busy machine a short stream's chunks can arrive together: a 0 ms gap.
        return f"{x / y:.2f}x" if y > 0 else "n/a (0 ms base)"

    def ratio(a: str, b: str) -> str:
        x, y = by[a], by[b]
        return f"{times(x.itl_p50_ms, y.itl_p50_ms)} ITL p50, {times(x.tpot_ms, y.tpot_ms)} TPOT"

    print(
        f"stops vs load (the same requests without stop strings): {ratio('stops', 'load')} "
        "(target <= 1.2)"
    )
    print(
        f"huge vs baseline: {ratio('huge', 'baseline')} (target <= 1.2), /health p99 "
        f"{by['huge'].health_p99_ms:.1f} ms (target <= 50)"
    )
    print(
        f"huge vs flood (the same loop of refused requests, 60-byte bodies): "
        f"{ratio('huge', 'flood')}; flood vs baseline: {ratio('flood', 'baseline')}"
    )
    print(
        f"{args.stalled_streams} streams that stop reading ({args.stalled_tokens} tokens, "
        f"top_logprobs 20): peak RSS {unread:.1f} -> {before:.1f} MB "
        f"(+{before - unread:.1f}; {(before - unread) * 1024 / args.stalled_streams:.0f} kB "
        "a stream)"
    )
    print(
        f"4 x {args.flood_mb} MB header floods: peak RSS {before:.1f} -> {after:.1f} MB "
        f"(+{after - before:.1f}; target <= +10)"
    )
    print(f"a head sent a byte a second: {dribble_status!r} after {dribble_s:.1f} s")
    return 0
