"""The sampler on real logits tensors and through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.outputs import RequestMetrics
from kvserve.sample.sampler import Sampler, SeededNoise
from kvserve.sampling_params import StructuredOutputsParams

VOCAB = 50


def make_request(
    params: SamplingParams, sampler: Sampler, outputs: list[int] | None = None
) -> Request:
    req = Request("r", [1, 2, 3], params, RequestMetrics(0.0))
    if params.seed is not None:
        req.generator = sampler.request_generator(params.seed)
    for t in outputs or []:
        req.append_output_token(t)
    return req


def test_top_k_1_equals_greedy() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    reqs = [make_request(SamplingParams(temperature=1.3, top_k=1), sampler) for _ in range(8)]
    assert sampler(logits, reqs).token_ids == logits.argmax(-1).tolist()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    top_k=st.integers(0, VOCAB),
    temperature=st.floats(0.2, 2.0),
)
def test_filters_never_pick_outside_allowed_set(seed, top_p, min_p, top_k, temperature) -> None:  # type: ignore[no-untyped-def]
    sampler = Sampler(torch.device("cpu"), seed=seed)
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    reqs = [make_request(params, sampler) for _ in range(16)]
    tokens = sampler(logits, reqs).token_ids
    for row, tok in zip(logits, tokens, strict=True):
        probs = torch.softmax(row / temperature, -1)
        order = probs.argsort(descending=True).tolist()
        rank = order.index(tok)
        if top_k > 0:
            assert rank < top_k
        mass_before = probs[order[:rank]].sum().item()
        assert mass_before < top_p + 1e-5, "outside the top-p nucleus"
        # min_p is relative to the most likely token (after top-k/top-p renormalisation,
        # which keeps the ratio to the maximum).
        assert probs[tok] >= min_p * probs.max() - 1e-6


def test_seeded_sampling_reproducible_across_batch_mixes() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    target = logits[2].clone()

    def draw(
        batch_logits: torch.Tensor, row: int, others_seeded: bool, steps: int = 5
    ) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=123)
        reqs = [
            make_request(
                SamplingParams(
                    temperature=1.0, seed=(7 if i == row else (i if others_seeded else None))
                ),
                sampler,
            )
            for i in range(len(batch_logits))
        ]
        return [sampler(batch_logits, reqs).token_ids[row] for _ in range(steps)]

    alone = draw(target.unsqueeze(0), 0, False)
    in_batch = draw(logits, 2, False)
    with_seeded_neighbours = draw(torch.cat([logits[3:], logits[:3]]), 5, True)
    assert alone == in_batch == with_seeded_neighbours
    assert len(set(alone)) > 1, "sampling at temperature 1 should vary across steps"


def test_penalties_discourage_repeats() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    plain = make_request(SamplingParams(temperature=0), sampler, outputs=[5, 5])
    penalised = make_request(SamplingParams(temperature=0, frequency_penalty=0.1), sampler, [5, 5])
    presence = make_request(SamplingParams(temperature=0, presence_penalty=0.2), sampler, [5])
    out = sampler(logits.repeat(3, 1), [plain, penalised, presence]).token_ids
    assert out == [5, 6, 6]


def test_logprobs_are_raw_log_softmax() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    reqs = [
        make_request(SamplingParams(temperature=0, logprobs=3), sampler),
        make_request(SamplingParams(temperature=0.7), sampler),
    ]
    out = sampler(logits, reqs)
    lp = out.logprobs[0]
    assert lp is not None and out.logprobs[1] is None
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == int(ref.argmax())
    assert abs(lp.logprob - ref.max().item()) < 1e-6
    assert list(lp.top) == ref.topk(3).indices.tolist()


def test_engine_seeded_requests_reproducible_regardless_of_batch(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(checkpoint_dir("llama")), dtype="float32", device="cpu")
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    other = SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True)
    alone = llm.generate(["hello there"], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(["a", "hello there", "the cache keeps keys"], [other, seeded, other])
    assert mixed[1].outputs[0].token_ids == alone
    greedy = llm.generate(
        ["hello there"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    top1 = llm.generate(
        ["hello there"], SamplingParams(max_tokens=10, temperature=0.9, top_k=1, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def noise_of(seed: int, n: int = 64) -> list[float]:
    row = torch.empty(n)
    SeededNoise(seed, torch.device("cpu")).exponential_(row)
    return row.tolist()


def test_every_bit_of_a_seed_changes_the_noise() -> None:
    # torch's CPU generator keeps only the low 32 bits of a seed: these pairs used to
    # sample alike.
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**32, 2**32 + 1, 2**62]
    noises = [noise_of(s) for s in seeds]
    assert len({tuple(n) for n in noises}) == len(seeds)
    assert noise_of(2**63 - 1) == noise_of(2**63 - 1)  # still reproducible
    assert noise_of(-1) == noise_of(2**64 - 1)  # one seed, two spellings (two's complement)


def test_small_seeds_sample_as_before() -> None:
    plain = torch.empty(64).exponential_(generator=torch.Generator().manual_seed(42))
    assert noise_of(42) == plain.tolist()


def test_the_noise_of_a_large_seed_is_exponential() -> None:
    values = torch.tensor(noise_of(2**40 + 7, n=200_000))
    assert bool((values > 0).all()) and bool(torch.isfinite(values).all())
    assert abs(values.mean().item() - 1.0) < 0.02  # Exp(1): mean 1, variance 1
    assert abs(values.var().item() - 1.0) < 0.05


def test_min_tokens_holds_back_every_stop(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """No EOS, stop token or stop string ends the output before min_tokens (vLLM's)."""
    llm = LLM(str(checkpoint_dir("llama")), dtype="float32", device="cpu")
    (eos, *_) = sorted(llm.engine.eos_token_ids)

    def run(**params: object) -> tuple[list[int], str | None, str | int | None, str]:
        out = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0, **params))
        c = out[0].outputs[0]
        return list(c.token_ids), c.finish_reason, c.stop_reason, c.text

    # +100 on EOS: it is the first token, or the first one min_tokens allows.
    assert run(logit_bias={eos: 100})[:2] == ([eos], "stop")
    tokens, reason, _, _ = run(logit_bias={eos: 100}, min_tokens=5)
    assert len(tokens) == 6 and tokens[-1] == eos and eos not in tokens[:5] and reason == "stop"
    tokens, reason, stop_reason, _ = run(logit_bias={17: 100}, stop_token_ids=[17], min_tokens=3)
    assert (len(tokens), tokens[-1], reason, stop_reason) == (4, 17, "stop", 17)
    # A stop string that the first tokens' text holds.
    _, _, _, text = run(ignore_eos=True)
    first = (
        llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[
            0
        ]
        .outputs[0]
        .text
    )
    stop = first[-2:] if len(first) >= 2 else first
    assert stop and run(ignore_eos=True, stop=[stop])[1] == "stop"
    tokens, reason, _, whole = run(ignore_eos=True, stop=[stop], min_tokens=12)
    assert (len(tokens), reason, whole) == (12, "length", text)


def test_min_tokens_is_checked() -> None:
    for params, fragment in (
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be an integer in [0, max_tokens=4]"),
        ({"min_tokens": -1}, "min_tokens must be"),
        (
            {"min_tokens": 2, "structured_outputs": StructuredOutputsParams(regex="a+")},
            "cannot be combined with structured outputs",
        ),
    ):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**params)  # type: ignore[arg-type]
        assert err.value.param == "min_tokens" and fragment in str(err.value)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"seed": 1.5}, "seed"),
        ({"logprobs": 2.5}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"stop": [1]}, "stop"),
        ({"stop": 7}, "stop"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_by_name(
    params: dict[str, object], param: str
) -> None:
    """Not accepted and left to fail in the engine as a TypeError (a float seed reached
    the sampler's bit mask; a number in stop, the stop-string matcher)."""
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**params)  # type: ignore[arg-type]
    assert err.value.param == param, err.value


def test_none_stop_lists_are_empty_as_in_vllm() -> None:
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert (params.stop, params.stop_token_ids) == ([], [])
    assert SamplingParams(seed=np.int64(3), stop_token_ids=[np.int32(5)]).stop_token_ids == [5]
