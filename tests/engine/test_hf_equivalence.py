"""Greedy fp32 output equals Hugging Face transformers, token for token."""

from __future__ import annotations

import pytest
import transformers

from kvserve import LLM, SamplingParams
from tests.support.checkpoints import CHECKPOINTS, make_prompts
from tests.support.device import TEST_DEVICE
from tests.support.peft_adapters import hf_greedy

MAX_TOKENS = 12


# Each setup stresses a different path through the scheduler and KV cache than the
# default one, which every checkpoint runs.
PRESSURE_SETUPS = {
    "no-prefix-cache": {"enable_prefix_caching": False},
    "preempt": {"block_size": 4, "num_kv_blocks": 40, "max_num_seqs": 16},
    "chunked-prefill": {"max_num_batched_tokens": 16, "block_size": 8},
    "recompute": {"recompute_every_step": True},
}


@pytest.fixture(scope="module")
def hf_reference(checkpoint_dir):  # type: ignore[no-untyped-def]
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(name: str) -> tuple[list[list[int]], list[list[int]]]:
        if name not in cache:
            path = checkpoint_dir(name)
            tok = transformers.AutoTokenizer.from_pretrained(path)
            prompts = make_prompts(tok)
            cache[name] = prompts, hf_greedy(path, prompts, MAX_TOKENS)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_matches_transformers_default_setup(name, checkpoint_dir, hf_reference):  # type: ignore[no-untyped-def]
    prompts, expected = hf_reference(name)
    llm = LLM(str(checkpoint_dir(name)), dtype="float32", device=TEST_DEVICE)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    # The prompts share prefixes and repeat one prompt, so the default (prefix-caching)
    # setup must have served some of them from the cache, and freed every block after.
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("setup", list(PRESSURE_SETUPS))
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_matches_transformers_under_pressure(name, setup, checkpoint_dir, hf_reference):  # type: ignore[no-untyped-def]
    prompts, expected = hf_reference(name)
    llm = LLM(
        str(checkpoint_dir(name)), dtype="float32", device=TEST_DEVICE, **PRESSURE_SETUPS[setup]
    )
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    if setup == "preempt":
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert stats.kv_cache_usage == 0.0


# (SamplingParams, the same for transformers' generate): each changes greedy choices.
LOGITS_ADJUSTMENTS = {
    "repetition_penalty": ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    "logit_bias": (
        {"logit_bias": {7: 4.0, 11: 2.5, 3: -100.0}},
        {"sequence_bias": {(7,): 4.0, (11,): 2.5, (3,): -100.0}},
    ),
}


@pytest.mark.parametrize("adjustment", list(LOGITS_ADJUSTMENTS))
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_logits_adjustments_match_transformers(name, adjustment, checkpoint_dir, hf_reference):  # type: ignore[no-untyped-def]
    """logit_bias is transformers' sequence_bias of one-token sequences; the repetition
    penalty is its own (over the prompt and the output so far)."""
    ours, theirs = LOGITS_ADJUSTMENTS[adjustment]
    prompts, plain = hf_reference(name)
    expected = hf_greedy(checkpoint_dir(name), prompts, MAX_TOKENS, **theirs)
    assert expected != plain, "the adjustment should change some greedy choice"
    llm = LLM(str(checkpoint_dir(name)), dtype="float32", device=TEST_DEVICE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **ours)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
