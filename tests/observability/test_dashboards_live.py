"""Every dashboard query against a real Prometheus scraping a real engine and gateway.

Two ``kvserve serve`` replica processes and a gateway on loopback; a real ``prometheus``
scrapes them every second (with ``namespace`` / ``pod`` target labels, as the Kubernetes
scrape config adds them, so the queries run unchanged) and loads the generated rules
file. Traffic includes normal requests with a shared prefix, an overload burst (queue
rejections and routing overrides), a client that hangs up mid-stream (an abort), a bad
key (401) and a rate-limited tenant (429). Then every target of every panel, with the
dashboard variables substituted as Grafana would, must return data through the HTTP API,
every variable query must find its values, every recording rule must have data and no
rule may fail to evaluate.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvserve.observability import dashboards as dash
from tests.support.gateway import KEY_A, KEY_LIMITED, Gateway, start_gateway
from tests.support.prometheus import RULES, Prometheus, interpolate
from tests.support.prometheus import start_prometheus as start
from tests.support.replicas import REPLICA_MODEL as MODEL
from tests.support.replicas import Replica
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "test"
PODS = ("replica-0", "replica-1")
# Rate windows: long enough to hold all the traffic of the test (Prometheus starts first).
WINDOW = "10m"


def start_prometheus(tmp: Path, replicas: list[Replica], gateway: Gateway) -> Prometheus:
    def host(url: str) -> str:
        return url.removeprefix("http://")

    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kvserve-engine",
                "static_configs": [
                    {"targets": [host(r.http)], "labels": {"namespace": NAMESPACE, "pod": pod}}
                    for r, pod in zip(replicas, PODS, strict=True)
                ],
            },
            {
                "job_name": "kvserve-gateway",
                "static_configs": [
                    {
                        "targets": [host(gateway.url)],
                        "labels": {"namespace": NAMESPACE, "pod": "gateway-0"},
                    }
                ],
            },
        ],
    }
    prom = start(tmp, config)
    try:
        wait_until(lambda: prom.value('count(up{namespace="test"} == 1)') == 3, timeout=60)
    except BaseException:
        prom.stop()
        raise
    return prom


@dataclass
class Stack:
    replicas: list[Replica]
    gateway: Gateway
    prometheus: Prometheus


@pytest.fixture(scope="module")
def stack(
    shared_replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    if shutil.which("prometheus") is None:
        pytest.skip("the live dashboard test needs `prometheus` on PATH (apt install prometheus)")
    reps = shared_replicas
    gw: Gateway | None = None
    prom: Prometheus | None = None
    try:
        # Small slots and queue so that a burst is partly shed (queue_full) and a hot
        # prefix spills past its home replica (routing overrides).
        gw = start_gateway(
            reps,
            max_in_flight=2,
            admission={"queue_size": 1, "queue_timeout_seconds": 60},
            routing={"policy": "prefix", "load_factor": 1.25},
        )
        prom = start_prometheus(tmp_path_factory.mktemp("prometheus"), reps, gw)
        yield Stack(reps, gw, prom)
    finally:
        if prom is not None:
            prom.stop()
        if gw is not None:
            gw.stop()


# ---- traffic ---------------------------------------------------------------------------------

SYSTEM = "You are the travel desk of a small airline. Answer briefly. " * 10


def _post(gw: Gateway, body: dict[str, Any], key: str = KEY_A) -> int:
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    )
    return r.status_code


def _chat(user: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _hang_up_mid_stream(gw: Gateway) -> None:
    """A streaming client that closes its connection after a few chunks (an abort)."""
    body = json.dumps(_chat("tell me a long story", 200, stream=True))
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_A}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}"
    )
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request.encode())
        received = b""
        while received.count(b"data: ") < 3:
            data = sock.recv(4096)
            assert data, f"the gateway closed the stream early: {received!r}"
            received += data


def _engine_total(stack: Stack, name: str, **labels: str) -> float:
    return sum(r.metric(name, **labels) for r in stack.replicas)


def send_traffic(stack: Stack, round_no: int) -> dict[str, int]:
    gw = stack.gateway
    codes: dict[str, int] = {}
    aborts_before = _engine_total(stack, "kvserve_requests_finished_total", finished_reason="abort")

    # Normal requests sharing the system prompt (prefix-cache hits), some streamed.
    for i in range(6):
        code = _post(gw, _chat(f"round {round_no} question {i}", 12, stream=i % 2 == 1))
        assert code == 200
    # A burst of one hot prompt: 4 slots + 1 queue place, the rest is shed (503), and the
    # prefix's home fills up so later requests are overridden to the other replica.
    with ThreadPoolExecutor(10) as pool:
        burst = list(pool.map(lambda _: _post(gw, _chat("hot", 48)), range(10)))
    assert set(burst) <= {200, 503} and 200 in burst and 503 in burst, burst
    codes["shed"] = burst.count(503)
    # A client that hangs up mid-stream: the gateway cancels, the engine aborts.
    _hang_up_mid_stream(gw)
    wait_until(
        lambda: (
            _engine_total(stack, "kvserve_requests_finished_total", finished_reason="abort")
            > aborts_before
        ),
        timeout=60,
    )
    # Refusals: a wrong key (401) and a tenant over its 2 requests per minute (429).
    assert _post(gw, _chat("who am i", 2), key="sk-wrong") == 401
    short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    limited = [_post(gw, short, key=KEY_LIMITED) for _ in range(3)]
    assert 429 in limited, limited
    return codes


def wait_for_scrape(stack: Stack) -> None:
    """Until Prometheus holds the counters' current values (never a bare sleep)."""
    prom = stack.prometheus
    finished = _engine_total(stack, "kvserve_requests_finished_total")
    rejected = stack.gateway.metric("kvserve_gateway_rejections_total")
    wait_until(
        lambda: (
            prom.value('sum(kvserve_requests_finished_total{namespace="test"})') == finished
            and prom.value("sum(kvserve_gateway_rejections_total)") == rejected
        ),
        timeout=60,
    )


