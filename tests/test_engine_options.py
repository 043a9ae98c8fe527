"""One engine-config schema: ``EngineConfig``'s fields drive ``LLM(**kwargs)``, the
``kvserve serve`` flags, the operator's flags and the CRD's ``engine`` block."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve import engine_options
from kvserve.config import EngineConfig
from kvserve.llm import LLM
from kvserve.server.main import add_arguments


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_generated_files_are_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_options.main(["--check"]) == 0, capsys.readouterr().err


def test_a_misspelt_llm_argument_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="'blok_size'; did you mean 'block_size'"):
        LLM("unused", blok_size=4)  # type: ignore[call-arg]


def test_serve_flags_default_to_the_engine_defaults() -> None:
    args = serve_parser().parse_args([])
    parsed = engine_options.config_from_args(args, model="m")
    assert parsed == EngineConfig(model="m")


def test_serve_flags_set_each_field() -> None:
    argv = ["--block-size", "8", "--max-num-seqs", "3", "--no-prefix-caching", "--seed", "7"]
    argv += ["--gpu-memory-utilization", "0.5", "--dtype", "float32", "--max-model-len", "99"]
    config = engine_options.config_from_args(serve_parser().parse_args(argv), model="m")
    assert (config.block_size, config.max_num_seqs, config.enable_prefix_caching) == (8, 3, False)
    assert (config.seed, config.gpu_memory_utilization) == (7, 0.5)
    assert (config.dtype, config.max_model_len) == ("float32", 99)


def test_every_field_but_the_test_mode_has_a_flag() -> None:
    flagless = {o.name for o in engine_options.engine_options() if o.option.flag is None}
    assert flagless == {"recompute_every_step"}
    assert {f.name for f in dataclasses.fields(EngineConfig)} == {
        o.name for o in engine_options.engine_options()
    }


def test_a_spec_engine_block_round_trips_through_the_serve_flags() -> None:
    spec = {"blockSize": 8, "enablePrefixCaching": False, "kvCacheMemoryFraction": 0.5}
    flags = engine_options.flags_from_spec(spec)
    config = engine_options.config_from_args(serve_parser().parse_args(flags), model="m")
    assert (config.block_size, config.enable_prefix_caching) == (8, False)
    assert config.gpu_memory_utilization == 0.5
    assert config.max_num_seqs == EngineConfig(model="m").max_num_seqs  # left at the default
    defaults = engine_options.flags_from_spec({})
    assert "--no-prefix-caching" not in defaults and "--max-model-len" not in defaults
    assert defaults[defaults.index("--block-size") + 1] == "16"


def test_the_crd_properties_are_the_options_with_a_crd_name() -> None:
    props = engine_options.crd_properties()
    assert list(props) == [
        "dtype",
        "quantization",
        "kvCacheDtype",
        "blockSize",
        "maxNumSeqs",
        "maxNumBatchedTokens",
        "maxModelLen",
        "kvCacheMemoryFraction",
        "enablePrefixCaching",
        "tensorParallelSize",
    ]
    assert props["blockSize"] == {
        "type": "integer",
        "format": "int32",
        "minimum": 1,
        "maximum": 256,
        "default": 16,
        "description": "Tokens per KV-cache block (--block-size).",
    }
    assert props["dtype"]["enum"] == ["auto", "float32", "bfloat16", "float16"]  # no aliases
    assert props["quantization"]["enum"] == ["int8"]
    assert "default" not in props["quantization"]  # none: the weights stay in dtype
    assert props["kvCacheDtype"]["enum"] == ["auto", "fp8_e4m3", "fp8_e5m2"]  # no fp8 alias
    assert props["kvCacheMemoryFraction"]["exclusiveMinimum"] is True
    assert "--model" in engine_options.operator_owned_flags()
