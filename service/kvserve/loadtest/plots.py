"""PNG charts of a run and of a sweep (matplotlib, Agg backend: no display needed).

* ``latency_over_time.png`` -- TTFT and TPOT of each request by send time, with rolling
  p50/p90/p99 and the SLO as a dashed line: queueing shows up as a rising TTFT.
* ``latency_cdf.png`` -- the distributions of TTFT, TPOT, ITL and E2E (successful requests).
* ``sweep.png`` -- goodput and throughput, and attainment, against the offered rate, with the
  attainment target and the max goodput rate marked.

The figures are the same ones the report computes (``kvserve.telemetry.definitions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.loadtest.records import RequestRecord
from kvserve.loadtest.report import Slo
from kvserve.telemetry import definitions

if TYPE_CHECKING:
    from kvserve.loadtest.sweep import SweepStep


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(records: Sequence[RequestRecord], slo: Slo, out_dir: Path) -> list[Path]:
    """The run's two charts; none without a successful request."""
    ok = [r for r in records if r.ok]
    if not ok:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_over_time(ok, slo, out_dir / "latency_over_time.png"), _cdfs(ok, slo, out_dir)]


def _over_time(ok: Sequence[RequestRecord], slo: Slo, path: Path) -> Path:
    """Each request's value (dots) and rolling percentiles over the last ``k`` requests."""
    plt = _pyplot()
    by_send = sorted(ok, key=lambda r: r.send_time)
    t0 = by_send[0].send_time
    k = max(5, min(200, len(by_send) // 20))
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax, name, limit in ((axes[0], "TTFT", slo.ttft_ms), (axes[1], "TPOT", slo.tpot_ms)):
        points = [
            (r.send_time - t0, v * 1000)
            for r in by_send
            if (v := (r.ttft() if name == "TTFT" else r.tpot())) is not None
        ]
        if points:
            ax.scatter(*zip(*points, strict=True), s=6, color="grey", alpha=0.4, label="request")
        for q in (50, 90, 99):
            xs, ys = [], []
            for i in range(len(points)):
                window = [v for _, v in points[max(0, i + 1 - k) : i + 1]]
                value = definitions.percentile(window, q)
                if value is not None:
                    xs.append(points[i][0])
                    ys.append(value)
            ax.plot(xs, ys, linewidth=1.5, label=f"p{q:g} of last {k}")
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    axes[1].set_xlabel("send time since the first request (s)")
    axes[0].set_title("Client-side TTFT and TPOT over the run (rolling percentiles)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdfs(ok: Sequence[RequestRecord], slo: Slo, out_dir: Path) -> Path:
    plt = _pyplot()
    values: dict[str, list[float]] = {
        "TTFT": [v for v in (r.ttft() for r in ok) if v is not None],
        "TPOT": [v for v in (r.tpot() for r in ok) if v is not None],
        "ITL": [g for r in ok for g in r.itls()],
        "E2E": [v for v in (r.e2e() for r in ok) if v is not None],
    }
    limits = {"TTFT": slo.ttft_ms, "TPOT": slo.tpot_ms}
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, (name, vs) in zip(axes.flat, values.items(), strict=True):
        ms = sorted(v * 1000 for v in vs)
        if ms:
            ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post")
        limit = limits.get(name)
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", linewidth=1, label="SLO")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of values ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle("Latency CDFs (successful requests)")
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(steps: Sequence[SweepStep], slo: Slo, path: Path) -> Path:
    plt = _pyplot()
    rates = [s.rate for s in steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(rates, rates, color="grey", linestyle=":", label="offered")
    ax1.plot(
        rates,
        [s.summary.request_throughput_rps or 0 for s in steps],
        marker="o",
        label="throughput",
    )
    ax1.plot(rates, [s.summary.goodput_rps or 0 for s in steps], marker="o", label="goodput")
    ax1.set_ylabel("requests/s")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(
        rates, [(s.summary.attainment or 0) * 100 for s in steps], marker="o", label="attainment"
    )
    ax2.axhline(slo.attainment * 100, color="red", linestyle="--", linewidth=1, label="target")
    best = definitions.max_goodput_rate(
        [(s.rate, s.summary.attainment) for s in steps], slo.attainment
    )
    if best is not None:
        for ax in (ax1, ax2):
            ax.axvline(best, color="green", linestyle="--", linewidth=1)
        ax2.annotate(
            f"max goodput rate {best:g} req/s",
            (best, slo.attainment * 100),
            textcoords="offset points",
            xytext=(5, -15),
            fontsize=8,
            color="green",
        )
    ax2.set_ylabel("SLO attainment (%)")
    ax2.set_xlabel("offered rate (requests/s, Poisson arrivals)")
    ax2.set_ylim(0, 105)
    ax2.legend(loc="lower left", fontsize=8)
    ax2.grid(alpha=0.3)
    ax1.set_title(f"Rate sweep: {slo.describe()}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
