"""The gateway end to end: real replica processes, the gateway on loopback, real clients."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import KEY_A, KEY_B, KEY_LIMITED, Gateway, start_gateway, stream_text
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica, start_replicas
from tests.support.waiting import wait_until

GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}
SYSTEM = "You are the travel desk. " * 24  # a shared prefix longer than prefix_chars (512)


def chat_body(user: str, max_tokens: int = 4, system: str = SYSTEM, **kw: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {**GREEDY, "messages": messages, "max_tokens": max_tokens, **kw}


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    """One request on its own connection (safe from many threads at once)."""
    return httpx.post(gw.url + path, json=body, headers=gw.headers, timeout=120)


# ---- the happy path ---------------------------------------------------------------------
def test_answers_match_the_replica_stream_and_whole(
    gateway: Gateway, replicas: list[Replica]
) -> None:
    body = {**GREEDY, "prompt": "the cache keeps keys", "max_tokens": 6}
    direct = httpx.post(f"{replicas[0].http}/v1/completions", json=body, timeout=60).json()
    with gateway.client() as c:
        whole = c.post("/v1/completions", json=body, headers={"x-request-id": "gw-1"})
        text, chunks = stream_text(
            c, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-request-id"] == "gw-1" and whole.json()["id"] == "cmpl-gw-1"
    assert whole.json()["choices"][0]["text"] == direct["choices"][0]["text"] == text
    assert whole.json()["usage"]["completion_tokens"] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "x-ratelimit-limit-requests" not in whole.headers  # team-a has no limits


def test_chat_stream_and_logprobs(gateway: Gateway, replicas: list[Replica]) -> None:
    body = chat_body("hello", 5, logprobs=True, top_logprobs=2)
    direct = httpx.post(f"{replicas[1].http}/v1/chat/completions", json=body, timeout=60).json()
    with gateway.client() as c:
        whole = c.post("/v1/chat/completions", json=body).json()
        text, chunks = stream_text(c, "/v1/chat/completions", body)
    assert whole["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    ours, theirs = whole["choices"][0]["logprobs"], direct["choices"][0]["logprobs"]
    # the same tokens and texts; values equal up to fp32 noise (cache hits change the path)
    assert [e["token"] for e in ours["content"]] == [e["token"] for e in theirs["content"]]
    for a, b in zip(ours["content"], theirs["content"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert len(a["top_logprobs"]) == 2 and a["bytes"] == b["bytes"]
        lps = [t["logprob"] for t in a["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk"


def test_logit_bias_and_repetition_penalty_reach_the_replica(
    gateway: Gateway, replicas: list[Replica]
) -> None:
    body = {**GREEDY, "prompt": "the cache keeps keys", "max_tokens": 12,
            "logit_bias": {"42": 5.5, "7": -100}, "repetition_penalty": 1.7}  # fmt: skip
    direct = httpx.post(f"{replicas[0].http}/v1/completions", json=body, timeout=60).json()
    plain = {k: v for k, v in body.items() if k not in ("logit_bias", "repetition_penalty")}
    with gateway.client() as c:
        via = c.post("/v1/completions", json=body).json()
        unbiased = c.post("/v1/completions", json=plain).json()
        # the replica checks the ids against its vocabulary; the gateway relays its 400
        r = c.post("/v1/completions", json={**body, "logit_bias": {"999999": 1}})
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via["choices"][0]["text"] != unbiased["choices"][0]["text"]
    assert r.status_code == 400 and error_of(r)["param"] == "logit_bias", r.text
    # min_tokens on a chat without max_tokens: the replica resolves the limit
    unlimited = {k: v for k, v in chat_body("hi").items() if k != "max_tokens"}
    with gateway.client() as c:
        chat = c.post("/v1/chat/completions", json={**unlimited, "min_tokens": 20})
        too_many = c.post("/v1/chat/completions", json={**unlimited, "min_tokens": 10**6})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 20, chat.text
    assert too_many.status_code == 400 and error_of(too_many)["param"] == "min_tokens"


def test_vllms_stop_and_special_token_fields_reach_the_replica(
    gateway: Gateway, replicas: list[Replica]
) -> None:
    body = {**GREEDY, "prompt": "the cache keeps keys", "max_tokens": 6,
            "logit_bias": {"42": 100}, "stop_token_ids": [42],
            "include_stop_str_in_output": True, "skip_special_tokens": False}  # fmt: skip
    direct = httpx.post(f"{replicas[0].http}/v1/completions", json=body, timeout=60).json()
    with gateway.client() as c:
        via = c.post("/v1/completions", json=body).json()
    assert via["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"] == "stop"
    assert via["usage"]["completion_tokens"] == 1
    # vLLM's stop_reason: the stop token id, or the stop string, that ended the output.
    assert via["choices"][0]["stop_reason"] == direct["choices"][0]["stop_reason"] == 42
    plain = {**GREEDY, "prompt": "the cache keeps keys", "max_tokens": 12}
    with gateway.client() as c:
        text = c.post("/v1/completions", json=plain).json()["choices"][0]["text"]
        stop = text[5:7]
        whole = c.post("/v1/completions", json={**plain, "stop": [stop]}).json()
        _, chunks = stream_text(c, "/v1/completions", {**plain, "stop": [stop]})
    assert whole["choices"][0]["stop_reason"] == chunks[-1]["choices"][0]["stop_reason"] == stop


def test_streamed_completion_logprobs_join_to_the_whole_answers(gateway: Gateway) -> None:
    body = {**GREEDY, "prompt": "hello", "max_tokens": 8, "logprobs": 1}
    with gateway.client() as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        _, chunks = stream_text(c, "/v1/completions", body)
    offsets = [
        x for e in chunks for x in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])
    ]
    assert len(chunks) > 2 and offsets == whole["text_offset"]
    assert whole["text_offset"] == [sum(map(len, whole["tokens"][:i])) for i in range(8)]


# ---- refusals -----------------------------------------------------------------------------
def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


def test_n_samples_match_the_replica_stream_and_whole(
    gateway: Gateway, replicas: list[Replica]
) -> None:
    """A request for ``n`` samples runs them on one replica: the choices are those the
    replica gives (sample i with seed + i), streamed and whole; the usage counts the
    prompt once and every sample's output. A batch of prompts gets n choices each."""
    body = {"model": MODEL, "prompt": "the cache keeps keys", "max_tokens": 6, "n": 3,
            "seed": 5, "ignore_eos": True}  # fmt: skip
    direct = httpx.post(f"{replicas[0].http}/v1/completions", json=body, timeout=60).json()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0)
    args: dict[str, Any] = {k: v for k, v in body.items() if k != "ignore_eos"}
    args["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**args)
    assert [c.model_dump() for c in whole.choices] == direct["choices"]
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    assert whole.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    texts, finishes, usage = ["", "", ""], ["", "", ""], None
    for chunk in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += c.finish_reason or ""
    assert texts == [c["text"] for c in direct["choices"]]
    assert finishes == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 18

    batch = {**body, "prompt": ["the cache keeps keys", "hello"], "n": 2}
    direct_batch = httpx.post(f"{replicas[1].http}/v1/completions", json=batch).json()
    with gateway.client() as c:
        through = c.post("/v1/completions", json=batch).json()
    assert through["choices"] == direct_batch["choices"] and len(through["choices"]) == 4
    for field in ("prompt_tokens", "completion_tokens"):  # (cache hits may differ)
        assert through["usage"][field] == direct_batch["usage"][field]

    chat = chat_body("hello", 5, n=2, temperature=1, seed=9)
    direct_chat = httpx.post(f"{replicas[0].http}/v1/chat/completions", json=chat).json()
    with gateway.client() as c:
        _, chunks = stream_text(c, "/v1/chat/completions", chat)
    contents, roles = ["", ""], [0, 0]
    for d in (d for chunk in chunks for d in chunk["choices"]):
        contents[d["index"]] += d["delta"].get("content", "")
        roles[d["index"]] += d["delta"].get("role") == "assistant"
    assert contents == [c["message"]["content"] for c in direct_chat["choices"]]
    assert roles == [1, 1]
    # Both choices open first, in index order (what the openai SDK's stream helper needs).
    openings = [chunk["choices"][0] for chunk in chunks[:2]]
    assert [(o["index"], o["delta"]) for o in openings] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]