# ---- substituting the dashboard variables ------------------------------------------------------


def substitutions(model: dict[str, Any]) -> dict[str, str]:
    """Variable values as Grafana would interpolate them for this test's targets."""
    values = {
        "namespace": NAMESPACE,
        "model": MODEL,
        "pod": "(" + "|".join(PODS) + ")",  # a multi-value selection, Grafana's regex form
        "__rate_interval": WINDOW,
        "__range": WINDOW,
    }
    for var in model["templating"]["list"]:
        if var["type"] == "custom":
            values[var["name"]] = var["current"]["value"]
    return values


# (dashboard uid, row, panel title, refId) → [(labels, value)]
Results = dict[tuple[str, str, str, str], list[tuple[dict[str, str], float]]]


def evaluate_dashboards(prom: Prometheus) -> tuple[list[str], list[str], Results]:
    """(report lines, failures, results) for every panel target and variable of every
    dashboard."""
    report: list[str] = []
    failures: list[str] = []
    results: Results = {}
    for d in dash.dashboards():
        model = dash.render(d)
        values = substitutions(model)
        report.append(dash.summary(model))
        report.append(f"  results ({d.uid}, variables: "
                      f"{', '.join(f'{k}={v}' for k, v in sorted(values.items()))}):")  # fmt: skip
        for row, panel, target in dash.iter_targets(model):
            expr = interpolate(target["expr"], values)
            result = prom.query(expr)
            where = f"{d.uid} / {row} / {panel['title']} / {target['refId']}"
            shown = ", ".join(
                f"{_legend(target['legendFormat'], s.get('metric', {}))}={s['value'][1]}"
                for s in result[:4]
            )
            report.append(f"    {where}: {len(result)} series  {shown}")
            results[(d.uid, row, panel["title"], target["refId"])] = [
                (r.get("metric", {}), float(r["value"][1])) for r in result
            ]
            if not result:
                failures.append(f"{where}: no data for {dash.one_line(expr)}")
        for var in model["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.*), *(\w+)\)", var["definition"])
            assert m, var["definition"]
            series = prom.api("series", **{"match[]": interpolate(m.group(1), values)})
            found = sorted({s[m.group(2)] for s in series if m.group(2) in s})
            report.append(f"    variable {var['name']}: {found}")
            if not found:
                failures.append(f"{d.uid} / variable {var['name']}: no values")
    return report, failures, results


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), "?"), fmt) or "-"


# ---- the test ---------------------------------------------------------------------------------


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    stack: Stack, record_property: Callable[[str, object], None], request: pytest.FixtureRequest
) -> None:
    prom = stack.prometheus
    failures: list[str] = []
    report: list[str] = []
    results: Results = {}
    # Normally one round is enough; a slow machine may need another for the gauges that
    # must have been caught non-zero by a scrape (the running batch averaged over time).
    for round_no in range(3):
        send_traffic(stack, round_no)
        wait_for_scrape(stack)
        report, failures, results = evaluate_dashboards(prom)
        if not failures:
            break
    text = "\n".join(report)
    # Shown in the test output without -s (written past the output capture, as pytest's
    # live logging does), and attached to the report (a junit XML property).
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(text)
    record_property("dashboard_summary", text)
    assert not failures, "dashboard queries without data:\n" + "\n".join(failures)
    total = sum(1 for d in dash.dashboards() for _ in dash.iter_targets(dash.render(d)))
    assert len(results) == total

    # The traffic shows where it should: cancellations, each kind of rejection, cache hits.
    def values(key: tuple[str, str, str, str], label: str) -> dict[str, float]:
        return {m.get(label, ""): v for m, v in results[key]}

    o = "kvserve-slo-overview"
    reasons = values((o, "Traffic", "Requests by finish reason", "A"), "finished_reason")
    assert reasons["abort"] > 0 and reasons["length"] > 0
    rejected = values((o, "Traffic", "Gateway rejections by reason", "A"), "reason")
    assert all(
        rejected[r] > 0 for r in ("unauthenticated", "rate_limited_requests", "queue_full")
    ), rejected
    assert values((o, "Traffic", "Error and cancellation ratio", "B"), "model")[MODEL] > 0
    cache = values((o, "Throughput and capacity", "Prefix-cache hit ratio", "A"), "model")
    assert cache[MODEL] > 0
    for title in ("TTFT SLO attainment", "TPOT SLO attainment"):
        for row in ("SLO summary (dashboard time range)", "SLOs and error budget"):
            assert 0 <= values((o, row, title, "A"), "model")[MODEL] <= 1
    balance = ("kvserve-replicas", "Load balance and routing", "Request share per replica", "A")
    share = values(balance, "pod")
    assert set(share) == set(PODS) and sum(share.values()) == pytest.approx(1)

    # The generated rules load in this Prometheus, evaluate without error on real data,
    # and every recording rule has a value for the model.
    groups = prom.api("rules")["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"]}
    generated = yaml.safe_load(RULES.read_text())
    names = {r.get("alert") or r["record"] for g in generated["groups"] for r in g["rules"]}
    assert names == loaded
    wait_until(
        lambda: all(
            not r["lastEvaluation"].startswith("0001") and r["health"] == "ok"
            for g in prom.api("rules")["groups"]
            for r in g["rules"]
        ),
        timeout=30,
    )
    for g in generated["groups"]:
        for r in g["rules"]:
            if "record" in r:
                got = prom.query(f'{r["record"]}{{model="{MODEL}"}}')
                assert got, f"recording rule {r['record']} has no data"
