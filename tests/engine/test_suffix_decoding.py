"""Suffix decoding: drafts from earlier outputs of the same tenant and adapter, exact
greedy output, bounded memory, and no drafting across tenants."""

from __future__ import annotations

import random

import pytest
import transformers

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, speculative_settings
from kvserve.lora.request import LoRARequest
from kvserve.spec_decode.proposer import NgramProposer
from kvserve.spec_decode.suffix import (
    HISTORY_NGRAM_TOKENS,
    HISTORY_TOKENS,
    NgramHistory,
    SuffixProposer,
    ngram_tokens_per_token,
)
from tests.support.checkpoints import make_prompts

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SALTED_A, SALTED_B = ("tenant-a", None), ("tenant-b", None)


def proposer(history_tokens: int = 10_000, **config: object) -> SuffixProposer:
    return SuffixProposer(speculative_settings(SUFFIX | config), history_tokens)


def test_an_output_is_drafted_again_after_the_same_context() -> None:
    p = proposer(prompt_lookup_max=3)
    p.learn([50, 51], [10, 11, 12, 13, 14, 15], SALTED_A)
    # A new request whose tokens end like the learned output's start.
    assert p.propose([90, 91, 51, 10], key=SALTED_A) == [11, 12, 13, 14]
    assert p.propose([90, 91, 51, 10], limit=2, key=SALTED_A) == [11, 12]
    assert p.propose([12, 13], key=SALTED_A) == [14, 15]  # ends where the output ended


def test_another_tenant_or_adapter_gets_no_drafts_from_that_history() -> None:
    p = proposer()
    p.learn([50], [10, 11, 12, 13, 14], SALTED_A)
    assert p.propose([7, 10], key=SALTED_A) == [11, 12, 13, 14]
    for other in (SALTED_B, (None, None), ("tenant-a", LoRARequest("adapter", "/path"))):
        assert p.propose([7, 10], key=other) == []  # nor prompt lookup: 10 is new


def test_without_history_it_falls_back_to_prompt_lookup() -> None:
    p = proposer()
    assert p.propose([1, 2, 3, 4, 1, 2], key=SALTED_A) == [3, 4, 1, 2]


def test_a_follower_below_the_least_share_is_not_drafted() -> None:
    p = proposer(suffix_decoding_min_token_prob=0.6)
    p.learn([], [5, 6, 7], SALTED_A)
    p.learn([], [5, 8, 9], SALTED_A)
    assert p.propose([3, 5], key=SALTED_A) == []  # 6 and 8 follow 5 half the time each
    p.learn([], [5, 6, 7], SALTED_A)
    assert p.propose([3, 5], key=SALTED_A) == [6, 7]  # now 2 of 3


def test_the_history_is_bounded_and_forgets_the_oldest_first() -> None:
    p = proposer(history_tokens=12, prompt_lookup_max=2)
    p.learn([], [1, 2, 3, 4, 5], SALTED_A)
    p.learn([], [6, 7, 8, 9], SALTED_B)
    assert p.num_learned_tokens == 9
    p.learn([], [20, 21, 22, 23], SALTED_B)  # 13 > 12: the first output is forgotten
    assert p.num_learned_tokens == 8
    assert p.propose([0, 1], key=SALTED_A) == []
    assert p.propose([0, 6], key=SALTED_B) == [7, 8, 9]
    assert p.propose([0, 20], key=SALTED_B) == [21, 22, 23]


def stored_ngram_tokens(p: SuffixProposer) -> int:
    """What the proposer's histories hold: each n-gram's tokens, once per time it was seen."""
    return sum(
        len(gram) * sum(counts.values())
        for history in p.histories.values()
        for gram, counts in history.followers.items()
    )


def random_outputs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32_000) for _ in range(length)] for _ in range(n)]


def test_the_history_is_bounded_by_the_ngram_tokens_it_stores() -> None:
    # prompt_lookup_max 24: each learned token stores n-grams of 1 + 2 + ... + 24 tokens.
    p = proposer(history_tokens=HISTORY_TOKENS, prompt_lookup_max=24)
    for i, output in enumerate(random_outputs(12, 600)):
        p.learn(output[:24], output[24:], (f"tenant-{i % 4}", None))
    assert p.num_learned_tokens * ngram_tokens_per_token(1, 24) <= HISTORY_NGRAM_TOKENS
    assert 0 < stored_ngram_tokens(p) <= HISTORY_NGRAM_TOKENS
    last = output[24 : 24 + 20]  # the newest output is still there to draft from
    assert p.propose(last[:10], key=("tenant-3", None)) == last[10:14]


def test_the_default_lengths_keep_history_tokens() -> None:
    p = proposer(history_tokens=HISTORY_TOKENS, prompt_lookup_max=5)
    for output in random_outputs(140, 512):
        p.learn([], output, SALTED_A)
    assert HISTORY_TOKENS - 512 < p.num_learned_tokens <= HISTORY_TOKENS
    assert stored_ngram_tokens(p) <= HISTORY_NGRAM_TOKENS


def most_frequent_by_search(counts: dict[int, int]) -> int:
    """The most frequent follower as drafts always chose it: the first seen of a tie."""
    return max(counts.items(), key=lambda item: item[1])[0]


