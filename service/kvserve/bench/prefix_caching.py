"""Prefix caching on vs off in the shared-prefix agent scenario
(docs/bench-methods.md, "prefix_caching")."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvserve.bench.results import Section, Target, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import Latency, Timeline, Workload, closed_loop, from_output, latency

NAME = "prefix_caching"
TITLE = "Prefix caching on vs off (shared-prefix agents)"
SYSTEM_TOKENS = 200
CONCURRENCY = 4
TARGET_SHARE_OF_SHARED = 80.0  # % of the shared share that caching must save


def agent_workload(
    agents: int,
    system_tokens: int,
    question_len: tuple[int, int],
    answer_tokens: int,
    vocab: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
    prompts = [
        system + [rng.randrange(3, vocab) for _ in range(rng.randint(*question_len))]
        for _ in range(agents)
    ]
    return Workload(prompts, [answer_tokens] * agents)


@dataclass
class ModeResult:
    seconds: float
    timelines: list[Timeline]
    cached_tokens: int


def _closed_loop(llm: Any, work: Workload, concurrency: int) -> ModeResult:
    """Run ``work`` with ``concurrency`` requests in flight, adding one as one finishes,
    from a cold prefix cache (every round starts cold)."""
    engine = llm.engine
    assert engine.reset_prefix_cache(), "the engine is idle between rounds"
    cached = 0
    timelines: list[Timeline] = []
    t0 = engine.clock()
    for out in closed_loop(engine, work, concurrency, "agent"):
        if out.finished:
            timelines.append(from_output(out))
            cached += out.num_cached_tokens
    return ModeResult(engine.clock() - t0, timelines, cached)


def run(ctx: SuiteContext) -> Section:
    dtype = ctx.dtype
    model_dir, config = ctx.model("30m")
    if ctx.smoke:
        agents, system_tokens, question, answer = 6, 40, (4, 12), 2
    else:
        agents, system_tokens, question, answer = 32, SYSTEM_TOKENS, (16, 48), 16
    work = agent_workload(agents, system_tokens, question, answer, config.vocab_size, ctx.seed)
    shared = system_tokens * agents
    llms = {
        mode: ctx.llm(model_dir, dtype=dtype, max_num_seqs=CONCURRENCY,
                      max_model_len=work.max_len, enable_prefix_caching=mode == "on")
        for mode in ("off", "on")
    }  # fmt: skip
    runs = {
        f"caching {mode}": partial(_closed_loop, llm, work, CONCURRENCY)
        for mode, llm in llms.items()
    }
    best = {name.split()[1]: res for name, res in ctx.best_of(runs, lambda r: r.seconds).items()}
    block_size = llms["on"].engine.config.block_size
    del llms

    rows = []
    computed: dict[str, int] = {}
    lat: dict[str, Latency] = {}
    for mode, res in best.items():
        computed[mode] = work.prompt_tokens - res.cached_tokens
        la = lat[mode] = latency(res.timelines)
        rows.append([mode, work.prompt_tokens, res.cached_tokens, computed[mode],
                     la.ttft_mean_ms, la.ttft_p99_ms, round(res.seconds, 2)])  # fmt: skip
    shared_share = 100 * shared / work.prompt_tokens
    cut = 100 * (1 - computed["on"] / computed["off"])
    ttft_cut = 100 * (1 - lat["on"].ttft_mean_ms / lat["off"].ttft_mean_ms)
    setup = model_setup(config, dtype, ctx.device) | {
        "agents": len(work.prompts),
        "shared system prompt": f"{shared // len(work.prompts)} tokens",
        "prompt tokens": work.prompt_tokens,
        "answer tokens": work.output_lens[0],
        "concurrency": CONCURRENCY,
        "block size": block_size,
        "rounds": ctx.rounds,
    }
    cut_share = round(100 * cut / shared_share, 1)
    tables = [
        table("Prefill work and TTFT", "prefix caching | prompt tokens | cached tokens | "
              "prefill tokens computed | TTFT mean (ms) | TTFT p99 (ms) | wall (s)", rows),
        table("Savings", "shared share of prompt tokens (%) | prefill tokens cut (%) | "
              "cut / shared share (%) | mean TTFT cut (%)",
              [[round(shared_share, 1), round(cut, 1), cut_share, round(ttft_cut, 1)]]),
    ]  # fmt: skip
    targets = [
        Target("prefill tokens cut, as a share of the shared share", cut_share,
               TARGET_SHARE_OF_SHARED, "%"),
    ]  # fmt: skip
    notes = [
        "Only full blocks are cached: each request reuses the shared prompt rounded down "
        "to a multiple of the block size, and the first request computes it in full.",
        "TTFT still pays for each request's own question tokens and for sharing steps "
        "with the other requests' decodes, so it falls by less than the prefill work.",
    ]
    return Section(NAME, TITLE, setup, tables, targets, notes)
