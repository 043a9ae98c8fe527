"""n-gram speculative decoding: exact greedy output, an unchanged sampling distribution,
stop rules inside an accepted run, its KV bookkeeping, its counters and its options."""

from __future__ import annotations

import argparse
import math
from collections import Counter

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.config import EngineConfig, SpeculativeSettings
from kvserve.engine.request import Request
from kvserve.engine_options import add_arguments, config_from_args
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestMetrics
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode.proposer import NgramProposer
from tests.support.checkpoints import CHECKPOINTS, make_prompts
from tests.support.device import TEST_DEVICE
from tests.support.peft_adapters import ALL_LINEAR, build_adapter

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# High enough that every step of these small batches speculates.
ALWAYS = {"speculative_config": NGRAM, "speculative_max_batch": 1000}
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SETUPS = {
    "default": {},
    "preempt": {"block_size": 4, "num_kv_blocks": 60, "max_num_seqs": 16},
    "chunked-prefill": {"max_num_batched_tokens": 16, "block_size": 8},
}


def _llm(path: object, **kwargs: object) -> LLM:
    return LLM(str(path), dtype="float32", device=TEST_DEVICE, **kwargs)  # type: ignore[arg-type]


def _prompts(path: object) -> list[list[int]]:
    return make_prompts(transformers.AutoTokenizer.from_pretrained(path), n=10)


