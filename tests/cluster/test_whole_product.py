"""The whole product on the test control plane, with pods that run their real commands.

The path a user takes: ``helm install`` of the chart, an API-key Secret, an
``InferenceModel``, the operator's Deployment, engine pods running ``kvserve model pull``
then ``kvserve serve`` with the bundled demo model, the gateway pod finding them through
EndpointSlices, and a streamed answer. The engine and gateway pods run on the pod runner's
node (tests/cluster/pod_runner.py): real processes on loopback pod IPs, their readiness
from their probes. The operator runs as a local process with the chart's arguments and
its ServiceAccount's token, as in tests/chart; its own pod stays a kwok fake.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.demo_model import DEMO_MODEL_NAME, corpus
from tests.chart import helm, prepared_chart
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner, scheduling
from tests.support.demo_source import demo_model_source
from tests.support.operator_process import OperatorProcess
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "kvserve-e2e"
RELEASE = "wp"
FULLNAME = "wp-kvserve"
GATEWAY = f"{FULLNAME}-gateway"
OPERATOR = f"{FULLNAME}-operator"
MODEL = "travel"  # the InferenceModel (and its Deployment and Service)
KEY = "sk-whole-product-test-key-do-not-use"
QUESTION = "Hotels in Kyoto under $200 with an onsen?"
REQUEST = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
# Two engines importing torch and loading the model at once on a busy 2-core machine.
START_TIMEOUT = 240.0
STREAM_TOKENS = 150


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page as {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(
    page: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return sum(v for (n, ls), v in page.items() if n == name and labels.items() <= dict(ls).items())


@dataclass
class Product:
    cluster: Cluster
    runner: PodRunner
    workdir: Path
    env: dict[str, str]
    operator: OperatorProcess | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        proc = self.cluster.kubectl("get", kind, name, "-n", NS, "-o", "json", check=False)
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def pods(self, selector: str) -> list[dict[str, Any]]:
        out = self.cluster.kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json").stdout
        return json.loads(out)["items"]  # type: ignore[no-any-return]

    def ready_engines(self) -> list[dict[str, Any]]:
        """The model's pods that are Ready (by the runner, from their readinessProbe)."""
        return [
            p
            for p in self.pods(f"app.kubernetes.io/instance={MODEL}")
            if p["metadata"].get("deletionTimestamp") is None
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions", [])
            )
        ]

    def gateway_url(self) -> str:
        """The gateway Service's ready endpoint, from its EndpointSlice (Services route
        nowhere here, but the endpoint is the gateway pod's own loopback IP)."""

        def endpoint() -> str | None:
            out = self.cluster.kubectl(
                "get", "endpointslices", "-n", NS, "-l",
                f"kubernetes.io/service-name={GATEWAY}", "-o", "json",
            ).stdout  # fmt: skip
            for eps in json.loads(out)["items"]:
                port = next(p["port"] for p in eps.get("ports") or [] if p["name"] == "http")
                for ep in eps.get("endpoints") or []:
                    if ep.get("conditions", {}).get("ready"):
                        return f"http://{ep['addresses'][0]}:{port}"
            return None

        url = poll("a ready endpoint of the gateway Service", endpoint, timeout=START_TIMEOUT)
        assert url is not None
        return url

    def engine_url(self, pod: dict[str, Any]) -> str:
        return f"http://{pod['status']['podIP']}:8000"

    def state(self) -> str:
        """What a failure shows: the objects, the runner's log and the operator's."""
        objects = self.cluster.kubectl(
            "get", "im,deploy,rs,pods,endpointslices", "-n", NS, "-o", "wide", check=False
        )
        operator = self.operator.logs()[-4000:] if self.operator else ""
        runner = "\n".join(self.runner.log[-80:])
        return (
            f"{objects.stdout}{objects.stderr}\n--- pod runner\n{runner}\n--- operator\n{operator}"
        )


def inference_model(replicas: int) -> dict[str, Any]:
    sched = scheduling()
    return {
        "apiVersion": "kvserve.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": MODEL, "namespace": NS},
        "spec": {
            "model": {"source": demo_model_source(), "servedName": DEMO_MODEL_NAME},
            "replicas": replicas,
            "resources": {
                "gpus": 0,
                "cpu": "1",
                "memory": "2Gi",
                "nodeSelector": sched["nodeSelector"],
                "tolerations": sched["tolerations"],
            },
        },
    }


def chart_values() -> dict[str, Any]:
    sched = scheduling()
    return {
        "gateway": {
            "replicas": 1,
            "nodeSelector": sched["nodeSelector"],
            "tolerations": sched["tolerations"],
            # Alternate strictly, so that concurrent streams land on both replicas.
            "config": {"routing": {"policy": "round_robin"}},
        },
        "tests": {"enabled": False},
    }


