"""Scaling and rolling updates of real engine pods under load, through the gateway pod.

The chart, the operator and an ``InferenceModel`` of the bundled demo model as in
test_whole_product.py (tests/support/product.py), in a namespace of this module's own;
the engine and gateway pods run on the pod runner's node (tests/cluster/pod_runner.py).

- a rolling update (``spec.engine.maxNumSeqs``) of 2 replicas under load: six streams
  loop through the gateway for the whole rollout; none fails, the gateway stops routing
  to the old pods with streams in flight on them (its log says how many), they drain and
  exit 0, and the new ones get requests only once Ready;
- 2→3 replicas: the third pod gets requests once Ready, and none before;
- 3→1 under load: six streams loop while two pods go; none fails.

In this order each test starts where the one before left the model (each still sets its
own starting point, so any one runs alone).

What makes the last two hold is the Deployment and pod settings of
operator/kvserve_operator/render.py and the gateway's EndpointSlice discovery (see
docs/inference-model.md, "Rollouts and scale-down without failed requests").
Each test prints its timeline whatever pytest captures.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kvserve.demo_model import DEMO_MODEL_NAME
from tests.cluster.controlplane import Cluster
from tests.cluster.pod_runner import PodRunner, RunningPod
from tests.support.product import (
    Product,
    Stream,
    StreamLoop,
    by_replica,
    install,
    metrics,
    problems,
    show,
    total,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "kvserve-rollouts"
RELEASE = "ro"
MODEL = "travel"
STREAMS = 6  # concurrent streams of the load
# Each stream lasts long enough that a pod leaving the gateway has one in flight, and
# stays well inside the drain timeout (30 s), so the drain never has to abort one: 40
# tokens took 2-16 s while each engine pod ran more threads than it had CPUs; with a
# thread per requested CPU (OMP_NUM_THREADS from the operator) a token takes ~5-15 ms.
# At 240 tokens, a quiet machine's streams took ~2.5 s: a pod let go about 1 s after its
# replacement became ready, while new requests went to the replacement, had all of its
# streams finished by then in one run (0 and 0 in flight); 400 (the demo model's
# max_model_len is 512) makes that unlikelier, not impossible.
LOAD_TOKENS = 400
# Requests per stream loop at most: the loops stop when the phase ends, this only bounds
# a phase that hangs (the phase's own wait fails first).
LOOP_LIMIT = 80
SAMPLE_INTERVAL = 0.25  # how often the watch samples the gateway and the runner
FINISHED = "kvserve_requests_finished_total"
DECISIONS = "kvserve_gateway_routing_decisions_total"


@pytest.fixture(scope="module")
def product(
    k8s_cluster: Cluster,
    pod_runner: PodRunner,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Product]:
    workdir = tmp_path_factory.mktemp("rollouts")
    with install(k8s_cluster, pod_runner, workdir, NS, RELEASE, MODEL) as p:
        started = time.monotonic()
        p.apply_model(2)
        p.wait_settled(2, "the InferenceModel serving 2 replicas through the gateway")
        p.timings["2 replicas serving"] = time.monotonic() - started
        try:
            yield p
        finally:
            timings = ", ".join(f"{k} {v:.1f} s" for k, v in p.timings.items())
            show(request, f"\nrollouts: setup: {timings}")


def ensure_replicas(p: Product, replicas: int) -> None:
    """The model at ``replicas`` (each test states where it starts)."""
    if not p.settled(replicas):
        p.patch_model({"replicas": replicas})
        p.wait_settled(replicas, f"{replicas} replicas serving")


@dataclass
class PodSeen:
    """What the watch saw of one engine pod."""

    rp: RunningPod
    old: bool  # it ran before the phase began
    ready_at: float | None = None  # first seen Ready (seconds into the phase)
    # New pods: gateway routing decisions to it counted while the runner said not ready.
    routed_unready: float = 0.0
    unready_samples: int = 0  # samples that saw a new pod not yet Ready
    # Old pods: when the runner first showed it not ready with its engine still running.
    left_at: float | None = None

    @property
    def name(self) -> str:
        return self.rp.name

    def drained(self) -> str:
        """The engine's own drain line from its log ("draining N in-flight requests")."""
        proc = self.rp.main[0].proc
        text = proc.log.read_text(errors="replace") if proc is not None else ""
        found = re.search(r"draining (\d+) in-flight requests", text)
        return found.group(1) if found else "?"


