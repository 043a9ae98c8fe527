"""int8 weight-only quantization of the decoder's projections (``--quantization int8``).

A decode step streams every weight from memory once, so its time is roughly the weights'
bytes over the memory bandwidth; int8 weights are a quarter of fp32's bytes and half of
bf16's. Only the weights are quantized: activations, the KV cache, norms, embeddings and
the LM head keep the model's dtype.

**Format.** Per output channel (row of the ``[out, in]`` weight), symmetric: ``scale =
max|row| / 127``, ``q = round(w / scale)`` clamped to [-127, 127] (no zero point, -128
unused so the range is symmetric). The scale is rounded to bfloat16 *before* ``q`` is
computed, because the kernel takes bf16 scales: the dequantized weight ``q · scale`` is
then exactly what the kernel multiplies by (the other paths round it to their matmul's
dtype, exact in fp32), and each weight is off by at most half a step. Rows are
independent, so quantizing a fused projection (q/k/v, gate/up) row by row is the same as
quantizing its checkpoint parts separately.

**Kernels.** ``int8pack``: PyTorch's own weight-only int8 matmul,
``torch.ops.aten._weight_int8pack_mm(x, q, scales)`` (x ``[M, K]``, q ``[N, K]`` int8,
contiguous, scales ``[N]`` of x's dtype). In this torch (2.15) its CPU kernel is
vectorized for bf16 activations only; with fp32 activations it runs scalar code,
measured 3× slower than the fp32 matmul at batch 1 and ~40× at batch 16 on the
2-core dev machine. So this path always feeds it bf16 activations (the model's fp32
input is rounded to bf16, and its output converted back): that rounding, ~0.2% per
value (rms), is small next to the int8 weights' own error (~0.8% rms on Gaussian rows).
That kernel works on blocks of 4 activation rows and re-reads and re-converts the
weights for each block, so its cost grows with the rows far faster than a dense
matmul's: from ``WIDE_ROWS`` rows on (prefill chunks, large batches) the weights are instead
dequantized to bf16 for the call and multiplied by the dense matmul (oneDNN on CPU), in
fp32 where the CPU has no native bf16. One thread, CPU time, the 158M bench model's four
projections: int8pack 5.8 ms vs 7.4 ms dequantized at 16 rows, 10.9 vs 9.1 at 32, 173
vs 68 at 512 (2-core dev machine, 2026-12-01). The CPU kernel also reads the input
dimension in steps of 16 with aligned loads and no tail (at 40 inputs it returned garbage
here), so a projection whose input size is not a multiple of ``PACK_ALIGN`` always takes
the dense path, and activations not 64-byte aligned are copied first.
``dequant``: the fallback where that op is missing or fails its probe (e.g. a CUDA build
without it): ``F.linear`` with ``q · scale`` made in the activations' dtype at each call;
in fp32 it is exact with respect to the dequantized weights; it saves memory, not time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.config import cpu_has_native_bf16

QMAX = 127  # symmetric: -127..127
WIDE_ROWS = 32  # rows from which int8pack dequantizes and uses the dense matmul (above)
PACK_ALIGN = 32  # input sizes the int8pack kernel is given (a multiple of its 16-wide steps)
SCALE_DTYPE = torch.bfloat16  # the int8pack kernel's scale (and activation) dtype
KERNELS = ("auto", "int8pack", "dequant")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of a ``[out, in]`` weight: (q int8 ``[out, in]``
    contiguous, scales bf16 ``[out]``), computed in float32."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / QMAX).to(SCALE_DTYPE)
    # An all-zero row keeps scale 0 and q 0; dividing by 1 avoids 0/0 there.
    s = scale.to(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8).contiguous()
    return q, scale


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q · scale`` per row, in ``dtype`` (exact in float32: an int8 times a bf16 fits)."""
    return q.to(dtype) * scales.to(dtype)[:, None]


def _int8pack_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)  # type: ignore[no-any-return]


@functools.cache
def int8pack_supported(device_type: str) -> bool:
    """True when ``_weight_int8pack_mm`` exists on this device type and agrees with the
    dequantized matmul on a probe (the op is private API: absent or wrong means the
    fallback)."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen)
        x = torch.randn(3, 64, generator=gen).to(SCALE_DTYPE)
        q, s = quantize_rows(w)
        got = _int8pack_mm(x.to(device_type), q.to(device_type), s.to(device_type)).float().cpu()
        want = F.linear(x.float(), dequantize(q, s, torch.float32))
        return bool(torch.allclose(got, want, atol=5e-2, rtol=2e-2))
    except Exception:  # any failure means: use the portable path
        return False


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``auto`` → ``int8pack`` where it works on ``device``, else ``dequant``."""
    if kernel not in KERNELS:
        raise ValueError(f"int8 kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "auto":
        return "int8pack" if int8pack_supported(device.type) else "dequant"
    return kernel


@dataclass
class Int8Weight:
    """One projection's int8 weight and per-row scales, and its matmul."""

    q: torch.Tensor  # int8 [out, in], contiguous (the kernel's layout)
    scales: torch.Tensor  # bf16 [out]
    kernel: str  # "int8pack" or "dequant"
    wide_dtype: torch.dtype = SCALE_DTYPE  # int8pack's dense matmul...
    wide_rows: int = WIDE_ROWS  # ...from this many rows on

    @classmethod
    def from_weight(cls, weight: torch.Tensor, kernel: str) -> Int8Weight:
        q, scales = quantize_rows(weight)
        native_bf16 = weight.device.type == "cuda" or cpu_has_native_bf16()
        wide = SCALE_DTYPE if native_bf16 else torch.float32
        rows = WIDE_ROWS if q.shape[1] % PACK_ALIGN == 0 else 0  # 0: always dense
        return cls(q, scales, resolve_kernel(kernel, weight.device), wide, rows)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scales, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "dequant":
            return F.linear(x, self.dequantize(x.dtype), bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= self.wide_rows:
            w = self.dequantize(self.wide_dtype)
            y = F.linear(x2.to(self.wide_dtype), w).to(x.dtype)
        else:  # 2-D contiguous aligned bf16 activations in, the model's dtype back out
            xb = x2.to(SCALE_DTYPE).contiguous()
            if xb.data_ptr() % 64:
                xb = xb.clone()
            y = _int8pack_mm(xb, self.q, self.scales).to(x.dtype)
        y = y.view(*x.shape[:-1], self.q.shape[0])
        return y if bias is None else y.add_(bias)
