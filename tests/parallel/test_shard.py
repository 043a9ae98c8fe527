"""The sharding rules (kvserve.parallel.shard) and the launch placement: pure code."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.model.config import ModelConfig
from kvserve.parallel.launch import DEFAULT_MASTER_PORT, Launch
from kvserve.parallel.shard import (
    TensorShard,
    check_shardable,
    local_config,
    rank_num_params,
    vocab_rows,
)


def config(heads: int = 32, kv: int = 8, inter: int = 14336, vocab: int = 128256) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=inter,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
    )


def test_heads_kv_heads_and_intermediate_split_evenly() -> None:
    local = local_config(config(), 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8, 2, 3584)
    assert local.kv_bytes_per_token(2) * 4 == config().kv_bytes_per_token(2)


def test_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    c = config(heads=8, kv=2)
    shards = [TensorShard(r, 8) for r in range(8)]
    # Each rank's one query head belongs to KV group head // 4: it stores that KV head.
    assert [list(s.kv_heads(c)) for s in shards] == [[0]] * 4 + [[1]] * 4
    assert [list(s.heads(c)) for s in shards] == [[r] for r in range(8)]
    assert local_config(c, 8).num_kv_heads == 1


def test_vocabulary_rows_cover_every_token_once() -> None:
    c = config(vocab=1001)
    assert vocab_rows(1001, 4) == 251
    ranges = [TensorShard(r, 4).vocab(c) for r in range(4)]
    assert [t for r in ranges for t in r] == list(range(1001))
    assert len(ranges[-1]) == 248  # the last rank's rows past the vocabulary are padding


def test_rank_params_add_up_to_the_model_plus_replicated_parts() -> None:
    c = dataclasses.replace(config(), o_bias=True)
    tp = 4
    replicated = c.num_layers * (2 * c.hidden_size + c.hidden_size) + c.hidden_size
    # norms (2 per layer + final) and the o_proj bias live on every rank
    assert tp * rank_num_params(c, tp) == c.num_params() + (tp - 1) * replicated


@pytest.mark.parametrize(
    ("heads", "kv", "inter", "tp", "named"),
    [
        (32, 8, 14336, 3, "num_attention_heads=32 is not divisible by 3"),
        (32, 6, 14336, 4, "num_key_value_heads=6 is not divisible by 4"),
        (32, 4, 14008, 16, "intermediate_size=14008 is not divisible by 16"),
        (24, 8, 12288, 12, "multiple of 8"),
    ],
)
def test_an_unshardable_model_is_refused_with_its_numbers(
    heads: int, kv: int, inter: int, tp: int, named: str
) -> None:
    with pytest.raises(ValueError, match="cannot shard") as info:
        check_shardable(config(heads, kv, inter), tp)
    assert named in str(info.value)


def test_launch_comes_from_flags_then_leaderworkerset_env() -> None:
    env = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "m-0.m"}
    lws = Launch.resolve(env=env)
    assert lws == Launch(2, 1, "m-0.m", DEFAULT_MASTER_PORT)
    assert lws.node_ranks(4) == range(2, 4)
    flags = Launch.resolve(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=7, env=env)
    assert flags == Launch(2, 0, "10.0.0.1", 7)
    assert Launch.resolve(env={}) == Launch()
    with pytest.raises(ValueError, match="multiple of it"):
        lws.node_ranks(3)
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX='x'"):
        Launch.resolve(env={"LWS_WORKER_INDEX": "x"})
    with pytest.raises(ValueError, match="--node-rank must be in"):
        Launch.resolve(nnodes=2, node_rank=2, env={})
