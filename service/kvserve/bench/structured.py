"""Structured outputs: constrained vs unconstrained throughput, mask and compile costs
(docs/bench-methods.md, "structured")."""

from __future__ import annotations

import time
from typing import Any

from kvserve.bench.results import Section, Target, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import random_workload

NAME = "structured"
TITLE = "Structured outputs (JSON schema) vs unconstrained"
CONCURRENCY = 16
TARGET_RATIO = 85.0  # % of the unconstrained throughput
TARGET_COLD_COMPILE_MS = 50.0

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "city": {"type": "string", "maxLength": 12},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01},
        "pool": {"type": "boolean"},
        "kind": {"enum": ["hotel", "hostel", "apartment"]},
        "rooms": {"type": "integer", "minimum": 1, "maximum": 500},
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "open": {"type": "boolean"},
    },
    "required": [
        "name",
        "city",
        "stars",
        "price",
        "pool",
        "kind",
        "rooms",
        "phone",
        "tags",
        "open",
    ],
    "additionalProperties": False,
}


def run(ctx: SuiteContext) -> Section:
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

    dtype = ctx.dtype
    # The test tokenizer's vocabulary, so that the grammar's tokens are real text.
    model_dir, config = ctx.model("30m", tokenizer_vocab=True)
    n = 8 if ctx.smoke else 2 * CONCURRENCY
    work = random_workload(n, (16, 64), (1, 1), config.vocab_size, ctx.seed)
    llm = ctx.llm(model_dir, dtype=dtype, max_num_seqs=CONCURRENCY)
    json_params = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(max_tokens=300, temperature=0, structured_outputs=json_params)

    # The constrained lengths, which the unconstrained side then asks for.
    outs = llm.generate(work.prompts, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    free = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
    masker = llm.engine.runner.token_masker

    def timed(params: Any) -> tuple[float, float, int]:
        seconds0, rows0 = masker.seconds, masker.rows
        start = time.perf_counter()
        got = llm.generate(work.prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in got] == lengths
        return took, masker.seconds - seconds0, masker.rows - rows0

    sides = {"constrained": lambda: timed(constrained), "unconstrained": lambda: timed(free)}
    best = ctx.best_of(sides, seconds=lambda r: r[0])
    tokens = sum(lengths)
    rate = {side: tokens / best[side][0] for side in best}
    ratio = 100 * rate["constrained"] / rate["unconstrained"]
    _, mask_seconds, mask_rows = best["constrained"]
    mask_us = 1e6 * mask_seconds / max(mask_rows, 1)
    cold_ms, cached_ms = _compile_times(llm)

    setup = model_setup(config, dtype, ctx.device) | {
        "requests": n,
        "concurrency (max_num_seqs)": CONCURRENCY,
        "schema": "10 properties (strings, integers, a number, booleans, an enum, a "
        "pattern, an array)",
        "output tokens per side": tokens,
        "constrained requests ended by the grammar": f"{finished}/{n}",
    }
    tables = [
        table("Throughput, same output lengths", "side | seconds | output tok/s",
              [[side, round(best[side][0], 3), round(rate[side], 1)] for side in best]),
        table("Grammar costs", "what | value",
              [["mask per constrained token (µs)", round(mask_us, 1)],
               ["cold compile: validate + compile (ms)", round(cold_ms, 2)],
               ["cached compile (ms)", round(cached_ms, 3)]]),
    ]  # fmt: skip
    targets = [
        Target("constrained / unconstrained throughput", round(ratio, 1), TARGET_RATIO, "%"),
        Target("cold compile", round(cold_ms, 2), TARGET_COLD_COMPILE_MS, "ms", op="<="),
    ]
    notes = [
        "The mask is filled on the CPU between the forward pass's launch and the logits; "
        "on a GPU it overlaps the forward pass, on a CPU it adds to the step.",
        f"The vocabulary is the test tokenizer's ({config.vocab_size} tokens): a mask costs "
        "more with a 150k vocabulary (docs/engine.md, structured outputs).",
    ]
    return Section(NAME, TITLE, setup, tables, targets, notes)


def _compile_times(llm: Any) -> tuple[float, float]:
    """Milliseconds to validate and compile a schema never seen (new property names),
    then the same schema again (a cache hit)."""
    from kvserve.sampling_params import StructuredOutputsParams

    structured = llm.engine.structured
    fresh = {**SCHEMA, "properties": {f"{k}_{time.time_ns()}": v
                                      for k, v in SCHEMA["properties"].items()}}  # fmt: skip
    fresh.pop("required")
    params = StructuredOutputsParams(json=fresh)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        structured.matcher(params).compiled.result()
        times.append(1e3 * (time.perf_counter() - start))
    return times[0], times[1]