def _greedy_case(path: object, setup: dict[str, object]) -> None:
    prompts = _prompts(path)
    expected = [o.outputs[0].token_ids for o in _llm(path, **setup).generate(prompts, GREEDY)]
    llm = _llm(path, **setup, **ALWAYS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    stats = llm.engine.stats()
    # Random models' greedy output loops, so prompt lookup finds drafts and some hold.
    assert stats.spec_decode.num_draft_tokens > 0
    assert stats.spec_decode.num_accepted_tokens > 0
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    assert stats.kv_cache_usage == 0.0  # rejected drafts' blocks were all given back
    if setup is SETUPS["preempt"]:
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if setup is SETUPS["default"]:
        assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_output_is_identical_on_every_architecture(name, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    _greedy_case(checkpoint_dir(name), SETUPS["default"])


@pytest.mark.parametrize("setup", ["preempt", "chunked-prefill"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_output_is_identical_under_pressure(name, setup, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    _greedy_case(checkpoint_dir(name), SETUPS[setup])


def test_a_logit_bias_speculates_and_keeps_its_output(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """A bias is the same at every position, so its requests are verified like others."""
    path = checkpoint_dir("llama")
    prompts = _prompts(path)
    biased = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias={7: 3.0, 11: -1.5}
    )
    expected = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, biased)]
    assert expected != [o.outputs[0].token_ids for o in _llm(path).generate(prompts, GREEDY)]
    llm = _llm(path, **ALWAYS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, biased)] == expected
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_lora_requests_speculate_under_their_adapter(checkpoint_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("llama")
    adapter = LoRARequest("a", str(build_adapter(path, tmp_path / "a", targets=ALL_LINEAR)))
    prompts = _prompts(path)
    # Every other request under the adapter: one batch mixes adapted and base requests.
    loras = [adapter if i % 2 else None for i in range(len(prompts))]
    lora = {"enable_lora": True, "max_lora_rank": 8}
    expected = _llm(path, **lora).generate(prompts, GREEDY, lora_request=loras)
    llm = _llm(path, **lora, **ALWAYS)
    got = llm.generate(prompts, GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_the_kv_invariant_holds_after_every_step(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = _llm(checkpoint_dir("llama"), block_size=4, **ALWAYS)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(checkpoint_dir("llama"))[:6]):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            assert not req.spec_token_ids  # drafts live for one step only
            if req.num_output_tokens:
                # Computed tokens are exactly the known ones but the newest, and the
                # request holds no block past its known tokens (rejected drafts' blocks
                # were given back).
                assert req.num_computed_tokens == req.num_tokens - 1
                held = len(engine.kv.block_ids(req.request_id))
                kv = engine.kv
                assert kv.blocks_needed(req.num_computed_tokens) <= held
                assert held <= kv.blocks_needed(req.num_tokens)
            # Prefix-cache hashes cover committed tokens only.
            assert len(req.block_hashes) <= req.num_tokens // engine.kv.block_size
    stats = engine.stats()
    assert stats.spec_decode.num_accepted_tokens > 0
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    assert stats.kv_cache_usage == 0.0


def test_stops_inside_an_accepted_run_truncate_it(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("llama")
    prompts = _prompts(path)
    plain, spec = _llm(path), _llm(path, **ALWAYS)
    free = [o.outputs[0] for o in plain.generate(prompts, GREEDY)]
    cases = []
    for prompt, out in zip(prompts, free, strict=True):
        # A stop token, a stop string and a max_tokens that fall mid-output.
        stop_token = out.token_ids[MAX_TOKENS // 2]
        stop_text = out.text[len(out.text) // 2 : len(out.text) // 2 + 3]
        for params in (
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_token]),
            SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0, stop=[stop_text] if stop_text.strip() else []
            ),
            SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2),
        ):
            cases.append((prompt, params))
    want = [plain.generate([p], sp)[0].outputs[0] for p, sp in cases]
    got = [spec.generate([p], sp)[0].outputs[0] for p, sp in cases]
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids,
            w.text,
            w.finish_reason,
            w.stop_reason,
        )
        if w.logprobs is not None:
            assert g.logprobs is not None and len(g.logprobs) == len(w.logprobs)
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.token_id == b.token_id
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert list(a.top) == list(b.top)
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0


def test_speculation_turns_off_for_large_batches_and_some_requests(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("llama")
    prompts = [p[:8] for p in _prompts(path) if len(p) >= 8][:4]
    assert len(prompts) == 4
    # All four decode in every step (same lengths, same max_tokens): at the threshold, no
    # step speculates; above it, steps do.
    for limit, speculates in ((4, False), (5, True)):
        llm = _llm(path, speculative_config=NGRAM, speculative_max_batch=limit)
        llm.generate(prompts, GREEDY)
        assert (llm.engine.stats().spec_decode.num_drafts > 0) is speculates
    # Penalties and grammars: never speculated (their per-position state is not
    # replayed), while the requests beside them are, unchanged.
    for penalty in ({"presence_penalty": 0.5}, {"repetition_penalty": 1.2}):
        llm = _llm(path, **ALWAYS)
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, **penalty))
        assert llm.engine.stats().spec_decode.num_drafts == 0, penalty
    regex = SamplingParams(
        max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z]{9}")
    )
    mixed = [regex, GREEDY, GREEDY, GREEDY]
    want = [o.outputs[0] for o in _llm(path).generate(prompts, mixed)]
    got = [o.outputs[0] for o in llm.generate(prompts, mixed)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(got[0].text) == 9 and got[0].text.isalpha()
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_one_seed_one_output_with_or_without_speculation(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """Alone, in a batch that turns speculation off (``speculative_max_batch``), and
    without speculation at all: one seed, one output. (Before, a seeded request drew
    noise only for rows with drafts, so a step that speculated and one that did not
    consumed it differently: the output depended on the batch.)"""
    path = checkpoint_dir("llama")
    prompts = _prompts(path)
    seeded = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=7 + i, ignore_eos=True)
        for i, t in enumerate((0.3, 0.8, 1.0, 1.3))
    ]
    others = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _llm(path).generate(prompts[:4], seeded)]
    llm = _llm(path, speculative_config=NGRAM, speculative_max_batch=5)
    alone = [
        llm.generate([p], s)[0].outputs[0].token_ids
        for p, s in zip(prompts[:4], seeded, strict=True)
    ]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    crowded = llm.generate(prompts, seeded + [others] * (len(prompts) - 4))
    assert alone == plain
    assert [o.outputs[0].token_ids for o in crowded[:4]] == plain


# ---- the sampling distribution ---------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), Wilson-Hilferty approximation."""
    return float(df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3)


