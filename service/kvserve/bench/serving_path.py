"""Serving path: ``kvserve gateway`` + ``kvserve serve`` vs the offline engine, 32 streams
(docs/bench-methods.md, "serving_path")."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvserve.bench.cpu import cpu_use, usable_cpus
from kvserve.bench.launcher import Launcher, LaunchSettings
from kvserve.bench.processes import Proc
from kvserve.bench.results import Section, model_setup, table
from kvserve.bench.sse_client import stream_workload
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import Latency, Timeline, Workload, closed_loop, diff, latency
from kvserve.telemetry import definitions

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.model.config import ModelConfig

NAME = "serving_path"
TITLE = "Serving path: gateway + server vs offline engine, 32 concurrent streams"
DTYPE = "float32"
CONCURRENCY = 32
WARMUP_TOKENS = 4


@dataclass
class Pass:
    """One timed pass of the workload on one side."""

    side: str
    seconds: float
    ok: int  # requests that finished with all their tokens ("length", ignore_eos)
    failed: int
    output_tokens: int  # of the ok requests
    text_outputs: int  # engine steps / SSE chunks that carried text
    late_text: int  # requests whose first token showed no text (offline only)
    timelines: list[Timeline]  # the ok requests that showed text
    # the ones sent after the first wave: each sent when a stream came free, one at a time
    steady: list[Timeline]
    # CPU s over the pass: this process, the replica, the gateway, every other process
    cpu: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    cpu_window: float = 0.0  # wall seconds those were measured over
    round: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def busy(self) -> float:
        """CPUs this benchmark's processes kept busy over the CPU window."""
        return sum(self.cpu[:3]) / self.cpu_window

    @property
    def cpu_per_token_ms(self) -> float:
        """This benchmark's CPU time per output token: independent of other processes'
        load, unlike the wall time."""
        return sum(self.cpu[:3]) / self.output_tokens * 1000


def _offline_pass(engine: LLMEngine, work: Workload, streams: int, tag: str) -> Pass:
    """A closed loop of ``streams`` requests in flight until the workload is done."""
    shown: dict[str, list[float]] = {}  # request id → engine times of outputs with text
    timelines: list[Timeline] = []
    steady: list[Timeline] = []
    ok = tokens = late = 0
    start = time.perf_counter()
    for out in closed_loop(engine, work, streams, tag):
        if out.outputs[0].delta_text:
            shown.setdefault(out.request_id, []).append(out.metrics.token_times[-1])
        if not out.finished or out.outputs[0].finish_reason != "length":
            continue
        times = shown.get(out.request_id)
        ok, tokens = ok + 1, tokens + len(out.outputs[0].token_ids)
        late += not times or times[0] != out.metrics.token_times[0]
        if times:
            timelines.append(Timeline(out.metrics.arrival_time, times[0], times[-1], len(times)))
            if int(out.request_id.rsplit("-", 1)[1]) >= streams:
                steady.append(timelines[-1])
    seconds = time.perf_counter() - start
    text = sum(map(len, shown.values()))
    return Pass(
        "offline", seconds, ok, len(work.prompts) - ok, tokens, text, late, timelines, steady
    )


def _serving_pass(url: str, key: str, work: Workload, streams: int) -> Pass:
    """``streams`` clients drain the workload through the gateway (HTTP + SSE, the key)."""
    x = asyncio.run(stream_workload(url, key, work, streams))
    ok = [r for r in x.records if r.ok]
    timelines, steady = [], []
    for i, r in enumerate(x.records):  # in workload order: the first `streams` went out first
        if r.ok and r.first is not None and r.last is not None:
            timelines.append(Timeline(r.send, r.first, r.last, len(r.chunk_times)))
            if i >= streams:
                steady.append(timelines[-1])
    return Pass("serving", x.seconds, len(ok), len(work.prompts) - len(ok),
                sum(r.output_tokens for r in ok), sum(len(r.chunk_times) for r in ok), 0,
                timelines, steady)  # fmt: skip


def _with_cpu(procs: list[Proc], pass_: Callable[[], Pass]) -> Pass:
    """Run a pass and charge it the CPU time of each process over the whole call."""
    with cpu_use(procs) as use:
        x = pass_()
    replica, gateway = use.children
    x.cpu, x.cpu_window = (use.own, replica, gateway, use.others or 0.0), use.wall
    return x


