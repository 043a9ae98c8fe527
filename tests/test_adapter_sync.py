"""``kvserve adapters sync`` (the InferenceModel pods' adapter-sync container) against a
real ``kvserve serve --enable-lora --lora-dir`` process on 127.0.0.1, with tiny PEFT
adapters: the listed adapters get pulled and loaded, removed ones unloaded, a repeated
pass does nothing, and the long-running command follows edits of its file, waits for an
engine that is not up yet and exits 0 on SIGTERM."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvserve.adapter_sync import (
    ENGINE_LOG_EVERY_S,
    ENGINE_RETRY_MAX_S,
    MARKER,
    Backoff,
    EngineClient,
    EngineUnavailable,
    EngineWait,
    read_config,
    sync_once,
)
from kvserve.cli import main as cli_main
from kvserve_operator.adapters import replicas_adapters
from kvserve_operator.spec import parse_spec
from kvserve_operator.status import adapters_status
from tests.support.cli_server import start_cli_server
from tests.support.net import free_port
from tests.support.peft_adapters import build_adapter
from tests.support.processes import LoggedProcess, start_logged
from tests.support.waiting import poll


@dataclass
class Engine:
    url: str
    base: Path
    lora_dir: Path
    sources: Path  # adapter folders outside --lora-dir, given as file:// sources

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def source(self, name: str) -> str:
        return f"file://{self.sources / name}"

    def models(self) -> dict[str, str | None]:
        data = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"]
        return {m["id"]: m["parent"] for m in data}


@pytest.fixture(scope="module")
def engine(checkpoint_dir, tmp_path_factory) -> Iterator[Engine]:  # type: ignore[no-untyped-def]
    base = checkpoint_dir("llama")
    root = tmp_path_factory.mktemp("adapter-sync")
    sources = root / "sources"
    for seed, name in enumerate(("alpha", "beta", "alpha-v2", "fixed"), start=1):
        build_adapter(base, sources / name, r=4, seed=seed)
    build_adapter(base, sources / "too-big", r=16, seed=9)  # over --max-lora-rank
    lora_dir = root / "adapters"
    lora_dir.mkdir()
    proc, url, _ = start_cli_server(
        base,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-dir",
        str(lora_dir),
        # Loaded at startup from outside --lora-dir: not the sync command's to manage.
        "--lora-modules",
        f"fixed={sources / 'fixed'}",
    )
    try:
        yield Engine(url, base, lora_dir, sources)
    finally:
        proc.stop()


def pod(name: str, ip: str, ready: bool = True) -> dict[str, object]:
    """A Pod object as the API server returns it, reduced to what the operator reads."""
    return {
        "metadata": {"name": name, "namespace": "models"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def write_list(path: Path, adapters: dict[str, str]) -> None:
    """Replace the file in one rename, as the kubelet swaps a ConfigMap's files."""
    body = {"adapters": [{"name": n, "source": s} for n, s in adapters.items()]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


def complete(engine: Engine, model: str) -> httpx.Response:
    return httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )


def sync_command(engine_url: str, config: Path, lora_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvserve",
        "adapters",
        "sync",
        "--config",
        str(config),
        "--lora-dir",
        str(lora_dir),
        "--url",
        engine_url,
        *extra,
    ]


