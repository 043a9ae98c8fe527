"""Prefix vs round-robin routing: ``kvserve bench gateway --phase routing``
(docs/gateway-config.md, "Gateway benchmark")."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvserve.bench.cpu import usable_cpus
from kvserve.bench.launcher import Launcher, Replica, metric_samples
from kvserve.bench.results import say, text_row
from kvserve.bench.sse_client import CHAT, ClientRecord, Connection, chat_body, ttfts
from kvserve.bench.timelines import ms, percentile_ms

POLICIES = ("prefix", "round_robin")
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


async def _warm_replicas(replicas: Sequence[Replica]) -> None:
    """One tiny request to each replica directly, sharing no KV block with the agents'
    prompts: the caches stay cold for what is measured."""
    for rep in replicas:
        async with Connection(rep.http_url) as conn:
            rec = await conn.stream(CHAT, chat_body([{"role": "user", "content": "warm up"}], 2))
        if rec.error:
            raise RuntimeError(f"warm-up request to {rep.http_url} failed: {rec.error}")


async def _agents_pass(
    url: str, key: str, system: str, questions: list[list[str]], args: argparse.Namespace
) -> tuple[float, list[ClientRecord]]:
    """Every agent at once, each asking its questions one after another on its own
    connection, the reply's text kept for its history."""
    records: list[ClientRecord] = []
    instructions = {"role": "system", "content": system}

    async def agent(asks: list[str]) -> None:
        history: list[dict[str, str]] = []
        async with Connection(url, key, keep_text=True) as conn:
            for question in asks:
                ask = {"role": "user", "content": question}
                body = chat_body([instructions, *history, ask], args.routing_max_tokens)
                rec = await conn.stream(CHAT, body)
                records.append(rec)
                if args.history:
                    history += [ask, {"role": "assistant", "content": rec.text}]

    start = time.perf_counter()
    await asyncio.gather(*(agent(asks) for asks in questions))
    return time.perf_counter() - start, records


def _routing_counts(url: str, replicas: Sequence[Replica]) -> tuple[list[int], int]:
    """The gateway's routing decisions per replica (in ``replicas`` order), and its
    overrides, from its /metrics."""
    per: dict[str, float] = {}
    overrides = 0.0
    for s in metric_samples(url):
        if s.name == "kvserve_gateway_routing_decisions_total":
            per[s.labels["replica"]] = per.get(s.labels["replica"], 0.0) + s.value
        elif s.name == "kvserve_gateway_routing_overrides_total":
            overrides += s.value
    return [round(per.get(r.grpc_address, 0.0)) for r in replicas], round(overrides)


def run_routing(args: argparse.Namespace, launcher: Launcher, tokenizer: Any) -> dict[str, Any]:
    system, system_tokens = system_prompt(tokenizer, args.system_tokens, args.seed)
    questions = agent_questions(args.agents, args.questions, args.seed)
    # One OpenMP team per replica, sized to its share of the CPUs (docs/bench-methods.md).
    threads = max(1, usable_cpus() // args.replicas)
    results: list[dict[str, Any]] = []
    for policy in POLICIES:
        say(f"routing: {policy}: starting {args.replicas} replicas and the gateway ...")
        reps = launcher.start_replicas(args.replicas, threads=threads)
        asyncio.run(_warm_replicas(reps))
        gateway = launcher.start_gateway([r.grpc_address for r in reps], policy)
        seconds, recs = asyncio.run(_agents_pass(gateway.url, gateway.key, system, questions, args))
        per_replica, overrides = _routing_counts(gateway.url, reps)
        launcher.stop_all()  # fresh replicas (cold caches) for the next policy
        ok = [r for r in recs if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)  # Σ usage.prompt_tokens
        cached = sum(r.cached_tokens for r in ok)  # Σ usage.prompt_tokens_details.cached_tokens
        ttft = ttfts(ok)
        res = {
            "policy": policy,
            "seconds": round(seconds, 3),
            "requests_ok": len(ok),
            "requests_failed": len(recs) - len(ok),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_ratio": round(cached / prompt, 4) if prompt else None,
            "ttft_mean_ms": ms(statistics.fmean(ttft)) if ttft else None,
            "ttft_p50_ms": percentile_ms(ttft, 50),
            "ttft_p90_ms": percentile_ms(ttft, 90),
            "requests_per_replica": per_replica,  # the gateway's routing decisions
            "routing_overrides": overrides,  # prefix routes sent elsewhere (load bound, retry)
        }
        results.append(res)
        say(
            f"  {policy}: {seconds:.2f} s, cached ratio {res['cached_ratio']}, TTFT mean "
            f"{res['ttft_mean_ms']} ms, per replica {per_replica}"
            + (f" ({res['requests_failed']} failed)" if res["requests_failed"] else "")
        )
        failed = [r.error for r in recs if r.error]
        if failed:
            say(f"  first failure: {failed[0]}")
    return {
        "replicas": args.replicas,
        "agents": args.agents,
        "questions": args.questions,
        "history": args.history,
        "system_prompt_tokens": system_tokens,
        "max_tokens": args.routing_max_tokens,
        # OMP_NUM_THREADS given to each replica (None: inherited)
        "replica_omp_threads": None if "OMP_NUM_THREADS" in os.environ else threads,
        "policies": results,
    }


def print_routing(r: dict[str, Any]) -> None:
    print()
    print(
        f"routing: {r['replicas']} replicas, {r['agents']} agents × {r['questions']} "
        f"questions, one {r['system_prompt_tokens']}-token system prompt, "
        + ("each agent keeping its conversation" if r["history"] else "independent questions")
        + f", {r['max_tokens']} output tokens per answer, cold caches for each policy; "
        "every process may run on every CPU"
    )
    widths = (14, 9, 11, 11, 8, 10, 10, 10, 9)
    header = ("requests", "prompt tok", "cached tok", "cached", "TTFT mean", "TTFT p50")
    print(text_row(["policy", *header, "TTFT p90", "seconds"], widths) + "  per replica")
    for p in r["policies"]:
        figures = ("policy", "requests_ok", "prompt_tokens", "cached_tokens", "cached_ratio")
        cells = [p[k] for k in figures] + [p[f"ttft_{x}_ms"] for x in ("mean", "p50", "p90")]
        failed = f"  ({p['requests_failed']} failed)" if p["requests_failed"] else ""
        per_replica = "/".join(map(str, p["requests_per_replica"]))
        row = text_row([*cells, p["seconds"]], widths, "d d d .1% .1f .1f .1f .2f")
        print(f"{row}  {per_replica}{failed}")
    print("  (TTFT in ms; cached = Σ cached_tokens / Σ prompt_tokens from the streams' usage)")
