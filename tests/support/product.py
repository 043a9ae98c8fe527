"""The whole product installed on the test control plane, for tests that drive it.

``install`` runs the path a user takes up to a serving model: ``helm install`` of the
chart (the gateway pod on the pod runner's node), the API-key Secret, the operator as a
local process with the chart's arguments and its ServiceAccount's token (its own pod
stays a kwok fake, docs/test-cluster.md), and ``Product.serve`` applies the
``InferenceModel`` of the bundled demo model whose engine pods the runner runs. Each test
module gives its own namespace and release, so modules of one session never meet.

Also here: reading a ``/metrics`` page, streamed chats through the gateway (one, or a
bounded loop of them on a thread), and the per-phase timings a module prints whatever
pytest captures.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.demo_model import DEMO_MODEL_NAME
from tests.chart import helm, prepared_chart
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner, RunningPod, scheduling
from tests.support.demo_source import demo_model_source
from tests.support.operator_process import OperatorProcess
from tests.support.waiting import poll

KEY = "sk-whole-product-test-key-do-not-use"
QUESTION = "Hotels in Kyoto under $200 with an onsen?"
# Engines importing torch and loading the model while others serve, on a busy 2-core
# machine.
START_TIMEOUT = 240.0

Page = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics(url: str) -> Page:
    """A /metrics page as {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(page: Page, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in page.items() if n == name and labels.items() <= dict(ls).items())


def by_replica(page: Page, name: str) -> dict[str, float]:
    """A gateway metric labelled ``replica`` ("ip:port") summed per replica IP."""
    out: dict[str, float] = {}
    for (n, labels), value in page.items():
        replica = dict(labels).get("replica")
        if n == name and replica:
            ip = replica.rsplit(":", 1)[0]
            out[ip] = out.get(ip, 0.0) + value
    return out


def model_pods(cluster: Cluster, namespace: str, model: str) -> list[dict[str, Any]]:
    """An InferenceModel's pods in the API, terminating ones included."""
    out = cluster.kubectl(
        "get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={model}",
        "-o", "json",
    ).stdout  # fmt: skip
    return json.loads(out)["items"]  # type: ignore[no-any-return]


def is_ready(pod: dict[str, Any]) -> bool:
    """Ready (by the runner, from its readinessProbe) and not being deleted."""
    return pod["metadata"].get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def inference_model(
    namespace: str,
    name: str,
    replicas: int,
    engine: dict[str, Any] | None = None,
    autoscaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The demo model's InferenceModel, its pods on the pod runner's node."""
    sched = scheduling()
    spec: dict[str, Any] = {
        "model": {"source": demo_model_source(), "servedName": DEMO_MODEL_NAME},
        "replicas": replicas,
        "resources": {
            "gpus": 0,
            "cpu": "1",
            "memory": "2Gi",
            "nodeSelector": sched["nodeSelector"],
            "tolerations": sched["tolerations"],
        },
    }
    if engine:
        spec["engine"] = engine
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return {
        "apiVersion": "kvserve.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested mappings key by key (as Helm merges
    values files)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def chart_values(namespace: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    sched = scheduling()
    values: dict[str, Any] = {
        # The operator and the gateway's discovery see only this namespace: models that
        # other modules of the session left behind (being deleted) are never reconciled
        # or routed to here, even under the same served name.
        "operator": {"watchNamespaces": [namespace]},
        "gateway": {
            "replicas": 1,
            "nodeSelector": sched["nodeSelector"],
            "tolerations": sched["tolerations"],
            # Alternate strictly, so that concurrent streams land on every replica.
            "config": {"routing": {"policy": "round_robin"}},
        },
        "tests": {"enabled": False},
    }
    return merged(values, extra or {})


@dataclass
class Product:
    """The chart installed in ``namespace`` as ``release``, and one InferenceModel."""

    cluster: Cluster
    runner: PodRunner
    workdir: Path
    namespace: str
    release: str
    model: str  # the InferenceModel (and its Deployment and Service)
    operator: OperatorProcess | None = None
    gateway: str | None = None  # its URL, once found (the gateway pod stays)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def gateway_service(self) -> str:
        return f"{self.release}-kvserve-gateway"

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        proc = self.cluster.kubectl(
            "get", kind, name, "-n", self.namespace, "-o", "json", check=False
        )
        if proc.returncode != 0:
            assert "NotFound" in proc.stderr, proc.stderr
            return None
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    def engine_pods(self) -> list[dict[str, Any]]:
        """The model's pods in the API, terminating ones included."""
        return model_pods(self.cluster, self.namespace, self.model)

    def ready_engines(self) -> list[dict[str, Any]]:
        """The model's pods that are Ready (by the runner, from their readinessProbe) and
        not being deleted."""
        return [p for p in self.engine_pods() if is_ready(p)]

    def engine_url(self, pod: dict[str, Any]) -> str:
        """An engine pod's HTTP address (its loopback pod IP)."""
        return f"http://{pod['status']['podIP']}:8000"

    def running(self) -> list[RunningPod]:
        """The runner's pods of this model, past and present (it keeps every pod it ran,
        with its containers' exit codes, after the pod object is gone)."""
        return [
            rp
            for rp in list(self.runner.pods.values())
            if rp.namespace == self.namespace
            and rp.pod["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == self.model
        ]

    def gateway_log(self) -> str:
        """What the gateway pods printed so far (the runner's logs of their containers)."""
        texts = []
        for rp in list(self.runner.pods.values()):
            if rp.namespace == self.namespace and rp.name.startswith(f"{self.gateway_service}-"):
                for c in rp.main:
                    if c.proc is not None and c.proc.log.exists():
                        texts.append(c.proc.log.read_text(errors="replace"))
        return "\n".join(texts)

    def gateway_url(self) -> str:
        """The gateway Service's ready endpoint, from its EndpointSlice (Services route
        nowhere here, but the endpoint is the gateway pod's own IP)."""
        if self.gateway is not None:
            return self.gateway

        def endpoint() -> str | None:
            out = self.cluster.kubectl(
                "get", "endpointslices", "-n", self.namespace, "-l",
                f"kubernetes.io/service-name={self.gateway_service}", "-o", "json",
            ).stdout  # fmt: skip
            for eps in json.loads(out)["items"]:
                port = next(p["port"] for p in eps.get("ports") or [] if p["name"] == "http")
                for ep in eps.get("endpoints") or []:
                    if ep.get("conditions", {}).get("ready"):
                        return f"http://{ep['addresses'][0]}:{port}"
            return None

        url = poll("a ready endpoint of the gateway Service", endpoint, timeout=START_TIMEOUT)
        assert url is not None
        self.gateway = url
        return url

    def routable(self) -> float:
        """How many replicas of the demo model the gateway counts healthy (0 while the
        gateway does not answer)."""
        try:
            page = metrics(f"{self.gateway_url()}/metrics")
        except httpx.TransportError:
            return 0
        return total(page, "kvserve_gateway_replicas", model=DEMO_MODEL_NAME, state="healthy")

    def apply_model(
        self,
        replicas: int,
        engine: dict[str, Any] | None = None,
        autoscaling: dict[str, Any] | None = None,
    ) -> None:
        manifest = inference_model(self.namespace, self.model, replicas, engine, autoscaling)
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def patch_model(self, spec: dict[str, Any]) -> None:
        """Merge ``spec`` into the InferenceModel, and return once the operator has applied
        it (``status.observedGeneration``): until then its Deployment still shows the old
        template, which ``settled`` would take for a finished rollout."""
        patched = self.cluster.kubectl(
            "patch", "inferencemodel", self.model, "-n", self.namespace, "--type", "merge",
            "-p", json.dumps({"spec": spec}), "-o", "json",
        )  # fmt: skip
        generation = int(json.loads(patched.stdout)["metadata"]["generation"])

        def applied() -> bool:
            im = self.get("inferencemodel", self.model) or {}
            return int((im.get("status") or {}).get("observedGeneration") or 0) >= generation

        poll("the operator to apply the patched spec", applied, timeout=START_TIMEOUT)

    def settled(self, replicas: int) -> bool:
        """Exactly ``replicas`` pods, all Ready and of the Deployment's current template;
        no old pod left in the API or running here; the gateway routing to all of them."""
        deployment = self.get("deployment", self.model)
        if deployment is None:
            return False
        status = deployment.get("status") or {}
        meta = deployment["metadata"]
        # The API leaves out counts that are 0.
        if (
            deployment["spec"].get("replicas") != replicas
            or status.get("observedGeneration") != meta.get("generation")
            or status.get("updatedReplicas", 0) != replicas
            or status.get("readyReplicas", 0) != replicas
            or status.get("replicas", 0) != replicas
        ):
            return False
        if len(self.engine_pods()) != replicas or len(self.ready_engines()) != replicas:
            return False
        alive = [rp for rp in self.running() if rp.thread is not None and rp.thread.is_alive()]
        return len(alive) == replicas and self.routable() == replicas

    def wait_settled(self, replicas: int, what: str) -> None:
        try:
            poll(what, lambda: self.settled(replicas), timeout=START_TIMEOUT)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.state()}") from None

    def state(self) -> str:
        """What a failure shows: the objects, the runner's log and the operator's."""
        objects = self.cluster.kubectl(
            "get", "im,deploy,rs,pods,endpointslices", "-n", self.namespace, "-o", "wide",
            check=False,
        )  # fmt: skip
        operator = self.operator.logs()[-4000:] if self.operator else ""
        runner = "\n".join(self.runner.log[-80:])
        return (
            f"{objects.stdout}{objects.stderr}\n--- pod runner\n{runner}\n--- operator\n{operator}"
        )


@contextmanager
def install(
    cluster: Cluster,
    runner: PodRunner,
    workdir: Path,
    namespace: str,
    release: str,
    model: str,
    values: dict[str, Any] | None = None,
) -> Iterator[Product]:
    """The chart installed (``values`` merged into ``chart_values``), the API-key Secret
    created, the operator running; on exit,
    the model, the release and the namespace deleted (the runner stops their pods as a
    kubelet would, in the background; what is left when the session ends is killed by
    PID)."""
    started = time.monotonic()
    env = cluster.env()
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(workdir / var.lower())
    p = Product(cluster, runner, workdir, namespace, release, model)
    cluster.kubectl("create", "namespace", namespace)
    # keys.source=existingSecret (the chart's default): the user creates the Secret.
    keys = {
        "keys": [
            {"tenant": "e2e", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "models": ["*"]}
        ]
    }
    (workdir / "keys.yaml").write_text(yaml.safe_dump(keys))
    cluster.kubectl(
        "create", "secret", "generic", f"{p.gateway_service}-keys", "-n", namespace,
        f"--from-file=keys.yaml={workdir / 'keys.yaml'}",
    )  # fmt: skip
    (workdir / "values.yaml").write_text(yaml.safe_dump(chart_values(namespace, values)))
    chart = prepared_chart(workdir)
    helm(cluster.bins.helm, "install", release, str(chart), "-n", namespace,
         "-f", str(workdir / "values.yaml"), env=env)  # fmt: skip
    deployment = p.get("deployment", f"{release}-kvserve-operator")
    assert deployment is not None
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    p.operator = OperatorProcess(
        c["args"],
        cluster.service_account_kubeconfig(
            namespace, f"{release}-kvserve-operator", workdir / "operator.kubeconfig"
        ),
        workdir / "operator.log",
        cluster.env(),
    )
    try:
        p.operator.start()
        p.timings["install"] = time.monotonic() - started
        yield p
    finally:
        p.operator.stop()
        cluster.kubectl("delete", "inferencemodel", model, "-n", namespace, "--wait=false",
                        check=False)  # fmt: skip
        helm(cluster.bins.helm, "uninstall", release, "-n", namespace, "--wait=false",
             env=env, check=False)  # fmt: skip
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def show(request: pytest.FixtureRequest, line: str) -> None:
    """Write ``line`` to the terminal whatever pytest captures (phase timings: CI cost)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@dataclass
class Stream:
    """One streamed chat through the gateway, read to its end: its data lines, in order."""

    gateway: str
    max_tokens: int
    lines: list[str] = field(default_factory=list)
    status: int | None = None
    error: BaseException | None = None
    first: threading.Event = field(default_factory=threading.Event)

    def run(self) -> Stream:
        body = {
            "model": DEMO_MODEL_NAME,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,  # a known length: each stream runs for a while
        }
        headers = {"authorization": f"Bearer {KEY}"}
        try:
            with httpx.stream(
                "POST", f"{self.gateway}/v1/chat/completions", json=body, headers=headers,
                timeout=120,
            ) as resp:  # fmt: skip
                self.status = resp.status_code
                if resp.status_code != 200:
                    self.lines.append(resp.read().decode(errors="replace"))
                    return self
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line.removeprefix("data: "))
                        self.first.set()
        except Exception as exc:  # reported by ``problem``
            self.error = exc
        finally:
            self.first.set()
        return self

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

    def problem(self) -> str | None:
        """None for a complete answer: HTTP 200, no error event, a finish reason
        "length" (ignore_eos), then [DONE]; else what went wrong."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        if self.status != 200:
            return f"HTTP {self.status}: {self.lines[-1:]}"
        if not self.lines or self.lines[-1] != "[DONE]":
            return f"no [DONE]: {self.lines[-2:]}"
        finish = None
        for line in self.lines[:-1]:
            chunk = json.loads(line)
            if "error" in chunk:
                return f"error event: {line}"
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
        if finish != "length":
            return f"finish reason {finish!r}: {self.lines[-2:]}"
        return None


@dataclass
class StreamLoop:
    """Streamed chats one after another on a thread, until ``stop`` is set or ``limit``
    have run (so a load never outlives its test by much): a bounded, steady load."""

    gateway: str
    max_tokens: int
    stop: threading.Event
    limit: int
    streams: list[Stream] = field(default_factory=list)
    # Set once the first stream answers (or fails): the load is on.
    started: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> StreamLoop:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set() and len(self.streams) < self.limit:
            s = Stream(self.gateway, self.max_tokens, first=self.started)
            self.streams.append(s)
            s.run()
        self.started.set()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def stopped_early(self) -> bool:
        """Whether it ran out of requests before ``stop`` (the load did not cover the
        whole phase)."""
        return len(self.streams) >= self.limit


def problems(loops: list[StreamLoop]) -> list[str]:
    return [p for loop in loops for s in loop.streams if (p := s.problem()) is not None]
