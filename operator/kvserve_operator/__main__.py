"""``kvserve-operator`` / ``python -m kvserve_operator``: run the operator."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve-operator",
        description="Reconcile InferenceModel resources (kvserve.dev/v1alpha1) into engine "
        "Deployments, Services and PodDisruptionBudgets, report their status, and autoscale.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument("--engine-image", help="default engine image (env KVSERVE_ENGINE_IMAGE)")
    p.add_argument("--image-pull-policy", choices=["Always", "IfNotPresent", "Never"])
    p.add_argument("--cluster-domain", help="DNS suffix of Services (default cluster.local)")
    p.add_argument(
        "--reconcile-interval", type=float, help="seconds between drift checks (default 60)"
    )
    p.add_argument(
        "--autoscale-interval", type=float, help="seconds between autoscaler ticks (default 15)"
    )
    p.add_argument(
        "--metrics-url-template",
        help="where a replica's metrics are read: {pod_ip}, {pod_name}, {namespace} "
        "(default http://{pod_ip}:8000/metrics)",
    )
    p.add_argument("--metrics-port", type=int, default=8081, help="the operator's /metrics")
    p.add_argument("--health-port", type=int, default=8080, help="liveness probe /healthz")
    p.add_argument("--bind", default="0.0.0.0", help="address for /metrics and /healthz")
    p.add_argument("--log-format", choices=["full", "json", "plain"], default="full")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, env in (
        ("engine_image", "KVSERVE_ENGINE_IMAGE"),
        ("image_pull_policy", "KVSERVE_IMAGE_PULL_POLICY"),
        ("cluster_domain", "KVSERVE_CLUSTER_DOMAIN"),
        ("reconcile_interval", "KVSERVE_RECONCILE_INTERVAL"),
        ("autoscale_interval", "KVSERVE_AUTOSCALE_INTERVAL"),
        ("metrics_url_template", "KVSERVE_METRICS_URL_TEMPLATE"),
    ):
        value = getattr(args, flag)
        if value is not None:
            os.environ[env] = str(value)
    os.environ["KVSERVE_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    os.environ["KVSERVE_OPERATOR_METRICS_HOST"] = args.bind

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
