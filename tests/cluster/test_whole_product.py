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

import ipaddress
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvserve.demo_model import DEMO_MODEL_NAME, corpus
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner
from tests.support.product import (
    KEY,
    QUESTION,
    START_TIMEOUT,
    Product,
    Stream,
    install,
    metrics,
    show,
    total,
)
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "kvserve-e2e"
RELEASE = "wp"
MODEL = "travel"  # the InferenceModel (and its Deployment and Service)
REQUEST = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
# Long enough to be in flight when its pod dies: an engine pod computing with a thread
# per requested CPU decodes a token in ~5-15 ms here (0.05-0.2 s while it ran more
# threads than CPUs), and the demo model's context is 512 tokens.
STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def product(
    k8s_cluster: Cluster,
    pod_runner: PodRunner,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Product]:
    workdir = tmp_path_factory.mktemp("whole-product")
    with install(k8s_cluster, pod_runner, workdir, NS, RELEASE, MODEL) as p:
        try:
            yield p
        finally:
            # Shown whatever pytest captures: what each phase took on this machine (CI cost).
            timings = ", ".join(f"{k} {v:.1f} s" for k, v in p.timings.items())
            show(request, f"\nwhole product on the pod runner: {timings}")


@pytest.fixture(scope="module")
def serving(product: Product) -> Product:
    """The InferenceModel applied and Ready with 2 replicas, and the gateway routing to
    both (its replica gauge, from EndpointSlices)."""
    started = time.monotonic()
    product.apply_model(2)

    def ready() -> bool:
        im = product.get("inferencemodel", MODEL) or {}
        status = im.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return conditions.get("Ready") == "True" and status.get("readyReplicas") == 2

    try:
        poll("the InferenceModel Ready with 2 replicas", ready, timeout=START_TIMEOUT)
        product.timings["model ready"] = time.monotonic() - started
        poll("the gateway routing to 2 healthy replicas", lambda: product.routable() == 2, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{product.state()}") from None
    product.timings["routable"] = time.monotonic() - started
    return product


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


def test_pod_loss_mid_stream_fails_only_its_streams_and_the_replacement_joins(
    serving: Product,
) -> None:
    started = time.monotonic()
    gateway = serving.gateway_url()
    engines = {e["status"]["podIP"]: e for e in serving.ready_engines()}
    assert len(engines) == 2
    finished = "kvserve_requests_finished_total"
    finished_before = {ip: total(metrics(f"http://{ip}:8000/metrics"), finished) for ip in engines}

    streams = [Stream(gateway, STREAM_TOKENS) for _ in range(4)]
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
        poll("the gateway routing to 2 healthy replicas", lambda: serving.routable() == 2, 60)
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
