"""What every ``kvserve bench suite`` section returns (:class:`Section`), how a run is
written (``results.json``, ``results.md``), and the commands' plain-text tables."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.processes import proc_field

SCHEMA_VERSION = 1


def say(msg: str) -> None:
    """A progress message: on stderr, as stdout holds the results."""
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Column:
    name: str
    unit: str = ""  # "" for counts and labels

    @property
    def header(self) -> str:
        return f"{self.name} ({self.unit})" if self.unit else self.name


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[list[Any]]

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"table {self.title!r}: row {row} has the wrong width")


def table(title: str, headers: str, rows: list[list[Any]]) -> Table:
    """A table whose columns are given as their headers, ``|``-separated, each a name with
    its unit in parentheses where it has one: ``"concurrency | wall (s)"``."""
    columns = []
    for header in headers.split("|"):
        name, paren, unit = header.strip().rpartition(" (")
        columns.append(Column(name, unit[:-1]) if paren else Column(unit))
    return Table(title, columns, rows)


@dataclass
class Target:
    """One target from the issue: ``measured`` compared with ``target`` by ``op``."""

    name: str
    measured: float | None
    target: float
    unit: str
    op: str = ">="  # ">=" or "<="

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.target if self.op == ">=" else self.measured <= self.target


@dataclass
class Section:
    name: str  # machine name, e.g. "roofline"
    title: str
    setup: dict[str, Any]
    tables: list[Table]
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # file names in the output directory
    seconds: float = 0.0  # how long the section took
    error: str | None = None  # why the section failed (it then has no figures)


def model_setup(config: Any, dtype: str, device: str) -> dict[str, Any]:
    """The model facts every section reports (``config`` is a ``ModelConfig``)."""
    return {
        "model": "random Llama",
        "parameters": config.num_params(),
        "layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": f"{config.num_heads} query / {config.num_kv_heads} KV",
        "vocab_size": config.vocab_size,
        "dtype": dtype,
        "device": device,
    }


def hardware(device: str) -> dict[str, Any]:
    """The machine the run is on: CPU model and count, memory, torch threads, GPU."""
    import torch

    cpu = proc_field("/proc/cpuinfo", "model name")
    memory = proc_field("/proc/meminfo", "MemTotal:")  # "16384 kB"
    info: dict[str, Any] = {
        "cpu": cpu or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": None if memory is None else round(int(memory.split()[0]) / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


@dataclass
class SuiteResult:
    date: str
    command: str
    hardware: dict[str, Any]
    smoke: bool
    sections: list[Section]
    schema_version: int = SCHEMA_VERSION

    @staticmethod
    def now() -> str:
        return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str) + "\n"

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        js, md = out_dir / "results.json", out_dir / "results.md"
        js.write_text(self.to_json())
        md.write_text(render_markdown(self))
        return js, md


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2g}"
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def fixed(x: float | None, width: int = 12, spec: str = ".2f", sign: bool = False) -> str:
    """A number right-aligned in ``width`` characters (``-`` for None), for the commands'
    plain-text tables; ``sign``: always with its sign."""
    if x is None:
        return f"{'-':>{width}}"
    return format(x, f">{'+' if sign else ''}{width}{spec}")


def text_row(cells: Sequence[Any], widths: Sequence[int], specs: str = "") -> str:
    """One line of a command's plain-text table: the first cell left-aligned, the others
    right-aligned in their ``widths``, formatted by ``specs`` (space-separated, one per
    cell after the first; ``-`` for None)."""
    formats = specs.split() or [""] * (len(cells) - 1)
    rest = zip(cells[1:], widths[1 : len(cells)], formats, strict=True)
    return f"{cells[0]:<{widths[0]}}" + "".join(fixed(x, w, spec) for x, w, spec in rest)


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_section(s: Section) -> str:
    parts = [f"### {s.title}", ""]
    setup = ", ".join(f"{k}: {_cell(v)}" for k, v in s.setup.items())
    parts += [f"Setup: {setup}. Took {s.seconds:.0f} s.", ""]
    if s.error is not None:
        parts += [f"**Failed:** {s.error}", ""]
    for t in s.tables:
        parts += [f"**{t.title}**", "", markdown_table([c.header for c in t.columns], t.rows), ""]
    if s.targets:
        rows = [
            [
                t.name,
                f"{_cell(t.measured)} {t.unit}".strip(),
                f"{t.op} {_cell(t.target)} {t.unit}".strip(),
                {True: "met", False: "**not met**", None: "–"}[t.met],
            ]
            for t in s.targets
        ]
        parts += ["**Targets**", "", markdown_table(["target", "measured", "goal", ""], rows), ""]
    if s.notes:
        parts += [*(f"- {n}" for n in s.notes), ""]
    if s.plots:
        parts += [*(f"![{p}]({p})" for p in s.plots), ""]
    return "\n".join(parts)


def render_markdown(r: SuiteResult) -> str:
    hw = ", ".join(f"{k}: {_cell(v)}" for k, v in r.hardware.items())
    head = [
        f"## kvserve bench suite — {r.date}"
        + (" (smoke mode: sizes too small to mean anything)" if r.smoke else ""),
        "",
        f"Command: `{r.command}`",
        "",
        f"Hardware: {hw}.",
        "",
    ]
    return "\n".join(head + [render_section(s) for s in r.sections])
