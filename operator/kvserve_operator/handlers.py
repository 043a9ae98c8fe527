"""Kopf wiring: which events call the reconciler. The logic lives in ``reconcile.py``.

Loaded by ``kvserve-operator`` (which sets the configuration first) or directly by
``kopf run -m kvserve_operator.handlers`` (configuration from environment variables,
see ``config_from_env``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, TypeAlias

import kopf
from kubernetes.client.exceptions import ApiException

from kvserve_operator import metrics
from kvserve_operator.kube import GROUP, PLURAL, VERSION, Kube, load_config
from kvserve_operator.reconcile import OperatorConfig, Reconciler, SpecInvalid
from kvserve_operator.render import OperatorSettings

Log: TypeAlias = logging.Logger | logging.LoggerAdapter[Any]
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvserve-operator"}


def config_from_env() -> OperatorConfig:
    env = os.environ
    defaults = OperatorConfig()
    render_defaults = OperatorSettings()
    return OperatorConfig(
        render=OperatorSettings(
            engine_image=env.get("KVSERVE_ENGINE_IMAGE", render_defaults.engine_image),
            image_pull_policy=env.get(
                "KVSERVE_IMAGE_PULL_POLICY", render_defaults.image_pull_policy
            ),
            cluster_domain=env.get("KVSERVE_CLUSTER_DOMAIN", render_defaults.cluster_domain),
        ),
        reconcile_interval_s=float(
            env.get("KVSERVE_RECONCILE_INTERVAL", defaults.reconcile_interval_s)
        ),
        autoscale_interval_s=float(
            env.get("KVSERVE_AUTOSCALE_INTERVAL", defaults.autoscale_interval_s)
        ),
        metrics_url_template=env.get("KVSERVE_METRICS_URL_TEMPLATE", defaults.metrics_url_template),
    )


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

CONFIG = config_from_env()  # timer intervals are fixed when the handlers are registered


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: Any, logger: Log, **_: Any) -> None:
    # The status schema is strict, so kopf keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only problems become Kubernetes Events (a timer's success every few seconds would
    # flood them); scaling decisions are posted explicitly.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    memo.reconciler = Reconciler(Kube(load_config(), CONFIG.field_manager), CONFIG)
    port = os.environ.get("KVSERVE_OPERATOR_METRICS_PORT")
    if port:
        metrics.serve(int(port), os.environ.get("KVSERVE_OPERATOR_METRICS_HOST", "0.0.0.0"))
    logger.info(
        "kvserve operator started: engine image %s, reconcile every %gs, autoscale every %gs",
        CONFIG.render.engine_image,
        CONFIG.reconcile_interval_s,
        CONFIG.autoscale_interval_s,
    )


def _reconcile(memo: Any, namespace: str | None, name: str, trigger: str, logger: Log) -> None:
    reconciler: Reconciler = memo.reconciler
    assert namespace is not None  # InferenceModel is namespaced
    try:
        reconciler.reconcile(namespace, name, trigger, logger)
    except SpecInvalid as error:
        raise kopf.PermanentError(f"invalid spec: {error}") from error
    except ApiException as error:
        raise kopf.TemporaryError(f"Kubernetes API: {error.reason}", delay=5) from error


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_change(
    memo: Any, namespace: str | None, name: str, reason: str, logger: Log, **_: Any
) -> None:
    _reconcile(memo, namespace, name, str(reason), logger)


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=CONFIG.reconcile_interval_s,
    initial_delay=CONFIG.reconcile_interval_s,
)
def restore_drift(memo: Any, namespace: str | None, name: str, logger: Log, **_: Any) -> None:
    """Periodic reconcile: catches drift that produced no event we watch."""
    _reconcile(memo, namespace, name, "timer", logger)


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=CONFIG.autoscale_interval_s,
    when=lambda spec, **_: bool((spec.get("autoscaling") or {}).get("enabled")),
)
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


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
def deployment_event(
    memo: Any, event: kopf.RawEvent, body: kopf.Body, logger: Log, **_: Any
) -> None:
    """A child Deployment changed (status, a manual edit) or was deleted: reconcile its owner."""
    owner = next(
        (
            ref
            for ref in body.metadata.get("ownerReferences") or []
            if ref.get("kind") == "InferenceModel" and ref.get("apiVersion", "").startswith(GROUP)
        ),
        None,
    )
    if owner is None or body.metadata.namespace is None:
        return
    try:
        memo.reconciler.reconcile(
            body.metadata.namespace, owner["name"], f"deployment-{event['type']}".lower(), logger
        )
    except (SpecInvalid, ApiException) as error:
        # The owner's own handlers retry; an event handler must not crash the watch.
        logger.warning("reconcile after a Deployment event failed: %s", error)


@kopf.on.probe(id="reconciler")
def reconciler_ready(memo: Any, **_: Any) -> bool:
    return hasattr(memo, "reconciler")