@pytest.fixture(scope="module")
def product(
    k8s_cluster: Cluster,
    pod_runner: PodRunner,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Product]:
    started = time.monotonic()
    workdir = tmp_path_factory.mktemp("whole-product")
    env = k8s_cluster.env()
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(workdir / var.lower())
    p = Product(k8s_cluster, pod_runner, workdir, env)
    k8s_cluster.kubectl("create", "namespace", NS)
    # keys.source=existingSecret (the chart's default): the user creates the Secret.
    keys = {
        "keys": [
            {"tenant": "e2e", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "models": ["*"]}
        ]
    }
    (workdir / "keys.yaml").write_text(yaml.safe_dump(keys))
    k8s_cluster.kubectl(
        "create", "secret", "generic", f"{GATEWAY}-keys", "-n", NS,
        f"--from-file=keys.yaml={workdir / 'keys.yaml'}",
    )  # fmt: skip
    (workdir / "values.yaml").write_text(yaml.safe_dump(chart_values()))
    chart = prepared_chart(workdir)
    helm(k8s_cluster.bins.helm, "install", RELEASE, str(chart), "-n", NS,
         "-f", str(workdir / "values.yaml"), env=env)  # fmt: skip
    deployment = p.get("deployment", OPERATOR)
    assert deployment is not None
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    p.operator = OperatorProcess(
        c["args"],
        k8s_cluster.service_account_kubeconfig(NS, OPERATOR, workdir / "operator.kubeconfig"),
        workdir / "operator.log",
        k8s_cluster.env(),
    )
    try:
        p.operator.start()
        p.timings["install"] = time.monotonic() - started
        yield p
    finally:
        p.operator.stop()
        # The runner stops each pod as a kubelet would (preStop, SIGTERM) in the
        # background; whatever is left when the session ends is killed by PID.
        k8s_cluster.kubectl("delete", "inferencemodel", MODEL, "-n", NS, "--wait=false",
                            check=False)  # fmt: skip
        helm(k8s_cluster.bins.helm, "uninstall", RELEASE, "-n", NS, "--wait=false",
             env=env, check=False)  # fmt: skip
        k8s_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        # Shown whatever pytest captures: what each phase took on this machine (CI cost).
        timings = ", ".join(f"{k} {v:.1f} s" for k, v in p.timings.items())
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"\nwhole product on the pod runner: {timings}")


@pytest.fixture(scope="module")
def serving(product: Product) -> Product:
    """The InferenceModel applied and Ready with 2 replicas, and the gateway routing to
    both (its replica gauge, from EndpointSlices)."""
    started = time.monotonic()
    product.cluster.kubectl("apply", "-f", "-", input=json.dumps(inference_model(2)))

    def ready() -> bool:
        im = product.get("inferencemodel", MODEL) or {}
        status = im.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return conditions.get("Ready") == "True" and status.get("readyReplicas") == 2

    try:
        poll("the InferenceModel Ready with 2 replicas", ready, timeout=START_TIMEOUT)
        product.timings["model ready"] = time.monotonic() - started
        gateway = product.gateway_url()
        poll(
            "the gateway routing to 2 healthy replicas",
            lambda: routable(gateway) == 2,
            timeout=60,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{product.state()}") from None
    product.timings["routable"] = time.monotonic() - started
    return product


def routable(gateway: str) -> float:
    try:
        page = metrics(f"{gateway}/metrics")
    except httpx.TransportError:
        return 0
    return total(page, "kvserve_gateway_replicas", model=DEMO_MODEL_NAME, state="healthy")


def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, timeout=120, max_retries=0)


def test_happy_path_a_streamed_answer_through_the_gateway_pod(serving: Product) -> None:
    gateway = serving.gateway_url()
    engines = serving.ready_engines()
    assert len(engines) == 2
    assert serving.runner.network is not None
    assert all(
        ipaddress.ip_address(e["status"]["podIP"]) in serving.runner.network for e in engines
    )
    before = {e["metadata"]["name"]: metrics(f"{serving.engine_url(e)}/metrics") for e in engines}
    gw_before = metrics(f"{gateway}/metrics")

    rid = "whole-product-happy-1"
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=DEMO_MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        stream=True,
        temperature=0,
        max_tokens=128,
        extra_headers={"x-request-id": rid},
    )
    assert raw.headers["x-request-id"] == rid
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert corpus.check_answer(REQUEST, text), text
    assert "Kyoto" in text
    assert chunks[-1].choices[0].finish_reason == "stop"

    finished = "kvserve_requests_finished_total"
    counted = {
        name: total(metrics(f"{serving.engine_url(e)}/metrics"), finished)
        - total(before[name], finished)
        for e in engines
        for name in [e["metadata"]["name"]]
    }
    assert sorted(counted.values()) == [0, 1], counted
    requests = "kvserve_gateway_requests_total"
    gw_after = metrics(f"{gateway}/metrics")
    assert (
        total(gw_after, requests, model=DEMO_MODEL_NAME, status="200")
        - total(gw_before, requests, model=DEMO_MODEL_NAME, status="200")
        == 1
    ), {k: v for k, v in gw_after.items() if k[0] == requests}


