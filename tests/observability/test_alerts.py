"""The generated Prometheus rules: up to date, valid (``promtool check rules``) and
behaving as specified (``promtool test rules`` on synthetic histogram series)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.observability import alerts

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL_TESTS = Path(__file__).parent / "promtool" / "rules_test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not on PATH (apt install prometheus): rules not checked")
    return path


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def groups() -> dict[str, Any]:
    return alerts.rule_groups()


def all_rules(groups: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in groups["groups"] for r in g["rules"]]


# ---- generated files ---------------------------------------------------------------------


def test_committed_rule_files_are_what_the_generator_writes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert alerts.main(["--check"]) == 0, capsys.readouterr().err
    texts = {(ROOT / p).read_text() for p in alerts.RULE_FILES}
    assert len(texts) == 1


def test_check_fails_on_a_stale_copy(tmp_path: Path) -> None:
    assert alerts.main(["--root", str(tmp_path)]) == 0
    assert alerts.main(["--root", str(tmp_path), "--check"]) == 0
    copy = tmp_path / alerts.RULE_FILES[1]
    copy.write_text(copy.read_text().replace("> 14.4", "> 20"))
    assert alerts.main(["--root", str(tmp_path), "--check"]) == 1


def test_rules_query_only_exported_series(groups: dict[str, Any]) -> None:
    assert alerts.query_problems(groups) == []


# ---- promtool --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", alerts.RULE_FILES)
def test_promtool_check_rules(path: str) -> None:
    result = run("check", "rules", str(ROOT / path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run("test", "rules", str(PROMTOOL_TESTS))
    print(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_unit_tests_catch_a_wrong_burn_rate_table(tmp_path: Path) -> None:
    """The promtool tests are not vacuous: the fast page at 6× instead of 14.4× (it would
    fire on a 10× burn) and a 1d ticket without its `for` both make them fail."""
    mutants = {
        "fast-page-factor": (replace(alerts.BURN_WINDOWS[0], factor=6.0), 0),
        "ticket-for": (replace(alerts.BURN_WINDOWS[2], for_="0m"), 2),
    }
    runs: dict[str, subprocess.Popen[str]] = {}
    for name, (window, index) in mutants.items():
        table = list(alerts.BURN_WINDOWS)
        table[index] = window
        root = tmp_path / name
        (root / "dashboards").mkdir(parents=True)
        test_dir = root / "tests" / "observability" / "promtool"
        test_dir.mkdir(parents=True)
        shutil.copy(PROMTOOL_TESTS, test_dir / PROMTOOL_TESTS.name)
        text = alerts.to_yaml(alerts.rule_groups(alerts.AlertConfig(burn_windows=tuple(table))))
        (root / "dashboards" / "prometheus-rules.yaml").write_text(text)
        # Side by side: each run is ~4 s of one CPU.
        runs[name] = subprocess.Popen(
            [promtool(), "test", "rules", str(test_dir / PROMTOOL_TESTS.name)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        for name, proc in runs.items():
            assert proc.wait(timeout=300) != 0, f"mutant {name} passed the promtool tests"
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()


def test_every_alert_is_tested_firing_and_quiet(groups: dict[str, Any]) -> None:
    spec = yaml.safe_load(PROMTOOL_TESTS.read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alerts.alert_names(groups))
    assert names - fired == set(), "alerts never asserted to fire"
    assert names - quiet == set(), "alerts never asserted to stay quiet"


# ---- the rules' content ----------------------------------------------------------------------


def test_burn_rate_table_is_the_issue_s() -> None:
    table = [(w.long, w.short, w.factor, w.severity) for w in alerts.BURN_WINDOWS]
    assert table == [
        ("1h", "5m", 14.4, "page"),
        ("6h", "30m", 6.0, "page"),
        ("1d", "2h", 3.0, "ticket"),
        ("3d", "6h", 1.0, "ticket"),
    ]


def test_burn_alerts_use_the_bucket_at_the_threshold(groups: dict[str, Any]) -> None:
    rules = all_rules(groups)
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d"):
        assert 'le="2.0"' in records[f"kvserve:ttft_slo_bad_ratio:rate{window}"]
        assert 'le="0.1"' in records[f"kvserve:tpot_slo_bad_ratio:rate{window}"]
        assert f"[{window}]" in records[f"kvserve:ttft_slo_bad_ratio:rate{window}"]
    burn = [r for r in rules if r.get("labels", {}).get("slo")]
    assert len(burn) == 8
    for r in burn:
        long, short = r["labels"]["long_window"], r["labels"]["short_window"]
        slo = r["labels"]["slo"]
        assert f"(kvserve:{slo}_slo_bad_ratio:rate{long})" in r["expr"]
        assert f"(kvserve:{slo}_slo_bad_ratio:rate{short})" in r["expr"]
        assert r["expr"].count("(1 - 0.99)") == 2


def test_every_alert_has_severity_summary_numbers_and_a_runbook(groups: dict[str, Any]) -> None:
    headings = {m.group(1).lower() for m in re.finditer(r"^## (\S+)$", RUNBOOKS.read_text(), re.M)}
    for rule in all_rules(groups):
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("page", "ticket", "warning"), name
        ann = rule["annotations"]
        assert ann["summary"] and "{{ $labels." in ann["summary"] + ann["description"], name
        assert "{{ $value" in ann["description"], name
        assert re.search(r"\d", ann["description"].replace("{{ $value", "")), name
        assert ann["runbook_url"] == f"docs/runbooks.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/runbooks.md has no section ## {name}"


def test_custom_thresholds_are_written_with_out_and_must_be_buckets(tmp_path: Path) -> None:
    out = tmp_path / "rules.yaml"
    args = ["--ttft-seconds", "1", "--tpot-seconds", "0.05", "--target", "0.995"]
    assert alerts.main([*args, "--out", str(out)]) == 0
    text = out.read_text()
    assert 'le="1.0"' in text and 'le="0.05"' in text and "(1 - 0.995)" in text
    assert run("check", "rules", str(out)).returncode == 0
    assert alerts.main([*args]) == 2  # the repository copies keep the defaults
    with pytest.raises(ValueError, match="not a bucket boundary"):
        alerts.rule_groups(alerts.AlertConfig(ttft_seconds=1.7))
    assert alerts.main(["--tpot-seconds", "0.11", "--out", str(out)]) == 2
