"""``kvserve bench gateway``: what the gateway adds to a streaming workload, how many
streamed chunks it can serve on one core, and what prefix routing buys over round-robin.

Everything runs as separate processes on 127.0.0.1, as in production: the replicas are
``kvserve serve`` processes (HTTP for the direct path, gRPC for the gateway), the gateway
a ``kvserve gateway --config FILE`` process with a generated config and keys file, and
this process is the client. Separate processes let the gateway's own CPU time be read
from ``/proc/PID/stat`` around each measured window.

Three phases (``--phase``; ``all`` runs them in this order):

* **overhead**: one replica (prefix caching off, so repeating the workload costs the
  engine the same each time). The same workload, ``--requests`` streamed completions
  (``ignore_eos``, greedy; output lengths uniform in ``--max-tokens`` × (1 ±
  ``--max-tokens-spread``), seeded, so streams end at different steps as in production)
  from ``--streams`` concurrent clients, goes direct to the replica's HTTP API and
  through the gateway, alternated within each of ``--rounds`` rounds (ABBA order, so
  drift in machine load falls on both paths alike). Client-side TTFT and every
  inter-token gap are recorded per request (``bench.sse_client``: send = just before the
  request's one write, chunks timed when their read completes). The gateway's added
  latency is the difference of the medians; each request is also found in the replica's
  request log and split at its engine (TTFT inside and outside the engine, delay added
  per gap beyond the engine's pace), which separates what the path adds from how the
  requests fell into batches. The gateway's efficiency at that load is the text chunks it
  streamed per CPU-second of its process. Then ``--lone-pairs`` lone requests on each
  path, one at a time and interleaved: the medians of their paired differences are the
  latency the gateway adds without batching noise.
* **capacity** (``bench.gateway_capacity``): the gateway alone on one CPU, fed by a stub
  replica (canned tokens over the engine's gRPC API) and a light load generator on the
  other CPUs, with more streams than one core can serve: the chunks per second it
  delivers saturated are its capacity on one core.
* **routing**: ``--replicas`` replicas, an agent workload: ``--agents`` agents share one
  system prompt of about ``--system-tokens`` tokens (built deterministically from
  ``--seed``, counted with the model's tokenizer) and each asks ``--questions`` short
  questions in turn, keeping its conversation (``--no-history``: each question alone
  after the system prompt). It runs once with ``routing.policy: prefix`` and once with
  ``round_robin``, each on freshly started replicas (cold prefix caches) behind a freshly
  started gateway. Reported: the cached-token ratio (Σ cached_tokens / Σ prompt_tokens
  from the streams' usage), TTFT, and the gateway's routing decisions per replica.

Why conversations by default: the gateway's prefix key is a chat's messages up to the
first user message, cut to ``routing.prefix_chars`` (512). A ~200-token system prompt is
shorter than that with the demo tokenizer (~2 characters per token), so the key also
holds the agent's first question: prefix routing keeps each agent on one replica, where
its conversation so far is cached, while round-robin scatters its turns. Independent
questions share only the system prompt, which every replica caches after its first
request under either policy.

CPU placement (``--placement``, overhead and capacity phases): ``separate`` (the default)
runs the gateway alone on the first CPU and the replica, the stub replica and this
process's client on the others, as in production, where the gateway has its own pod and
never takes CPU from a replica. It needs two CPUs; with one, or ``shared``, every process
may run on every CPU, and on a small machine the gateway's own work then slows the
replica it is measured against. Either way the direct path has the replica serve HTTP and
SSE itself, work the gateway path moves to the gateway (the replica speaks gRPC to it), so
with ``separate`` the gateway path can come out faster at 64 streams. The routing phase
always shares the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.cpu import Placement, running_on, split_cpus, usable_cpus
from kvserve.bench.gateway_capacity import CapacityResult, print_capacity, run_capacity
from kvserve.bench.processes import Proc, free_ports, spawn, stop, wait_listening, wait_ready
from kvserve.bench.serving import (
    MODEL_NAME,
    ClientRecord,
    _body,
    _client,
    _ms,
    _percentile,
    _request_log,
    _same_clock,
    run_on_uvloop,
    stream_sse,
)
from kvserve.bench.sse_client import Connection
from kvserve.bench.timelines import Workload
from kvserve.config import DEFAULT_BLOCK_SIZE, DTYPES
from kvserve.telemetry import definitions

if TYPE_CHECKING:
    import httpx

# The issue's targets, printed next to the measured figures.
TARGET_TTFT_ADDED_MS = 5.0
TARGET_ITL_ADDED_MS = 0.5

POLICIES = ("prefix", "round_robin")
DESCRIPTION = (
    "The gateway's added latency and CPU cost on a streaming workload, and prefix vs "
    "round-robin routing on a shared-prefix agent workload (docs/gateway-config.md)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", choices=("overhead", "capacity", "routing", "all"), default="all")
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="KV block size of the replicas"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        help="replicas' max_num_seqs (default: enough for --streams and --agents)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds for a process to be ready"
    )
    p.add_argument(
        "--placement",
        choices=("separate", "shared"),
        default="separate",
        help="overhead and capacity phases: 'separate' runs the gateway alone on one CPU and "
        "everything else on the others, as in production where it has its own pod (needs "
        "≥ 2 CPUs; with fewer, or 'shared', every process may run on every CPU)",
    )
    o = p.add_argument_group("overhead phase")
    o.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    o.add_argument("--requests", type=int, default=384, help="requests per pass")
    o.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    o.add_argument(
        "--max-tokens-spread",
        type=float,
        default=0.5,
        help="output lengths uniform in --max-tokens × (1 ± this), seeded; 0: all equal, "
        "so the streams start and end in waves of --streams requests at once",
    )
    o.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    o.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of direct + gateway passes (order alternates between rounds)",
    )
    o.add_argument(
        "--lone-pairs",
        type=int,
        default=32,
        help="then this many lone requests on each path, one at a time and interleaved, "
        "for the latency the gateway adds without batching noise (0: skip)",
    )
    c = p.add_argument_group("capacity phase (also uses --max-tokens and --rounds)")
    c.add_argument(
        "--capacity-streams",
        type=int,
        default=128,
        help="concurrent streams offered to the gateway (more than it can serve on one core)",
    )
    c.add_argument("--capacity-requests", type=int, default=2048, help="requests per round")
    r = p.add_argument_group("routing phase")
    r.add_argument("--replicas", type=int, default=3)
    r.add_argument("--agents", type=int, default=8, help="agents running concurrently")
    r.add_argument("--questions", type=int, default=4, help="questions each agent asks in turn")
    r.add_argument(
        "--system-tokens", type=int, default=200, help="size of the shared system prompt"
    )
    r.add_argument(
        "--routing-max-tokens", type=int, default=32, help="output tokens per agent answer"
    )
    r.add_argument(
        "--no-history",
        dest="history",
        action="store_false",
        help="send each question alone after the system prompt (default: each agent keeps "
        "its conversation, so later questions carry the earlier turns)",
    )


@dataclass
class ReplicaProc:
    proc: Proc
    http_url: str
    grpc_address: str  # host:port, as the gateway's metrics label it


class Launcher:
    """Starts replicas and gateways for one benchmark run, and stops everything it started
    (also on errors and Ctrl-C: ``run`` calls ``stop_all`` in a ``finally``)."""

    def __init__(self, args: argparse.Namespace, model: str, workdir: Path) -> None:
        self.args = args
        self.model = model
        self.workdir = workdir
        self.started: list[Proc] = []
        self._count = 0

    def stop_all(self) -> None:
        stop(self.started)

    def _name(self, kind: str) -> tuple[str, Path]:
        self._count += 1
        name = f"{kind}-{self._count}"
        return name, self.workdir / f"{name}.log"

    def _env(self, threads: int | None) -> dict[str, str]:
        env = dict(os.environ)
        if threads is not None and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(threads)
        return env

    def start_replicas(
        self,
        n: int,
        *extra: str,
        threads: int | None = None,
        cpus: frozenset[int] | None = None,
        log_level: str = "warning",
    ) -> list[ReplicaProc]:
        """``n`` replicas started together (on ``cpus`` when given); returns once every
        one answers /ready. At ``log_level`` info their logs hold the request log."""
        a = self.args
        max_seqs = a.max_num_seqs or max(a.streams, a.agents, 1)
        reps: list[ReplicaProc] = []
        for _ in range(n):
            http_port, grpc_port = free_ports(2)
            name, log = self._name("replica")
            argv = [
                sys.executable, "-m", "kvserve", "serve", "--model", self.model,
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
                "--port", str(http_port), "--grpc-port", str(grpc_port),
                "--dtype", a.dtype, "--device", a.device, "--block-size", str(a.block_size),
                "--max-num-seqs", str(max_seqs),
                "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                "--seed", str(a.seed), "--drain-timeout", "2", "--log-level", log_level, *extra,
            ]  # fmt: skip
            proc = spawn(name, argv, log, self._env(threads), cpus)
            self.started.append(proc)
            reps.append(
                ReplicaProc(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
            )
        deadline = time.monotonic() + a.startup_timeout
        for rep in reps:
            wait_ready(rep.proc, f"{rep.http_url}/ready", deadline)
        return reps

    def start_stub_replica(self, cpus: frozenset[int] | None = None) -> str:
        """A stub replica (``bench.stub_replica``) on ``cpus``; returns its gRPC address
        once it listens."""
        (port,) = free_ports(1)
        name, log = self._name("stub-replica")
        argv = [sys.executable, "-m", "kvserve.bench.stub_replica", "--port", str(port)]
        proc = spawn(name, argv, log, self._env(None), cpus)
        self.started.append(proc)
        wait_listening(proc, port, time.monotonic() + self.args.startup_timeout)
        return f"127.0.0.1:{port}"

    def start_gateway(
        self, addresses: Sequence[str], policy: str, cpus: frozenset[int] | None = None
    ) -> tuple[Proc, str, str]:
        """A gateway for the replicas at ``addresses`` (gRPC ``host:port``) with routing
        ``policy``, on ``cpus`` when given; returns once it can route to every replica.
        Returns the process, its URL and the API key."""
        import yaml

        from kvserve.gateway.keys import new_key

        a = self.args
        (port,) = free_ports(1)
        name, log = self._name("gateway")
        key, digest = new_key()
        keys_path = self.workdir / f"{name}-keys.yaml"
        config_path = self.workdir / f"{name}.yaml"
        # One key, no rate limits (null = unlimited), highest priority.
        entry = {"tenant": "bench", "sha256": digest, "models": ["*"], "priority": "critical"}
        keys = {"keys": [entry]}
        in_flight = max(a.streams, a.agents, a.capacity_streams, 1)
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "models": {
                MODEL_NAME: {
                    "replicas": [f"grpc://{address}" for address in addresses],
                    # Never the bottleneck: the gateway must not queue what the replica
                    # would run, or the comparison measures the queue.
                    "max_in_flight_per_replica": in_flight,
                }
            },
            "routing": {"policy": policy},
            "admission": {"queue_size": max(256, a.requests, a.agents)},
            "keys_file": keys_path.name,
        }
        keys_path.write_text(yaml.safe_dump(keys))
        config_path.write_text(yaml.safe_dump(config))
        argv = [
            sys.executable, "-m", "kvserve", "gateway", "--config", str(config_path),
            "--log-level", "warning",
        ]  # fmt: skip
        proc = spawn(name, argv, log, self._env(None), cpus)
        self.started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def all_routable(r: httpx.Response) -> bool:
            return bool(r.json().get("replicas", {}).get(MODEL_NAME) == len(addresses))

        wait_ready(proc, f"{url}/ready", time.monotonic() + a.startup_timeout, all_routable)
        return proc, url, key


# ---- figures -------------------------------------------------------------------------
def _ttfts(records: Sequence[ClientRecord]) -> list[float]:
    return [definitions.ttft(r.send, r.first) for r in records if r.ok and r.first is not None]


def _itls(records: Sequence[ClientRecord]) -> list[float]:
    return [gap for r in records if r.ok for gap in definitions.itls(r.chunk_times)]


def _chunks(records: Sequence[ClientRecord]) -> int:
    return sum(len(r.chunk_times) for r in records if r.ok)


@dataclass
class PassResult:
    """One timed pass of the overhead workload on one path."""

    path: str  # "direct" or "gateway"
    round: int
    seconds: float
    requests_ok: int
    requests_failed: int
    chunks: int  # SSE chunks with text, as received
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    gateway_cpu_seconds: float | None  # None on the direct path
    replica_cpu_seconds: float


@dataclass
class PathStats:
    """One path over all rounds (medians and p90s of the pooled requests)."""

    requests_ok: int
    requests_failed: int
    chunks: int
    seconds: float  # sum of its passes' wall times
    chunks_per_second: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    replica_cpu_seconds: float
    # Each request's latencies split at the replica's engine, from the replica's request
    # log (same clock as the client); medians over the requests found in it (None: no
    # log, or not one clock on this OS). TTFT: the engine's own part, arrival → first
    # token (waiting for a batch, prefill), and the rest (the way in before arrival, the
    # way out after the token). Gaps: client TPOT − the engine's TPOT, the delay the way
    # out adds per gap on top of the engine's own pace.
    engine_ttft_p50_ms: float | None = None
    ttft_outside_engine_p50_ms: float | None = None
    gap_added_p50_ms: float | None = None
    split_requests: int = 0


@dataclass
class OverheadResult:
    streams: int
    requests: int
    max_tokens: int
    output_tokens_min: int  # the workload's output lengths (ignore_eos: exact)
    output_tokens_max: int
    output_tokens_per_pass: int
    prompt_tokens: int
    rounds: int
    placement: str
    direct: PathStats
    gateway: PathStats
    ttft_p50_added_ms: float | None  # gateway − direct
    ttft_p90_added_ms: float | None
    itl_p50_added_ms: float | None
    itl_p90_added_ms: float | None
    # The same, of each request's TTFT outside the replica's engine, and of the delay
    # added per gap beyond the engine's pace (see PathStats).
    ttft_outside_engine_added_ms: float | None
    gap_added_by_gateway_ms: float | None
    gateway_cpu_seconds: float  # Δ(utime + stime) over the gateway passes
    gateway_chunks: int
    gateway_chunks_per_cpu_second: float | None
    gateway_cpu_busy: float | None  # CPU-seconds / wall seconds of the gateway passes
    # The floor: a bare grpc.aio client (this process, uvloop) reading the same streams
    # straight from the replica, once per round.
    grpc_client_messages: int
    grpc_client_cpu_seconds: float
    grpc_client_messages_per_cpu_second: float | None
    # Lone requests, one at a time, direct and through the gateway in turn: medians (and
    # quartiles) of the pairs' differences, gateway − direct; ITL per request is the
    # median of its own gaps.
    lone_pairs: int = 0
    lone_ttft_added_ms: float | None = None
    lone_ttft_added_q1_ms: float | None = None
    lone_ttft_added_q3_ms: float | None = None
    lone_itl_added_ms: float | None = None
    lone_itl_added_q1_ms: float | None = None
    lone_itl_added_q3_ms: float | None = None
    target_ttft_added_ms: float = TARGET_TTFT_ADDED_MS
    target_itl_added_ms: float = TARGET_ITL_ADDED_MS
    passes: list[PassResult] = field(default_factory=list)


@dataclass
class PolicyResult:
    policy: str
    seconds: float
    requests_ok: int
    requests_failed: int
    prompt_tokens: int  # Σ usage.prompt_tokens
    cached_tokens: int  # Σ usage.prompt_tokens_details.cached_tokens
    cached_ratio: float | None
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    requests_per_replica: list[int]  # the gateway's routing decisions, by replica
    routing_overrides: int  # prefix routes sent elsewhere (load bound or retry)


@dataclass
class RoutingResult:
    replicas: int
    agents: int
    questions: int
    history: bool
    system_prompt_tokens: int
    max_tokens: int
    replica_omp_threads: int | None  # OMP_NUM_THREADS given to each replica (None: inherited)
    policies: list[PolicyResult]


@dataclass
class Report:
    model: str
    dtype: str
    device: str
    cpus: int
    overhead: OverheadResult | None = None
    capacity: CapacityResult | None = None
    routing: RoutingResult | None = None


@dataclass
class EngineSplit:
    """One request's latencies split at the replica's engine (seconds; see PathStats)."""

    engine_ttft: float  # arrival → first token, in the engine
    outside_ttft: float  # client TTFT − that: the way in and the way out
    gap_added: float | None  # client TPOT − the engine's (None: fewer than 2 tokens)


def _pass_tag(path: str, round_: int) -> str:
    """The request id prefix of a pass: its request ``i`` is ``{tag}-{i}``."""
    return f"{path}-r{round_}"


def _split_at_engine(
    records: Sequence[ClientRecord], tag: str, log: dict[str, dict[str, Any]]
) -> list[EngineSplit]:
    """The split of each request of a pass found in the replica's request log (request
    ``i`` is ``{tag}-{i}``)."""
    split = []
    for i, rec in enumerate(records):
        entry = log.get(f"{tag}-{i}")
        if entry is None or not rec.ok or rec.first is None or rec.last is None:
            continue
        f, e = entry.get("first_token_time"), entry.get("last_token_time")
        if f is None or e is None:
            continue
        engine = float(f) - float(entry["arrival_time"])
        tokens = int(entry["output_tokens"])
        # Each chunk's delay after its token, last minus first, spread over the gaps.
        gap = (
            ((rec.last - float(e)) - (rec.first - float(f))) / (tokens - 1) if tokens > 1 else None
        )
        split.append(EngineSplit(engine, definitions.ttft(rec.send, rec.first) - engine, gap))
    return split


def _path_stats(
    passes: Sequence[tuple[PassResult, list[ClientRecord]]], split: Sequence[EngineSplit] = ()
) -> PathStats:
    records = [rec for _, recs in passes for rec in recs]
    seconds = sum(p.seconds for p, _ in passes)
    ttfts, itls = _ttfts(records), _itls(records)
    return PathStats(
        requests_ok=sum(r.ok for r in records),
        requests_failed=sum(not r.ok for r in records),
        chunks=_chunks(records),
        seconds=round(seconds, 3),
        chunks_per_second=round(_chunks(records) / seconds, 1) if seconds > 0 else 0.0,
        ttft_p50_ms=_ms(_percentile(ttfts, 50)),
        ttft_p90_ms=_ms(_percentile(ttfts, 90)),
        itl_p50_ms=_ms(_percentile(itls, 50)),
        itl_p90_ms=_ms(_percentile(itls, 90)),
        replica_cpu_seconds=round(sum(p.replica_cpu_seconds for p, _ in passes), 2),
        engine_ttft_p50_ms=_ms(_percentile([x.engine_ttft for x in split], 50)),
        ttft_outside_engine_p50_ms=_ms(_percentile([x.outside_ttft for x in split], 50)),
        gap_added_p50_ms=_ms(
            _percentile([x.gap_added for x in split if x.gap_added is not None], 50)
        ),
        split_requests=len(split),
    )


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


# ---- phase 1: overhead -------------------------------------------------------------------
def _overhead_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    """``--requests`` prompts of ``--prompt-len`` random ordinary token ids (seeded)."""
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    prompts = [[rng.choice(ids) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    lo = max(1, round(args.max_tokens * (1 - args.max_tokens_spread)))
    hi = max(lo, round(args.max_tokens * (1 + args.max_tokens_spread)))
    return Workload(prompts, [rng.randint(lo, hi) for _ in range(args.requests)])


async def _overhead_pass(
    url: str,
    key: str | None,
    work: Workload,
    streams: int,
    procs: Sequence[Proc],
    tag: str | None = None,
) -> tuple[float, list[ClientRecord], list[float]]:
    """``streams`` clients (``sse_client``, one keep-alive connection each) drain the
    workload; returns wall seconds, the records (in the workload's order), and each of
    ``procs``' CPU seconds over the timed window (warm-up excluded). With ``tag``, request
    ``i`` goes as request id ``{tag}-{i}``."""
    n = min(streams, len(work.prompts))
    connections = [Connection(url, key) for _ in range(n)]
    records: list[ClientRecord | None] = [None] * len(work.prompts)
    todo = iter(range(len(work.prompts)))

    async def worker(conn: Connection) -> None:
        for i in todo:
            body = _body(work.prompts[i], work.output_lens[i])
            rid = None if tag is None else f"{tag}-{i}"
            records[i] = await conn.stream("/v1/completions", body, rid)

    try:
        # Warm-up: the connections (and the gateway's channel), outside the timed window.
        warm = await asyncio.gather(
            *(c.stream("/v1/completions", _body(work.prompts[0], 2)) for c in connections)
        )
        errors = [rec.error for rec in warm if rec.error]
        if errors:
            raise RuntimeError(f"warm-up request to {url} failed: {errors[0]}")
        cpu0 = [p.cpu_seconds() for p in procs]
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in connections))
        seconds = time.perf_counter() - start
        cpu = [p.cpu_seconds() - c for p, c in zip(procs, cpu0, strict=True)]
    finally:
        for c in connections:
            c.close()
    done = [r for r in records if r is not None]
    assert len(done) == len(records), "every request of the pass has its record"
    return seconds, done, cpu


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _grpc_client_pass(
    address: str, work: Workload, streams: int, tag: str
) -> tuple[int, float]:
    """The gRPC floor: ``streams`` workers read the workload's streams straight from the
    replica with the gateway's own upstream client (``ReplicaClient``: one shared
    ``GenerateMany`` call) in this process, nothing else running in it meanwhile.
    Returns the delta messages with text and this process's CPU seconds over the timed
    window."""
    from kvserve.gateway.upstream import ReplicaClient
    from kvserve.rpc.codec import encode_request
    from kvserve.sampling_params import SamplingParams

    client = ReplicaClient(address)
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(work.prompts)):
        todo.put_nowait(i)

    async def one(rid: str, prompt: list[int], max_tokens: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        call = client.generate(encode_request(prompt, params, request_id=rid), 600.0, {})
        texts = 0
        async for msg in call:
            if msg.WhichOneof("kind") == "delta" and msg.delta.text:
                texts += 1
        return texts

    async def worker() -> int:
        texts = 0
        while True:
            try:
                i = todo.get_nowait()
            except asyncio.QueueEmpty:
                return texts
            texts += await one(f"{tag}-{i}", work.prompts[i], work.output_lens[i])

    try:
        await one(f"{tag}-warm-up", work.prompts[0], 2)  # the channel's connection
        cpu0 = _own_cpu_seconds()
        counts = await asyncio.gather(*(worker() for _ in range(min(streams, len(work.prompts)))))
        return sum(counts), _own_cpu_seconds() - cpu0
    finally:
        await client.close()


@dataclass
class LonePair:
    """One lone request on each path (seconds): TTFT and the median of its own gaps."""

    ttft_direct: float
    ttft_gateway: float
    itl_direct: float
    itl_gateway: float


async def _lone_pairs(
    direct_url: str, gateway_url: str, key: str, work: Workload, n: int
) -> list[LonePair]:
    """``n`` lone requests on each path, one at a time, the order swapped every pair (so
    drift falls on both alike). Only pairs where both requests succeeded are kept."""
    pairs: list[LonePair] = []
    direct, via = Connection(direct_url), Connection(gateway_url, key)
    try:
        for i in range(n):
            body = _body(work.prompts[i % len(work.prompts)], work.output_lens[0])
            if i % 2 == 0:
                d = await direct.stream("/v1/completions", body)
                g = await via.stream("/v1/completions", body)
            else:
                g = await via.stream("/v1/completions", body)
                d = await direct.stream("/v1/completions", body)
            if not (d.ok and g.ok and d.first is not None and g.first is not None):
                continue
            gaps_d, gaps_g = definitions.itls(d.chunk_times), definitions.itls(g.chunk_times)
            if not gaps_d or not gaps_g:
                continue
            pairs.append(
                LonePair(
                    definitions.ttft(d.send, d.first),
                    definitions.ttft(g.send, g.first),
                    statistics.median(gaps_d),
                    statistics.median(gaps_g),
                )
            )
    finally:
        direct.close()
        via.close()
    return pairs


def _median_and_quartiles(values: Sequence[float]) -> tuple[float | None, ...]:
    """Median, first and third quartile in ms (None when there are too few values)."""
    if len(values) < 2:
        return (_ms(values[0]) if values else None, None, None)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return _ms(q2), _ms(q1), _ms(q3)


def run_overhead(
    args: argparse.Namespace, launcher: Launcher, tokenizer: Any, say: Callable[[str], None]
) -> OverheadResult:
    work = _overhead_workload(args, tokenizer)
    placement = split_cpus(args.placement == "separate")
    say(
        f"overhead: starting 1 replica (prefix caching off) and the gateway; {placement.describe()}"
    )
    # Prefix caching off: every pass repeats the same prompts, and must cost the same.
    # The replica's OpenMP team leaves one CPU to the gateway (and, shared, the client): a
    # team as wide as the machine stalls at every barrier while those run, which swamped
    # the comparison (5x slower steps on 2 cores) unless the caller set OMP_NUM_THREADS.
    threads = len(placement.others) if placement.others else max(1, usable_cpus() - 1)
    (rep,) = launcher.start_replicas(
        1, "--no-prefix-caching", threads=threads, cpus=placement.others, log_level="info"
    )
    gateway, gw_url, key = launcher.start_gateway(
        [rep.grpc_address], "prefix", cpus=placement.gateway
    )
    with running_on(placement.others):  # the client: never on the gateway's CPU
        return _overhead_rounds(args, launcher, work, rep, gateway, gw_url, key, placement, say)


def _overhead_rounds(
    args: argparse.Namespace,
    launcher: Launcher,
    work: Workload,
    rep: ReplicaProc,
    gateway: Proc,
    gw_url: str,
    key: str,
    placement: Placement,
    say: Callable[[str], None],
) -> OverheadResult:
    # An untimed pass of one request per stream on each path first: the engine's first
    # steps at each batch size, and the gRPC path's first calls, are several times slower
    # than later ones, and would otherwise fall on whichever path runs first.
    n = min(args.streams, args.requests)
    warm = Workload(work.prompts[:n], work.output_lens[:n])
    say(f"  warm-up: {n} requests on each path (not measured) ...")
    for url, k in ((rep.http_url, None), (gw_url, key)):
        _, recs, _ = asyncio.run(_overhead_pass(url, k, warm, args.streams, []))
        errors = [r.error or "no finish_reason" for r in recs if not r.ok]
        if errors:
            raise RuntimeError(f"{len(errors)} warm-up requests to {url} failed: {errors[0]}")
    passes: list[tuple[PassResult, list[ClientRecord]]] = []
    floor_messages, floor_cpu = 0, 0.0
    for r in range(args.rounds):
        order = ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")
        for path in order:
            via_gw = path == "gateway"
            procs = [rep.proc, gateway] if via_gw else [rep.proc]
            seconds, recs, cpu = asyncio.run(
                _overhead_pass(
                    gw_url if via_gw else rep.http_url,
                    key if via_gw else None,
                    work,
                    args.streams,
                    procs,
                    _pass_tag(path, r + 1),
                )
            )
            result = PassResult(
                path=path,
                round=r + 1,
                seconds=round(seconds, 3),
                requests_ok=sum(x.ok for x in recs),
                requests_failed=sum(not x.ok for x in recs),
                chunks=_chunks(recs),
                ttft_p50_ms=_ms(_percentile(_ttfts(recs), 50)),
                itl_p50_ms=_ms(_percentile(_itls(recs), 50)),
                gateway_cpu_seconds=round(cpu[1], 2) if via_gw else None,
                replica_cpu_seconds=round(cpu[0], 2),
            )
            passes.append((result, recs))
            say(
                f"  round {r + 1}/{args.rounds} {path:<7} {seconds:6.2f} s, TTFT p50 "
                f"{result.ttft_p50_ms} ms, ITL p50 {result.itl_p50_ms} ms"
                + (f", gateway CPU {cpu[1]:.2f} s" if via_gw else "")
                + (f" ({result.requests_failed} failed)" if result.requests_failed else "")
            )
        # On uvloop where installed, as the gateway's uvicorn runs.
        texts, cpu_s = run_on_uvloop(
            _grpc_client_pass(rep.grpc_address, work, args.streams, f"floor-{r}")
        )
        floor_messages += texts
        floor_cpu += cpu_s
        say(f"  round {r + 1}/{args.rounds} bare gRPC client: {texts} messages, {cpu_s:.2f} CPU-s")
    lone: list[LonePair] = []
    if args.lone_pairs > 0:
        say(f"  {args.lone_pairs} lone requests on each path, one at a time, interleaved ...")
        lone = run_on_uvloop(_lone_pairs(rep.http_url, gw_url, key, work, args.lone_pairs))
    launcher.stop_all()  # the request log is complete once the replica has stopped
    engine_log = _request_log(rep.proc.log) if _same_clock() else {}
    splits: dict[str, list[EngineSplit]] = {"direct": [], "gateway": []}
    for result, recs in passes:
        tag = _pass_tag(result.path, result.round)
        splits[result.path] += _split_at_engine(recs, tag, engine_log)
    lone_ttft = _median_and_quartiles([p.ttft_gateway - p.ttft_direct for p in lone])
    lone_itl = _median_and_quartiles([p.itl_gateway - p.itl_direct for p in lone])
    direct = _path_stats([p for p in passes if p[0].path == "direct"], splits["direct"])
    via = _path_stats([p for p in passes if p[0].path == "gateway"], splits["gateway"])
    gw_cpu = sum(p.gateway_cpu_seconds or 0.0 for p, _ in passes)
    return OverheadResult(
        streams=args.streams,
        requests=args.requests,
        max_tokens=args.max_tokens,
        output_tokens_min=min(work.output_lens),
        output_tokens_max=max(work.output_lens),
        output_tokens_per_pass=sum(work.output_lens),
        prompt_tokens=args.prompt_len,
        rounds=args.rounds,
        placement=placement.describe(),
        direct=direct,
        gateway=via,
        ttft_p50_added_ms=_diff(via.ttft_p50_ms, direct.ttft_p50_ms),
        ttft_p90_added_ms=_diff(via.ttft_p90_ms, direct.ttft_p90_ms),
        itl_p50_added_ms=_diff(via.itl_p50_ms, direct.itl_p50_ms),
        ttft_outside_engine_added_ms=_diff(
            via.ttft_outside_engine_p50_ms, direct.ttft_outside_engine_p50_ms
        ),
        gap_added_by_gateway_ms=_diff(via.gap_added_p50_ms, direct.gap_added_p50_ms),
        itl_p90_added_ms=_diff(via.itl_p90_ms, direct.itl_p90_ms),
        gateway_cpu_seconds=round(gw_cpu, 2),
        gateway_chunks=via.chunks,
        gateway_chunks_per_cpu_second=round(via.chunks / gw_cpu, 1) if gw_cpu > 0 else None,
        gateway_cpu_busy=round(gw_cpu / via.seconds, 3) if via.seconds > 0 else None,
        grpc_client_messages=floor_messages,
        grpc_client_cpu_seconds=round(floor_cpu, 4),
        grpc_client_messages_per_cpu_second=(
            round(floor_messages / floor_cpu, 1) if floor_cpu > 0 else None
        ),
        passes=[p for p, _ in passes],
        lone_pairs=len(lone),
        lone_ttft_added_ms=lone_ttft[0],
        lone_ttft_added_q1_ms=lone_ttft[1],
        lone_ttft_added_q3_ms=lone_ttft[2],
        lone_itl_added_ms=lone_itl[0],
        lone_itl_added_q1_ms=lone_itl[1],
        lone_itl_added_q3_ms=lone_itl[2],
    )


# ---- phase 2: capacity (kvserve.bench.gateway_capacity) --------------------------------
def run_capacity_phase(
    args: argparse.Namespace, launcher: Launcher, say: Callable[[str], None]
) -> CapacityResult:
    placement = split_cpus(args.placement == "separate")
    say(f"capacity: starting a stub replica and the gateway; {placement.describe()}")
    address = launcher.start_stub_replica(placement.others)
    gateway, url, key = launcher.start_gateway([address], "prefix", cpus=placement.gateway)
    result = run_capacity(args, gateway, int(url.rsplit(":", 1)[1]), key, placement, say)
    launcher.stop_all()
    return result


# ---- phase 3: routing ----------------------------------------------------------------------
_WORDS = (
    "travel", "train", "flight", "hotel", "booking", "ticket", "station", "airport",
    "luggage", "refund", "delay", "platform", "passport", "itinerary", "connection",
    "seat", "window", "aisle", "breakfast", "checkout", "museum", "harbour", "ferry",
    "bicycle", "map", "weather", "budget", "receipt", "schedule", "guide",
)  # fmt: skip
_CITIES = ("Lisbon", "Vienna", "Oslo", "Porto", "Prague", "Seville", "Ghent", "Turin")


def system_prompt(tokenizer: Any, tokens: int, seed: int) -> tuple[str, int]:
    """A deterministic system prompt of about ``tokens`` tokens, and its exact count."""
    rng = random.Random(seed)
    text = "You are a travel desk agent. Follow these notes:"

    def count(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=False))

    while count(text) < tokens:
        text += " " + rng.choice(_WORDS)
    return text, count(text)


def agent_questions(agents: int, questions: int, seed: int) -> list[list[str]]:
    """Each agent's questions: short, distinct, deterministic."""
    rng = random.Random(seed + 1)
    return [
        [
            f"Agent {a + 1}, question {q + 1}: the {rng.choice(_WORDS)} from "
            f"{rng.choice(_CITIES)} to {rng.choice(_CITIES)}?"
            for q in range(questions)
        ]
        for a in range(agents)
    ]


