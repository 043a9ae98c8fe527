"""Clients' ``x-request-id``s through the gateway: echoed and carried to the replica, but
never a key, so clients that happen to pick the same id all get their own answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.gateway import Gateway
from tests.support.replicas import REPLICA_MODEL

PROMPTS = [f"request number {i}: the cache keeps keys" for i in range(6)]


def complete(gw: Gateway, prompt: str, rid: str) -> httpx.Response:
    body = {"model": REPLICA_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body["ignore_eos"] = True
    return httpx.post(
        f"{gw.url}/v1/completions",
        json=body,
        headers={**gw.headers, "x-request-id": rid},
        timeout=120,
    )


def test_concurrent_requests_with_one_id_all_get_their_own_answer(gateway: Gateway) -> None:
    expected = []
    for i, prompt in enumerate(PROMPTS):
        r = complete(gateway, prompt, f"unique-{i}")
        assert r.status_code == 200, r.text
        expected.append(r.json()["choices"][0]["text"])
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: complete(gateway, p, "shared-id"), PROMPTS))
    for r, text in zip(results, expected, strict=True):
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "shared-id"
        assert r.json()["choices"][0]["text"] == text
        assert r.json()["usage"]["completion_tokens"] == 8
