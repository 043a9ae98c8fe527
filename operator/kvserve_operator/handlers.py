"""Kopf wiring: which events call the reconciler. The logic lives in ``reconcile.py``.

Loaded by ``kvserve-operator``, which passes its configuration in the operator's memo
(``kopf.run(memo=kopf.Memo(config=...))``), or directly by ``kopf run -m
kvserve_operator.handlers``, where the startup handler reads it from environment
variables (``config_from_env``). Every handler then reads ``memo.config``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, TypeAlias

import kopf
from kubernetes.client.exceptions import ApiException

from kvserve_operator import metrics
from kvserve_operator.config import OperatorConfig, config_from_env
from kvserve_operator.constants import (
    GROUP,
    KIND,
    LWS_GROUP,
    LWS_PLURAL,
    LWS_VERSION,
    MANAGED_BY_LABEL,
    OPERATOR_NAME,
    PLURAL,
    VERSION,
)
from kvserve_operator.kube import Kube, load_config
from kvserve_operator.reconcile import Reconciler, SpecInvalid

Log: TypeAlias = logging.Logger | logging.LoggerAdapter[Any]


class _QuietTimers(logging.Filter):
    """Drop the INFO line Kopf writes after every successful timer run: one per object
    every few seconds would bury the lines that matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno == logging.INFO
            and record.getMessage().startswith(
                ("Timer 'autoscale' succeeded", "Timer 'restore_drift' succeeded")
            )
        )


logging.getLogger("kopf.objects").addFilter(_QuietTimers())


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Log, **_: Any) -> None:
    if "config" not in memo:  # `kopf run`: no kvserve-operator command line filled it
        memo.config = config_from_env(os.environ)
    config: OperatorConfig = memo.config
    # The status schema is strict, so kopf keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only problems become Kubernetes Events (a timer's success every few seconds would
    # flood them); scaling decisions are posted explicitly.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    memo.problems = {}  # (namespace, name) -> the problem last posted as an Event
    memo.reconciler = Reconciler(Kube(load_config(), config.field_manager), config)
    if config.metrics_port is not None:
        metrics.serve(config.metrics_port, config.metrics_host)
    # Last, so that a failed (and retried) startup has registered nothing yet.
    register_timers(kopf.get_default_registry(), config)
    logger.info(
        "kvserve operator started: engine image %s, reconcile every %gs, autoscale every %gs",
        config.render.engine_image,
        config.reconcile_interval_s,
        config.autoscale_interval_s,
    )


def _reconcile(
    memo: Any, body: kopf.Body, namespace: str | None, name: str, trigger: str, logger: Log
) -> None:
    reconciler: Reconciler = memo.reconciler
    assert namespace is not None  # InferenceModel is namespaced
    try:
        reconciler.reconcile(namespace, name, trigger, logger)
    except SpecInvalid as error:
        _post_problem(memo, body, namespace, name, "InvalidSpec", f"invalid spec: {error}")
        raise kopf.PermanentError(f"invalid spec: {error}") from error
    except ApiException as error:
        message = f"Kubernetes API: {error.reason}"
        _post_problem(memo, body, namespace, name, "ReconcileError", message)
        raise kopf.TemporaryError(message, delay=5) from error
    memo.problems.pop((namespace, name), None)


def _post_problem(
    memo: Any, body: kopf.Body, namespace: str, name: str, reason: str, message: str
) -> None:
    """A Warning Event on the InferenceModel (``kubectl describe`` shows it), once per
    problem: the handlers retry every few seconds, and the same problem is posted again
    only after a reconcile has succeeded."""
    if memo.problems.get((namespace, name)) == message:
        return
    memo.problems[(namespace, name)] = message
    kopf.event(body, type="Warning", reason=reason, message=message)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_change(
    memo: Any,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    reason: str,
    logger: Log,
    **_: Any,
) -> None:
    _reconcile(memo, body, namespace, name, str(reason), logger)


def restore_drift(
    memo: Any, body: kopf.Body, namespace: str | None, name: str, logger: Log, **_: Any
) -> None:
    """Periodic reconcile: catches drift that produced no event we watch."""
    _reconcile(memo, body, namespace, name, "timer", logger)


def autoscale(
    memo: Any, body: kopf.Body, namespace: str | None, name: str, logger: Log, **_: Any
) -> None:
    reconciler: Reconciler = memo.reconciler
    assert namespace is not None  # InferenceModel is namespaced
    decision = reconciler.autoscale(namespace, name, logger)
    if decision is not None:
        kopf.event(
            body,
            type="Normal",
            reason="Scaled",
            message=f"{decision.replicas} replicas: {decision.reason}",
        )


def register_timers(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register the drift and autoscaler timers with the configured intervals.

    A Kopf timer's interval is fixed when it is registered, and the configuration is
    known only at startup (it arrives in the memo), so the timers are registered then,
    unlike the handlers above. Kopf starts watching resources only after every startup
    handler has finished, so no object is seen before its timers exist.
    """
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        registry=registry,
        interval=config.reconcile_interval_s,
        initial_delay=config.reconcile_interval_s,
    )(restore_drift)
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        registry=registry,
        interval=config.autoscale_interval_s,
        when=lambda spec, **_: bool((spec.get("autoscaling") or {}).get("enabled")),
    )(autoscale)


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: OPERATOR_NAME})
def deployment_event(
    memo: Any, event: kopf.RawEvent, body: kopf.Body, logger: Log, **_: Any
) -> None:
    """A child Deployment changed (status, a manual edit) or was deleted: reconcile its owner."""
    _child_event(memo, event, body, logger, "deployment")


# Kopf serves this once the LeaderWorkerSet CRD exists (it warns "Unresolved resources"
# until then and watches the CRDs for it), so a cluster without LWS runs as before.
@kopf.on.event(LWS_GROUP, LWS_VERSION, LWS_PLURAL, labels={MANAGED_BY_LABEL: OPERATOR_NAME})
def leader_worker_set_event(
    memo: Any, event: kopf.RawEvent, body: kopf.Body, logger: Log, **_: Any
) -> None:
    """A child LeaderWorkerSet (spec.nodes > 1) changed or was deleted: reconcile its owner."""
    _child_event(memo, event, body, logger, "leaderworkerset")


def _child_event(memo: Any, event: kopf.RawEvent, body: kopf.Body, logger: Log, kind: str) -> None:
    owner = next(
        (
            ref
            for ref in body.metadata.get("ownerReferences") or []
            if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP)
        ),
        None,
    )
    if owner is None or body.metadata.namespace is None:
        return
    try:
        memo.reconciler.reconcile(
            body.metadata.namespace, owner["name"], f"{kind}-{event['type']}".lower(), logger
        )
    except (SpecInvalid, ApiException) as error:
        # The owner's own handlers retry; an event handler must not crash the watch.
        logger.warning("reconcile after a %s event failed: %s", kind, error)


@kopf.on.probe(id="reconciler")
def reconciler_ready(memo: Any, **_: Any) -> bool:
    return hasattr(memo, "reconciler")
