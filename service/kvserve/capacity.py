"""Capacity calculator: weights, KV cache, blocks and a memory-bound decode time.

Formulas are the fixed ones in docs/architecture.md §3:

- KV bytes per token = 2 × layers × kv_heads × head_dim × bytes_per_element
- KV for requests = KV bytes per token × Σ Tᵢ
- blocks = Σ ceil(Tᵢ / block_size); slots = block_size × blocks
- decode lower bound per step = bytes read (weights + KV of the batch) / bandwidth

With tensor parallelism over N ranks (``tensor_parallel_size``) each rank holds its own
slice of the weights and the KV of its own heads (``kvserve.parallel.shard``): the
``rank_*`` figures are one rank's, ``memory_gib`` is one rank's accelerator memory, and
the decode bound is one rank's reads (the ranks read in parallel; the all-reduces
between them are not counted). ``params``, ``weight_bytes``, ``kv_bytes_per_token`` and
``kv_bytes`` stay the whole model's.

``num_kv_blocks`` is the single definition of how many KV blocks fit in a byte
budget; the engine's block pool sizing uses it too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.config import DEFAULT_BLOCK_SIZE
from kvserve.model.config import ModelConfig, total_blocks
from kvserve.parallel.shard import local_config, rank_num_params

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    # kvserve serve --kv-cache-dtype's names for the same byte (docs/engine.md).
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

GIB = 2**30
# quantization="int8" (kvserve.model.quant): the projections' weights take 1 byte each,
# plus one bf16 scale per output row; everything else stays in the weight dtype.
INT8_SCALE_BYTES = 2


def dtype_bytes(name: str) -> int:
    """Bytes per element for a dtype name such as ``bf16`` or ``torch.float16``."""
    key = name.strip().lower().removeprefix("torch.")
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class CapacityReport:
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int
    blocks: int
    slots: int
    decode_lower_bound_ms: float | None
    max_kv_tokens: int | None
    # One rank's share with tensor parallelism (the whole model's when it is 1).
    tensor_parallel_size: int
    rank_params: int
    rank_weight_bytes: int
    rank_kv_bytes_per_token: int
    rank_kv_bytes: int

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    config: ModelConfig,
    *,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    tokens: Sequence[int] = (),
    block_size: int = DEFAULT_BLOCK_SIZE,
    bandwidth_gbps: float | None = None,
    memory_gib: float | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
) -> CapacityReport:
    """Size weights and KV cache for ``config``.

    ``tokens`` are request lengths (prompt + output) sharing the KV cache.
    ``bandwidth_gbps`` is memory bandwidth in GB/s (10⁹ bytes/s); ``memory_gib``
    is one rank's accelerator memory in GiB, giving how many KV tokens fit beside its
    weights. ``quantization="int8"``: the projections' weights are int8.
    ``tensor_parallel_size``: ranks the model is sharded over; ValueError, with the
    numbers, when it cannot be.
    """
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be None or 'int8' (got {quantization!r})")
    weight_elem = dtype_bytes(dtype)
    kv_elem = dtype_bytes(kv_dtype if kv_dtype is not None else dtype)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (got {block_size!r})")
    token_list = list(tokens)
    for t in token_list:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tokens must all be integers >= 1 (got {t!r})")
    if bandwidth_gbps is not None and not 0 < bandwidth_gbps < math.inf:  # NaN too
        raise ValueError(f"bandwidth_gbps must be a finite number > 0 (got {bandwidth_gbps!r})")
    if memory_gib is not None and not 0 < memory_gib < math.inf:
        raise ValueError(f"memory_gib must be a finite number > 0 (got {memory_gib!r})")

    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1 (got {tp!r})")
    local = local_config(config, tp)  # refuses an unshardable tp with the numbers

    params = config.num_params()
    weight_bytes = _weight_bytes(config, params, weight_elem, quantization)
    rank_params = rank_num_params(config, tp)
    rank_weight_bytes = _weight_bytes(local, rank_params, weight_elem, quantization)
    kv_per_token = config.kv_bytes_per_token(kv_elem)
    if kv_per_token <= 0:
        raise ValueError(f"config gives {kv_per_token} KV bytes per token; expected > 0")
    rank_kv_per_token = local.kv_bytes_per_token(kv_elem)
    kv_bytes = kv_per_token * sum(token_list)
    rank_kv_bytes = rank_kv_per_token * sum(token_list)
    blocks = total_blocks(token_list, block_size)

    decode_ms: float | None = None
    if bandwidth_gbps is not None:
        # One decode step reads every weight of the rank once plus its KV of the batch.
        decode_ms = (rank_weight_bytes + rank_kv_bytes) / (bandwidth_gbps * 1e9) * 1000.0

    max_kv_tokens: int | None = None
    if memory_gib is not None:
        free = memory_gib * GIB - rank_weight_bytes
        if free < 0:
            whose = "weights" if tp == 1 else f"one rank's weights (of {tp})"
            raise ValueError(
                f"weights alone do not fit: {rank_weight_bytes / GIB:.2f} GiB of {whose} "
                f"({_weights_label(dtype, quantization)}) > {memory_gib:g} GiB of memory"
            )
        # Every rank holds every token (of its own heads), so one rank's room is the
        # replica's.
        max_kv_tokens = math.floor(free / rank_kv_per_token)

    return CapacityReport(
        params=params,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        kv_bytes=kv_bytes,
        blocks=blocks,
        slots=block_size * blocks,
        decode_lower_bound_ms=decode_ms,
        max_kv_tokens=max_kv_tokens,
        tensor_parallel_size=tp,
        rank_params=rank_params,
        rank_weight_bytes=rank_weight_bytes,
        rank_kv_bytes_per_token=rank_kv_per_token,
        rank_kv_bytes=rank_kv_bytes,
    )


def _weight_bytes(
    config: ModelConfig, params: int, weight_elem: int, quantization: str | None
) -> int:
    """Bytes of ``params`` weights of ``config`` (a whole model or one rank's shapes)."""
    out = params * weight_elem
    if quantization == "int8":
        # One rank's projections are its local config's (row-parallel o/down keep all
        # their output rows, so their scales are on every rank).
        proj, rows = config.projection_params()
        out += proj * (1 - weight_elem) + rows * INT8_SCALE_BYTES
    return out


def _weights_label(dtype: str, quantization: str | None) -> str:
    return dtype if quantization is None else f"{dtype}, {quantization} projections"


def num_kv_blocks(
    config: ModelConfig,
    kv_cache_memory_bytes: int,
    block_size: int,
    kv_bytes_per_element: int,
) -> int:
    """KV blocks that fit in a byte budget: floor(budget / (kv_bytes_per_token × block_size))."""
    if kv_cache_memory_bytes < 0:
        raise ValueError(f"kv_cache_memory_bytes must be >= 0 (got {kv_cache_memory_bytes})")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if kv_bytes_per_element < 1:
        raise ValueError(f"kv_bytes_per_element must be >= 1 (got {kv_bytes_per_element})")
    block_bytes = config.kv_bytes_per_token(kv_bytes_per_element) * block_size
    if block_bytes <= 0:
        raise ValueError(f"config gives {block_bytes} KV bytes per block; expected > 0")
    return int(kv_cache_memory_bytes) // block_bytes


# ---- command line -------------------------------------------------------------------


def add_calc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        metavar="PATH",
        help="a config.json file, or a checkpoint directory containing one",
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="weight dtype (default: bf16)",
    )
    parser.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: the attention and MLP projections' weights as int8 (kvserve serve "
        "--quantization int8)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2"),
        default=None,
        help="KV cache dtype (default: same as --dtype); fp8, fp8_e4m3, fp8_e5m2: 1 byte "
        "per element (kvserve serve --kv-cache-dtype)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="request lengths in tokens (prompt + output), one per request",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default: {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        metavar="B",
        help="memory bandwidth in GB/s, for the memory-bound decode time per step",
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        metavar="M",
        help="accelerator memory in GiB (one rank's with --tensor-parallel-size), for how "
        "many KV tokens fit beside the weights",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N ranks (kvserve serve --tensor-parallel-size): "
        "prints one rank's weights and KV (default: 1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _error(message: str) -> int:
    print(f"kvserve calc: error: {message}", file=sys.stderr)
    return 2