def test_echo_through_the_gateway_is_the_replicas(
    gateway: Gateway, replicas: list[Replica]
) -> None:
    """``echo`` with ``logprobs`` (lm-evaluation-harness's loglikelihood request): the
    replica sends the prompt, its text and its tokens scored, in the first delta; the
    gateway's answer, whole or streamed, is the one the replica gives directly."""
    body = {**GREEDY, "prompt": [[5, 6, 7, 8, 9], [5, 6, 7]], "max_tokens": 1, "logprobs": 1,
            "echo": True}  # fmt: skip
    direct = httpx.post(f"{replicas[0].http}/v1/completions", json=body, timeout=60).json()
    with gateway.client() as c:
        whole = c.post("/v1/completions", json=body).json()
        _, chunks = stream_text(c, "/v1/completions", body)
        text_only = c.post("/v1/completions", json={**body, "logprobs": None}).json()
    for ours, theirs in zip(whole["choices"], direct["choices"], strict=True):
        assert ours["text"] == theirs["text"]
        assert ours["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        assert ours["logprobs"]["token_logprobs"][0] is None
        assert ours["logprobs"]["token_logprobs"] == pytest.approx(
            theirs["logprobs"]["token_logprobs"], abs=1e-4
        )
        assert ours["logprobs"]["text_offset"] == theirs["logprobs"]["text_offset"]
    assert whole["usage"]["prompt_tokens"] == 8
    streamed: list[dict[str, list[Any]]] = [{"tokens": [], "text_offset": []} for _ in range(2)]
    for chunk in chunks:
        for ch in chunk["choices"]:
            for key, values in streamed[ch["index"]].items():
                values += (ch["logprobs"] or {}).get(key, [])
    assert streamed == [
        {k: ch["logprobs"][k] for k in ("tokens", "text_offset")} for ch in whole["choices"]
    ]
    assert [ch["text"] for ch in text_only["choices"]] == [ch["text"] for ch in whole["choices"]]
    zero = {**body, "max_tokens": 0}  # the prompts alone, scored
    direct_zero = httpx.post(f"{replicas[0].http}/v1/completions", json=zero, timeout=60).json()
    with gateway.client() as c:
        through = c.post("/v1/completions", json=zero).json()
        _, zero_chunks = stream_text(c, "/v1/completions", zero)
    assert [ch["logprobs"]["tokens"] for ch in through["choices"]] == [
        ch["logprobs"]["tokens"] for ch in direct_zero["choices"]
    ]
    assert through["usage"]["completion_tokens"] == 0
    zero_texts, zero_tokens = ["", ""], [[], []]
    for ch in (ch for chunk in zero_chunks for ch in chunk["choices"]):
        zero_texts[ch["index"]] += ch["text"]
        zero_tokens[ch["index"]] += (ch["logprobs"] or {}).get("tokens", [])
    assert zero_texts == [ch["text"] for ch in direct_zero["choices"]]
    assert zero_tokens == [ch["logprobs"]["tokens"] for ch in direct_zero["choices"]]
    with gateway.client() as c:  # no logprobs asked: none shown, though the replica scored
        unscored = c.post("/v1/completions", json={**zero, "logprobs": None}).json()
    assert [ch["logprobs"] for ch in unscored["choices"]] == [None, None]


def test_every_refusal_has_its_status_headers_and_metric(gateway: Gateway) -> None:
    body = {**GREEDY, "prompt": "hi", "max_tokens": 2}
    upstream_errors = gateway.metric("kvserve_gateway_upstream_errors_total")
    with gateway.client(key=None) as anonymous:
        r = anonymous.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert error_of(r)["code"] == "missing_api_key"
    with gateway.client(key="sk-wrong") as wrong:
        r = wrong.post("/v1/completions", json=body)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert "sk-wrong" not in r.text
    with gateway.client(key=KEY_B) as b:
        r = b.post("/v1/completions", json=body)
        assert r.status_code == 403 and error_of(r)["code"] == "model_not_allowed"
    with gateway.client() as c:
        r = c.post("/v1/completions", json={**body, "model": "nope"})
        assert r.status_code == 404 and error_of(r)["param"] == "model"
        r = c.post("/v1/completions", json={**body, "max_tokens": 257})
        assert r.status_code == 400 and "limit of 256" in error_of(r)["message"]
        r = c.post("/v1/completions", json={**body, "prompt": "x" * 20_000})
        assert r.status_code == 413
        r = c.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "JSON" in error_of(r)["message"]
        r = c.post("/v1/completions", json={**body, "prompt": [5] * 2000})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"  # the engine's check
        r = c.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and error_of(r)["param"] == "stream_options"
        r = c.post(
            "/v1/completions",
            content=gzip.compress(json.dumps(body).encode()),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
        assert r.status_code == 415 and error_of(r)["param"] == "content-encoding"
    for reason, n in [("unauthenticated", 2), ("forbidden", 1), ("payload_too_large", 1)]:
        assert gateway.metric("kvserve_gateway_rejections_total", reason=reason) == n
    assert gateway.metric("kvserve_gateway_rejections_total", reason="invalid") >= 4
    # The prompt the replica refused was the client's error, not a failed call to it.
    assert gateway.metric("kvserve_gateway_upstream_errors_total") == upstream_errors


def test_a_lone_surrogate_escape_is_named_in_the_400(gateway: Gateway) -> None:
    """As from the engine server (the same body parser): the 400 names the escape of half
    a UTF-16 pair that stands alone, and where it is."""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800x"}]}' % (
        MODEL.encode()
    )
    with gateway.client() as c:
        r = c.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert r.status_code == 400, r.text
    assert error_of(r)["message"] == (
        "invalid JSON body: lone surrogate \\ud800 at line 1 column 61: a high surrogate "
        "must be followed at once by a low one (\\udc00-\\udfff)"
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_not_sent_as_json_is_refused_415(gateway: Gateway, path: str) -> None:
    """A body the browser of a web page could send to another origin without a preflight
    (text/plain, a form) is not read as JSON; no Content-Type, or a JSON one, is."""
    what = (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body = json.dumps({**GREEDY, **what, "max_tokens": 2}).encode()
    with gateway.client() as c:
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            r = c.post(path, content=body, headers={"content-type": content_type})
            assert r.status_code == 415, r.text
            assert error_of(r)["param"] == "content-type"
            assert repr(content_type) in error_of(r)["message"]
        for json_type in ({}, {"content-type": "application/json; charset=utf-8"}):
            r = c.post(path, content=body, headers=json_type)
            assert r.status_code == 200, r.text


def test_refusals_name_the_parameter_the_client_sent(replicas: list[Replica]) -> None:
    """The replica's refusal of a chat's max_completion_tokens names that field (the
    engine calls every limit max_tokens); the shared checks apply at the gateway too."""
    gw = start_gateway(replicas, max_tokens_ceiling=None)  # the replica's check, not ours
    chat = chat_body("hi", max_tokens=2)
    del chat["max_tokens"]
    try:
        with gw.client() as c:
            r = c.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 10**9})
            assert r.status_code == 400, r.text
            assert error_of(r)["param"] == "max_completion_tokens"
            assert "max_completion_tokens (1000000000)" in error_of(r)["message"]
            assert error_of(r)["code"] == "context_length_exceeded"
            # A chat's prompt is its messages, as OpenAI names it.
            long = chat_body("word " * 2100, max_tokens=2)
            r = c.post("/v1/chat/completions", json=long)
            assert r.status_code == 400, r.text
            assert (error_of(r)["param"], error_of(r)["code"]) == (
                "messages",
                "context_length_exceeded",
            )
            r = c.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})
            assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs", r.text
            nan = json.dumps(chat)[:-1] + ', "temperature": NaN}'
            r = c.post("/v1/chat/completions", content=nan.encode())
            assert r.status_code == 400 and error_of(r)["param"] == "temperature", r.text
            assert "finite number" in error_of(r)["message"]
    finally:
        gw.stop()


