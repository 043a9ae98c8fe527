"""Property-based: a request's output does not depend on the requests it runs beside.

Every request of a random mix, run under scheduling pressure, must end with exactly the
output it gets when it runs alone: the same tokens, text, finish and stop reasons and
logprobs. This guards the class of serving bugs that deliver one request's tokens to
another, share KV blocks that hold different content, or let one request's state (its
sampling noise, its biases, its stop rules) leak into another's.

The mixes (hypothesis) vary the prompts (some share a prefix that spans full blocks, some
repeat an earlier prompt exactly, so the prefix cache serves them), ``max_tokens``,
greedy or seeded sampling (a seeded request's output is its own whatever the batch:
``SamplingParams``), ``n``, stop tokens and strings that fall inside the output,
``logit_bias``, logprobs, staggered arrivals (the engine is stepped by hand, so batch
composition and arrival order vary) and aborts (the aborted request has no expectation;
its neighbours still must match). The engines are small enough to preempt and to chunk
prefills, one of them with n-gram speculative decoding on; each serves every example (as a
server's engine serves one request after another), from an empty prefix cache.

The reference is each request run alone through ``LLM.generate`` on an engine with plenty
of blocks, an unchunked budget and no prefix cache. With float32 and the random
checkpoint's wide weights (``build_random_checkpoint``) greedy choices sit far from
ties, so the different batch shapes cannot legitimately change a token (the
equivalence tests against transformers rely on the same margin).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import CompletionOutput

BLOCK = 4
# 10 blocks of 4 tokens: the longest request alone fills the pool, two middling ones do
# too, so running requests are preempted; a budget of 8 tokens chunks longer prompts.
PRESSURE: dict[str, object] = {
    "block_size": BLOCK,
    "num_kv_blocks": 10,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 8,
    "enable_prefix_caching": True,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SETUPS: dict[str, dict[str, object]] = {
    "pressure": PRESSURE,
    # Drafts need room in the budget; every step with a decoding request speculates.
    "speculative": {
        **PRESSURE,
        "max_num_batched_tokens": 12,
        "speculative_config": NGRAM,
        "speculative_max_batch": 1000,
    },
}
# Shared prefixes: 3 full blocks and a token, and 2 full blocks.
PREFIXES = (tuple(range(40, 53)), tuple(range(300, 308)))
TEMPERATURES = (0.6, 1.0, 1.5)
BIAS = {7: 4.0, 100: 2.0, 200: -3.0}
MAX_SUFFIX, MAX_TOKENS = 12, 14  # at most 13 + 12 + 14 = 39 tokens: the 10 blocks

Outputs = list[CompletionOutput]
Solo = Callable[[tuple[int, ...], SamplingParams], Outputs]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request of a mix, and when it arrives (and maybe is aborted)."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float  # 0: greedy
    seed: int | None
    n: int
    ignore_eos: bool
    logprobs: int | None
    bias: bool
    stop_token_at: int | None  # a stop token: the solo output's token there
    stop_text_at: int | None  # a stop string: two characters of the solo text from there
    arrive_after: int  # steps after the previous request's arrival
    abort_after: int | None  # steps after its own arrival


@st.composite
def specs(draw: st.DrawFn, earlier: Sequence[tuple[int, ...]]) -> Spec:
    if earlier and draw(st.integers(0, 4)) == 0:
        prompt = draw(st.sampled_from(earlier))  # an exact repeat
    else:
        prefix = draw(st.sampled_from(((), *PREFIXES)))
        suffix = draw(st.lists(st.integers(3, 511), min_size=1, max_size=MAX_SUFFIX))
        prompt = (*prefix, *suffix)
    greedy = draw(st.booleans())
    optional_at = st.none() | st.integers(0, MAX_TOKENS)
    return Spec(
        prompt=prompt,
        max_tokens=draw(st.integers(1, MAX_TOKENS)),
        temperature=0.0 if greedy else draw(st.sampled_from(TEMPERATURES)),
        # Few seeds: requests that share one (and a prompt) must still keep their own noise.
        seed=None if greedy else draw(st.integers(0, 3)),
        n=draw(st.sampled_from((1, 1, 2))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 3)),
        bias=draw(st.integers(0, 3)) == 0,
        stop_token_at=draw(optional_at),
        stop_text_at=draw(optional_at),
        arrive_after=draw(st.sampled_from((0, 0, 1, 2, 4))),
        abort_after=draw(st.sampled_from((None,) * 9 + (1, 3, 6))),
    )


@st.composite
def mixes(draw: st.DrawFn) -> list[Spec]:
    mix: list[Spec] = []
    for _ in range(draw(st.integers(2, 7))):
        mix.append(draw(specs([s.prompt for s in mix])))
    return mix


def params_of(spec: Spec, solo: Solo) -> SamplingParams:
    """The spec's sampling parameters; its stops are taken from its output without them,
    so that they do fall inside the output."""
    params = SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        seed=spec.seed,
        n=spec.n,
        ignore_eos=spec.ignore_eos,
        logprobs=spec.logprobs,
        logit_bias=dict(BIAS) if spec.bias else None,
    )
    if spec.stop_token_at is None and spec.stop_text_at is None:
        return params
    free = solo(spec.prompt, params)[0]
    stop_ids, stop = [], []
    if spec.stop_token_at is not None and free.token_ids:
        stop_ids = [free.token_ids[spec.stop_token_at % len(free.token_ids)]]
    if spec.stop_text_at is not None and free.text:
        at = spec.stop_text_at % len(free.text)
        stop = [free.text[at : at + 2]]
    return dataclasses.replace(params, stop_token_ids=stop_ids, stop=stop)


def run_mix(
    engine: LLMEngine,
    mix: Sequence[tuple[Spec, SamplingParams]],
    after_step: Callable[[], None] = lambda: None,
) -> dict[str, CompletionOutput]:
    """Step the engine through the mix: arrivals and aborts at their steps. Returns each
    finished (not aborted) sample's completion by ``"<spec index>/<sample index>"``."""
    arrivals: dict[int, list[int]] = {}
    aborts: dict[int, list[int]] = {}
    step = 0
    for k, (spec, _) in enumerate(mix):
        step += spec.arrive_after
        arrivals.setdefault(step, []).append(k)
        if spec.abort_after is not None:
            aborts.setdefault(step + spec.abort_after, []).append(k)
    run = next(_runs)
    ids = {k: [f"mix{run}-{k}/{i}" for i in range(params.n)] for k, (_, params) in enumerate(mix)}
    live: set[str] = set()
    done: dict[str, CompletionOutput] = {}
    last_arrival = max(arrivals)
    step = 0
    while step <= last_arrival or engine.has_unfinished_requests():
        for k in arrivals.get(step, []):
            spec, params = mix[k]
            for i, sample in enumerate(params.samples()):
                engine.add_request(ids[k][i], list(spec.prompt), sample, sample_index=i)
                live.add(ids[k][i])
        for k in aborts.get(step, []):
            for out in engine.abort_request(ids[k]):
                assert out.request_id in live and out.outputs[0].finish_reason == "abort"
                live.remove(out.request_id)
        for out in engine.step():
            assert out.request_id in live, f"an output for {out.request_id}, not running"
            if out.finished:
                live.remove(out.request_id)
                done[out.request_id.split("-", 1)[1]] = out.outputs[0]
        after_step()
        step += 1
    assert not live
    assert engine.stats().kv_cache_usage == 0.0
    return done


