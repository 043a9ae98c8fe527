"""status.capacity: what one replica holds, from the model's config.json alone.

Uses the engine's own calculator (``kvserve.capacity``, the same code behind
``kvserve calc``) so the operator's numbers and the engine's agree. The inputs are the
spec's GPU memory and ``kvCacheMemoryFraction``, not a measurement, so the result is
an estimate of the KV cache the engine will size at startup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.capacity import estimate
from kvserve.config import DTYPES
from kvserve.model.config import ModelConfig
from kvserve_operator.spec import InferenceModelSpec


def serving_dtype(config: ModelConfig, spec: InferenceModelSpec) -> str:
    """The dtype the engine will load the weights in on a GPU."""
    if spec.engine.dtype != "auto":
        return spec.engine.dtype
    # `kvserve serve --dtype auto` takes a checkpoint's torch_dtype on GPU when it is one
    # the engine knows; anything else falls back to bfloat16 (EngineConfig.torch_dtype).
    if config.torch_dtype in DTYPES:
        return config.torch_dtype
    return "bfloat16"


def capacity_status(
    config_json: Mapping[str, Any], spec: InferenceModelSpec, source: str
) -> dict[str, Any]:
    """status.capacity for one replica; raises ValueError (for status.capacityError).

    The model is sharded over ``spec.tensor_parallel_size`` ranks, one GPU each, and
    every rank holds every token's KV for its own heads, so one rank's GPU decides:
    memory per rank = gpuMemoryGiB × kvCacheMemoryFraction, as the engine budgets
    ``--gpu-memory-utilization`` of its GPU for its weights plus KV cache. weightBytes
    and kvBytesPerToken are one rank's. tokensPerReplica is rounded down to whole KV
    blocks, as the engine's pool is.
    """
    r = spec.resources
    if r.gpus < 1:
        raise ValueError(
            "capacity needs GPUs: resources.gpus is 0 (the engine runs on CPU with a "
            "fixed-size KV cache)"
        )
    try:
        config = ModelConfig.from_dict(dict(config_json))
    except ValueError as e:  # includes UnsupportedModelError
        raise ValueError(f"config.json: {e}") from None
    except (TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"config.json is malformed: {type(e).__name__}: {e}") from None

    dtype = serving_dtype(config, spec)
    tp = spec.tensor_parallel_size
    memory_gib = r.gpu_memory_gib * spec.engine.kv_cache_memory_fraction
    block_size = spec.engine.block_size
    budget = (
        f"{r.gpu_memory_gib:g} GiB × kvCacheMemoryFraction "
        f"{spec.engine.kv_cache_memory_fraction:g} = {memory_gib:g} GiB per GPU"
    )
    if tp > 1:
        budget += f", one rank of tensorParallelSize {tp}"
    try:
        report = estimate(
            config,
            dtype=dtype,
            block_size=block_size,
            memory_gib=memory_gib,
            quantization=spec.engine.quantization,
            # auto: the weights' dtype; fp8_e4m3 / fp8_e5m2: 1 byte (docs/engine.md).
            kv_dtype=None if spec.engine.kv_cache_dtype == "auto" else "fp8",
            tensor_parallel_size=tp,
        )
    except ValueError as e:
        raise ValueError(f"{e} ({budget})") from None
    assert report.max_kv_tokens is not None  # memory_gib was given
    tokens = report.max_kv_tokens // block_size * block_size
    if tokens < 1:
        raise ValueError(
            f"no KV-cache block of {block_size} tokens fits beside "
            f"{report.rank_weight_bytes / 2**30:.2f} GiB of weights ({dtype}) in {budget}"
        )
    return {
        "tensorParallelSize": tp,
        "weightBytes": report.rank_weight_bytes,
        "kvBytesPerToken": report.rank_kv_bytes_per_token,
        "tokensPerReplica": tokens,
        "source": source,
    }