@dataclass
class Stream:
    """One streamed chat read to its end on a thread: its data lines, in order."""

    gateway: str
    lines: list[str] = field(default_factory=list)
    first: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": DEMO_MODEL_NAME,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            # Long enough to be in flight when its pod dies: decoding on this busy CPU
            # takes 0.05-0.2 s a token.
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
        }
        headers = {"authorization": f"Bearer {KEY}"}
        try:
            with httpx.stream(
                "POST", f"{self.gateway}/v1/chat/completions", json=body, headers=headers,
                timeout=120,
            ) as resp:  # fmt: skip
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line.removeprefix("data: "))
                        self.first.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first.set()

    @property
    def errored(self) -> bool:
        """Whether it ended with an error event (then [DONE])."""
        return len(self.lines) >= 2 and "error" in json.loads(self.lines[-2])

    @property
    def finish_reason(self) -> str | None:
        for line in reversed(self.lines[:-1]):
            chunk = json.loads(line)
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason"):
                    return str(choice["finish_reason"])
        return None


def test_pod_loss_mid_stream_fails_only_its_streams_and_the_replacement_joins(
    serving: Product,
) -> None:
    started = time.monotonic()
    gateway = serving.gateway_url()
    engines = {e["status"]["podIP"]: e for e in serving.ready_engines()}
    assert len(engines) == 2
    finished = "kvserve_requests_finished_total"
    finished_before = {ip: total(metrics(f"http://{ip}:8000/metrics"), finished) for ip in engines}

    streams = [Stream(gateway) for _ in range(4)]
    threads = [threading.Thread(target=s.run) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        assert s.first.wait(120), "a stream produced nothing"
    # Which replica serves which stream count: the gateway's in-flight gauge by replica.
    page = metrics(f"{gateway}/metrics")
    in_flight = {
        dict(labels)["replica"].rsplit(":", 1)[0]: value
        for (name, labels), value in page.items()
        if name == "kvserve_gateway_in_flight_requests" and value
    }
    assert sum(in_flight.values()) == 4 and set(in_flight) <= set(engines), in_flight
    victim_ip = max(in_flight, key=lambda ip: in_flight[ip])
    victim = engines[victim_ip]["metadata"]["name"]
    survivor = next(e for ip, e in engines.items() if ip != victim_ip)
    assert serving.runner.kill(NS, victim), f"no running process in {victim}"

    # New requests go to the others (the gateway retries a dead replica before any output).
    for _ in range(3):
        answer = client(gateway).chat.completions.create(
            model=DEMO_MODEL_NAME,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=8,
        )
        assert answer.choices[0].message.content

    for t in threads:
        t.join(timeout=300)
    assert all(s.error is None for s in streams), [s.error for s in streams]
    assert all(s.lines and s.lines[-1] == "[DONE]" for s in streams), [
        s.lines[-2:] for s in streams
    ]
    failed = [s for s in streams if s.errored]
    assert len(failed) == in_flight[victim_ip], (in_flight, [s.lines[-2:] for s in streams])
    assert all(s.finish_reason == "length" for s in streams if not s.errored)

    # The runner reports the killed container (exit 137) and the pod Failed; the
    # ReplicaSet replaces it, the runner runs the new pod, and the gateway routes to it.
    dead = serving.get("pod", victim)
    assert dead is not None and dead["status"]["phase"] == "Failed", dead and dead["status"]
    (engine_status,) = dead["status"]["containerStatuses"]
    assert engine_status["state"]["terminated"]["exitCode"] == 137

    def replacement() -> dict[str, Any] | None:
        names = {victim, survivor["metadata"]["name"]}
        fresh = [e for e in serving.ready_engines() if e["metadata"]["name"] not in names]
        return fresh[0] if fresh else None

    try:
        new = poll("a Ready replacement pod", replacement, timeout=START_TIMEOUT)
        assert new is not None
        poll("the gateway routing to 2 healthy replicas", lambda: routable(gateway) == 2, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{serving.state()}") from None
    serving.timings["replacement ready"] = time.monotonic() - started
    # The survivor finished its streams; it and a replacement that joined meanwhile served
    # the 3 requests.
    survivor_ip = survivor["status"]["podIP"]
    served = total(metrics(f"http://{survivor_ip}:8000/metrics"), finished) + total(
        metrics(f"{serving.engine_url(new)}/metrics"), finished
    )
    assert served - finished_before[survivor_ip] == in_flight[survivor_ip] + 3
    new_url = f"{serving.engine_url(new)}/metrics"
    for _ in range(2):  # round robin: one of two consecutive requests is the new pod's
        client(gateway).chat.completions.create(
            model=DEMO_MODEL_NAME,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=16,
        )
    assert total(metrics(new_url), finished) >= 1
    serving.cluster.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")