@dataclass
class Watch:
    """Samples the gateway's per-replica metrics, then the runner's view of the pods,
    every SAMPLE_INTERVAL seconds on a thread.

    Read in that order, a routing decision counted at a pod that the runner shows not
    Ready afterwards (a new pod's readiness only rises) was made while it was not Ready.
    """

    product: Product
    gateway: str
    t0: float = field(default_factory=time.monotonic)
    pods: dict[str, PodSeen] = field(default_factory=dict)  # by uid
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    samples: int = 0
    before: set[str] = field(default_factory=set)  # uids of every pod the runner had run

    def __post_init__(self) -> None:
        # Pods that ran and ended before the phase are not watched.
        self.before = {rp.uid for rp in self.product.running()}
        for rp in self.product.running():
            if rp.thread is not None and rp.thread.is_alive():
                self.pods[rp.uid] = PodSeen(rp, old=True)

    def start(self) -> Watch:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(30)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                page = metrics(f"{self.gateway}/metrics")
            except httpx.TransportError:
                self.stop.wait(SAMPLE_INTERVAL)
                continue
            decisions = by_replica(page, DECISIONS)
            now = time.monotonic() - self.t0
            for rp in self.product.running():
                if rp.uid in self.before and rp.uid not in self.pods:
                    continue
                seen = self.pods.setdefault(rp.uid, PodSeen(rp, old=False))
                ready = bool(rp.main) and all(c.ready for c in rp.main)
                running = any(c.proc is not None and c.exit_code is None for c in rp.main)
                if ready and seen.ready_at is None:
                    seen.ready_at = now
                if not seen.old and not ready and not rp.deleted.is_set():
                    seen.unready_samples += 1
                    seen.routed_unready = max(seen.routed_unready, decisions.get(rp.ip, 0.0))
                gone = seen.old and rp.deleted.is_set() and running and not ready
                if gone and seen.left_at is None:
                    seen.left_at = now
            self.samples += 1
            self.stop.wait(SAMPLE_INTERVAL)

    def new(self) -> list[PodSeen]:
        return [s for s in self.pods.values() if not s.old]

    def gone(self) -> list[PodSeen]:
        """Old pods that were deleted during the phase."""
        return [s for s in self.pods.values() if s.old and s.rp.deleted.is_set()]

    def check_new_pods_routed_only_once_ready(self) -> None:
        # Not vacuous: the watch saw each new pod before it was Ready.
        unseen = [s.name for s in self.new() if not s.unready_samples]
        assert not unseen, f"the watch never saw these pods before they were Ready: {unseen}"
        early = {s.name: s.routed_unready for s in self.new() if s.routed_unready}
        assert not early, f"requests routed to pods that were not Ready: {early}"

    def check_gone_pods_drained_and_exited_0(self) -> None:
        for s in self.gone():
            assert s.left_at is not None, f"{s.name} never seen not-ready while running"
            codes = [c.exit_code for c in [*s.rp.init, *s.rp.main]]
            assert codes == [0] * len(codes), f"{s.name}: exit codes {codes}"

    def describe(self, drains: dict[str, int] | None = None) -> str:
        """Each old pod's exit, with the streams in flight on it when the gateway stopped
        routing to it (``drains``, by pod IP, from ``gateway_drains``)."""
        parts = []
        for s in self.gone():
            left = "never seen" if s.left_at is None else f"at {s.left_at:.1f} s"
            held = (
                ""
                if drains is None
                else f", {drains.get(s.rp.ip, '?')} in flight as the gateway let go"
            )
            parts.append(
                f"{s.name} not-ready {left}{held}, drained {s.drained()} after SIGTERM, exit "
                f"{s.rp.main[0].exit_code}"
            )
        return "; ".join(parts)


