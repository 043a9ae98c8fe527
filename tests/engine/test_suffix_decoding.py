"""Suffix decoding: drafts from earlier outputs of the same tenant and adapter, exact
greedy output, bounded memory, and no drafting across tenants."""

from __future__ import annotations

import pytest
import transformers

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, speculative_settings
from kvserve.lora.request import LoRARequest
from kvserve.spec_decode.suffix import SuffixProposer
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


def test_the_config_takes_vllms_method_name_and_checks_its_key() -> None:
    config = EngineConfig(model="m", speculative_config=SUFFIX)
    assert config.speculative_config is not None
    assert config.speculative_config["suffix_decoding_min_token_prob"] == 0.1
    for bad in (0, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
            EngineConfig(
                model="m", speculative_config=SUFFIX | {"suffix_decoding_min_token_prob": bad}
            )
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
