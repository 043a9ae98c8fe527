"""KV memory efficiency: allocated token slots vs tokens actually held, over a mixed run
(docs/bench-methods.md, "kv_memory")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.results import Section, Target, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import Workload, greedy

NAME = "kv_memory"
TITLE = "KV cache memory efficiency"
BLOCK_SIZES = (16, 32, 8)  # the first is the engine default, which the target is about
TARGET_WASTE = 4.0  # % of allocated slots


@dataclass
class Occupancy:
    steps: int = 0
    held: int = 0  # token-steps
    allocated: int = 0  # slot-steps
    reserved: int = 0  # slot-steps with max_model_len per request
    series: list[tuple[int, int, int, int]] = field(default_factory=list)  # per step:
    # (running requests, tokens held, slots allocated, slots reserved)

    @property
    def waste(self) -> float:
        return 100 * (1 - self.held / self.allocated)

    @property
    def reserved_waste(self) -> float:
        return 100 * (1 - self.held / self.reserved)


def measure(llm: Any, work: Workload) -> Occupancy:
    engine = llm.engine
    kv, block = engine.kv, engine.config.block_size
    for i, (p, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        engine.add_request(f"mix-{i}", p, greedy(n))
    occ = Occupancy()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        held = sum(r.num_computed_tokens for r in running)
        allocated = sum(len(kv.block_ids(r.request_id)) for r in running) * block
        reserved = len(running) * engine.max_model_len
        occ.steps += 1
        occ.held += held
        occ.allocated += allocated
        occ.reserved += reserved
        occ.series.append((len(running), held, allocated, reserved))
    return occ


def run(ctx: SuiteContext) -> Section:
    dtype, concurrency = ctx.dtype, 16
    model_dir, config = ctx.model("30m")
    max_model_len = config.max_position_embeddings
    work = ctx.mixed_workload(64, config.vocab_size, smoke=(8, (4, 40), (2, 12)))
    results: dict[int, Occupancy] = {}
    rows = []
    for bs in BLOCK_SIZES:
        llm = ctx.llm(model_dir, dtype=dtype, block_size=bs, max_num_seqs=concurrency,
                      max_model_len=max_model_len)  # fmt: skip
        o = results[bs] = measure(llm, work)
        del llm
        ctx.say(f"  block size {bs:>2}: waste {o.waste:5.2f}% over {o.steps} steps")
        rows.append([bs, o.steps, round(o.held / o.steps, 1), round(o.allocated / o.steps, 1),
                     round(o.waste, 2), round(o.reserved / o.steps, 1),
                     round(o.reserved_waste, 2)])  # fmt: skip
    default = results[BLOCK_SIZES[0]]
    setup = model_setup(config, dtype, ctx.device) | {
        "requests": len(work.prompts),
        "prompt tokens": work.prompt_tokens,
        "output tokens": work.output_tokens,
        "max_num_seqs": concurrency,
        "max_model_len": max_model_len,
    }
    tables = [
        table("Slots per step (averages over steps) and waste",
              "block size (tokens) | steps | tokens held | slots allocated | paged waste (%) | "
              "slots if max_model_len reserved | reservation waste (%)", rows)
    ]  # fmt: skip
    targets = [
        Target(f"KV waste at block size {BLOCK_SIZES[0]}", round(default.waste, 2), TARGET_WASTE,
               "%", op="<=")
    ]  # fmt: skip
    notes = [
        "Paged waste is the unfilled tail of each running request's last block: at most "
        "block size − 1 slots per request, whatever the request's length.",
        f"Reserving max_model_len ({max_model_len}) per request would leave "
        f"{default.reserved_waste:.1f}% of the reserved slots empty on this workload.",
    ]
    plots = ctx.save_plot("kv_memory.png", _draw, default, BLOCK_SIZES[0])
    return Section(NAME, TITLE, setup, tables, targets, notes, plots)


def _draw(fig: Any, occ: Occupancy, block_size: int) -> None:
    ax = fig.add_subplot()
    steps = range(1, len(occ.series) + 1)
    ax.plot(steps, [s[2] for s in occ.series], label="slots allocated (paged)")
    ax.plot(steps, [s[1] for s in occ.series], label="tokens held")
    ax.set_xlabel("engine step")
    ax.set_ylabel("token slots")
    ax.set_title(f"KV slots over a mixed run (block size {block_size}); waste {occ.waste:.2f}%")
    ax.grid(alpha=0.3)
    ax.legend()
