"""Roofline: decode and prefill against this machine's measured memory bandwidth and
matmul peak (docs/bench-methods.md, "roofline")."""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.bench.cpu import cpu_use, usable_cpus
from kvserve.bench.results import Column, Section, Table, Target, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import greedy
from kvserve.config import DEFAULT_BLOCK_SIZE, blocks_for, cpu_has_native_bf16, torch_dtype
from kvserve.model.config import ModelConfig

NAME = "roofline"
TITLE = "Roofline: decode and prefill vs this machine's bandwidth and matmul peak"
MODEL_DTYPES = ("bfloat16", "float32")  # the targets are about the first
BATCHES = (1, 8, 32)
TARGET_DECODE = 60.0  # % of the bandwidth bound, batch 1, bf16
TARGET_PREFILL = 50.0  # % of the matmul bound, bf16


@dataclass(frozen=True)
class Sizes:
    read_mib: int  # bandwidth tensor
    matmul_n: int
    reps: int  # timed repetitions of each machine measurement (after one warm-up)
    prompt: int  # decode requests' prompt tokens
    prefill: int  # prefill request's tokens
    prefill_reps: int
    decode_steps: int  # timed decode steps per batch: at most this many...
    decode_seconds: float  # ...or as many as fit in this time (at least 3)


def _sizes(smoke: bool, cuda: bool) -> Sizes:
    if smoke:
        return Sizes(4, 64, 1, 8, 32, 1, 2, 0.0)
    if cuda:
        return Sizes(2048, 8192, 10, 64, 512, 5, 32, 4.0)
    return Sizes(512, 2048, 3, 64, 512, 3, 16, 4.0)


@dataclass
class Point:
    """One measured step in ``dtype``: a decode step at a batch size, or a prefill."""

    dtype: str
    bandwidth: float  # bytes/s, measured
    peak: float  # FLOP/s of this dtype, measured
    weight_bytes: float  # read per step
    kind: str  # "decode" or "prefill"
    batch: int
    tokens: float  # decode: KV tokens read per step (mean); prefill: prompt tokens
    kv_bytes: float  # decode: read; prefill: written
    flops: float
    seconds: float  # median step time
    samples: int  # timed steps

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def bandwidth_bound(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def compute_bound(self) -> float:
        return self.flops / self.peak

    @property
    def bound(self) -> float:
        """The bound the issue compares with: bandwidth for decode, matmul for prefill."""
        return self.bandwidth_bound if self.kind == "decode" else self.compute_bound

    @property
    def fraction(self) -> float:  # % of the bound
        return 100 * self.bound / self.seconds


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], object], reps: int, device: str) -> float:
    fn()  # warm-up: first-call allocation and kernel selection
    return min(_timed(fn, device) for _ in range(reps))


