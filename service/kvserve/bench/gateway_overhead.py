"""What the gateway adds to a streaming workload: ``kvserve bench gateway --phase overhead``
(docs/gateway-config.md, "Gateway benchmark", defines every figure)."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.bench.cpu import cpu_use, running_on, split_cpus, usable_cpus
from kvserve.bench.launcher import Gateway, Launcher, Replica
from kvserve.bench.results import fixed, say, text_row
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

# The targets, printed next to the measured figures.
TARGET_TTFT_ADDED_MS = 5.0
TARGET_ITL_ADDED_MS = 0.5
PATHS = ("direct", "gateway")
# The timed passes: each one's figures (as reported under "passes") and its records.
Passes = list[tuple[dict[str, Any], list[ClientRecord]]]


@dataclass
class EngineSplit:
    """One request's latencies split at the replica's engine (seconds), from the
    replica's request log (same clock as the client)."""

    engine_ttft: float  # arrival → first token, in the engine (waiting for a batch, prefill)
    outside_ttft: float  # client TTFT − that: the way in before arrival, the way out after
    # Client TPOT − the engine's: the delay the way out adds per gap on top of the
    # engine's own pace (None: fewer than 2 tokens).
    gap_added: float | None


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


def _figures(records: Sequence[ClientRecord], *qs: int) -> dict[str, Any]:
    """How many requests succeeded and failed, and of those that succeeded: the text
    chunks, and the TTFT and ITL percentiles (ms)."""
    series = {"ttft": ttfts(records), "itl": itls(records)}
    return {
        "requests_ok": sum(r.ok for r in records),
        "requests_failed": sum(not r.ok for r in records),
        "chunks": text_chunks(records),  # SSE chunks with text, as received
        **{f"{name}_p{q}_ms": percentile_ms(v, q) for name, v in series.items() for q in qs},
    }