def run(ctx: SuiteContext) -> Section:
    import torch

    from kvserve.engine.cpu_threads import call_in_short_lived_thread

    model_dir, config = ctx.model("30m", tokenizer_vocab=True)
    streams = 4 if ctx.smoke else CONCURRENCY
    work = ctx.mixed_workload(64, config.vocab_size, smoke=(6, (4, 16), (4, 8)))
    warm = Workload(work.prompts[:streams], [WARMUP_TOKENS] * min(streams, len(work.prompts)))
    cpus = usable_cpus()
    threads = torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else max(1, cpus - 1)
    saved_threads = torch.get_num_threads()
    settings = LaunchSettings(
        str(model_dir), dtype=DTYPE, device=ctx.device, seed=ctx.seed, max_num_seqs=streams
    )
    workdir = ctx.work_dir / "serving_path"
    workdir.mkdir(parents=True, exist_ok=True)
    passes: list[Pass] = []
    try:
        torch.set_num_threads(threads)  # inherited by the short-lived threads below
        ctx.say(f"starting a replica ({threads} compute thread(s)) and a gateway ...")
        with Launcher(settings, workdir) as launcher:
            (rep,) = launcher.start_replicas(1, prefix_caching=False, threads=threads)
            gateway = launcher.start_gateway([rep.grpc_address], "prefix")
            url, key, procs = gateway.url, gateway.key, [rep.proc, gateway.proc]
            llm = call_in_short_lived_thread(ctx.llm, model_dir, dtype=DTYPE, max_num_seqs=streams)
            # Untimed: the first steps at each batch size, and the gRPC path's first calls.
            call_in_short_lived_thread(_offline_pass, llm.engine, warm, streams, "warm")
            if _serving_pass(url, key, warm, streams).failed:
                raise RuntimeError("warm-up requests through the gateway failed")
            for r in range(1, ctx.rounds + 1):
                offline = partial(_offline_pass, llm.engine, work, streams, f"r{r}")
                off = _with_cpu(procs, partial(call_in_short_lived_thread, offline))
                srv = _with_cpu(procs, partial(_serving_pass, url, key, work, streams))
                for x in (off, srv):
                    x.round = r
                    passes.append(x)
                    failed = f" ({x.failed} failed)" if x.failed else ""
                    ctx.say(f"  round {r}/{ctx.rounds} {x.side:<8} {x.seconds:6.2f} s "
                            f"{x.tok_s:7.1f} tok/s{failed}")  # fmt: skip
    finally:
        torch.set_num_threads(saved_threads)
    off = max((x for x in passes if x.side == "offline"), key=lambda x: x.tok_s)
    srv = max((x for x in passes if x.side == "serving"), key=lambda x: x.tok_s)
    if not (off.timelines and srv.timelines):
        raise RuntimeError("no request showed any text: no TTFT to report")
    return _section(ctx, config, work, streams, threads, cpus, passes, off, srv)


