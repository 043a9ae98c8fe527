"""Per-request timelines (``s``, ``f``, ``e``, ``n``) and their latency figures, workloads
and greedy requests (docs/bench-methods.md, "Timelines")."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.telemetry import definitions

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.llm import LLM
    from kvserve.outputs import RequestOutput
    from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Timeline:
    s: float
    f: float
    e: float
    n: int


def from_output(out: RequestOutput, arrival: float | None = None) -> Timeline:
    """A kvserve output's timeline; ``arrival`` overrides the engine's arrival time (a
    burst's start, when requests were queued outside the engine)."""
    m = out.metrics
    assert m.first_token_time is not None and m.token_times, "request produced no token"
    s = m.arrival_time if arrival is None else arrival
    return Timeline(s, m.first_token_time, m.token_times[-1], len(out.outputs[0].token_ids))


@dataclass
class Latency:
    """Latency percentiles of a run, in milliseconds."""

    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None


def ms(seconds: float | None) -> float | None:
    """Seconds in milliseconds, to 0.01 ms (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 2)


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile of seconds, in milliseconds (None without values)."""
    return ms(definitions.percentile(values, q))


def diff(a: float | None, b: float | None) -> float | None:
    """``a − b`` to 0.01 (None when either is)."""
    return None if a is None or b is None else round(a - b, 2)


def latency(timelines: Sequence[Timeline]) -> Latency:
    ttfts = [definitions.ttft(t.s, t.f) for t in timelines]
    tpots = [v for t in timelines if (v := definitions.tpot(t.f, t.e, t.n)) is not None]
    return Latency(
        ttft_mean_ms=round(statistics.fmean(ttfts) * 1000, 2),
        ttft_p50_ms=ms(definitions.percentile(ttfts, 50)) or 0.0,
        ttft_p99_ms=ms(definitions.percentile(ttfts, 99)) or 0.0,
        tpot_p50_ms=ms(definitions.percentile(tpots, 50)),
        tpot_p99_ms=ms(definitions.percentile(tpots, 99)),
    )


@dataclass
class Workload:
    """Token-id prompts and the output length each request asks for (``ignore_eos``)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        return max(map(len, self.prompts)) + max(self.output_lens)


def random_workload(
    num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    """``num`` random prompts with uniform lengths in the given (inclusive) ranges."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num)])


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy and exactly ``max_tokens`` tokens (``ignore_eos``): every benchmark request,
    so that a request costs the same on every engine and in every round."""
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def timed_generate(
    llm: LLM, work: Workload, group: int | None = None
) -> tuple[float, list[Timeline]]:
    """``LLM.generate`` over the workload, every request arriving at the start, in one call
    or in groups of ``group`` (static batching): the wall seconds and the timelines."""
    params = [greedy(n) for n in work.output_lens]
    size = group or len(work.prompts)
    t0 = llm.engine.clock()
    timelines = []
    for i in range(0, len(work.prompts), size):
        outs = llm.generate(work.prompts[i : i + size], params[i : i + size], use_tqdm=False)
        timelines += [from_output(o, arrival=t0) for o in outs]
    return llm.engine.clock() - t0, timelines


def closed_loop(
    engine: LLMEngine, work: Workload, streams: int, tag: str
) -> Iterator[RequestOutput]:
    """Drive the engine's step API with ``streams`` requests of the workload in flight,
    adding the next one as one finishes (as clients behind a fixed number of streams
    send); yields every output. Request ``i`` goes as ``{tag}-{i}``."""
    todo = iter(range(len(work.prompts)))

    def add() -> None:
        i = next(todo, None)
        if i is not None:
            engine.add_request(f"{tag}-{i}", work.prompts[i], greedy(work.output_lens[i]))

    for _ in range(streams):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                add()
            yield out
