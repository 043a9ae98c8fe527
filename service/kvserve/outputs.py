"""What the engine returns for each request, step by step and at the end."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar, overload

from kvserve.lora.request import LoRARequest

FinishReason = Literal["stop", "length", "abort"]
T = TypeVar("T")


class Prefix(Sequence[T]):
    """The first ``n`` items of a list that only ever grows at its end, as a read-only
    sequence. Taking one costs O(1), where copying a request's output tokens into every
    step's output would cost O(n²) over an output of n tokens (docs/engine.md, "The
    step"). It stays valid while the list grows: its items never change."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T], n: int | None = None) -> None:
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1:
                return self._items[start:stop]
            return [self._items[i] for i in range(start, stop, step)]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._n)

    def __add__(self, other: Sequence[T]) -> list[T]:
        return [*self, *other]

    def __radd__(self, other: Sequence[T]) -> list[T]:  # list + Prefix, as with two lists
        return [*other, *self]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Prefix, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(list(self))


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
    token_ids: Sequence[int]  # every output token so far (a ``Prefix`` from the engine)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: Sequence[TokenLogprob] | None = None  # one per output token so far
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
    # With SamplingParams.prompt_logprobs: one per prompt token (None for the first), the
    # prompt's own tokens scored; complete from the request's first output token on.
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None
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
