"""Prompt logprobs (vLLM's ``prompt_logprobs``; what ``echo`` with ``logprobs`` returns):
for each prompt position after the first, the log-probability the model gave that token
from the tokens before it, and the top alternatives there (docs/engine.md, "Prompt
logprobs").

They come from the same forward pass as the prompt's prefill, chunk by chunk: the logits
of every prompt position in a scheduled chunk, not only of the last. The vocabulary-wide
rows are made ``ROWS_PER_PART`` at a time, so a long chunk of a large-vocabulary model does
not hold all of its logits at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.request import Request
from kvserve.outputs import TokenLogprob

ROWS_PER_PART = 256


@dataclass
class PromptScores:
    """A chunk's positions whose next token is a prompt token: ``count`` of them from
    position ``start``."""

    request: Request
    start: int
    count: int


def scored_positions(req: Request, start: int, n: int) -> int:
    """How many of the chunk ``[start, start + n)`` of ``req`` are scored: the positions
    whose next token is a prompt token (0 unless it asked for prompt logprobs)."""
    if req.prompt_logprobs is None:
        return 0
    return max(0, min(start + n, req.num_prompt_tokens - 1) - start)


def parts(rows: torch.Tensor) -> list[torch.Tensor]:
    """``rows`` in parts of at most ROWS_PER_PART (the logits made at a time)."""
    return list(rows.split(ROWS_PER_PART))


def record(logits: torch.Tensor, scores: Sequence[PromptScores]) -> None:
    """Score ``scores`` from ``logits`` (their rows, in order) into each request's
    ``prompt_logprobs``: position p's entry is that of prompt token p + 1."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    offset = 0
    for s in scores:
        req, rows = s.request, logprobs[offset : offset + s.count]
        offset += s.count
        targets = req.prompt_token_ids[s.start + 1 : s.start + 1 + s.count]
        chosen = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0]
        k = req.params.prompt_logprobs or 0
        top_vals, top_ids = rows.topk(max(k, 1), dim=-1)
        top_v, top_i = top_vals[:, :k].tolist(), top_ids[:, :k].tolist()
        assert req.prompt_logprobs is not None
        for i, (token, value) in enumerate(zip(targets, chosen.tolist(), strict=True)):
            top = dict(zip(top_i[i], top_v[i], strict=True))
            req.prompt_logprobs[s.start + 1 + i] = TokenLogprob(token, value, top)
