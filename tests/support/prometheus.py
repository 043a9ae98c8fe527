"""Reading a server's ``/metrics``; a real Prometheus server and the dashboards' queries
for it."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.observability import dashboards as dash
from tests.support.net import free_port
from tests.support.waiting import wait_until

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "prometheus-rules.yaml"


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# ---- a real Prometheus server (tests skip when ``prometheus`` is not on PATH) ---------------


@dataclass
class Prometheus:
    """A ``prometheus`` process on 127.0.0.1 and its HTTP API."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] in ("vector", "scalar"), data
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def start_prometheus(
    workdir: Path, config: dict[str, Any], binary: Path | str | None = None
) -> Prometheus:
    """``binary`` (default: ``prometheus`` on PATH) with ``config`` (a prometheus.yml as a
    dict), once it is ready."""
    binary = binary or shutil.which("prometheus")
    assert binary is not None, "prometheus is not on PATH"
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode}:\n{prom.log_tail()}")
        try:
            return httpx.get(f"{prom.url}/-/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, timeout=60)
    except BaseException:
        prom.stop()
        raise
    return prom


def interpolate(expr: str, values: dict[str, str]) -> str:
    """A dashboard query with its ``$variables`` substituted as Grafana would."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise AssertionError(f"no test value for variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def dashboard_queries(values: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(where, query) of every panel target of every generated dashboard, with
    ``values`` for its variables (and each custom variable's current value)."""
    for d in dash.dashboards():
        model = dash.render(d)
        mine = dict(values)
        for var in model["templating"]["list"]:
            if var["type"] == "custom":
                mine[var["name"]] = var["current"]["value"]
        for row, panel, target in dash.iter_targets(model):
            where = f"{d.uid} / {row} / {panel['title']} / {target['refId']}"
            yield where, interpolate(target["expr"], mine)


def recording_rules(path: Path = RULES) -> list[str]:
    """The names of the recording rules in the generated rules file."""
    generated = yaml.safe_load(path.read_text())
    return [r["record"] for g in generated["groups"] for r in g["rules"] if "record" in r]
