"""A LoRA adapter whose files a replica can no longer read back: two real ``kvserve serve``
replicas (one device slot, no idle adapter kept in host memory, so each adapter is read
again from its folder when it next runs) and a real gateway on 127.0.0.1.

The replica answers such a request 503 ``adapter_unavailable`` (gRPC UNAVAILABLE) naming
the adapter, never its path, and stops listing the adapter until it is loaded again; the
gateway retries the request on another replica and keeps the first one in rotation.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvserve.gateway.config import GatewayConfig
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from tests.support.gateway import KEY_A, Gateway, keys_file, serve_gateway
from tests.support.peft_adapters import build_adapter
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica, start_replicas
from tests.support.waiting import wait_until

PROMPT = [5, 17, 42, 9, 33, 70, 11]
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
# One device slot and no idle adapter in host memory: an adapter is read from its folder
# again whenever it runs after another one.
ONE_ADAPTER_IN_MEMORY = ("--enable-lora", "--max-loras", "1", "--max-cpu-loras", "0")


@pytest.fixture(scope="module")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``source``, copied into a folder per adapter load (each test removes or rewrites
    its own), and ``other``, whose requests push the rest out of host memory."""
    root = tmp_path_factory.mktemp("adapters")
    build_adapter(model_dir, root / "source", r=4, seed=1)
    build_adapter(model_dir, root / "other", r=4, seed=2)
    return root


@pytest.fixture(scope="module")
def reps(model_dir: Path, lora_dir: Path) -> Iterator[list[Replica]]:
    modules = ["--lora-dir", str(lora_dir), "--lora-modules", f"other={lora_dir / 'other'}"]
    started = start_replicas(model_dir, 2, *ONE_ADAPTER_IN_MEMORY, *modules)
    try:
        yield started
    finally:
        for rep in started:
            rep.stop()


def load(rep: Replica, name: str, path: str) -> httpx.Response:
    r = httpx.post(
        f"{rep.http}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r


def complete(url: str, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, **GREEDY}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def served_by(rep: Replica) -> set[str]:
    return {m["id"] for m in httpx.get(f"{rep.http}/v1/models", timeout=10).json()["data"]}


def loaded_then_dropped(rep: Replica, lora_dir: Path, name: str) -> Path:
    """Load ``name`` from a folder of its own, run it, then run ``other``: ``name`` is
    then on disk only. Returns its folder."""
    folder = lora_dir / f"{name}-{rep.grpc_port}"
    shutil.copytree(lora_dir / "source", folder)
    load(rep, name, folder.name)
    for model in (name, "other"):
        r = complete(rep.http, model)
        assert r.status_code == 200, r.text
    return folder


def assert_unavailable(r: httpx.Response, name: str, lora_dir: Path) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_unavailable" and repr(name) in error["message"]
    assert str(lora_dir) not in r.text  # the server's paths stay in its log


def test_an_adapter_whose_folder_vanished_is_503_and_no_longer_listed(
    reps: list[Replica], lora_dir: Path
) -> None:
    rep = reps[0]
    folder = loaded_then_dropped(rep, lora_dir, "vanished")
    shutil.rmtree(folder)
    for _ in range(2):  # the first request finds out; the next is refused at once
        assert_unavailable(complete(rep.http, "vanished"), "vanished", lora_dir)
    assert "vanished" not in served_by(rep)
    with grpc.insecure_channel(f"127.0.0.1:{rep.grpc_port}") as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        assert "vanished" not in stub.GetLoad(pb.GetLoadRequest()).lora_adapters
        listed = stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest()).adapters
        assert "vanished" not in {a.name for a in listed}
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=PROMPT), max_tokens=2, lora_adapter="vanished"
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert str(lora_dir) not in err.value.details()
    assert complete(rep.http, MODEL).status_code == 200  # the base model serves on
    assert str(folder) in rep.proc.log.read_text()  # the operator learns the path


def test_an_adapter_whose_files_changed_is_503_until_it_is_loaded_again(
    reps: list[Replica], lora_dir: Path
) -> None:
    rep = reps[0]
    folder = loaded_then_dropped(rep, lora_dir, "rewritten")
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes: only the stamp changed
    assert_unavailable(complete(rep.http, "rewritten"), "rewritten", lora_dir)
    assert "rewritten" not in served_by(rep)
    load(rep, "rewritten", folder.name)  # loaded again: its files as they are now
    assert complete(rep.http, "rewritten").status_code == 200
    assert "rewritten" in served_by(rep)


def test_the_gateway_retries_elsewhere_when_a_replica_cannot_read_the_adapter(
    reps: list[Replica], lora_dir: Path
) -> None:
    """The gateway knows only the first replica serves ``shared`` (it polled before the
    second loaded it, and polls no more): the first answers UNAVAILABLE, and the request
    succeeds on the second, which stays the adapter's holder while the first stays in
    rotation for everything else."""
    first, second = reps
    folder = loaded_then_dropped(first, lora_dir, "shared")
    gw = gateway(reps)
    try:
        wait_until(lambda: "shared" in gw.state.fleet.adapters(MODEL), timeout=30)
        loaded_then_dropped(second, lora_dir, "shared")
        shutil.rmtree(folder)
        r = complete(gw.url, "shared", {"authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
        fleet: dict[str, Any] = gw.state.fleet.replicas[MODEL]
        assert {rep.healthy for rep in fleet.values()} == {True}
        holders = {address for address, rep in fleet.items() if "shared" in rep.lora_adapters}
        assert holders == {f"127.0.0.1:{second.grpc_port}"}
    finally:
        gw.stop()


def gateway(reps: list[Replica]) -> Gateway:
    """A gateway that polls its replicas once, at start (``load_poll_seconds`` is an
    hour): what it knows of who serves which adapter then changes only by its own doing."""
    config = GatewayConfig.model_validate(
        {
            "models": {MODEL: {"replicas": [r.grpc_url for r in reps]}},
            "keys_file": "unused.yaml",
            "load_poll_seconds": 3600,
        },
        strict=False,
    )
    return serve_gateway(config, keys_file())
