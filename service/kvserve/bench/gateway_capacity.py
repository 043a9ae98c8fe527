"""The gateway's capacity on one core: ``kvserve bench gateway --phase capacity``
(docs/gateway-config.md, "Gateway benchmark")."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from kvserve.bench.cpu import cpu_use, running_on, split_cpus
from kvserve.bench.launcher import Launcher
from kvserve.bench.results import fixed, say, text_row
from kvserve.bench.sse_client import CHAT, MODEL_NAME, StreamPool, run_on_uvloop

TARGET_CHUNKS_PER_SECOND = 10_000.0
SATURATED = 0.9  # busy share of the gateway's CPU above which a round measures capacity
STUB_STEP_MS = 1.0  # between the stub replica's output messages


async def offer_load(
    url: str, key: str, model: str, streams: int, requests: int, max_tokens: int
) -> tuple[int, int, int, str | None]:
    """``streams`` connections drain ``requests`` streaming chat requests: (ok, failed,
    text chunks of the ok ones, the first error)."""
    # Plain chat requests (no usage chunk): every chunk the client reads is a token's text.
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"capacity probe {i}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        for i in range(requests)
    ]
    async with StreamPool(url, key, min(streams, requests)) as pool:
        _, records = await pool.drain(CHAT, bodies)
    ok = [rec for rec in records if rec.ok]
    errors = [rec.error or "the stream ended without a finish" for rec in records if not rec.ok]
    return len(ok), len(errors), sum(len(rec.chunk_times) for rec in ok), next(iter(errors), None)


def run_capacity(args: argparse.Namespace, launcher: Launcher, tokenizer: Any) -> dict[str, Any]:
    """A stub replica and a gateway, then ``--rounds`` timed rounds after one untimed (no
    model: the tokenizer goes unused)."""
    placement = split_cpus(args.placement == "separate")
    say(f"capacity: starting a stub replica and the gateway; {placement.describe()}")
    address = launcher.start_stub_replica(placement.others)
    gateway = launcher.start_gateway([address], "prefix", cpus=placement.gateway)
    streams, requests, max_tokens = args.capacity_streams, args.capacity_requests, args.max_tokens

    def load(n: int) -> tuple[int, int, int, str | None]:
        return run_on_uvloop(
            offer_load(gateway.url, gateway.key, MODEL_NAME, streams, n, max_tokens)
        )

    rounds: list[dict[str, Any]] = []
    first_error: str | None = None
    with running_on(placement.others):
        say(f"  warm-up: {streams} requests (not measured) ...")
        load(streams)
        for r in range(1, args.rounds + 1):
            with cpu_use([gateway.proc]) as use:
                ok, failed, chunks, error = load(requests)
            seconds, (cpu,) = use.wall, use.children
            first_error = first_error or error
            res = {
                "round": r,
                "requests_ok": ok,
                "requests_failed": failed,
                "chunks": chunks,  # text chunks received by the client
                "seconds": round(seconds, 3),
                "gateway_cpu_seconds": round(cpu, 2),
                "chunks_per_second": round(chunks / seconds, 1),
                "gateway_busy": round(cpu / seconds, 3),  # gateway CPU-seconds / wall seconds
                "chunks_per_cpu_second": round(chunks / cpu, 1) if cpu > 0 else None,
            }
            rounds.append(res)
            say(
                f"  round {r}/{args.rounds}: {chunks} chunks in {seconds:.2f} s = "
                f"{res['chunks_per_second']:,.0f} chunks/s; gateway busy "
                f"{res['gateway_busy']:.0%} of one CPU"
                + (f" ({failed} failed: {error})" if failed else "")
            )
    per_cpu = [v for x in rounds if (v := x["chunks_per_cpu_second"]) is not None]
    peak_rss = gateway.proc.peak_rss_bytes()
    launcher.stop_all()
    return {
        "streams": streams,
        "requests": requests,  # per round
        "max_tokens": max_tokens,
        "stub_step_ms": STUB_STEP_MS,
        "placement": placement.describe(),
        "gateway_alone": placement.separate,  # the gateway had a CPU to itself
        # the median round's
        "chunks_per_second": round(statistics.median(x["chunks_per_second"] for x in rounds), 1),
        "chunks_per_cpu_second": round(statistics.median(per_cpu), 1) if per_cpu else None,
        "gateway_busy": round(statistics.median(x["gateway_busy"] for x in rounds), 3),
        # every round had the gateway busy ≥ SATURATED
        "saturated": all(x["gateway_busy"] >= SATURATED for x in rounds),
        # VmHWM after the rounds: what its pod must hold
        "gateway_peak_rss_mb": None if peak_rss is None else round(peak_rss / 1e6, 1),
        "target_chunks_per_second": TARGET_CHUNKS_PER_SECOND,
        "rounds": rounds,
        "first_error": first_error,
    }


def print_capacity(c: dict[str, Any]) -> None:
    print()
    print(
        f"gateway capacity: {c['streams']} streams, {c['requests']} requests per round, "
        f"{c['max_tokens']}-token chat answers from a stub replica (no model; a message "
        f"every {c['stub_step_ms']:g} ms); {c['placement']}"
    )
    widths = (8, 9, 9, 10, 9, 11)
    print(text_row(["round", "chunks", "seconds", "chunks/s", "GW busy", "per CPU-s"], widths))
    for x in c["rounds"]:
        figures = ("round", "chunks", "seconds", "chunks_per_second", "gateway_busy")
        cells = [*(x[k] for k in figures), x["chunks_per_cpu_second"]]
        failed = f"  ({x['requests_failed']} failed)" if x["requests_failed"] else ""
        print(text_row(cells, widths, "d .2f ,.0f .0% ,.0f") + failed)
    per_cpu = fixed(c["chunks_per_cpu_second"], 0, ",.0f")
    if c["gateway_alone"] and c["saturated"]:
        print(
            f"capacity on one core (median round): {c['chunks_per_second']:,.0f} chunks/s "
            f"(target ≥ {c['target_chunks_per_second']:,.0f}); {per_cpu} per gateway CPU-second"
        )
    else:
        why = (
            "the gateway did not have a CPU to itself"
            if not c["gateway_alone"]
            else f"the load generator kept the gateway only {c['gateway_busy']:.0%} busy"
        )
        print(
            f"not a capacity figure ({why}): {per_cpu} chunks per gateway CPU-second "
            f"(target ≥ {c['target_chunks_per_second']:,.0f} per second on one core)"
        )
    if c["gateway_peak_rss_mb"] is not None:
        print(f"gateway peak memory (VmHWM): {c['gateway_peak_rss_mb']:,.0f} MB")
    if c["first_error"]:
        print(f"  first failure: {c['first_error']}")
