"""Capacity calculator: fixed formulas (docs/architecture.md §3), CLI output, refusals."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve import capacity
from kvserve.model.config import ModelConfig

SERVICE_DIR = Path(__file__).resolve().parents[1] / "service"

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128000,
    "num_hidden_layers": 32,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
LLAMA_8B_PARAMS = 8_028_164_096
LLAMA_8B_KV_BF16 = 131_072
JSON_KEYS = {
    "params",
    "weight_bytes",
    "kv_bytes_per_token",
    "kv_bytes",
    "blocks",
    "slots",
    "decode_lower_bound_ms",
    "max_kv_tokens",
    "tensor_parallel_size",
    "rank_params",
    "rank_weight_bytes",
    "rank_kv_bytes_per_token",
    "rank_kv_bytes",
}


def write_config(tmp_path: Path, cfg: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def calc(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``kvserve calc`` in process through its own argument parser."""
    parser = argparse.ArgumentParser(prog="kvserve calc")
    capacity.add_calc_arguments(parser)
    rc = capacity.run_calc(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def calc_json(
    tmp_path: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str], *extra: str
) -> dict[str, Any]:
    path = write_config(tmp_path, cfg)
    rc, out, err = calc(["--config", str(path), "--json", *extra], capsys)
    assert rc == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


# ---- worked example -----------------------------------------------------------------


def test_llama_8b_worked_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = calc_json(
        tmp_path, LLAMA_8B, capsys, "--bandwidth-gbps", "1000", "--tokens", "17", "31",
        "--block-size", "16",
    )  # fmt: skip
    assert set(r) == JSON_KEYS
    assert r["params"] == LLAMA_8B_PARAMS
    assert r["weight_bytes"] == 2 * LLAMA_8B_PARAMS
    assert r["kv_bytes_per_token"] == LLAMA_8B_KV_BF16
    assert r["kv_bytes"] == LLAMA_8B_KV_BF16 * 48
    assert r["blocks"] == 4
    assert r["slots"] == 64
    # weights + KV of the batch, read once per step
    assert r["decode_lower_bound_ms"] == pytest.approx(
        (2 * LLAMA_8B_PARAMS + 48 * LLAMA_8B_KV_BF16) / 1e12 * 1000
    )
    assert round(r["decode_lower_bound_ms"], 2) == 16.06
    assert r["max_kv_tokens"] is None


def test_decode_bound_weights_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = calc_json(tmp_path, LLAMA_8B, capsys, "--bandwidth-gbps", "1000")
    assert r["decode_lower_bound_ms"] == pytest.approx(2 * LLAMA_8B_PARAMS / 1e9)
    assert r["decode_lower_bound_ms"] == pytest.approx(16.06, abs=0.005)
    assert r["kv_bytes"] == 0 and r["blocks"] == 0 and r["slots"] == 0


def test_json_nulls_when_not_applicable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = calc_json(tmp_path, LLAMA_8B, capsys)
    assert set(r) == JSON_KEYS
    assert r["decode_lower_bound_ms"] is None
    assert r["max_kv_tokens"] is None


