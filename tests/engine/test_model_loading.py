"""Loading checkpoints: layouts, refusals with clear messages."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.config import UnsupportedModelError
from kvserve.testing.checkpoints import build_random_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    single = checkpoint_dir("llama")
    sharded = build_random_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompts = ["the cache keeps", "hello"]
    a = LLM(str(single), dtype="float32", device="cpu").generate(prompts, GREEDY)
    b = LLM(str(sharded), dtype="float32", device="cpu").generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"kv_lora_rank": 512}, "multi-head latent attention"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "hybrid attention layers"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    tmp_path: Path, checkpoint_dir, changes, message
) -> None:  # type: ignore[no-untyped-def]
    path = _edit_config(checkpoint_dir("llama"), tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(path), dtype="float32", device="cpu")


def test_mistral_with_sliding_window_is_refused(tmp_path: Path, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = _edit_config(checkpoint_dir("mistral"), tmp_path / "m", sliding_window=4096)
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        LLM(str(path), dtype="float32", device="cpu")


def test_missing_and_misshaped_weights_are_named(tmp_path: Path, checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = _edit_config(checkpoint_dir("llama"), tmp_path / "layers", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"num_hidden_layers is 3, .* \(the first: layer 2\)"):
        LLM(str(path), dtype="float32", device="cpu")
    path = _edit_config(checkpoint_dir("llama"), tmp_path / "shape", intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape"):
        LLM(str(path), dtype="float32", device="cpu")


def test_a_config_its_weights_do_not_match_is_refused_before_allocating(
    tmp_path: Path, checkpoint_dir
) -> None:  # type: ignore[no-untyped-def]
    """vocab_size 10^12 was a RuntimeError from allocating 512 TB for the whole model,
    before any tensor was compared with the config; a truncated file a SafetensorError;
    a tokenizer.json of the wrong structure a KeyError."""
    path = _edit_config(checkpoint_dir("llama"), tmp_path / "vocab", vocab_size=10**12)
    with pytest.raises(ValueError, match=r"'lm_head\.weight' has shape .* vocab_size"):
        LLM(str(path), dtype="float32", device="cpu")
    path = Path(shutil.copytree(checkpoint_dir("llama"), tmp_path / "truncated"))
    os.truncate(path / "model.safetensors", (path / "model.safetensors").stat().st_size - 8)
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: "):
        LLM(str(path), dtype="float32", device="cpu")
    path = Path(shutil.copytree(checkpoint_dir("llama"), tmp_path / "tokenizer"))
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    with pytest.raises(ValueError, match=r"tokenizer \(tokenizer\.json.*\) cannot be loaded"):
        LLM(str(path), dtype="float32", device="cpu")


def test_bad_engine_arguments_are_named(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    path = str(checkpoint_dir("llama"))
    with pytest.raises(ValueError, match="block_size must be >= 1 and <= 256, got 0"):
        LLM(path, block_size=0)
    # The Option's bounds (the CRD's and the flag's) hold for LLM too: it took 512.
    with pytest.raises(ValueError, match="block_size must be >= 1 and <= 256, got 512"):
        LLM(path, block_size=512)
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer, got 1\.5"):
        LLM(path, max_num_seqs=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be"):
        LLM(path, dtype="int8")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=1024"):
        LLM(path, max_model_len=4096, device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="max_tokens must be"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be"):
        SamplingParams(top_p=0)


def test_default_dtype_on_cpu_is_bf16_only_where_native(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    from kvserve.config import cpu_has_native_bf16

    llm = LLM(str(checkpoint_dir("llama")), device="auto")
    if llm.engine.device.type == "cpu":
        import torch

        want = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        assert llm.engine.dtype == want
    assert llm.generate(["hi"], GREEDY)[0].outputs[0].finish_reason == "length"
