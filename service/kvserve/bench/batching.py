"""Static vs continuous batching in kvserve itself, at concurrency 1, 4 and 16
(docs/bench-methods.md, "batching")."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvserve.bench.results import Section, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import Timeline, Workload, latency, timed_generate

NAME = "batching"
TITLE = "Static vs continuous batching (kvserve)"
CONCURRENCIES = (1, 4, 16)
REQUESTS_PER_SLOT = 8


def run(ctx: SuiteContext) -> Section:
    dtype = ctx.dtype
    model_dir, config = ctx.model("30m")
    per_slot = 2 if ctx.smoke else REQUESTS_PER_SLOT
    n = per_slot * max(CONCURRENCIES)
    everything = ctx.mixed_workload(n, config.vocab_size, smoke=(n, (4, 24), (2, 8)))
    rows = []
    results: dict[tuple[int, str], tuple[float, list[Timeline]]] = {}
    for c in CONCURRENCIES:
        k = per_slot * c
        work = Workload(everything.prompts[:k], everything.output_lens[:k])
        ctx.say(
            f"  concurrency {c}: {k} prompts, {work.prompt_tokens} prompt and "
            f"{work.output_tokens} output tokens, {dtype}"
        )
        llm = ctx.llm(model_dir, dtype=dtype, max_num_seqs=c, max_model_len=work.max_len)
        timed_generate(llm, Workload(work.prompts[:2], [2, 2]))  # warm-up
        modes = {"static": partial(timed_generate, llm, work, c),
                 "continuous": partial(timed_generate, llm, work)}  # fmt: skip
        best = ctx.best_of(modes, lambda run: run[0], label=f"concurrency {c:>2}, ")
        for mode, (seconds, timelines) in best.items():
            results[(c, mode)] = (seconds, timelines)
            lat = latency(timelines)
            rows.append([c, k, mode, round(seconds, 2), round(work.output_tokens / seconds, 1),
                         lat.ttft_p50_ms, lat.ttft_p99_ms, lat.tpot_p50_ms])  # fmt: skip
        del llm

    speedups = [
        [c, round(results[(c, "static")][0] / results[(c, "continuous")][0], 2)]
        for c in CONCURRENCIES
    ]
    setup = model_setup(config, dtype, ctx.device) | {
        "requests": f"{per_slot} × concurrency",
        "prompt lengths": "16–256 tokens" if not ctx.smoke else "4–24 tokens",
        "output lengths": "16–128 tokens" if not ctx.smoke else "2–8 tokens",
        "rounds": ctx.rounds,
    }
    headers = "concurrency | requests | batching | wall (s) | output (tok/s) | TTFT p50 (ms)"
    tables = [
        table("Throughput and TTFT by concurrency", headers + " | TTFT p99 (ms) | TPOT p50 (ms)",
              rows),
        table("Continuous over static", "concurrency | throughput ratio (x)", speedups),
    ]  # fmt: skip
    notes = [
        "All requests arrive at t=0: TTFT includes the wait for a slot. At concurrency 1 "
        "both modes run the same schedule (a noise control).",
    ]
    plots = ctx.save_plot("batching.png", _draw, rows)
    return Section(NAME, TITLE, setup, tables, [], notes, plots)


def _draw(fig: Any, rows: list[list[Any]]) -> None:
    tput, ttft = fig.subplots(1, 2)
    for mode, marker in (("static", "s"), ("continuous", "o")):
        mine = [r for r in rows if r[2] == mode]
        tput.plot([r[0] for r in mine], [r[4] for r in mine], marker=marker, label=mode)
        ttft.plot([r[0] for r in mine], [r[6] for r in mine], marker=marker, label=mode)
    for ax, label in ((tput, "output tokens/s"), (ttft, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r[0] for r in rows[::2]], [str(r[0]) for r in rows[::2]])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("kvserve: static vs continuous batching")
