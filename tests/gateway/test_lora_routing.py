"""The gateway and LoRA adapters: two real ``kvserve serve --enable-lora`` replicas with
tiny PEFT adapters under their ``--lora-dir``, and a real gateway on 127.0.0.1.

The gateway polls its replicas' load once, at start (``load_poll_seconds`` is an hour):
what it then knows of who serves which adapter changes only by its own doing (the loads
it asks for, the NOT_FOUND it is answered), so each test's routing is deterministic.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from pydantic import ValidationError

from kvserve.gateway.adapters import route_adapter
from kvserve.gateway.config import GatewayConfig
from kvserve.gateway.keys import hash_key
from kvserve.gateway.routing import (
    ConsistentHashRouter,
    LeastLoadRouter,
    ReplicaLoad,
    RouteDecision,
    prefix_key,
)
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from tests.support.gateway import KEY_A, Gateway, keys_file, serve_gateway
from tests.support.peft_adapters import build_adapter
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica, start_replicas
from tests.support.waiting import wait_until

KEY_BASE = "sk-test-base-model-only"  # may use the base model, none of its adapters
KEY_ALPHA = "sk-test-alpha-only"  # may use the adapter "alpha" only
PROMPT = [5, 17, 42, 9, 33, 70, 11]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
DECISIONS = "kvserve_gateway_routing_decisions_total"
LOADS = "kvserve_gateway_lora_loads_total"


@pytest.fixture(scope="module")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``alpha`` .. ``delta``: adapters made by peft for the replicas' checkpoint."""
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(["alpha", "beta", "gamma", "delta"], start=1):
        build_adapter(model_dir, root / name, r=4, seed=seed)
    return root


@pytest.fixture(scope="module")
def lora_replicas(model_dir: Path, lora_dir: Path) -> Iterator[list[Replica]]:
    reps = start_replicas(
        model_dir, 2, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--max-cpu-loras", "4", "--lora-dir", str(lora_dir),
    )  # fmt: skip
    try:
        # Only the first replica serves "alpha" when the gateway starts.
        r = httpx.post(
            f"{reps[0].http}/v1/load_lora_adapter",
            json={"lora_name": "alpha", "lora_path": "alpha"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        yield reps
    finally:
        for rep in reps:
            rep.stop()


@pytest.fixture(scope="module")
def gw(lora_replicas: list[Replica]) -> Iterator[Gateway]:
    config = GatewayConfig.model_validate(
        {
            "models": {
                MODEL: {
                    "replicas": [r.grpc_url for r in lora_replicas],
                    "lora_adapters": ["beta", "gamma", "delta"],
                }
            },
            "keys_file": "unused.yaml",
            "load_poll_seconds": 3600,
        },
        strict=False,
    )
    extra = (
        {"tenant": "base-only", "sha256": hash_key(KEY_BASE), "models": [MODEL]},
        {"tenant": "alpha-only", "sha256": hash_key(KEY_ALPHA), "models": ["alpha"]},
    )
    gateway = serve_gateway(config, keys_file(extra=extra))
    try:
        wait_until(lambda: "alpha" in gateway.state.fleet.adapters(MODEL), timeout=30)
        yield gateway
    finally:
        gateway.stop()


def address(rep: Replica) -> str:
    return f"127.0.0.1:{rep.grpc_port}"


def served_by(rep: Replica) -> set[str]:
    """The model names the replica itself lists."""
    return {m["id"] for m in httpx.get(f"{rep.http}/v1/models", timeout=10).json()["data"]}


def decisions(gw: Gateway, reps: list[Replica]) -> list[float]:
    return [gw.metric(DECISIONS, replica=address(rep)) for rep in reps]


def complete(gw: Gateway, model: str, key: str = KEY_A, prompt: list[int] = PROMPT) -> Any:
    return httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": model, "prompt": prompt, **GREEDY},
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    )


# ---- routing ----------------------------------------------------------------------------
def test_requests_go_to_the_replica_that_serves_the_adapter(
    gw: Gateway, lora_replicas: list[Replica]
) -> None:
    first, second = lora_replicas
    sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_A, max_retries=0)
    before = decisions(gw, lora_replicas)
    texts = []
    for head in range(4):  # different prompts: prefix routing alone would spread them
        out = sdk.completions.create(
            model="alpha",
            prompt=[head, *PROMPT],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.model == "alpha"
        texts.append(out.choices[0].text)
    after = decisions(gw, lora_replicas)
    assert (after[0] - before[0], after[1] - before[1]) == (4, 0)
    assert "alpha" not in served_by(second)  # nothing was loaded anywhere else
    direct = httpx.post(
        f"{first.http}/v1/completions",
        json={"model": "alpha", "prompt": [3, *PROMPT], **GREEDY},
        timeout=60,
    ).json()
    assert texts[3] == direct["choices"][0]["text"]
    base = complete(gw, MODEL, prompt=[3, *PROMPT]).json()["choices"][0]["text"]
    assert base != texts[3], "the adapter must change the answer"


def test_an_adapter_no_replica_serves_is_loaded_on_the_least_loaded(
    gw: Gateway, lora_replicas: list[Replica]
) -> None:
    first, second = lora_replicas
    loads = gw.metric(LOADS, outcome="loaded")
    # One request in flight on the first replica, as the gateway counts load (its own
    # exact count, which routing reads): held here rather than by a real stream, whose
    # length would race with this test.
    slots = gw.state.fleet.slots
    slots.take(address(first))
    try:
        r = complete(gw, "beta")
    finally:
        slots.give(address(first))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "beta"
    assert "beta" in served_by(second) and "beta" not in served_by(first)
    assert gw.metric(LOADS, outcome="loaded") == loads + 1
    # Both idle now: the next request goes where the adapter is, with no second load.
    before = decisions(gw, lora_replicas)
    again = complete(gw, "beta")
    assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    after = decisions(gw, lora_replicas)
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)
    assert gw.metric(LOADS, outcome="loaded") == loads + 1


