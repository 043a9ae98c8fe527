"""What a PEFT adapter may be: served ones load, everything else is refused by name."""

from __future__ import annotations

import asyncio
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AdapterUnavailableError, AsyncEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import InvalidRequestError
from kvserve.lora import LoRARequest
from kvserve.lora.adapter import LoRAError, load_adapter, read_config
from kvserve.model.config import ModelConfig
from tests.support.peft_adapters import ALL_LINEAR, build_adapter, edit_config


@pytest.fixture(scope="module")
def base(checkpoint_dir) -> Path:  # type: ignore[no-untyped-def]
    return checkpoint_dir("llama")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def good(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(base, tmp_path_factory.mktemp("good"), r=8, targets=ALL_LINEAR)


def copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / "adapter"))


def load(path: Path, base: Path, max_rank: int = 16):  # type: ignore[no-untyped-def]
    return load_adapter(LoRARequest("x", str(path)), ModelConfig.from_file(base), max_rank)


def test_a_served_adapter_loads(good: Path, base: Path) -> None:
    weights = load(good, base)
    assert weights.rank == 8 and weights.scaling == 2.0  # lora_alpha 16 / r 8
    assert weights.targets == ALL_LINEAR
    assert len(weights.weights) == 2 * len(ALL_LINEAR)  # two layers


def test_rslora_scales_by_the_root_of_the_rank(good: Path, tmp_path: Path) -> None:
    path = copy(good, tmp_path)
    edit_config(path, use_rslora=True)
    assert read_config(path, 16) == (8, 16 / math.sqrt(8))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "lm_head"),
        ({"target_modules": ["embed_tokens"]}, "embedding or lm_head"),
        ({"target_modules": ["c_attn"]}, "'c_attn'"),
        ({"r": 32}, "max_lora_rank=16"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_refused_configs_name_the_reason(
    good: Path, base: Path, tmp_path: Path, change: dict[str, object], named: str
) -> None:
    path = copy(good, tmp_path)
    edit_config(path, **change)
    with pytest.raises(LoRAError, match=named):
        load(path, base)


@pytest.mark.parametrize(
    ("extra_key", "named"),
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding or lm_head"),
        ("base_model.model.lm_head.lora_A.weight", "embedding or lm_head"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "biases"),
        ("base_model.model.model.layers.0.mlp.fc1.lora_A.weight", "'fc1'"),
        ("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", "2 layers"),
    ],
)
def test_refused_tensors_name_the_reason(
    good: Path, base: Path, tmp_path: Path, extra_key: str, named: str
) -> None:
    path = copy(good, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    any_tensor = next(iter(tensors.values()))
    save_file({**tensors, extra_key: any_tensor.clone()}, path / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=named):
        load(path, base)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_or_alpha_that_are_not_finite_are_refused(
    good: Path, base: Path, tmp_path: Path, bad: float
) -> None:
    """Such an adapter would give NaN to its own requests, and in a batch of several
    adapters (stacked slots) to every other request in the step."""
    path = copy(good, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key][0, 0] = bad
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="NaN or infinity"):
        load(path, base)
    alpha = copy(good, tmp_path / "alpha")
    edit_config(alpha, lora_alpha=bad)
    with pytest.raises(LoRAError, match="lora_alpha must be a finite number"):
        load(alpha, base)


def test_an_adapter_for_another_model_is_refused(
    checkpoint_dir, good: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LoRAError, match="another model"):
        load(good, checkpoint_dir("qwen3"))  # head_dim 32 x 4 heads: other shapes


