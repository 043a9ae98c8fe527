"""The one definition of each latency figure (DESIGN.md §3). Everything uses these.

Times are seconds on one clock. ``s`` = request received, ``f`` = first visible output
token, ``e`` = last visible output token, ``O`` = visible output tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def ttft(s: float, f: float) -> float:
    """Time to first token: f − s (includes queueing and prefill)."""
    return f - s


def e2e(s: float, e: float) -> float:
    """End-to-end latency up to the last token: e − s."""
    return e - s


def tpot(f: float, e: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first: (e − f) / (O − 1); None unless O > 1."""
    if num_output_tokens <= 1:
        return None
    return (e - f) / (num_output_tokens - 1)


def itls(token_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: every gap between consecutive streamed outputs."""
    return [b - a for a, b in itertools.pairwise(token_times)]


def decode_rate(f: float, e: float, num_output_tokens: int) -> float | None:
    """Decode-only output rate, tokens/s: (O − 1) / (e − f)."""
    if num_output_tokens <= 1 or e <= f:
        return None
    return (num_output_tokens - 1) / (e - f)


def whole_request_rate(s: float, e: float, num_output_tokens: int) -> float | None:
    """Whole-request output rate, tokens/s: O / (e − s)."""
    if e <= s:
        return None
    return num_output_tokens / (e - s)


def queue_time(queued: float, first_scheduled: float) -> float:
    """Time waiting for the scheduler: first scheduled − queued."""
    return first_scheduled - queued


def prefill_time(first_scheduled: float, f: float) -> float:
    """Prefill phase: first token − first scheduled (includes chunking and preemption)."""
    return f - first_scheduled


def decode_time(f: float, e: float) -> float:
    """Decode phase: last token − first token."""
    return e - f
