"""``kvserve serve --enable-lora`` as a real process: adapters chosen by ``model``,
listed by ``/v1/models``, loaded and unloaded at run time only from under ``--lora-dir``,
called with the openai SDK."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import schemathesis
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.lora import LoRARequest
from kvserve.rpc import engine_pb2 as pb
from kvserve.rpc import engine_pb2_grpc as pb_grpc
from kvserve.server.main import add_arguments, lora_dir_warning, lora_problem
from tests.support.cli_server import start_cli_server
from tests.support.net import free_port
from tests.support.openapi_fuzz import fuzz_operation
from tests.support.peft_adapters import ALL_LINEAR, build_adapter

PROMPT = [5, 17, 42, 9, 33, 70, 11]  # token ids: the same prompt under every model
MAX_TOKENS = 8


@dataclass
class Served:
    url: str
    lora_dir: Path
    outside: Path  # an adapter folder outside --lora-dir
    base_dir: Path
    grpc_port: int

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def post(self, path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)


@pytest.fixture(scope="module")
def served(checkpoint_dir, tmp_path_factory) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    base = checkpoint_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    lora_dir = root / "adapters"
    outside = build_adapter(base, root / "outside", r=8, seed=1)
    build_adapter(base, lora_dir / "second", r=4, targets=ALL_LINEAR, seed=2)
    build_adapter(base, lora_dir / "third", r=8, seed=3)
    grpc_port = free_port()
    proc, url, _ = start_cli_server(
        base,
        "--grpc-port",  # after the helper's own: argparse keeps the last
        str(grpc_port),
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"first={outside}",
        "--lora-dir",
        str(lora_dir),
        "--metrics-compat",
        "vllm",
        grpc=True,
    )
    try:
        yield Served(url, lora_dir, outside, base, grpc_port)
    finally:
        proc.stop()


def complete(served: Served, model: str, prompt: list[int] = PROMPT) -> str:
    out = served.sdk().completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.model == model
    return out.choices[0].text


def offline(served: Served, adapters: dict[str, Path]) -> dict[str | None, str]:
    """The same prompt, offline, under the base model and each adapter."""
    llm = LLM(str(served.base_dir), dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    texts: dict[str | None, str] = {None: llm.generate([PROMPT], params)[0].outputs[0].text}
    for name, path in adapters.items():
        [out] = llm.generate([PROMPT], params, lora_request=LoRARequest(name, str(path)))
        texts[name] = out.outputs[0].text
    return texts


def test_models_lists_the_base_and_each_adapter(served: Served) -> None:
    models = {m.id: m for m in served.sdk().models.list().data}
    assert set(models) == {"m", "first"}
    first = models["first"].model_dump()
    assert first["parent"] == "m" and first["root"] == str(served.outside.resolve())
    assert models["m"].model_dump()["parent"] is None


def test_the_model_field_selects_the_adapter(served: Served) -> None:
    expected = offline(served, {"first": served.outside})
    assert expected["first"] != expected[None], "the adapter must change the output"
    assert complete(served, "m") == expected[None]
    assert complete(served, "first") == expected["first"]
    chat = served.sdk().chat.completions.create(
        model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.model == "first"


def test_an_unknown_model_is_404_model_not_found(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        complete(served, "nobody")
    assert err.value.code == "model_not_found"


def test_load_use_and_unload_at_run_time(served: Served) -> None:
    r = served.post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "second"})
    assert r.status_code == 200, r.text
    abs_inside = str(served.lora_dir / "third")
    r = served.post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": abs_inside})
    assert r.status_code == 200, r.text
    again = served.post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": "second"})
    assert again.status_code == 400 and "already loaded" in again.text
    for bad in ("two words", "line\nbreak", ""):  # a name goes into logs and labels
        r = served.post("/v1/load_lora_adapter", {"lora_name": bad, "lora_path": "second"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    names = {m.id for m in served.sdk().models.list().data}
    assert {"second", "third"} <= names
    expected = offline(
        served, {"second": served.lora_dir / "second", "third": served.lora_dir / "third"}
    )
    # Three adapters over two slots: one waits for a slot, none blocks the others.
    assert complete(served, "second") == expected["second"]
    assert complete(served, "third") == expected["third"]
    assert complete(served, "first") != expected[None]

    # A stream under "second" keeps going while the adapter is unloaded under it.
    stream = served.sdk().completions.create(
        model="second",
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    r = served.post("/v1/unload_lora_adapter", {"lora_name": "second"})
    assert r.status_code == 200, r.text
    finish, usage = None, None
    for chunk in chunks:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 200
    with pytest.raises(openai.NotFoundError):
        complete(served, "second")
    r = served.post("/v1/unload_lora_adapter", {"lora_name": "second"})
    assert r.status_code == 404
    served.post("/v1/unload_lora_adapter", {"lora_name": "third"})


def test_a_reload_of_changed_files_serves_the_new_weights(served: Served) -> None:
    """A name unloaded and loaded again from the same folder after its files changed (a
    new revision): the next request runs the new weights, neither the old ones' prefix
    cache blocks nor their device slot, which a request in flight still holds."""
    folder = served.lora_dir / "swap"
    prompt = list(range(40, 40 + 40))  # two and a half 16-token blocks: a prefix to cache
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def offline_text() -> str:  # a new engine: it reads the folder as it is now
        llm = LLM(str(served.base_dir), dtype="float32", device="cpu", enable_lora=True)
        lora = LoRARequest("swap", str(folder))
        return llm.generate([prompt], params, lora_request=lora)[0].outputs[0].text

    def served_text() -> str:
        return complete(served, "swap", prompt)

    build_adapter(served.base_dir, folder, r=8, seed=4)
    old = offline_text()
    assert served.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": "swap"})
    assert served_text() == old  # and its prompt's blocks are cached now
    in_flight = served.sdk().completions.create(
        model="swap", prompt=prompt, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(in_flight)
    next(chunks)  # running: the old weights hold their slot

    r = served.post("/v1/unload_lora_adapter", {"lora_name": "swap"})
    assert r.status_code == 200, r.text
    shutil.rmtree(folder)
    build_adapter(served.base_dir, folder, r=8, seed=5)
    new = offline_text()
    assert new != old, "the two adapters must differ"
    r = served.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": "swap"})
    assert r.status_code == 200, r.text
    assert served_text() == new
    assert len(list(chunks)) > 0  # the old stream ran to its end meanwhile
    served.post("/v1/unload_lora_adapter", {"lora_name": "swap"})


def test_load_inplace_replaces_a_loaded_adapter_without_a_gap(served: Served) -> None:
    """vLLM's ``load_inplace``, as adapter-sync reloads a new revision: the name serves
    the old weights until the new ones are read, then the new ones (never a 404, never
    the old ones' cached KV); a request running on the old version finishes on it, and a
    refused replacement leaves the old version serving. Without it, a loaded name could
    only be unloaded first (404s until the load finished)."""
    folder = served.lora_dir / "hot"
    prompt = list(range(40, 40 + 40))  # two and a half 16-token blocks: a prefix to cache

    def served_text() -> str:
        return complete(served, "hot", prompt)

    def load(lora_path: str) -> httpx.Response:
        body = {"lora_name": "hot", "lora_path": lora_path, "load_inplace": True}
        return served.post("/v1/load_lora_adapter", body)

    build_adapter(served.base_dir, folder, r=8, seed=6)
    assert load("hot").status_code == 200  # not loaded yet: an ordinary load
    old = served_text()  # and its prompt's blocks are cached now
    in_flight = served.sdk().completions.create(
        model="hot", prompt=prompt, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(in_flight)
    next(chunks)  # running on the old weights, in their slot

    # A new revision swapped in by rename, as adapter-sync does.
    build_adapter(served.base_dir, served.lora_dir / "hot-next", r=8, seed=7)
    os.rename(folder, served.lora_dir / "hot-prev")
    os.rename(served.lora_dir / "hot-next", folder)
    r = load("hot")
    assert r.status_code == 200, r.text
    new = served_text()
    assert new != old, "the new weights serve, not the old ones' cached KV"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"  # the old stream ran to its end meanwhile

    build_adapter(served.base_dir, served.lora_dir / "hot-big", r=16, seed=8)  # over rank 8
    refused = load("hot-big")
    assert refused.status_code == 400 and "max_lora_rank=8" in refused.text
    assert served_text() == new  # the loaded version still serves
    models = {m.id: m for m in served.sdk().models.list().data}
    assert models["hot"].root == str(folder)  # type: ignore[attr-defined]

    again = served.post("/v1/load_lora_adapter", {"lora_name": "hot", "lora_path": "hot"})
    assert again.status_code == 400 and "load_inplace" in again.text
    served.post("/v1/unload_lora_adapter", {"lora_name": "hot"})


@pytest.mark.parametrize("how", ["dotdot", "absolute-outside", "symlink-dir", "symlink-file"])
def test_loads_from_outside_the_lora_dir_are_refused(served: Served, how: str) -> None:
    name = f"evil-{how}"
    if how == "dotdot":
        path = "../outside"
    elif how == "absolute-outside":
        path = str(served.outside)
    elif how == "symlink-dir":
        (served.lora_dir / name).symlink_to(served.outside, target_is_directory=True)
        path = name
    else:  # a folder inside whose weights file points outside
        folder = served.lora_dir / name
        folder.mkdir()
        shutil.copy(served.outside / "adapter_config.json", folder)
        os.symlink(
            served.outside / "adapter_model.safetensors", folder / "adapter_model.safetensors"
        )
        path = name
    r = served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_path"
    assert name not in {m.id for m in served.sdk().models.list().data}


def test_a_bad_adapter_is_refused_by_name(served: Served) -> None:
    build_adapter(served.base_dir, served.lora_dir / "big", r=16, seed=4)  # over rank 8
    r = served.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "big"})
    assert r.status_code == 400 and "max_lora_rank=8" in r.json()["error"]["message"]


def test_lora_info_metric(served: Served) -> None:
    complete(served, "first")
    text = httpx.get(f"{served.url}/metrics").text
    [family] = [
        f for f in text_string_to_metric_families(text) if f.name == "kvserve_lora_requests_info"
    ]
    [sample] = family.samples
    assert sample.labels["max_lora"] == "2"
    assert sample.labels["running_lora_adapters"] == ""  # nothing in flight now
    assert sample.value > 1e9  # a Unix time
    counted = {
        s.labels["lora_adapter"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvserve_lora_requests"
        for s in f.samples
        if s.name == "kvserve_lora_requests_total"
    }
    assert counted.get("first", 0) >= 1, counted


def test_vllm_compat_metrics_mirror_the_load_gauges_and_infos(served: Served) -> None:
    """``--metrics-compat vllm``: what a Gateway API Inference Extension endpoint picker
    reads by vLLM's names (queue, running, KV usage, cache info, LoRA info) carries the
    same figures and labels as kvserve's own series."""
    complete(served, "first")
    text = httpx.get(f"{served.url}/metrics").text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for ours, theirs in [
        ("kvserve_num_requests_waiting", "vllm:num_requests_waiting"),
        ("kvserve_num_requests_running", "vllm:num_requests_running"),
        ("kvserve_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
    ]:
        assert samples[theirs].labels == {"model_name": "m", "engine": "0"}
        assert samples[theirs].value == samples[ours].value, theirs
    info, ours_info = samples["vllm:cache_config_info"], samples["kvserve_cache_config_info"]
    assert info.labels["block_size"] == ours_info.labels["block_size"]
    assert info.labels["num_gpu_blocks"] == ours_info.labels["num_gpu_blocks"]
    assert int(info.labels["num_gpu_blocks"]) > 0 and info.value == 1
    lora, ours_lora = samples["vllm:lora_requests_info"], samples["kvserve_lora_requests_info"]
    assert set(lora.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert lora.labels["max_lora"] == "2"
    assert lora.labels == {k: v for k, v in ours_lora.labels.items() if k != "model"}
    assert lora.value > 1e9  # the time of the last update, which pickers compare


def test_lora_flags_need_enable_lora() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert "need --enable-lora" in (lora_problem(p.parse_args(["--lora-dir", "/x"])) or "")
    args = p.parse_args(["--enable-lora", "--lora-modules", "a=/x", "a=/y"])
    assert "twice" in (lora_problem(args) or "")
    assert "NAME=PATH" in (
        lora_problem(p.parse_args(["--enable-lora", "--lora-modules", "a"])) or ""
    )
    assert "whitespace" in (
        lora_problem(p.parse_args(["--enable-lora", "--lora-modules", "a b=/x"])) or ""
    )
    assert lora_problem(p.parse_args(["--enable-lora", "--lora-modules", "a=/x"])) is None


def test_a_missing_lora_dir_is_warned_about(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    missing = tmp_path / "adapters"
    warning = lora_dir_warning(p.parse_args(["--enable-lora", "--lora-dir", str(missing)]))
    assert warning is not None and str(missing) in warning and "not a folder" in warning
    missing.mkdir()
    assert lora_dir_warning(p.parse_args(["--enable-lora", "--lora-dir", str(missing)])) is None
    assert lora_dir_warning(p.parse_args([])) is None


def test_grpc_selects_loads_lists_and_unloads_adapters(served: Served) -> None:
    expected = offline(served, {"first": served.outside})
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = pb_grpc.EngineServiceStub(channel)

        def generate(adapter: str | None) -> str:
            request = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=PROMPT),
                max_tokens=MAX_TOKENS,
                temperature=0,
                ignore_eos=True,
                lora_adapter=adapter,
            )
            return "".join(r.delta.text for r in stub.Generate(request) if r.HasField("delta"))

        assert generate(None) == expected[None]
        assert generate("first") == expected["first"]
        with pytest.raises(grpc.RpcError) as err:
            generate("nobody")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        listed = stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest())
        assert listed.max_loras == 2 and "first" in [a.name for a in listed.adapters]
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="x", lora_path="../outside"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        loaded = stub.LoadLoRAAdapter(
            pb.LoadLoRAAdapterRequest(lora_name="via-grpc", lora_path="third")
        )
        assert loaded.adapter.path == str((served.lora_dir / "third").resolve())
        assert generate("via-grpc")
        again = pb.LoadLoRAAdapterRequest(lora_name="via-grpc", lora_path="second")
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadLoRAAdapter(again)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "load_inplace" in (err.value.details() or "")
        again.load_inplace = True  # as over HTTP: the name now serves the other folder
        replaced = stub.LoadLoRAAdapter(again)
        assert replaced.adapter.path == str((served.lora_dir / "second").resolve())
        assert generate("via-grpc")
        stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="via-grpc"))
        with pytest.raises(grpc.RpcError) as err:
            stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="via-grpc"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("label", ["POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"])
def test_fuzzed_adapter_requests_get_no_server_errors(served: Served, label: str) -> None:
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", timeout=30)
    fuzz_operation(schema, label, served.url, "m", max_examples=25)