def gateway_drains(product: Product) -> dict[str, int]:
    """Pod IP → requests in flight there when the gateway stopped routing to it, from the
    gateway pod's log ("replica ADDRESS of model M is draining (N in flight)"). The
    gateway's own count at its own moment: the watch's samples of its in-flight gauge
    came after discovery had already let go and the streams had often ended (a 0 in 1 of
    3 runs on 2026-12-06)."""
    found: dict[str, int] = {}
    for line in product.gateway_log().splitlines():
        match = re.search(
            r"replica ([0-9.]+):\d+ of model \S+ is draining \((\d+) in flight\)", line
        )
        if match:
            found.setdefault(match.group(1), int(match.group(2)))
    return found


def load(gateway: str, stop: threading.Event) -> list[StreamLoop]:
    """STREAMS loops of streamed chats, each answering before this returns."""
    loops = [StreamLoop(gateway, LOAD_TOKENS, stop, LOOP_LIMIT).start() for _ in range(STREAMS)]
    if not all(loop.started.wait(120) for loop in loops):
        end_load(loops, stop)
        raise AssertionError("a stream of the load produced nothing")
    return loops


def end_load(loops: list[StreamLoop], stop: threading.Event) -> None:
    """Stop the loops and wait for their last streams (in a ``finally``: never raises)."""
    stop.set()
    for loop in loops:
        loop.join(180)


def check_load(loops: list[StreamLoop]) -> int:
    """No stream of the load failed, and it covered the whole phase; how many it made."""
    assert not any(loop.running for loop in loops), "a stream loop did not end"
    failed = problems(loops)
    assert not failed, failed
    assert not any(loop.stopped_early for loop in loops), (
        f"a loop ran out of its {LOOP_LIMIT} requests before the phase ended"
    )
    return sum(len(loop.streams) for loop in loops)


