"""The ``kvserve`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """A subcommand whose module is imported only when it runs (or ``--help`` needs it)."""

    module: str
    help: str
    description: str | None = None  # None: the module's docstring when ``doc`` is set
    doc: bool = False  # the description is the module's docstring, laid out as written
    add: str = "add_arguments"  # the module's function that adds the arguments
    run: str = "run"  # ... and the one that runs the command


@dataclass(frozen=True)
class Group:
    help: str
    commands: dict[str, Command]
    description: str | None = None


# Commands import their modules lazily: several pull in torch (seconds to import), which
# `kvserve gateway`, `kvserve calc` or `kvserve model pull` must not pay for.
COMMANDS: dict[str, Command | Group] = {
    "calc": Command(
        "kvserve.capacity",
        "size weights, KV cache and blocks for a model config",
        "Capacity calculator: parameters, weight bytes, KV bytes per token, "
        "blocks and slots for given request lengths, and memory-bound decode time.",
        add="add_calc_arguments",
        run="run_calc",
    ),
    "serve": Command("kvserve.server.main", "serve a model over the OpenAI-compatible HTTP API"),
    "gateway": Command(
        "kvserve.gateway.main",
        "the OpenAI front door: API keys, rate limits, routing across replicas",
        "Serve the OpenAI API in front of kvserve replicas (gRPC), with API "
        "keys, per-key rate limits, admission control and prefix-aware routing.",
    ),
    "demo": Command(
        "kvserve.demo", "run the offline engine on a small model and show what it does"
    ),
    "chat": Command(
        "kvserve.chat",
        "chat in the terminal with a server (--url) or an in-process engine",
    ),
    "train-demo": Command(
        "kvserve.demo_model.train",
        "regenerate the bundled demo model from its seed (CPU, ~12 minutes)",
        "Generate the travel-assistant corpus, train its tokenizer and a small "
        "Llama on the CPU, and write the checkpoint (default: over the bundled one). "
        "--check trains into a temporary directory and compares the files instead; "
        "--adapter travel-table trains the demo LoRA adapter on the frozen model (minutes).",
    ),
    "eval-demo": Command(
        "kvserve.demo_model.evaluate",
        "score the demo model on held-out hotel requests",
        "Greedy answers to held-out requests, checked against the world's rules "
        "(price cap, amenities, kind), plus held-out perplexity and sample conversations; "
        "--adapter travel-table scores the demo LoRA adapter's style rate and accuracy.",
    ),
    "bench": Group(
        "benchmarks",
        {
            "offline": Command(
                "kvserve.bench.offline",
                "continuous batching vs transformers static batching, one process",
            ),
            "serve": Command(
                "kvserve.bench.serving",
                "the HTTP server under concurrent streams vs the offline engine",
            ),
            "gateway": Command(
                "kvserve.bench.gateway",
                "the gateway's added latency, CPU cost and capacity, and prefix vs "
                "round-robin routing (replica and gateway processes)",
            ),
            "attacks": Command(
                "kvserve.bench.attacks",
                "what hostile clients cost a replica's other clients (stop strings, huge "
                "prompts, header floods, slow heads)",
            ),
            "suite": Command(
                "kvserve.bench.suite",
                "the performance suite: vs transformers, batching, prefix caching, "
                "roofline, KV memory, serving path, structured outputs, LoRA, int8, "
                "speculative decoding, fp8 KV, tensor parallelism (JSON + Markdown + PNG)",
                doc=True,
            ),
        },
    ),
    "loadtest": Group(
        "Locust load tests that measure SLO goodput (run, sweep)",
        {
            "run": Command(
                "kvserve.loadtest.cli",
                "one load test (headless, or --web for Locust's UI)",
                add="add_run_arguments",
                run="run_loadtest",
            ),
            "sweep": Command(
                "kvserve.loadtest.cli",
                "raise the Poisson arrival rate step by step: the max goodput rate",
                add="add_sweep_arguments",
                run="run_sweep",
            ),
        },
        "Locust load tests of the OpenAI API (engine server or gateway): "
        "client-side TTFT/TPOT/ITL/E2E, goodput and SLO attainment. See loadtests/README.md.",
    ),
    "report": Command(
        "kvserve.loadtest.cli",
        "recompute a load test's summary from its records.jsonl",
        "Goodput, attainment and latency percentiles from saved load-test "
        "records, with the run's SLO or new ones; --compare another run. Exit 1 below the "
        "target.",
        add="add_report_arguments",
        run="run_report",
    ),
    "adapters": Group(
        "LoRA adapters of a running engine",
        {
            "sync": Command(
                "kvserve.adapter_sync",
                "keep an engine's loaded LoRA adapters equal to a list file",
                doc=True,
            ),
        },
    ),
    "model": Group(
        "fetch and check model checkpoints",
        {
            "pull": Command(
                "kvserve.model.pull",
                "copy or download a checkpoint into a directory and verify it",
                "Put the model at SOURCE (hf://ORG/NAME[@REVISION], pvc://CLAIM[/PATH] "
                "or file:///ABS/PATH) into DEST and verify it, for kvserve serve --model "
                "DEST. Does nothing when DEST already holds SOURCE (an init container "
                "reruns on restart).",
            ),
            "verify": Command(
                "kvserve.model.pull",
                "check a checkpoint directory without loading it",
                "Check config.json, the safetensors headers and sizes (and shards of an "
                "index), and that a tokenizer is present; reads headers only, no torch.",
                add="add_verify_arguments",
                run="run_verify",
            ),
        },
    ),
}


def command_paths() -> list[tuple[str, ...]]:
    """Every runnable command, as the words that name it (``("bench", "gateway")``)."""
    paths: list[tuple[str, ...]] = []
    for name, entry in COMMANDS.items():
        if isinstance(entry, Group):
            paths += [(name, sub) for sub in entry.commands]
        else:
            paths.append((name,))
    return paths


def _chosen(argv: Sequence[str]) -> tuple[str, ...]:
    """The command ``argv`` names: its leading words (the parsers above a command take
    no option with a value, so the words are the first non-option arguments)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in COMMANDS:
        return ()
    entry = COMMANDS[words[0]]
    if isinstance(entry, Group):
        return (words[0], words[1]) if len(words) > 1 and words[1] in entry.commands else ()
    return (words[0],)


