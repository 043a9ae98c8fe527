"""What the gateway adds to a streaming workload: ``kvserve bench gateway --phase overhead``
(docs/gateway-config.md, "Gateway benchmark", defines every figure).

One replica (prefix caching off, so every pass costs the engine the same; its request log
on). The same seeded workload of ``--requests`` streamed completions from ``--streams``
clients goes direct to the replica's HTTP API and through the gateway, alternated in ABBA
order over ``--rounds`` rounds so drift falls on both paths alike. Reported: the
difference of the medians, each request split at the replica's engine (from its request
log, on the client's clock), the gateway's chunks per CPU-second next to the floor of its
gRPC client alone, and ``--lone-pairs`` lone requests on each path, interleaved, for what
the gateway adds without batching noise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.cpu import cpu_use, running_on, split_cpus, usable_cpus
from kvserve.bench.launcher import Gateway, Launcher, Replica
from kvserve.bench.results import fixed, say
from kvserve.bench.sse_client import (
    COMPLETIONS,
    ClientRecord,
    Connection,
    completion_body,
    itls,
    run_on_uvloop,
    stream_workload,
    text_chunks,
    ttfts,
)
from kvserve.bench.timelines import Workload, diff, greedy, percentile_ms
from kvserve.telemetry import definitions

# The issue's targets, printed next to the measured figures.
TARGET_TTFT_ADDED_MS = 5.0
TARGET_ITL_ADDED_MS = 0.5
PATHS = ("direct", "gateway")


@dataclass
class PassResult:
    """One timed pass of the workload on one path."""

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
class EngineSplit:
    """One request's latencies split at the replica's engine (seconds; see PathStats)."""

    engine_ttft: float  # arrival → first token, in the engine
    outside_ttft: float  # client TTFT − that: the way in and the way out
    gap_added: float | None  # client TPOT − the engine's (None: fewer than 2 tokens)


@dataclass
class LonePair:
    """One lone request on each path (seconds): TTFT and the median of its own gaps."""

    ttft_direct: float
    ttft_gateway: float
    itl_direct: float
    itl_gateway: float


def _workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    """``--requests`` prompts of ``--prompt-len`` random ordinary token ids (seeded)."""
    rng = random.Random(args.seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    prompts = [[rng.choice(ids) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    lo = max(1, round(args.max_tokens * (1 - args.max_tokens_spread)))
    hi = max(lo, round(args.max_tokens * (1 + args.max_tokens_spread)))
    return Workload(prompts, [rng.randint(lo, hi) for _ in range(args.requests)])


def _pass_tag(path: str, round_: int) -> str:
    """The request id prefix of a pass: its request ``i`` is ``{tag}-{i}``."""
    return f"{path}-r{round_}"


def _split_at_engine(
    records: Sequence[ClientRecord], tag: str, log: dict[str, dict[str, Any]]
) -> list[EngineSplit]:
    """The split of each request of a pass found in the replica's request log."""
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
    passes: Sequence[tuple[PassResult, list[ClientRecord]]], split: Sequence[EngineSplit]
) -> PathStats:
    records = [rec for _, recs in passes for rec in recs]
    seconds = sum(x.seconds for x, _ in passes)
    ttft, itl, chunks = ttfts(records), itls(records), text_chunks(records)
    return PathStats(
        requests_ok=sum(r.ok for r in records),
        requests_failed=sum(not r.ok for r in records),
        chunks=chunks,
        seconds=round(seconds, 3),
        chunks_per_second=round(chunks / seconds, 1) if seconds > 0 else 0.0,
        ttft_p50_ms=percentile_ms(ttft, 50),
        ttft_p90_ms=percentile_ms(ttft, 90),
        itl_p50_ms=percentile_ms(itl, 50),
        itl_p90_ms=percentile_ms(itl, 90),
        replica_cpu_seconds=round(sum(x.replica_cpu_seconds for x, _ in passes), 2),
        engine_ttft_p50_ms=percentile_ms([x.engine_ttft for x in split], 50),
        ttft_outside_engine_p50_ms=percentile_ms([x.outside_ttft for x in split], 50),
        gap_added_p50_ms=percentile_ms([x.gap_added for x in split if x.gap_added is not None], 50),
        split_requests=len(split),
    )


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

    client = ReplicaClient(address)
    todo = iter(range(len(work.prompts)))

    async def one(rid: str, prompt: list[int], max_tokens: int) -> int:
        call = client.generate(
            encode_request(prompt, greedy(max_tokens), request_id=rid), 600.0, {}
        )
        return sum(
            [msg.WhichOneof("kind") == "delta" and bool(msg.delta.text) async for msg in call]
        )

    async def worker() -> int:
        return sum([await one(f"{tag}-{i}", work.prompts[i], work.output_lens[i]) for i in todo])

    try:
        await one(f"{tag}-warm-up", work.prompts[0], 2)  # the channel's connection
        with cpu_use() as use:
            counts = await asyncio.gather(
                *(worker() for _ in range(min(streams, len(work.prompts))))
            )
        return sum(counts), use.own
    finally:
        await client.close()


