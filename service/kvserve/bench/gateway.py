"""``kvserve bench gateway``: the command's arguments, report and run over its three phases
(docs/bench-methods.md, "kvserve bench gateway"; docs/gateway-config.md, "Gateway
benchmark")."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from kvserve.arg_types import output_file
from kvserve.bench.cpu import usable_cpus
from kvserve.bench.gateway_capacity import print_capacity, run_capacity
from kvserve.bench.gateway_overhead import print_overhead, run_overhead
from kvserve.bench.gateway_routing import print_routing, run_routing
from kvserve.bench.launcher import Launcher, LaunchSettings
from kvserve.bench.results import say
from kvserve.config import DEFAULT_BLOCK_SIZE, DTYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", choices=("overhead", "capacity", "routing", "all"), default="all")
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    _numbers(p, [
        ("--block-size", DEFAULT_BLOCK_SIZE, "KV block size of the replicas"),
        ("--max-num-seqs", None, "replicas' max_num_seqs (default: enough for --streams and "
         "--agents)"),
        ("--max-num-batched-tokens", None, "replicas' token budget per step (default: the "
         "engine's)"),
        ("--seed", 0, None),
    ])  # fmt: skip
    p.add_argument(
        "--json",
        metavar="PATH",
        type=output_file,
        help="also write every figure to this JSON file",
    )
    _numbers(p, [("--startup-timeout", 300.0, "seconds for a process to be ready")])
    p.add_argument(
        "--placement",
        choices=("separate", "shared"),
        default="separate",
        help="overhead and capacity phases: 'separate' runs the gateway alone on one CPU and "
        "everything else on the others, as in production where it has its own pod (needs "
        "≥ 2 CPUs; with fewer, or 'shared', every process may run on every CPU)",
    )
    o = p.add_argument_group("overhead phase")
    _numbers(o, [
        ("--streams", 64, "concurrent streaming clients"),
        ("--requests", 384, "requests per pass"),
        ("--max-tokens", 32, "output tokens per request"),
        ("--max-tokens-spread", 0.5, "output lengths uniform in --max-tokens × (1 ± this), "
         "seeded; 0: all equal, so the streams start and end in waves of --streams requests "
         "at once"),
        ("--prompt-len", 32, "prompt tokens per request"),
        ("--rounds", 2, "rounds of direct + gateway passes (order alternates between rounds)"),
        ("--lone-pairs", 32, "then this many lone requests on each path, one at a time and "
         "interleaved, for the latency the gateway adds without batching noise (0: skip)"),
    ])  # fmt: skip
    c = p.add_argument_group("capacity phase (also uses --max-tokens and --rounds)")
    _numbers(c, [
        ("--capacity-streams", 128, "concurrent streams offered to the gateway (more than it "
         "can serve on one core)"),
        ("--capacity-requests", 2048, "requests per round"),
    ])  # fmt: skip
    r = p.add_argument_group("routing phase")
    _numbers(r, [
        ("--replicas", 3, None),
        ("--agents", 8, "agents running concurrently"),
        ("--questions", 4, "questions each agent asks in turn"),
        ("--system-tokens", 200, "size of the shared system prompt"),
        ("--routing-max-tokens", 32, "output tokens per agent answer"),
    ])  # fmt: skip
    r.add_argument(
        "--no-history",
        dest="history",
        action="store_false",
        help="send each question alone after the system prompt (default: each agent keeps "
        "its conversation, so later questions carry the earlier turns)",
    )


def _numbers(
    p: Any,  # a parser or an argument group
    flags: list[tuple[str, float | None, str | None]],
) -> None:
    """Options that take a number: an int, or a float where the default is one."""
    for flag, default, text in flags:
        p.add_argument(flag, type=type(default) if default is not None else int,
                       default=default, help=text)  # fmt: skip


PHASES = {  # the report's key of each phase: how it runs and how it prints
    "overhead": (run_overhead, print_overhead),
    "capacity": (run_capacity, print_capacity),
    "routing": (run_routing, print_routing),
}


def print_report(rep: dict[str, Any]) -> None:
    print(
        f"model: {rep['model']} ({rep['dtype']}, {rep['device']}); {rep['cpus']} CPU(s) on "
        "this machine"
    )
    if rep["cpus"] < 4:
        print(
            "note: too few CPUs for a core per process: processes that share CPUs wait for "
            "them, and that waiting is in the latencies"
        )
    for phase, (_, show) in PHASES.items():
        if rep[phase] is not None:
            show(rep[phase])


def _check_args(args: argparse.Namespace) -> str | None:
    positive = (
        "streams", "requests", "max_tokens", "prompt_len", "rounds", "replicas", "agents",
        "questions", "system_tokens", "routing_max_tokens", "block_size",
        "capacity_streams", "capacity_requests",
    )  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be ≥ 1"
    if not 0 <= args.max_tokens_spread < 1:
        return "--max-tokens-spread must be in [0, 1)"
    return None


def _failures(rep: dict[str, Any]) -> int:
    """The requests that failed, in every phase that ran."""
    o, c, r = rep["overhead"], rep["capacity"], rep["routing"]
    runs = ([o["direct"], o["gateway"]] if o else []) + (c["rounds"] if c else [])
    return sum(x["requests_failed"] for x in runs + (r["policies"] if r else []))


def _launch_settings(args: argparse.Namespace, model: str) -> LaunchSettings:
    """The replicas' and gateways' configuration from the command's arguments."""
    return LaunchSettings(
        model=model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs or max(args.streams, args.agents, 1),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        startup_timeout=args.startup_timeout,
        gateway_in_flight=max(args.streams, args.agents, args.capacity_streams, 1),
        gateway_queue=max(256, args.requests, args.agents),
    )


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        say(f"kvserve bench gateway: error: {problem}")
        return 2
    model = args.model
    if not model:
        from kvserve.demo_model import default_model_dir

        try:
            model = str(default_model_dir())
        except FileNotFoundError as exc:
            say(f"kvserve bench gateway: error: {exc}")
            return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    report: dict[str, Any] = {
        "model": Path(model).name,
        "dtype": args.dtype,
        "device": args.device,
        "cpus": usable_cpus(),
    }
    try:
        with (
            tempfile.TemporaryDirectory(prefix="kvserve-bench-gateway-") as tmp,
            Launcher(_launch_settings(args, model), Path(tmp)) as launcher,
        ):
            for phase, (measure, _) in PHASES.items():
                chosen = args.phase in (phase, "all")
                report[phase] = measure(args, launcher, tokenizer) if chosen else None
    except KeyboardInterrupt:
        say("interrupted; every process the benchmark started is stopped")
        return 130
    except RuntimeError as exc:
        say(f"kvserve bench gateway: error: {exc}")
        return 1
    print_report(report)
    if args.json:
        try:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:  # checked at the start, but a disk fills, a folder goes
            say(f"kvserve bench gateway: error: --json {args.json}: {exc}")
            return 2
        say(f"wrote {args.json}")
    failed = _failures(report)
    if failed:
        say(f"{failed} requests failed")
    return 0 if failed == 0 else 1
