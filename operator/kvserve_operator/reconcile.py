"""One idempotent reconcile per InferenceModel, plus the autoscaler's tick.

Every trigger (create, update, resume, timer, a child's event) calls the same
``Reconciler.reconcile``: read the object, render the children, server-side apply them,
read the Deployment back and write the status only if it changed. Running it twice, or
after a restart, converges to the same objects, so nothing is ever duplicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvserve_operator import metrics
from kvserve_operator.adapters import replicas_adapters
from kvserve_operator.autoscaler import (
    RUNNING,
    WAITING,
    Activity,
    Autoscaler,
    Bounds,
    Decision,
    Scrape,
    pod_metrics_url,
    scrape_samples,
)
from kvserve_operator.capacity import capacity_status
from kvserve_operator.config import OperatorConfig
from kvserve_operator.constants import (
    API_VERSION,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_CRD_NAME,
    INFERENCE_POOL_KIND,
    KIND,
    LWS_API_VERSION,
    LWS_CRD_NAME,
    LWS_KIND,
)
from kvserve_operator.kube import Kube
from kvserve_operator.render import (
    desired_replicas,
    endpoint_status,
    render_children,
    render_inference_pool,
    selector_string,
    served_name,
)
from kvserve_operator.spec import (
    AutoscalingSpec,
    InferenceModelSpec,
    SpecError,
    parse_spec,
)
from kvserve_operator.status import (
    LWS_CRD_MISSING,
    POOL_CRD_MISSING,
    POOL_FORBIDDEN,
    adapters_status,
    compute_status,
    inference_pool_status,
    rfc3339,
)

Log = logging.Logger | logging.LoggerAdapter[Any]

# The two kinds of engine workload: (apiVersion, kind).
DEPLOYMENT = ("apps/v1", "Deployment")
LWS = (LWS_API_VERSION, LWS_KIND)


def workload_of(spec: InferenceModelSpec) -> tuple[str, str]:
    """What runs the engine pods: a Deployment, or a LeaderWorkerSet with spec.nodes > 1."""
    return LWS if spec.nodes > 1 else DEPLOYMENT


# Children the drift timer may delete and create again when a hand edit cannot be merged
# with what the operator renders: no pods go with them (a Service's ClusterIP changes;
# the gateway and the InferencePool follow the pods' endpoints, not that address).
RECREATABLE_KINDS = frozenset({"Service", "PodDisruptionBudget", "ConfigMap"})


class SpecInvalid(Exception):
    """The spec got past the API server's schema but cannot be rendered."""


@dataclass(frozen=True)
class PoolOutcome:
    """The InferencePool part of a reconcile: status.inferencePool, a Ready=False
    (reason, message) when the pool could not be written, and an API error to retry."""

    status: dict[str, Any] | None
    problem: tuple[str, str] | None
    error: str | None


