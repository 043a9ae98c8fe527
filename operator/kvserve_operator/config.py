"""The operator's own configuration, and how it is read from environment variables.

``kvserve-operator`` builds an ``OperatorConfig`` from its flags (falling back to the
environment) and hands it to Kopf in the operator's memo. ``kopf run -m
kvserve_operator.handlers`` has no flags, so there the startup handler reads the
environment instead. Either way the handlers read ``memo.config``, never the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvserve_operator.constants import OPERATOR_NAME
from kvserve_operator.render import OperatorSettings


@dataclass(frozen=True)
class OperatorConfig:
    render: OperatorSettings = field(default_factory=OperatorSettings)
    field_manager: str = OPERATOR_NAME
    reconcile_interval_s: float = 60.0
    autoscale_interval_s: float = 15.0
    # Where the autoscaler reads a replica's metrics; tests point it at a local feed.
    metrics_url_template: str = "http://{pod_ip}:8000/metrics"
    # The gateway pods whose kvserve_gateway_held_requests scale a model from zero:
    # a label selector in one namespace (None: no gateway is read, so no model is ever
    # scaled to zero), and where a pod's /metrics is ({pod_ip}, {pod_name}, {namespace}).
    gateway_selector: str | None = None
    gateway_namespace: str | None = None
    gateway_metrics_url_template: str = "http://{pod_ip}:8080/metrics"
    # The operator's own /metrics endpoint; None serves none.
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"

    def with_values(self, **values: Any) -> OperatorConfig:
        """A copy with the given fields replaced, where a ``None`` keeps the current value
        (an absent flag or variable). The fields of ``render`` are given by their names."""
        given = {name: value for name, value in values.items() if value is not None}
        render_names = {f.name for f in fields(OperatorSettings)}
        render = {name: given.pop(name) for name in render_names & set(given)}
        return replace(self, render=replace(self.render, **render), **given)


def config_from_env(env: Mapping[str, str]) -> OperatorConfig:
    """The defaults, overridden by each variable that ``env`` sets."""

    def number(variable: str) -> float | None:
        return float(env[variable]) if variable in env else None

    port = env.get("KVSERVE_OPERATOR_METRICS_PORT")
    return OperatorConfig().with_values(
        engine_image=env.get("KVSERVE_ENGINE_IMAGE"),
        image_pull_policy=env.get("KVSERVE_IMAGE_PULL_POLICY"),
        cluster_domain=env.get("KVSERVE_CLUSTER_DOMAIN"),
        reconcile_interval_s=number("KVSERVE_RECONCILE_INTERVAL"),
        autoscale_interval_s=number("KVSERVE_AUTOSCALE_INTERVAL"),
        metrics_url_template=env.get("KVSERVE_METRICS_URL_TEMPLATE"),
        gateway_selector=env.get("KVSERVE_GATEWAY_SELECTOR"),
        gateway_namespace=env.get("KVSERVE_GATEWAY_NAMESPACE"),
        gateway_metrics_url_template=env.get("KVSERVE_GATEWAY_METRICS_URL_TEMPLATE"),
        metrics_port=int(port) if port else None,
        metrics_host=env.get("KVSERVE_OPERATOR_METRICS_HOST"),
    )