def test_sync_loads_unloads_and_a_rerun_is_a_no_op(engine: Engine, tmp_path: Path) -> None:
    config = tmp_path / "adapters.json"
    write_list(config, {"alpha": engine.source("alpha"), "beta": engine.source("beta")})

    # Once through the command the pods run.
    proc = start_logged(
        sync_command(engine.url, config, engine.lora_dir, "--once"), "adapters-sync-once"
    )
    assert proc.wait(timeout=120) == 0, proc.tail()
    models = engine.models()
    assert models["alpha"] == models["beta"] == models["fixed"] == "m"
    assert (engine.lora_dir / "alpha" / MARKER).is_file()
    assert complete(engine, "alpha").status_code == 200

    client = EngineClient(engine.url)
    again = sync_once(read_config(config), engine.lora_dir, client)
    assert not again.changed, again

    # What the operator counts in status.adapters, read from this replica.
    replicas = replicas_adapters(
        [pod("ready", "127.0.0.1"), pod("unready", "127.0.0.1", ready=False)],
        f"http://{{pod_ip}}:{engine.port}/v1/models",
    )
    assert replicas == [frozenset({"alpha", "beta", "fixed"})]
    listed = [{"name": n, "source": engine.source(n)} for n in ("alpha", "beta", "gamma")]
    im = parse_spec({"model": {"source": "file:///m"}, "adapters": listed})
    counts = {a["name"]: a["loadedReplicas"] for a in adapters_status(im, replicas) or []}
    assert counts == {"alpha": 1, "beta": 1, "gamma": 0}
    closed = f"http://{{pod_ip}}:{free_port()}/v1/models"  # a replica that does not answer
    assert replicas_adapters([pod("gone", "127.0.0.1")], closed) == []

    write_list(config, {"alpha": engine.source("alpha")})
    removed = sync_once(read_config(config), engine.lora_dir, client)
    assert (removed.unloaded, removed.loaded, removed.failed) == (["beta"], [], {})
    assert "beta" not in engine.models()
    assert not (engine.lora_dir / "beta").exists()  # nobody can load it by name again
    assert complete(engine, "beta").status_code == 404
    assert "fixed" in engine.models()  # --lora-modules adapters are left alone

    third = sync_once(read_config(config), engine.lora_dir, client)
    assert not third.changed, third

    # A new source for a listed name: pulled again and reloaded under the same name.
    write_list(config, {"alpha": engine.source("alpha-v2")})
    changed = sync_once(read_config(config), engine.lora_dir, client)
    assert changed.reloaded == ["alpha"]
    marker = json.loads((engine.lora_dir / "alpha" / MARKER).read_text())
    assert marker["source"] == engine.source("alpha-v2")
    assert complete(engine, "alpha").status_code == 200

    write_list(config, {})
    assert sync_once(read_config(config), engine.lora_dir, client).unloaded == ["alpha"]
    assert set(engine.models()) == {"m", "fixed"}


def test_a_refused_adapter_is_reported_and_retried_later(engine: Engine, tmp_path: Path) -> None:
    config = tmp_path / "adapters.json"
    write_list(
        config,
        {
            "too-big": engine.source("too-big"),
            "missing": engine.source("no-such-adapter"),
            "beta": engine.source("beta"),
            "fixed": engine.source("alpha"),  # the name of a --lora-modules adapter
        },
    )
    client = EngineClient(engine.url)
    moment = [0.0]
    backoff = Backoff(now=lambda: moment[0])
    first = sync_once(read_config(config), engine.lora_dir, client, backoff=backoff)
    assert first.loaded == ["beta"]
    assert set(first.failed) == {"too-big", "missing", "fixed"}
    assert "max_lora_rank" in first.failed["too-big"]  # the engine's own refusal
    assert "no-such-adapter" in first.failed["missing"]
    assert "another adapter" in first.failed["fixed"]
    # Within their backoff the failed ones are not tried again; after it, they are.
    assert set(sync_once(read_config(config), engine.lora_dir, client, backoff=backoff).failed) == {
        "fixed"
    }
    moment[0] += 60
    later = sync_once(read_config(config), engine.lora_dir, client, backoff=backoff)
    assert set(later.failed) == {"too-big", "missing", "fixed"}

    write_list(config, {})
    assert sync_once(read_config(config), engine.lora_dir, client).unloaded == ["beta"]