@dataclass
class ChatRecord(ClientRecord):
    """A streamed chat request, with the usage the routing comparison needs."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""


async def _stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> ChatRecord:
    """Stream one chat completion (timing: ``serving.stream_sse``), keeping the usage
    (cached tokens) and the reply."""
    rec = ChatRecord(send=time.perf_counter())
    parts: list[str] = []

    def handle(event: dict[str, Any], now: float) -> None:
        usage = event.get("usage")
        if usage:
            rec.output_tokens = int(usage["completion_tokens"])
            rec.prompt_tokens = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in event.get("choices", ()):
            content = (choice.get("delta") or {}).get("content")
            if content:
                rec.chunk_times.append(now)
                parts.append(content)
            if choice.get("finish_reason") is not None:
                rec.finish_reason = choice["finish_reason"]

    await stream_sse(client, "/v1/chat/completions", body, rec, handle)
    rec.text = "".join(parts)
    return rec


def _chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _warm_replicas(replicas: Sequence[ReplicaProc]) -> None:
    """One tiny request to each replica directly (first forward passes, lazy set-up).

    It starts with a user message, so it shares no KV block with the agents' prompts
    (which start with the system prompt): the caches stay cold for what is measured.
    """
    for rep in replicas:
        async with _client(rep.http_url, 1) as client:
            body = _chat_body([{"role": "user", "content": "warm up"}], 2)
            rec = await _stream_chat(client, body)
            if rec.error:
                raise RuntimeError(f"warm-up request to {rep.http_url} failed: {rec.error}")


async def _agents_pass(
    url: str, key: str, system: str, questions: list[list[str]], args: argparse.Namespace
) -> tuple[float, list[ChatRecord]]:
    """Every agent at once, each asking its questions one after another."""
    records: list[ChatRecord] = []
    async with _client(url, len(questions)) as client:
        client.headers["authorization"] = f"Bearer {key}"

        async def agent(asks: list[str]) -> None:
            history: list[dict[str, str]] = []
            for question in asks:
                messages = [
                    {"role": "system", "content": system},
                    *history,
                    {"role": "user", "content": question},
                ]
                rec = await _stream_chat(client, _chat_body(messages, args.routing_max_tokens))
                records.append(rec)
                if args.history:
                    history += [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": rec.text},
                    ]

        start = time.perf_counter()
        await asyncio.gather(*(agent(asks) for asks in questions))
        seconds = time.perf_counter() - start
    return seconds, records


def _routing_counts(url: str, replicas: Sequence[ReplicaProc]) -> tuple[list[int], int]:
    """The gateway's routing decisions per replica (in ``replicas`` order), and its
    overrides, from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    per: dict[str, float] = {}
    overrides = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "kvserve_gateway_routing_decisions_total":
                per[s.labels["replica"]] = per.get(s.labels["replica"], 0.0) + s.value
            elif s.name == "kvserve_gateway_routing_overrides_total":
                overrides += s.value
    return [round(per.get(r.grpc_address, 0.0)) for r in replicas], round(overrides)