async def _lone_pairs(direct_url: str, gateway: Gateway, work: Workload, n: int) -> list[LonePair]:
    """``n`` lone requests on each path, one at a time, the order swapped every pair (so
    drift falls on both alike). Only pairs where both requests succeeded are kept."""
    pairs: list[LonePair] = []
    direct, via = Connection(direct_url), Connection(gateway.url, gateway.key)
    try:
        for i in range(n):
            body = completion_body(work.prompts[i % len(work.prompts)], work.output_lens[0])
            first, second = (direct, via) if i % 2 == 0 else (via, direct)
            recs = {first: await first.stream(COMPLETIONS, body)}
            recs[second] = await second.stream(COMPLETIONS, body)
            d, g = recs[direct], recs[via]
            if not (d.ok and g.ok and d.ttft is not None and g.ttft is not None):
                continue
            gaps_d, gaps_g = definitions.itls(d.chunk_times), definitions.itls(g.chunk_times)
            if gaps_d and gaps_g:
                itl_d, itl_g = statistics.median(gaps_d), statistics.median(gaps_g)
                pairs.append(LonePair(d.ttft, g.ttft, itl_d, itl_g))
    finally:
        direct.close()
        via.close()
    return pairs


def _quartiles(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """Median, first and third quartile in ms (only the median of a single value)."""
    if len(values) < 2:
        return percentile_ms(values, 50), None, None
    return percentile_ms(values, 50), percentile_ms(values, 25), percentile_ms(values, 75)


def run_overhead(args: argparse.Namespace, launcher: Launcher, tokenizer: Any) -> OverheadResult:
    work = _workload(args, tokenizer)
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
        1, prefix_caching=False, threads=threads, cpus=placement.others, log_level="info"
    )
    gateway = launcher.start_gateway([rep.grpc_address], "prefix", cpus=placement.gateway)
    with running_on(placement.others):  # the client: never on the gateway's CPU
        passes, (floor_messages, floor_cpu), lone = _measure(args, work, rep, gateway)
    launcher.stop_all()  # the request log is complete once the replica has stopped
    engine_log = rep.request_log()
    stats = {}
    for path in PATHS:
        mine = [(x, recs) for x, recs in passes if x.path == path]
        tags = [(recs, _pass_tag(path, x.round)) for x, recs in mine]
        stats[path] = _path_stats(
            mine, [s for r, t in tags for s in _split_at_engine(r, t, engine_log)]
        )
    direct, via = stats["direct"], stats["gateway"]
    gw_cpu = sum(x.gateway_cpu_seconds or 0.0 for x, _ in passes)
    lone_ttft = _quartiles([x.ttft_gateway - x.ttft_direct for x in lone])
    lone_itl = _quartiles([x.itl_gateway - x.itl_direct for x in lone])
    return OverheadResult(
        streams=args.streams,
        requests=args.requests,
        max_tokens=args.max_tokens,
        output_tokens_min=min(work.output_lens),
        output_tokens_max=max(work.output_lens),
        output_tokens_per_pass=work.output_tokens,
        prompt_tokens=args.prompt_len,
        rounds=args.rounds,
        placement=placement.describe(),
        direct=direct,
        gateway=via,
        ttft_p50_added_ms=diff(via.ttft_p50_ms, direct.ttft_p50_ms),
        ttft_p90_added_ms=diff(via.ttft_p90_ms, direct.ttft_p90_ms),
        itl_p50_added_ms=diff(via.itl_p50_ms, direct.itl_p50_ms),
        itl_p90_added_ms=diff(via.itl_p90_ms, direct.itl_p90_ms),
        ttft_outside_engine_added_ms=diff(
            via.ttft_outside_engine_p50_ms, direct.ttft_outside_engine_p50_ms
        ),
        gap_added_by_gateway_ms=diff(via.gap_added_p50_ms, direct.gap_added_p50_ms),
        gateway_cpu_seconds=round(gw_cpu, 2),
        gateway_chunks=via.chunks,
        gateway_chunks_per_cpu_second=round(via.chunks / gw_cpu, 1) if gw_cpu > 0 else None,
        gateway_cpu_busy=round(gw_cpu / via.seconds, 3) if via.seconds > 0 else None,
        grpc_client_messages=floor_messages,
        grpc_client_cpu_seconds=round(floor_cpu, 4),
        grpc_client_messages_per_cpu_second=(
            round(floor_messages / floor_cpu, 1) if floor_cpu > 0 else None
        ),
        passes=[x for x, _ in passes],
        lone_pairs=len(lone),
        lone_ttft_added_ms=lone_ttft[0],
        lone_ttft_added_q1_ms=lone_ttft[1],
        lone_ttft_added_q3_ms=lone_ttft[2],
        lone_itl_added_ms=lone_itl[0],
        lone_itl_added_q1_ms=lone_itl[1],
        lone_itl_added_q3_ms=lone_itl[2],
    )