def test_a_reload_never_404s_and_a_refused_update_keeps_the_old_version(
    engine: Engine, tmp_path: Path
) -> None:
    """A new source for a loaded adapter was an unload then a load: the name answered 404
    in between, and when the engine refused the new files (a rank over its limit) the
    name stayed unloaded and the old files were gone. Now the reload is in place and a
    refused one puts the old files back, with the old version serving."""
    config = tmp_path / "adapters.json"

    def sync_command_once() -> LoggedProcess:
        proc = start_logged(
            sync_command(engine.url, config, engine.lora_dir, "--once"), "adapters-sync-reload"
        )
        proc.wait(timeout=120)
        return proc

    write_list(config, {"alpha": engine.source("alpha")})
    assert sync_command_once().returncode == 0
    codes: dict[int, int] = {}
    stop = threading.Event()

    def ask_for_alpha_until_stopped() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set() or not codes:
                body = {"model": "alpha", "prompt": "hi", "max_tokens": 1}
                status = client.post(f"{engine.url}/v1/completions", json=body).status_code
                codes[status] = codes.get(status, 0) + 1

    asker = threading.Thread(target=ask_for_alpha_until_stopped)
    asker.start()
    try:
        write_list(config, {"alpha": engine.source("alpha-v2")})
        reload = sync_command_once()
    finally:
        stop.set()
        asker.join()
    assert reload.returncode == 0 and "reloaded alpha" in log(reload), log(reload)
    assert set(codes) == {200}, codes  # every request got the old or the new version
    v2_text = complete(engine, "alpha").json()["choices"][0]["text"]

    write_list(config, {"alpha": engine.source("too-big")})
    refused = sync_command_once()
    assert refused.returncode == 1 and "max_lora_rank" in log(refused), log(refused)
    served = complete(engine, "alpha")
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == v2_text
    marker = json.loads((engine.lora_dir / "alpha" / MARKER).read_text())
    assert marker["source"] == engine.source("alpha-v2")  # its files are in place
    assert not [p for p in engine.lora_dir.iterdir() if p.name.startswith(".")]
    # Not "up to date": the next pass tries the refused source again.
    again = sync_once(read_config(config), engine.lora_dir, EngineClient(engine.url))
    assert "max_lora_rank" in again.failed["alpha"]

    write_list(config, {})
    assert sync_once(read_config(config), engine.lora_dir, EngineClient(engine.url)).unloaded == [
        "alpha"
    ]