def run_routing(
    args: argparse.Namespace, launcher: Launcher, tokenizer: Any, say: Callable[[str], None]
) -> RoutingResult:
    system, system_tokens = system_prompt(tokenizer, args.system_tokens, args.seed)
    questions = agent_questions(args.agents, args.questions, args.seed)
    # Replicas share the CPUs: one OpenMP thread team each sized to its share, unless the
    # caller set OMP_NUM_THREADS (oversubscribed teams spin and throttle each other).
    threads = max(1, usable_cpus() // args.replicas)
    results: list[PolicyResult] = []
    for policy in POLICIES:
        say(f"routing: {policy}: starting {args.replicas} replicas and the gateway ...")
        reps = launcher.start_replicas(args.replicas, threads=threads)
        asyncio.run(_warm_replicas(reps))
        _, gw_url, key = launcher.start_gateway([r.grpc_address for r in reps], policy)
        seconds, recs = asyncio.run(_agents_pass(gw_url, key, system, questions, args))
        per_replica, overrides = _routing_counts(gw_url, reps)
        launcher.stop_all()  # fresh replicas (cold caches) for the next policy
        ok = [r for r in recs if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        ttfts = _ttfts(ok)
        res = PolicyResult(
            policy=policy,
            seconds=round(seconds, 3),
            requests_ok=len(ok),
            requests_failed=len(recs) - len(ok),
            prompt_tokens=prompt,
            cached_tokens=cached,
            cached_ratio=round(cached / prompt, 4) if prompt else None,
            ttft_mean_ms=_ms(statistics.fmean(ttfts)) if ttfts else None,
            ttft_p50_ms=_ms(_percentile(ttfts, 50)),
            ttft_p90_ms=_ms(_percentile(ttfts, 90)),
            requests_per_replica=per_replica,
            routing_overrides=overrides,
        )
        results.append(res)
        say(
            f"  {policy}: {seconds:.2f} s, cached ratio {res.cached_ratio}, TTFT mean "
            f"{res.ttft_mean_ms} ms, per replica {per_replica}"
            + (f" ({res.requests_failed} failed)" if res.requests_failed else "")
        )
        failed = [r.error for r in recs if r.error]
        if failed:
            say(f"  first failure: {failed[0]}")
    return RoutingResult(
        replicas=args.replicas,
        agents=args.agents,
        questions=args.questions,
        history=args.history,
        system_prompt_tokens=system_tokens,
        max_tokens=args.routing_max_tokens,
        replica_omp_threads=None if "OMP_NUM_THREADS" in os.environ else threads,
        policies=results,
    )


# ---- output ---------------------------------------------------------------------------------
def _f(x: float | None, width: int = 12, spec: str = ".2f", sign: bool = False) -> str:
    if x is None:
        return f"{'-':>{width}}"
    return format(x, f">{'+' if sign else ''}{width}{spec}")


def print_report(rep: Report) -> None:
    print(f"model: {rep.model} ({rep.dtype}, {rep.device}); {rep.cpus} CPU(s) on this machine")
    if rep.cpus < 4:
        print(
            "note: too few CPUs for a core per process: processes that share CPUs wait for "
            "them, and that waiting is in the latencies"
        )
    o = rep.overhead
    if o is not None:
        lengths = (
            str(o.output_tokens_min)
            if o.output_tokens_min == o.output_tokens_max
            else f"{o.output_tokens_min}–{o.output_tokens_max} (uniform, seeded)"
        )
        print()
        print(
            f"gateway overhead: 1 replica, {o.streams} concurrent streams, {o.requests} "
            f"requests per pass ({o.prompt_tokens}-token prompts, {lengths} output tokens, "
            f"ignore_eos), {o.rounds} round(s) alternating direct and gateway"
        )
        print(f"CPUs: {o.placement}")
        print(
            f"{'':<26}{'TTFT p50 ms':>12}{'TTFT p90 ms':>12}{'ITL p50 ms':>12}{'ITL p90 ms':>12}"
            f"{'chunks':>9}{'chunks/s':>10}{'failed':>8}"
        )
        for label, s in (("direct (HTTP)", o.direct), ("through the gateway", o.gateway)):
            print(
                f"{label:<26}{_f(s.ttft_p50_ms)}{_f(s.ttft_p90_ms)}{_f(s.itl_p50_ms)}"
                f"{_f(s.itl_p90_ms)}{s.chunks:>9}{s.chunks_per_second:>10.0f}"
                f"{s.requests_failed:>8}"
            )
        print(
            f"{'added by the gateway':<26}{_f(o.ttft_p50_added_ms, sign=True)}"
            f"{_f(o.ttft_p90_added_ms, sign=True)}{_f(o.itl_p50_added_ms, sign=True)}"
            f"{_f(o.itl_p90_added_ms, sign=True)}"
        )
        print(
            f"{'target (added, median)':<26}{'≤ ' + format(o.target_ttft_added_ms, '.1f'):>12}"
            f"{'':>12}{'≤ ' + format(o.target_itl_added_ms, '.1f'):>12}"
        )
        d, g = o.direct, o.gateway
        if d.split_requests and g.split_requests:
            print(
                f"split at the replica's engine (its request log; {d.split_requests} + "
                f"{g.split_requests} requests), medians, direct / via the gateway:"
            )
            print(
                f"  TTFT inside the engine (arrival → first token) {_f(d.engine_ttft_p50_ms, 0)}"
                f" / {_f(g.engine_ttft_p50_ms, 0)} ms; outside it (the way in and out) "
                f"{_f(d.ttft_outside_engine_p50_ms, 0)} / {_f(g.ttft_outside_engine_p50_ms, 0)}"
                f" ms: added {_f(o.ttft_outside_engine_added_ms, 0, sign=True)} ms"
            )
            print(
                f"  delay added per gap beyond the engine's pace (client TPOT − engine TPOT) "
                f"{_f(d.gap_added_p50_ms, 0, '.3f')} / {_f(g.gap_added_p50_ms, 0, '.3f')} ms: "
                f"added {_f(o.gap_added_by_gateway_ms, 0, '.3f', sign=True)} ms"
            )
        if o.lone_pairs:
            print(
                f"lone requests ({o.lone_pairs} pairs, one at a time, interleaved), median of "
                f"(gateway − direct) [quartiles]: TTFT {_f(o.lone_ttft_added_ms, 0, sign=True)} "
                f"ms [{_f(o.lone_ttft_added_q1_ms, 0)}, {_f(o.lone_ttft_added_q3_ms, 0)}], "
                f"ITL (each request's median) {_f(o.lone_itl_added_ms, 0, sign=True)} ms "
                f"[{_f(o.lone_itl_added_q1_ms, 0)}, {_f(o.lone_itl_added_q3_ms, 0)}]"
            )
        rate = o.gateway_chunks_per_cpu_second
        print(
            f"gateway CPU: {o.gateway_cpu_seconds:.2f} s (utime+stime) for {o.gateway_chunks} "
            f"streamed chunks = "
            + ("-" if rate is None else f"{rate:,.0f}")
            + " chunks per CPU-second at this load (the capacity phase measures the gateway "
            "saturated)"
        )
        if o.gateway_cpu_busy is not None:
            print(
                f"  the gateway was busy {o.gateway_cpu_busy:.0%} of one CPU during its passes; "
                f"replica CPU: {o.direct.replica_cpu_seconds:.2f} s direct, "
                f"{o.gateway.replica_cpu_seconds:.2f} s via the gateway (gRPC)"
            )
        floor = o.grpc_client_messages_per_cpu_second
        if floor is not None:
            print(
                f"  for scale: the gateway's gRPC client alone, reading the same streams from the "
                f"replica (no HTTP, no SSE), handled {floor:,.0f} messages per CPU-second "
                f"({o.grpc_client_messages} messages, {o.grpc_client_cpu_seconds:.2f} CPU-s)"
            )
    if rep.capacity is not None:
        print_capacity(rep.capacity)
    r = rep.routing
    if r is not None:
        print()
        print(
            f"routing: {r.replicas} replicas, {r.agents} agents × {r.questions} questions, one "
            f"{r.system_prompt_tokens}-token system prompt, "
            + ("each agent keeping its conversation" if r.history else "independent questions")
            + f", {r.max_tokens} output tokens per answer, cold caches for each policy; "
            "every process may run on every CPU"
        )
        print(
            f"{'policy':<14}{'requests':>9}{'prompt tok':>11}{'cached tok':>11}{'cached':>8}"
            f"{'TTFT mean':>10}{'TTFT p50':>10}{'TTFT p90':>10}{'seconds':>9}  per replica"
        )
        for p in r.policies:
            ratio = "-" if p.cached_ratio is None else f"{p.cached_ratio:.1%}"
            print(
                f"{p.policy:<14}{p.requests_ok:>9}{p.prompt_tokens:>11}{p.cached_tokens:>11}"
                f"{ratio:>8}{_f(p.ttft_mean_ms, 10, '.1f')}{_f(p.ttft_p50_ms, 10, '.1f')}"
                f"{_f(p.ttft_p90_ms, 10, '.1f')}{p.seconds:>9.2f}  "
                f"{'/'.join(map(str, p.requests_per_replica))}"
                + (f"  ({p.requests_failed} failed)" if p.requests_failed else "")
            )
        print("  (TTFT in ms; cached = Σ cached_tokens / Σ prompt_tokens from the streams' usage)")


# ---- the run ---------------------------------------------------------------------------------
def _check_args(args: argparse.Namespace) -> str | None:
    positive = (
        "streams", "requests", "max_tokens", "prompt_len", "rounds", "replicas", "agents",
        "questions", "system_tokens", "routing_max_tokens", "block_size",
        "capacity_streams", "capacity_requests",
    )  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be ≥ 1"
    if not 0 <= args.max_tokens_spread < 1:
        return "--max-tokens-spread must be in [0, 1)"
    return None


def _failures(rep: Report) -> int:
    n = 0
    if rep.overhead is not None:
        n += rep.overhead.direct.requests_failed + rep.overhead.gateway.requests_failed
    if rep.capacity is not None:
        n += sum(r.requests_failed for r in rep.capacity.rounds)
    if rep.routing is not None:
        n += sum(p.requests_failed for p in rep.routing.policies)
    return n


@contextlib.contextmanager
def _launcher(args: argparse.Namespace, model: str) -> Iterator[Launcher]:
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-gateway-") as tmp:
        launcher = Launcher(args, model, Path(tmp))
        try:
            yield launcher
        finally:
            launcher.stop_all()


def run(args: argparse.Namespace) -> int:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    problem = _check_args(args)
    if problem:
        say(f"kvserve bench gateway: error: {problem}")
        return 2
    model = args.model
    if not model:
        from kvserve.demo_model import default_model_dir

        try:
            model = str(default_model_dir())
        except FileNotFoundError as exc:
            say(f"kvserve bench gateway: error: {exc}")
            return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    report = Report(
        model=Path(model).name, dtype=args.dtype, device=args.device, cpus=usable_cpus()
    )
    try:
        with _launcher(args, model) as launcher:
            if args.phase in ("overhead", "all"):
                report.overhead = run_overhead(args, launcher, tokenizer, say)
            if args.phase in ("capacity", "all"):
                report.capacity = run_capacity_phase(args, launcher, say)
            if args.phase in ("routing", "all"):
                report.routing = run_routing(args, launcher, tokenizer, say)
    except KeyboardInterrupt:
        say("interrupted; every process the benchmark started is stopped")
        return 130
    except RuntimeError as exc:
        say(f"kvserve bench gateway: error: {exc}")
        return 1
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
        say(f"wrote {args.json}")
    failed = _failures(report)
    if failed:
        say(f"{failed} requests failed")
    return 0 if failed == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark without the ``kvserve`` CLI (``python -m kvserve.bench.gateway``)."""
    p = argparse.ArgumentParser(prog="kvserve bench gateway", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