def run_calc(args: argparse.Namespace) -> int:
    try:
        config = ModelConfig.from_file(args.config)
    except (OSError, ValueError) as e:  # includes UnsupportedModelError, bad JSON
        return _error(str(e))
    except (TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        return _error(f"malformed config {args.config}: {type(e).__name__}: {e}")

    dtype: str = args.dtype
    kv_dtype: str = args.kv_dtype or dtype
    tokens: list[int] = list(args.tokens or [])
    try:
        report = estimate(
            config,
            dtype=dtype,
            kv_dtype=kv_dtype,
            tokens=tokens,
            block_size=args.block_size,
            bandwidth_gbps=args.bandwidth_gbps,
            memory_gib=args.memory_gib,
            quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except ValueError as e:
        return _error(str(e))

    if args.json:
        print(json.dumps(report.to_json_dict()))
    else:
        print(
            _table(
                config,
                report,
                dtype=_weights_label(dtype, args.quantization),
                kv_dtype=kv_dtype,
                tokens=tokens,
                block_size=args.block_size,
                bandwidth_gbps=args.bandwidth_gbps,
                memory_gib=args.memory_gib,
            )
        )
    return 0


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


def _count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _table(
    config: ModelConfig,
    report: CapacityReport,
    *,
    dtype: str,
    kv_dtype: str,
    tokens: list[int],
    block_size: int,
    bandwidth_gbps: float | None,
    memory_gib: float | None,
) -> str:
    rows: list[tuple[str, str]] = [
        (
            "model",
            f"{config.architecture}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_heads} heads, {config.num_kv_heads} KV heads, "
            f"head_dim {config.head_dim}",
        ),
        ("params", f"{_count(report.params)} params ({report.params:,})"),
        (
            f"weights ({dtype})",
            f"{_bytes(report.weight_bytes)} ({report.weight_bytes:,} bytes)",
        ),
        (
            f"KV per token ({kv_dtype})",
            f"{_bytes(report.kv_bytes_per_token)} ({report.kv_bytes_per_token:,} bytes)",
        ),
    ]
    tp = report.tensor_parallel_size
    if tp > 1:
        rows += [
            ("tensor parallel", f"{tp} ranks; the figures below are one rank's"),
            (
                "rank weights",
                f"{_bytes(report.rank_weight_bytes)} ({report.rank_weight_bytes:,} bytes, "
                f"{_count(report.rank_params)} params)",
            ),
            (
                "rank KV per token",
                f"{_bytes(report.rank_kv_bytes_per_token)} "
                f"({report.rank_kv_bytes_per_token:,} bytes)",
            ),
        ]
    if tokens:
        total = sum(tokens)
        rows += [
            ("requests", f"{len(tokens)} ({total:,} tokens)"),
            ("KV for requests", f"{_bytes(report.kv_bytes)} ({report.kv_bytes:,} bytes)"),
            *([("rank KV for requests", f"{_bytes(report.rank_kv_bytes)}")] if tp > 1 else []),
            ("blocks", f"{report.blocks:,} (block size {block_size})"),
            ("slots", f"{report.slots:,} ({report.slots - total:,} unused)"),
        ]
    else:
        rows.append(("requests", "none (pass --tokens N [N ...] for KV, blocks and slots)"))
    if report.decode_lower_bound_ms is not None and bandwidth_gbps is not None:
        read = "weights + KV of the batch" if tokens else "weights"
        rows.append(
            (
                "decode lower bound",
                f"{report.decode_lower_bound_ms:.2f} ms/step at {bandwidth_gbps:g} GB/s "
                f"(reads {read} once{', per rank, without the all-reduces' if tp > 1 else ''})",
            )
        )
    if report.max_kv_tokens is not None and memory_gib is not None:
        free = memory_gib * GIB - report.rank_weight_bytes
        per = " per rank" if tp > 1 else ""
        rows.append(
            (
                "max KV tokens",
                f"{report.max_kv_tokens:,} ({_bytes(free)} free of {memory_gib:g} GiB{per} "
                "after weights)",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