def _measure(
    args: argparse.Namespace, work: Workload, rep: Replica, gateway: Gateway
) -> tuple[list[tuple[PassResult, list[ClientRecord]]], tuple[int, float], list[LonePair]]:
    """The rounds of passes on both paths, each round's gRPC floor, then the lone pairs."""
    # An untimed pass of one request per stream on each path first: the engine's first
    # steps at each batch size, and the gRPC path's first calls, are several times slower
    # than later ones, and would otherwise fall on whichever path runs first.
    n = min(args.streams, args.requests)
    warm = Workload(work.prompts[:n], work.output_lens[:n])
    say(f"  warm-up: {n} requests on each path (not measured) ...")
    for url, key in ((rep.http_url, None), (gateway.url, gateway.key)):
        recs = asyncio.run(stream_workload(url, key, warm, args.streams)).records
        errors = [r.error or "no finish_reason" for r in recs if not r.ok]
        if errors:
            raise RuntimeError(f"{len(errors)} warm-up requests to {url} failed: {errors[0]}")
    passes: list[tuple[PassResult, list[ClientRecord]]] = []
    floor_messages, floor_cpu = 0, 0.0
    for r in range(1, args.rounds + 1):
        for path in PATHS if r % 2 == 1 else PATHS[::-1]:
            via_gw = path == "gateway"
            url, key = (gateway.url, gateway.key) if via_gw else (rep.http_url, None)
            procs = [rep.proc, gateway.proc] if via_gw else [rep.proc]
            tag = _pass_tag(path, r)
            x = asyncio.run(stream_workload(url, key, work, args.streams, tag=tag, children=procs))
            recs, cpu = x.records, x.cpu.children
            result = PassResult(
                path=path,
                round=r,
                seconds=round(x.seconds, 3),
                requests_ok=sum(rec.ok for rec in recs),
                requests_failed=sum(not rec.ok for rec in recs),
                chunks=text_chunks(recs),
                ttft_p50_ms=percentile_ms(ttfts(recs), 50),
                itl_p50_ms=percentile_ms(itls(recs), 50),
                gateway_cpu_seconds=round(cpu[1], 2) if via_gw else None,
                replica_cpu_seconds=round(cpu[0], 2),
            )
            passes.append((result, recs))
            say(
                f"  round {r}/{args.rounds} {path:<7} {x.seconds:6.2f} s, TTFT p50 "
                f"{result.ttft_p50_ms} ms, ITL p50 {result.itl_p50_ms} ms"
                + (f", gateway CPU {cpu[1]:.2f} s" if via_gw else "")
                + (f" ({result.requests_failed} failed)" if result.requests_failed else "")
            )
        # On uvloop where installed, as the gateway's uvicorn runs.
        texts, cpu_s = run_on_uvloop(
            _grpc_client_pass(rep.grpc_address, work, args.streams, f"floor-{r - 1}")
        )
        floor_messages += texts
        floor_cpu += cpu_s
        say(f"  round {r}/{args.rounds} bare gRPC client: {texts} messages, {cpu_s:.2f} CPU-s")
    lone: list[LonePair] = []
    if args.lone_pairs > 0:
        say(f"  {args.lone_pairs} lone requests on each path, one at a time, interleaved ...")
        lone = run_on_uvloop(_lone_pairs(rep.http_url, gateway, work, args.lone_pairs))
    return passes, (floor_messages, floor_cpu), lone


