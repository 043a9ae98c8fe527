"""``kvserve loadtest run|sweep`` and ``kvserve report``: argument sets and entry points.

``run`` and ``sweep`` start Locust (``python -m locust``) on the repository's
``loadtests/locustfile.py`` as a subprocess, so the load test behaves exactly as when Locust
is called by hand; ``report`` only reads records. Each has ``add_*_arguments(parser)`` and
``run_*(args) -> exit code``, the style of ``kvserve.cli``; ``main(argv)`` runs them without
it (``python -m kvserve.loadtest ...``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvserve.arg_types import http_url, non_negative_seconds, positive_int
from kvserve.loadtest.options import DEFAULT_STOP_TIMEOUT_S, OPTIONS, add_options, to_argv
from kvserve.loadtest.report import Slo, WindowRule


def default_locustfile() -> Path | None:
    """``./loadtests/locustfile.py``, else the one next to this source tree (editable install)."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        path = base / "loadtests" / "locustfile.py"
        if path.is_file():
            return path
    return None


def _locustfile(args: argparse.Namespace) -> Path:
    path = Path(args.locustfile) if args.locustfile else default_locustfile()
    if path is None or not path.is_file():
        raise SystemExit(
            "kvserve loadtest: error: no locustfile found; run from the kvserve repository or "
            "pass --locustfile PATH/TO/loadtests/locustfile.py"
        )
    return path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-H",
        "--host",
        required=True,
        type=http_url,
        help="base URL of the engine server or gateway, e.g. http://127.0.0.1:8000",
    )
    p.add_argument("--locustfile", help="default: loadtests/locustfile.py of this repository")
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=DEFAULT_STOP_TIMEOUT_S,
        help="seconds the end of a run waits for requests in flight",
    )


# ---- kvserve loadtest run -----------------------------------------------------------------------
def add_run_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("-u", "--users", type=int, default=4, help="constant shape: users")
    p.add_argument(
        "-r", "--spawn-rate", type=float, help="users started per second (default: all at once)"
    )
    p.add_argument(
        "-t", "--run-time", type=run_time, default="60s", help="e.g. 60s, 5m, 1h30m (default 60s)"
    )
    p.add_argument(
        "--web",
        action="store_true",
        help="open Locust's web UI (with the SLO tab) instead of running headless",
    )
    add_options(p.add_argument)
    p.add_argument(
        "locust_args",
        nargs=argparse.REMAINDER,
        help="after --: more Locust arguments (e.g. -- --csv out/locust)",
    )


_TIMESPAN = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?")


def run_time(text: str) -> str:
    """Locust's -t (``90``, ``60s``, ``5m``, ``1h30m``), more than zero: Locust reads
    0 as no limit at all, and a load test must stop by itself."""
    match = _TIMESPAN.fullmatch(text.strip())
    if not text.strip() or match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: not a time span like 60s, 5m or 1h30m")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    if hours * 3600 + minutes * 60 + seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than zero (0 never stops)")
    return text.strip()


def run_command(args: argparse.Namespace) -> list[str]:
    extra = list(args.locust_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    argv = [sys.executable, "-m", "locust", "-f", str(_locustfile(args)), "-H", args.host]
    if not args.web:
        argv += ["--headless", "-t", str(args.run_time)]
    argv += ["-u", str(args.users), "-r", str(args.spawn_rate or args.users)]
    argv += ["--stop-timeout", f"{args.stop_timeout:g}", *to_argv(args), *extra]
    return argv


def run_loadtest(args: argparse.Namespace) -> int:
    from kvserve.loadtest.options import describe_argv
    from kvserve.loadtest.process import run_locust

    argv = run_command(args)
    print(describe_argv(argv), file=sys.stderr, flush=True)
    try:
        return run_locust(argv)
    except KeyboardInterrupt:
        return 130  # Locust wrote what it had (its report)


# ---- kvserve loadtest sweep ---------------------------------------------------------------------
def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--rates",
        default="0.5,1,2,4,8",
        help="offered Poisson rates, requests/s: a list (0.5,1,2,4) or "
        "START:STOP:STEP (1:8:1); run in ascending order",
    )
    p.add_argument(
        "--step-seconds", type=positive_int, default=60, help="seconds of arrivals per step"
    )
    p.add_argument(
        "--stop-after-failures",
        type=int,
        default=1,
        help="stop after this many steps in a row below the attainment target (0: run every rate)",
    )
    p.add_argument(
        "--require-rate",
        type=float,
        help="exit 1 unless the max goodput rate is at least this (a CI gate)",
    )
    for opt in OPTIONS:  # the step shape is fixed: Poisson at each rate, one directory each
        if opt.dest not in (
            "load_shape",
            "rate",
            "step_users",
            "step_seconds",
            "steps",
            "think_time",
        ):
            p.add_argument(opt.flag, **opt.kwargs)
    p.set_defaults(out_dir="loadtest-sweep")