def test_rate_limits_answer_429_with_headers_and_recover_on_the_clock(gateway: Gateway) -> None:
    body = {**GREEDY, "prompt": "hi", "max_tokens": 2}
    with gateway.client(key=KEY_LIMITED) as c:
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert c.post("/v1/completions", json=body).status_code == 200
        over = c.post("/v1/completions", json=body)
        assert over.status_code == 429, over.text
        assert int(over.headers["retry-after"]) >= 1
        assert over.headers["x-ratelimit-remaining-requests"] == "0"
        assert error_of(over)["type"] == "rate_limit_error"
        gateway.clock.now += 30  # one request's worth of refill at 2/minute
        assert c.post("/v1/completions", json=body).status_code == 200
        gateway.clock.now += 60
        big = c.post("/v1/completions", json={**body, "max_tokens": 256, "prompt": "x" * 800})
        assert big.status_code == 400 and "tokens per minute" in error_of(big)["message"]
    assert gateway.metric("kvserve_gateway_rejections_total", reason="rate_limited_requests") == 1
    assert gateway.metric("kvserve_gateway_rejections_total", reason="rate_limited_tokens") == 1


# ---- routing -------------------------------------------------------------------------------
def cached_tokens(gw: Gateway, n: int, system: str) -> int:
    total = 0
    with gw.client() as c:
        for i in range(n):
            r = c.post("/v1/chat/completions", json=chat_body(f"question {i}", 2, system))
            assert r.status_code == 200, r.text
            total += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return total


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(replicas: list[Replica]) -> None:
    prefix = start_gateway(replicas)
    try:
        # each run has its own system prompt: the replicas' caches outlive a gateway
        cached = cached_tokens(prefix, 8, "Prefix run. " + SYSTEM)
        per_replica = [
            prefix.metric(
                "kvserve_gateway_routing_decisions_total",
                model=MODEL,
                policy="prefix",
                replica=f"127.0.0.1:{r.grpc_port}",
            )
            for r in replicas
        ]
    finally:
        prefix.stop()
    assert sorted(per_replica) == [0, 8]  # all on the prefix's home replica
    rr = start_gateway(replicas, routing={"policy": "round_robin"})
    try:
        rr_cached = cached_tokens(rr, 8, "Round-robin run. " + SYSTEM)
        spread = [
            rr.metric("kvserve_gateway_routing_decisions_total", replica=f"127.0.0.1:{r.grpc_port}")
            for r in replicas
        ]
    finally:
        rr.stop()
    assert spread == [4, 4]
    assert cached > 0 and rr_cached < cached


