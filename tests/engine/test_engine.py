"""Engine behaviour: prefix caching, refusals, aborts, stops, timelines, bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.telemetry import definitions as d
from tests.support.prompts import greedy_reference

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(checkpoint_dir("llama")), dtype="float32", device="cpu", block_size=4)


def test_repeated_prompt_hits_prefix_cache(llm: LLM) -> None:
    prompt = list(range(10, 33))  # 23 tokens: 5 full blocks of 4
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 20  # every full block of the prompt
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_block_aligned_prompt_still_computes_its_last_token(llm: LLM) -> None:
    prompt = list(range(40, 56))  # 16 tokens = exactly 4 blocks
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 12  # the last block is recomputed for its logits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_cache_salt_isolates_tenants(llm: LLM) -> None:
    prompt = list(range(60, 81))
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    same = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 20
    assert other.outputs[0].token_ids == same.outputs[0].token_ids


def test_a_prefix_cache_reset_waits_for_the_engine_to_be_idle(llm: LLM) -> None:
    """As vLLM's: while a request holds blocks the reset is refused (its later blocks
    would be cached as children of parents no longer cached), and nothing is forgotten."""
    prompt = list(range(90, 111))
    llm.generate([prompt], GREEDY)
    engine = llm.engine
    cached = set(engine.kv.pool.cached)
    assert cached
    engine.add_request("busy", list(range(200, 210)), GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False
    assert set(engine.kv.pool.cached) >= cached
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    assert engine.kv.pool.cached == {}


def test_prefix_cache_evicts_lru_and_stays_correct(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(checkpoint_dir("llama")), dtype="float32", device="cpu", block_size=4, num_kv_blocks=12
    )
    a, b = list(range(100, 121)), list(range(200, 233))
    ref_a = llm.generate([a], GREEDY)[0].outputs[0].token_ids  # leaves 7 cached blocks
    # b needs 10 blocks: the 5 never used, then a's blocks tail first (outputs, then the
    # end of its prompt), so only a's first 2 blocks survive.
    llm.generate([b], GREEDY)
    again = llm.generate([a], GREEDY)[0]
    assert again.num_cached_tokens == 8
    assert again.outputs[0].token_ids == ref_a


def test_requests_that_can_never_fit_are_refused_with_numbers(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(checkpoint_dir("llama")),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=10,
        max_model_len=64,
    )
    with pytest.raises(
        ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(8\) = 68 exceeds max_model_len=64"
    ):
        llm.generate([list(range(3, 63))], GREEDY)
    with pytest.raises(
        ValueError, match=r"= 45 tokens need 12 KV blocks but the whole pool has 10"
    ):
        llm.generate([list(range(3, 40))], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100_000]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_waiting_running_and_mid_prefill(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(checkpoint_dir("llama")),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=2,
        max_num_batched_tokens=8,
    )
    eng = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    eng.add_request("long", list(range(3, 40)), params)  # prefilled in chunks of 8
    eng.add_request("short", [5, 6, 7], params)
    eng.add_request("queued", [8, 9], params)  # max_num_seqs=2 keeps it waiting
    eng.step()
    assert eng.requests["long"].num_computed_tokens < 37  # mid-prefill
    # The running prefill took the whole token budget; the others wait their turn.
    assert [r.request_id for r in eng.scheduler.waiting] == ["short", "queued"]
    outs = eng.abort_request(["long", "queued"])
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]
    eng.step()
    assert eng.requests["short"].num_output_tokens == 1  # admitted once "long" left
    eng.abort_request("short")
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.num_free_blocks == 64


def test_stop_strings_and_tokens(llm: LLM) -> None:
    prompt = "the cache keeps keys"
    base = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length"
    # Stop on the third generated token id.
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[2]])
    )[0]
    assert out.outputs[0].token_ids == ids[: ids.index(ids[2]) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == ids[2]
    # Stop on a piece of the text: it never shows in the output.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
        assert out.outputs[0].text == text[: text.index(stop)]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_eos_stops_unless_ignored(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("llama")
    llm = LLM(str(path), dtype="float32", device="cpu")
    base = llm.generate(
        ["the cache"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    eos_like = base.outputs[0].token_ids[3]
    llm.engine.eos_token_ids = {eos_like}  # what generation_config.json would say
    out = llm.generate(["the cache"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.outputs[0].token_ids[-1] == eos_like and out.outputs[0].finish_reason == "stop"
    ignored = llm.generate(
        ["the cache"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )[0]
    assert len(ignored.outputs[0].token_ids) == 6


def test_timeline_is_monotonic_and_feeds_definitions(llm: LLM) -> None:
    out = llm.generate(
        ["hello world"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )[0]
    m = out.metrics
    assert m.first_scheduled_time is not None and m.finished_time is not None
    assert m.first_token_time == m.token_times[0]
    assert m.arrival_time <= m.first_scheduled_time <= m.token_times[0]
    assert m.token_times == sorted(m.token_times) and len(m.token_times) == 5
    assert m.token_times[-1] <= m.finished_time
    assert d.queue_time(m.arrival_time, m.first_scheduled_time) >= 0
    assert len(d.itls(m.token_times)) == 4
    tpot = d.tpot(m.token_times[0], m.token_times[-1], 5)
    assert tpot is not None and tpot >= 0


def test_outputs_in_input_order_and_chat(llm: LLM) -> None:
    prompts = ["a", "the cache keeps keys and values for every token", "b c"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outs] == prompts
    chat = llm.chat([{"role": "user", "content": "hello"}], GREEDY)
    assert len(chat) == 1 and len(chat[0].outputs[0].token_ids) == 8
    assert chat[0].prompt_token_ids[0] == llm.get_tokenizer().bos_token_id


def test_n_samples_are_one_output_each_with_its_own_seed(llm: LLM) -> None:
    """``SamplingParams(n=3)`` answers a prompt three times in one RequestOutput (vLLM's
    shape): sample i is what the same request alone with seed + i gives."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=40, n=3)
    out, other = llm.generate(["the cache keeps keys", "hello"], params)
    alone = llm.generate(
        ["the cache keeps keys"] * 3,
        [SamplingParams(max_tokens=6, ignore_eos=True, seed=40 + i) for i in range(3)],
    )
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(other.outputs) == 3
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_kv_blocks
    # Admitted in one step, the later samples reuse the first one's prompt blocks.
    prompt = list(range(100, 140))  # (no other test's)
    for i, sample in enumerate(SamplingParams(max_tokens=2, n=3).samples()):
        llm.engine.add_request(f"sample-{i}", prompt, sample, sample_index=i)
    cached = {}
    while llm.engine.has_unfinished_requests():
        cached |= {o.request_id: o.num_cached_tokens for o in llm.engine.step() if o.finished}
    assert cached == {"sample-0": 0, "sample-1": 36, "sample-2": 36}
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=129)


