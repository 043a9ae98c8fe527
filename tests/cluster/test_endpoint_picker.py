"""kvserve replicas behind the Gateway API Inference Extension's own endpoint picker.

An ``InferenceModel`` with ``spec.inferencePool.enabled`` (2 replicas of the bundled demo
model, run for real by the pod runner with ``--metrics-compat vllm``) gets its
``InferencePool`` from the operator, on the API server with GIE v1.3.0's CRD. GIE's
unmodified endpoint picker (``cmd/epp`` v1.3.0, built by tests/cluster/build.py) runs as
a local process against that pool with GIE's default scorers, scraping the engine pods'
real ``/metrics``; the tests ask it for an endpoint over its ext_proc gRPC API, as Envoy
does (tests/support/endpoint_picker.py), and check that

- it answers a Ready kvserve pod's ``IP:8000``, which then serves the request;
- while one replica's waiting queue is long (its real ``vllm:num_requests_waiting``, from
  streams sent straight to it with ``maxNumSeqs: 1``), it picks the other;
- a pod that is not Ready (its engine SIGSTOPped, so its readiness probe times out) is
  never picked, and is picked from again once Ready.

The endpoint picker's Service (``endpointPickerRef``) exists but routes nowhere: no
gateway runs here, the test is Envoy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.demo_model import DEMO_MODEL_NAME
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner
from tests.support.endpoint_picker import EndpointPicker, Pick
from tests.support.operator_process import (
    OPERATOR_NS,
    OPERATOR_SA,
    OperatorProcess,
    install_operator_rbac,
)
from tests.support.product import QUESTION, START_TIMEOUT, is_ready, model_pods, show
from tests.support.product import inference_model as inference_model_of
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GIE_CRD = REPO / "tests" / "cluster" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_ROLE = REPO / "operator" / "kvserve_operator" / "manifests" / "rbac-inference-pool.yaml"
POOL_ROLE_BINDING = "kvserve-operator-inference-pool"  # tests/operator expects it absent
NS = "gie-picker"
MODEL = "travel-pool"  # the InferenceModel, its Deployment and its InferencePool
PICKER_SERVICE = f"{MODEL}-epp"
# The backlog on one replica: with maxNumSeqs 1, one stream runs and the others wait;
# each asks for as many tokens as the demo model's 512-token context leaves room for.
BACKLOG_STREAMS = 8
BACKLOG_TOKENS = 384
PICKS = 6


def inference_model() -> dict[str, Any]:
    manifest = inference_model_of(
        NS,
        MODEL,
        2,
        # One sequence at a time, so that a few streams make a waiting queue.
        engine={"maxNumSeqs": 1, "drainTimeoutSeconds": 5},
    )
    manifest["spec"]["inferencePool"] = {
        "enabled": True,
        "endpointPickerRef": {"name": PICKER_SERVICE},
    }
    return manifest


def picker_service() -> dict[str, Any]:
    """What endpointPickerRef names; a gateway would send ext_proc calls to it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": PICKER_SERVICE, "namespace": NS},
        "spec": {"ports": [{"name": "grpc-ext-proc", "port": 9002, "protocol": "TCP"}]},
    }


def waiting(ip: str) -> float:
    """The engine pod's own vllm:num_requests_waiting (what the picker reads)."""
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:num_requests_waiting"
    )


@dataclass
class Pool:
    cluster: Cluster
    runner: PodRunner
    picker: EndpointPicker
    operator: OperatorProcess
    timings: dict[str, float] = field(default_factory=dict)

    def ready_pods(self) -> dict[str, str]:
        """The model's Ready pods (by the runner, from their readinessProbe): name → IP."""
        return {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in model_pods(self.cluster, NS, MODEL)
            if is_ready(p)
        }

    def state(self) -> str:
        """What a failure shows besides the processes' logs (the picker's is one)."""
        objects = self.cluster.kubectl(
            "get", "im,inferencepools,deploy,pods", "-n", NS, "-o", "wide", check=False
        )
        runner = "\n".join(self.runner.log[-40:])
        return (
            f"{objects.stdout}{objects.stderr}\n--- pod runner\n{runner}\n"
            f"--- operator\n{self.operator.logs()[-3000:]}"
        )


