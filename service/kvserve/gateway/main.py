"""``kvserve gateway --config FILE``: the OpenAI front door to the engine replicas."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvserve.ports import bind_problem, port_number
from kvserve.telemetry.log_setup import add_log_level_argument, configure_logging

if TYPE_CHECKING:
    from kvserve.gateway.config import GatewayConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="gateway YAML (docs/gateway-config.md); required to serve")
    p.add_argument("--host", help="override listen.host")
    p.add_argument("--port", type=port_number, help="override listen.port")
    p.add_argument(
        "--metrics-port",
        type=port_number,
        help="override listen.metrics_port: serve /metrics on this port instead of the API's",
    )
    add_log_level_argument(p)
    p.add_argument(
        "--new-key",
        action="store_true",
        help="print a new random API key and its sha256 for the keys file, then exit",
    )


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kvserve.gateway.files import ConfigError, validation_problems
    from kvserve.gateway.keys import new_key
    from kvserve.gateway.watch import ConfigWatcher
    from kvserve.telemetry.tracing import otlp_problem

    if args.new_key:
        key, digest = new_key()
        print(f"key:    {key}\nsha256: {digest}")
        return 0
    if not args.config:
        print("kvserve gateway: error: --config FILE is required", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    try:
        watcher = ConfigWatcher(args.config)  # validates both files: fail fast
    except ConfigError as exc:
        print(f"kvserve gateway: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from kvserve.gateway.app import create_gateway_app
    from kvserve.gateway.shutdown import GatewayServer
    from kvserve.heap import freeze_startup_heap
    from kvserve.openai.http_limits import protocol_with
    from kvserve.openai.refusal_pacing import RefusalPacer

    overrides = {"host": args.host, "port": args.port, "metrics_port": args.metrics_port}
    try:
        config = watcher.config.with_listen(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for problem in validation_problems(exc, show_input=True):
            print(f"kvserve gateway: error: listen.{problem}", file=sys.stderr)
        return 2
    startup_problem = listen_problem(config) or otlp_problem()
    if startup_problem is not None:
        print(f"kvserve gateway: error: {startup_problem}", file=sys.stderr)
        return 2
    host, port = config.listen.host, config.listen.port
    pacer = RefusalPacer.at(config.listen.refusals_per_second)
    app = create_gateway_app(config, watcher.keys, watcher=watcher, refusal_pacer=pacer)
    for name, model in config.models.items():
        print(
            f"model {name!r}: {len(model.replicas)} static replica(s) {', '.join(model.replicas)}",
            file=sys.stderr,
        )
    if config.discovery.kubernetes is not None:
        k8s = config.discovery.kubernetes
        print(
            f"discovering replicas from EndpointSlices of Services matching "
            f"{k8s.label_selector!r} (port {k8s.port_name!r}) in "
            f"{', '.join(k8s.namespaces) or 'all namespaces'}",
            file=sys.stderr,
        )
    metrics_port = config.listen.metrics_port
    print(
        f"gateway on http://{host}:{port} (OpenAI API under /v1"
        + ("" if metrics_port is None else f"; /metrics on port {metrics_port}")
        + "); routing "
        f"{config.routing.policy}; {len(watcher.keys.keys)} API key(s) from "
        f"{config.keys_file}",
        file=sys.stderr,
        flush=True,
    )
    freeze_startup_heap()
    uvicorn_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=config.listen.keep_alive_seconds,
        http=protocol_with(config.listen.http_limits, pacer),
    )
    GatewayServer(uvicorn_config).run()
    return 0


def listen_problem(config: GatewayConfig) -> str | None:
    """Why the gateway could not listen where ``config.listen`` says (a port taken, a
    host that is no address here), or None: checked before anything starts, as
    ``kvserve serve`` does, so that it is one line and status 2, not a traceback after the
    startup lines."""
    listen = config.listen
    ports = {("listen.port", "--port"): listen.port}
    if listen.metrics_port is not None:
        ports["listen.metrics_port", "--metrics-port"] = listen.metrics_port
    for (field, flag), port in ports.items():
        problem = bind_problem(listen.host, port)
        if problem is not None:
            return f"{problem} (set by listen.host and {field}, or --host and {flag})"
    return None
