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


def test_a_step_of_decodes_a_continued_chunk_and_fresh_prompts_matches_transformers(
    checkpoint_dir, hf_reference
):  # type: ignore[no-untyped-def]
    """Each kind of token has its own attention path (model/attention.py): decodes over
    their gathered context, a chunk continuing its prompt over its cached prefix, and
    fresh prompts of different lengths each on its own keys. One step holding all three
    must give every request transformers' tokens."""
    prompts, expected = hf_reference("llama")
    # Two short prompts decode while a long one is chunked by the budget and three more
    # arrive; prefix caching off, so a fresh prompt is one with nothing cached.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    early, long_one, late = order[:2], order[-1], order[2:5]
    assert len({len(prompts[i]) for i in late}) > 1, "the fresh prompts should differ"
    # Step 3 holds the 2 decodes, the long prompt's rest and the late prompts whole.
    longest, late_tokens = len(prompts[long_one]), sum(len(prompts[i]) for i in late)
    budget = (longest + 4 + late_tokens) // 2 + 1
    assert budget - 2 < longest, "the long prompt should take two chunks"
    engine = LLM(
        str(checkpoint_dir("llama")),
        dtype="float32",
        device=TEST_DEVICE,
        enable_prefix_caching=False,
        max_num_batched_tokens=budget,
    ).engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    got: dict[int, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = list(out.outputs[0].token_ids)

    for i in early:
        engine.add_request(str(i), prompts[i], params)
    step()  # their prefill; from now on they decode
    engine.add_request(str(long_one), prompts[long_one], params)
    step()  # its first chunk
    for i in late:
        engine.add_request(str(i), prompts[i], params)
    step()
    kinds = [  # (after the step: a fresh prompt has computed exactly its n tokens)
        "decode" if n == 1 else "fresh" if r.num_computed_tokens == n else "continued"
        for r, n in engine.last_schedule.scheduled
    ]
    assert kinds.count("decode") == 2 and kinds.count("continued") == 1, kinds
    assert kinds.count("fresh") == len(late), kinds
    while engine.has_unfinished_requests():
        step()
    assert got == {i: expected[i] for i in [*early, long_one, *late]}