def test_requests_at_once_for_a_new_adapter_share_one_load(
    gw: Gateway, lora_replicas: list[Replica]
) -> None:
    loads = gw.metric(LOADS, outcome="loaded")
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: complete(gw, "gamma"), range(2)))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json()["choices"] == answers[1].json()["choices"]
    assert gw.metric(LOADS, outcome="loaded") == loads + 1
    assert sum("gamma" in served_by(rep) for rep in lora_replicas) == 1


def test_an_adapter_unloaded_behind_the_gateways_back_is_loaded_elsewhere(
    gw: Gateway, lora_replicas: list[Replica]
) -> None:
    assert complete(gw, "delta").status_code == 200
    [holder] = [rep for rep in lora_replicas if "delta" in served_by(rep)]
    r = httpx.post(f"{holder.http}/v1/unload_lora_adapter", json={"lora_name": "delta"}, timeout=60)
    assert r.status_code == 200, r.text
    # The gateway still thinks the holder serves it (no poll since): the holder answers
    # NOT_FOUND, and the request is retried on the other replica, which loads it.
    again = complete(gw, "delta")
    assert again.status_code == 200, again.text
    [other] = [rep for rep in lora_replicas if rep is not holder]
    assert "delta" in served_by(other) and "delta" not in served_by(holder)
    assert {r.healthy for r in gw.state.fleet.replicas[MODEL].values()} == {True}


# ---- names and keys ---------------------------------------------------------------------
def test_an_unknown_adapter_is_404_model_not_found(gw: Gateway) -> None:
    sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        sdk.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found"
    # A key sees only the names it may use, in the list and in the 404's message.
    r = complete(gw, "no-such-adapter", key=KEY_BASE)
    assert r.status_code == 404
    assert "alpha" not in r.json()["error"]["message"]


def test_keys_allowlists_name_each_adapter(gw: Gateway) -> None:
    refused = complete(gw, "alpha", key=KEY_BASE)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "model_not_allowed"
    assert complete(gw, "alpha", key=KEY_ALPHA).status_code == 200
    assert complete(gw, MODEL, key=KEY_ALPHA).status_code == 403

    def listed(key: str) -> dict[str, Any]:
        r = httpx.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {key}"})
        return {m["id"]: m for m in r.json()["data"]}

    assert set(listed(KEY_BASE)) == {MODEL}
    assert set(listed(KEY_ALPHA)) == {"alpha"} and listed(KEY_ALPHA)["alpha"]["parent"] == MODEL
    every = listed(KEY_A)
    assert {MODEL, "alpha", "beta", "gamma", "delta"} <= set(every)
    assert every[MODEL]["parent"] is None