def test_a_hot_prefix_spills_over_the_load_bound(replicas: list[Replica]) -> None:
    gw = start_gateway(replicas, max_in_flight=8, routing={"load_factor": 1.25})
    try:
        body = chat_body("same question", 64)
        with ThreadPoolExecutor(6) as pool:
            codes = list(
                pool.map(lambda _: post(gw, "/v1/chat/completions", body).status_code, range(6))
            )
        assert codes == [200] * 6
        assert gw.metric("kvserve_gateway_routing_overrides_total") > 0
        used = [
            gw.metric("kvserve_gateway_routing_decisions_total", replica=f"127.0.0.1:{r.grpc_port}")
            for r in replicas
        ]
        assert all(u > 0 for u in used), used
    finally:
        gw.stop()


# ---- cancellation and overload ---------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_aborts_on_the_replica(
    gateway: Gateway, replicas: list[Replica], n: int
) -> None:
    """... every sample of it, when it asked for several."""
    before = [
        r.metric("kvserve_requests_finished_total", finished_reason="abort") for r in replicas
    ]
    body = {**GREEDY, "prompt": "long answer", "max_tokens": 256, "stream": True, "n": n}
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(json.dumps(body))}\r\n\r\n"
        f"{json.dumps(body)}"
    )
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request.encode())
        received = b""
        while received.count(b"data: ") < 3:  # mid-stream
            data = sock.recv(4096)
            assert data, f"the gateway closed the stream early: {received!r}"
            received += data

    # the socket is closed: the gateway cancels the call, the replica aborts the request
    def aborted() -> bool:
        now = [
            r.metric("kvserve_requests_finished_total", finished_reason="abort") for r in replicas
        ]
        return sum(now) == sum(before) + n

    wait_until(aborted, timeout=30)
    wait_until(lambda: all(r.metric("kvserve_num_requests_running") == 0 for r in replicas))
    wait_until(lambda: gateway.metric("kvserve_gateway_client_disconnects_total") == 1)
    assert gateway.state.fleet.slots.total == 0


