"""Tensor parallelism on the CPU (gloo, 2 ranks as 2 processes): greedy fp32 output
equals the one-rank engine and transformers token for token, under the scheduler's
pressure paths; logits agree to float rounding; bad shapes are refused at load.

The model's sums are split over ranks (o_proj, down_proj, the embedding), so logits
differ from one rank's in the last bits (asserted below to 1e-4); the random test
checkpoints are wide enough that no greedy choice is that close to a tie."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.parallel.group import GroupFailedError, TensorGroup
from kvserve.parallel.launch import Launch, LocalWorkers
from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support.checkpoints import make_prompts
from tests.support.peft_adapters import hf_greedy

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

SETUPS = {
    "prefix-cache": {},
    "chunked-prefill": {"max_num_batched_tokens": 16, "block_size": 8},
    "preempt": {"block_size": 4, "num_kv_blocks": 40, "max_num_seqs": 16},
}


@pytest.fixture(scope="module")
def reference(checkpoint_dir):  # type: ignore[no-untyped-def]
    """name → (path, prompts, transformers' greedy tokens)."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]], list[list[int]]]:
        if name not in cache:
            path = checkpoint_dir(name)
            prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(path), n=12)
            cache[name] = path, prompts, hf_greedy(path, prompts, MAX_TOKENS)
        return cache[name]

    return get


# llama: GQA, 2 KV heads (one a rank); qwen3: GQA with q/k norms; llama3-tied-mqa: one
# KV head, replicated on both ranks, and tied embeddings (the vocabulary-parallel
# embedding is also the LM head).
@pytest.mark.parametrize(
    ("name", "setup"),
    [(name, setup) for name in ("llama", "qwen3") for setup in SETUPS]
    + [("llama3-tied-mqa", "prefix-cache")],
)
def test_two_ranks_match_transformers_token_for_token(name, setup, reference):  # type: ignore[no-untyped-def]
    path, prompts, expected = reference(name)
    with LLM(
        str(path), dtype="float32", device="cpu", tensor_parallel_size=2, **SETUPS[setup]
    ) as llm:
        outs = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.kv_cache_usage == 0.0
    if setup == "prefix-cache":
        assert stats.prefix_cache_hit_tokens > 0
    if setup == "preempt":
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"


def test_logits_match_one_rank_with_a_padded_vocabulary(tmp_path: Path) -> None:
    # 515 tokens over 2 ranks: the second rank's last row is padding, cut from the logits.
    path = build_random_checkpoint(tmp_path / "odd", "qwen2", vocab_size=515)
    tokens = list(range(3, 300))
    with LLM(str(path), dtype="float32", device="cpu") as one:
        expected = one.engine.prompt_logprobs(tokens)
    with LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=2) as two:
        got = two.engine.prompt_logprobs(tokens)
        # Served: a step that samples and scores the prompt (in two parts of rows): every
        # rank makes the same logits in the same order.
        params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
        scored = two.generate([tokens], params)[0].prompt_logprobs
        workers = list(two.engine.workers.procs.values())  # type: ignore[union-attr]
    assert got.shape == expected.shape == (len(tokens), 515)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert scored is not None and len(scored) == len(tokens)
    served = torch.tensor([e.logprob for e in scored[1:] if e is not None])
    teacher = expected[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    torch.testing.assert_close(served, teacher, atol=1e-4, rtol=1e-4)
    # close() stopped the worker: it left on rank 0's stop message, with status 0
    assert [w.returncode for w in workers] == [0]


def test_an_unshardable_model_is_refused_at_load_with_the_numbers(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by 3"):
        LLM(str(checkpoint_dir("llama")), device="cpu", tensor_parallel_size=3)


def test_lora_with_tensor_parallelism_is_refused(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="enable_lora cannot be combined"):
        LLM(str(checkpoint_dir("llama")), device="cpu", tensor_parallel_size=2, enable_lora=True)


def test_a_worker_gone_before_the_group_forms_fails_the_join_at_once(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 used to wait out torch's 5-minute rendezvous for a worker that had died
    before joining (killed, out of memory, a failed import): the watcher had said so at
    once, and nobody listened."""
    config = EngineConfig(model=str(checkpoint_dir("llama")), device="cpu")
    launch = Launch().with_port()
    assert launch.master_port is not None
    workers = LocalWorkers(config, launch, range(1, 2), 2)
    [proc] = workers.procs.values()
    proc.kill()
    proc.wait()
    with pytest.raises(GroupFailedError, match=r"rank 1 .* exited with signal SIGKILL"):
        TensorGroup.join(
            0, 2, launch.master_addr, launch.master_port, torch.device("cpu"), workers.exited
        )
    workers.stop(timeout=0)


def test_a_rendezvous_port_in_use_is_named(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """The port was a torch DistNetworkError, which `kvserve serve` printed as a
    traceback; now a ValueError naming the address and the flags (one error line)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EngineConfig(
            model=str(checkpoint_dir("llama")), device="cpu", tensor_parallel_size=2
        )
        with pytest.raises(ValueError, match=rf"127.0.0.1:{port} .*--master-port.*in use"):
            LLMEngine(config, time.monotonic, Launch(master_port=port))


def test_a_step_that_fails_on_rank_0_is_fatal(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    """With one rank a failed step fails its batch and the engine serves on. With more,
    rank 0 may have left the step between two collectives the others still wait in (a
    review made the token masker raise there: the next request hung for the 5-minute
    collective timeout): the engine stops at once, as when a rank is lost."""
    import asyncio

    from kvserve.engine.async_engine import AsyncEngine, EngineDeadError

    llm = LLM(str(checkpoint_dir("llama")), device="cpu", dtype="float32", tensor_parallel_size=2)

    def fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of device memory")

    llm.engine.runner.execute = fails  # type: ignore[method-assign]
    engine = AsyncEngine(llm.engine)

    async def main() -> None:
        engine.start()
        try:
            with pytest.raises(EngineDeadError, match="a step failed on rank 0"):
                async for _ in engine.stream(engine.make_request([1, 2, 3], GREEDY)):
                    pass
            with pytest.raises(EngineDeadError):  # at once, not after a collective's wait
                async for _ in engine.stream(engine.make_request([4, 5, 6], GREEDY)):
                    pass
        finally:
            await engine.stop()

    try:
        asyncio.run(main())
    finally:
        llm.close()