def _section(ctx: SuiteContext, config: ModelConfig, work: Workload, streams: int, threads: int,
             cpus: int, passes: list[Pass], off: Pass, srv: Pass) -> Section:  # fmt: skip
    # TTFT from the steady part only (docs/bench-methods.md), TPOT from all requests.
    lat = {}
    for x in (off, srv):
        ttft, tpot = latency(x.steady or x.timelines), latency(x.timelines)
        lat[x.side] = Latency(ttft.ttft_mean_ms, ttft.ttft_p50_ms, ttft.ttft_p99_ms,
                              tpot.tpot_p50_ms, tpot.tpot_p99_ms)  # fmt: skip

    def row(label: str, x: Pass, la: Latency) -> list[object]:
        return [
            label, x.round, x.ok, x.failed, x.output_tokens, round(x.seconds, 3),
            round(x.tok_s, 1), round(definitions.request_throughput(x.ok, x.seconds), 3),
            la.ttft_p50_ms, la.ttft_p99_ms, la.tpot_p50_ms, la.tpot_p99_ms,
        ]  # fmt: skip

    main = table(
        "Throughput and latency (best round of each side)",
        "path | round | requests ok | requests failed | output tokens (tokens) | wall (s) | "
        "output (tok/s) | requests (req/s) | TTFT p50, steady (ms) | TTFT p99, steady (ms) | "
        "TPOT p50 (ms) | TPOT p99 (ms)",
        [row("offline engine", off, lat["offline"]), row("gateway + server", srv, lat["serving"])],
    )
    ratio, cpu_ratio = srv.tok_s / off.tok_s, srv.cpu_per_token_ms / off.cpu_per_token_ms
    d_ttft = diff(lat["serving"].ttft_p50_ms, lat["offline"].ttft_p50_ms)
    d_tpot = diff(lat["serving"].tpot_p50_ms, lat["offline"].tpot_p50_ms)
    compare = table(
        "Serving path vs offline engine (best rounds)",
        "output throughput, serving / offline (×) | TTFT p50, serving − offline (ms) | "
        "TPOT p50, serving − offline (ms) | CPU per output token, serving / offline (×)",
        [[round(ratio, 3), d_ttft, d_tpot, round(cpu_ratio, 3)]],
    )
    sides = (("offline engine", off), ("gateway + server", srv))
    cpu = table(
        "CPU time over each side's best round",
        "path | this process (CPU s) | replica process (CPU s) | gateway process (CPU s) | "
        "other processes (CPU s) | window (s) | busy, this benchmark's processes (CPUs) | "
        "CPU per output token (ms)",
        [[label, *(round(c, 2) for c in x.cpu), round(x.cpu_window, 3), round(x.busy, 2),
          round(x.cpu_per_token_ms, 3)] for label, x in sides],
    )  # fmt: skip
    rounds = table(
        "Every round",
        "round | path | wall (s) | output (tok/s)",
        [[x.round, x.side, round(x.seconds, 3), round(x.tok_s, 1)] for x in passes],
    )
    setup = model_setup(config, DTYPE, ctx.device) | {
        "prompts": len(work.prompts),
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "concurrency": streams,
        "prefix_caching": "off",
        "rounds": ctx.rounds,
        "cpus": cpus,
        "compute_threads_per_engine": threads,
    }
    notes = [
        f"The serving path delivered {ratio:.0%} of the offline engine's output throughput "
        f"({srv.tok_s:.1f} vs {off.tok_s:.1f} tok/s), best of {ctx.rounds} interleaved "
        f"round(s) each; both engines compute with {threads} thread(s) on {cpus} CPU(s).",
        f"Through the gateway and server, TTFT p50 changed by {_signed(d_ttft)} ms and TPOT "
        f"p50 by {_signed(d_tpot)} ms. That is the whole path, not split by part: the "
        "client's HTTP request and SSE parsing, the gateway and its gRPC stream to the "
        "replica, the replica's HTTP/gRPC server threads, and those processes' CPU time "
        "taken from the same CPUs the engine computes on.",
        f"CPU per output token: {srv.cpu_per_token_ms:.2f} ms on the serving path (replica "
        f"{srv.cpu[1]:.2f} s, gateway {srv.cpu[2]:.2f} s, clients {srv.cpu[0]:.2f} s) vs "
        f"{off.cpu_per_token_ms:.2f} ms offline (the engine's process {off.cpu[0]:.2f} s; the "
        f"idle replica and gateway {off.cpu[1] + off.cpu[2]:.2f} s meanwhile): the serving "
        f"path cost {cpu_ratio - 1:+.0%} CPU per token. CPU time counts only what these "
        "processes ran, so unlike wall time it leaves out waiting for a CPU.",
        f"Other processes on the machine kept {off.cpu[3] / off.cpu_window:.2f} CPUs busy "
        f"during the best offline round and {srv.cpu[3] / srv.cpu_window:.2f} during the best "
        f"serving round, of {cpus}; this benchmark's processes {off.busy:.2f} and "
        f"{srv.busy:.2f}. Wall-time figures (throughput, TTFT, TPOT) compare fairly only as "
        "far as that outside load was even.",
        f"Text outputs per output token: {off.text_outputs / off.output_tokens:.2f} offline "
        f"(engine steps with text), {srv.text_outputs / srv.output_tokens:.2f} streamed (SSE "
        "chunks with text). TTFT runs from the request's arrival in the engine (offline) or "
        "its last byte on the socket (client) to the first output with text; neither counts "
        f"the wait for one of the {streams} streams to be free. TTFT is over the requests "
        f"after the first {streams} (each sent as a stream came free: "
        f"{len(off.steady)} offline, {len(srv.steady)} serving): the first wave arrives all "
        "at once offline but spread out through the gateway, and the first steps prefill "
        "every prompt the token budget holds, so their TTFTs measure the start-up, not the "
        "path. TPOT is the mean gap between "
        f"outputs with text. {off.late_text} of {off.ok} requests showed no text with their "
        "first token (offline; random weights emit bytes the tokenizer cannot show yet), so "
        "their TTFT includes decode steps.",
    ]
    return Section(NAME, TITLE, setup, [main, compare, cpu, rounds], notes=notes)


def _signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}"