def test_missing_files_and_pickles_are_refused(good: Path, base: Path, tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match="not a directory"):
        load(tmp_path / "nowhere", base)
    path = copy(good, tmp_path)
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(LoRAError, match="pickle"):
        load(path, base)
    (path / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LoRAError, match=r"adapter_config\.json: JSON nested too deeply to read"):
        load(path, base)
    (path / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match=r"adapter_config\.json"):
        load(path, base)


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated"])
def test_an_unreadable_weights_file_is_refused(
    good: Path, base: Path, tmp_path: Path, damage: str
) -> None:
    """A LoRAError (a 400 from /v1/load_lora_adapter), not safetensors' own error (a 500)."""
    path = copy(good, tmp_path)
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    damaged = {"empty": b"", "garbage": b"\xff" * 64, "truncated": data[: len(data) // 2]}
    weights.write_bytes(damaged[damage])
    with pytest.raises(LoRAError, match="not a readable safetensors file"):
        load(path, base)


def test_adapters_need_enable_lora_and_bad_ones_fail_before_queueing(
    good: Path, base: Path, tmp_path: Path
) -> None:
    params = SamplingParams(max_tokens=2)
    plain = LLM(str(base), dtype="float32", device="cpu")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate("hi", params, lora_request=LoRARequest("good", str(good)))
    llm = LLM(str(base), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    bad = copy(good, tmp_path)
    edit_config(bad, r=16)
    with pytest.raises(LoRAError, match="max_lora_rank=8"):
        llm.generate(["a", "b"], params, lora_request=[None, LoRARequest("bad", str(bad))])
    assert not llm.engine.has_unfinished_requests()
    lora = LoRARequest("good", str(good))
    [out] = llm.generate("hi", params, lora_request=lora)
    assert len(out.outputs[0].token_ids) == 2
    manager = llm.engine.lora
    assert manager is not None and lora in manager.host and manager.slots.resident == [lora]
    llm.engine.remove_lora(lora)  # idle: dropped from host memory and its slot at once
    assert lora not in manager.host and manager.slots.resident == []


def test_vllm_style_lora_requests_are_the_same_adapter(good: Path, base: Path) -> None:
    """vLLM's LoRARequest(name, int_id, path) works as it is (only the import changes):
    the integer id is checked and not used; the adapter is its name, path and generation."""
    ours = LoRARequest("good", str(good))
    for vllm_style in (
        LoRARequest("good", 1, str(good)),
        LoRARequest(lora_name="good", lora_int_id=7, lora_path=str(good)),
    ):
        assert vllm_style == ours and hash(vllm_style) == hash(ours)
    # kvserve's generation (the server's count of loads) makes another adapter.
    reload = LoRARequest("good", str(good), generation=2)
    assert reload != ours and reload.cache_key != ours.cache_key
    assert LoRARequest("good", str(good), generation=0) == ours
    for generation, error in ((-1, "generation must be ≥ 0"), (True, "must be an int")):
        with pytest.raises((TypeError, ValueError), match=error):
            LoRARequest("good", str(good), generation=generation)
    for args, error in (
        (("good", 0, str(good)), "lora_int_id must be ≥ 1"),
        (("good", str(good), "/elsewhere"), "takes (name, path)"),
        (("good",), "needs a lora_path"),
    ):
        with pytest.raises((TypeError, ValueError), match=re.escape(error)):
            LoRARequest(*args)  # type: ignore[arg-type]
    llm = LLM(str(base), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(
        ["hi", "hi"], params, lora_request=[ours, LoRARequest("good", 1, str(good))]
    )
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def one_slot_no_spare(base: Path) -> EngineConfig:
    """One device slot and no idle adapter kept in host memory: an adapter leaves memory
    as soon as another one runs."""
    return EngineConfig(
        model=str(base), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8,
        max_loras=1, max_cpu_loras=0,
    )  # fmt: skip


async def last_output(engine: AsyncEngine, params: SamplingParams, lora: LoRARequest | None) -> Any:
    outputs = engine.stream(engine.make_request("hi", params, lora_request=lora))
    return [out async for out in outputs][-1]


def test_an_adapter_that_cannot_be_read_back_fails_its_request_alone(
    good: Path, base: Path, tmp_path: Path
) -> None:
    """An adapter dropped from host memory is read again from disk, on the engine thread,
    by the next request for it: when that fails, that request fails alone and the engine
    serves on. Any exception there used to end the engine thread, and with it every
    request and the server. The failure is AdapterUnavailableError (the server's files,
    not the client's input: front ends answer 503 so a gateway tries another replica),
    naming the adapter but not the server's path; and the adapter stays unavailable,
    without another read, until it is loaded again."""
    first, second = copy(good, tmp_path / "1"), copy(good, tmp_path / "2")
    params = SamplingParams(max_tokens=2)
    long = SamplingParams(max_tokens=64, ignore_eos=True)
    last = last_output
    config = first / "adapter_config.json"
    intact = config.read_bytes()

    async def main() -> None:
        engine = AsyncEngine(LLMEngine(one_slot_no_spare(base)))
        engine.start()
        try:
            for lora in (LoRARequest("first", str(first)), LoRARequest("second", str(second))):
                await last(engine, params, lora)  # "first" leaves host memory for "second"
            config.write_text("[" * 100_000 + "]" * 100_000)
            base_model = asyncio.ensure_future(last(engine, long, None))
            with pytest.raises(AdapterUnavailableError, match="'first' is unavailable") as e:
                await last(engine, params, LoRARequest("first", str(first)))
            assert str(tmp_path) not in str(e.value)
            assert e.value.lora == LoRARequest("first", str(first))
            assert (await base_model).outputs[0].finish_reason == "length"
            assert (await last(engine, params, None)).finished  # and new ones run
            config.write_bytes(intact)  # not known to be the files first read
            with pytest.raises(AdapterUnavailableError):
                await last(engine, params, LoRARequest("first", str(first)))
            again = LoRARequest("first", str(first), generation=1)  # loaded again
            assert (await last(engine, params, again)).finished
        finally:
            await engine.stop()

    asyncio.run(main())


def test_an_adapter_whose_files_changed_is_not_read_back_under_its_old_identity(
    good: Path, base: Path, tmp_path: Path
) -> None:
    """Read again after it left host memory, an adapter's files must be those it was
    loaded from: its identity (and the prefix cache's KV under it) is the old weights'.
    New files fail the request, by name, until the adapter is loaded again."""
    first, second = copy(good, tmp_path / "1"), copy(good, tmp_path / "2")
    params = SamplingParams(max_tokens=2)

    async def last(engine: AsyncEngine, lora: LoRARequest | None) -> Any:
        return await last_output(engine, params, lora)

    async def main() -> None:
        engine = AsyncEngine(LLMEngine(one_slot_no_spare(base)))
        engine.start()
        try:
            for lora in (LoRARequest("first", str(first)), LoRARequest("second", str(second))):
                await last(engine, lora)  # "first" leaves host memory for "second"
            weights = first / "adapter_model.safetensors"
            save_file({k: t * 2 for k, t in load_file(weights).items()}, weights)
            with pytest.raises(AdapterUnavailableError, match="changed since it was loaded"):
                await last(engine, LoRARequest("first", str(first)))
            assert (await last(engine, None)).finished  # the engine serves on
            again = LoRARequest("first", str(first), generation=1)  # loaded again
            assert (await last(engine, again)).finished
        finally:
            await engine.stop()

    asyncio.run(main())


def test_an_unloaded_identity_is_never_read_again_under_its_old_name(
    good: Path, base: Path, tmp_path: Path
) -> None:
    """The server resolves a request's adapter on its event loop and the engine queues it
    on its own thread, so a request may come for an identity unloaded (or replaced in
    place) meanwhile. Read again then, the folder's new files ran under the old identity,
    whose cached KV holds the old weights; now that request is refused (503 through the
    server, which a gateway retries), and the engine serves the identity again only when
    it is loaded again."""
    folder = copy(good, tmp_path)
    params = SamplingParams(max_tokens=2)

    async def main() -> None:
        engine = AsyncEngine(LLMEngine(one_slot_no_spare(base)))
        engine.start()
        try:
            old = LoRARequest("a", str(folder))
            await engine.call(lambda e: e.add_lora(old))
            assert (await last_output(engine, params, old)).finished
            await engine.call(lambda e: e.remove_lora(old))  # idle: forgotten at once
            weights = folder / "adapter_model.safetensors"
            save_file({k: t * 2 for k, t in load_file(weights).items()}, weights)
            with pytest.raises(AdapterUnavailableError, match="unloaded or replaced"):
                await last_output(engine, params, old)
            assert (await last_output(engine, params, None)).finished  # the engine serves on
            new = LoRARequest("a", str(folder), generation=1)  # the new files, loaded
            await engine.call(lambda e: e.add_lora(new))
            assert (await last_output(engine, params, new)).finished
            await engine.call(lambda e: e.add_lora(old))  # loaded again: served again
            assert (await last_output(engine, params, old)).finished
        finally:
            await engine.stop()

    asyncio.run(main())


def test_an_adapter_with_running_and_waiting_requests_is_listed_as_both(
    good: Path, base: Path
) -> None:
    """vLLM's running_lora_adapters and waiting_lora_adapters (which GIE's endpoint
    picker reads): an adapter is in each list where it has requests."""
    llm = LLM(
        str(base), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8,
        max_num_seqs=2,
    )  # fmt: skip
    engine = llm.engine
    lora = LoRARequest("good", str(good))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [1, 2, 3], params, lora_request=lora)
    stats = engine.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ((), ("good",))
    engine.step()  # two run, two wait
    stats = engine.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (("good",), ("good",))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ((), ())