def test_overload_turns_into_fast_rejections_and_admitted_requests_complete(
    replicas: list[Replica],
) -> None:
    gw = start_gateway(
        replicas, max_in_flight=2, admission={"queue_size": 2, "queue_timeout_seconds": 60}
    )
    try:
        body = {**GREEDY, "prompt": "busy", "max_tokens": 48}
        with ThreadPoolExecutor(18) as pool:
            results = list(pool.map(lambda _: post(gw, "/v1/completions", body), range(18)))
        codes = sorted(r.status_code for r in results)
        admitted = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code == 503]
        assert set(codes) <= {200, 503}, codes
        assert len(admitted) >= 6 and refused, codes  # 4 slots + 2 queued at least
        assert all(r.json()["usage"]["completion_tokens"] == 48 for r in admitted)
        assert all(r.headers["retry-after"] == "60" for r in refused)
        assert gw.metric("kvserve_gateway_rejections_total", reason="queue_full") == len(refused)
    finally:
        gw.stop()


# ---- failover -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_dead_replica_is_routed_around_and_shows_in_metrics(model_dir: Any) -> None:
    reps = start_replicas(model_dir, 2)
    gw = start_gateway(reps, routing={"policy": "round_robin"})
    try:
        reps[0].stop()
        body = {**GREEDY, "prompt": "still there?", "max_tokens": 2}
        with gw.client() as c:
            codes = [c.post("/v1/completions", json=body).status_code for _ in range(6)]
        assert codes == [200] * 6
        wait_until(
            lambda: gw.metric("kvserve_gateway_replicas", model="tiny", state="unhealthy") == 1
        )
        assert gw.metric("kvserve_gateway_replicas", model="tiny", state="healthy") == 1
    finally:
        gw.stop()
        for rep in reps:
            rep.stop()