@pytest.fixture(scope="module")
def pool(
    k8s_cluster: Cluster,
    pod_runner: PodRunner,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Pool]:
    """The model Ready with 2 replicas, its InferencePool, and the picker holding both."""
    started = time.monotonic()
    workdir = tmp_path_factory.mktemp("endpoint-picker")
    cluster = k8s_cluster
    install_operator_rbac(cluster)
    cluster.kubectl("apply", "-f", str(POOL_ROLE))
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": POOL_ROLE_BINDING},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "kvserve-operator-inference-pool",
        },
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NS}],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(binding))
    cluster.kubectl("apply", "--server-side", "-f", str(GIE_CRD))
    cluster.kubectl(
        "wait", "--for=condition=Established",
        "crd/inferencepools.inference.networking.k8s.io", "--timeout=60s",
    )  # fmt: skip
    cluster.kubectl("create", "namespace", NS)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(picker_service()))
    operator = OperatorProcess(
        ["--reconcile-interval", "3", "--log-format", "json",
         "--engine-image", "registry.example/kvserve:test"],
        cluster.service_account_kubeconfig(OPERATOR_NS, OPERATOR_SA, workdir / "kubeconfig"),
        workdir / "operator.log",
        cluster.env(),
    )  # fmt: skip
    # The picker reads the pool and its pods with the admin kubeconfig (cluster.env()).
    picker = EndpointPicker(cluster.bins.epp, MODEL, NS, cluster.env(), workdir)
    p = Pool(cluster, pod_runner, picker, operator)
    try:
        operator.start()
        cluster.kubectl("apply", "-f", "-", input=json.dumps(inference_model()))
        # Started while the engines load: it waits for the pool, then lists its pods.
        picker.start()

        def ready() -> bool:
            im = json.loads(cluster.kubectl("get", "im", MODEL, "-n", NS, "-o", "json").stdout)
            status = im.get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            return (
                conditions.get("Ready") == "True"
                and status.get("readyReplicas") == 2
                and bool(status.get("inferencePool"))
            )

        try:
            poll("the InferenceModel Ready with 2 replicas and its pool", ready, START_TIMEOUT)
            p.timings["model ready"] = time.monotonic() - started
            picker.wait_serving()
            names = set(p.ready_pods())
            poll("the picker holding both pods", lambda: set(picker.queue_sizes()) == names)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{p.state()}") from None
        p.timings["picker ready"] = time.monotonic() - started
        yield p
    finally:
        stopping = time.monotonic()
        picker.stop()
        # While the operator still runs: it removes its finalizer from the model. The
        # runner stops the pods as a kubelet would, in the background.
        cluster.kubectl("delete", "im", MODEL, "-n", NS, "--ignore-not-found", "--timeout=60s",
                        check=False)  # fmt: skip
        operator.stop()
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        cluster.kubectl(
            "delete", "crd", "inferencepools.inference.networking.k8s.io", "--wait=false",
            "--ignore-not-found", check=False,
        )  # fmt: skip
        cluster.kubectl("delete", "clusterrolebinding", POOL_ROLE_BINDING, "--ignore-not-found",
                        check=False)  # fmt: skip
        p.timings["teardown"] = time.monotonic() - stopping
        # Shown whatever pytest captures: what each phase took on this machine (CI cost).
        timings = ", ".join(f"{k} {v:.1f} s" for k, v in p.timings.items())
        show(request, f"\nGIE endpoint picker: {timings}")


def picks(pool: Pool, n: int = PICKS) -> list[Pick]:
    return [pool.picker.pick(DEMO_MODEL_NAME) for _ in range(n)]


def picked_now(pool: Pool) -> tuple[str, str]:
    """(the pod the picker chooses now, the other one). Between equal pods it breaks the
    tie at random; the next tests take this pod away, so that what they check is a change
    of the picker's mind, not a preference it had anyway."""
    pods = pool.ready_pods()
    assert len(pods) == 2, pods
    endpoint = pool.picker.pick(DEMO_MODEL_NAME).endpoint
    chosen = next((name for name, ip in pods.items() if f"{ip}:8000" == endpoint), None)
    assert chosen is not None, (endpoint, pods)
    return chosen, next(name for name in pods if name != chosen)


