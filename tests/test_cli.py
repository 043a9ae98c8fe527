"""The kvserve command line, run as a user would."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import command_paths
from tests.support.fresh_python import heavy_modules_after
from tests.support.net import free_port
from tests.support.processes import run_into_closed_pipe

REPO = Path(__file__).resolve().parents[1]


def run_kvserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_help_lists_subcommands() -> None:
    out = run_kvserve("--help")
    assert out.returncode == 0
    for cmd in ("calc", "demo", "bench"):
        assert cmd in out.stdout


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_every_command_builds_its_parser_alone(path: tuple[str, ...]) -> None:
    from kvserve.cli import build_parser

    parser = build_parser(list(path))
    # The chosen command has its arguments and its function; --help on it would list them.
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*path, "--help"])
    assert exit_.value.code == 0


def test_no_command_takes_an_abbreviated_flag() -> None:
    """A flag is matched whole (argparse's allow_abbrev is off): a prefix of a flag is an
    unrecognised argument, in every command that has a flag to shorten."""
    from kvserve.cli import build_parser

    checked = 0
    for path in command_paths():
        parser = build_parser(list(path))
        sub = parser
        for word in path:  # the command's own parser
            (choices,) = [a.choices for a in sub._actions if isinstance(a.choices, dict)]
            sub = choices[word]
        flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        long_ones = [f for f in flags if f not in ("--help", "--version") and len(f) > 4]
        if not long_ones:
            continue
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*path, long_ones[0][:-1], "1"])
        assert exit_.value.code == 2, path
        checked += 1
    assert checked > 10


def test_an_unknown_flag_is_refused_with_the_commands_own_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was the top level's usage (``kvserve [-h] [--version] COMMAND``), which says
    nothing of the command's flags."""
    from kvserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["calc", "--config", "c.json", "--bogus", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvserve calc ") and "--config" in err, err
    assert err.rstrip().endswith("kvserve calc: error: unrecognized arguments: --bogus 1")


@pytest.mark.parametrize(
    ("argv", "misplaced"),
    [
        (["--versio"], "--versio"),
        (["-x"], "-x"),
        (["--versio", "calc", "--config", "c.json"], "--versio"),
        (["bench", "--bogus"], "--bogus"),
        (["bench", "--version", "offline"], "--version"),
    ],
)
def test_an_unknown_option_before_the_command_is_named(argv: list[str], misplaced: str) -> None:
    """argparse set it aside and complained of something else: "the following arguments
    are required: COMMAND" (or the command's own missing --config)."""
    out = run_kvserve(*argv)
    assert out.returncode == 2, out.stderr
    last = out.stderr.splitlines()[-1]
    assert last == f"kvserve: error: unrecognized arguments: {misplaced}", out.stderr


def test_version() -> None:
    from kvserve import __version__

    out = run_kvserve("--version")
    assert (out.returncode, out.stdout) == (0, f"kvserve {__version__}\n"), out.stderr


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """``kvserve ... | head -1``: the reader is gone before the output is written. Python
    complained at exit (BrokenPipeError, status 120); a Unix tool stops quietly."""
    proc = run_into_closed_pipe([sys.executable, "-m", "kvserve", "gateway", "--new-key"])
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert proc.stderr == ""


def test_a_command_imports_only_its_own_module() -> None:
    # `kvserve gateway` must not import torch through the other commands' modules.
    code = "from kvserve.cli import main\nassert main(['gateway', '--new-key']) == 0"
    heavy = {"torch", "transformers", "kvserve.demo_model.train"}
    assert heavy_modules_after(code, heavy) == set()


def test_demo_runs_on_a_given_model(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    out = run_kvserve(
        "demo",
        "--model",
        str(checkpoint_dir("llama")),
        "--num-requests",
        "4",
        "--max-tokens",
        "4",
        "--dtype",
        "float32",
    )
    assert out.returncode == 0, out.stderr
    assert "4 requests, 16 output tokens" in out.stdout
    assert "prefix cache:" in out.stdout


def test_demo_runs_the_bundled_model_by_default() -> None:
    out = run_kvserve("demo", "--num-requests", "3", "--max-tokens", "64", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert "kvserve-travel-tiny" in out.stderr  # loading ...
    answers = [line for line in out.stdout.splitlines() if line.startswith("assistant> ")]
    assert len(answers) == 2 and all("a night" in a or "Sorry" in a for a in answers), out.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--model", __file__), "is a file, not a directory"),
        (("--model", "/nonexistent"), "'/nonexistent' does not exist"),
        (("--dtype", "float64"), "dtype must be"),
    ],
)
@pytest.mark.parametrize("command", ["demo", "eval-demo"])
def test_bad_model_arguments_are_one_error_line(
    command: str, args: tuple[str, ...], expected: str
) -> None:
    out = run_kvserve(command, *args)
    assert out.returncode == 2, out.stderr
    assert f"kvserve {command}: error: " in out.stderr and expected in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "/nonexistent", "--no-grpc"],
        ["serve", "--model", "/nonexistent", "--port", "70000"],
        ["demo", "--model", "/nonexistent"],
        ["eval-demo", "--model", "/nonexistent"],
        ["train-demo", "--steps", "0"],
        # LLM() checks its settings before it imports the engine.
        ["demo", "--dtype", "float64"],
        ["eval-demo", "--dtype", "float64"],
        ["eval-demo", "--adapter", "nope"],
        ["train-demo", "--adapter", "nope"],
    ],
)
def test_a_wrong_argument_is_refused_before_torch_loads(argv: list[str]) -> None:
    """Refusing a mistyped path or flag took seconds, spent importing torch first."""
    code = (
        "from kvserve.cli import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as exit:\n    rc = exit.code\n"
        "assert rc == 2, rc"
    )
    assert heavy_modules_after(code, {"torch", "transformers"}) == set()


