"""Integers outside the wire's ranges (engine.proto's int32 and int64 fields) are refused
with the same 400, naming the parameter, by the gateway and by a replica's own HTTP API.
They used to reach the proto builder in the gateway and come back as 500s."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.gateway import Gateway
from tests.support.replicas import REPLICA_MODEL, Replica

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
COMPLETION = {"model": REPLICA_MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": REPLICA_MODEL, "messages": [{"role": "user", "content": "hi"}]}

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"max_tokens": INT32_MAX + 1}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": INT32_MAX + 1}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": INT32_MAX + 1}, "max_completion_tokens"),
    ("/v1/completions", {"top_k": INT32_MAX + 1}, "top_k"),
    ("/v1/completions", {"top_k": -(2**31) - 1}, "top_k"),
    ("/v1/chat/completions", {"top_k": 2**40}, "top_k"),
    ("/v1/completions", {"seed": INT64_MAX + 1}, "seed"),
    ("/v1/completions", {"seed": 2**64 - 1}, "seed"),
    ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {"seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": [INT32_MAX + 1]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 2**40]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
]


@pytest.mark.parametrize(("path", "fields", "param"), CASES)
def test_out_of_range_integers_are_a_400_naming_the_parameter(
    gateway: Gateway, replicas: list[Replica], path: str, fields: dict[str, Any], param: str
) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), **fields}
    through_gateway = httpx.post(gateway.url + path, json=body, headers=gateway.headers)
    direct = httpx.post(replicas[0].http + path, json=body, timeout=60)
    for r in (through_gateway, direct):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_the_edges_of_the_ranges_are_accepted(gateway: Gateway) -> None:
    for fields in ({"seed": INT64_MAX}, {"seed": -(2**63)}, {"top_k": INT32_MAX}):
        r = httpx.post(
            gateway.url + "/v1/completions", json={**COMPLETION, **fields}, headers=gateway.headers
        )
        assert r.status_code == 200, (fields, r.text)
