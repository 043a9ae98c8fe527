"""What the engine returns for each request, step by step and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvserve.lora.request import LoRARequest

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class RequestMetrics:
    """The request's timeline, in seconds of the engine's monotonic clock.

    ``token_times[i]`` is when output token ``i`` was produced. Latency figures (TTFT,
    TPOT, ITL, queue time) are derived from this timeline by ``kvserve.telemetry``.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the N most likely tokens → log-probability


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None
    # What this step added (for streaming):
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    external_id: str | None = None  # the client's id for the request (``Request.external_id``)
    lora_request: LoRARequest | None = None  # the adapter it ran under (None: the base model)

    @property
    def client_id(self) -> str:
        """The id to show the client and put in logs: theirs, else the engine's."""
        return self.external_id if self.external_id is not None else self.request_id

    def absorb(self, earlier: RequestOutput) -> RequestOutput:
        """This output (the later one) also carrying ``earlier``'s deltas, as if the two
        steps were one: the cumulative fields are already this output's.

        What a consumer that fell behind gets: one output, whatever the number of steps it
        missed, so its request holds O(output length) memory, not a copy of the output so
        far per step.
        """
        for mine, theirs in zip(self.outputs, earlier.outputs, strict=True):
            mine.delta_text = theirs.delta_text + mine.delta_text
            mine.delta_token_ids = theirs.delta_token_ids + mine.delta_token_ids
        return self
