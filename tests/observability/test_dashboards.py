"""The generated Grafana dashboards: up to date, and following the conventions.

Structure only (no Prometheus needed except for the PromQL syntax check, which uses
``promtool``); test_dashboards_live.py runs every query against real data.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.observability import alerts, metric_names
from kvserve.observability import dashboards as dash
from kvserve.observability import queries as q
from kvserve.telemetry.prometheus import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS
from kvserve_operator.spec import SloSpec

ROOT = Path(__file__).resolve().parents[2]
DS = {"type": "prometheus", "uid": "${datasource}"}
ALLOWED_RANGES = {"$__rate_interval", "$__range", "1h"}


@pytest.fixture(scope="module")
def models() -> dict[str, dict[str, Any]]:
    return {d.uid: dash.render(d) for d in dash.dashboards()}


def targets(model: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return list(dash.iter_targets(model))


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in model["panels"] if p["type"] != "row"]


# ---- generated files ---------------------------------------------------------------------


def test_committed_files_are_what_the_generator_writes(capsys: pytest.CaptureFixture[str]) -> None:
    assert dash.main(["--check"]) == 0, capsys.readouterr().err


def test_check_fails_on_a_stale_copy_and_generate_fixes_it(tmp_path: Path) -> None:
    assert dash.main(["--root", str(tmp_path)]) == 0
    assert dash.main(["--root", str(tmp_path), "--check"]) == 0
    chart_copy = tmp_path / "charts/kvserve/files/dashboards/kvserve-replicas.json"
    chart_copy.write_text(chart_copy.read_text().replace("Load imbalance", "Load balance"))
    assert dash.main(["--root", str(tmp_path), "--check"]) == 1
    (tmp_path / "dashboards/kvserve-slo-overview.json").unlink()
    assert dash.main(["--root", str(tmp_path), "--check"]) == 1
    assert dash.main(["--root", str(tmp_path)]) == 0
    assert dash.main(["--root", str(tmp_path), "--check"]) == 0


def test_every_copy_is_identical_and_the_doc_lists_every_panel(
    models: dict[str, dict[str, Any]],
) -> None:
    doc = (ROOT / "docs" / "dashboards.md").read_text()
    for uid, model in models.items():
        texts = {(ROOT / folder / f"{uid}.json").read_text() for folder in dash.DASHBOARD_DIRS}
        assert len(texts) == 1
        for panel in panels(model):
            assert f"**{panel['title']}**" in doc


def test_generation_is_deterministic() -> None:
    first = [dash.to_json(d) for d in dash.dashboards()]
    assert first == [dash.to_json(d) for d in dash.dashboards()]
    for text in first:
        assert (
            text
            == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        )


def test_out_writes_only_the_json(tmp_path: Path) -> None:
    assert dash.main(["--out", str(tmp_path / "grafana")]) == 0
    assert sorted(p.name for p in (tmp_path / "grafana").iterdir()) == [
        "kvserve-replicas.json",
        "kvserve-slo-overview.json",
    ]


# ---- metrics exist --------------------------------------------------------------------------


def test_every_query_uses_metrics_and_labels_the_code_exports() -> None:
    assert dash.query_problems(dash.dashboards()) == []


def test_the_check_catches_an_unknown_metric_or_label() -> None:
    exported = metric_names.exported_metrics()
    bad = metric_names.problems(
        [
            ("typo", "rate(kvserve_time_to_first_token_secs_bucket[5m])"),
            ("label", 'sum(rate(kvserve_requests_finished_total{reason="stop"}[5m]))'),
            ("ok", 'kvserve_num_requests_running{namespace="a", pod="b", model="c"}'),
        ],
        exported,
    )
    assert len(bad) == 2
    assert "kvserve_time_to_first_token_secs_bucket" in bad[0] and "does not export" in bad[0]
    assert "no label reason" in bad[1]


def test_exported_names_come_from_the_real_registries() -> None:
    exported = metric_names.exported_metrics()
    # one per component, with the suffixes Prometheus stores
    assert exported["kvserve_time_to_first_token_seconds_bucket"].labels == {"model", "le"}
    assert exported["kvserve_requests_finished_total"].labels == {"model", "finished_reason"}
    assert "kvserve_gateway_rejections_total" in exported
    assert "kvserve_operator_reconcile_errors_total" in exported
    assert not any(name.endswith("_created") for name in exported)


def test_selector_scanner() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, pod) (rate(a_bucket{x=~"$v", le="2.0"}'
        "[$__rate_interval]))) / ignoring (pod) group_left () (b > 0) and on (pod) c"
    )
    found = [(s.metric, sorted(s.labels)) for s in metric_names.selectors(expr)]
    assert found == [("a_bucket", ["le", "x"]), ("b", []), ("c", [])]


# ---- conventions ------------------------------------------------------------------------------


def test_datasource_is_a_variable_and_no_uid_is_hard_coded(
    models: dict[str, dict[str, Any]],
) -> None:
    for model in models.values():
        ds_vars = [v for v in model["templating"]["list"] if v["type"] == "datasource"]
        assert [(v["name"], v["query"]) for v in ds_vars] == [("datasource", "prometheus")]

        def walk(node: Any, path: str) -> None:
            if isinstance(node, dict):
                if "uid" in node and path:  # the dashboard's own uid is at the top
                    assert node["uid"] == "${datasource}", path
                for k, v in node.items():
                    walk(v, f"{path}.{k}")
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(v, f"{path}[{i}]")

        walk(model, "")
        for panel in panels(model):
            assert panel["datasource"] == DS
            assert all(t["datasource"] == DS for t in panel["targets"])


def test_namespace_model_and_pod_variables(models: dict[str, dict[str, Any]]) -> None:
    for uid, model in models.items():
        names = [v["name"] for v in model["templating"]["list"]]
        expected = ["datasource", "namespace", "model"]
        expected += ["pod"] if uid == "kvserve-replicas" else []
        assert names[: len(expected)] == expected
        for v in model["templating"]["list"]:
            if v["type"] == "query":
                assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
                assert v["datasource"] == DS


def test_threshold_variables_offer_exactly_the_bucket_boundaries(
    models: dict[str, dict[str, Any]],
) -> None:
    slo = SloSpec()
    for model in models.values():
        by_name = {v["name"]: v for v in model["templating"]["list"]}
        for name, buckets, default in (
            ("ttft_slo", TTFT_BUCKETS, slo.ttft_seconds),
            ("tpot_slo", TOKEN_LATENCY_BUCKETS, slo.tpot_seconds),
        ):
            var = by_name[name]
            assert [o["value"] for o in var["options"]] == [q.le_value(b) for b in buckets]
            assert var["current"]["value"] == q.le_value(default)
        assert by_name["slo_target"]["current"]["value"] == str(slo.attainment)


def test_a_default_threshold_off_the_buckets_is_refused() -> None:
    with pytest.raises(ValueError, match="not a bucket boundary"):
        dash.threshold_options(TTFT_BUCKETS, 1.7, "TTFT")


def test_every_panel_has_a_unit_a_description_and_queries(
    models: dict[str, dict[str, Any]],
) -> None:
    for model in models.values():
        for panel in panels(model):
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            assert len(panel["description"]) >= 80, panel["title"]
            assert panel["targets"], panel["title"]
            assert all(t["expr"] and t["legendFormat"] for t in panel["targets"])


def test_rates_use_the_grafana_interval_variables(models: dict[str, dict[str, Any]]) -> None:
    rate_interval_used = 0
    for model in models.values():
        for _, panel, target in targets(model):
            ranges = set(re.findall(r"\[([^\]]+)\]", target["expr"]))
            assert ranges <= ALLOWED_RANGES, (panel["title"], ranges)
            rate_interval_used += "$__rate_interval" in ranges
            if panel["type"] == "stat":
                assert ranges == {"$__range"} and target["instant"]
    assert rate_interval_used > 50


def _group_after(expr: str, start: int) -> str:
    """The balanced parenthesised group starting at or after ``start``."""
    i = expr.index("(", start)
    depth = 0
    for j in range(i, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[j], 0)
        if depth == 0:
            return expr[i : j + 1]
    raise AssertionError(f"unbalanced: {expr}")


def test_every_division_is_guarded_against_zero(models: dict[str, dict[str, Any]]) -> None:
    divisions = 0
    for model in models.values():
        for _, panel, target in targets(model):
            expr = target["expr"]
            for m in re.finditer(r"/(\s*(ignoring|on)\s*\([^)]*\)\s*group_left\s*\(\))?", expr):
                divisions += 1
                denominator = _group_after(expr, m.end())
                # by a positive constant (the error budget) or by a series filtered to > 0
                assert denominator == "(1 - $slo_target)" or denominator.endswith("> 0)"), (
                    panel["title"],
                    denominator,
                )
    assert divisions > 30


def test_engine_queries_filter_by_namespace_model_and_pod(
    models: dict[str, dict[str, Any]],
) -> None:
    exported = metric_names.exported_metrics()
    for uid, model in models.items():
        for _, panel, target in targets(model):
            for sel in metric_names.selectors(target["expr"]):
                labels = exported[sel.metric].labels
                if sel.metric.startswith("kvserve_gateway_"):
                    if "model" in labels:
                        assert "model" in sel.labels, (panel["title"], sel)
                    continue
                need = {"namespace", "model"} | ({"pod"} if uid == "kvserve-replicas" else set())
                assert need <= sel.labels, (panel["title"], sel)


def test_layout_ids_and_grid(models: dict[str, dict[str, Any]]) -> None:
    for model in models.values():
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids))
        cells: set[tuple[int, int]] = set()
        for p in model["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, p["title"]
                    cells.add((x, y))


def test_alerts_named_in_descriptions_exist(models: dict[str, dict[str, Any]]) -> None:
    names = set(alerts.alert_names(alerts.rule_groups()))
    for model in models.values():
        for panel in panels(model):
            for name in re.findall(r"Kvserve\w+", panel["description"]):
                assert name in names, (panel["title"], name)


def test_summary_names_every_panel(models: dict[str, dict[str, Any]]) -> None:
    for model in models.values():
        text = dash.summary(model)
        assert all(p["title"] in text for p in model["panels"])


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (variables substituted) as a recording rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (apt install prometheus): PromQL syntax not checked")
    values = {"__rate_interval": "5m", "__range": "1h", "namespace": ".*", "model": ".*",
              "pod": "(a|b)", "ttft_slo": "2.0", "tpot_slo": "0.1", "slo_target": "0.99",
              "quantile": "0.95"}  # fmt: skip
    rules = []
    for d in dash.dashboards():
        for i, (_, _, t) in enumerate(dash.iter_targets(dash.render(d))):
            expr = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], t["expr"])
            rules.append({"record": f"check:{d.uid.replace('-', '_')}:{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(rules)} rules found" in run.stdout
