"""A tensor-parallel replica as two pods, leader and worker, answering through the
gateway: the chart, the operator's LeaderWorkerSet (``spec.nodes: 2``), and the pods of
its templates running their real commands on the pod runner's node (loopback pod IPs).

No LeaderWorkerSet controller runs on the test control plane, so this test does its
part: it makes the group's two pods from the stored LeaderWorkerSet's templates, with
the names, labels and ``LWS_*`` environment the controller gives them (the leader's
address is its pod IP, where the controller would give a DNS name). Everything else is
the product's own: the leader (`kvserve serve`, node 0) loads rank 0 and serves the API,
the worker pod's `kvserve serve` (node 1) runs rank 1 and answers /health, the Service
selects only the leader, and the gateway finds it through its EndpointSlice.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvserve.demo_model import DEMO_MODEL_NAME, corpus
from kvserve_operator.constants import LWS_CRD_NAME
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner
from tests.support.lws import install_crd
from tests.support.product import (
    KEY,
    QUESTION,
    START_TIMEOUT,
    Product,
    inference_model,
    install,
    is_ready,
    show,
)
from tests.support.waiting import poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "kvserve-tp"
RELEASE = "tp"
MODEL = "travel"
REQUEST = corpus.HotelRequest("Kyoto", "hotel", 200, ("onsen",))
LWS = "leaderworkerset.sigs.k8s.io"


@pytest.fixture(scope="module")
def product(
    k8s_cluster: Cluster,
    pod_runner: PodRunner,
    lws_crd_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Product]:
    install_crd(k8s_cluster, lws_crd_file)
    workdir = tmp_path_factory.mktemp("tensor-parallel")
    try:
        with install(k8s_cluster, pod_runner, workdir, NS, RELEASE, MODEL) as p:
            try:
                yield p
            finally:
                timings = ", ".join(f"{k} {v:.1f} s" for k, v in p.timings.items())
                show(request, f"\ntensor-parallel replica on the pod runner: {timings}")
    finally:
        k8s_cluster.kubectl("delete", "crd", LWS_CRD_NAME, "--ignore-not-found", check=False)


def group_pod(
    lws: dict[str, Any], template: str, name: str, worker_index: int, leader_address: str
) -> dict[str, Any]:
    """One pod of group 0, as the LeaderWorkerSet controller makes it from a template."""
    meta = lws["metadata"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    tmpl = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"][template])
    labels = {
        **tmpl["metadata"].get("labels", {}),
        f"{LWS}/name": meta["name"],
        f"{LWS}/group-index": "0",
        f"{LWS}/worker-index": str(worker_index),
    }
    env = [
        {"name": "LWS_LEADER_ADDRESS", "value": leader_address},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(worker_index)},
    ]
    for c in tmpl["spec"]["containers"]:
        c["env"] = [*c.get("env", []), *env]
    owner = {
        "apiVersion": lws["apiVersion"],
        "kind": lws["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": tmpl["metadata"].get("annotations", {}),
            "ownerReferences": [owner],
        },
        "spec": tmpl["spec"],
    }


def test_a_two_pod_replica_answers_through_the_gateway(product: Product) -> None:
    started = time.monotonic()
    manifest = inference_model(NS, MODEL, 1)
    manifest["spec"]["nodes"] = 2  # gpus 0: one rank a pod, --tensor-parallel-size 2
    product.cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    lws = poll("the operator's LeaderWorkerSet", lambda: product.get("lws", MODEL), timeout=60)
    assert product.get("deployment", MODEL) is None
    args = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    assert "--tensor-parallel-size" in next(c for c in args if c["name"] == "engine")["args"]

    # The leader binds the rendezvous on its own address ("127.0.0.1" becomes the pod IP
    # on the runner); the worker is given the leader's pod IP.
    leader = group_pod(lws, "leaderTemplate", f"{MODEL}-0", 0, "127.0.0.1")
    product.cluster.kubectl("apply", "-f", "-", input=json.dumps(leader))

    def leader_ip() -> str | None:
        pod = product.get("pod", f"{MODEL}-0") or {}
        return (pod.get("status") or {}).get("podIP")

    ip = poll("the leader's pod IP", leader_ip, timeout=START_TIMEOUT)
    worker = group_pod(lws, "workerTemplate", f"{MODEL}-0-1", 1, ip)
    product.cluster.kubectl("apply", "-f", "-", input=json.dumps(worker))

    def both_ready() -> bool:
        pods = {p["metadata"]["name"]: p for p in product.engine_pods()}
        return len(pods) == 2 and all(is_ready(p) for p in pods.values())

    try:
        poll("leader and worker Ready", both_ready, timeout=START_TIMEOUT)
        product.timings["group ready"] = time.monotonic() - started
        poll("the gateway routing to the leader", lambda: product.routable() == 1, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{product.state()}") from None

    # Only the leader is an endpoint of the model's Service (the worker serves no API).
    selector = f"kubernetes.io/service-name={MODEL}"
    out = product.cluster.kubectl("get", "endpointslices", "-n", NS, "-l", selector, "-o", "json")
    slices = json.loads(out.stdout)["items"]
    addresses = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert addresses == {ip}

    client = openai.OpenAI(
        base_url=f"{product.gateway_url()}/v1", api_key=KEY, timeout=120, max_retries=0
    )
    answer = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=128,
    )
    text = answer.choices[0].message.content or ""
    assert corpus.check_answer(REQUEST, text), text
    product.timings["answered"] = time.monotonic() - started