WRONG_KIND_OF_PATH = [
    (["bench", "gateway", "--json", "{dir}"], "--json: '{dir}' is a directory, not a file"),
    (
        ["bench", "gateway", "--json", "{dir}/no/r.json"],
        "--json: '{dir}/no/r.json': there is no directory '{dir}/no'",
    ),
    (["train-demo", "--out", "{file}"], "--out: '{file}' is a file, not a directory"),
    (["train-demo", "--out", "{file}/sub"], "--out: '{file}/sub' is under '{file}', a file"),
    (
        ["train-demo", "--adapter", "travel-table", "--out", "{file}"],
        "--out: '{file}' is a file, not a directory",
    ),
]


@pytest.mark.parametrize(("argv", "expected"), WRONG_KIND_OF_PATH)
def test_an_output_path_of_the_wrong_kind_is_one_error_line(
    tmp_path: Path, argv: list[str], expected: str
) -> None:
    """Each was a traceback (IsADirectoryError, FileExistsError), the benchmark's after its
    whole run; now a usage error, before torch is imported."""
    (tmp_path / "a-file").write_text("")
    where = {"dir": str(tmp_path), "file": str(tmp_path / "a-file")}
    argv = [arg.format(**where) for arg in argv]
    out = run_kvserve(*argv)
    assert out.returncode == 2, out.stderr
    command = " ".join(argv[: 2 if argv[0] == "bench" else 1])
    error = f"kvserve {command}: error: argument {expected.format(**where)}"
    assert error in out.stderr, out.stderr
    code = (
        "from kvserve.cli import main\n"
        f"try:\n    rc = main({argv!r})\nexcept SystemExit as exit:\n    rc = exit.code\n"
        "assert rc == 2, rc"
    )
    assert heavy_modules_after(code, {"torch", "transformers"}) == set()


def test_demo_refuses_a_zero_token_budget() -> None:
    out = run_kvserve("demo", "--max-tokens", "0")
    assert out.returncode == 2 and "--max-tokens must be ≥ 1" in out.stderr, out.stderr


