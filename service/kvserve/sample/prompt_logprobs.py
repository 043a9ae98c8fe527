"""Prompt logprobs (vLLM's ``prompt_logprobs``; what ``echo`` with ``logprobs`` returns):
for each prompt position after the first, the log-probability the model gave that token
from the tokens before it, and the top alternatives there (docs/engine.md, "Prompt
logprobs").

They come from the same forward pass as the prompt's prefill, chunk by chunk: the logits
of every prompt position in a scheduled chunk, not only of the last. The vocabulary-wide
rows are made ``ROWS_PER_PART`` at a time and each part is reduced to its scores before
the next is made, so a long chunk of a large-vocabulary model never holds all of its
logits at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


def scored(req: Request, start: int, n: int) -> int:
    """How many of the chunk ``[start, start + n)`` of ``req`` (which asked for prompt
    logprobs) are scored: the positions whose next token is a prompt token."""
    return max(0, min(start + n, req.num_prompt_tokens - 1) - start)


def parts(rows: torch.Tensor) -> list[torch.Tensor]:
    """``rows`` in parts of at most ROWS_PER_PART (the logits made at a time)."""
    return list(rows.split(ROWS_PER_PART))


def record(logits_parts: Iterable[torch.Tensor], scores: Sequence[PromptScores]) -> None:
    """Score ``scores`` into each request's ``prompt_logprobs`` from the logits of their
    rows, in order, part by part: position p's entry is that of prompt token p + 1."""
    targets = [
        t for s in scores for t in s.request.prompt_token_ids[s.start + 1 : s.start + 1 + s.count]
    ]
    k = max(s.request.params.prompt_logprobs or 0 for s in scores)
    chosen: list[float] = []
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    for logits in logits_parts:  # each part reduced before the next is made
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        rows = torch.tensor(targets[len(chosen) : len(chosen) + len(logprobs)])
        chosen += logprobs.gather(1, rows.to(logprobs.device)[:, None])[:, 0].tolist()
        values, ids = logprobs.topk(max(k, 1), dim=-1)
        top_vals += values[:, :k].tolist()
        top_ids += ids[:, :k].tolist()
    i = 0
    for s in scores:
        req, n = s.request, s.request.params.prompt_logprobs or 0
        assert req.prompt_logprobs is not None
        for p in range(s.start + 1, s.start + 1 + s.count):
            top = dict(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
            req.prompt_logprobs[p] = TokenLogprob(targets[i], chosen[i], top)
            i += 1
