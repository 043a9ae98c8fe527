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
outputs contained a phrase, as with the prefix cache. Requests without a salt share one
history, and the memory bound below is one for all keys: one key's volume forgets the
others' outputs (a loss of speed only).

Memory is bounded by what the history stores, over all keys, oldest output forgotten
first: a learned token starts at most one n-gram of each length, so it costs at most
the sum of those lengths in stored n-gram tokens, and the history keeps at most
``HISTORY_NGRAM_TOKENS`` of them (and at most ``HISTORY_TOKENS`` learned tokens, which the
default lengths 1-5 reach at the same time). Longer n-grams keep fewer outputs, and no
lengths keep more n-grams or stored tokens than the defaults. Each output teaches at most
``LEARNED_PER_OUTPUT`` tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.config import (
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    SpeculativeSettings,
)
from kvserve.lora.request import LoRARequest
from kvserve.spec_decode.proposer import NgramProposer, Proposer

if TYPE_CHECKING:
    from kvserve.engine.request import Request

HISTORY_TOKENS = 65_536  # learned tokens kept at most, over all keys
LEARNED_PER_OUTPUT = 512  # of each output, the first tokens are learned
HistoryKey = tuple[str | None, LoRARequest | None]  # (cache salt, adapter)


def ngram_tokens_per_token(min_n: int, max_n: int) -> int:
    """The most one learned token costs the history in stored n-gram tokens: it starts at
    most one n-gram of each length ``min_n`` ≤ n ≤ ``max_n``, of n tokens each."""
    return sum(range(min_n, max_n + 1))


# The history's budget of stored n-gram tokens: HISTORY_TOKENS learned tokens at the
# default lengths, so the defaults keep what they always kept.
HISTORY_NGRAM_TOKENS = HISTORY_TOKENS * ngram_tokens_per_token(
    DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
)


def history_key(req: Request) -> HistoryKey:
    """Whose earlier outputs may draft for ``req``: its tenant's (the cache salt) under
    its adapter."""
    return (req.cache_salt, req.lora)


# Up to this many followers, finding the most frequent costs about what keeping it would.
SEARCHED_FOLLOWERS = 8
Ngram = tuple[int, ...]


@dataclass
class NgramHistory:
    """Who followed each of one key's n-grams: ``followers[ngram][token] = count``, the
    tokens in the order first seen (the first seen wins a tie)."""

    followers: dict[Ngram, dict[int, int]] = field(default_factory=dict)
    # For n-grams with more than SEARCHED_FOLLOWERS followers that a draft asked about:
    # [the most frequent, the total], kept as the counts change, because a draft asks at
    # every drafted token and a common n-gram has thousands of followers. Dropped when a
    # change leaves the most frequent unknown (found again by the next draft that asks).
    summaries: dict[Ngram, list[int]] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], min_n: int, max_n: int) -> None:
        summaries = self.summaries
        for gram, nxt in _grams(tokens, min_n, max_n):
            counts = self.followers.setdefault(gram, {})
            count = counts[nxt] = counts.get(nxt, 0) + 1
            summary = summaries.get(gram)
            if summary is None:
                continue
            summary[1] += 1
            best = summary[0]
            if nxt != best and count > counts[best]:
                summary[0] = nxt
            elif nxt != best and count == counts[best] and count > 1:
                # A tie with a follower seen before (a new one, count 1, is the last seen):
                # which came first, only a search of the dict can say.
                del summaries[gram]

    def remove(self, tokens: Sequence[int], min_n: int, max_n: int) -> None:
        """Undo ``add(tokens, ...)``."""
        summaries = self.summaries
        for gram, nxt in _grams(tokens, min_n, max_n):
            counts = self.followers[gram]
            if counts[nxt] > 1:
                counts[nxt] -= 1
            elif len(counts) > 1:
                del counts[nxt]
            else:
                del self.followers[gram]
            summary = summaries.get(gram)
            if summary is None:
                continue
            if nxt == summary[0]:  # another may have as many now (or the n-gram is gone)
                del summaries[gram]
            else:
                summary[1] -= 1

    def most_frequent(self, gram: Ngram) -> tuple[int, int, int] | None:
        """The most frequent follower of ``gram``, its count and the total (None: unseen)."""
        counts = self.followers.get(gram)
        if counts is None:
            return None
        summary = self.summaries.get(gram)
        if summary is None:
            token = max(counts.items(), key=lambda item: item[1])[0]
            total = sum(counts.values())
            if len(counts) > SEARCHED_FOLLOWERS:
                self.summaries[gram] = [token, total]
        else:
            token, total = summary
        return token, counts[token], total


def _grams(tokens: Sequence[int], min_n: int, max_n: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every (n-gram, the token after it) of ``tokens``, min_n ≤ n ≤ max_n (the tuples are
    built by zip, in C: learning runs on the engine thread)."""
    for n in range(min_n, min(max_n, len(tokens) - 1) + 1):  # each with a token after it
        grams = zip(*(tokens[i : len(tokens) - n + i] for i in range(n)), strict=True)
        yield from zip(grams, tokens[n:], strict=True)


class SuffixProposer:
    def __init__(self, settings: SpeculativeSettings, history_tokens: int = HISTORY_TOKENS) -> None:
        self.k = settings.num_speculative_tokens
        self.min_n = settings.prompt_lookup_min
        self.max_n = settings.prompt_lookup_max
        # Learned tokens kept: history_tokens, fewer where the n-grams are longer.
        per_token = ngram_tokens_per_token(self.min_n, self.max_n)
        self.history_tokens = min(history_tokens, HISTORY_NGRAM_TOKENS // per_token)
        self.min_token_prob = settings.suffix_decoding_min_token_prob
        self.lookup = NgramProposer(settings)
        self.histories: dict[HistoryKey, NgramHistory] = {}
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
        history = self.histories.get(key)
        # Only the last max_n tokens can match: never copy the whole context.
        drafts = [] if history is None else self._follow(history, list(tokens[-self.max_n :]), k)
        return drafts or self.lookup.propose(tokens, k)

    def learn(self, context: Sequence[int], output: Sequence[int], key: HistoryKey) -> None:
        """Remember ``output`` (what followed ``context``: its last tokens start the first
        n-grams) under ``key``."""
        if not output:
            return
        tokens = [*context[-self.max_n :], *output[:LEARNED_PER_OUTPUT]]
        self.histories.setdefault(key, NgramHistory()).add(tokens, self.min_n, self.max_n)
        self._learned.append((key, tokens))
        self.num_learned_tokens += len(tokens)
        while self.num_learned_tokens > self.history_tokens:
            old_key, old = self._learned.popleft()
            history = self.histories[old_key]
            history.remove(old, self.min_n, self.max_n)
            if not history.followers:
                del self.histories[old_key]
            self.num_learned_tokens -= len(old)

    def _follow(self, history: NgramHistory, ctx: list[int], k: int) -> list[int]:
        drafts: list[int] = []
        while len(drafts) < k:
            nxt = None
            for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
                found = history.most_frequent(tuple(ctx[-n:]))
                if found is None:
                    continue
                token, count, total = found
                if count >= self.min_token_prob * total:
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
