"""Counters of speculative decoding, with vLLM's meanings (``vllm:spec_decode_*``).

A *draft* is one request's run of draft tokens verified in one step; its *draft tokens*
are the tokens of that run; *accepted* tokens are the drafts the verifier kept (the token
sampled after them is not counted). ``accepted_per_pos[i]`` counts drafts whose token at
position ``i`` (0-based) was accepted, so ``accepted_per_pos[i] / num_drafts`` is the
acceptance rate at that depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` tokens, ``num_accepted`` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos.extend([0] * (num_accepted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token (0 with no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )
