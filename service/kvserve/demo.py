"""``kvserve demo``: run the offline engine on a small model and show what it does.

Until the project ships a trained demo model, the default model is a tiny random Llama
built on first use (its text is noise; the point is the engine's behaviour: batching,
prefix-cache hits, latency figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from kvserve.telemetry import definitions as d

DEMO_CACHE = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: a tiny demo model)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)


def _demo_model() -> Path:
    from kvserve.testing.checkpoints import build_random_checkpoint

    path = DEMO_CACHE / "demo-random-llama-v1"
    if not (path / "config.json").exists():
        print(f"building a tiny random Llama checkpoint in {path} ...", file=sys.stderr)
        build_random_checkpoint(
            path,
            "llama",
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            intermediate_size=688,
            max_position_embeddings=2048,
        )
    return path


def run(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    model = args.model or str(_demo_model())
    print(f"loading {model} ...", file=sys.stderr)
    llm = LLM(model, dtype=args.dtype, device=args.device, max_num_seqs=16)
    eng = llm.engine
    print(
        f"device {eng.device}, dtype {str(eng.dtype).removeprefix('torch.')}, "
        f"{eng.model_config.num_params() / 1e6:.1f}M parameters, "
        f"{eng.num_kv_blocks} KV blocks of {eng.config.block_size} tokens"
    )

    system = (
        "You are a travel assistant. Answer with hotels that match the city, the price "
        "cap per night and the amenities the guest asks for. "
    )
    cities = ["Kyoto", "Lisbon", "Oslo", "Hakone", "Sapporo", "Porto", "Bergen", "Nara"]
    prompts = [
        f"{system}Guest: a ryokan in {cities[i % len(cities)]} under {80 + 10 * i} EUR."
        for i in range(args.num_requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start

    ttfts = [d.ttft(o.metrics.arrival_time, o.metrics.token_times[0]) for o in outs]
    tpots = [
        t
        for o in outs
        if (
            t := d.tpot(
                o.metrics.token_times[0], o.metrics.token_times[-1], len(o.metrics.token_times)
            )
        )
        is not None
    ]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = eng.stats()
    print(f"\nfirst answer: {outs[0].outputs[0].text!r}")
    print(
        f"\n{len(outs)} requests, {produced} output tokens in {wall:.2f} s "
        f"({produced / wall:.0f} tok/s)"
    )
    print(f"TTFT  median {statistics.median(ttfts) * 1e3:.0f} ms, max {max(ttfts) * 1e3:.0f} ms")
    if tpots:
        print(f"TPOT  median {statistics.median(tpots) * 1e3:.1f} ms")
    print(
        f"prefix cache: {stats.prefix_cache_hit_tokens} of {stats.prefix_cache_queried_tokens} "
        f"prompt tokens served from cache (shared system prompt)"
    )
    print(f"preemptions: {stats.num_preemptions}")
    if args.model is None:
        print("\n(the demo model has random weights, so its text is noise)")
    return 0
