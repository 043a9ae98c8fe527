"""``kvserve report`` / ``python -m kvserve.loadtest`` arguments, and the shared options."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import pytest

from kvserve.loadtest import cli
from kvserve.loadtest.options import Settings, add_options, describe_argv, to_argv
from kvserve.loadtest.records import write_records
from kvserve.loadtest.report import Slo, WindowRule, summarize, write_summary
from tests.loadtest.helpers import cohort_100
from tests.support.processes import run_into_closed_pipe


def test_report_recomputes_and_gates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "records.jsonl"
    write_records(path, cohort_100())
    assert cli.main(["report", str(path), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"]) == 0
    out = capsys.readouterr().out
    assert "goodput             9.50 req/s" in out and "attainment          95.0%" in out
    # A stricter target fails the gate.
    args = ["report", str(path), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"]
    assert cli.main([*args, "--slo-attainment", "0.99"]) == 1
    capsys.readouterr()
    assert cli.main([*args, "--json", "--out-dir", str(tmp_path / "again")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["goodput_rps"] == pytest.approx(9.5)
    assert (tmp_path / "again" / "summary.json").is_file()
    assert (tmp_path / "again" / "latency_cdf.png").is_file()


def saved_run(run_dir: Path, slo: Slo, rule: WindowRule | None = None) -> Path:
    """A run's outputs as ``kvserve loadtest run`` leaves them: the records of
    ``cohort_100`` and the summary.json of its SLO and window rule; the records' path."""
    path = run_dir / "records.jsonl"
    write_records(path, cohort_100())
    write_summary(summarize(cohort_100(), slo, rule), run_dir)
    return path


def test_report_takes_the_runs_slo_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = saved_run(tmp_path, Slo(ttft_ms=1000, tpot_ms=100, attainment=0.96))
    assert cli.main(["report", str(path)]) == 1  # 95% < the run's 96%
    assert "TTFT ≤ 1000 ms and TPOT ≤ 100 ms, attainment target 96%" in capsys.readouterr().out
    other = tmp_path / "other.jsonl"
    write_records(other, [r for r in cohort_100() if r.ok])
    args = ["report", str(path), "--slo-attainment", "0.95", "--compare", str(other)]
    assert cli.main(args) == 0
    assert "B − A" in capsys.readouterr().out


def test_one_slo_flag_overrides_only_its_own_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A single SLO flag dropped the run's other SLOs (TTFT gone, attainment back to 90%)."""
    path = saved_run(tmp_path, Slo(ttft_ms=1000, tpot_ms=100, attainment=0.96))
    assert cli.main(["report", str(path), "--slo-tpot-ms", "200"]) == 0  # 96 of 98 ≥ 96%
    out = capsys.readouterr().out
    assert "SLO: TTFT ≤ 1000 ms and TPOT ≤ 200 ms, attainment target 96%" in out, out


def test_report_applies_the_runs_window_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's steady window (warm-up 2 s, cool-down 1 s) was not saved, and the report
    used the closed cohort unless told otherwise."""
    path = saved_run(tmp_path, Slo(ttft_ms=1000, tpot_ms=100), WindowRule("steady", 2.0, 1.0))
    assert cli.main(["report", str(path), "--json"]) in (0, 1)
    window = json.loads(capsys.readouterr().out)["window"]
    assert (window["rule"], window["warmup_s"], window["cooldown_s"]) == ("steady", 2.0, 1.0)
    # A flag overrides only its own part of the rule.
    assert cli.main(["report", str(path), "--json", "--cooldown-s", "0"]) in (0, 1)
    window = json.loads(capsys.readouterr().out)["window"]
    assert (window["rule"], window["warmup_s"], window["cooldown_s"]) == ("steady", 2.0, 0.0)
    assert cli.main(["report", str(path), "--window", "cohort"]) == 0
    assert "window: closed cohort: all 100 requests" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--warmup-s", "--cooldown-s"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_report_refuses_a_warmup_or_cooldown_that_is_no_length_of_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    path = tmp_path / "records.jsonl"
    write_records(path, cohort_100())
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", str(path), "--window", "steady", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"report: error: argument {flag}: {value!r}: " in err, err


def test_a_saved_window_rule_of_the_wrong_shape_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "records.jsonl"
    write_records(path, cohort_100())
    for window, why in (
        ({"rule": "weekly"}, "the window rule must be cohort or steady, got 'weekly'"),
        ({"rule": "steady", "warmup_s": "2"}, "the window's warmup_s must be a number"),
        ({"rule": "steady", "cooldown_s": -1}, "the window's cooldown_s must be ≥ 0 s"),
    ):
        (tmp_path / "summary.json").write_text(json.dumps({"window": window}))
        assert cli.main(["report", str(path)]) == 2
        assert f"kvserve report: error: {why}" in capsys.readouterr().err


def test_report_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`kvserve report ... | head -1` ended in a BrokenPipeError traceback."""
    path = tmp_path / "records.jsonl"
    write_records(path, cohort_100())
    proc = run_into_closed_pipe([sys.executable, "-m", "kvserve", "report", str(path)])
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert proc.stderr == ""


