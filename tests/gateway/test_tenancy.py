"""Per-tenant prefix-cache isolation through the gateway, against a real replica.

One replica, so every request meets the same prefix cache and only the salt decides
whether a prompt's blocks are found: a tenant's repeated prompt is served from its cache,
another tenant's identical prompt is not (no timing signal of what others sent), and
tenants in one sharing group share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.gateway.keys import hash_key
from tests.support.gateway import KEY_A, KEY_B, Gateway, keys_file, start_gateway
from tests.support.replicas import REPLICA_MODEL, Replica

BLOCK_SIZE = 4  # the replicas' --block-size
KEY_C1, KEY_C2 = "sk-test-tenant-c-1", "sk-test-tenant-c-2"  # one tenant, two keys
KEY_P1, KEY_P2 = "sk-test-partner-1", "sk-test-partner-2"  # two tenants, one group

EXTRA_KEYS = (
    {"tenant": "team-c", "sha256": hash_key(KEY_C1), "models": ["*"]},
    {"tenant": "team-c", "sha256": hash_key(KEY_C2), "models": ["*"]},
    *(
        {
            "tenant": f"partner-{i}",
            "sha256": hash_key(key),
            "models": ["*"],
            "share_prefix_cache": "partners",
        }
        for i, key in ((1, KEY_P1), (2, KEY_P2))
    ),
)


@pytest.fixture(scope="module")
def one_replica(shared_replicas: list[Replica]) -> Replica:
    return shared_replicas[0]


@pytest.fixture(scope="module")
def gateway(one_replica: Replica) -> Iterator[Gateway]:
    gw = start_gateway([one_replica], keys_file(models_b=("*",), extra=EXTRA_KEYS))
    yield gw
    gw.stop()


def usage(gw: Gateway, key: str, prompt: str, **extra: Any) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one completion sent with ``key``."""
    body = {"model": REPLICA_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with gw.client(key) as c:
        r = c.post("/v1/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def long_prompt(tag: str) -> str:
    return f"{tag}: the travel desk keeps every booking and every fare for a week. " * 4


def full_blocks(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is computed


def test_another_tenants_identical_prompt_finds_nothing_cached(gateway: Gateway) -> None:
    prompt = long_prompt("isolation")
    n, cached = usage(gateway, KEY_A, prompt)
    assert cached == 0
    assert usage(gateway, KEY_A, prompt) == (n, full_blocks(n))  # A's own blocks
    assert usage(gateway, KEY_B, prompt) == (n, 0)  # B learns nothing of A's prompt
    assert usage(gateway, KEY_B, prompt) == (n, full_blocks(n))  # B's own blocks now


def test_keys_of_one_tenant_share_its_cache(gateway: Gateway) -> None:
    prompt = long_prompt("one tenant")
    n, _ = usage(gateway, KEY_C1, prompt)
    assert usage(gateway, KEY_C2, prompt) == (n, full_blocks(n))


def test_tenants_of_one_sharing_group_share_and_no_one_else(gateway: Gateway) -> None:
    prompt = long_prompt("partners")
    n, _ = usage(gateway, KEY_P1, prompt)
    assert usage(gateway, KEY_P2, prompt) == (n, full_blocks(n))
    assert usage(gateway, KEY_A, prompt) == (n, 0)


def test_a_client_salt_narrows_sharing_within_the_tenant(gateway: Gateway) -> None:
    prompt = long_prompt("client salt")
    n, _ = usage(gateway, KEY_C1, prompt, cache_salt="session-1")
    assert usage(gateway, KEY_C2, prompt, cache_salt="session-1") == (n, full_blocks(n))
    assert usage(gateway, KEY_C2, prompt, cache_salt="session-2") == (n, 0)
    assert usage(gateway, KEY_C2, prompt) == (n, 0)