def gateway_counts(gateway: str) -> dict[str, float]:
    page = metrics(f"{gateway}/metrics")
    return {
        "ok": total(page, "kvserve_gateway_requests_total", model=DEMO_MODEL_NAME, status="200"),
        "retries": total(page, "kvserve_gateway_retries_total", model=DEMO_MODEL_NAME),
        "upstream errors": total(page, "kvserve_gateway_upstream_errors_total"),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def check_no_retry_was_needed(counts: dict[str, float]) -> None:
    """The gateway never sent a request to a pod that could not take it: the pod left
    its EndpointSlice (not-ready, terminating) and so the gateway's replicas during the
    preStop sleep, before SIGTERM; the retry on another replica (before any output) is
    only the safety net for a slower endpoint update."""
    assert counts["retries"] == 0 and counts["upstream errors"] == 0, counts


def shown(counts: dict[str, float]) -> str:
    return ", ".join(f"{k} +{v:.0f}" for k, v in counts.items())


def test_rolling_update_under_load_fails_no_request(
    product: Product, request: pytest.FixtureRequest
) -> None:
    ensure_replicas(product, 2)
    gateway = product.gateway_url()
    im = product.get("inferencemodel", MODEL) or {}
    current = (im["spec"].get("engine") or {}).get("maxNumSeqs")
    seqs = 48 if current == 32 else 32
    stop = threading.Event()
    before = gateway_counts(gateway)
    t0 = time.monotonic()
    loops = load(gateway, stop)
    loaded = time.monotonic() - t0
    watch = Watch(product, gateway).start()
    try:
        product.patch_model({"engine": {"maxNumSeqs": seqs}})
        product.wait_settled(2, "the rollout complete: 2 new replicas serving, old ones gone")
        settled = time.monotonic() - watch.t0
    finally:
        watch.finish()
        end_load(loops, stop)
    made = check_load(loops)
    # Both old pods were replaced by pods of the new template.
    assert len(watch.gone()) == 2, [s.name for s in watch.gone()]
    new = watch.new()
    assert len(new) == 2 and all(s.ready_at is not None for s in new), [s.name for s in new]
    for s in new:
        args = s.rp.pod["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == str(seqs), args
    watch.check_gone_pods_drained_and_exited_0()
    # The gateway let go of the old pods with streams in flight on them, which then
    # finished (no failures above): they drained rather than being cut.
    drains = gateway_drains(product)
    assert all(s.rp.ip in drains for s in watch.gone()), (drains, watch.describe())
    assert sum(drains[s.rp.ip] for s in watch.gone()) >= 1, watch.describe(drains)
    watch.check_new_pods_routed_only_once_ready()
    # The load moved onto the new pods.
    decisions = by_replica(metrics(f"{gateway}/metrics"), DECISIONS)
    assert all(decisions.get(s.rp.ip, 0) >= 1 for s in new), decisions
    counts = delta(gateway_counts(gateway), before)
    check_no_retry_was_needed(counts)
    product.timings["rollout"] = settled
    show(
        request,
        f"\nrollouts: rolling update under load (maxNumSeqs -> {seqs}): load on after "
        f"{loaded:.1f} s; rollout complete {settled:.1f} s after the patch; {made} streams, "
        f"0 failed (gateway: {shown(counts)}); {watch.describe(drains)}; new pods "
        + ", ".join(f"{s.name} Ready at {s.ready_at:.1f} s" for s in new),
    )


def test_scale_up_2_to_3_new_pod_gets_requests_once_ready(
    product: Product, request: pytest.FixtureRequest
) -> None:
    ensure_replicas(product, 2)
    gateway = product.gateway_url()
    watch = Watch(product, gateway).start()
    try:
        product.patch_model({"replicas": 3})
        product.wait_settled(3, "the third replica serving")
    finally:
        watch.finish()
    settled = time.monotonic() - watch.t0
    (new,) = watch.new()
    urls = {s.rp.ip: f"http://{s.rp.ip}:8000/metrics" for s in watch.pods.values()}
    before = {ip: total(metrics(url), FINISHED) for ip, url in urls.items()}
    for _ in range(6):  # round robin over 3 replicas: 2 each
        stream = Stream(gateway, max_tokens=8).run()
        assert stream.problem() is None, stream.problem()
    served = {ip: total(metrics(url), FINISHED) - before[ip] for ip, url in urls.items()}
    assert served[new.rp.ip] >= 1, served
    assert sum(served.values()) == 6 and all(served.values()), served
    watch.check_new_pods_routed_only_once_ready()
    product.timings["scale 2->3"] = settled
    show(
        request,
        f"\nrollouts: scale 2->3: third pod Ready and routed {settled:.1f} s after the patch; "
        f"6 requests then served per pod {sorted(served.values())} (new pod {new.name}: "
        f"{served[new.rp.ip]:.0f})",
    )


def test_scale_down_3_to_1_under_load_fails_no_request(
    product: Product, request: pytest.FixtureRequest
) -> None:
    ensure_replicas(product, 3)
    gateway = product.gateway_url()
    stop = threading.Event()
    before = gateway_counts(gateway)
    t0 = time.monotonic()
    loops = load(gateway, stop)
    loaded = time.monotonic() - t0
    watch = Watch(product, gateway).start()
    try:
        product.patch_model({"replicas": 1})
        product.wait_settled(1, "1 replica left, the others drained and gone")
        settled = time.monotonic() - watch.t0
    finally:
        watch.finish()
        end_load(loops, stop)
    made = check_load(loops)
    assert len(watch.gone()) == 2, [s.name for s in watch.gone()]
    watch.check_gone_pods_drained_and_exited_0()
    counts = delta(gateway_counts(gateway), before)
    check_no_retry_was_needed(counts)
    product.timings["scale 3->1"] = settled
    show(
        request,
        f"\nrollouts: scale 3->1 under load: load on after {loaded:.1f} s; 2 pods gone "
        f"{settled:.1f} s after the patch; {made} streams, 0 failed (gateway: {shown(counts)}); "
        f"{watch.describe()}",
    )