def print_overhead(o: OverheadResult) -> None:
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
            f"{label:<26}{fixed(s.ttft_p50_ms)}{fixed(s.ttft_p90_ms)}{fixed(s.itl_p50_ms)}"
            f"{fixed(s.itl_p90_ms)}{s.chunks:>9}{s.chunks_per_second:>10.0f}"
            f"{s.requests_failed:>8}"
        )
    print(
        f"{'added by the gateway':<26}{fixed(o.ttft_p50_added_ms, sign=True)}"
        f"{fixed(o.ttft_p90_added_ms, sign=True)}{fixed(o.itl_p50_added_ms, sign=True)}"
        f"{fixed(o.itl_p90_added_ms, sign=True)}"
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
            f"  TTFT inside the engine (arrival → first token) {fixed(d.engine_ttft_p50_ms, 0)}"
            f" / {fixed(g.engine_ttft_p50_ms, 0)} ms; outside it (the way in and out) "
            f"{fixed(d.ttft_outside_engine_p50_ms, 0)} / {fixed(g.ttft_outside_engine_p50_ms, 0)}"
            f" ms: added {fixed(o.ttft_outside_engine_added_ms, 0, sign=True)} ms"
        )
        print(
            f"  delay added per gap beyond the engine's pace (client TPOT − engine TPOT) "
            f"{fixed(d.gap_added_p50_ms, 0, '.3f')} / {fixed(g.gap_added_p50_ms, 0, '.3f')} ms: "
            f"added {fixed(o.gap_added_by_gateway_ms, 0, '.3f', sign=True)} ms"
        )
    if o.lone_pairs:
        print(
            f"lone requests ({o.lone_pairs} pairs, one at a time, interleaved), median of "
            f"(gateway − direct) [quartiles]: TTFT {fixed(o.lone_ttft_added_ms, 0, sign=True)} "
            f"ms [{fixed(o.lone_ttft_added_q1_ms, 0)}, {fixed(o.lone_ttft_added_q3_ms, 0)}], "
            f"ITL (each request's median) {fixed(o.lone_itl_added_ms, 0, sign=True)} ms "
            f"[{fixed(o.lone_itl_added_q1_ms, 0)}, {fixed(o.lone_itl_added_q3_ms, 0)}]"
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