def test_an_adapter_whose_checks_blow_up_does_not_stop_the_others(
    engine: Engine, tmp_path: Path
) -> None:
    """An adapter_config.json (or a safetensors header) nested 100,000 deep made the JSON
    parser raise RecursionError, which ended the long-running command (status 1) before
    it loaded the adapters listed after it. Now such an adapter is logged and retried with
    its backoff like any other failure, and the rest are loaded."""
    deep = "[" * 100_000 + "]" * 100_000
    deep_config = tmp_path / "deep-config"
    shutil.copytree(engine.sources / "alpha", deep_config)
    (deep_config / "adapter_config.json").write_text(deep)
    deep_header = tmp_path / "deep-header"
    shutil.copytree(engine.sources / "alpha", deep_header)
    header = deep.encode()
    (deep_header / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    config = tmp_path / "adapters.json"
    write_list(
        config,
        {
            "deep-config": f"file://{deep_config}",
            "deep-header": f"file://{deep_header}",
            "later": engine.source("beta"),  # after both in the command's order
        },
    )
    lora_dir = engine.lora_dir
    sync = start_logged(
        sync_command(engine.url, config, lora_dir, "--interval", "0.2"), "adapters-sync-deep"
    )
    try:
        poll(
            "later loaded, or the command gone",
            lambda: sync.poll() is not None or "later" in engine.models(),
        )
        assert sync.poll() is None, log(sync)

        def retried(name: str) -> bool:
            return log(sync).count(f"{name}: ") >= 2

        poll("both retried", lambda: retried("deep-config") and retried("deep-header"))
        output = log(sync)
        assert "Traceback" not in output, output
        assert "deep-config: adapter_config.json: JSON nested too deeply to read" in output
        assert "adapter_model.safetensors: header: JSON nested too deeply to read" in output
        sync.send_signal(signal.SIGTERM)
        assert sync.wait(timeout=30) == 0, log(sync)
    finally:
        sync.stop()
    write_list(config, {})
    assert sync_once(read_config(config), lora_dir, EngineClient(engine.url)).unloaded == ["later"]


def test_an_engine_that_is_not_up_is_asked_again_every_few_seconds_and_logged_seldom() -> None:
    """The wait for the engine grew to 60 s, so a model that took minutes to load had its
    adapters missing for up to a minute after it was ready; every retry was logged."""
    moment = [0.0]
    wait = EngineWait(now=lambda: moment[0])
    tries = []
    for _ in range(40):
        delay, logged = wait.failed()
        tries.append((delay, logged))
        moment[0] += delay
    delays = [d for d, _ in tries]
    assert delays[:4] == [0.25, 0.5, 1.0, 2.0] and set(delays[3:]) == {ENGINE_RETRY_MAX_S}
    logged_at = [i for i, (_, logged) in enumerate(tries) if logged]
    assert logged_at[0] == 0 and len(logged_at) == 1 + int(sum(delays[:-1]) // ENGINE_LOG_EVERY_S)
    wait.answered()
    assert wait.failed() == (0.25, True)  # a new wait starts over, and is logged


def test_sync_waits_for_the_engine_follows_the_file_and_stops_on_sigterm(
    engine: Engine, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    lora_dir = tmp_path / "adapters"
    config = tmp_path / "adapters.json"
    write_list(config, {"alpha": engine.source("alpha")})
    with pytest.raises(EngineUnavailable):
        sync_once(read_config(config), lora_dir, EngineClient(url))

    sync = start_logged(
        sync_command(url, config, lora_dir, "--interval", "0.2"), "adapters-sync-loop"
    )
    server: LoggedProcess | None = None
    try:
        poll("the sync command to find no engine", lambda: "engine not ready" in log(sync))
        server = start_logged(
            [
                sys.executable, "-m", "kvserve", "serve", "--model", str(engine.base),
                "--served-model-name", "m", "--dtype", "float32", "--port", str(port),
                "--no-grpc", "--enable-lora", "--max-lora-rank", "8",
                "--lora-dir", str(lora_dir), "--log-level", "warning",
            ],
            "kvserve-serve-late",
        )  # fmt: skip
        started = Engine(url, engine.base, lora_dir, engine.sources)

        def served() -> set[str]:
            try:
                return set(started.models())
            except httpx.TransportError:
                return set()

        poll("alpha loaded once the engine is up", lambda: "alpha" in served(), timeout=120)
        write_list(config, {"beta": engine.source("beta")})
        poll("the edited list applied", lambda: served() == {"m", "beta"}, timeout=60)
        assert sync.poll() is None, log(sync)
        sync.send_signal(signal.SIGTERM)
        assert sync.wait(timeout=30) == 0, log(sync)
    finally:
        sync.stop()
        if server is not None:
            server.stop()


def log(proc: LoggedProcess) -> str:
    return proc.log.read_text(errors="replace")


class _NotAnEngine(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>a proxy's page</html>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_what_is_not_an_engine_is_not_ready_and_bad_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 200 that is not a model list was a traceback that ended the sidecar; a --url
    without a scheme (or a port out of range) was retried for ever as "not ready", an
    --interval of 0 polled 40 times a second, and a --lora-dir that is a file was a
    traceback."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAnEngine)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(EngineUnavailable, match="/v1/models: not a model list"):
            EngineClient(url).adapters()
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    config = tmp_path / "adapters.json"
    write_list(config, {})
    common = ["adapters", "sync", "--config", str(config)]
    for flags, why in (
        (["--url", "127.0.0.1:8000"], "not an http(s)://HOST[:PORT] URL"),
        (["--url", "http://127.0.0.1:99999"], "not an http(s)://HOST[:PORT] URL"),
        (["--interval", "0"], "must be more than 0 seconds"),
    ):
        with pytest.raises(SystemExit) as info:
            cli_main([*common, "--lora-dir", str(tmp_path / "a"), *flags])
        assert info.value.code == 2 and why in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert cli_main([*common, "--lora-dir", str(tmp_path / "a-file"), "--once"]) == 2
    assert "--lora-dir" in capsys.readouterr().err
