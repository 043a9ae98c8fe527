"""``kvserve serve``: one engine behind the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvserve import engine_options
from kvserve.config import EngineConfig, model_dir_problem, tokenizer_problem
from kvserve.lora.request import name_problem
from kvserve.names import model_name_problem
from kvserve.openai.chat_output import ChatParsing
from kvserve.openai.http_limits import HttpLimits, protocol_with
from kvserve.openai.reasoning import REASONING_PARSERS
from kvserve.openai.refusal_pacing import REPLICA_REFUSALS_PER_SECOND, RefusalPacer
from kvserve.openai.stalls import DEFAULT_WRITE_STALL_SECONDS
from kvserve.openai.tool_parsers import TOOL_CALL_PARSERS
from kvserve.parallel.launch import DEFAULT_MASTER_PORT, Launch
from kvserve.ports import bind_problem, port_number
from kvserve.sampling_params import StopLimits
from kvserve.telemetry.log_setup import add_log_level_argument, configure_logging
from kvserve.telemetry.vllm_compat import METRICS_COMPAT

DEFAULT_GRPC_PORT = 50051  # the gRPC API the gateway speaks


def add_arguments(p: argparse.ArgumentParser) -> None:
    engine_options.add_arguments(p)  # the EngineConfig options (docs/engine.md, "Options")
    p.add_argument(
        "--served-model-name",
        help='the name clients send as "model" (default: the model directory\'s name)',
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=[],
        help="LoRA adapters (PEFT folders) to serve from the start, each as the model NAME "
        "(needs --enable-lora)",
    )
    p.add_argument(
        "--lora-dir",
        help="the folder POST /v1/load_lora_adapter may load adapters from (default: no "
        "loading at run time)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="HTTP port (OpenAI API; default: 8000)"
    )
    p.add_argument(
        "--grpc-port",
        type=port_number,
        help=f"gRPC port (for the gateway; default: {DEFAULT_GRPC_PORT})",
    )
    p.add_argument("--no-grpc", action="store_true", help="do not serve the gRPC API")
    p.add_argument(
        "--metrics-port",
        type=port_number,
        help="serve /metrics on this port of --host instead of the HTTP port, which then "
        "answers it 404 (default: on the HTTP port; docs/security.md)",
    )
    p.add_argument(
        "--metrics-compat",
        choices=METRICS_COMPAT,
        help="also export the load gauges, cache and LoRA info under vLLM's names "
        "(vllm:num_requests_waiting, ...), for Gateway API Inference Extension endpoint "
        "pickers and autoscalers written for vLLM (default: kvserve's names only)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls (vLLM's names; default: what the chat "
        "template implies, if unambiguous)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split <think>...</think> into reasoning_content (default: none)",
    )
    g = p.add_argument_group(
        "multi-node tensor parallelism",
        "a group of --tensor-parallel-size ranks over several nodes (pods), each running "
        "tensor-parallel-size / nnodes of them; node 0 serves the API, the others only "
        "/health. In a LeaderWorkerSet the defaults come from LWS_GROUP_SIZE, "
        "LWS_WORKER_INDEX and LWS_LEADER_ADDRESS (docs/engine.md, 'Tensor parallelism')",
    )
    g.add_argument("--nnodes", type=int, help="nodes in the group (default: 1)")
    g.add_argument("--node-rank", type=int, help="this node's index, 0 leads (default: 0)")
    g.add_argument("--master-addr", help="node 0's address (default: 127.0.0.1)")
    g.add_argument(
        "--master-port",
        type=port_number,
        help=f"node 0's rendezvous port (default: {DEFAULT_MASTER_PORT} with several "
        "nodes, a free one with one node)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest request body; larger is a 413 (default: 4 MiB)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=HttpLimits.max_head_bytes,
        help="largest request line + headers; larger is a 431 "
        f"(default: {HttpLimits.max_head_bytes})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HttpLimits.head_timeout,
        help="seconds for a request's line and headers to arrive; later is a 408 "
        f"(default: {HttpLimits.head_timeout:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=HttpLimits.body_timeout,
        help="seconds for each part of a request body to arrive; later is a 408 "
        f"(default: {HttpLimits.body_timeout:g})",
    )
    p.add_argument(
        "--refusals-per-second",
        type=_non_negative,
        default=REPLICA_REFUSALS_PER_SECOND,
        help="answer 4xx refusals no faster than this, after a burst of one second's worth, "
        "so that clients looping on refused requests cannot take the CPU from the others; "
        f"0: answer at once (default: {REPLICA_REFUSALS_PER_SECOND:g})",
    )
    p.add_argument(
        "--write-stall-timeout",
        type=float,
        default=DEFAULT_WRITE_STALL_SECONDS,
        help="seconds a streaming client may go without reading before its request is "
        f"aborted (default: {DEFAULT_WRITE_STALL_SECONDS:g})",
    )
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=StopLimits.max_count,
        help=f"most stop strings per request (default: {StopLimits.max_count})",
    )
    p.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=StopLimits.max_chars,
        help=f"longest stop string in characters (default: {StopLimits.max_chars})",
    )
    p.add_argument(
        "--drain-timeout",
        type=_non_negative,
        default=30.0,
        help="seconds to let in-flight requests finish on SIGTERM; then the rest are aborted "
        "(default: 30)",
    )
    add_log_level_argument(p)
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log every HTTP request, probes and refusals included (uvicorn's access log; "
        "off by default: generation requests have their own log line, kvserve.requests, and "
        "a line per refused request is a cost a flooding client would set)",
    )


def run(args: argparse.Namespace) -> int:
    from kvserve.telemetry.tracing import otlp_problem

    configure_logging(args.log_level)
    if (problem := grpc_problem(args)) is None:
        args.grpc_port = args.grpc_port or DEFAULT_GRPC_PORT  # None: not given
        problem = port_clash_problem(args) or lora_problem(args) or otlp_problem()
    if problem is not None:  # before loading the model: a wrong flag fails fast
        print(f"kvserve serve: error: {problem}", file=sys.stderr)
        return 2
    if not args.model:
        from kvserve.demo_model import default_model_dir

        try:
            args.model = str(default_model_dir())
        except FileNotFoundError as exc:
            print(f"kvserve serve: error: {exc}", file=sys.stderr)
            return 2
        print("no --model given: serving the bundled demo model", file=sys.stderr)
    name = args.served_model_name or Path(args.model).resolve().name
    if (problem := model_name_problem(name, "served model name")) is not None:
        hint = "name it with --served-model-name"
        print(f"kvserve serve: error: {problem} ({hint})", file=sys.stderr)
        return 2
    try:
        engine_config = engine_options.config_from_args(args)
        launch = Launch.resolve(args.nnodes, args.node_rank, args.master_addr, args.master_port)
        launch.node_ranks(engine_config.tensor_parallel_size)  # splits evenly, or an error
    except ValueError as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    if launch.node_rank > 0:
        from kvserve.parallel.node import serve_worker_node

        return serve_worker_node(engine_config, launch, args.host, args.port)
    problem = (
        ports_problem(args)
        or model_dir_problem(args.model)
        or checkpoint_problem(args.model)
        or tokenizer_problem(args.tokenizer, args.model)
    )
    if problem is not None:  # before torch and the model load, which can take minutes
        print(f"kvserve serve: error: {problem}", file=sys.stderr)
        return 2
    if (warning := lora_dir_warning(args)) is not None:
        print(f"kvserve serve: warning: {warning}", file=sys.stderr)
    return _serve(args, engine_config, launch, name)


def _serve(args: argparse.Namespace, engine_config: EngineConfig, launch: Launch, name: str) -> int:
    """Load the model and serve until drained. Imported here, not above: every check in
    ``run`` answers a wrong flag in a fraction of a second, before torch (seconds) loads."""
    import torch
    import uvicorn

    from kvserve.engine.cpu_threads import call_in_short_lived_thread
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.heap import freeze_startup_heap
    from kvserve.parallel.group import GroupFailedError
    from kvserve.server.app import create_app
    from kvserve.server.shutdown import DrainingServer
    from kvserve.telemetry.prometheus import EngineMetrics

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        # In a thread that exits when loading is done; see kvserve.engine.cpu_threads.
        engine = call_in_short_lived_thread(LLMEngine, engine_config, time.monotonic, launch)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    except GroupFailedError as exc:  # a worker died, or never came, before the group formed
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 1
    bs = engine.config.block_size
    # On a CPU, the compute threads: more than the CPUs this process gets leaves every op
    # waiting for a thread that is not running (docs/engine.md, "CPU threads").
    threads = f", {torch.get_num_threads()} threads" if engine.device.type == "cpu" else ""
    print(
        f"loaded in {time.perf_counter() - start:.1f} s on {engine.device} "
        f"({str(engine.dtype).removeprefix('torch.')}{threads}); KV cache: "
        f"{engine.num_kv_blocks} blocks "
        f"of {bs} tokens = {engine.num_kv_blocks * bs:,} tokens "
        f"({str(engine.kv_cache_dtype).removeprefix('torch.')}); max_model_len "
        f"{engine.max_model_len}"
        + (
            f"; {engine.config.tensor_parallel_size} tensor-parallel ranks (each holds that "
            "many blocks of its own KV heads)"
            if engine.group is not None
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    grpc_address = None if args.no_grpc else (args.host, args.grpc_port)
    metrics_address = None if args.metrics_port is None else (args.host, args.metrics_port)
    limits = HttpLimits(args.max_header_bytes, args.header_timeout, args.body_timeout)
    pacer = RefusalPacer.at(args.refusals_per_second)
    try:
        app = create_app(
            engine,
            name,
            max_body_bytes=args.max_body_bytes,
            stop_limits=StopLimits(args.max_stop_strings, args.max_stop_string_chars),
            write_stall_timeout=args.write_stall_timeout,
            body_timeout=args.body_timeout,
            metrics=EngineMetrics(name, compat=args.metrics_compat),
            grpc_address=grpc_address,
            metrics_address=metrics_address,
            http_limits=limits,
            refusal_pacer=pacer,
            chat_parsing=ChatParsing.for_model(
                args.tool_call_parser,
                args.reasoning_parser,
                getattr(engine.tokenizer, "chat_template", None),
                engine.tokenizer,
            ),
            lora_modules=dict(m.split("=", 1) for m in args.lora_modules),
            lora_dir=args.lora_dir,
        )
    except ValueError as exc:  # a --lora-modules adapter that cannot be served
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"serving {name!r} on http://{args.host}:{args.port} (OpenAI API under /v1)"
        + ("" if args.no_grpc else f" and grpc://{args.host}:{args.grpc_port}")
        + ("" if metrics_address is None else f", /metrics on port {args.metrics_port}"),
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=1,
        http=protocol_with(limits, pacer),
    )
    freeze_startup_heap()
    server = DrainingServer(config, app.state.kvserve, args.drain_timeout)
    app.state.kvserve.engine.hooks.on_dead = server.engine_died
    server.run()
    return server.exit_code


def _ports(args: argparse.Namespace) -> dict[str, int]:
    """The ports the server listens on, by flag."""
    ports = {"--port": args.port}
    if not args.no_grpc:
        ports["--grpc-port"] = args.grpc_port
    if args.metrics_port is not None:
        ports["--metrics-port"] = args.metrics_port
    return ports


def checkpoint_problem(model: str) -> str | None:
    """What ``kvserve model verify`` finds wrong with the checkpoint (its config, and
    its safetensors files read only as far as their headers), without torch: a broken
    checkpoint then fails in a fraction of a second, not after torch has loaded. The
    loader runs the same checks again (kvserve.model.loader)."""
    from kvserve.model.pull import ModelPullError, verify_model

    try:
        verify_model(model)
    except ModelPullError as exc:
        return f"{model}: {exc}"
    return None


def ports_problem(args: argparse.Namespace) -> str | None:
    """Why one of the server's ports cannot be listened on now, or None."""
    for flag, port in _ports(args).items():
        problem = bind_problem(args.host, port)
        if problem is not None:
            return f"{problem} (choose another with {flag})"
    return None