def test_table_has_human_and_exact_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    rc, out, err = calc(
        ["--config", str(path), "--tokens", "17", "31", "--bandwidth-gbps", "1000",
         "--memory-gib", "80"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "8.03 B params" in out
    assert "8,028,164,096" in out
    assert "14.95 GiB" in out
    assert "16,056,328,192" in out
    assert "131,072" in out
    assert "16.06 ms" in out
    lines = out.splitlines()
    # aligned: every value starts in the same column
    cols = {len(line) - len(line.split("  ", 1)[1].lstrip()) for line in lines}
    assert len(cols) == 1, out


def test_config_directory_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_config(ckpt, LLAMA_8B)
    rc, out, err = calc(["--config", str(ckpt), "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["params"] == LLAMA_8B_PARAMS


# ---- formula variants -----------------------------------------------------------------


def test_tied_embeddings_counted_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tied = calc_json(tmp_path, {**LLAMA_8B, "tie_word_embeddings": True}, capsys)
    assert tied["params"] == LLAMA_8B_PARAMS - 128000 * 4096


def test_fp8_kv_halves_kv_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bf16 = calc_json(tmp_path, LLAMA_8B, capsys, "--tokens", "100")
    fp8 = calc_json(tmp_path, LLAMA_8B, capsys, "--tokens", "100", "--kv-dtype", "fp8")
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    assert fp8["kv_bytes"] * 2 == bf16["kv_bytes"]
    assert fp8["weight_bytes"] == bf16["weight_bytes"]


def test_fp32_doubles_weights_and_default_kv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bf16 = calc_json(tmp_path, LLAMA_8B, capsys)
    fp32 = calc_json(tmp_path, LLAMA_8B, capsys, "--dtype", "fp32")
    assert fp32["weight_bytes"] == 2 * bf16["weight_bytes"] == 4 * LLAMA_8B_PARAMS
    # --kv-dtype defaults to --dtype
    assert fp32["kv_bytes_per_token"] == 2 * bf16["kv_bytes_per_token"]
    mixed = calc_json(tmp_path, LLAMA_8B, capsys, "--dtype", "fp32", "--kv-dtype", "bf16")
    assert mixed["kv_bytes_per_token"] == LLAMA_8B_KV_BF16


def test_gqa_and_mqa_use_kv_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mha = calc_json(tmp_path, {**LLAMA_8B, "num_key_value_heads": 32}, capsys)
    gqa = calc_json(tmp_path, LLAMA_8B, capsys)
    mqa = calc_json(tmp_path, {**LLAMA_8B, "num_key_value_heads": 1}, capsys)
    assert mqa["kv_bytes_per_token"] == 2 * 32 * 1 * 128 * 2 == 16_384
    assert gqa["kv_bytes_per_token"] == 8 * mqa["kv_bytes_per_token"]
    assert mha["kv_bytes_per_token"] == 32 * mqa["kv_bytes_per_token"]


def test_blocks_round_up_per_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = calc_json(tmp_path, LLAMA_8B, capsys, "--tokens", "1", "16", "17", "--block-size", "16")
    assert r["blocks"] == 1 + 1 + 2
    assert r["slots"] == 64
    r = calc_json(tmp_path, LLAMA_8B, capsys, "--tokens", "17", "31", "--block-size", "1")
    assert r["blocks"] == 48 and r["slots"] == 48


def test_max_kv_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = calc_json(tmp_path, LLAMA_8B, capsys, "--memory-gib", "80")
    assert r["max_kv_tokens"] == (80 * 2**30 - 2 * LLAMA_8B_PARAMS) // LLAMA_8B_KV_BF16
    assert r["max_kv_tokens"] == 532_859
    fp8 = calc_json(tmp_path, LLAMA_8B, capsys, "--memory-gib", "80", "--kv-dtype", "fp8")
    assert fp8["max_kv_tokens"] == (80 * 2**30 - 2 * LLAMA_8B_PARAMS) // (LLAMA_8B_KV_BF16 // 2)


def test_weights_do_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    rc, out, err = calc(["--config", str(path), "--memory-gib", "8"], capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith("kvserve calc: error: ")
    assert "do not fit" in err and "14.95 GiB" in err and "8 GiB" in err


@pytest.mark.parametrize("flag", ["--memory-gib", "--bandwidth-gbps"])
@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_a_memory_or_bandwidth_that_is_not_a_finite_positive_number_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    rc, out, err = calc(["--config", str(path), flag, value], capsys)
    assert (rc, out) == (2, "")
    assert err.startswith("kvserve calc: error: ") and "finite number > 0" in err, err


# ---- tensor parallelism ------------------------------------------------------------------


def test_tp1_rank_figures_are_the_whole_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = calc_json(tmp_path, LLAMA_8B, capsys, "--tokens", "100")
    assert r["tensor_parallel_size"] == 1
    assert r["rank_params"] == r["params"] == LLAMA_8B_PARAMS
    assert r["rank_weight_bytes"] == r["weight_bytes"]
    assert r["rank_kv_bytes_per_token"] == r["kv_bytes_per_token"] == LLAMA_8B_KV_BF16
    assert r["rank_kv_bytes"] == r["kv_bytes"]


def test_tp_splits_weights_and_kv_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = calc_json(tmp_path, LLAMA_8B, capsys, "--tokens", "100")
    r = calc_json(
        tmp_path, LLAMA_8B, capsys, "--tokens", "100", "--tensor-parallel-size", "4",
        "--memory-gib", "20", "--bandwidth-gbps", "1000",
    )  # fmt: skip
    assert r["tensor_parallel_size"] == 4
    # The whole model's figures do not change with the split.
    for key in ("params", "weight_bytes", "kv_bytes_per_token", "kv_bytes", "blocks"):
        assert r[key] == whole[key], key
    # 8 KV heads over 4 ranks: 2 each, a quarter of the KV.
    assert r["rank_kv_bytes_per_token"] == LLAMA_8B_KV_BF16 // 4
    assert r["rank_kv_bytes"] == 100 * LLAMA_8B_KV_BF16 // 4
    # Everything is split except the norms (replicated): a quarter, plus 3/4 of them.
    h, layers = 4096, 32
    norms = (2 * layers + 1) * h
    assert r["rank_params"] == (LLAMA_8B_PARAMS - norms) // 4 + norms
    assert r["rank_weight_bytes"] == 2 * r["rank_params"]
    # --memory-gib is one rank's memory: its weights and its KV.
    assert r["max_kv_tokens"] == (20 * 2**30 - r["rank_weight_bytes"]) // (LLAMA_8B_KV_BF16 // 4)
    per_rank = (r["rank_weight_bytes"] + r["rank_kv_bytes"]) / 1e12 * 1000
    assert r["decode_lower_bound_ms"] == pytest.approx(per_rank)


def test_tp_beyond_kv_heads_replicates_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 16 ranks, 8 KV heads: every rank stores one KV head (each one on two ranks).
    r = calc_json(tmp_path, LLAMA_8B, capsys, "--tensor-parallel-size", "16")
    assert r["rank_kv_bytes_per_token"] == LLAMA_8B_KV_BF16 // 8


def test_tp_table_shows_rank_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    rc, out, err = calc(
        ["--config", str(path), "--tensor-parallel-size", "2", "--memory-gib", "20"], capsys
    )
    assert rc == 0, err
    assert "2 ranks; the figures below are one rank's" in out
    assert "rank weights" in out and "rank KV per token    64.00 KiB (65,536 bytes)" in out
    assert "GiB per rank after weights" in out
    rc, out, err = calc(["--config", str(path)], capsys)
    assert rc == 0 and "rank" not in out


def test_unshardable_tp_refused_with_the_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    rc, out, err = calc(["--config", str(path), "--tensor-parallel-size", "3"], capsys)
    assert (rc, out) == (2, "")
    assert err.startswith("kvserve calc: error: cannot shard LlamaForCausalLM")
    assert "num_attention_heads=32 is not divisible by 3" in err
    assert "intermediate_size=14336 is not divisible by 3" in err
    for bad in ("0", "-2"):
        rc, out, err = calc(["--config", str(path), "--tensor-parallel-size", bad], capsys)
        assert (rc, out) == (2, "") and "tensor_parallel_size must be" in err


def test_weights_of_one_rank_do_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    argv = ["--config", str(path), "--memory-gib", "3", "--tensor-parallel-size", "4"]
    rc, out, err = calc(argv, capsys)
    assert (rc, out) == (2, "")
    assert "one rank's weights (of 4)" in err and "3 GiB" in err
    rc, _, err = calc([*argv[:-1], "8"], capsys)
    assert rc == 0, err


def test_num_kv_blocks() -> None:
    cfg = ModelConfig.from_dict(LLAMA_8B)
    block = LLAMA_8B_KV_BF16 * 16
    assert capacity.num_kv_blocks(cfg, 10 * block, 16, 2) == 10
    assert capacity.num_kv_blocks(cfg, 10 * block + block - 1, 16, 2) == 10
    assert capacity.num_kv_blocks(cfg, block - 1, 16, 2) == 0
    assert capacity.num_kv_blocks(cfg, 10 * block, 16, 1) == 20
    with pytest.raises(ValueError, match="block_size"):
        capacity.num_kv_blocks(cfg, block, 0, 2)


def test_estimate_validates_inputs() -> None:
    cfg = ModelConfig.from_dict(LLAMA_8B)
    with pytest.raises(ValueError, match="block_size"):
        capacity.estimate(cfg, block_size=0)
    with pytest.raises(ValueError, match="tokens"):
        capacity.estimate(cfg, tokens=[5, 0])
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        capacity.estimate(cfg, bandwidth_gbps=0)
    with pytest.raises(ValueError, match="memory_gib"):
        capacity.estimate(cfg, memory_gib=-1)
    with pytest.raises(ValueError, match="fp32"):
        capacity.estimate(cfg, dtype="int4")
    assert capacity.dtype_bytes("bfloat16") == 2
    assert capacity.dtype_bytes("fp8") == 1
    report = capacity.estimate(cfg, tokens=[17, 31])
    assert set(report.to_json_dict()) == JSON_KEYS


def test_invalid_cli_values_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    for extra in (["--tokens", "0"], ["--block-size", "0"], ["--bandwidth-gbps", "-5"]):
        rc, out, err = calc(["--config", str(path), *extra], capsys)
        assert out == ""
        assert rc == 2, extra
        assert err.startswith("kvserve calc: error: ") and "Traceback" not in err


# ---- refusals and bad input -----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"kv_lora_rank": 512, "q_lora_rank": 1536}, "latent attention"),
        ({"num_experts": 64}, "mixture-of-experts"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        (
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
             "sliding_window": 4096},
            "sliding-window",
        ),
        ({"layer_types": ["full_attention", "sliding_attention"] * 16}, "hybrid"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ],
)  # fmt: skip
def test_unsupported_models_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    overrides: dict[str, Any],
    needle: str,
) -> None:
    path = write_config(tmp_path, {**LLAMA_8B, **overrides})
    rc, out, err = calc(["--config", str(path)], capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith("kvserve calc: error: ")
    assert needle in err
    assert "Traceback" not in err


def test_mistral_without_window_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {**LLAMA_8B, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    assert calc_json(tmp_path, cfg, capsys)["params"] == LLAMA_8B_PARAMS


def test_missing_file_and_bad_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = calc(["--config", str(tmp_path / "nope.json")], capsys)
    assert rc == 2 and err.startswith("kvserve calc: error: ")
    assert f"{tmp_path / 'nope.json'}: no such file" in err  # not "no config.json at"
    rc, _, err = calc(["--config", str(tmp_path)], capsys)  # directory without config.json
    assert rc == 2 and f"no config.json in {tmp_path}" in err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    rc, _, err = calc(["--config", str(empty)], capsys)  # it said "architecture None"
    assert rc == 2 and "names no architecture" in err, err
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"model_type": "gpt2"}')
    rc, _, err = calc(["--config", str(unknown)], capsys)
    assert rc == 2 and "model_type 'gpt2' is not supported" in err, err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, _, err = calc(["--config", str(bad)], capsys)
    assert rc == 2 and "not valid JSON" in err and "Traceback" not in err
    listy = write_config(tmp_path, [1, 2], name="list.json")  # type: ignore[arg-type]
    rc, _, err = calc(["--config", str(listy)], capsys)
    assert rc == 2 and err.startswith("kvserve calc: error: ")
    partial = write_config(tmp_path, {"architectures": ["LlamaForCausalLM"]}, "partial.json")
    rc, _, err = calc(["--config", str(partial)], capsys)
    assert rc == 2 and "hidden_size" in err


# ---- the real command line ------------------------------------------------------------


def test_cli_main_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.cli import main

    path = write_config(tmp_path, LLAMA_8B)
    rc = main(["calc", "--config", str(path), "--json", "--tokens", "17", "31",
               "--bandwidth-gbps", "1000"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out)
    assert set(r) == JSON_KEYS
    assert (r["params"], r["blocks"], r["slots"]) == (LLAMA_8B_PARAMS, 4, 64)
    rc = main(["calc", "--config", str(tmp_path / "missing.json")])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("kvserve calc: error: ")


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SERVICE_DIR), env.get("PYTHONPATH", "")) if p
    )
    return env


def test_subprocess_module_entry_point(tmp_path: Path) -> None:
    path = write_config(tmp_path, LLAMA_8B)
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "calc", "--config", str(path), "--json",
         "--tokens", "17", "31", "--block-size", "16", "--bandwidth-gbps", "1000"],
        capture_output=True, text=True, env=_subprocess_env(), timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert set(r) == JSON_KEYS
    assert r["params"] == LLAMA_8B_PARAMS
    assert r["kv_bytes_per_token"] == LLAMA_8B_KV_BF16
    assert (r["blocks"], r["slots"]) == (4, 64)
    assert round(r["decode_lower_bound_ms"], 2) == 16.06

    refused = write_config(tmp_path, {**LLAMA_8B, "num_experts": 8}, "moe.json")
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "calc", "--config", str(refused)],
        capture_output=True, text=True, env=_subprocess_env(), timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("kvserve calc: error: ")
    assert "mixture-of-experts" in proc.stderr and "Traceback" not in proc.stderr


# ---- cross-check parameter counts against transformers --------------------------------

SMALL = {
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("config_cls", "kwargs"),
    [
        ("LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True}),
        ("LlamaConfig", {"tie_word_embeddings": True, "attention_bias": True}),
        ("LlamaConfig", {"tie_word_embeddings": False, "mlp_bias": True}),
        ("MistralConfig", {"sliding_window": None, "tie_word_embeddings": False}),
        ("Qwen2Config", {"tie_word_embeddings": False}),
        ("Qwen2Config", {"tie_word_embeddings": True}),
        ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": False}),
        ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": True, "num_key_value_heads": 1}),
    ],
)
def test_num_params_matches_transformers(config_cls: str, kwargs: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    hf_cfg = getattr(transformers, config_cls)(**{**SMALL, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    expected = sum(p.numel() for p in model.parameters())  # tied weights counted once
    ours = ModelConfig.from_dict(hf_cfg.to_dict())
    assert ours.num_params() == expected
    if "head_dim" in kwargs:
        assert ours.head_dim == kwargs["head_dim"] != SMALL["hidden_size"] // 4
    assert ours.num_kv_heads == kwargs.get("num_key_value_heads", 2)
