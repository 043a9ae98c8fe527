"""The engine arguments of ``LLM(model, **kwargs)``, for type checkers.

Generated from ``kvserve.config.EngineConfig`` by ``python -m kvserve.engine_options``;
do not edit (a test checks it is up to date)."""

from __future__ import annotations

from typing import Any, TypedDict


class EngineKwargs(TypedDict, total=False):
    tokenizer: str | None
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    device: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    seed: int
    tensor_parallel_size: int
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None
    speculative_config: dict[str, Any] | None
    speculative_max_batch: int
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_topic: str | None
    recompute_every_step: bool
