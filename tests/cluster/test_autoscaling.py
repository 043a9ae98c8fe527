"""Scale from zero and autoscaling on the replicas' real queue, through the gateway pod.

The chart, the operator and an ``InferenceModel`` of the bundled demo model as in
test_whole_product.py (tests/support/product.py), with ``spec.autoscaling`` on:
``minReplicas: 0``, ``maxReplicas: 2``, a target of 1 waiting request per replica, and
short windows so that the whole story fits in a test run. The engine runs one sequence
at a time (``maxNumSeqs: 1``), so concurrent streams make a real waiting queue.

- from zero: the model starts with no pod; a request through the gateway is held (the
  gateway's ``kvserve_gateway_held_requests``, which the operator reads from the gateway
  pod), the operator scales 0→1, and the request is answered once the pod is Ready; the
  gateway's queue-wait histogram shows the wait (the cold start);
- on the queue: looping streams make the replica's ``kvserve_num_requests_waiting``
  rise; the operator scales 1→2, the new pod joins the gateway and serves, the queue
  drains; after the load and the scale-down delay it is back at 1;
- Prometheus: a real ``prometheus`` (when on PATH; else that test skips), started before
  the model, finds the engine and gateway pods with Kubernetes service discovery (role
  ``pod`` against the test API server, the ``prometheus.io/*`` annotations the operator
  and the chart put on the pods) and scrapes them on their pod IPs; every dashboard
  query and every SLO recording rule returns data for the traffic above;
- to zero: ``scaleToZeroAfterSeconds`` without a request, the operator scales 1→0.

Each test prints its timeline whatever pytest captures. Each starts where the one
before left the model, and still runs alone (from zero the first request scales it up).
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvserve.demo_model import DEMO_MODEL_NAME
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner
from tests.support.product import (
    START_TIMEOUT,
    Product,
    Stream,
    StreamLoop,
    install,
    metrics,
    problems,
    show,
    total,
)
from tests.support.prometheus import (
    RULES,
    Prometheus,
    dashboard_queries,
    recording_rules,
    start_prometheus,
)
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "kvserve-autoscaling"
RELEASE = "as"
MODEL = "travel"
AUTOSCALING = {
    "enabled": True,
    "minReplicas": 0,
    "maxReplicas": 2,
    "metric": "queueDepth",
    "target": 1,
    # Short windows: this test's whole story in about two cold starts.
    "scaleUpStabilizationSeconds": 2,
    "scaleDownDelaySeconds": 4,
    # Longer than the Prometheus test between the last request and the last test.
    "scaleToZeroAfterSeconds": 15,
}
VALUES = {
    "operator": {"autoscaleIntervalSeconds": 1},
    # A held request waits out the cold start (an engine pod importing torch and loading
    # the model on a busy machine) instead of the default 30 s.
    "gateway": {"config": {"admission": {"queue_timeout_seconds": START_TIMEOUT}}},
}
# On 1 replica one stream runs and 3 wait: the queue asks for 3 replicas (2, the most).
# On 2, two run and 2 wait: still 2. (With fewer streams the second replica would empty
# the queue and the rule, an average-value target like the HPA's, would take it away.)
LOAD_STREAMS = 4
# Long enough that a stream's time is the engine's, not the round trip's: the waiting
# queue then holds the other streams most of the time (12 tokens made a queue only while
# each engine pod ran more threads than it had CPUs, which made every step crawl).
LOAD_TOKENS = 96
LOOP_LIMIT = 200  # bounds the load if a phase hangs (the phase's own wait fails first)
HELD = "kvserve_gateway_held_requests"
WAITED = "kvserve_gateway_queue_wait_seconds"
WAITING = "kvserve_num_requests_waiting"
FINISHED = "kvserve_requests_finished_total"


def scrape_config(cluster: Cluster) -> dict[str, Any]:
    """Kubernetes service discovery of the namespace's pods, kept by their
    ``prometheus.io/scrape`` annotation and scraped at their pod IP and annotated port,
    labelled ``namespace`` and ``pod`` as the chart's PodMonitor labels them."""
    meta = "__meta_kubernetes_pod_"
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "kubernetes_sd_configs": [
                    {
                        "role": "pod",
                        # The test API server's admin credentials and CA.
                        "kubeconfig_file": str(cluster.kubeconfig),
                        "namespaces": {"names": [NS]},
                    }
                ],
                "relabel_configs": [
                    {
                        "source_labels": [f"{meta}annotation_prometheus_io_scrape"],
                        "regex": "true",
                        "action": "keep",
                    },
                    {
                        "source_labels": [f"{meta}phase"],
                        "regex": "Pending|Succeeded|Failed",
                        "action": "drop",
                    },
                    {
                        "source_labels": [f"{meta}ip", f"{meta}annotation_prometheus_io_port"],
                        "regex": r"(.+);(\d+)",
                        "replacement": "$1:$2",
                        "target_label": "__address__",
                    },
                    {
                        "source_labels": [f"{meta}annotation_prometheus_io_path"],
                        "regex": "(.+)",
                        "target_label": "__metrics_path__",
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": [f"{meta}name"], "target_label": "pod"},
                ],
            }
        ],
    }


