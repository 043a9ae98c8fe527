"""Tensor parallelism on this CPU: two ranks with one thread each vs one rank with two
threads, decode tokens/s at batch 1 and 16.

On the ~34M-parameter random Llama (``MODEL_SHAPES["30m"]``) in fp32, both engines stay
loaded in this process for the whole section: ``tensor_parallel_size=1`` computing with
this process's torch threads set to the ranks' total, and ``tensor_parallel_size=2``
(rank 0 here, rank 1 a worker process, one thread each: ``cpu_threads_per_rank``). The
sides alternate within each round and keep their best round, timed on pure decode steps
(``kvserve.bench.decode_throughput``).

Both sides use the same cores, so TP=2 can only lose here: it adds two all-reduces per
layer, the embedding's all-reduce, the logits' gather and the step's broadcast, and a
matmul split in two runs on one core each instead of two. What TP is for is a model that
does not fit one GPU's memory (docs/performance.md, "Tensor parallelism").
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from kvserve.bench.cpu import cpu_use
from kvserve.bench.decode_throughput import DecodePlan, decode_step_seconds
from kvserve.bench.results import Section, model_setup, table
from kvserve.bench.suite import SuiteContext

if TYPE_CHECKING:
    from kvserve.llm import LLM

NAME = "tensor_parallel"
TITLE = "tensor parallelism on the CPU: 2 ranks × 1 thread vs 1 rank × 2 threads"
BATCHES = (1, 16)
PROMPT = 128
RANKS = 2


def run(ctx: SuiteContext) -> Section:
    path, config = ctx.model("30m")
    plan = DecodePlan.for_run(ctx, BATCHES, 32 if ctx.smoke else PROMPT)
    total = min(RANKS, len(os.sched_getaffinity(0)))
    saved = torch.get_num_threads()
    sides: dict[str, tuple[LLM, int]] = {
        "TP=1": (ctx.llm(path, **plan.engine_settings()), total),
        "TP=2": (ctx.llm(path, tensor_parallel_size=RANKS, **plan.engine_settings()), 1),
    }
    ctx.say(f"  loaded TP=1 ({total} threads) and TP=2 (1 thread per rank)")
    best: dict[tuple[str, int], float] = {}
    try:
        with cpu_use() as use:
            for r in range(ctx.rounds):
                for batch in plan.batches:
                    for side, (llm, threads) in sides.items():
                        torch.set_num_threads(threads)
                        t = decode_step_seconds(llm, batch, plan, ctx.seed, "tp")
                        ctx.say(f"  round {r + 1}/{ctx.rounds} B={batch:<2} {side} "
                                f"{1e3 * t:8.2f} ms/step")  # fmt: skip
                        best[side, batch] = min(t, best.get((side, batch), t))
    finally:
        torch.set_num_threads(saved)
        for llm, _ in sides.values():
            llm.close()
    rows = [
        [batch, side, round(1e3 * best[side, batch], 2), round(batch / best[side, batch], 1),
         round(best["TP=1", batch] / best[side, batch], 2)]
        for batch in BATCHES for side in sides
    ]  # fmt: skip
    for batch in BATCHES:
        ctx.say(f"  B={batch}: TP=2 / TP=1 = {best['TP=1', batch] / best['TP=2', batch]:.2f}×")
    others = None if use.others is None or use.wall <= 0 else use.others / use.wall
    setup: dict[str, Any] = model_setup(config, "float32", ctx.device) | {
        "prompt tokens": plan.prompt,
        "CPUs used (both sides)": total,
        "timed decode steps per point": f"median of ≤{plan.steps} (≥3, ≤{plan.limit:.0f} s)",
        "rounds": ctx.rounds,
        "other processes' CPU use (CPUs, mean)": None if others is None else round(others, 2),
    }
    tables = [
        table("Decode, one step at a time", "batch | side | step (ms) | decode tok/s | "
              "vs TP=1 (×)", rows),
    ]  # fmt: skip
    notes = [
        "No target: on one machine's cores TP can only add communication. The figures "
        "show its overhead; correctness is tested (tests/parallel).",
        "Per step, TP=2 runs 2 all-reduces per layer, one for the embedding, a gather "
        "of the logits and one broadcast of the step's input (pickled, gloo over "
        "loopback TCP).",
    ]
    return Section(NAME, TITLE, setup, tables, [], notes)
