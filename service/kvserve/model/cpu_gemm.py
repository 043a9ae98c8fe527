"""Prepacked oneDNN weights for CPU matmuls.

Decode steps multiply a handful of rows by every weight matrix, which is bound by how
fast the weights stream from memory. oneDNN's blocked ("prepacked") weight layout
streams markedly faster than the plain row-major layout that ``F.linear`` reads (on the
2-core dev machine, ~1.5× for 16 rows). This is the op PyTorch's own compiler uses for
frozen CPU linears; it is private API, so it is probed once and skipped when absent or
wrong.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_PACK_HINT_ROWS = 16  # a layout hint only: any number of rows works


def _ops() -> tuple[object, object] | None:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def prepacking_supported(dtype: torch.dtype) -> bool:
    """True when packed linears exist here and agree with ``F.linear`` on a probe."""
    if dtype != torch.float32 or _ops() is None:
        return False  # bf16/fp16 oneDNN kernels need CPU features this path doesn't check
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen)
        b = torch.randn(24, generator=gen)
        x = torch.randn(3, 40, generator=gen)
        got = linear(x, pack_weight(w), b)
        return torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    except Exception:  # any failure means: use the portable path
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT_ROWS)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]