def _homogeneity(a: Counter[object], b: Counter[object]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples over the same cells;
    cells with fewer than 10 observations in all are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells = [(a[k], b[k]) for k in set(a) | set(b)]
    big = [c for c in cells if c[0] + c[1] >= 10]
    small = [c for c in cells if c[0] + c[1] < 10]
    if small:
        big.append((sum(c[0] for c in small), sum(c[1] for c in small)))
    stat = 0.0
    for x, y in big:
        total = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = total * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(big) - 1


def _request(i: int, drafts: list[int], params: SamplingParams) -> Request:
    req = Request(str(i), [1, 2, 3], params, RequestMetrics(arrival_time=0.0))
    req.spec_token_ids = list(drafts)
    return req


def test_verification_samples_each_token_from_the_model_distribution() -> None:
    # Three rows of one request with two drafts; drafts with middling probability, so
    # acceptance and rejection both happen often.
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 6, generator=gen)
    drafts = [2, 4]
    rows[0, 2], rows[1, 4] = rows[0].max(), rows[1].max()
    n = 20000
    params = SamplingParams(max_tokens=8, temperature=1.0)
    reqs = [_request(i, drafts, params) for i in range(n)]
    out = Sampler(torch.device(TEST_DEVICE), seed=0).verify(rows.repeat(n, 1).to(TEST_DEVICE), reqs)

    probs = torch.softmax(rows, dim=-1)
    first = Counter(tokens[0] for tokens in out.token_ids)
    second = Counter(tokens[1] for tokens in out.token_ids if tokens[0] == drafts[0])
    for counts, p in ((first, probs[0]), (second, probs[1])):
        total = sum(counts.values())
        stat = sum((counts[t] - total * q) ** 2 / (total * q) for t, q in enumerate(p.tolist()))
        assert stat < _chi2_critical(5), (counts, p)
    accepted = sum(len(t) - 1 for t in out.token_ids)
    assert 0 < accepted < 2 * n
    # Never more tokens than drafts + 1, and an accepted prefix of the drafts.
    assert all(t[: len(t) - 1] == drafts[: len(t) - 1] for t in out.token_ids)


def test_verification_never_accepts_a_draft_outside_top_k() -> None:
    rows = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=2)
    reqs = [_request(i, [3], params) for i in range(500)]
    out = Sampler(torch.device(TEST_DEVICE), seed=0).verify(
        rows.repeat(500, 1).to(TEST_DEVICE), reqs
    )
    assert all(len(t) == 1 and t[0] in (0, 1) for t in out.token_ids)


def test_sampled_output_distribution_is_unchanged_on_a_model(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("llama")
    plain = _llm(path, max_num_seqs=256, seed=1)
    start = list(range(40, 60))
    greedy = SamplingParams(max_tokens=30, temperature=0)
    # The model's own greedy continuation in the prompt: drafts it gives weight to.
    prompt = start + plain.generate([start], greedy)[0].outputs[0].token_ids
    # The first 3 tokens: the 2nd and 3rd come from one verification step (a draft and
    # the token after it) whenever the 1st token occurred in the prompt.
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    n = 1500

    def sample(llm: LLM) -> Counter[object]:
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        return Counter(tuple(o.outputs[0].token_ids) for o in outs)

    spec = _llm(
        path,
        max_num_seqs=256,
        seed=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        speculative_max_batch=10**6,
    )
    stat, df = _homogeneity(sample(plain), sample(spec))
    assert stat < _chi2_critical(df), (stat, df)
    counts = spec.engine.stats().spec_decode
    assert counts.num_draft_tokens > n // 10
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens


# ---- the proposer and the options --------------------------------------------------------


def test_the_proposer_takes_the_longest_most_recent_match() -> None:
    p = NgramProposer(SpeculativeSettings("ngram", 3, 2, 4))
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]
    # [7, 2, 3] occurs once (a 3-gram) and [2, 3] later: the longer match wins.
    assert p.propose([7, 2, 3, 8, 8, 2, 3, 6, 7, 2, 3]) == [8, 8, 2]
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], limit=1) == [4]
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert p.propose([5, 1, 2, 5]) == []  # only a 1-gram: below prompt_lookup_min
    assert p.propose([4]) == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": "3"}, "prompt_lookup_max"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min (4) must be ≤ prompt_lookup_max (2)",
        ),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown key 'lookahead'"),
        ("ngram", "must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_by_key(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model="m", speculative_config=config)  # type: ignore[arg-type]


def test_the_serve_flag_takes_json() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 3}'])
    config = config_from_args(args, model="m")
    assert config.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 5,
    }
    assert config_from_args(parser.parse_args([]), model="m").speculative_config is None
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
