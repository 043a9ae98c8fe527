"""The rate sweep: Poisson arrivals at rising rates until the SLO attainment target fails.

Each step is a separate headless Locust run of the locustfile (``--load-shape poisson
--rate R``) for ``--step-seconds``, into its own directory; its records are then summarised
here with the same rule and SLOs for every step. The max goodput rate (docs/architecture.md §3,
DistServe) is the highest offered rate whose attainment still meets the target
(``definitions.max_goodput_rate``). Steps run in order of rate and, by default, stop after
the first one that misses the target (higher rates only queue more).
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.loadtest.process import run_locust
from kvserve.loadtest.records import read_records
from kvserve.loadtest.report import Slo, Summary, WindowRule, pkey, summarize
from kvserve.telemetry import definitions


@dataclass
class SweepStep:
    rate: float  # offered: the Poisson rate asked for, requests/s
    summary: Summary
    out_dir: Path
    locust_exit_code: int

    @property
    def met(self) -> bool:
        return self.summary.attainment_met


@dataclass
class SweepResult:
    steps: list[SweepStep]
    slo: Slo
    max_goodput_rate: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "kvserve.loadtest.sweep/1",
            "slo": {
                "ttft_ms": self.slo.ttft_ms,
                "tpot_ms": self.slo.tpot_ms,
                "attainment": self.slo.attainment,
            },
            "max_goodput_rate_rps": self.max_goodput_rate,
            "steps": [
                {"rate_rps": s.rate, "out_dir": str(s.out_dir), "summary": s.summary.to_dict()}
                for s in self.steps
            ],
        }


MAX_RATES = 1000  # steps of one sweep: each runs for --step-seconds


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2,4"`` or ``"1:8:1"`` (start:stop:step, stop included) → ascending rates."""
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            bits = part.split(":")
            if len(bits) != 3:
                raise ValueError(f"a rate range is START:STOP:STEP, got {part!r}")
            start, stop, step = (float(b) for b in bits)
            if not all(map(math.isfinite, (start, stop, step))):
                raise ValueError(f"a rate range takes finite numbers, got {part!r}")
            if step <= 0:
                raise ValueError(f"the step of {part!r} must be > 0")
            n = round((stop - start) / step)
            if n + 1 > MAX_RATES:  # checked before the list is built
                raise ValueError(f"{part!r} is {n + 1} rates; a sweep takes at most {MAX_RATES}")
            rates += [round(start + i * step, 6) for i in range(n + 1) if start + i * step > 0]
        else:
            rates.append(float(part))
    if not rates or not all(0 < r < math.inf for r in rates):  # NaN fails both
        raise ValueError(f"rates must be finite and > 0, got {text!r}")
    if len(set(rates)) > MAX_RATES:
        raise ValueError(f"{len(set(rates))} rates; a sweep takes at most {MAX_RATES}")
    return sorted(set(rates))


def find_max_goodput_rate(steps: Sequence[SweepStep], slo: Slo) -> float | None:
    return definitions.max_goodput_rate(
        [(s.rate, s.summary.attainment) for s in steps], slo.attainment
    )


Runner = Callable[[float, Path], int]  # (rate, step directory) → Locust's exit code


def sweep(
    rates: Sequence[float],
    run_step: Runner,
    out_dir: Path,
    slo: Slo,
    window: WindowRule,
    stop_after_failures: int = 1,
    progress: Callable[[str], None] | None = None,
) -> SweepResult:
    """Run ``run_step`` at each rate, summarise each from its records, find the max rate."""
    steps: list[SweepStep] = []
    failures = 0
    for i, rate in enumerate(rates, 1):
        step_dir = out_dir / f"step-{i:02d}-rate-{rate:g}"
        if progress:
            progress(f"step {i}/{len(rates)}: {rate:g} req/s → {step_dir}")
        code = run_step(rate, step_dir)
        records_path = step_dir / "records.jsonl"
        if code not in (0, 1) or not records_path.exists():
            raise RuntimeError(
                f"the Locust run at {rate:g} req/s failed (exit code {code}); see "
                f"{step_dir / 'locust.log'}"
            )
        summary = summarize(read_records(records_path), slo, window)
        steps.append(SweepStep(rate, summary, step_dir, code))
        if progress:
            progress("  " + step_line(steps[-1]))
        failures = 0 if summary.attainment_met else failures + 1
        if stop_after_failures and failures >= stop_after_failures and i < len(rates):
            if progress:
                progress(f"stopping: {failures} step(s) in a row below the attainment target")
            break
    return SweepResult(steps, slo, find_max_goodput_rate(steps, slo))


