"""``kvserve demo``: run the offline engine on a small model and show what it does.

The default model is the bundled travel assistant (``kvserve.demo_model``): 32 hotel
requests that share a system prompt go through the engine at once, and the demo prints
two answers, throughput, TTFT/TPOT and how many prompt tokens the prefix cache served.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvserve.telemetry import definitions as d


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the demo model)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)


def run(args: argparse.Namespace) -> int:
    from kvserve.demo_model import default_model_dir

    if args.num_requests < 1 or args.max_tokens < 1:
        print("kvserve demo: error: --num-requests and --max-tokens must be ≥ 1", file=sys.stderr)
        return 2
    model = args.model or str(default_model_dir())
    from kvserve import LLM, SamplingParams
    from kvserve.demo_model import corpus

    print(f"loading {model} ...", file=sys.stderr)
    try:
        llm = LLM(model, dtype=args.dtype, device=args.device, max_num_seqs=16)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve demo: error: {exc}", file=sys.stderr)
        return 2
    eng = llm.engine
    print(
        f"device {eng.device}, dtype {str(eng.dtype).removeprefix('torch.')}, "
        f"{eng.model_config.num_params() / 1e6:.1f}M parameters, "
        f"{eng.num_kv_blocks} KV blocks of {eng.config.block_size} tokens"
    )

    # One system prompt for all: the prefix cache serves it after the first request.
    system = {"role": "system", "content": corpus.SYSTEM_PROMPTS[0]}
    conversations = [
        [system, p.messages[-1]] for p in corpus.sample_eval_prompts(args.num_requests, seed=7)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=0)
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
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
    for conv, out in list(zip(conversations, outs, strict=True))[:2]:
        print(f"\nuser> {conv[-1]['content']}\nassistant> {out.outputs[0].text}")
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
    return 0
