"""One load-test run's state, outside Locust: the workload, the records, the report.

The locustfile creates one :class:`LoadTestRun` and calls ``start`` (test start),
``add`` (each finished request), ``finish`` (test stop). Keeping this here, not in the
locustfile, makes it typed and testable without starting Locust.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.loadtest.options import Settings
from kvserve.loadtest.records import RecordWriter, RequestRecord
from kvserve.loadtest.report import (
    PERCENTILES,
    Summary,
    format_summary,
    pkey,
    summarize,
    summarize_recent,
    write_summary,
)
from kvserve.loadtest.workloads import (
    TOKENS_PER_WORD,
    RequestSpec,
    Workload,
    calibration_text,
    make_workload,
)

log = logging.getLogger("kvserve.loadtest")
DEFAULT_CONTEXT_TOKENS = 4096
RECORDS_FILE = "records.jsonl"
# (request_type, name, response_time in ms, response_length): Locust's request event.
TimingEvent = tuple[str, str, float, int]


def timing_events(rec: RequestRecord) -> list[TimingEvent]:
    """The custom Locust events for one request: TTFT, TPOT, E2E once, ITL per gap.

    Float milliseconds (microsecond precision); only for successful requests, so Locust's
    tables hold the same population as the report's percentiles. ``response_length`` is the
    output tokens for E2E (Locust shows it as average size) and 0 otherwise.
    """
    if not rec.ok:
        return []
    name = rec.scenario
    out: list[TimingEvent] = []
    if (ttft := rec.ttft()) is not None:
        out.append(("TTFT", name, ttft * 1000, 0))
    if (tpot := rec.tpot()) is not None:
        out.append(("TPOT", name, tpot * 1000, 0))
    out += [("ITL", name, gap * 1000, 0) for gap in rec.itls()]
    if (e2e := rec.e2e()) is not None:
        out.append(("E2E", name, e2e * 1000, rec.num_output_tokens or 0))
    return out


@dataclass
class ServerInfo:
    model: str
    context_tokens: int | None


def discover(
    host: str, headers: dict[str, str], get: Callable[..., Any] | None = None
) -> ServerInfo:
    """The first model of ``GET /v1/models`` and its ``max_model_len`` (if reported)."""
    if get is None:
        import requests

        get = requests.get
    url = host.rstrip("/") + "/v1/models"
    try:
        resp = get(url, headers=headers, timeout=30)
    except Exception as exc:
        raise RuntimeError(f"cannot reach {url}: {exc}; is --host right?") from exc
    if resp.status_code != 200:
        hint = " (pass --api-key or set KVSERVE_API_KEY)" if resp.status_code == 401 else ""
        raise RuntimeError(f"GET {url} answered HTTP {resp.status_code}{hint}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"GET {url} lists no model; pass --model")
    first = data[0]
    ctx = first.get("max_model_len")
    return ServerInfo(str(first["id"]), int(ctx) if ctx else None)


def calibrate(
    host: str, headers: dict[str, str], model: str, post: Callable[..., Any] | None = None
) -> float | None:
    """Tokens per word of the workloads' text with this model's tokenizer, plus 10%.

    One ``/v1/completions`` request with ``max_tokens`` 1 (not recorded): the server's
    ``usage.prompt_tokens`` over the words sent. None if the server did not say.
    """
    if post is None:
        import requests

        post = requests.post
    text = calibration_text()
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": 1}
    try:
        resp = post(host.rstrip("/") + "/v1/completions", json=body, headers=headers, timeout=60)
        tokens = int(resp.json()["usage"]["prompt_tokens"])
    except Exception as exc:
        log.warning("could not measure tokens per word (%s); assuming %g", exc, TOKENS_PER_WORD)
        return None
    return round(1.1 * tokens / len(text.split()), 3)


@dataclass
class LoadTestRun:
    settings: Settings
    records: list[RequestRecord] = field(default_factory=list)
    workload: Workload | None = None
    model: str = ""
    host: str = ""
    started_at: float | None = None
    tokens_per_word: float = TOKENS_PER_WORD
    summary: Summary | None = None
    exit_code: int | None = None
    _writer: RecordWriter | None = None

    @property
    def records_path(self) -> Path:
        return self.settings.out_dir / RECORDS_FILE

    def start(
        self,
        host: str,
        get: Callable[..., Any] | None = None,
        post: Callable[..., Any] | None = None,
    ) -> None:
        """Find the model, its context and tokens per word, build the workload, and start a
        fresh records file."""
        s = self.settings
        self.host = host
        model, ctx = s.model, s.context_tokens
        if not model or ctx is None:
            info = discover(host, s.headers(), get)
            model = model or info.model
            ctx = ctx or info.context_tokens
        self.model = model
        context = ctx or DEFAULT_CONTEXT_TOKENS
        tpw = s.tokens_per_word or calibrate(host, s.headers(), model, post)
        self.tokens_per_word = tpw or TOKENS_PER_WORD
        self.workload = make_workload(
            s.workload, s.seed, context, s.max_tokens, self.tokens_per_word
        )
        self.records = []
        self.summary = None
        self.started_at = time.time()
        s.out_dir.mkdir(parents=True, exist_ok=True)
        self.records_path.unlink(missing_ok=True)
        self._writer = RecordWriter(self.records_path)
        log.info(
            "load test: %s workload, %s shape, model %r (context %d tokens, %.2f tokens/word), "
            "records → %s",
            s.workload, s.load_shape, model, context, self.tokens_per_word, self.records_path,
        )  # fmt: skip

    def next_spec(self) -> RequestSpec:
        if self.workload is None:
            raise RuntimeError("the load test has not started (no test_start event yet)")
        return self.workload.next()

    def add(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        if self._writer is not None:
            self._writer.write(rec)

    def finish(self, run_info: dict[str, Any] | None = None) -> Summary | None:
        """Close the records, compute, print and write the report; set the exit code."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        s = self.settings
        if not self.records:
            print("load test: no request was sent, so there is nothing to report", file=sys.stderr)
            self.exit_code = 1
            return None
        summary = summarize(self.records, s.slo, s.window)
        info = {
            "host": self.host,
            "model": self.model,
            "workload": s.workload,
            "load_shape": s.load_shape,
            "rate": s.rate if s.load_shape == "poisson" else None,
            "seed": s.seed,
            "context_tokens": self.workload.context_tokens if self.workload else None,
            "tokens_per_word": self.tokens_per_word,
            "started_at": self.started_at,
            "records": str(self.records_path),
            **(run_info or {}),
        }
        paths = write_summary(summary, s.out_dir, info)
        if s.plots:
            from kvserve.loadtest.plots import plot_run

            paths += plot_run(self.records, s.slo, s.out_dir)
        print("\n" + format_summary(summary), file=sys.stderr)
        print("wrote " + ", ".join(str(p) for p in [self.records_path, *paths]), file=sys.stderr)
        self.summary = summary
        self.exit_code = 0 if summary.attainment_met else 1
        if not summary.attainment_met:
            got = "none" if summary.attainment is None else f"{summary.attainment:.1%}"
            print(
                f"load test: attainment {got} is below the target {s.slo.attainment:.0%} "
                "→ exit code 1",
                file=sys.stderr,
            )
        return summary

    # ---- the web UI's live table ---------------------------------------------------------
    def live_rows(self, now: float | None = None, seconds: float = 30.0) -> list[dict[str, str]]:
        """Rows ``{"metric", "recent", "run", "target"}`` for the web UI's SLO tab."""
        s = self.settings
        now = time.time() if now is None else now
        recent = summarize_recent(self.records, s.slo, now, seconds)
        whole = summarize_recent(self.records, s.slo, now, float("inf"))

        def ms(summary: Summary | None, fig: str, q: float) -> str:
            v = summary.latency_ms[fig].percentiles[pkey(q)] if summary else None
            return "—" if v is None else f"{v:.1f}"

        def rate(v: float | None) -> str:
            return "—" if v is None else f"{v:.2f}"

        def share(v: float | None) -> str:
            return "—" if v is None else f"{v:.1%}"

        both = (recent, whole)
        rows = [
            ("requests done", *(str(x.requests.attempted) if x else "0" for x in both), ""),
            ("goodput (req/s)", *(rate(x.goodput_rps if x else None) for x in both), ""),
            ("throughput (req/s)",
             *(rate(x.request_throughput_rps if x else None) for x in both), ""),
            ("attainment", *(share(x.attainment if x else None) for x in both),
             f"≥ {s.slo.attainment:.0%}"),
            ("error rate", *(share(x.error_rate if x else None) for x in both), ""),
        ]  # fmt: skip
        for fig, target in (("ttft", s.slo.ttft_ms), ("tpot", s.slo.tpot_ms)):
            for q in (50, 90, 99):
                if q not in PERCENTILES:
                    continue
                limit = f"≤ {target:g}" if target is not None else ""
                rows.append(
                    (f"{fig.upper()} p{q} (ms)", ms(recent, fig, q), ms(whole, fig, q), limit)
                )
        return [{"metric": m, "recent": r, "run": w, "target": t} for m, r, w, t in rows]

    def live_json(self) -> str:
        return json.dumps({"rows": self.live_rows()})
