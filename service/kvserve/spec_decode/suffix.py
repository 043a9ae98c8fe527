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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.config import SpeculativeSettings
from kvserve.spec_decode.proposer import HistoryKey, NgramProposer, Proposer

HISTORY_TOKENS = 65_536  # learned output tokens kept, over all keys
LEARNED_PER_OUTPUT = 512  # of each output, the first tokens are learned


@dataclass
class _History:
    """Follower counts of one key's n-grams: ``followers[ngram][token] = count``."""

    followers: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], min_n: int, max_n: int, sign: int) -> None:
        for end in range(min_n, len(tokens)):
            nxt = tokens[end]
            for n in range(min_n, min(max_n, end) + 1):
                gram = tuple(tokens[end - n : end])
                counts = self.followers.setdefault(gram, {})
                left = counts.get(nxt, 0) + sign
                if left > 0:
                    counts[nxt] = left
                else:
                    counts.pop(nxt, None)
                    if not counts:
                        del self.followers[gram]


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
        self._learned: OrderedDict[int, tuple[HistoryKey, list[int]]] = OrderedDict()
        self._next_id = 0
        self.num_learned_tokens = 0

    def propose(
        self, tokens: Sequence[int], limit: int | None = None, key: HistoryKey = (None, None)
    ) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``tokens`` (maybe none)."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0:
            return []
        history = self._histories.get(key)
        drafts = [] if history is None else self._follow(history, list(tokens), k)
        return drafts or self.lookup.propose(tokens, k)

    def learn(self, context: Sequence[int], output: Sequence[int], key: HistoryKey) -> None:
        """Remember ``output`` (what followed ``context``: its last tokens start the first
        n-grams) under ``key``."""
        if not output:
            return
        tokens = [*context[-self.max_n :], *output[:LEARNED_PER_OUTPUT]]
        self._histories.setdefault(key, _History()).add(tokens, self.min_n, self.max_n, +1)
        self._learned[self._next_id] = (key, tokens)
        self._next_id += 1
        self.num_learned_tokens += len(tokens)
        while self.num_learned_tokens > self.history_tokens:
            _, (old_key, old) = self._learned.popitem(last=False)
            history = self._histories[old_key]
            history.add(old, self.min_n, self.max_n, -1)
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