# ---- output -------------------------------------------------------------------------------
COLUMNS = (
    "rate", "sent/s", "done", "thr/s", "good/s", "attain", "errors",
    "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "SLO",
)  # fmt: skip


def _row(s: SweepStep) -> list[str]:
    m = s.summary

    def f(v: float | None, fmt: str = ".2f") -> str:
        return "—" if v is None else format(v, fmt)

    def lat(fig: str, q: float) -> str:
        return f(m.latency_ms[fig].percentiles[pkey(q)], ".0f")

    return [
        f"{s.rate:g}",
        f(m.offered_rate_rps),
        str(m.requests.attempted),
        f(m.request_throughput_rps),
        f(m.goodput_rps),
        "—" if m.attainment is None else f"{m.attainment:.1%}",
        "—" if m.error_rate is None else f"{m.error_rate:.1%}",
        lat("ttft", 50),
        lat("ttft", 99),
        lat("tpot", 50),
        lat("tpot", 99),
        "met" if s.met else "MISSED",
    ]


def _numbers(s: SweepStep) -> dict[str, Any]:
    """One step as numbers (shares as fractions), for the CSV."""
    m = s.summary

    def lat(fig: str, q: float) -> float | None:
        return m.latency_ms[fig].percentiles[pkey(q)]

    return {
        "rate_rps": s.rate,
        "sent_rps": m.offered_rate_rps,
        "attempted": m.requests.attempted,
        "throughput_rps": m.request_throughput_rps,
        "goodput_rps": m.goodput_rps,
        "attainment": m.attainment,
        "error_rate": m.error_rate,
        "ttft_p50_ms": lat("ttft", 50),
        "ttft_p99_ms": lat("ttft", 99),
        "tpot_p50_ms": lat("tpot", 50),
        "tpot_p99_ms": lat("tpot", 99),
        "met": s.met,
    }


def step_line(s: SweepStep) -> str:
    return "  ".join(f"{c} {v}" for c, v in zip(COLUMNS, _row(s), strict=True))


def format_table(result: SweepResult) -> str:
    rows = [list(COLUMNS)] + [_row(s) for s in result.steps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    best = result.max_goodput_rate
    lines += [
        "",
        "latencies in ms (successful requests); rate = offered Poisson rate, sent/s = measured",
        f"SLO: {result.slo.describe()}",
        "max goodput rate: "
        + (f"{best:g} req/s" if best is not None else "none of the steps met the target"),
    ]
    return "\n".join(lines)


def write_outputs(result: SweepResult, out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "sweep.json"
    js.write_text(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) + "\n")
    cs = out_dir / "sweep.csv"
    with cs.open("w", newline="", encoding="utf-8") as f:
        rows = [_numbers(step) for step in result.steps]
        w = csv.DictWriter(f, fieldnames=list(_numbers(result.steps[0])) if rows else ["rate_rps"])
        w.writeheader()
        w.writerows(rows)
    paths = [js, cs]
    if plots and result.steps:
        from kvserve.loadtest.plots import plot_sweep

        paths.append(plot_sweep(result.steps, result.slo, out_dir / "sweep.png"))
    return paths


# ---- Locust as a subprocess -------------------------------------------------------------------
def locust_runner(
    locustfile: Path, host: str, step_seconds: int, options: Sequence[str], stop_timeout: float
) -> Runner:
    """Each step: ``python -m locust -f LOCUSTFILE --headless`` with Poisson arrivals."""

    def run(rate: float, step_dir: Path) -> int:
        step_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
            "--only-summary", "-H", host, "-t", f"{step_seconds}s",
            "--stop-timeout", f"{stop_timeout:g}", *options,
            "--load-shape", "poisson", "--rate", f"{rate:g}", "--out-dir", str(step_dir),
        ]  # fmt: skip
        started = time.monotonic()
        with (step_dir / "locust.log").open("w") as log:
            code = run_locust(argv, stdout=log, stderr=subprocess.STDOUT)
        if code not in (0, 1):
            tail = (step_dir / "locust.log").read_text(errors="replace").splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
        print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr)
        return code

    return run
