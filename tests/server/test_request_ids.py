"""The engine names requests itself; the client's ``x-request-id`` is only echoed, logged
and traced. Clients choose their ids, so they collide: at the same time, and when a
client that timed out retries with the same id while the engine still aborts the first
request. Neither may fail a request or hand it another request's output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.support.engine_server import SERVED_MODEL as MODEL
from tests.support.engine_server import RunningServer

GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}
RETRIES = 100  # disconnect-then-reuse rounds (bounded; each takes ~0.1 s on the tiny model)


def complete(server: RunningServer, rid: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {**GREEDY, "prompt": prompt, "max_tokens": max_tokens}
    with server.client() as c:
        return c.post("/v1/completions", json=body, headers={"x-request-id": rid})


def answer(r: httpx.Response) -> tuple[str, int, str]:
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    return choice["text"], usage["completion_tokens"], choice["finish_reason"]


def test_two_clients_with_one_id_at_the_same_time_both_succeed(server: RunningServer) -> None:
    prompts = {"travel": "the cache keeps keys", "other": "a new token attends"}
    expected = {k: answer(complete(server, f"alone-{k}", p, 12)) for k, p in prompts.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(complete, server, "same-id", p, 12) for k, p in prompts.items()}
        results = {k: f.result() for k, f in futures.items()}
    for key, r in results.items():
        assert r.headers["x-request-id"] == "same-id"
        assert r.json()["id"] == "cmpl-same-id"
        assert answer(r) == expected[key]


def test_reusing_an_id_right_after_a_disconnect_gets_only_your_own_output(
    server: RunningServer,
) -> None:
    """A retry with the id of a request its client just abandoned (the engine is still
    aborting it) gets exactly its own answer, every time, and never a 5xx."""
    mine = ("a new token attends", 3)
    expected = answer(complete(server, "reference", *mine))
    long_body: dict[str, Any] = {
        **GREEDY,
        "prompt": "the cache keeps keys and values for every token",
        "max_tokens": 400,
        "stream": True,
    }
    with server.client() as c:
        for i in range(RETRIES):
            rid = f"retry-{i}"
            with c.stream(
                "POST", "/v1/completions", json=long_body, headers={"x-request-id": rid}
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                while not next(lines).startswith("data: "):
                    pass  # one chunk arrived: the request is running; now hang up
            retry = c.post(
                "/v1/completions",
                json={**GREEDY, "prompt": mine[0], "max_tokens": mine[1]},
                headers={"x-request-id": rid},
            )
            assert retry.status_code == 200, (i, retry.text)
            assert answer(retry) == expected, i


def test_cache_salt_isolates_the_prefix_cache(server: RunningServer) -> None:
    prompt = "salted prefix: the cache keeps keys and values for every token " * 3
    body = {**GREEDY, "prompt": prompt, "max_tokens": 1}

    def cached(**extra: Any) -> tuple[int, int]:
        with server.client() as c:
            r = c.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    prompt_tokens, first = cached(cache_salt="tenant-a")
    full_blocks = (prompt_tokens - 1) // 4 * 4  # block size 4; the last token is computed
    assert first == 0
    assert cached(cache_salt="tenant-a") == (prompt_tokens, full_blocks)
    assert cached(cache_salt="tenant-b") == (prompt_tokens, 0)  # another salt: no hit
    assert cached() == (prompt_tokens, 0)  # no salt is a namespace of its own


def test_an_empty_cache_salt_is_refused_by_name(server: RunningServer) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json={**GREEDY, "prompt": "x", "cache_salt": ""})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"
