"""Engine arguments, validated up front with errors that name the argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The dtype names the engine accepts. torch is imported only where a dtype is made, so
# argument parsers and the gateway (which shares modules that import this one) can use
# the names without loading torch.
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


_SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for one of ``DTYPES``."""
    import torch

    if name not in DTYPES:
        raise KeyError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    dtype: torch.dtype = getattr(torch, _SHORT_NAMES.get(name, name))
    return dtype


DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB, capped at what max_num_seqs full requests need


@dataclass
class EngineConfig:
    """Everything that shapes an engine; the defaults suit a laptop CPU.

    ``num_kv_blocks`` fixes the KV pool size directly; otherwise it is derived from
    ``kv_cache_memory`` bytes, or on CUDA from ``gpu_memory_utilization`` of the GPU's
    memory after the weights are loaded, or on CPU from 1 GiB (but no more blocks than
    ``max_num_seqs`` requests of ``max_model_len`` tokens need).
    """

    model: str
    tokenizer: str | None = None
    # auto: on CUDA the checkpoint's dtype (or bf16); on CPU bf16 where the CPU computes
    # bf16 natively (AVX512-BF16/AMX), else float32
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    # Reference mode for tests: drop every request's KV after each step, so each token
    # is computed from scratch over the whole sequence (slow; prefix caching is off).
    recompute_every_step: bool = False

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive("block_size", self.block_size)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_model_len", self.max_model_len)
        positive("num_kv_blocks", self.num_kv_blocks)
        positive("kv_cache_memory", self.kv_cache_memory)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not _cuda_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available here")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.recompute_every_step:
            self.enable_prefix_caching = False

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return torch_dtype(self.dtype)
        if self.torch_device().type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        if checkpoint_dtype in DTYPES:
            return torch_dtype(checkpoint_dtype)
        return torch.bfloat16


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN computes bf16 natively here (AVX512-BF16 or AMX). Without it a bf16
    matmul is emulated and several times slower than fp32 (`kvserve bench suite --only
    roofline` measured 21 vs 169 GFLOP/s on an AVX2-only CPU)."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe and probe())
