"""``kvserve-operator`` / ``python -m kvserve_operator``: run the operator."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from kvserve_operator.config import OperatorConfig, config_from_env
from kvserve_operator.constants import API_VERSION, KIND
from kvserve_operator.spec import PULL_POLICIES

DEFAULTS = OperatorConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve-operator",
        description=f"Reconcile {KIND} resources ({API_VERSION}) into engine Deployments, "
        "Services and PodDisruptionBudgets, report their status, and autoscale.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    # Each option left out falls back to its environment variable, then to the default.
    p.add_argument("--engine-image", help="default engine image (env KVSERVE_ENGINE_IMAGE)")
    p.add_argument("--image-pull-policy", choices=PULL_POLICIES)
    p.add_argument(
        "--cluster-domain",
        help=f"DNS suffix of Services (default {DEFAULTS.render.cluster_domain})",
    )
    p.add_argument(
        "--reconcile-interval",
        type=float,
        help=f"seconds between drift checks (default {DEFAULTS.reconcile_interval_s:g})",
    )
    p.add_argument(
        "--autoscale-interval",
        type=float,
        help=f"seconds between autoscaler ticks (default {DEFAULTS.autoscale_interval_s:g})",
    )
    p.add_argument(
        "--metrics-url-template",
        help="where a replica's metrics are read: {pod_ip}, {pod_name}, {namespace} "
        f"(default {DEFAULTS.metrics_url_template})",
    )
    p.add_argument(
        "--gateway-selector",
        help="label selector of the gateway pods whose held requests scale a model from "
        "zero (env KVSERVE_GATEWAY_SELECTOR; unset: models are never scaled to zero)",
    )
    p.add_argument(
        "--gateway-namespace", help="namespace of those pods (env KVSERVE_GATEWAY_NAMESPACE)"
    )
    p.add_argument(
        "--gateway-metrics-url-template",
        help="where a gateway pod's metrics are read: {pod_ip}, {pod_name}, {namespace} "
        f"(default {DEFAULTS.gateway_metrics_url_template})",
    )
    p.add_argument("--metrics-port", type=int, default=8081, help="the operator's /metrics")
    p.add_argument("--health-port", type=int, default=8080, help="liveness probe /healthz")
    p.add_argument(
        "--bind", default=DEFAULTS.metrics_host, help="address for /metrics and /healthz"
    )
    p.add_argument("--log-format", choices=["full", "json", "plain"], default="full")
    p.add_argument("--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> OperatorConfig:
    """The flags given, else the environment's variables, else the defaults."""
    return config_from_env(env).with_values(
        engine_image=args.engine_image,
        image_pull_policy=args.image_pull_policy,
        cluster_domain=args.cluster_domain,
        reconcile_interval_s=args.reconcile_interval,
        autoscale_interval_s=args.autoscale_interval,
        metrics_url_template=args.metrics_url_template,
        gateway_selector=args.gateway_selector,
        gateway_namespace=args.gateway_namespace,
        gateway_metrics_url_template=args.gateway_metrics_url_template,
        metrics_port=args.metrics_port,
        metrics_host=args.bind,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args, os.environ)

    import kopf

    import kvserve_operator.handlers  # noqa: F401 - registers the handlers

    kopf.configure(
        verbose=args.verbose,
        log_format={
            "full": kopf.LogFormat.FULL,
            "json": kopf.LogFormat.JSON,
            "plain": kopf.LogFormat.PLAIN,
        }[args.log_format],
        log_refkey="object",
    )
    try:
        kopf.run(
            memo=kopf.Memo(config=config),
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=f"http://{args.bind}:{args.health_port}/healthz",
        )
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
