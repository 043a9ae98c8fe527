"""Suffix decoding: drafts from what earlier requests of the same tenant generated.

Services answer in their own recurring phrases: a support bot's greetings, an agent's
tool-call scaffolding, the demo model's "... a night - sure, I found 2 hotels:" lines.
Prompt lookup cannot draft those (they are not in the request), but the outputs of
earlier requests hold them. This proposer keeps counts of which token followed each
n-gram (``prompt_lookup_min`` ≤ n ≤ ``prompt_lookup_max``) in recent outputs, and drafts
by following, from the request's last tokens, the longest n-gram it has seen, token by
token, while the most frequent follower has at least ``min_token_prob`` of the counts.
When the history has nothing to say, it falls back to prompt lookup (``NgramProposer``).
vLLM calls this method "suffix" (after Arctic Inference's suffix decoding, which keeps a
suffix tree; n-gram counts bounded by ``prompt_lookup_max`` are the same idea, smaller).

Drafts only change speed: the verifier keeps greedy output token for token and sampled
output in distribution. But speed is observable, so a request is drafted only from the
history of its own **key**: its ``cache_salt`` and adapter. Through the gateway the salt
is the tenant's (docs/architecture.md §5), so no tenant can time whether another tenant's
outputs contained a phrase, as with the prefix cache.

Memory is bounded by ``HISTORY_TOKENS`` learned tokens over all keys, oldest output
forgotten first, and each output teaches at most ``LEARNED_PER_OUTPUT`` tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.config import SpeculativeSettings
from kvserve.lora.request import LoRARequest
from kvserve.spec_decode.proposer import NgramProposer, Proposer

if TYPE_CHECKING:
    from kvserve.engine.request import Request

HISTORY_TOKENS = 65_536  # learned output tokens kept, over all keys
LEARNED_PER_OUTPUT = 512  # of each output, the first tokens are learned
HistoryKey = tuple[str | None, LoRARequest | None]  # (cache salt, adapter)


def history_key(req: Request) -> HistoryKey:
    """Whose earlier outputs may draft for ``req``: its tenant's (the cache salt) under
    its adapter."""
    return (req.cache_salt, req.lora)


@dataclass
class _History:
    """Follower counts of one key's n-grams: ``followers[ngram][token] = count``."""

    followers: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], min_n: int, max_n: int) -> None:
        for gram, nxt in _grams(tokens, min_n, max_n):
            counts = self.followers.setdefault(gram, {})
            counts[nxt] = counts.get(nxt, 0) + 1

    def remove(self, tokens: Sequence[int], min_n: int, max_n: int) -> None:
        """Undo ``add(tokens, ...)``."""
        for gram, nxt in _grams(tokens, min_n, max_n):
            counts = self.followers[gram]
            if counts[nxt] > 1:
                counts[nxt] -= 1
            elif len(counts) > 1:
                del counts[nxt]
            else:
                del self.followers[gram]


def _grams(tokens: Sequence[int], min_n: int, max_n: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every (n-gram, the token after it) of ``tokens``, min_n ≤ n ≤ max_n (the tuples are
    built by zip, in C: learning runs on the engine thread)."""
    for n in range(min_n, min(max_n, len(tokens) - 1) + 1):  # each with a token after it
        grams = zip(*(tokens[i : len(tokens) - n + i] for i in range(n)), strict=True)
        yield from zip(grams, tokens[n:], strict=True)


class SuffixProposer:
    def __init__(self, settings: SpeculativeSettings, history_tokens: int = HISTORY_TOKENS) -> None:
        self.k = settings.num_speculative_tokens
        self.history_tokens = history_tokens
        self.min_n = settings.prompt_lookup_min
        self.max_n = settings.prompt_lookup_max
        self.min_token_prob = settings.suffix_decoding_min_token_prob
        self.lookup = NgramProposer(settings)
        self._histories: dict[HistoryKey, _History] = {}
        # Learned outputs, oldest first: (key, tokens), and their total length.
        self._learned: deque[tuple[HistoryKey, list[int]]] = deque()
        self.num_learned_tokens = 0

    def draft(self, req: Request, limit: int) -> list[int]:
        return self.propose(req.all_token_ids, limit, history_key(req))

    def finished(self, req: Request) -> None:
        self.learn(req.prompt_token_ids, req.output_token_ids, history_key(req))

    def propose(
        self, tokens: Sequence[int], limit: int | None = None, key: HistoryKey = (None, None)
    ) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``tokens`` (maybe none)."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0:
            return []
        history = self._histories.get(key)
        # Only the last max_n tokens can match: never copy the whole context.
        drafts = [] if history is None else self._follow(history, list(tokens[-self.max_n :]), k)
        return drafts or self.lookup.propose(tokens, k)

    def learn(self, context: Sequence[int], output: Sequence[int], key: HistoryKey) -> None:
        """Remember ``output`` (what followed ``context``: its last tokens start the first
        n-grams) under ``key``."""
        if not output:
            return
        tokens = [*context[-self.max_n :], *output[:LEARNED_PER_OUTPUT]]
        self._histories.setdefault(key, _History()).add(tokens, self.min_n, self.max_n)
        self._learned.append((key, tokens))
        self.num_learned_tokens += len(tokens)
        while self.num_learned_tokens > self.history_tokens:
            old_key, old = self._learned.popleft()
            history = self._histories[old_key]
            history.remove(old, self.min_n, self.max_n)
            if not history.followers:
                del self._histories[old_key]
            self.num_learned_tokens -= len(old)

    def _follow(self, history: _History, ctx: list[int], k: int) -> list[int]:
        drafts: list[int] = []
        while len(drafts) < k:
            nxt = None
            for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
                counts = history.followers.get(tuple(ctx[-n:]))
                if counts is None:
                    continue
                token, count = max(counts.items(), key=lambda item: item[1])
                if count >= self.min_token_prob * sum(counts.values()):
                    nxt = token
                break  # the longest seen n-gram decides
            if nxt is None:
                break
            drafts.append(nxt)
            ctx.append(nxt)
        return drafts


def make_proposer(settings: SpeculativeSettings) -> Proposer:
    """The proposer of ``settings.method``."""
    if settings.method == "suffix":
        return SuffixProposer(settings)
    return NgramProposer(settings)
