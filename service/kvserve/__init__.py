"""kvserve: a paged-KV-cache LLM inference engine with an OpenAI API, gateway and operator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.llm import LLM
    from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

# Imported on first use: tools that only need the pure parts (the operator, `kvserve
# calc`, `kvserve model pull`) must not pay for importing torch, or need it installed.
_LAZY = {
    "LLM": "kvserve.llm",
    "CompletionOutput": "kvserve.outputs",
    "RequestMetrics": "kvserve.outputs",
    "RequestOutput": "kvserve.outputs",
    "SamplingParams": "kvserve.sampling_params",
    "StructuredOutputsParams": "kvserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