_runs = itertools.count()


def _reason(out: CompletionOutput) -> str:
    if out.finish_reason != "stop":
        return str(out.finish_reason)
    if out.stop_reason is None:
        return "EOS"
    return "a stop token" if isinstance(out.stop_reason, int) else "a stop string"


def assert_same(got: CompletionOutput, want: CompletionOutput, what: str) -> None:
    assert list(got.token_ids) == list(want.token_ids), what
    assert (got.index, got.text, got.finish_reason, got.stop_reason) == (
        want.index,
        want.text,
        want.finish_reason,
        want.stop_reason,
    ), what
    if want.logprobs is None:
        assert got.logprobs is None, what
        return
    assert got.logprobs is not None and len(got.logprobs) == len(want.logprobs), what
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id, what
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4), what
        assert list(a.top) == list(b.top), what
        assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-4), what


def check_mix(
    engine: LLMEngine,
    solo: Solo,
    mix: Sequence[Spec],
    after_step: Callable[[], None] = lambda: None,
) -> list[str]:
    """Run ``mix`` on ``engine``; every sample that was not aborted ends as it does alone.
    Returns what the mix exercised, for hypothesis' statistics."""
    assert not engine.has_unfinished_requests()
    engine.reset_prefix_cache()  # each example on its own (what it leaves in the pool stays)
    with_params = [(spec, params_of(spec, solo)) for spec in mix]
    before = engine.stats()
    done = run_mix(engine, with_params, after_step)
    after = engine.stats()
    seen = [
        f"preempted: {after.num_preemptions > before.num_preemptions}",
        f"prefix-cache hits: {after.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens}",
        f"aborted: {len(done) < sum(p.n for _, p in with_params)}",
        *(f"finished by {_reason(o)}" for o in done.values()),
    ]
    if engine.config.speculative_config is not None:
        accepted = after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens
        seen.append(f"drafts accepted: {accepted > 0}")
    for key, got in done.items():
        k, i = (int(x) for x in key.split("/"))
        spec, params = with_params[k]
        want = solo(spec.prompt, params)[i]
        assert_same(got, want, f"request {k} sample {i}: {spec} with {params}")
    for k, (spec, params) in enumerate(with_params):
        if spec.abort_after is None:
            assert all(f"{k}/{i}" in done for i in range(params.n)), f"request {k} lost"
    return seen


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> Path:  # type: ignore[no-untyped-def]
    return checkpoint_dir("llama")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def solo(model: Path) -> Solo:
    """Each (prompt, params)'s completions when it runs alone, computed once."""
    llm = LLM(
        str(model),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    cache: dict[tuple[tuple[int, ...], str], Outputs] = {}

    def get(prompt: tuple[int, ...], params: SamplingParams) -> Outputs:
        key = (prompt, repr(params))
        if key not in cache:
            [out] = llm.generate([list(prompt)], params, use_tqdm=False)
            cache[key] = list(out.outputs)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def engines(model: Path) -> dict[str, LLMEngine]:
    return {
        name: LLM(str(model), dtype="float32", device="cpu", **setup).engine  # type: ignore[arg-type]
        for name, setup in SETUPS.items()
    }


@pytest.mark.parametrize("setup", list(SETUPS))
@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(mix=mixes())
def test_every_request_outputs_what_it_outputs_alone(
    setup: str, engines: dict[str, LLMEngine], solo: Solo, mix: list[Spec]
) -> None:
    for seen in check_mix(engines[setup], solo, mix):
        event(seen)  # what the mixes exercise: --hypothesis-show-statistics


# A fixed mix that must exercise what the property is about: preemption, chunked
# prefills, prefix-cache hits and (with speculation) accepted drafts.
BUSY_MIX = [
    Spec(
        prompt=(*PREFIXES[i % 2], *range(100 + 7 * i, 100 + 7 * i + 3 + 2 * i)),
        max_tokens=MAX_TOKENS,
        temperature=0.0 if i % 2 else 1.0,
        seed=None if i % 2 else i,
        n=2 if i == 3 else 1,
        ignore_eos=True,
        logprobs=2 if i == 1 else None,
        bias=i == 2,
        stop_token_at=None,
        stop_text_at=None,
        arrive_after=i % 3,
        abort_after=4 if i == 4 else None,
    )
    for i in range(6)
]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_setups_preempt_chunk_and_hit_the_prefix_cache(
    setup: str, model: Path, solo: Solo
) -> None:
    engine = LLM(str(model), dtype="float32", device="cpu", **SETUPS[setup]).engine  # type: ignore[arg-type]
    chunked = False

    def note_chunks() -> None:  # a request that ran and still has prompt left
        nonlocal chunked
        sched = engine.last_schedule
        if sched is not None:
            chunked |= any(r.num_computed_tokens < r.num_tokens - 1 for r, _ in sched.scheduled)

    check_mix(engine, solo, BUSY_MIX, note_chunks)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_tokens > 0
    assert chunked, "some prefill should have taken more than one step"
    if setup == "speculative":
        assert stats.spec_decode.num_accepted_tokens > 0