def test_report_errors_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "kvserve report: error:" in capsys.readouterr().err
    # What was a traceback (a review helper's): a line that is no object, a field of the
    # wrong type, a summary.json of the wrong shape, a NaN SLO, --out-dir a file.
    good = json.loads(cohort_100()[0].to_json())
    for line, why in (
        ("[1, 2]", "records.jsonl:1: a record is a JSON object, got list"),
        (json.dumps({**good, "send_time": "abc"}), "field 'send_time': 'abc' is not a finite"),
        (json.dumps({**good, "chunk_times_s": [1, None]}), "field 'chunk_times_s'"),
    ):
        (tmp_path / "records.jsonl").write_text(line + "\n")
        assert cli.main(["report", str(tmp_path / "records.jsonl")]) == 2
        assert why in capsys.readouterr().err
    path = tmp_path / "records.jsonl"
    write_records(path, cohort_100())
    for saved in ("null", "[]", '{"slo": null}'):  # ignored: the defaults apply
        (tmp_path / "summary.json").write_text(saved)
        assert cli.main(["report", str(path), "--slo-ttft-ms", "1000"]) in (0, 1)
    (tmp_path / "summary.json").write_text('{"slo": {"ttft_ms": "100"}}')
    assert cli.main(["report", str(path)]) == 2
    assert "the SLO's ttft_ms must be a number, got '100'" in capsys.readouterr().err
    assert cli.main(["report", str(path), "--slo-ttft-ms", "nan"]) == 2
    assert "SLO must be > 0 ms and finite, got nan" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    args = ["report", str(path), "--slo-ttft-ms", "1000", "--out-dir", str(tmp_path / "a-file")]
    assert cli.main(args) == 2
    assert "--out-dir" in capsys.readouterr().err


def test_options_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser.add_argument)
    argv = ["--workload", "agents", "--slo-ttft-ms", "500", "--ignore-eos", "--rate", "2.5",
            "--api-key", "sk-x"]  # fmt: skip
    ns = parser.parse_args(argv)
    assert parser.parse_args(to_argv(ns)) == ns
    assert to_argv(ns)[:2] == ["--workload", "agents"]
    assert to_argv(parser.parse_args([])) == []
    s = Settings.from_namespace(ns)
    assert s.slo == Slo(ttft_ms=500.0, tpot_ms=None, attainment=0.9)
    assert s.headers() == {"authorization": "Bearer sk-x"}
    assert s.extra_body() == {"ignore_eos": True}
    assert "sk-x" not in describe_argv(argv)
    with pytest.raises(ValueError, match="--rate"):
        Settings.from_namespace(parser.parse_args(["--load-shape", "poisson", "--rate", "0"]))


def test_settings_from_the_web_form_strings() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser.add_argument)
    ns = parser.parse_args([])
    ns.slo_ttft_ms, ns.max_tokens, ns.slo_tpot_ms = "1000", "", " "  # as Locust's form sets them
    s = Settings.from_namespace(ns)
    assert s.slo.ttft_ms == 1000.0 and s.max_tokens is None and s.slo.tpot_ms is None


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_API_KEY", "sk-env")
    parser = argparse.ArgumentParser()
    add_options(parser.add_argument)
    assert Settings.from_namespace(parser.parse_args([])).api_key == "sk-env"


def test_run_builds_the_locust_command() -> None:
    command = "run -H http://gw:8080 -u 8 -t 30s --workload rag -- --csv out/locust"
    args = cli.build_parser().parse_args(command.split(" "))
    argv = cli.run_command(args)
    assert argv[:3] == [sys.executable, "-m", "locust"]
    assert argv[argv.index("-f") + 1].endswith("loadtests/locustfile.py")
    joined = " ".join(argv)
    for part in ("-H http://gw:8080", "--headless -t 30s", "-u 8 -r 8", "--workload rag",
                 "--csv out/locust", "--stop-timeout 300"):  # fmt: skip
        assert part in joined


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ("run -H http://gw:8080 -t 0", "must be more than zero (0 never stops)"),
        ("run -H http://gw:8080 -t 0s", "must be more than zero (0 never stops)"),
        ("run -H http://gw:8080 -t soon", "not a time span like 60s"),
        ("sweep -H http://gw:8080 --rates 1,2 --step-seconds 0", "must be at least 1"),
    ],
)
def test_a_load_test_that_would_never_stop_is_refused(
    command: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Locust reads -t 0 as no time limit: such a run (and a sweep of 0-second steps)
    went on until killed."""
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(command.split(" "))
    assert info.value.code == 2
    assert why in capsys.readouterr().err


def test_run_times_in_locusts_forms_are_passed_on() -> None:
    for text in ("90", "60s", "5m", "1h30m", "1h"):
        args = cli.build_parser().parse_args(["run", "-H", "http://gw:8080", "-t", text])
        assert "-t " + text in " ".join(cli.run_command(args))