def _path_stats(passes: Passes, path: str, log: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``path`` over all rounds: the pooled requests' figures, and the medians of their
    split at the engine (None: no request log, or not one clock on this OS)."""
    mine = [(x, recs) for x, recs in passes if x["path"] == path]
    records = [rec for _, recs in mine for rec in recs]
    tags = [(recs, _pass_tag(path, x["round"])) for x, recs in mine]
    split = [s for recs, tag in tags for s in _split_at_engine(recs, tag, log)]
    seconds = sum(x["seconds"] for x, _ in mine)
    figures = _figures(records, 50, 90)
    gaps = [x.gap_added for x in split if x.gap_added is not None]
    return figures | {
        "seconds": round(seconds, 3),  # the sum of its passes' wall times
        "chunks_per_second": round(figures["chunks"] / seconds, 1) if seconds > 0 else 0.0,
        "replica_cpu_seconds": round(sum(x["replica_cpu_seconds"] for x, _ in mine), 2),
        "engine_ttft_p50_ms": percentile_ms([x.engine_ttft for x in split], 50),
        "ttft_outside_engine_p50_ms": percentile_ms([x.outside_ttft for x in split], 50),
        "gap_added_p50_ms": percentile_ms(gaps, 50),
        "split_requests": len(split),
    }


async def _grpc_client_pass(
    address: str, work: Workload, streams: int, tag: str
) -> tuple[int, float]:
    """The gRPC floor: the workload's streams read straight from the replica with the
    gateway's own ``ReplicaClient``: the deltas with text, and this process's CPU-s."""
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


async def _lone_pairs(
    direct_url: str, gateway: Gateway, work: Workload, n: int
) -> list[tuple[float, float]]:
    """``n`` lone requests on each path, the order swapped every pair: what the gateway
    added (seconds) to each pair's TTFT and to the median of its own gaps."""
    added: list[tuple[float, float]] = []
    async with Connection(direct_url) as direct, Connection(gateway.url, gateway.key) as via:
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
                itl = statistics.median(gaps_g) - statistics.median(gaps_d)
                added.append((g.ttft - d.ttft, itl))
    return added


def run_overhead(args: argparse.Namespace, launcher: Launcher, tokenizer: Any) -> dict[str, Any]:
    work = _workload(args, tokenizer)
    placement = split_cpus(args.placement == "separate")
    say(
        f"overhead: starting 1 replica (prefix caching off) and the gateway; {placement.describe()}"
    )
    # Prefix caching off: every pass repeats the same prompts, and must cost the same.
    # The replica's OpenMP team leaves one CPU to the others (docs/bench-methods.md).
    threads = len(placement.others) if placement.others else max(1, usable_cpus() - 1)
    (rep,) = launcher.start_replicas(
        1, prefix_caching=False, threads=threads, cpus=placement.others, log_level="info"
    )
    gateway = launcher.start_gateway([rep.grpc_address], "prefix", cpus=placement.gateway)
    with running_on(placement.others):  # the client: never on the gateway's CPU
        passes, (floor_messages, floor_cpu), lone = _measure(args, work, rep, gateway)
    launcher.stop_all()  # the request log is complete once the replica has stopped
    log = rep.request_log()
    direct, via = (_path_stats(passes, path, log) for path in PATHS)
    gw_cpu = sum(x["gateway_cpu_seconds"] or 0.0 for x, _ in passes)
    o: dict[str, Any] = {
        "streams": args.streams,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        # the workload's output lengths (ignore_eos: exact)
        "output_tokens_min": min(work.output_lens),
        "output_tokens_max": max(work.output_lens),
        "output_tokens_per_pass": work.output_tokens,
        "prompt_tokens": args.prompt_len,
        "rounds": args.rounds,
        "placement": placement.describe(),
        "direct": direct,
        "gateway": via,
    }
    # Gateway − direct: of the medians and p90s, of each request's TTFT outside the
    # replica's engine, and of the delay added per gap beyond the engine's pace.
    added = {f"{x}_added_ms": f"{x}_ms" for x in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90")}
    added["ttft_outside_engine_added_ms"] = "ttft_outside_engine_p50_ms"
    added["gap_added_by_gateway_ms"] = "gap_added_p50_ms"
    o |= {name: diff(via[key], direct[key]) for name, key in added.items()}
    o |= {
        "gateway_cpu_seconds": round(gw_cpu, 2),  # Δ(utime + stime) over the gateway passes
        "gateway_chunks": via["chunks"],
        "gateway_chunks_per_cpu_second": round(via["chunks"] / gw_cpu, 1) if gw_cpu > 0 else None,
        # CPU-seconds / wall seconds of the gateway passes
        "gateway_cpu_busy": round(gw_cpu / via["seconds"], 3) if via["seconds"] > 0 else None,
        # The floor: a bare grpc.aio client (this process, uvloop) reading the same
        # streams straight from the replica, once per round.
        "grpc_client_messages": floor_messages,
        "grpc_client_cpu_seconds": round(floor_cpu, 4),
        "grpc_client_messages_per_cpu_second": (
            round(floor_messages / floor_cpu, 1) if floor_cpu > 0 else None
        ),
        "lone_pairs": len(lone),
    }
    # Lone requests: the median and quartiles of the pairs' differences (only the median
    # of a single pair); ITL per request is the median of its own gaps.
    for i, figure in enumerate(("ttft", "itl")):
        values = [pair[i] for pair in lone]
        several = len(values) > 1
        o[f"lone_{figure}_added_ms"] = percentile_ms(values, 50)
        o[f"lone_{figure}_added_q1_ms"] = percentile_ms(values, 25) if several else None
        o[f"lone_{figure}_added_q3_ms"] = percentile_ms(values, 75) if several else None
    o |= {
        "target_ttft_added_ms": TARGET_TTFT_ADDED_MS,
        "target_itl_added_ms": TARGET_ITL_ADDED_MS,
        "passes": [x for x, _ in passes],
    }
    return o


def _measure(
    args: argparse.Namespace, work: Workload, rep: Replica, gateway: Gateway
) -> tuple[Passes, tuple[int, float], list[tuple[float, float]]]:
    """The rounds of passes on both paths, each round's gRPC floor, then the lone pairs."""
    # Untimed first (docs/bench-methods.md): first steps and first calls are slow.
    n = min(args.streams, args.requests)
    warm = Workload(work.prompts[:n], work.output_lens[:n])
    say(f"  warm-up: {n} requests on each path (not measured) ...")
    for url, key in ((rep.http_url, None), (gateway.url, gateway.key)):
        recs = asyncio.run(stream_workload(url, key, warm, args.streams)).records
        errors = [r.error or "no finish_reason" for r in recs if not r.ok]
        if errors:
            raise RuntimeError(f"{len(errors)} warm-up requests to {url} failed: {errors[0]}")
    passes: Passes = []
    floor_messages, floor_cpu = 0, 0.0
    for r in range(1, args.rounds + 1):
        for path in PATHS if r % 2 == 1 else PATHS[::-1]:
            via_gw = path == "gateway"
            url, key = (gateway.url, gateway.key) if via_gw else (rep.http_url, None)
            procs = [rep.proc, gateway.proc] if via_gw else [rep.proc]
            tag = _pass_tag(path, r)
            x = asyncio.run(stream_workload(url, key, work, args.streams, tag=tag, children=procs))
            recs, cpu = x.records, x.cpu.children
            result = {
                "path": path,
                "round": r,
                "seconds": round(x.seconds, 3),
                **_figures(recs, 50),
                "gateway_cpu_seconds": round(cpu[1], 2) if via_gw else None,
                "replica_cpu_seconds": round(cpu[0], 2),
            }
            passes.append((result, recs))
            say(
                f"  round {r}/{args.rounds} {path:<7} {x.seconds:6.2f} s, TTFT p50 "
                f"{result['ttft_p50_ms']} ms, ITL p50 {result['itl_p50_ms']} ms"
                + (f", gateway CPU {cpu[1]:.2f} s" if via_gw else "")
                + (f" ({result['requests_failed']} failed)" if result["requests_failed"] else "")
            )
        # On uvloop where installed, as the gateway's uvicorn runs.
        texts, cpu_s = run_on_uvloop(
            _grpc_client_pass(rep.grpc_address, work, args.streams, f"floor-{r - 1}")
        )
        floor_messages += texts
        floor_cpu += cpu_s
        say(f"  round {r}/{args.rounds} bare gRPC client: {texts} messages, {cpu_s:.2f} CPU-s")
    lone: list[tuple[float, float]] = []
    if args.lone_pairs > 0:
        say(f"  {args.lone_pairs} lone requests on each path, one at a time, interleaved ...")
        lone = run_on_uvloop(_lone_pairs(rep.http_url, gateway, work, args.lone_pairs))
    return passes, (floor_messages, floor_cpu), lone


def print_overhead(o: dict[str, Any]) -> None:
    lo, hi = o["output_tokens_min"], o["output_tokens_max"]
    lengths = str(lo) if lo == hi else f"{lo}–{hi} (uniform, seeded)"
    print()
    print(
        f"gateway overhead: 1 replica, {o['streams']} concurrent streams, {o['requests']} "
        f"requests per pass ({o['prompt_tokens']}-token prompts, {lengths} output tokens, "
        f"ignore_eos), {o['rounds']} round(s) alternating direct and gateway"
    )
    print(f"CPUs: {o['placement']}")
    widths = (26, 12, 12, 12, 12, 9, 10, 8)
    header = ("TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "chunks", "chunks/s")
    print(text_row(["", *header, "failed"], widths))
    figures = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90")
    d, g = o["direct"], o["gateway"]
    for label, s in (("direct (HTTP)", d), ("through the gateway", g)):
        cells = [label, *(s[f"{x}_ms"] for x in figures), s["chunks"], s["chunks_per_second"]]
        print(text_row([*cells, s["requests_failed"]], widths, ".2f .2f .2f .2f d .0f d"))
    added = "".join(fixed(o[f"{x}_added_ms"], sign=True) for x in figures)
    print(f"{'added by the gateway':<26}{added}")
    ttft, itl = ("≤ " + format(o[f"target_{x}_added_ms"], ".1f") for x in ("ttft", "itl"))
    print(text_row(["target (added, median)", ttft, "", itl], widths))
    if d["split_requests"] and g["split_requests"]:

        def both(key: str, spec: str = ".2f") -> str:
            return f"{fixed(d[key], 0, spec)} / {fixed(g[key], 0, spec)}"

        print(
            f"split at the replica's engine (its request log; {d['split_requests']} + "
            f"{g['split_requests']} requests), medians, direct / via the gateway:"
        )
        print(
            "  TTFT inside the engine (arrival → first token) "
            f"{both('engine_ttft_p50_ms')} ms; outside it (the way in and out) "
            f"{both('ttft_outside_engine_p50_ms')} ms: added "
            f"{fixed(o['ttft_outside_engine_added_ms'], 0, sign=True)} ms"
        )
        print(
            f"  delay added per gap beyond the engine's pace (client TPOT − engine TPOT) "
            f"{both('gap_added_p50_ms', '.3f')} ms: "
            f"added {fixed(o['gap_added_by_gateway_ms'], 0, '.3f', sign=True)} ms"
        )
    if o["lone_pairs"]:

        def lone(x: str) -> str:
            q1, q3 = fixed(o[f"lone_{x}_added_q1_ms"], 0), fixed(o[f"lone_{x}_added_q3_ms"], 0)
            return f"{fixed(o[f'lone_{x}_added_ms'], 0, sign=True)} ms [{q1}, {q3}]"

        print(
            f"lone requests ({o['lone_pairs']} pairs, one at a time, interleaved), median of "
            f"(gateway − direct) [quartiles]: TTFT {lone('ttft')}, "
            f"ITL (each request's median) {lone('itl')}"
        )
    rate = fixed(o["gateway_chunks_per_cpu_second"], 0, ",.0f")
    print(
        f"gateway CPU: {o['gateway_cpu_seconds']:.2f} s (utime+stime) for {o['gateway_chunks']} "
        f"streamed chunks = {rate} chunks per CPU-second at this load (the capacity phase "
        "measures the gateway saturated)"
    )
    if o["gateway_cpu_busy"] is not None:
        print(
            f"  the gateway was busy {o['gateway_cpu_busy']:.0%} of one CPU during its passes; "
            f"replica CPU: {d['replica_cpu_seconds']:.2f} s direct, "
            f"{g['replica_cpu_seconds']:.2f} s via the gateway (gRPC)"
        )
    floor = o["grpc_client_messages_per_cpu_second"]
    if floor is not None:
        print(
            f"  for scale: the gateway's gRPC client alone, reading the same streams from the "
            f"replica (no HTTP, no SSE), handled {floor:,.0f} messages per CPU-second "
            f"({o['grpc_client_messages']} messages, {o['grpc_client_cpu_seconds']:.2f} CPU-s)"
        )