def measure_machine(s: Sizes, device: str) -> tuple[float, dict[str, float]]:
    """Streaming-read bandwidth (bytes/s) and matmul peak per dtype (FLOP/s)."""
    x = torch.ones(s.read_mib * 2**20 // 4, dtype=torch.float32, device=device)
    bandwidth = x.numel() * 4 / _best(x.sum, s.reps, device)
    del x
    peaks = {}
    for name in MODEL_DTYPES:
        a = torch.randn(s.matmul_n, s.matmul_n, device=device).to(torch_dtype(name))
        b = torch.randn(s.matmul_n, s.matmul_n, device=device).to(torch_dtype(name))
        peaks[name] = 2 * s.matmul_n**3 / _best(functools.partial(F.linear, a, b), s.reps, device)
    return bandwidth, peaks


def measure_model(
    ctx: SuiteContext, path: Path, dtype: str, s: Sizes, bandwidth: float, peak: float
) -> list[Point]:
    """Decode at each batch size, then prefill, for the model at ``path`` in ``dtype``."""
    c = ModelConfig.from_file(path)
    elem = torch.empty(0, dtype=torch_dtype(dtype)).element_size()
    h, kv_per_token = c.hidden_size, c.kv_bytes_per_token(elem)
    body = c.num_layers * (2 * h * (c.q_size + c.kv_size) + 3 * h * c.intermediate_size)
    head = c.vocab_size * h  # the LM head's weights
    # A step reads every parameter but the input embedding table (unless tied to the head).
    weights = (c.num_params() - (0 if c.tie_word_embeddings else head)) * elem
    attn = 4 * c.q_size * c.num_layers  # FLOPs per (query, key) pair: score + weighted sum
    point = functools.partial(Point, dtype, bandwidth, peak, weights)
    max_tokens = 3 * (s.decode_steps + 8)  # outlasts the three batch phases
    max_len = max(s.prompt + max_tokens, s.prefill + 1)
    llm = ctx.llm(
        path,
        dtype=dtype,
        max_num_seqs=max(BATCHES),
        max_model_len=max_len,
        # One step admits a whole batch of prompts, or the whole prefill request.
        max_num_batched_tokens=max(s.prefill, max(BATCHES) * (s.prompt + 1)),
        num_kv_blocks=(max(BATCHES) + 1) * blocks_for(max_len, DEFAULT_BLOCK_SIZE),
    )
    engine, gen = llm.engine, torch.Generator().manual_seed(ctx.seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()  # type: ignore[no-any-return]

    def scheduled() -> list[tuple[str, int]]:
        sched = engine.last_schedule
        return [(r.request_id, n) for r, n in sched.scheduled] if sched else []

    points = []
    decode = greedy(max_tokens)
    for batch in BATCHES:
        for i in range(len(engine.requests), batch):
            engine.add_request(f"decode-{i}", ids(s.prompt), decode)
        running = engine.scheduler.running
        while len(running) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in running
        ):
            if len(engine.requests) < batch:
                raise RuntimeError("decode requests finished before they were timed")
            engine.step()  # prefills (and steps mixing them with decodes) are not timed
        engine.step()  # nor is the first pure decode step at this batch size
        times: list[float] = []
        kv_tokens: list[int] = []
        start = time.perf_counter()
        while len(times) < s.decode_steps and (
            len(times) < 3 or time.perf_counter() - start < s.decode_seconds
        ):
            times.append(_timed(engine.step, ctx.device))
            done = scheduled()
            if len(done) != batch or any(n != 1 for _, n in done):
                raise RuntimeError(f"a timed step at batch {batch} was not a pure decode step")
            # Each request's context after the step: the keys and values the step read.
            kv_tokens.append(sum(engine.requests[rid].num_computed_tokens for rid, _ in done))
        tokens = sum(kv_tokens) / len(kv_tokens)
        flops = 2 * (body + head) * batch + attn * tokens
        points.append(
            point("decode", batch, tokens, tokens * kv_per_token, flops, median(times), len(times))
        )
        ctx.say(f"  {dtype} decode batch {batch}: {_ms(points[-1].seconds)}/step")
    engine.abort_request(list(engine.requests))

    times = []
    once = greedy(1)  # done in its first step
    for rep in range(s.prefill_reps):
        engine.add_request(f"prefill-{rep}", ids(s.prefill), once)
        times.append(_timed(engine.step, ctx.device))
        if scheduled() != [(f"prefill-{rep}", s.prefill)]:
            raise RuntimeError("the prefill was not computed in one step")
    t = s.prefill
    flops = 2 * body * t + 2 * head + attn * t * (t + 1) / 2  # logits of the last token only
    points.append(point("prefill", 1, t, t * kv_per_token, flops, median(times), len(times)))
    ctx.say(f"  {dtype} prefill of {t} tokens: {_ms(points[-1].seconds)}")
    return points


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"  # never 1.2e+03


def _sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits (smoke and full sizes differ 1000×)."""
    return float(f"{x:.{digits}g}")


def _notes(points: list[Point], device: str, others: float | None) -> list[str]:
    """What the figures mean on this machine, each stated from this run's numbers."""
    get = {(p.dtype, p.kind, p.batch): p for p in points}
    bf, fp = MODEL_DTYPES
    d1, d1f = get[(bf, "decode", 1)], get[(fp, "decode", 1)]
    pre, pref = get[(bf, "prefill", 1)], get[(fp, "prefill", 1)]
    notes = []
    if pre.peak < pref.peak:
        why = ""
        if device == "cpu" and not cpu_has_native_bf16():
            why = " oneDNN has no native bf16 on this CPU (no AVX512-BF16 or AMX): it emulates it."
        notes.append(
            f"The bf16 matmul peak is {pref.peak / pre.peak:.1f}× below fp32's "
            f"({pre.peak / 1e9:.1f} vs {pref.peak / 1e9:.1f} GFLOP/s).{why}"
        )
    for dtype in MODEL_DTYPES:
        capped = [
            f"{p.batch} ({_ms(p.compute_bound)} vs {_ms(p.bound)}: at most "
            f"{100 * p.bound / p.compute_bound:.0f}% of the bandwidth bound)"
            for p in points
            if p.dtype == dtype and p.kind == "decode" and p.compute_bound > p.bound
        ]
        if capped:
            notes.append(
                f"{dtype} decode is compute-bound here at batch {', '.join(capped)}. At the "
                "measured matmul peak its FLOPs take longer than reading its bytes (compute "
                "vs bandwidth bound), so it cannot reach the bandwidth bound there."
            )
    if d1.fraction < TARGET_DECODE:
        rest = d1.seconds - max(d1.bound, d1.compute_bound)
        notes.append(
            f"Decode at batch 1 in bf16 takes {_ms(d1.seconds)} a step. That is {_ms(rest)} "
            "more than the larger of its two bounds: time not spent streaming bytes at full "
            "bandwidth. This section does not break it down further; candidates are per-step "
            "Python and scheduling work, kernel overheads and the KV gather. fp32 at batch 1 "
            f"reaches {d1f.fraction:.0f}% of its bound ({d1f.bytes / d1f.seconds / 1e9:.1f} GB/s)."
        )
    if d1.seconds > d1f.seconds:
        notes.append(
            f"bf16 decode at batch 1 is slower than fp32 ({_ms(d1.seconds)} vs "
            f"{_ms(d1f.seconds)} a step), though it reads half the bytes."
        )
    if pre.fraction < TARGET_PREFILL:
        notes.append(
            f"Prefill in bf16 runs at {pre.flops / pre.seconds / 1e9:.1f} GFLOP/s, "
            f"{pre.fraction:.0f}% of the bf16 n×n matmul peak; fp32 reaches "
            f"{pref.fraction:.0f}% of its own."
        )
    if any(p.fraction > 100 for p in points):
        notes.append(
            "Some fractions exceed 100%. There the model's kernels beat the probe that set the "
            "ceiling: a sum for bandwidth, an n×n matmul for the peak."
        )
    last = get[(bf, "decode", max(BATCHES))]
    notes.append(
        f"KV reads are {100 * last.kv_bytes / last.bytes:.0f}% of a decode step's bytes at "
        f"batch {last.batch} ({last.tokens:.0f} context tokens), and "
        f"{100 * d1.kv_bytes / d1.bytes:.1f}% at batch 1, where the weights dominate."
    )
    notes.append(
        f"fp32, for information only: decode at batch 1 reaches {d1f.fraction:.0f}% of the "
        f"bandwidth bound, and prefill {pref.fraction:.0f}% of the matmul bound."
    )
    if others is not None and others > 10:
        notes.append(
            f"Other processes used {others:.0f}% of the CPUs during this section, so every "
            "time here is slower than it would be on an idle machine."
        )
    return notes


Getter = Callable[[Point], Any]
DECODE_COLUMNS: list[tuple[Column, Getter]] = [
    (Column("dtype"), lambda p: p.dtype),
    (Column("batch"), lambda p: p.batch),
    (Column("steps timed"), lambda p: p.samples),
    (Column("KV tokens read/step"), lambda p: round(p.tokens)),
    (Column("bytes/step", "MB"), lambda p: _sig(p.bytes / 1e6)),
    (Column("step", "ms"), lambda p: _sig(p.seconds * 1e3)),
    (Column("bandwidth bound", "ms"), lambda p: _sig(p.bandwidth_bound * 1e3)),
    (Column("compute bound", "ms"), lambda p: _sig(p.compute_bound * 1e3)),
    (Column("fraction of bound", "%"), lambda p: _sig(p.fraction)),
    (Column("achieved", "GB/s"), lambda p: _sig(p.bytes / p.seconds / 1e9)),
]
PREFILL_COLUMNS: list[tuple[Column, Getter]] = [
    (Column("dtype"), lambda p: p.dtype),
    (Column("tokens"), lambda p: int(p.tokens)),
    (Column("runs"), lambda p: p.samples),
    (Column("work", "GFLOP"), lambda p: _sig(p.flops / 1e9)),
    (Column("step", "ms"), lambda p: _sig(p.seconds * 1e3)),
    (Column("matmul bound", "ms"), lambda p: _sig(p.bound * 1e3)),
    (Column("fraction of bound", "%"), lambda p: _sig(p.fraction)),
    (Column("achieved", "GFLOP/s"), lambda p: _sig(p.flops / p.seconds / 1e9)),
]


def _table(title: str, columns: list[tuple[Column, Getter]], points: list[Point]) -> Table:
    return Table(title, [c for c, _ in columns], [[get(p) for _, get in columns] for p in points])


def run(ctx: SuiteContext) -> Section:
    s = _sizes(ctx.smoke, ctx.device.startswith("cuda"))
    with cpu_use() as use:
        bandwidth, peaks = measure_machine(s, ctx.device)
        gflops = {k: _sig(v / 1e9) for k, v in peaks.items()}
        ctx.say(f"  streaming read {bandwidth / 1e9:.1f} GB/s; matmul peak GFLOP/s {gflops}")
        path = ctx.checkpoint("150m")
        points: list[Point] = []
        for dtype in MODEL_DTYPES:
            points += measure_model(ctx, path, dtype, s, bandwidth, peaks[dtype])
            gc.collect()  # free this dtype's model and KV cache before the next one
    # % of the machine's CPU time that other processes used meanwhile
    others = None if use.others is None else 100 * use.others / (use.wall * usable_cpus())

    machine = [_sig(bandwidth / 1e9), gflops["float32"], gflops["bfloat16"]]
    headers = "streaming read (GB/s) | fp32 matmul peak (GFLOP/s) | bf16 matmul peak (GFLOP/s)"
    tables = [
        table("Machine", f"{headers} | read size (MiB) | matmul n",
              [[*machine, s.read_mib, s.matmul_n]]),
        _table("Decode", DECODE_COLUMNS, [p for p in points if p.kind == "decode"]),
        _table("Prefill", PREFILL_COLUMNS, [p for p in points if p.kind == "prefill"]),
    ]  # fmt: skip
    bf16 = {(p.kind, p.batch): p for p in points if p.dtype == MODEL_DTYPES[0]}
    targets = [
        Target(f"{name}, bf16: fraction of the {bound} bound", _sig(p.fraction), goal, "%")
        for name, bound, p, goal in [
            ("decode batch 1", "bandwidth", bf16[("decode", 1)], TARGET_DECODE),
            ("prefill", "matmul", bf16[("prefill", 1)], TARGET_PREFILL),
        ]
    ]
    setup = model_setup(ModelConfig.from_file(path), "bfloat16 and float32", ctx.device) | {
        "streaming read (GB/s)": machine[0],
        "fp32 matmul peak (GFLOP/s)": machine[1],
        "bf16 matmul peak (GFLOP/s)": machine[2],
        "decode prompt tokens": s.prompt,
        "prefill tokens": s.prefill,
        "torch threads": torch.get_num_threads(),
        "CPU share of other processes (%)": None if others is None else round(others, 1),
    }
    notes = _notes(points, ctx.device, others)
    plots = ctx.save_plot("roofline.png", _draw, bandwidth, peaks, points)
    return Section(NAME, TITLE, setup, tables, targets, notes, plots)


def _draw(fig: Any, bandwidth: float, peaks: dict[str, float], points: list[Point]) -> None:
    import numpy as np

    ax = fig.add_subplot()
    # Span every point and both ridges (where a roof turns flat).
    xs = [p.flops / p.bytes for p in points] + [v / bandwidth for v in peaks.values()]
    x = np.geomspace(min(xs) / 4, max(xs) * 4, 200)
    for color, style, dtype in zip(("C0", "C1"), ("--", "-"), MODEL_DTYPES, strict=True):
        roof = np.minimum(x * bandwidth, peaks[dtype]) / 1e9
        label = f"{dtype} roof ({peaks[dtype] / 1e9:.0f} GFLOP/s)"
        ax.plot(x, roof, style, color=color, label=label, zorder=3 if style == "--" else 2)
        for p in (p for p in points if p.dtype == dtype):
            at = (p.flops / p.bytes, p.flops / p.seconds / 1e9)
            ax.scatter(*at, color=color, marker="o" if p.kind == "decode" else "s")
            text = f"B={p.batch}" if p.kind == "decode" else f"prefill {p.tokens:.0f}"
            ax.annotate(text, at, textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"Roofline: {bandwidth / 1e9:.1f} GB/s streaming read; points = this run")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