# ---- the replica's side: GetLoad and loading by name ------------------------------------
def test_replicas_report_adapters_and_load_them_by_name(
    lora_replicas: list[Replica], lora_dir: Path, tmp_path: Path
) -> None:
    shutil.copytree(lora_dir / "alpha", lora_dir / "epsilon")
    outside = shutil.copytree(lora_dir / "alpha", tmp_path / "outside")
    (lora_dir / "sneaky").symlink_to(outside, target_is_directory=True)
    with grpc.insecure_channel(f"127.0.0.1:{lora_replicas[0].grpc_port}") as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        load = stub.GetLoad(pb.GetLoadRequest())
        assert "alpha" in load.lora_adapters and load.max_loras == 2
        loaded = stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="epsilon"))
        assert loaded.adapter.path == str((lora_dir / "epsilon").resolve())
        assert "epsilon" in stub.GetLoad(pb.GetLoadRequest()).lora_adapters
        stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="epsilon"))
        # A name is a path under --lora-dir by the same rules as any path.
        for name in ["../outside", str(outside), "sneaky", "missing"]:
            with pytest.raises(grpc.RpcError) as err:
                stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name


# ---- the routing rule itself ------------------------------------------------------------
def views(**in_flight: int) -> list[ReplicaLoad]:
    """Replicas a, b, c with LoRA on; ``a`` serves "x"."""
    return [
        ReplicaLoad(
            name,
            in_flight=in_flight.get(name, 0),
            waiting=0,
            running=0,
            capacity=8,
            adapters=frozenset({"x"}) if name == "a" else frozenset(),
            lora_slots=2,
        )
        for name in "abc"
    ]


@pytest.mark.parametrize("router", [ConsistentHashRouter(), LeastLoadRouter()])
def test_route_adapter_prefers_holders_within_the_load_bound(router: Any) -> None:
    assert route_adapter(router, "x", "k", views()) == RouteDecision("a")
    # 3 in flight: the bound is ceil(1.25 × 4 / 3) = 2, which "a" would pass.
    decision = route_adapter(router, "x", "k", views(a=2, b=1))
    assert decision == RouteDecision("c", overridden=True, load_adapter="x")
    # Over the bound (2), but no more loaded than the others once their own queues count
    # (in flight + waiting): the holder wins the tie, and nothing is loaded.
    queued = [v if v.address == "a" else replace(v, waiting=2) for v in views(a=2)]
    assert route_adapter(router, "x", "k", queued) == RouteDecision("a", overridden=True)
    assert route_adapter(router, "x", "k", views(), exclude={"a"}) == RouteDecision(
        "b", overridden=True, load_adapter="x"
    )


def test_route_adapter_never_picks_a_replica_with_lora_off() -> None:
    off = [replace(v, lora_slots=0) if v.address != "a" else v for v in views(a=8)]
    assert route_adapter(LeastLoadRouter(), "x", "k", off) is None  # "a" is full
    assert route_adapter(LeastLoadRouter(), "y", "k", off[1:]) is None


def test_the_adapter_is_part_of_the_prefix_key() -> None:
    plain = prefix_key({"prompt": "same"})
    assert prefix_key({"prompt": "same", "lora_adapter": None}) == plain
    assert prefix_key({"prompt": "same", "lora_adapter": "x"}) != plain


def test_config_adapter_names() -> None:
    def config(adapters: list[str], *, other: list[str] | None = None) -> GatewayConfig:
        models: dict[str, Any] = {"m": {"replicas": ["grpc://h:1"], "lora_adapters": adapters}}
        if other is not None:
            models["n"] = {"replicas": ["grpc://h:2"], "lora_adapters": other}
        return GatewayConfig.model_validate({"models": models, "keys_file": "k.yaml"})

    assert config(["a-1", "b.2"]).adapter_model("b.2") == "m"
    for bad in (["../x"], ["a/b"], [".x"], ["a", "a"], ["m"]):
        with pytest.raises(ValidationError):
            config(bad)
    with pytest.raises(ValidationError, match="also an adapter of"):
        config(["a"], other=["a"])
