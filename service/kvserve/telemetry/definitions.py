"""The one definition of each latency figure (docs/architecture.md §3). Everything uses these.

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


def itls(output_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: every gap between consecutive streamed outputs (a client's
    chunk times; the engine's token times through ``output_times``)."""
    return [b - a for a, b in itertools.pairwise(output_times)]


def output_times(token_times: Sequence[float]) -> list[float]:
    """The instants a request's outputs were streamed, from its tokens' times: the tokens
    of one step (a step's accepted drafts, with speculative decoding) share its instant
    and leave in one output, so no client waits between them."""
    return [t for i, t in enumerate(token_times) if i == 0 or t != token_times[i - 1]]


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


# ---- a set of requests over a window (docs/architecture.md §3: goodput, throughput, errors)
def request_throughput(num_succeeded: int, window_seconds: float) -> float:
    """Request throughput, requests/s: successful requests / window seconds."""
    return num_succeeded / _window(window_seconds)


def goodput(num_good: int, window_seconds: float) -> float:
    """Goodput, requests/s: requests that succeeded AND met every SLO / window seconds."""
    return num_good / _window(window_seconds)


def error_rate(num_failed: int, num_attempted: int) -> float | None:
    """Failed / attempted; None when nothing was attempted."""
    if num_attempted <= 0:
        return None
    return num_failed / num_attempted


def slo_attainment(num_good: int, num_judged: int) -> float | None:
    """Share of the judged requests that succeeded and met every SLO; None if none judged.

    ``num_judged`` counts failed requests too (a failure never meets an SLO); which requests
    are judged at all (e.g. client-cancelled ones are not) is the caller's stated rule.
    """
    if num_judged <= 0:
        return None
    return num_good / num_judged


def meets_slo(
    ttft_s: float | None,
    tpot_s: float | None,
    *,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> bool:
    """Whether one successful request met every SLO given (None = no such SLO).

    A missing TTFT (no visible output at all) fails a TTFT SLO: the user saw nothing. A
    missing TPOT (one output token, so no gaps) passes a TPOT SLO: there was nothing to wait
    for after the first token.
    """
    if ttft_slo_s is not None and (ttft_s is None or ttft_s > ttft_slo_s):
        return False
    return tpot_slo_s is None or tpot_s is None or tpot_s <= tpot_slo_s


def max_goodput_rate(
    steps: Sequence[tuple[float, float | None]], target_attainment: float
) -> float | None:
    """Max goodput rate (DistServe): the highest offered rate whose attainment ≥ target.

    ``steps`` are (offered requests/s, attainment) pairs; None when no step reaches it.
    """
    passing = [rate for rate, att in steps if att is not None and att >= target_attainment]
    return max(passing) if passing else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) by linear interpolation between closest ranks.

    The same method as numpy's default ("linear"): position (n − 1)·q/100 in the sorted
    values. None for no values, so an empty distribution is never reported as 0.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _window(window_seconds: float) -> float:
    if not window_seconds > 0:
        raise ValueError(f"a rate needs a window longer than 0 s, got {window_seconds}")
    return window_seconds
