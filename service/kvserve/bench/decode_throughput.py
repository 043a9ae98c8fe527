"""The decode-throughput harness the ``kv_dtype`` and ``quantization`` sections share:
one engine per side, each timed on pure decode steps at several batch sizes, the sides
alternating within each round (this machine's speed drifts) and each keeping its best.

For a batch size B, a side admits B requests of a random ``prompt``-token prompt, steps
until they all decode (prefills are not timed, nor is the first decode step), then times
pure decode steps one by one (``steps``, or as many as fit in ``limit`` seconds, at least
3) and keeps the median; decode tokens/s = B / that step time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvserve.bench.cpu import cpu_use
from kvserve.config import DEFAULT_BLOCK_SIZE, blocks_for
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.bench.suite import SuiteContext
    from kvserve.llm import LLM


@dataclass(frozen=True)
class DecodePlan:
    """What one section times: its batch sizes, prompt length, and how many decode steps
    per point (fewer, and a shorter limit, in smoke mode)."""

    batches: tuple[int, ...]
    prompt: int
    steps: int
    limit: float  # seconds of timed steps per point, once 3 are done

    @classmethod
    def for_run(cls, ctx: SuiteContext, batches: tuple[int, ...], prompt: int) -> DecodePlan:
        steps, limit = (4, 1.0) if ctx.smoke else (16, 4.0)
        return cls(batches, prompt, steps, limit)

    def engine_settings(self) -> dict[str, Any]:
        """Engine sizes that admit the largest batch at once, with no preemption: every
        request's prompt prefills in one step and its blocks are all there."""
        most = max(self.batches)
        max_len = self.prompt + self.steps + 16
        return {
            "max_num_seqs": most,
            "max_model_len": max_len,
            "max_num_batched_tokens": most * (self.prompt + 1),
            "num_kv_blocks": most * blocks_for(max_len, DEFAULT_BLOCK_SIZE) + 1,
        }


@dataclass(frozen=True)
class DecodeTimes:
    """Each (side, batch)'s best median decode step, in seconds, and the other processes'
    mean CPU use while they were timed (None where it cannot be read)."""

    plan: DecodePlan
    rounds: int
    best: dict[tuple[str, int], float]
    others: float | None

    def rate(self, side: str, batch: int) -> float:
        """Decode tokens/s."""
        return batch / self.best[side, batch]

    def ratio(self, side: str, base: str, batch: int) -> float:
        """``side``'s decode tokens/s over ``base``'s, rounded for a table."""
        return round(self.rate(side, batch) / self.rate(base, batch), 2)

    def setup(self) -> dict[str, Any]:
        """The section setup's entries about the timing."""
        return {
            "timed decode steps per point": (
                f"median of ≤{self.plan.steps} (≥3, ≤{self.plan.limit:.0f} s)"
            ),
            "rounds": self.rounds,
            "other processes' CPU use (CPUs, mean)": (
                None if self.others is None else round(self.others, 2)
            ),
        }


def decode_step_seconds(
    llm: LLM, batch: int, plan: DecodePlan, seed: int, request_prefix: str
) -> float:
    """Median time of a pure decode step with ``batch`` requests running; the engine is
    left empty again."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed + batch)
    params = SamplingParams(max_tokens=plan.steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, vocab, (plan.prompt,), generator=gen).tolist()
        engine.add_request(f"{request_prefix}-{batch}-{i}", ids, params)
    running = engine.scheduler.running
    while len(running) < batch or any(r.num_computed_tokens < r.num_prompt_tokens for r in running):
        engine.step()  # prefills are not timed
    engine.step()  # nor the first pure decode step
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < plan.steps and (len(times) < 3 or time.perf_counter() - start < plan.limit):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        sched = engine.last_schedule
        # A step that prefilled or left a request out would time something else.
        if (
            sched is None
            or len(sched.scheduled) != batch
            or any(n != 1 for _, n in sched.scheduled)
        ):
            raise RuntimeError(f"a timed step at batch {batch} was not a pure decode step")
    engine.abort_request(list(engine.requests))
    return statistics.median(times)


def time_decode(
    ctx: SuiteContext, llms: Mapping[str, LLM], plan: DecodePlan, request_prefix: str
) -> DecodeTimes:
    """Every side at every batch size, for ``ctx.rounds`` rounds, keeping each point's
    best round."""
    best: dict[tuple[str, int], float] = {}
    width = max(map(len, llms))
    with cpu_use() as use:
        for r in range(ctx.rounds):
            for batch in plan.batches:
                for side, llm in llms.items():
                    t = decode_step_seconds(llm, batch, plan, ctx.seed, request_prefix)
                    step = f"{1e3 * t:8.2f} ms/step"
                    ctx.say(f"  round {r + 1}/{ctx.rounds} B={batch:<2} {side:<{width}} {step}")
                    best[side, batch] = min(t, best.get((side, batch), t))
    others = None if use.others is None or use.wall <= 0 else use.others / use.wall
    return DecodeTimes(plan, ctx.rounds, best, others)
