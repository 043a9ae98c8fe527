"""Greedy fp32 output under LoRA adapters equals transformers + peft (``PeftModel``,
unmerged), token for token, in one mixed batch of base-model and adapter requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from kvserve import LLM, SamplingParams
from kvserve.lora import LoRARequest
from tests.support.checkpoints import make_prompts
from tests.support.device import TEST_DEVICE
from tests.support.peft_adapters import ALL_LINEAR, ATTENTION, build_adapter, hf_greedy

MAX_TOKENS = 8
# name → build arguments: ranks 8 and 64, attention-only and all-linear, rsLoRA.
ADAPTERS: dict[str, dict[str, object]] = {
    "attn-r8": {"r": 8, "alpha": 16, "targets": ATTENTION, "seed": 1},
    "all-r64": {"r": 64, "alpha": 32, "targets": ALL_LINEAR, "seed": 2},
    "all-r8-rslora": {"r": 8, "alpha": 4, "targets": ALL_LINEAR, "use_rslora": True, "seed": 3},
}
# Two slots for three adapters: some requests wait for a slot. The setups are
# test_hf_equivalence's pressure setups (each also runs the plain mixed batch): a pool
# small enough to preempt, and a budget that chunks prefills.
SETUPS: dict[str, dict[str, object]] = {
    "preempt": {"block_size": 4, "num_kv_blocks": 24, "max_num_seqs": 16},
    "chunked-prefill": {"max_num_batched_tokens": 24, "block_size": 8},
}


@pytest.fixture(scope="module")
def reference(checkpoint_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """name → (checkpoint, adapters, prompts, requests' adapters, expected tokens)."""
    cache: dict[str, object] = {}

    def get(name: str):  # type: ignore[no-untyped-def]
        if name not in cache:
            ckpt = checkpoint_dir(name)
            root = tmp_path_factory.mktemp(f"adapters-{name}")
            adapters = {a: build_adapter(ckpt, root / a, **kw) for a, kw in ADAPTERS.items()}  # type: ignore[arg-type]
            prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(ckpt), n=4)
            by_adapter: dict[str | None, list[list[int]]] = {
                a: hf_greedy(ckpt, prompts, MAX_TOKENS, adapters[a] if a else None)
                for a in (None, *ADAPTERS)
            }
            for a in ADAPTERS:
                assert by_adapter[a] != by_adapter[None], f"adapter {a} must change the output"
            # Every prompt under every adapter and the base model, interleaved.
            order = [(i, a) for i in range(len(prompts)) for a in (None, *ADAPTERS)]
            cache[name] = (
                ckpt,
                adapters,
                [prompts[i] for i, _ in order],
                [a for _, a in order],
                [by_adapter[a][i] for i, a in order],
            )
        return cache[name]

    return get


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mixed_batch_matches_peft(name: str, setup: str, reference) -> None:  # type: ignore[no-untyped-def]
    ckpt, adapters, prompts, which, expected = reference(name)
    llm = LLM(
        str(ckpt),
        dtype="float32",
        device=TEST_DEVICE,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=64,
        max_cpu_loras=1,
        **SETUPS[setup],  # type: ignore[arg-type]
    )
    loras = {a: LoRARequest(a, str(path)) for a, path in adapters.items()}
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        lora_request=[loras[a] if a else None for a in which],
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    if setup == "preempt":
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if setup == "chunked-prefill":
        assert max(len(p) for p in prompts) > 24, "some prompt was meant to be chunked"
    assert stats.kv_cache_usage == 0.0
    assert llm.engine.lora is not None and llm.engine.lora.slots.pins == [0, 0]


def test_single_adapter_batch_matches_peft(reference) -> None:  # type: ignore[no-untyped-def]
    """Every token under one adapter (the batch's no-gather path)."""
    ckpt, adapters, prompts, which, expected = reference("llama")
    picked = [i for i, a in enumerate(which) if a == "all-r64"]
    llm = LLM(str(ckpt), dtype="float32", device=TEST_DEVICE, enable_lora=True, max_lora_rank=64)
    outs = llm.generate(
        [prompts[i] for i in picked],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        lora_request=LoRARequest("all-r64", str(Path(adapters["all-r64"]))),
    )
    assert [o.outputs[0].token_ids for o in outs] == [expected[i] for i in picked]
