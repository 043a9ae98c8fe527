"""The ``kvserve`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from kvserve import __version__, capacity, chat, demo
    from kvserve.bench import gateway as bench_gateway
    from kvserve.bench import offline as bench_offline
    from kvserve.bench import serving as bench_serving
    from kvserve.bench import suite as bench_suite
    from kvserve.demo_model import evaluate as demo_eval
    from kvserve.demo_model import train as demo_train
    from kvserve.gateway import main as gateway_main
    from kvserve.loadtest import cli as loadtest_cli
    from kvserve.model import pull as model_pull
    from kvserve.server import main as server_main

    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: paged-KV LLM inference engine and tools"
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    calc = sub.add_parser(
        "calc",
        help="size weights, KV cache and blocks for a model config",
        description="Capacity calculator: parameters, weight bytes, KV bytes per token, "
        "blocks and slots for given request lengths, and memory-bound decode time.",
    )
    capacity.add_calc_arguments(calc)
    calc.set_defaults(func=capacity.run_calc)

    serve = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
    )
    server_main.add_arguments(serve)
    serve.set_defaults(func=server_main.run)

    gateway = sub.add_parser(
        "gateway",
        help="the OpenAI front door: API keys, rate limits, routing across replicas",
        description="Serve the OpenAI API in front of kvserve replicas (gRPC), with API "
        "keys, per-key rate limits, admission control and prefix-aware routing.",
    )
    gateway_main.add_arguments(gateway)
    gateway.set_defaults(func=gateway_main.run)

    demo_p = sub.add_parser(
        "demo",
        help="run the offline engine on a small model and show what it does",
    )
    demo.add_arguments(demo_p)
    demo_p.set_defaults(func=demo.run)

    chat_p = sub.add_parser(
        "chat",
        help="chat in the terminal with a server (--url) or an in-process engine",
    )
    chat.add_arguments(chat_p)
    chat_p.set_defaults(func=chat.run)

    train_p = sub.add_parser(
        "train-demo",
        help="regenerate the bundled demo model from its seed (CPU, ~15 minutes)",
        description="Generate the travel-assistant corpus, train its tokenizer and a small "
        "Llama on the CPU, and write the checkpoint (default: over the bundled one). "
        "--check trains into a temporary directory and compares the files instead.",
    )
    demo_train.add_arguments(train_p)
    train_p.set_defaults(func=demo_train.run)

    eval_p = sub.add_parser(
        "eval-demo",
        help="score the demo model on held-out hotel requests",
        description="Greedy answers to held-out requests, checked against the world's rules "
        "(price cap, amenities, kind), plus held-out perplexity and sample conversations.",
    )
    demo_eval.add_arguments(eval_p)
    eval_p.set_defaults(func=demo_eval.run)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    off = bench_sub.add_parser(
        "offline",
        help="continuous batching vs transformers static batching, one process",
    )
    bench_offline.add_arguments(off)
    off.set_defaults(func=bench_offline.run)
    srv = bench_sub.add_parser(
        "serve",
        help="the HTTP server under concurrent streams vs the offline engine",
    )
    bench_serving.add_arguments(srv)
    srv.set_defaults(func=bench_serving.run)
    gw = bench_sub.add_parser(
        "gateway",
        help="the gateway's added latency and CPU cost, and prefix vs round-robin routing "
        "(replica and gateway processes)",
    )
    bench_gateway.add_arguments(gw)
    gw.set_defaults(func=bench_gateway.run)
    suite = bench_sub.add_parser(
        "suite",
        help="the performance suite: vs transformers, batching, prefix caching, roofline, "
        "KV memory, serving path (JSON + Markdown + PNG)",
        description=bench_suite.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_suite.add_arguments(suite)
    suite.set_defaults(func=bench_suite.run)

    loadtest = sub.add_parser(
        "loadtest",
        help="Locust load tests that measure SLO goodput (run, sweep)",
        description="Locust load tests of the OpenAI API (engine server or gateway): "
        "client-side TTFT/TPOT/ITL/E2E, goodput and SLO attainment. See loadtests/README.md.",
    )
    loadtest_sub = loadtest.add_subparsers(
        dest="loadtest_command", required=True, metavar="LOADTEST"
    )
    lt_run = loadtest_sub.add_parser(
        "run", help="one load test (headless, or --web for Locust's UI)"
    )
    loadtest_cli.add_run_arguments(lt_run)
    lt_run.set_defaults(func=loadtest_cli.run_loadtest)
    lt_sweep = loadtest_sub.add_parser(
        "sweep", help="raise the Poisson arrival rate step by step: the max goodput rate"
    )
    loadtest_cli.add_sweep_arguments(lt_sweep)
    lt_sweep.set_defaults(func=loadtest_cli.run_sweep)
    report_p = sub.add_parser(
        "report",
        help="recompute a load test's summary from its records.jsonl",
        description="Goodput, attainment and latency percentiles from saved load-test "
        "records, with the run's SLO or new ones; --compare another run. Exit 1 below the "
        "target.",
    )
    loadtest_cli.add_report_arguments(report_p)
    report_p.set_defaults(func=loadtest_cli.run_report)

    model = sub.add_parser("model", help="fetch and check model checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="MODEL")
    pull_p = model_sub.add_parser(
        "pull",
        help="copy or download a checkpoint into a directory and verify it",
        description="Put the model at SOURCE (hf://ORG/NAME[@REVISION], pvc://CLAIM[/PATH] "
        "or file:///ABS/PATH) into DEST and verify it, for kvserve serve --model DEST. "
        "Does nothing when DEST already holds SOURCE (an init container reruns on restart).",
    )
    model_pull.add_arguments(pull_p)
    pull_p.set_defaults(func=model_pull.run)
    verify_p = model_sub.add_parser(
        "verify",
        help="check a checkpoint directory without loading it",
        description="Check config.json, the safetensors headers and sizes (and shards of an "
        "index), and that a tokenizer is present; reads headers only, no torch.",
    )
    model_pull.add_verify_arguments(verify_p)
    verify_p.set_defaults(func=model_pull.run_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
