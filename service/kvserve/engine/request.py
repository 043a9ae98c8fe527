"""One generation request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.lora.request import LoRARequest
from kvserve.outputs import FinishReason, RequestMetrics, TokenLogprob
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.detokenizer import IncrementalDetokenizer
    from kvserve.sample.sampler import LogitsState, SeededNoise
    from kvserve.structured.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token state of one request.

    The scheduler's one rule: give each request tokens until ``num_computed_tokens``
    catches up with ``num_tokens`` (prompt + generated so far) plus its draft tokens
    (``spec_token_ids``); when it has caught up, the step samples a new token (and, with
    drafts, first verifies them: see ``kvserve.engine.scheduler``).
    """

    request_id: str  # the engine's key: unique among its requests (see ``external_id``)
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None = None
    # The client's id (``x-request-id``): logged, traced and echoed, never a key. Clients
    # choose it, so two in-flight requests may share one (docs/architecture.md).
    external_id: str | None = None
    cache_salt: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    # Which of its prompt's n samples it is (SamplingParams.samples): its output's index.
    sample_index: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    # params.stop_token_ids as a set: each sampled token is looked up in it (up to 1,024).
    stop_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache, set when admitted
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order
    logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs: position p's entry scores prompt token p (None for the
    # first token, and for those its prefill has not reached yet).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    generator: SeededNoise | None = None  # the noise of a seeded request
    logits_state: LogitsState | None = None  # its biases' and penalties' (the sampler's)
    grammar: GrammarMatcher | None = None  # its structured-outputs constraint
    # Draft tokens scheduled for verification this step (speculative decoding); the
    # engine empties the list once the step has verified them.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def can_speculate(self) -> bool:
        """Whether drafts may be verified for it: not under a grammar or penalties, whose
        per-position state the verifier does not replay (docs/engine.md). A logit bias is
        the same at every position."""
        p = self.params
        penalised = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
        # Until min_tokens, each position's stop tokens are masked by its own count.
        return self.grammar is None and not penalised and self.num_output_tokens >= p.min_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