def grpc_problem(args: argparse.Namespace) -> str | None:
    """Why the gRPC flags do not go together, or None."""
    if args.no_grpc and args.grpc_port is not None:
        return "--grpc-port with --no-grpc: there is no gRPC listener to put on it"
    return None


def lora_problem(args: argparse.Namespace) -> str | None:
    """Why the LoRA flags do not go together, or None."""
    if (args.lora_modules or args.lora_dir) and not args.enable_lora:
        return "--lora-modules and --lora-dir need --enable-lora"
    names = []
    for module in args.lora_modules:
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            return f"--lora-modules takes NAME=PATH, got {module!r}"
        problem = name_problem(name)
        if problem is not None:
            return f"--lora-modules: {problem}"
        names.append(name)
    if len(set(names)) != len(names):
        return "--lora-modules names an adapter twice"
    return None


def lora_dir_warning(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--lora-dir`` now, or None. A warning, not an error: a volume
    or a sidecar may fill the folder in after the server starts."""
    if args.lora_dir is None or Path(args.lora_dir).is_dir():
        return None
    return (
        f"--lora-dir {args.lora_dir} is not a folder (yet): every POST /v1/load_lora_adapter "
        "is refused until it is"
    )


def _non_negative(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def port_clash_problem(args: argparse.Namespace) -> str | None:
    """Why two of the server's listeners would share a port, or None (checked first)."""
    flags_of: dict[int, str] = {}
    for flag, port in _ports(args).items():
        if port in flags_of:
            return f"{flag} {port} is also {flags_of[port]}: each listener needs a port of its own"
        flags_of[port] = flag
    return None