def _misplaced_options(argv: Sequence[str]) -> list[str]:
    """The options before the command is named whole that its parents do not take: the
    top level takes only --help and --version, a group only --help. argparse sets such an
    option aside and first complains of the missing command (``kvserve --versio``: "the
    following arguments are required: COMMAND"), or of the command's own arguments."""
    level: Mapping[str, Command | Group] = COMMANDS
    misplaced: list[str] = []
    for arg in argv:
        if arg.startswith("-"):
            allowed = ("-h", "--help", "--version") if level is COMMANDS else ("-h", "--help")
            if arg not in allowed:
                misplaced.append(arg)
            continue
        entry = level.get(arg)
        if not isinstance(entry, Group):
            break  # the command (its parser takes the rest), or a word argparse refuses
        level = entry.commands
    return misplaced


def _add_command(sub: Any, name: str, cmd: Command, load: bool) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=cmd.help, description=cmd.description, allow_abbrev=False
    )
    if not load:
        return p
    module = importlib.import_module(cmd.module)
    if cmd.doc:
        p.description = module.__doc__
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    getattr(module, cmd.add)(p)
    p.set_defaults(func=getattr(module, cmd.run), command_parser=p)
    return p


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` parser. With ``argv``, only the command it names gets its arguments
    (and its module imported); without, every command does."""
    from kvserve import __version__

    chosen = _chosen(argv) if argv is not None else None
    # No abbreviated flags (argparse's allow_abbrev), in any command: a flag is matched
    # whole, so a new flag cannot change what an old abbreviation meant, and the
    # operator's refusal of the flags it owns in spec.engine.extraArgs (an exact match)
    # cannot be bypassed with a prefix such as `--served`.
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: paged-KV LLM inference engine and tools",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if isinstance(entry, Command):
            _add_command(sub, name, entry, chosen is None or chosen == (name,))
            continue
        group = sub.add_parser(
            name, help=entry.help, description=entry.description, allow_abbrev=False
        )
        group_sub = group.add_subparsers(
            dest=f"{name}_command", required=True, metavar=name.upper()
        )
        for sub_name, cmd in entry.commands.items():
            _add_command(group_sub, sub_name, cmd, chosen is None or chosen == (name, sub_name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    if misplaced := _misplaced_options(argv):
        parser.error(f"unrecognized arguments: {' '.join(misplaced)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's (argparse's default)
        getattr(args, "command_parser", parser).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader gone shows here, not in Python's flush at exit
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket's, not `kvserve ... | head`'s
        # Stop quietly, as Unix tools do when the reader has all it wants; what is still
        # buffered goes to /dev/null (Python's own flush at exit would raise again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # a shell's status for a tool that SIGPIPE ended


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (captured output), or closed
        return False
