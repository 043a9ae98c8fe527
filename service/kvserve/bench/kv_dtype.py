"""fp8 KV cache vs the fp32 cache: decode tokens/s at batch 1 and 16, and where it goes.

On the ~34M-parameter random Llama (``MODEL_SHAPES["30m"]``) in fp32, one engine per side
stays loaded for the whole section: the fp32 cache (``kv_cache_dtype="auto"``),
``fp8_e4m3`` and ``fp8_e5m2``. For each batch size B, each side admits B requests of a
random prompt of ``PROMPT`` tokens (long enough that reading the KV cache is a real part
of a decode step), steps until they all decode, then times pure decode steps one by one
(16, or as many as fit in 4 s, at least 3) and keeps the median; decode tokens/s = B /
that step time. The sides alternate within each round (this machine's speed drifts), each
keeping its best round (``kvserve.bench.decode_throughput``, shared with
``quantization``). The issue's target: fp8 ≥ 0.85× the fp32 cache's decode
tokens/s.

The profile table times, on the same shapes, what an fp8 decode step adds per layer:
gathering a batch's context from the cache (fp32: 4-byte gather; fp8: 1-byte gather,
then the conversion to fp32) for keys and values.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from kvserve.bench.decode_throughput import DecodePlan, time_decode
from kvserve.bench.results import Section, Target, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.config import blocks_for
from kvserve.model.attention import fp8_values

if TYPE_CHECKING:
    from kvserve.llm import LLM

NAME = "kv_dtype"
TITLE = "fp8 KV cache vs fp32 cache: decode tokens/s"
BATCHES = (1, 16)
PROMPT = 512
SIDES = ("auto", "fp8_e4m3", "fp8_e5m2")
TARGET_RATIO = 0.85  # fp8 / fp32-cache decode tokens/s


def _gather_ms(llm: LLM, batch: int, context: int, reps: int) -> tuple[float, float]:
    """Per layer, milliseconds to gather ``batch`` contexts of ``context`` tokens of keys
    and values from the engine's cache: (the gather of the stored bytes, the engine's
    conversion to fp32; 0 for an fp32 cache). Median of ``reps``."""
    cache = llm.engine.runner.kv_caches[0]
    bs = llm.engine.config.block_size
    width = blocks_for(context, bs)
    tables = torch.arange(batch * width).remainder(cache.k.shape[0])
    fp8 = cache.k.element_size() == 1
    gathers: list[float] = []
    casts: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        rows = []
        for c in (cache.k, cache.v):
            storage = c.permute(2, 0, 1, 3)
            rows.append((storage.view(torch.uint8) if fp8 else storage).index_select(1, tables))
        t1 = time.perf_counter()
        if fp8:  # the engine's own conversion (e4m3 on the CPU: through float16's bits)
            for r in rows:
                fp8_values(r, cache.k.dtype, torch.float32)
        t2 = time.perf_counter()
        gathers.append(t1 - t0)
        casts.append(t2 - t1)
    return 1e3 * statistics.median(gathers), 1e3 * statistics.median(casts)


def run(ctx: SuiteContext) -> Section:
    path, config = ctx.model("30m")
    plan = DecodePlan.for_run(ctx, BATCHES, 32 if ctx.smoke else PROMPT)
    llms: dict[str, LLM] = {}
    for side in SIDES:
        llms[side] = ctx.llm(path, kv_cache_dtype=side, **plan.engine_settings())
        ctx.say(f"  loaded kv_cache_dtype={side}")

    times = time_decode(ctx, llms, plan, "kv")
    best = times.best

    def ratio(side: str, batch: int) -> float:
        return times.ratio(side, "auto", batch)

    rows = [
        [batch, "fp32" if side == "auto" else side, round(1e3 * best[side, batch], 2),
         round(times.rate(side, batch), 1), ratio(side, batch)]
        for batch in BATCHES for side in SIDES
    ]  # fmt: skip
    for batch in BATCHES:
        ctx.say(
            f"  B={batch}: fp8_e4m3/fp32 = {ratio('fp8_e4m3', batch)}×, "
            f"fp8_e5m2/fp32 = {ratio('fp8_e5m2', batch)}×"
        )
    profile = []
    reps = 3 if ctx.smoke else 15
    for batch in BATCHES:
        for side, llm in llms.items():
            gather, cast = _gather_ms(llm, batch, plan.prompt + plan.steps, reps)
            per_step = config.num_layers * (gather + cast)
            profile.append([
                batch, "fp32" if side == "auto" else side, round(gather, 3), round(cast, 3),
                round(per_step, 2), round(100 * per_step / (1e3 * best[side, batch]), 1),
            ])  # fmt: skip
    setup: dict[str, Any] = (
        model_setup(config, "float32", ctx.device)
        | {"prompt tokens": plan.prompt, "torch threads": torch.get_num_threads()}
        | times.setup()
    )
    tables = [
        table("Decode, one step at a time", "batch | KV cache | step (ms) | decode tok/s | "
              "vs fp32 cache (×)", rows),
        table("Profile: one layer's K and V context read (outside the engine)",
              "batch | KV cache | gather (ms) | convert to fp32 (ms) | × layers (ms) | "
              "share of the step (%)", profile),
    ]  # fmt: skip
    targets = [
        Target(f"fp8_e4m3 / fp32 cache decode tokens/s, batch {b}", ratio("fp8_e4m3", b),
               TARGET_RATIO, "×")
        for b in BATCHES
    ]  # fmt: skip
    notes = [
        "fp8: keys and values stored as one byte with a per-layer power-of-two scale "
        "(docs/engine.md, fp8 KV cache); each decode step gathers the bytes and converts "
        "them to the compute dtype before attention.",
        "On a CPU the KV cache lives in host memory that the engine does not run short of; "
        "fp8's gain (twice bf16's blocks, four times fp32's) is for a GPU's memory.",
    ]
    return Section(NAME, TITLE, setup, tables, targets, notes)