def test_prompt_logprobs_score_the_whole_prompt_chunk_by_chunk(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """``prompt_logprobs``: each prompt token's logprob (and the top ones) as transformers
    computes it, through chunked prefill, and again when the prefix cache holds the
    prompt (such a request computes it all the same)."""
    path = checkpoint_dir("llama")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]  # the cache holds its prompt now
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    for out in (first, again):
        scores = out.prompt_logprobs
        assert scores is not None and len(scores) == len(prompt) and scores[0] is None
        for i, entry in enumerate(scores[1:], start=1):
            assert entry is not None and entry.token_id == prompt[i]
            assert entry.logprob == pytest.approx(reference[i - 1, prompt[i]].item(), abs=1e-4)
            top = reference[i - 1].topk(3)
            assert list(entry.top) == top.indices.tolist()
    assert again.num_cached_tokens == 0  # it computed the prompt the cache held
    plain = llm.generate([prompt], GREEDY)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 36
    # max_tokens=0: only the prompt scored (OpenAI's legacy echo with max_tokens 0).
    scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[1:] == [
        replace(e, top={}) for e in first.prompt_logprobs[1:] if e is not None
    ]
    with pytest.raises(InvalidRequestError, match="0 only to score the prompt"):
        SamplingParams(max_tokens=0)
    # Held per token until the request ends (and sent to a gateway in one message): bounded.
    with pytest.raises(InvalidRequestError, match="12500 prompt tokens") as refused:
        llm.generate([[5] * 12_500], SamplingParams(prompt_logprobs=20))
    assert refused.value.param == "prompt_logprobs"


def test_bf16_agrees_with_fp32_teacher_forced(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(checkpoint_dir("qwen3-trained"))
    fp32 = LLM(path, dtype="float32", device="cpu")
    reference = greedy_reference(fp32)
    outs, sequences, ref = reference.outputs, reference.sequences, reference.logprobs
    del fp32
    bf16 = LLM(path, dtype="bfloat16", device="cpu")
    got = [bf16.engine.prompt_logprobs(s) for s in sequences]
    agree = total = 0
    max_diff = 0.0
    for r, g, o in zip(ref, got, outs, strict=True):
        start = len(o.prompt_token_ids) - 1  # positions that predicted the fp32 outputs
        r, g = r[start:-1], g[start:-1]
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
        max_diff = max(max_diff, float((r - g).abs().max()))
    print(f"bf16 vs fp32: argmax agreement {agree}/{total}, max |Δ log-softmax| = {max_diff:.4f}")
    assert agree / total >= 0.99
    assert max_diff < 0.5


def test_prompt_logprobs_match_transformers(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = checkpoint_dir("qwen2")
    llm = LLM(str(path), dtype="float32", device="cpu")
    ids = llm.get_tokenizer().encode("the cache keeps keys and values")
    ours = llm.engine.prompt_logprobs(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    assert torch.allclose(ours, ref, atol=1e-4)


def test_a_failed_step_leaves_no_uncomputed_block_in_the_prefix_cache(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """Full blocks enter the prefix cache when allocated, before the step computes them.
    A step whose forward pass failed (a CUDA OOM, a kernel error: the async engine fails
    that batch and serves on) left them cached with KV never written, and the next
    request with the prompt decoded from it: wrong output, and no error."""
    import asyncio

    from kvserve.engine.async_engine import AsyncEngine, RequestFailedError

    llm = LLM(str(checkpoint_dir("llama")), dtype="float32", device="cpu", block_size=4)
    engine = llm.engine
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    # The pool's blocks hold another prompt's KV (not zeros), then nothing is cached.
    llm.generate([list(range(300, 330))], GREEDY)
    assert engine.reset_prefix_cache()
    execute, failures = engine.runner.execute, [RuntimeError("out of device memory")]

    def fails_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        if failures:
            raise failures.pop()
        return execute(*args, **kwargs)

    engine.runner.execute = fails_once  # type: ignore[method-assign]

    async def tokens() -> list[int]:
        outputs = [o async for o in async_engine.stream(async_engine.make_request(prompt, GREEDY))]
        return list(outputs[-1].outputs[0].token_ids)

    async def main() -> list[int]:
        async_engine.start()
        try:
            with pytest.raises(RequestFailedError, match="out of device memory"):
                await tokens()
            assert engine.kv.pool.cached == {}
            return await tokens()
        finally:
            await async_engine.stop()

    async_engine = AsyncEngine(engine)
    assert asyncio.run(main()) == want
