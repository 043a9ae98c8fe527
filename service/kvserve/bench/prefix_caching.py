"""Prefix caching on vs off in the shared-prefix agent scenario.

``agents`` agents share one system prompt of ``SYSTEM_TOKENS`` tokens; each sends its
own question (random length) after it and asks for a short answer. Requests run as a
closed loop of ``CONCURRENCY`` clients straight on the engine's step API: a new request
is added as soon as one finishes, so each request's TTFT is its own (engine arrival to
first token), not a burst's queue.

Reported for each mode: prefill tokens computed (Σ prompt tokens − Σ tokens served from
the prefix cache), mean and p99 TTFT. The target: the cut in computed prefill tokens is
at least 80% of the shared share (shared tokens / all prompt tokens) — the most caching
can save is the shared share minus the first request's copy and the partial last block
(only full blocks are cached).

Both modes use the same engine settings; the cache is emptied before every "on" round
so each round starts cold. Rounds alternate; each mode's best round (by wall time) is
reported.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Any

from kvserve.bench.results import Column, Section, Table, Target, model_setup
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import Timeline, Workload, from_output
from kvserve.telemetry import definitions

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


def closed_loop(llm: Any, work: Workload, concurrency: int) -> ModeResult:
    """Run ``work`` with ``concurrency`` requests in flight, adding one as one finishes."""
    from kvserve import SamplingParams

    engine = llm.engine
    pending = list(range(len(work.prompts)))[::-1]
    in_flight = 0
    timelines: list[Timeline] = []
    cached = 0
    t0 = engine.clock()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i = pending.pop()
            params = SamplingParams(max_tokens=work.output_lens[i], temperature=0, ignore_eos=True)
            engine.add_request(f"agent-{i}", work.prompts[i], params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                timelines.append(from_output(out))
                cached += out.num_cached_tokens
    return ModeResult(engine.clock() - t0, timelines, cached)


def run(ctx: SuiteContext) -> Section:
    from kvserve import LLM
    from kvserve.model.config import ModelConfig

    dtype = "float32"
    model_dir = ctx.checkpoint("30m")
    config = ModelConfig.from_file(model_dir)
    if ctx.smoke:
        agents, system_tokens, question, answer = 6, 40, (4, 12), 2
    else:
        agents, system_tokens, question, answer = 32, SYSTEM_TOKENS, (16, 48), 16
    work = agent_workload(agents, system_tokens, question, answer, config.vocab_size, ctx.seed)
    shared = system_tokens * agents
    llms = {
        mode: LLM(
            str(model_dir),
            dtype=dtype,
            device=ctx.device,
            max_num_seqs=CONCURRENCY,
            max_model_len=work.max_len,
            seed=ctx.seed,
            enable_prefix_caching=mode == "on",
        )
        for mode in ("off", "on")
    }
    best: dict[str, ModeResult] = {}
    for r in range(ctx.rounds):
        for mode, llm in llms.items():
            llm.engine.kv.pool.reset_prefix_cache()  # every round starts cold
            res = closed_loop(llm, work, CONCURRENCY)
            ctx.say(f"  round {r + 1}/{ctx.rounds}: caching {mode:<3} {res.seconds:6.2f} s")
            if mode not in best or res.seconds < best[mode].seconds:
                best[mode] = res
    block_size = llms["on"].engine.config.block_size
    del llms

    rows = []
    computed: dict[str, int] = {}
    mean_ttft: dict[str, float] = {}
    for mode, res in best.items():
        computed[mode] = work.prompt_tokens - res.cached_tokens
        ttfts = [definitions.ttft(t.s, t.f) for t in res.timelines]
        mean_ttft[mode] = statistics.fmean(ttfts) * 1000
        p99 = definitions.percentile(ttfts, 99)
        rows.append(
            [
                mode,
                work.prompt_tokens,
                res.cached_tokens,
                computed[mode],
                round(mean_ttft[mode], 2),
                round((p99 or 0) * 1000, 2),
                round(res.seconds, 2),
            ]
        )
    shared_share = 100 * shared / work.prompt_tokens
    cut = 100 * (1 - computed["on"] / computed["off"])
    ttft_cut = 100 * (1 - mean_ttft["on"] / mean_ttft["off"])
    setup = model_setup(config, dtype, ctx.device) | {
        "agents": len(work.prompts),
        "shared system prompt": f"{shared // len(work.prompts)} tokens",
        "prompt tokens": work.prompt_tokens,
        "answer tokens": work.output_lens[0],
        "concurrency": CONCURRENCY,
        "block size": block_size,
        "rounds": ctx.rounds,
    }
    tables = [
        Table(
            "Prefill work and TTFT",
            [
                Column("prefix caching"),
                Column("prompt tokens"),
                Column("cached tokens"),
                Column("prefill tokens computed"),
                Column("TTFT mean", "ms"),
                Column("TTFT p99", "ms"),
                Column("wall", "s"),
            ],
            rows,
        ),
        Table(
            "Savings",
            [
                Column("shared share of prompt tokens", "%"),
                Column("prefill tokens cut", "%"),
                Column("cut / shared share", "%"),
                Column("mean TTFT cut", "%"),
            ],
            [
                [
                    round(shared_share, 1),
                    round(cut, 1),
                    round(100 * cut / shared_share, 1),
                    round(ttft_cut, 1),
                ]
            ],
        ),
    ]
    targets = [
        Target(
            "prefill tokens cut, as a share of the shared share",
            round(100 * cut / shared_share, 1),
            TARGET_SHARE_OF_SHARED,
            "%",
        ),
    ]
    notes = [
        "Only full blocks are cached: each request reuses the shared prompt rounded down "
        "to a multiple of the block size, and the first request computes it in full.",
        "TTFT still pays for each request's own question tokens and for sharing steps "
        "with the other requests' decodes, so it falls by less than the prefill work.",
    ]
    return Section(NAME, TITLE, setup, tables, targets, notes)