@pytest.mark.slow
def test_a_replica_dying_mid_stream_ends_its_streams_with_an_error_and_the_rest_carry_on(
    model_dir: Any,
) -> None:
    reps = start_replicas(model_dir, 2)
    gw = start_gateway(reps, routing={"policy": "round_robin"})
    n = 4  # round-robin: two streams on each replica
    started = [threading.Event() for _ in range(n)]
    ends: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    done_flags = [False] * n

    def stream(i: int) -> None:
        body = {**GREEDY, "prompt": f"stream {i}", "max_tokens": 200, "stream": True}
        with gw.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done_flags[i] = True
                elif line.startswith("data: "):
                    event = json.loads(line[len("data: ") :])
                    chunks += 1
                    if chunks == 2:
                        started[i].set()
                    if "error" in event or event["choices"][0]["finish_reason"] is not None:
                        ends[i].append(event)

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(stream, i) for i in range(n)]
            for event in started:
                assert event.wait(timeout=60), "a stream never started"
            reps[0].stop()  # killed while all four are streaming
            for f in futures:
                f.result(timeout=120)
        assert all(done_flags)  # every stream ended properly, none hung
        errors = [e for end in ends for e in end if "error" in e]
        finished = [e for end in ends for e in end if "error" not in e]
        assert len(errors) == 2 and len(finished) == 2, ends
        assert all("the replica failed" in e["error"]["message"] for e in errors)
        assert all(e["error"]["request_id"] for e in errors)  # as in every error body
        assert all(e["choices"][0]["finish_reason"] == "length" for e in finished)
        # New requests go to the replica that is left.
        ok = post(gw, "/v1/completions", {**GREEDY, "prompt": "after", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        wait_until(lambda: gw.state.fleet.slots.total == 0)
        assert gw.metric("kvserve_gateway_requests_total", model=MODEL, status="502") == 2
    finally:
        gw.stop()
        for rep in reps:
            rep.stop()


def test_models_lists_what_the_key_may_use(gateway: Gateway) -> None:
    with gateway.client() as c:
        listed = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [MODEL]
        assert 0 <= time.time() - listed[0]["created"] < 24 * 3600  # the gateway's start
    with gateway.client(key=KEY_B) as b:
        assert b.get("/v1/models").json()["data"] == []
        # A model the key may not use is as unknown as one that does not exist.
        assert b.get(f"/v1/models/{MODEL}").status_code == 404
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY_A, max_retries=0)
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("nope")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong").models.retrieve(MODEL)
    assert httpx.get(f"{gateway.url}/ready").json()["replicas"] == {MODEL: 2}
    for probe in ("/health", "/ready"):  # load balancers probe with HEAD too
        assert httpx.head(f"{gateway.url}{probe}").status_code == 200
    assert KEY_A not in httpx.get(f"{gateway.url}/metrics").text


# ---- the command ------------------------------------------------------------------------------
def test_the_gateway_command_fails_fast_on_a_bad_config_and_serves_a_good_one(
    tmp_path: Any, replicas: list[Replica]
) -> None:
    import subprocess
    import sys

    from kvserve.gateway.keys import hash_key
    from tests.support.net import free_port

    (tmp_path / "keys.yaml").write_text(
        f'keys:\n  - tenant: a\n    sha256: "{hash_key(KEY_A)}"\n    models: ["*"]\n'
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(f'models:\n  {MODEL}:\n    replicas: ["http://nope:1"]\nkeys_file: keys.yaml\n')
    kvserve = [sys.executable, "-m", "kvserve", "gateway"]
    out = subprocess.run(
        [*kvserve, "--config", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and f"models.{MODEL}.replicas[0]" in out.stderr, out.stderr

    port = free_port()
    good = tmp_path / "gateway.yaml"
    good.write_text(
        f"listen: {{port: {port}}}\nmodels:\n  {MODEL}:\n    replicas: ['{replicas[0].grpc_url}']\n"
        "keys_file: keys.yaml\n"
    )
    proc = subprocess.Popen([*kvserve, "--config", str(good), "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/ready").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, timeout=120)
        r = httpx.post(
            f"{url}/v1/completions",
            json={**GREEDY, "prompt": "hi", "max_tokens": 2},
            headers={"authorization": f"Bearer {KEY_A}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_changed_keys_file_is_applied_without_a_restart(
    tmp_path: Any, replicas: list[Replica]
) -> None:
    from kvserve.gateway.keys import hash_key
    from kvserve.gateway.watch import ConfigWatcher
    from tests.support.gateway import serve_gateway

    keys = tmp_path / "keys.yaml"
    entry = '  - tenant: {t}\n    sha256: "{d}"\n    models: ["*"]\n'
    keys.write_text("keys:\n" + entry.format(t="a", d=hash_key(KEY_A)))
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"models:\n  {MODEL}:\n    replicas: ['{replicas[0].grpc_url}']\n"
        "keys_file: keys.yaml\nreload_poll_seconds: 0.1\n"
    )
    watcher = ConfigWatcher(config)
    gw = serve_gateway(watcher.config, watcher.keys, watcher)
    body = {**GREEDY, "prompt": "hi", "max_tokens": 2}
    try:
        assert post_as(gw, KEY_B, body).status_code == 401
        # A broken file is reported and ignored: the old keys stay in force.
        keys.write_text("keys: [")
        assert post_as(gw, KEY_A, body).status_code == 200
        keys.write_text(
            "keys:\n"
            + entry.format(t="a", d=hash_key(KEY_A))
            + entry.format(t="b", d=hash_key(KEY_B))
        )
        wait_until(lambda: post_as(gw, KEY_B, body).status_code == 200, timeout=30)
        # A's request whose head came before A's key was revoked, and its body after: the
        # key is checked again once the body is read (a slow body used to keep it alive).
        head_sent, released = threading.Event(), threading.Event()

        def slow_body() -> Iterator[bytes]:
            text = json.dumps(body).encode()
            yield text[:5]
            head_sent.set()  # asked for more: the head and the first part are out
            released.wait(60)
            yield text[5:]

        with ThreadPoolExecutor(1) as pool:
            late = pool.submit(
                httpx.post,
                gw.url + "/v1/completions",
                content=slow_body(),
                headers={"authorization": f"Bearer {KEY_A}", "content-type": "application/json"},
                timeout=60,
            )
            assert head_sent.wait(60)
            keys.write_text("keys:\n" + entry.format(t="b", d=hash_key(KEY_B)))
            wait_until(lambda: post_as(gw, KEY_A, body).status_code == 401, timeout=30)
            released.set()
            assert late.result().status_code == 401, late.result().text
    finally:
        gw.stop()


def post_as(gw: Gateway, key: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=60)