def test_the_history_keeps_the_most_frequent_follower_a_search_finds() -> None:
    rng = random.Random(1)
    history = NgramHistory()
    held: list[list[int]] = []
    for _ in range(2_000):
        if held and rng.random() < 0.45:  # forget an output, the oldest ones more often
            history.remove(held.pop(rng.randrange(min(len(held), 3))), 1, 2)
        else:  # 12 tokens: 1-grams with more followers than are searched, and many ties
            held.append([rng.randrange(12) for _ in range(rng.randrange(2, 12))])
            history.add(held[-1], 1, 2)
        for _ in range(3):  # asked about some n-grams at each step, not all
            gram = (rng.randrange(12),)
            counts = history.followers.get(gram)
            expected = None
            if counts is not None:
                token = most_frequent_by_search(counts)
                expected = (token, counts[token], sum(counts.values()))
            assert history.most_frequent(gram) == expected
    assert history.summaries  # the wide n-grams were kept, not only searched
    while held:
        history.remove(held.pop(), 1, 2)
    assert history.followers == {} and history.summaries == {}


class DraftsBySearch:
    """Drafts as they were before the most frequent follower was kept: plain counts, in
    the order first seen (kept while seen in any output held), searched at each token."""

    def __init__(self, budget: int, min_n: int, max_n: int) -> None:
        self.budget, self.min_n, self.max_n = budget, min_n, max_n
        self.held: list[list[int]] = []
        self.followers: dict[tuple[int, ...], dict[int, int]] = {}

    def pairs(self, output: list[int]) -> list[tuple[tuple[int, ...], int]]:
        return [
            (tuple(output[i : i + n]), output[i + n])
            for n in range(self.min_n, self.max_n + 1)
            for i in range(len(output) - n)
        ]

    def learn(self, output: list[int]) -> None:
        for gram, token in self.pairs(output):
            counts = self.followers.setdefault(gram, {})
            counts[token] = counts.get(token, 0) + 1
        self.held.append(output)
        while sum(map(len, self.held)) > self.budget:  # the oldest forgotten first
            for gram, token in self.pairs(self.held.pop(0)):
                self.followers[gram][token] -= 1
                if not self.followers[gram][token]:
                    del self.followers[gram][token]
                if not self.followers[gram]:
                    del self.followers[gram]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        drafts: list[int] = []
        ctx = list(tokens)
        while len(drafts) < k:
            longest = next(
                (
                    self.followers[gram]
                    for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1)
                    if (gram := tuple(ctx[-n:])) in self.followers
                ),
                None,
            )
            if longest is None:
                break
            token = most_frequent_by_search(longest)
            if longest[token] < 0.1 * sum(longest.values()):
                break
            drafts.append(token)
            ctx.append(token)
        return drafts


def test_drafts_are_those_a_search_of_every_follower_finds() -> None:
    rng = random.Random(2)
    p = proposer(history_tokens=200, prompt_lookup_max=3)
    by_search = DraftsBySearch(budget=200, min_n=1, max_n=3)
    lookup = NgramProposer(speculative_settings(SUFFIX | {"prompt_lookup_max": 3}))
    for step in range(600):
        # Outputs of 12 tokens repeat n-grams with many followers (1-grams with more than
        # are searched) and ties.
        output = [rng.randrange(12) for _ in range(rng.randrange(2, 30))]
        p.learn([], output, SALTED_A)
        by_search.learn(output)
        for _ in range(3):
            context = [rng.randrange(12) for _ in range(4)]
            # Where the history drafts nothing, prompt lookup does.
            expected = by_search.propose(context, 4) or lookup.propose(context, 4)
            assert p.propose(context, key=SALTED_A) == expected, step


def test_the_config_takes_vllms_method_name_and_checks_its_key() -> None:
    config = EngineConfig(model="m", speculative_config=SUFFIX)
    assert config.speculative_config is not None
    assert config.speculative_config["suffix_decoding_min_token_prob"] == 0.1
    for bad in (0, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
            EngineConfig(
                model="m", speculative_config=SUFFIX | {"suffix_decoding_min_token_prob": bad}
            )
    for too_long, key in (({"prompt_lookup_max": 25}, "max"), ({"prompt_lookup_min": 25}, "min")):
        with pytest.raises(
            ValueError, match=f'prompt_lookup_{key} must be ≤ 24 for method "suffix"'
        ):
            EngineConfig(model="m", speculative_config=SUFFIX | too_long)
    assert speculative_settings(SUFFIX | {"prompt_lookup_max": 24}).prompt_lookup_max == 24
    ngram = {"num_speculative_tokens": 2, "prompt_lookup_max": 64}  # prompt lookup stores none
    assert speculative_settings(ngram).prompt_lookup_max == 64
    with pytest.raises(ValueError, match='for method "suffix" only'):
        EngineConfig(
            model="m",
            speculative_config={"num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.5},
        )


def test_greedy_output_is_identical_and_a_tenant_is_drafted_from_its_own_history(
    checkpoint_dir,  # type: ignore[no-untyped-def]
) -> None:
    path = checkpoint_dir("llama")
    prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(path), n=8)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def llm(**kwargs: object) -> LLM:
        return LLM(str(path), dtype="float32", device="cpu", **kwargs)  # type: ignore[arg-type]

    expected = [o.outputs[0].token_ids for o in llm().generate(prompts, greedy)]
    spec = llm(speculative_config=SUFFIX, speculative_max_batch=1000)

    def accepted_running(salt: str) -> tuple[list[list[int]], int]:
        before = spec.engine.stats().spec_decode.num_accepted_tokens
        outs = spec.generate(prompts, greedy, cache_salt=salt)
        after = spec.engine.stats().spec_decode.num_accepted_tokens
        return [o.outputs[0].token_ids for o in outs], after - before

    first, _ = accepted_running("tenant-a")
    again, accepted_again = accepted_running("tenant-a")  # its own answers are history now
    other, accepted_other = accepted_running("tenant-b")  # the same prompts, no history
    assert first == again == other == expected
    assert accepted_again > accepted_other
    # Tenant A's second pass repeats its first: nearly every token comes from a draft.
    assert accepted_again >= 0.5 * sum(len(t) for t in expected)
    assert spec.engine.stats().kv_cache_usage == 0.0
