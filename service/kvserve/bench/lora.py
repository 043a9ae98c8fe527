"""LoRA adapters: throughput under adapters vs the base model, load time, memory
(docs/bench-methods.md, "lora")."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvserve.bench.results import Section, Target, model_setup, table
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import random_workload

NAME = "lora"
TITLE = "LoRA adapters vs the base model"
CONCURRENCY = 16
RANK = 16
MAX_LORAS = 4
TARGET_RATIO = 75.0  # % of the base model's throughput, 4 adapters
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: Any, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter for ``config``'s model (non-zero A and B)."""
    import torch
    from safetensors.torch import save_file

    from kvserve.lora.adapter import projection_shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name, (n_in, n_out) in projection_shapes(config).items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def run(ctx: SuiteContext) -> Section:
    from kvserve.lora.adapter import load_adapter
    from kvserve.lora.layers import STACKED_MAX_TOKENS
    from kvserve.lora.request import LoRARequest
    from kvserve.model.config import ModelConfig
    from kvserve.sampling_params import SamplingParams

    dtype = ctx.dtype
    model_dir = ctx.checkpoint("30m")
    config = ModelConfig.from_file(model_dir)
    adapters = [
        LoRARequest(f"a{i}", str(write_adapter(ctx.work_dir / f"adapter-{i}", config, RANK, i)))
        for i in range(16)
    ]
    n = 8 if ctx.smoke else 2 * CONCURRENCY
    work = random_workload(
        n, (16, 64), (32, 32) if ctx.smoke else (64, 64), config.vocab_size, ctx.seed
    )
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work.output_lens
    ]
    llm = ctx.llm(
        model_dir,
        dtype=dtype,
        max_num_seqs=CONCURRENCY,
        enable_lora=True,
        max_loras=MAX_LORAS,
        max_lora_rank=RANK,
        max_cpu_loras=16,
    )

    def timed(distinct: int) -> float:
        loras = [adapters[i % distinct] if distinct else None for i in range(n)]
        start = time.perf_counter()
        llm.generate(work.prompts, params, use_tqdm=False, lora_request=loras)
        return time.perf_counter() - start

    sides = {
        "base model": lambda: timed(0),
        "1 adapter": lambda: timed(1),
        "4 adapters": lambda: timed(4),
        "16 adapters (4 slots)": lambda: timed(16),
    }
    best = ctx.best_of(sides, seconds=lambda s: s)
    rate = {side: work.output_tokens / best[side] for side in best}
    ratio = 100 * rate["4 adapters"] / rate["base model"]

    load_ms = []
    for lora in adapters[:4]:
        start = time.perf_counter()
        weights = load_adapter(lora, config, RANK)
        load_ms.append(1e3 * (time.perf_counter() - start))
    assert llm.engine.lora is not None
    slot_bytes = llm.engine.lora.layers.nbytes / MAX_LORAS

    setup = model_setup(config, dtype, ctx.device) | {
        "requests": n,
        "concurrency (max_num_seqs)": CONCURRENCY,
        "adapters": f"rank {RANK}, all seven projections, max_loras {MAX_LORAS}",
        "output tokens per side": work.output_tokens,
    }
    tables = [
        table("Throughput, same workload", "side | seconds | output tok/s | vs base (%)",
              [[side, round(best[side], 3), round(rate[side], 1),
                round(100 * rate[side] / rate["base model"], 1)] for side in best]),
        table("Adapter costs", "what | value",
              [["load from local disk, median of 4 (ms)", round(statistics.median(load_ms), 2)],
               ["host memory per adapter (MiB, fp32)", round(weights.nbytes / 2**20, 2)],
               ["device memory per slot (MiB, padded to max_lora_rank)",
                round(slot_bytes / 2**20, 2)]]),
    ]  # fmt: skip
    targets = [Target("4 adapters / base model throughput", round(ratio, 1), TARGET_RATIO, "%")]
    notes = [
        "Batched LoRA chosen per step (docs/engine.md, LoRA adapters): stacked slots for "
        f"steps of up to {STACKED_MAX_TOKENS} tokens with two or more adapters (2 + parts "
        "ops per projection, every slot's FLOPs), per-adapter segments otherwise.",
    ]
    return Section(NAME, TITLE, setup, tables, targets, notes)
