"""The n-gram (prompt lookup) proposer: drafts copied from the request's own tokens.

A request's last ``n`` tokens (``prompt_lookup_max`` ≥ n ≥ ``prompt_lookup_min``, longest
first) are looked up earlier in its prompt and output; where they occurred, the tokens
that followed are proposed as the next ones. Answers that restate their request, code
edits and extraction tasks repeat spans of the context, and then whole spans are
accepted in one verification step.

The search is one vectorised pass over the context: candidates are the earlier positions
of the last token, and each is extended backwards up to ``prompt_lookup_max`` tokens, so
a step costs O(context) per request (tens of microseconds for thousands of tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvserve.config import SpeculativeSettings

if TYPE_CHECKING:
    from kvserve.engine.request import Request


class Proposer(Protocol):
    """What the scheduler asks of a draft proposer."""

    def draft(self, req: Request, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens to follow ``req``'s tokens (maybe none)."""

    def finished(self, req: Request) -> None:
        """``req`` is done (what it generated may inform later drafts)."""


class NgramProposer:
    def __init__(self, settings: SpeculativeSettings) -> None:
        self.k = settings.num_speculative_tokens
        self.min_n = settings.prompt_lookup_min
        self.max_n = settings.prompt_lookup_max

    def draft(self, req: Request, limit: int) -> list[int]:
        return self.propose(req.all_token_ids, limit)

    def finished(self, req: Request) -> None:
        """Nothing: prompt lookup drafts from the request alone."""

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``tokens`` (maybe none)."""
        k = self.k if limit is None else min(self.k, limit)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        ctx = np.asarray(tokens, dtype=np.int64)
        # Candidate ends: earlier positions holding the last token, with a follower.
        ends = np.flatnonzero(ctx[: length - 1] == ctx[-1])
        if ends.size == 0:
            return []
        # Extend each candidate backwards while it still matches the suffix.
        matched = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.max_n, length - 1)):
            pos = ends - j
            ok = alive & (pos >= 0)
            ok[ok] = ctx[pos[ok]] == ctx[length - 1 - j]
            alive = ok
            if not alive.any():
                break
            matched += alive
        best = int(matched.max())
        if best < self.min_n:
            return []
        # The most recent of the longest matches: nearer context predicts better.
        end = int(ends[np.flatnonzero(matched == best)[-1]])
        return ctx[end + 1 : end + 1 + k].tolist()  # type: ignore[no-any-return]
