"""kvserve: a paged-KV-cache LLM inference engine with an OpenAI API, gateway and operator."""

from kvserve.llm import LLM
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]