def test_help_lists_the_demo_model_commands() -> None:
    out = run_kvserve("--help")
    for cmd in ("chat", "train-demo", "eval-demo"):
        assert cmd in out.stdout
    check = run_kvserve("train-demo", "--steps", "0")
    assert check.returncode == 2 and "--steps must be ≥ 1" in check.stderr


@pytest.mark.slow
def test_offline_benchmark_smoke() -> None:
    out = run_kvserve(
        "bench", "offline", "--model-size", "tiny", "--num-prompts", "6", "--rounds", "1", "--json"
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["output_tokens"] > 0 and result["ratio"] > 0
    assert result["kvserve_seconds"] > 0 and result["transformers_seconds"] > 0


def _broken_checkpoint(good: Path, folder: Path, what: str) -> tuple[Path, int]:
    """A copy of the checkpoint ``good`` in ``folder`` with one thing damaged, as the
    reviewer's cases did, and its original vocab_size."""
    model = Path(shutil.copytree(good, folder / "model"))
    config = json.loads((model / "config.json").read_text())
    if what in ("vocab_size", "num_hidden_layers"):
        (model / "config.json").write_text(
            json.dumps({**config, what: 10**12 if what == "vocab_size" else 10**5})
        )
    elif what == "truncated":
        weights = model / "model.safetensors"
        os.truncate(weights, weights.stat().st_size - 1000)
    elif what == "tokenizer structure":
        (model / "tokenizer.json").write_text(
            '{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}'
        )
    elif what == "tokenizer json":
        (model / "tokenizer.json").write_text("{not json")
    elif what == "nested config":
        (model / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return model, int(config["vocab_size"])


BROKEN_CHECKPOINTS = [
    (
        "vocab_size",
        "model.safetensors: tensor 'lm_head.weight' has shape [{vocab}, 64], but "
        "config.json's vocab_size makes it [1000000000000, 64]",
    ),
    ("num_hidden_layers", "config.json's num_hidden_layers is 100000, but the checkpoint has"),
    ("truncated", "model.safetensors: truncated: header says"),
    ("tokenizer structure", "cannot be loaded: KeyError: 'added_tokens'"),
    ("tokenizer json", "cannot be loaded: tokenizer.json: not valid JSON: Expecting"),
    ("nested config", "config.json: JSON nested too deeply to read"),
]


@pytest.mark.parametrize(("what", "expected"), BROKEN_CHECKPOINTS)
def test_serve_on_a_broken_checkpoint_is_one_error_line(
    tmp_path: Path, checkpoint_dir, what: str, expected: str
) -> None:  # type: ignore[no-untyped-def]
    """They were tracebacks (exit 1): a 512 TB allocation for vocab_size 10^12, two
    minutes and 2.9 GB for num_hidden_layers 10^5, a SafetensorError, a KeyError from the
    tokenizer library, a RecursionError; an invalid tokenizer.json was named nowhere."""
    model, vocab = _broken_checkpoint(checkpoint_dir("llama"), tmp_path, what)
    out = run_kvserve(
        "serve", "--model", str(model), "--port", str(free_port()), "--no-grpc", "--device", "cpu"
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvserve serve: error: {model}"), out.stderr
    assert expected.format(vocab=vocab) in last, out.stderr
    if what != "tokenizer structure":  # found by the tokenizer library only, as it loads
        # Found as `kvserve model verify` finds it, before torch and the model load.
        assert f"loading {model}" not in out.stderr, out.stderr


@pytest.mark.parametrize(("what", "expected"), BROKEN_CHECKPOINTS)
def test_the_engine_refuses_a_broken_checkpoint_itself(
    tmp_path: Path, checkpoint_dir, what: str, expected: str
) -> None:  # type: ignore[no-untyped-def]
    """`LLM` and the engine do not rely on the server's check before loading: the loader
    checks the weights' headers before it allocates, the tokenizer's files are named."""
    from kvserve.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine

    model, vocab = _broken_checkpoint(checkpoint_dir("llama"), tmp_path, what)
    with pytest.raises(ValueError) as refused:
        LLMEngine(EngineConfig(model=str(model), device="cpu"))
    assert expected.format(vocab=vocab) in str(refused.value)