@pytest.fixture(scope="module")
def prometheus(
    k8s_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus | None]:
    """Started before the product, so that it sees all the traffic: the one
    tests/cluster/build.py builds with the plane, else ``prometheus`` on PATH; None
    without one with Kubernetes service discovery (Debian's package has none)."""
    built = k8s_cluster.bins.prometheus
    binary = built if built.is_file() else shutil.which("prometheus")
    if binary is None:
        yield None
        return
    try:
        workdir = tmp_path_factory.mktemp("prometheus")
        prom = start_prometheus(workdir, scrape_config(k8s_cluster), binary)
    except AssertionError as exc:
        if "field kubernetes_sd_configs not found" not in str(exc):
            raise
        yield None
        return
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def product(
    k8s_cluster: Cluster,
    pod_runner: PodRunner,
    prometheus: Prometheus | None,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Product]:
    workdir = tmp_path_factory.mktemp("autoscaling")
    with install(k8s_cluster, pod_runner, workdir, NS, RELEASE, MODEL, VALUES) as p:
        started = time.monotonic()
        p.apply_model(0, engine={"maxNumSeqs": 1}, autoscaling=AUTOSCALING)
        # The gateway knows the model (its Service) with no replica.
        p.wait_settled(0, "the InferenceModel at zero replicas, the gateway up")
        p.timings["at zero"] = time.monotonic() - started
        try:
            yield p
        finally:
            timings = ", ".join(f"{k} {v:.1f} s" for k, v in p.timings.items())
            show(request, f"\nautoscaling: {timings}")