def run_sweep(args: argparse.Namespace) -> int:
    from kvserve.loadtest.options import Settings
    from kvserve.loadtest.sweep import (
        format_table,
        locust_runner,
        parse_rates,
        sweep,
        write_outputs,
    )

    try:
        rates = parse_rates(args.rates)
        settings = Settings.from_namespace(args)
    except ValueError as exc:
        print(f"kvserve loadtest sweep: error: {exc}", file=sys.stderr)
        return 2
    options = [a for a in to_argv(args) if a]
    # Each step writes its own directory; the sweep's --out-dir is their parent.
    if "--out-dir" in options:
        i = options.index("--out-dir")
        del options[i : i + 2]
    runner = locust_runner(
        _locustfile(args), args.host, args.step_seconds, options, args.stop_timeout
    )
    out = settings.out_dir
    print(
        f"sweep: {len(rates)} rates ({', '.join(f'{r:g}' for r in rates)} req/s), "
        f"{args.step_seconds} s each, {settings.workload} workload → {out}",
        file=sys.stderr,
        flush=True,
    )
    try:
        result = sweep(
            rates,
            runner,
            out,
            settings.slo,
            settings.window,
            args.stop_after_failures,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except RuntimeError as exc:
        print(f"kvserve loadtest sweep: error: {exc}", file=sys.stderr)
        return 2
    paths = write_outputs(result, out, settings.plots)
    print("\n" + format_table(result))
    print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    if result.max_goodput_rate is None:
        return 1
    if args.require_rate is not None and result.max_goodput_rate < args.require_rate:
        print(
            f"max goodput rate {result.max_goodput_rate:g} < required {args.require_rate:g} req/s",
            file=sys.stderr,
        )
        return 1
    return 0


# ---- kvserve report ----------------------------------------------------------------------------
def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "records",
        nargs="+",
        type=Path,
        help="records.jsonl files of one run (several: e.g. one per Locust worker)",
    )
    saved = "default: the run's, from the summary.json next to the records"
    p.add_argument("--slo-ttft-ms", type=float, help=f"{saved}; else none")
    p.add_argument("--slo-tpot-ms", type=float, help=f"{saved}; else none")
    p.add_argument("--slo-attainment", type=float, help=f"{saved}; else 0.9")
    p.add_argument("--window", choices=("cohort", "steady"), help=f"{saved}; else cohort")
    p.add_argument("--warmup-s", type=non_negative_seconds, help=f"{saved}; else 0")
    p.add_argument("--cooldown-s", type=non_negative_seconds, help=f"{saved}; else 0")
    p.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="RECORDS",
        help="another run's records: show both side by side, same SLO and rule",
    )
    p.add_argument(
        "--out-dir", type=Path, help="also write summary.json, summary.csv and the PNGs here"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plots", action="store_true")


def _saved_summary(args: argparse.Namespace) -> dict[str, Any]:
    """The run's own summary.json next to the records ({} when there is none, or it is no
    JSON object)."""
    summary_json = args.records[0].parent / "summary.json"
    if not summary_json.is_file():
        return {}
    try:
        found = json.loads(summary_json.read_text())
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _flag_or_saved(flag: Any, summary: dict[str, Any], section: str, key: str, default: Any) -> Any:
    """A report flag's value; when it is not given, the run's (``summary[section][key]``);
    when the run saved none either, ``default``."""
    saved = summary.get(section)
    for value in (flag, saved.get(key) if isinstance(saved, dict) else None):
        if value is not None:
            return value
    return default


def _slo_from(args: argparse.Namespace, summary: dict[str, Any]) -> Slo:
    """The SLO flags; each one not given is the run's (a flag overrides only its own)."""
    return Slo(
        _flag_or_saved(args.slo_ttft_ms, summary, "slo", "ttft_ms", None),
        _flag_or_saved(args.slo_tpot_ms, summary, "slo", "tpot_ms", None),
        _flag_or_saved(args.slo_attainment, summary, "slo", "attainment", 0.9),
    )


def _rule_from(args: argparse.Namespace, summary: dict[str, Any]) -> WindowRule:
    """The window flags; each one not given is the run's."""
    return WindowRule(
        _flag_or_saved(args.window, summary, "window", "rule", "cohort"),
        _flag_or_saved(args.warmup_s, summary, "window", "warmup_s", 0.0),
        _flag_or_saved(args.cooldown_s, summary, "window", "cooldown_s", 0.0),
    )


def run_report(args: argparse.Namespace) -> int:
    from kvserve.loadtest.records import read_records
    from kvserve.loadtest.report import format_summary, summarize, write_summary

    try:
        saved = _saved_summary(args)
        slo = _slo_from(args, saved)
        rule = _rule_from(args, saved)
        records = read_records(*args.records)
        summary = summarize(records, slo, rule)
        other = summarize(read_records(*args.compare), slo, rule) if args.compare else None
    except (OSError, ValueError) as exc:
        print(f"kvserve report: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(format_summary(summary))
    if other is not None:
        from kvserve.loadtest.report import format_comparison

        print(
            "\n"
            + format_comparison(
                summary, other, ", ".join(map(str, args.records)), ", ".join(map(str, args.compare))
            )
        )
    if args.out_dir:
        try:
            paths = write_summary(
                summary, args.out_dir, {"records": [str(p) for p in args.records]}
            )
        except OSError as exc:  # e.g. --out-dir is a file
            print(f"kvserve report: error: --out-dir {args.out_dir}: {exc}", file=sys.stderr)
            return 2
        if not args.no_plots:
            from kvserve.loadtest.plots import plot_run

            paths += plot_run(records, slo, args.out_dir)
        print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    return 0 if summary.attainment_met else 1


# ---- python -m kvserve.loadtest ---------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.loadtest",
        description="Locust load tests that measure SLO goodput, and their reports.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run_p = sub.add_parser("run", help="one Locust load test (headless, or --web)")
    add_run_arguments(run_p)
    run_p.set_defaults(func=run_loadtest)
    sweep_p = sub.add_parser("sweep", help="raise the Poisson rate step by step: max goodput rate")
    add_sweep_arguments(sweep_p)
    sweep_p.set_defaults(func=run_sweep)
    report_p = sub.add_parser("report", help="recompute the summary from saved records")
    add_report_arguments(report_p)
    report_p.set_defaults(func=run_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
