"""The kvserve image (docker/kvserve.Dockerfile), run the way the chart's and the
operator's pods run it: uid/gid 1000, a read-only root filesystem with an emptyDir at
/tmp, no capabilities, no privilege escalation. On the host's network, so its ports are
on 127.0.0.1.

- ``kvserve serve`` with the bundled demo model on the CPU answers a streamed chat (the
  official openai SDK), and SIGTERM drains a stream in flight, then exits 0 within the
  pod's grace period;
- ``kvserve model pull`` pulls a file:// source into an empty volume, a rerun is a no-op,
  and the operator's own init command for a file:// source verifies it in place;
- ``kvserve gateway`` with a mounted config and keys file answers /v1/models, in front of
  the engine container.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from kvserve.gateway.keys import hash_key
from kvserve_operator.render import GRACE_MARGIN_SECONDS
from tests.images.containers import POD_SECURITY, Container, podman, run, running, volume
from tests.support.net import free_port
from tests.support.waiting import poll

pytestmark = [pytest.mark.images, pytest.mark.slow]

DEMO = "kvserve-travel-tiny"
DEMO_PATH = "/opt/kvserve/demo-model"
PROMPT = "Hotels in Kyoto under $200 with an onsen?"
# Loading torch and the demo model in a fresh container on a busy 2-core machine.
START_TIMEOUT = 240.0
DRAIN_TIMEOUT = 30


@dataclass
class Engine:
    container: Container
    url: str
    grpc_port: int


def serve(ref: str, *extra: str) -> tuple[list[str], str, int]:
    http, grpc = free_port(), free_port()
    args = [
        "serve", "--host", "127.0.0.1", "--port", str(http), "--grpc-port", str(grpc),
        "--device", "cpu", *extra,
    ]  # fmt: skip
    return args, f"http://127.0.0.1:{http}", grpc


def wait_ready(container: Container, url: str) -> None:
    def ready() -> bool:
        container.alive()
        try:
            return httpx.get(f"{url}/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    poll(f"{container.name} /ready", ready, timeout=START_TIMEOUT)


@pytest.fixture(scope="module")
def engine(engine_image: str) -> Iterator[Engine]:
    args, url, grpc = serve(engine_image)
    with running(engine_image, args, name="engine", options=POD_SECURITY) as container:
        wait_ready(container, url)
        yield Engine(container, url, grpc)


def proc_status(container: Container) -> dict[str, str]:
    """/proc/1/status of the container: the engine process itself."""
    text = podman("exec", container.name, "cat", "/proc/1/status").stdout
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def test_engine_answers_a_streamed_chat_as_the_pods_user(engine: Engine) -> None:
    client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", timeout=120)
    stream = client.chat.completions.create(
        model=DEMO,
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        max_tokens=48,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    status = proc_status(engine.container)
    assert status["Uid"].split() == ["1000"] * 4, status["Uid"]
    assert status["Gid"].split() == ["1000"] * 4, status["Gid"]
    assert int(status["CapEff"], 16) == 0, status["CapEff"]
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2", "the runtime's default seccomp filter"
    write = podman("exec", engine.container.name, "touch", "/opt/kvserve/x", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr, write


def test_sigterm_drains_the_stream_and_exits_0_within_the_grace_period(engine_image: str) -> None:
    args, url, _ = serve(engine_image, "--drain-timeout", str(DRAIN_TIMEOUT))
    with running(engine_image, args, name="engine-drain", options=POD_SECURITY) as container:
        wait_ready(container, url)
        body = {
            "model": DEMO,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
            "max_tokens": 200,
            "ignore_eos": True,  # long enough to be in flight when SIGTERM comes
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = 0
            while seen < 2:
                seen += next(lines).startswith("data: ")
            container.signal("TERM")
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        last = json.loads(rest[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length", last
        # The pod's terminationGracePeriodSeconds (kvserve_operator/render.py).
        status = container.proc.wait(timeout=DRAIN_TIMEOUT + GRACE_MARGIN_SECONDS)
        assert status == 0, container.proc.tail()


def pull(ref: str, vol: str, source: str, dest: str) -> tuple[int, str]:
    # The init container of the operator's engine pods (render.py): HOME and HF_HOME, the
    # model cache volume at /models (":U": owned by the pod's user, as fsGroup makes it).
    options = [
        *POD_SECURITY, "-v", f"{vol}:/models:U",
        "-e", "HOME=/tmp", "-e", "HF_HOME=/models/.hf-home",
    ]  # fmt: skip
    proc = run(ref, ["model", "pull", source, dest], options=options)
    return proc.returncode, proc.stderr


def test_model_pull_fills_an_empty_volume_then_is_a_no_op(engine_image: str) -> None:
    source = f"file://{DEMO_PATH}"
    with volume() as vol:
        status, log = pull(engine_image, vol, source, "/models/demo")
        assert status == 0 and "copied" in log, log
        status, log = pull(engine_image, vol, source, "/models/demo")
        assert status == 0 and "up to date" in log, log
        assert "copied" not in log
        # What the operator runs for a file:// source: the image's own copy, verified in
        # place on the read-only root filesystem (render.model_dir).
        status, log = pull(engine_image, vol, source, DEMO_PATH)
        assert status == 0 and "verifying in place" in log, log


def test_gateway_runs_from_the_image_with_mounted_config_and_keys(
    engine_image: str, engine: Engine, tmp_path: Path
) -> None:
    key = "sk-images-test"
    port = free_port()
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o755)
    (keys / "keys.yaml").write_text(
        yaml.safe_dump({"keys": [{"tenant": "t", "sha256": hash_key(key), "models": ["*"]}]})
    )
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "models": {DEMO: {"replicas": [f"grpc://127.0.0.1:{engine.grpc_port}"]}},
                # Where the chart mounts the keys Secret (charts/kvserve/_helpers.tpl).
                "keys_file": "/etc/kvserve/keys/keys.yaml",
            }
        )
    )
    for path in (keys / "keys.yaml", config):
        path.chmod(0o644)
    options = [
        *POD_SECURITY,
        "-v", f"{config}:/etc/kvserve/gateway.yaml:ro",
        "-v", f"{keys}:/etc/kvserve/keys:ro",
    ]  # fmt: skip
    # The chart's command (gateway-deployment.yaml): the image's entrypoint plus these.
    args = ["gateway", "--config", "/etc/kvserve/gateway.yaml"]
    url = f"http://127.0.0.1:{port}"
    with running(engine_image, args, name="gateway", options=options) as container:

        def models() -> httpx.Response | None:
            container.alive()
            try:
                resp = httpx.get(
                    f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5
                )
            except httpx.TransportError:
                return None
            return resp if resp.status_code == 200 else None

        resp = poll("the gateway's /v1/models", models, timeout=START_TIMEOUT)
        assert [m["id"] for m in resp.json()["data"]] == [DEMO]
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