@dataclass
class Timeline:
    """What a watch thread saw, as changes: (seconds into the phase, what, old → new)."""

    product: Product
    started: float = field(default_factory=time.monotonic)
    events: list[str] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def at(self) -> float:
        return time.monotonic() - self.started

    def note(self, what: str, value: Any, why: str | None = None) -> None:
        if self.last.get(what, "-") != value:
            because = f" ({why})" if why else ""
            self.events.append(
                f"{self.at():6.1f} s  {what}: {self.last.get(what, '-')} -> {value}{because}"
            )
            self.last[what] = value

    def sample(self) -> None:
        p = self.product
        im = p.get("inferencemodel", MODEL) or {}
        scaled = (im.get("status") or {}).get("autoscaling") or {}
        self.note("desired replicas", scaled.get("desiredReplicas"), scaled.get("reason"))
        ready = p.ready_engines()
        self.note("ready pods", len(ready))
        waiting = 0.0
        for pod in ready:
            # A pod stopping right now has no queue left to count.
            with contextlib.suppress(httpx.TransportError):
                waiting += total(metrics(f"{p.engine_url(pod)}/metrics"), WAITING)
        self.note("engines' waiting queue", waiting)
        try:
            page = metrics(f"{p.gateway_url()}/metrics")
        except httpx.TransportError:
            return
        self.note("gateway held", total(page, HELD, model=DEMO_MODEL_NAME))
        self.note("gateway routable", p.routable())

    def start(self) -> Timeline:
        def run() -> None:
            while not self.stop.is_set():
                self.sample()
                self.stop.wait(0.5)

        self.thread = threading.Thread(target=run, name="timeline", daemon=True)
        self.thread.start()
        return self

    def mark(self, line: str) -> None:
        self.events.append(f"{self.at():6.1f} s  ** {line}")

    def wait(self, what: str, ok: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
        try:
            poll(what, ok, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n--- timeline\n" + "\n".join(self.events) + f"\n{self.product.state()}"
            ) from None
        self.mark(what)

    def finish(self, request: pytest.FixtureRequest, title: str) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        show(request, f"\n{title}:\n" + "\n".join(self.events))


def deployment_replicas(p: Product) -> int | None:
    deployment = p.get("deployment", MODEL) or {}
    return (deployment.get("spec") or {}).get("replicas")


def test_a_request_at_zero_replicas_is_answered_after_the_cold_start(
    product: Product, request: pytest.FixtureRequest
) -> None:
    p = product
    if deployment_replicas(p) != 0:
        p.wait_settled(0, "scaled to zero (no requests for scaleToZeroAfterSeconds)")
    gateway = p.gateway_url()
    # The gateway learns the model from its Service's EndpointSlice, which may come a
    # moment after the Deployment settles; a request before that is a 404 (unknown model),
    # not a hold. Its held gauge has a series for every model it knows.
    poll(
        "the gateway to know the model",
        lambda: any(
            n == HELD and dict(ls).get("model") == DEMO_MODEL_NAME
            for n, ls in metrics(f"{gateway}/metrics")
        ),
        timeout=60,
    )
    before = metrics(f"{gateway}/metrics")
    timeline = Timeline(p).start()
    try:
        stream = Stream(gateway, 8)
        thread = threading.Thread(target=stream.run, daemon=True)
        thread.start()
        timeline.wait(
            "the request held at the gateway",
            lambda: total(metrics(f"{gateway}/metrics"), HELD, model=DEMO_MODEL_NAME) == 1,
            timeout=60,
        )
        held_at = time.monotonic()  # it was held by then
        timeline.wait("the operator scaling 0 -> 1", lambda: deployment_replicas(p) == 1, 60)
        # The last moment the model surely had no Ready pod: the request was still held.
        unready_at = held_at

        def pod_ready() -> bool:
            nonlocal unready_at
            checked = time.monotonic()
            if p.ready_engines():
                return True
            unready_at = checked
            return False

        timeline.wait("the pod Ready", pod_ready)
        thread.join(timeout=START_TIMEOUT)
        assert not thread.is_alive(), "the held request was never answered"
        cold_start = timeline.at()
        timeline.mark(f"answered: cold start {cold_start:.1f} s")
        assert stream.problem() is None, stream.problem()
    finally:
        timeline.finish(request, "scale from zero")
    after = metrics(f"{gateway}/metrics")
    assert total(after, HELD, model=DEMO_MODEL_NAME) == 0
    # The wait shows in the gateway's queue-wait histogram: one more admission, of at
    # least the time the test saw it held with no Ready pod (a bound, not a speed).
    assert total(after, f"{WAITED}_count") - total(before, f"{WAITED}_count") == 1
    waited = total(after, f"{WAITED}_sum") - total(before, f"{WAITED}_sum")
    assert waited >= unready_at - held_at > 0, (waited, unready_at - held_at)
    p.timings["cold start"] = cold_start


def test_the_real_queue_scales_up_the_new_pod_serves_then_down_to_zero(
    product: Product, request: pytest.FixtureRequest
) -> None:
    p = product
    gateway = p.gateway_url()
    started = time.monotonic()
    timeline = Timeline(p).start()
    stop = threading.Event()
    loops = [StreamLoop(gateway, LOAD_TOKENS, stop, LOOP_LIMIT) for _ in range(LOAD_STREAMS)]
    try:
        first = {e["metadata"]["name"] for e in p.ready_engines()}
        for loop in loops:
            loop.start()
        timeline.mark(f"load on: {LOAD_STREAMS} looping streams ({len(first)} ready pods)")
        timeline.wait("the engines' waiting queue at 1 or more", lambda: timeline.last.get(
            "engines' waiting queue", 0) >= 1)  # fmt: skip
        timeline.wait("the operator scaling to 2", lambda: deployment_replicas(p) == 2)

        def joined() -> bool:
            # A pod that was not serving when the queue built up, Ready, routed to and
            # having served.
            fresh = [e for e in p.ready_engines() if e["metadata"]["name"] not in first]
            return (
                len(p.ready_engines()) == 2
                and p.routable() == 2
                and any(total(metrics(f"{p.engine_url(e)}/metrics"), FINISHED) >= 1 for e in fresh)
            )

        timeline.wait("the new pod Ready, routed to and serving", joined)
        stop.set()
        timeline.mark("load off")
        for loop in loops:
            loop.join(timeout=120)
        assert not any(loop.running for loop in loops), "a stream loop did not stop"
        timeline.wait("the queue drained", lambda: timeline.last.get("engines' waiting queue") == 0)
        timeline.wait("scaled down to 1 after the delay", lambda: deployment_replicas(p) == 1)
        p.wait_settled(1, "one engine pod left, the gateway routing to it")
        timeline.mark("one pod left")
    finally:
        stop.set()
        timeline.finish(request, "autoscaling on the engines' queue")
    assert not problems(loops), problems(loops)
    p.timings["queue: up to 2 and down to 1"] = time.monotonic() - started


def test_prometheus_finds_the_pods_and_the_dashboards_and_slo_rules_have_data(
    product: Product, prometheus: Prometheus | None, request: pytest.FixtureRequest
) -> None:
    if prometheus is None:
        pytest.skip(
            "needs a `prometheus` with Kubernetes service discovery: tests/cluster/build.py "
            "builds one with Go; Debian's package has none"
        )
    p, prom = product, prometheus
    started = time.monotonic()
    # One more request: a replica stays up (scaleToZeroAfterSeconds counts from it) while
    # the gauges are read, and this test also runs alone.
    assert Stream(p.gateway_url(), 4).run().problem() is None
    # Found by service discovery, scraped on pod IPs: the gateway pod and the engines.
    up = {
        (t["labels"]["pod"], t["health"])
        for t in prom.api("targets")["activeTargets"]
        if t["labels"].get("namespace") == NS
    }
    ready = {e["metadata"]["name"] for e in p.ready_engines()}
    assert ready and {(pod, "up") for pod in ready} <= up, (ready, up)
    gateway_pods = {pod for pod, health in up if "gateway" in pod and health == "up"}
    assert gateway_pods, up
    # Until Prometheus holds the gateway's current count (never a bare sleep).
    answered = total(metrics(f"{p.gateway_url()}/metrics"), "kvserve_gateway_requests_total")
    poll(
        "Prometheus holding the gateway's request count",
        lambda: prom.value(f'sum(kvserve_gateway_requests_total{{namespace="{NS}"}})') == answered,
        timeout=60,
    )
    engines = sorted({rp.name for rp in p.running()})
    values = {
        "namespace": NS,
        "model": DEMO_MODEL_NAME,
        "pod": "(" + "|".join(engines) + ")",  # a multi-value selection, Grafana's regex form
        "__rate_interval": "10m",  # holds all of this module's traffic
        "__range": "10m",
    }
    report, empty = [], []
    for where, expr in dashboard_queries(values):
        result = prom.query(expr)
        report.append(f"  {where}: {len(result)} series")
        if not result:
            empty.append(f"{where}: {expr}")
    # The generated rules evaluate on this data: every recording rule has a value.
    poll(
        "every rule evaluated once",
        lambda: all(
            not r["lastEvaluation"].startswith("0001")
            for g in prom.api("rules")["groups"]
            for r in g["rules"]
        ),
        timeout=30,
    )
    for record in recording_rules():
        result = prom.query(f'{record}{{model="{DEMO_MODEL_NAME}"}}')
        report.append(f"  rule {record}: {len(result)} series")
        if not result:
            empty.append(f"rule {record}")
    show(request, "\nPrometheus with Kubernetes SD:\n" + "\n".join(report))
    assert not empty, "no data:\n" + "\n".join(empty)
    p.timings["prometheus"] = time.monotonic() - started


def test_no_request_for_the_idle_time_scales_to_zero(
    product: Product, request: pytest.FixtureRequest
) -> None:
    p = product
    started = time.monotonic()
    if deployment_replicas(p) == 0:  # alone: a request scales it up first
        assert Stream(p.gateway_url(), 8).run().problem() is None
    timeline = Timeline(p).start()
    try:
        timeline.wait("scaled to zero after the idle time", lambda: deployment_replicas(p) == 0)
        # The pod then stops as on any scale-down (preStop, drain), in the background.
        timeline.wait("the gateway routing to no replica", lambda: p.routable() == 0, 60)
    finally:
        timeline.finish(request, "scale to zero")
    p.timings["idle to zero"] = time.monotonic() - started