def test_it_picks_a_ready_kvserve_pod_that_then_serves(pool: Pool) -> None:
    started = time.monotonic()
    pods = pool.ready_pods()
    endpoints = {f"{ip}:8000" for ip in pods.values()}
    assert len(endpoints) == 2
    # What it read from each pod's metrics: both idle.
    assert pool.picker.queue_sizes() == dict.fromkeys(pods, 0.0)

    answers = picks(pool)
    for pick in answers:
        assert pick.status is None, pick
        assert pick.endpoint in endpoints, (pick, endpoints)
        assert pick.metadata_endpoint == pick.endpoint, pick

    # Envoy's next step: send the body the picker handed back to that endpoint.
    pick = pool.picker.pick(DEMO_MODEL_NAME, content=QUESTION, max_tokens=16)
    assert pick.endpoint in endpoints, pick
    body = json.loads(pick.body)
    assert body["model"] == DEMO_MODEL_NAME and body["messages"][0]["content"] == QUESTION
    resp = httpx.post(f"http://{pick.endpoint}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]
    pool.timings["ready pod picked"] = time.monotonic() - started


@dataclass
class Backlog:
    """Long streamed chats sent straight to one engine pod (not through the picker), on an
    event loop of their own; ``stop`` disconnects them all and the engine aborts them."""

    url: str
    streams: int
    errors: list[str] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    thread: threading.Thread | None = None
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, name="backlog", daemon=True)
        self.thread.start()

        async def begin() -> asyncio.Task[None]:
            return asyncio.create_task(self._run())

        self.task = asyncio.run_coroutine_threadsafe(begin(), self.loop).result(timeout=10)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
            await asyncio.gather(*(self._one(client, i) for i in range(self.streams)))

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": DEMO_MODEL_NAME,
            "messages": [{"role": "user", "content": f"{QUESTION} ({i})"}],
            "stream": True,
            "max_tokens": BACKLOG_TOKENS,
            "ignore_eos": True,
        }
        try:
            async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.errors.append(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
                    return
                async for _ in resp.aiter_lines():
                    pass
        except httpx.HTTPError as exc:
            self.errors.append(repr(exc))

    def stop(self) -> None:
        async def cancel() -> None:
            assert self.task is not None
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

        if self.task is not None:
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.loop.close()


def test_a_replica_with_a_waiting_queue_is_avoided(pool: Pool) -> None:
    started = time.monotonic()
    pods = pool.ready_pods()
    busy, idle = picked_now(pool)
    backlog = Backlog(f"http://{pods[busy]}:8000", BACKLOG_STREAMS)
    backlog.start()
    try:
        # The engine's own metric first, then the picker's reading of it.
        poll(
            f"{busy}'s vllm:num_requests_waiting >= 3",
            lambda: backlog.errors or waiting(pods[busy]) >= 3,
            timeout=60,
        )
        assert not backlog.errors, backlog.errors

        def reading() -> dict[str, float] | None:
            queues = pool.picker.queue_sizes()
            return queues if queues.get(busy, 0) >= 1 else None

        seen = poll(f"the picker reading {busy}'s queue", reading, timeout=30)
        assert seen is not None and seen.get(idle) == 0, seen
        answers = picks(pool)
        # The queue lasted through the picks (it only shrinks: nothing else is sent).
        still = waiting(pods[busy])
    finally:
        backlog.stop()
    assert still >= 1, "the backlog drained before the picks were done: make it longer"
    assert [a.endpoint for a in answers] == [f"{pods[idle]}:8000"] * PICKS, (answers, seen)
    pool.timings["busy replica avoided"] = time.monotonic() - started


def test_a_pod_that_is_not_ready_is_never_picked(pool: Pool) -> None:
    started = time.monotonic()
    pods = pool.ready_pods()
    stopped, other = picked_now(pool)
    # A stopped engine answers no probe: after failureThreshold (2) probes that time out
    # (5 s each), the runner reports the pod Ready=False; the pod itself stays.
    assert pool.runner.kill(NS, stopped, signal.SIGSTOP), f"no running process in {stopped}"
    try:
        try:
            poll(f"{stopped} not Ready", lambda: stopped not in pool.ready_pods(), timeout=60)
            poll(
                f"the picker dropping {stopped}",
                lambda: set(pool.picker.queue_sizes()) == {other},
                timeout=30,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{pool.state()}") from None
        answers = picks(pool)
    finally:
        pool.runner.kill(NS, stopped, signal.SIGCONT)
    assert [a.endpoint for a in answers] == [f"{pods[other]}:8000"] * PICKS, answers

    # Ready again, it is held again: readiness alone kept it out.
    poll(f"{stopped} Ready again", lambda: stopped in pool.ready_pods(), timeout=60)
    poll(
        f"the picker holding {stopped} again",
        lambda: set(pool.picker.queue_sizes()) == set(pods),
        timeout=30,
    )
    pool.timings["not-ready pod skipped"] = time.monotonic() - started
