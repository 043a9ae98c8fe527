"""A chat without ``max_tokens`` is held to the model's ceiling, and reserved against its
tenant's tokens-per-minute budget at what it may really generate, so a burst of them
cannot spend several times the budget. One replica with a short context (128 tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.gateway.keys import hash_key
from kvserve.gateway.ratelimit import Usage
from tests.support.gateway import Gateway, keys_file, start_gateway
from tests.support.replicas import REPLICA_MODEL, Replica, start_replicas
from tests.support.waiting import wait_until

CONTEXT = 128
KEY_BUDGET = "sk-test-token-budget"
TOKENS_PER_MINUTE = 1000
BURST = 12  # chats sent at once: together they could use ~1,400 tokens
CHAT = {
    "model": REPLICA_MODEL,
    "messages": [{"role": "user", "content": "tell me everything"}],
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def short_replica(model_dir: Path) -> Iterator[Replica]:
    (rep,) = start_replicas(model_dir, 1, "--max-model-len", str(CONTEXT))
    yield rep
    rep.stop()


def gateway_for(replica: Replica, ceiling: int | None) -> Gateway:
    budget = {
        "tenant": "budget",
        "sha256": hash_key(KEY_BUDGET),
        "models": ["*"],
        "limits": {"tokens_per_minute": TOKENS_PER_MINUTE},
    }
    gw = start_gateway([replica], keys_file(extra=(budget,)), max_tokens_ceiling=ceiling)
    # The replicas' context reaches the gateway with the first load poll.
    wait_until(lambda: gw.state.fleet.max_model_len(REPLICA_MODEL) == CONTEXT, timeout=30)
    return gw


def test_a_chat_without_max_tokens_stops_at_the_ceiling(short_replica: Replica) -> None:
    gw = gateway_for(short_replica, ceiling=20)
    try:
        with gw.client() as c:
            r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 20
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        gw.stop()


def test_a_burst_of_chats_without_max_tokens_stays_within_the_budget(
    short_replica: Replica,
) -> None:
    gw = gateway_for(short_replica, ceiling=None)  # the context is the only bound
    try:

        def chat(_: int) -> httpx.Response:
            return httpx.post(
                f"{gw.url}/v1/chat/completions",
                json=CHAT,
                headers={"authorization": f"Bearer {KEY_BUDGET}"},
                timeout=120,
            )

        with ThreadPoolExecutor(max_workers=BURST) as pool:
            answers = list(pool.map(chat, range(BURST)))
    finally:
        gw.stop()
    assert {r.status_code for r in answers} <= {200, 429}
    used = [r.json()["usage"]["total_tokens"] for r in answers if r.status_code == 200]
    assert used and 429 in {r.status_code for r in answers}
    # The clock is frozen (no refill): what was admitted fits the budget, give or take
    # the prompt estimate of the last admitted request.
    assert sum(used) <= TOKENS_PER_MINUTE + max(used), used


def test_a_stream_left_after_its_first_chunk_is_charged_its_prompt_in_tokens(
    short_replica: Replica,
) -> None:
    """A request that ends before its usage came (the client left) is charged the prompt
    tokens its replica counted, which its first delta carries, not the gateway's estimate
    of a token per 4 characters: a client that leaves early would otherwise pay a quarter
    of a byte-level prompt."""
    gw = gateway_for(short_replica, ceiling=None)
    prompt, max_tokens = "x " * 40, 16
    body = {"model": REPLICA_MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    try:
        with gw.client() as c:  # another tenant, unlimited
            answer = c.post("/v1/completions", json={**body, "max_tokens": 1})
        counted = answer.json()["usage"]["prompt_tokens"]
        assert counted > len(prompt) // 4 + max_tokens  # the estimate would show
        headers = {"authorization": f"Bearer {KEY_BUDGET}"}
        streamed = {**body, "max_tokens": max_tokens, "stream": True}
        with (
            httpx.Client(base_url=gw.url, headers=headers, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=streamed) as r,
        ):
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
        # Settled when the gateway ends the request (the clock is frozen: no refill).
        wait_until(lambda: _usage(gw).in_flight == 0, timeout=30)
        charged = TOKENS_PER_MINUTE - (_usage(gw).tokens_available or 0)
        assert counted <= charged <= counted + max_tokens, (counted, charged)
    finally:
        gw.stop()


def _usage(gw: Gateway) -> Usage:
    usage = gw.state.limiter.usage("budget")
    assert usage is not None
    return usage