@dataclass
class Outcome:
    applied: bool
    status: dict[str, Any]


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        config: OperatorConfig,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.config = config
        self.now = now
        self.monotonic = monotonic
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # Per (namespace, name): the UID of the object whose history it is, and the
        # history. A model deleted and created again under the same name is a new object:
        # it must observe its windows afresh, not inherit the old one's recommendations.
        self._autoscalers: dict[tuple[str, str], tuple[str, Autoscaler]] = {}

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(
        self,
        namespace: str,
        name: str,
        trigger: str,
        logger: Log,
    ) -> Outcome | None:
        """Bring the children of one InferenceModel to its spec; None when it is gone."""
        started = time.perf_counter()
        with self._lock(namespace, name):
            try:
                outcome = self._reconcile(namespace, name, logger)
            except SpecInvalid:
                metrics.RECONCILES.labels(trigger, "error").inc()
                metrics.RECONCILE_ERRORS.labels("spec").inc()
                raise
            except ApiException:
                metrics.RECONCILES.labels(trigger, "error").inc()
                metrics.RECONCILE_ERRORS.labels("api").inc()
                raise
            finally:
                metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(trigger, "ok" if outcome else "gone").inc()
        return outcome

    def _reconcile(self, namespace: str, name: str, logger: Log) -> Outcome | None:
        im = self.kube.get(API_VERSION, KIND, namespace, name)
        if im is None or im["metadata"].get("deletionTimestamp"):
            # Deleted: garbage collection removes the children (ownerReferences).
            self._autoscalers.pop((namespace, name), None)
            with contextlib.suppress(KeyError):  # never set for this object
                metrics.DESIRED_REPLICAS.remove(namespace, name)
            return None
        meta = im["metadata"]
        previous: dict[str, Any] = im.get("status") or {}
        generation = int(meta.get("generation") or 0)
        try:
            spec = parse_spec(im.get("spec") or {})
            autoscaled = (previous.get("autoscaling") or {}).get("desiredReplicas")
            if not spec.autoscaling.enabled:
                autoscaled = None
            replicas = desired_replicas(
                spec, autoscaled if isinstance(autoscaled, int) else None, self.replica_floor()
            )
            children = render_children(
                name, namespace, meta["uid"], spec, self.config.render, replicas
            )
        except SpecError as invalid:
            # Past the API server's schema but not renderable: say so in status and stop
            # retrying until the spec changes.
            deployment = self._get_optional(*DEPLOYMENT, namespace, name) or self._get_optional(
                *LWS, namespace, name
            )
            # observedGeneration: this generation was seen and acted on (refused), so a
            # client waiting for it reads the refusal instead of waiting forever.
            status = self._status(
                generation,
                int((deployment or {}).get("spec", {}).get("replicas") or 0),
                deployment,
                previous,
                f"invalid spec: {invalid}",
            )
            self._write_status(namespace, name, previous, status)
            raise SpecInvalid(str(invalid)) from invalid

        metrics.DESIRED_REPLICAS.labels(namespace, name).set(replicas)
        error: str | None = None
        child_refused = False  # the API server refused a child as invalid: the spec must change
        applied = False
        workload = workload_of(spec)
        before = self._get_optional(*workload, namespace, name)
        refused = self._refusal(spec)
        if refused is not None:
            # Nothing is rendered (what exists already is left as it is) until the API
            # server serves what the spec needs; the drift timer looks again.
            pool = PoolOutcome(previous.get("inferencePool"), refused, None)
        else:
            try:
                for child in children:
                    self._apply_child(child, logger)
                self._remove_other_workload(namespace, name, workload, logger)
                applied = True
            except ApiException as exc:
                child_refused = exc.status == 422
                error = f"apply failed: {_api_reason(exc)}"
                logger.error("reconcile of %s/%s failed: %s", namespace, name, error)
            pool = self._inference_pool(namespace, name, meta["uid"], spec, previous, logger)
            if pool.error is not None and error is None:
                error = pool.error

        deployment = self.kube.get(*workload, namespace, name)
        if deployment is None and refused is not None:
            # Nothing rendered: the counts are those of the workload still running (a
            # Deployment left as it was while the LeaderWorkerSet it should become waits).
            other = DEPLOYMENT if workload == LWS else LWS
            deployment = self._get_optional(*other, namespace, name)
        # Applied, or refused for good (by the API server, or until it serves
        # LeaderWorkerSets): this generation was acted on. Only a transient API error
        # leaves the generation to a retry.
        acted = applied or child_refused or refused is not None
        status = self._status(
            generation if acted else previous.get("observedGeneration", 0),
            replicas,
            deployment,
            previous,
            error,
            pool.problem,
            workload[1] if deployment is None else None,  # else its own kind
            template_changed=_template_changed(before, deployment),
        )
        status["selector"] = selector_string(name)
        status["endpoint"] = endpoint_status(name, namespace, self.config.render)
        status.update(self._capacity(namespace, spec))
        status["adapters"] = adapters_status(spec, self._replicas_adapters(namespace, name, spec))
        status["inferencePool"] = pool.status
        if not spec.autoscaling.enabled:
            # Its history goes too: turned on again, it starts afresh (from minReplicas,
            # each window observed in full), as for a new model.
            self._autoscalers.pop((namespace, name), None)
            if previous.get("autoscaling") is not None:
                status["autoscaling"] = None  # merge patch: removed
        self._write_status(namespace, name, previous, status)
        if child_refused:  # past the CRD's schema, but not what the API server takes in a child
            assert error is not None
            raise SpecInvalid(error)
        if error is not None:
            raise ApiException(status=500, reason=error)
        return Outcome(applied, status)

    def _status(
        self,
        generation: int,
        replicas: int,
        deployment: Mapping[str, Any] | None,
        previous: Mapping[str, Any],
        error: str | None,
        pool_problem: tuple[str, str] | None = None,
        workload_kind: str | None = None,
        template_changed: bool = False,
    ) -> dict[str, Any]:
        return compute_status(
            generation=int(generation),
            desired_replicas=replicas,
            deployment=deployment,
            previous=previous,
            error=error,
            now=self.now(),
            pool_problem=pool_problem,
            workload_kind=workload_kind or str((deployment or {}).get("kind") or "Deployment"),
            template_changed=template_changed,
        )

    def _refusal(self, spec: InferenceModelSpec) -> tuple[str, str] | None:
        """(reason, message) when the cluster cannot run ``spec``: with spec.nodes > 1,
        an API server that does not serve LeaderWorkerSets."""
        if spec.nodes == 1 or self.kube.serves(*LWS):
            return None
        return (
            LWS_CRD_MISSING,
            f"spec.nodes is {spec.nodes}, which needs a {LWS_API_VERSION} LeaderWorkerSet, "
            f"but the API server does not serve it (CRD {LWS_CRD_NAME}): install "
            f"LeaderWorkerSet (sigs.k8s.io/lws) in the cluster; the model is rendered "
            f"once it is served",
        )

    def _get_optional(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        """``get``, None also when the operator may not read the kind (a LeaderWorkerSet
        under an older ClusterRole)."""
        try:
            return self.kube.get(api_version, kind, namespace, name)
        except ApiException as exc:
            if exc.status == 403:
                return None
            raise

    def _apply_child(self, child: dict[str, Any], logger: Any) -> None:
        """Apply one child. A hand edit that took fields from us can make the merge
        invalid (422: a port added beside ours under the same name, minAvailable beside
        our maxUnavailable); a child that is cheap to replace is then deleted and applied
        anew, and only a second refusal is the spec's."""
        try:
            self.kube.apply(child)
            return
        except ApiException as exc:
            meta = child["metadata"]
            if exc.status != 422 or child["kind"] not in RECREATABLE_KINDS:
                raise
            if not self.kube.delete(
                child["apiVersion"], child["kind"], meta["namespace"], meta["name"]
            ):
                raise
            logger.warning(
                "%s %s/%s could not take the rendered object (%s): recreated",
                child["kind"], meta["namespace"], meta["name"], _api_reason(exc),
            )  # fmt: skip
        self.kube.apply(child)

    def _remove_other_workload(
        self, namespace: str, name: str, workload: tuple[str, str], logger: Log
    ) -> None:
        """After spec.nodes changed between 1 and more: delete the workload of the other
        kind, now that this one is applied (its pods go at once: the kinds cannot hand
        over pod by pod)."""
        other = DEPLOYMENT if workload == LWS else LWS
        found = self._get_optional(*other, namespace, name)
        if found is None or not _owned_by_model(found):
            return
        logger.info("deleting %s %s/%s: replaced by a %s", other[1], namespace, name, workload[1])
        self.kube.delete(*other, namespace, name)

    def _inference_pool(
        self,
        namespace: str,
        name: str,
        uid: str,
        spec: InferenceModelSpec,
        previous: Mapping[str, Any],
        logger: Log,
    ) -> PoolOutcome:
        """Apply (or, turned off, delete) the InferencePool; what status says about it.

        Its CRD is GIE's and its RBAC optional, so a missing CRD (404) or a missing
        permission (403) becomes a Ready=False reason that says what to install, not an
        error that Kopf retries in a loop; the drift timer applies the pool once it can.
        """
        pool = render_inference_pool(name, namespace, uid, spec)
        if pool is None:
            if previous.get("inferencePool"):
                # Turned off: owner references remove the pool only with the model.
                try:
                    self.kube.delete(
                        INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND, namespace, name
                    )
                except ApiException as exc:
                    if exc.status != 403:
                        return PoolOutcome(
                            previous["inferencePool"],
                            None,
                            f"deleting the InferencePool failed: {_api_reason(exc)}",
                        )
                    # No right to delete it any more: it stays until the model is deleted.
                    logger.warning(
                        "cannot delete InferencePool %s/%s: %s", namespace, name, _api_reason(exc)
                    )
            return PoolOutcome(None, None, None)
        try:
            applied = self.kube.apply(pool)
        except ApiException as exc:
            if exc.status == 404:
                return PoolOutcome(
                    None,
                    (
                        POOL_CRD_MISSING,
                        f"spec.inferencePool.enabled is true, but the API server does not "
                        f"serve {INFERENCE_POOL_API_VERSION} InferencePool (CRD "
                        f"{INFERENCE_POOL_CRD_NAME}): install the Gateway API Inference "
                        f"Extension's CRDs; the pool is created once they exist",
                    ),
                    None,
                )
            if exc.status == 403:
                return PoolOutcome(
                    None,
                    (
                        POOL_FORBIDDEN,
                        f"the operator may not write {INFERENCE_POOL_CRD_NAME} "
                        f"({_api_reason(exc)}): install the Helm chart with "
                        f"operator.inferencePool.enabled=true, or bind the ClusterRole of "
                        f"manifests/rbac-inference-pool.yaml to the operator",
                    ),
                    None,
                )
            return PoolOutcome(
                previous.get("inferencePool"),
                None,
                f"applying the InferencePool failed: {_api_reason(exc)}",
            )
        return PoolOutcome(inference_pool_status(name, applied), None, None)

    def _replicas_adapters(
        self, namespace: str, name: str, spec: InferenceModelSpec
    ) -> list[frozenset[str]]:
        """What each ready replica serves, for status.adapters (only when any are listed)."""
        if not spec.adapters:
            return []
        pods = self.kube.list("v1", "Pod", namespace, selector_string(name))
        return replicas_adapters(pods)

    def _capacity(self, namespace: str, spec: InferenceModelSpec) -> dict[str, Any]:
        """status.capacity when the model's config.json is visible to the operator."""
        config_json: dict[str, Any] | None = None
        where = ""
        try:
            if spec.model.config_map:
                cm = self.kube.get("v1", "ConfigMap", namespace, spec.model.config_map)
                where = f"configmap/{spec.model.config_map}"
                if cm is None:
                    return {"capacity": None, "capacityError": f"{where} not found"}
                text = (cm.get("data") or {}).get("config.json")
                if text is None:
                    return {"capacity": None, "capacityError": f"{where} has no key config.json"}
                config_json = json.loads(text)
            elif spec.model.source.startswith("file://"):
                path = Path(spec.model.source.removeprefix("file://")) / "config.json"
                if not path.is_file():
                    return {"capacity": None, "capacityError": None}
                where = str(path)
                config_json = json.loads(path.read_text())
            else:
                return {"capacity": None, "capacityError": None}
            return {
                "capacity": capacity_status(config_json, spec, where),
                "capacityError": None,
            }
        except (ValueError, KeyError, TypeError) as exc:
            return {"capacity": None, "capacityError": f"{where}: {exc}"}

    def _write_status(
        self, namespace: str, name: str, previous: Mapping[str, Any], status: Mapping[str, Any]
    ) -> None:
        merged = {**previous, **status}
        if _without_nones(merged) == _without_nones(previous):
            return  # no write, no event, no reconcile loop
        try:
            self.kube.patch_status(namespace, name, status)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def replica_floor(self) -> int:
        """The fewest replicas an autoscaled model may have: 1 with no gateway to read.
        Scale from zero needs the gateway's held requests; without a gateway a model at
        zero would stay there, whatever came for it."""
        config = self.config
        return 0 if config.gateway_selector and config.gateway_namespace else 1

    def autoscale(self, namespace: str, name: str, logger: Log) -> Decision | None:
        """One autoscaler tick: read the metric, decide, record, and apply a change."""
        im = self.kube.get(API_VERSION, KIND, namespace, name)
        autoscaling = _enabled_autoscaling(im)
        if im is None or autoscaling is None:
            self._autoscalers.pop((namespace, name), None)
            return None
        bounds = Bounds.from_spec(autoscaling)
        if bounds.min_replicas < (floor := self.replica_floor()):
            bounds = dataclasses.replace(bounds, min_replicas=floor)
        status = im.get("status") or {}
        previous = status.get("autoscaling") or {}
        current = previous.get("desiredReplicas")
        if not isinstance(current, int):
            # No decision yet (just created, or autoscaling turned on again): the
            # Deployment got minReplicas (render.desired_replicas), and so starts this.
            current = bounds.min_replicas
        scrape = self._replica_gauges(namespace, name, logger)
        metric = scrape.metric(bounds.metric) if scrape is not None else None
        activity = None
        if bounds.min_replicas == 0:
            served = served_name(name, parse_spec(im.get("spec") or {}))
            activity = self._activity(served, scrape, logger)
        scaler = self._autoscaler(namespace, name, im["metadata"]["uid"])
        missing = scrape.missing if scrape is not None else 0
        decision = scaler.decide(self.monotonic(), current, metric, bounds, activity, missing)
        record: dict[str, Any] = {
            "desiredReplicas": decision.replicas,
            "currentMetric": scrape.per_replica(bounds.metric) if scrape is not None else None,
            "reason": decision.reason,
            "lastScaleTime": previous.get("lastScaleTime"),
        }
        if decision.changed(current):
            record["lastScaleTime"] = rfc3339(self.now())
            direction = "up" if decision.replicas > current else "down"
            metrics.SCALE_EVENTS.labels(direction).inc()
            logger.info(
                "scaling %s/%s %s from %d to %d: %s",
                namespace,
                name,
                direction,
                current,
                decision.replicas,
                decision.reason,
            )
        if _without_nones(record) != _without_nones(previous):  # as a merge patch leaves it
            self.kube.patch_status(namespace, name, {"autoscaling": record})
        if decision.changed(current):
            self.reconcile(namespace, name, "autoscale", logger)
        return decision if decision.changed(current) else None

    def _autoscaler(self, namespace: str, name: str, uid: str) -> Autoscaler:
        """The history of the object with ``uid``; a new one when the name's previous
        history was another object's (deleted and created again)."""
        owner, scaler = self._autoscalers.get((namespace, name), (None, None))
        if owner != uid or scaler is None:
            scaler = Autoscaler()
            self._autoscalers[(namespace, name)] = (uid, scaler)
        return scaler

    def _replica_gauges(self, namespace: str, name: str, logger: Log) -> Scrape | None:
        """The engine queue gauges of the ready replicas; None when none answered."""
        pods = self.kube.list("v1", "Pod", namespace, selector_string(name))
        template = self.config.metrics_url_template
        pages = self._scrape(pods, template, (WAITING, RUNNING), logger)
        if not pages:
            return None
        ready = sum(1 for pod in pods if pod_metrics_url(template, pod))
        totals = {g: sum(page[g] for page in pages) for g in (WAITING, RUNNING)}
        return Scrape(totals, len(pages), ready - len(pages))

    def _activity(self, served: str, replicas: Scrape | None, logger: Log) -> Activity | None:
        """What the gateways (and the replicas) say of the model's requests; None when no
        gateway is configured or none answered."""
        selector, namespace = self.config.gateway_selector, self.config.gateway_namespace
        if not selector or not namespace:
            return None
        pods = self.kube.list("v1", "Pod", namespace, selector)
        names = (HELD, ANSWERED)
        url = self.config.gateway_metrics_url_template
        pages = self._scrape(pods, url, names, logger, {"model": served})
        if not pages:
            return None
        return Activity(
            held=sum(page[HELD] for page in pages),
            answered=sum(page[ANSWERED] for page in pages),
            in_replicas=sum(replicas.totals.values()) if replicas is not None else 0.0,
        )

    @staticmethod
    def _scrape(
        pods: list[dict[str, Any]],
        template: str,
        names: tuple[str, ...],
        logger: Log,
        labels: Mapping[str, str] | None = None,
    ) -> list[dict[str, float]]:
        """The named samples from each ready pod's metrics page that answered."""
        pages = []
        for url in (u for u in (pod_metrics_url(template, p) for p in pods) if u):
            try:
                pages.append(scrape_samples(url, names, labels))
            except (OSError, ValueError) as exc:
                logger.warning("no metrics from %s: %s", url, exc)
        return pages


# The gateway's samples that scale a model from zero (kvserve.gateway.metrics).
HELD = "kvserve_gateway_held_requests"
ANSWERED = "kvserve_gateway_requests_total"


def _enabled_autoscaling(im: Mapping[str, Any] | None) -> AutoscalingSpec | None:
    """The parsed autoscaling spec of an InferenceModel that asks to be autoscaled."""
    if im is None:
        return None
    try:
        spec = parse_spec(im.get("spec") or {})
    except SpecError:
        # The reconcile reports an invalid spec in status and renders nothing until it is
        # fixed, so a scaling decision could not take effect either.
        return None
    return spec.autoscaling if spec.autoscaling.enabled else None


def _template_changed(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> bool:
    """Whether this reconcile gave the workload a new pod template (or created it): a
    rollout, where a changed replica count alone is scaling. Both as the API server
    returned them, defaults filled in, so an unchanged template compares equal."""
    if after is None:
        return False
    if before is None:
        return True
    # A LeaderWorkerSet's pod templates (leader's and workers') are under leaderWorkerTemplate.
    key = "leaderWorkerTemplate" if after.get("kind") == LWS_KIND else "template"
    return bool(before.get("spec", {}).get(key) != after.get("spec", {}).get(key))


def _owned_by_model(obj: Mapping[str, Any]) -> bool:
    return any(
        ref.get("kind") == KIND and ref.get("controller")
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []
    )


def _api_reason(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
        return str(body.get("message") or exc.reason)
    except (TypeError, ValueError):
        return str(exc.reason)


def _without_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value
