"""``kvserve model pull`` / ``verify`` on real checkpoint directories (no mocks).

hf:// is only parsed and made to fail offline here: this machine cannot reach the Hub.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from kvserve.cli import main as cli_main
from kvserve.model.pull import (
    MARKER,
    InvalidSourceError,
    ModelPullError,
    ModelSource,
    check_safetensors,
    parse_source,
    pull,
    verify_model,
)
from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support.fresh_python import heavy_modules_after
from tests.support.processes import start_logged
from tests.support.waiting import wait_until

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pull-src")
    return {
        "single": build_random_checkpoint(root / "single"),
        "sharded": build_random_checkpoint(root / "sharded", max_shard_size="100KB"),
    }


@pytest.fixture
def model(built: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the single-file checkpoint, free to damage."""
    return Path(shutil.copytree(built["single"], tmp_path / "model"))


@pytest.fixture
def sharded(built: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(built["sharded"], tmp_path / "sharded"))


def logged(messages: list[str]) -> Callable[[str], None]:
    return messages.append


# ---- parse_source -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hf://Qwen/Qwen3-0.6B", ModelSource("hf", repo_id="Qwen/Qwen3-0.6B", revision="main")),
        (
            f"hf://meta-llama/Llama-3.2-1B@{COMMIT}",
            ModelSource("hf", repo_id="meta-llama/Llama-3.2-1B", revision=COMMIT),
        ),
        ("hf://org/name@v1.0", ModelSource("hf", repo_id="org/name", revision="v1.0")),
        ("hf://org/name@refs/pr/3", ModelSource("hf", repo_id="org/name", revision="refs/pr/3")),
        ("pvc://models/llama/3b", ModelSource("pvc", claim="models", path="llama/3b")),
        ("pvc://models", ModelSource("pvc", claim="models", path="")),
        ("pvc://models/", ModelSource("pvc", claim="models", path="")),
        ("pvc://my.claim-1//a/./b/", ModelSource("pvc", claim="my.claim-1", path="a/b")),
        ("file:///opt/models/llama", ModelSource("file", path="/opt/models/llama")),
        ("file:///opt/models/llama/", ModelSource("file", path="/opt/models/llama")),
    ],
)
def test_parse_source_accepts(text: str, expected: ModelSource) -> None:
    assert parse_source(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "expected hf://ORG/NAME[@REVISION], pvc://CLAIM[/PATH] or file:///ABS/PATH"),
        ("/models/llama", "unsupported model source"),
        ("s3://bucket/llama", "unsupported model source 's3://bucket/llama'"),
        ("HF://org/name", "unsupported model source"),
        ("hf://gpt2", "expected hf://ORG/NAME[@REVISION]"),
        ("hf://org/name/extra", "expected hf://ORG/NAME[@REVISION]"),
        ("hf://org/na me", "expected hf://ORG/NAME[@REVISION]"),
        ("hf://org/name@", "bad revision ''"),
        ("hf://org/name@ main", "bad revision"),
        ("pvc://Models/llama", "claim name 'Models' is not a valid DNS-1123 name"),
        ("pvc://-models", "not a valid DNS-1123 name"),
        ("pvc:///llama", "claim name ''"),
        ("pvc://models/../other", "may not leave the claim"),
        ("file://relative/path", "needs an absolute path"),
        ("file://", "needs an absolute path"),
    ],
)
def test_parse_source_rejects(text: str, fragment: str) -> None:
    with pytest.raises(InvalidSourceError) as info:
        parse_source(text)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)  # the operator may catch plain ValueError


def test_source_strings_round_trip() -> None:
    for text in (f"hf://org/name@{COMMIT}", "pvc://models/a/b", "pvc://models", "file:///m"):
        assert str(parse_source(text)) == text
    assert str(parse_source("hf://org/name")) == "hf://org/name@main"
    assert parse_source(f"hf://org/name@{COMMIT}").pinned
    assert not parse_source("hf://org/name").pinned


def test_pull_module_imports_only_the_standard_library() -> None:
    """The operator imports parse_source; loading pull.py must not drag in torch. Of
    kvserve it loads only the package itself and the stdlib-only json_input."""
    allowed = {"kvserve", "kvserve.model", "kvserve.model.pull", "kvserve.json_input"}
    code = (
        "import sys\n"
        "import kvserve.model.pull as pull\n"
        "assert pull.parse_source('pvc://models/x').claim == 'models'\n"
        "loaded = {m for m in sys.modules if m == 'kvserve' or m.startswith('kvserve.')}\n"
        f"assert loaded <= {allowed!r}, sorted(loaded)\n"
    )
    heavy = {"torch", "transformers", "huggingface_hub", "numpy", "safetensors"}
    assert heavy_modules_after(code, heavy, timeout=60) == set()


# ---- pulling local sources --------------------------------------------------------------


def test_file_pull_copies_then_is_up_to_date(model: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    messages: list[str] = []
    result = pull(f"file://{model}", dest, log=logged(messages))
    assert result.action == "copied"
    assert sorted(result.files) == sorted(p.name for p in model.iterdir())  # all match
    for name, size in result.files.items():
        assert (dest / name).read_bytes() == (model / name).read_bytes()
        assert size == (model / name).stat().st_size
    assert messages[0] == f"pulling file://{model} → {dest}"
    assert messages[1].startswith(f"copied {len(result.files)} files (")
    assert messages[-1].startswith("verified: 1 safetensors file, ")
    assert messages[-1].endswith("of tensors, config llama")
    marker = json.loads((dest / MARKER).read_text())
    assert marker == {"version": 1, "source": f"file://{model}", "files": result.files}
    assert not [p for p in dest.iterdir() if p.name.startswith(".kvserve-pull-")]  # no stage

    mtime = (dest / "model.safetensors").stat().st_mtime_ns
    messages.clear()
    again = pull(f"file://{model}", dest, log=logged(messages))
    assert again.action == "up to date"
    assert again.files == result.files
    assert len(messages) == 1 and messages[0].startswith(f"up to date: {dest} already holds")
    assert (dest / "model.safetensors").stat().st_mtime_ns == mtime


def test_force_copies_again(model: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull(f"file://{model}", dest)
    (dest / "model.safetensors").write_bytes(b"stale")  # would also defeat the marker check
    os.utime(dest / "config.json", ns=(0, 0))
    result = pull(f"file://{model}", dest, force=True)
    assert result.action == "copied"
    assert (dest / "config.json").stat().st_mtime_ns != 0
    assert (dest / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()


def test_changed_content_or_source_pulls_again(model: Path, sharded: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull(f"file://{model}", dest)
    with (dest / "tokenizer.json").open("ab") as f:  # size differs from the marker
        f.write(b" ")
    assert pull(f"file://{model}", dest).action == "copied"

    # Another model into the same DEST: the old model's files it wrote are removed.
    result = pull(f"file://{sharded}", dest)
    assert result.action == "copied"
    assert not (dest / "model.safetensors").exists()
    assert result.report is not None and len(result.report.safetensors_files) == 6


def test_a_failed_pull_leaves_nothing_that_the_next_one_would_serve(
    model: Path, sharded: Path, tmp_path: Path
) -> None:
    """A pull that fails has already removed DEST's marker (it no longer claims a complete
    pull), and with it the list of the files an earlier pull wrote: the next pull of
    another model must still leave only its own model files, or the loader would read the
    earlier model's index and shards with the new config."""
    dest = tmp_path / "dest"
    pull(f"file://{sharded}", dest)
    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    (broken / "config.json").unlink()
    with pytest.raises(ModelPullError):
        pull(f"file://{broken}", dest)
    result = pull(f"file://{model}", dest)
    assert result.report is not None and len(result.report.safetensors_files) == 1
    assert sorted(p.name for p in dest.glob("*.safetensors*")) == ["model.safetensors"]


def test_same_directory_only_verifies(model: Path, tmp_path: Path) -> None:
    dest = tmp_path / "link"
    dest.symlink_to(model)  # another name for the same directory
    messages: list[str] = []
    before = sorted((p.name, p.stat().st_mtime_ns) for p in model.iterdir())
    result = pull(f"file://{model}", dest, log=logged(messages))
    assert result.action == "verified in place"
    assert messages[0] == f"file://{model} is {dest} itself: verifying in place"
    assert messages[-1].startswith("verified: ")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in model.iterdir()) == before  # no marker


def test_pvc_source_resolves_under_the_pvc_root(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "pvc"
    (root / "models" / "llama").mkdir(parents=True)
    shutil.copytree(model, root / "models" / "llama" / "tiny")
    dest = tmp_path / "dest"
    result = pull("pvc://models/llama/tiny", dest, pvc_root=root)
    assert result.action == "copied"
    assert json.loads((dest / MARKER).read_text())["source"] == "pvc://models/llama/tiny"

    monkeypatch.setenv("KVSERVE_PVC_ROOT", str(root))  # the default root
    assert pull("pvc://models/llama/tiny", dest).action == "up to date"
    assert parse_source("pvc://models").local_path() == root / "models"

    with pytest.raises(ModelPullError) as info:
        pull("pvc://other/llama", tmp_path / "dest2", pvc_root=root)
    assert str(info.value) == (
        f"pvc://other/llama: {root / 'other' / 'llama'}: no such directory "
        f"(is claim 'other' mounted at {root / 'other'}?)"
    )
    assert not (tmp_path / "dest2").exists()


def test_unwritable_dest_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    dest = tmp_path / "afile" / "dest"  # cannot be created: its parent is a file
    with pytest.raises(ModelPullError) as info:
        pull(f"file://{model}", dest)
    assert str(info.value).startswith(f"{dest}: [Errno 20] Not a directory")
    with pytest.raises(ModelPullError, match="exists and is not a directory"):
        pull(f"file://{model}", tmp_path / "afile")


def test_bad_source_leaves_dest_untouched(model: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    pull(f"file://{model}", dest)
    before = {p.name: p.read_bytes() for p in dest.iterdir() if p.name != MARKER}
    (model / "config.json").write_text("{not json")
    with pytest.raises(ModelPullError, match=r"config\.json: not valid JSON"):
        pull(f"file://{model}", dest, force=True)
    after = {p.name: p.read_bytes() for p in dest.iterdir() if p.name != MARKER}
    assert after == before
    assert not (dest / MARKER).exists()  # no longer claims to hold a complete pull
    assert not [p for p in dest.iterdir() if p.name.startswith(".kvserve-pull-")]


# ---- verify ----------------------------------------------------------------------------


def test_verify_reports_the_checkpoint(built: dict[str, Path]) -> None:
    single = verify_model(built["single"])
    assert single.safetensors_files == ("model.safetensors",)
    assert single.model_type == "llama" and single.architecture == "LlamaForCausalLM"
    assert single.tensor_bytes > 0 and single.tensors > 0 and not single.warnings
    sharded = verify_model(built["sharded"])
    assert len(sharded.safetensors_files) == 6
    assert sharded.tensor_bytes == single.tensor_bytes  # same weights, split
    assert sharded.summary().startswith("verified: 6 safetensors files, ")


def test_verify_missing_config(model: Path) -> None:
    (model / "config.json").unlink()
    with pytest.raises(ModelPullError, match=r"^config\.json: missing$"):
        verify_model(model)


def test_verify_corrupt_config(model: Path) -> None:
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelPullError, match=r"^config\.json: not valid JSON: "):
        verify_model(model)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "config.json: expected a JSON object, got list"),
        ('{"hidden_size": 8}', "config.json: has neither 'architectures' nor 'model_type'"),
        ('{"architectures": ["GPT2LMHeadModel"]}', "config.json: architecture 'GPT2LMHeadModel'"),
    ],
)
def test_verify_config_the_engine_refuses(model: Path, content: str, message: str) -> None:
    (model / "config.json").write_text(content)
    with pytest.raises(ModelPullError) as info:
        verify_model(model)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", -64, "hidden_size must be a whole number ≥ 1, got -64"),
        ("num_hidden_layers", 0, "num_hidden_layers must be a whole number ≥ 1, got 0"),
        ("vocab_size", float("inf"), "vocab_size must be a whole number ≥ 1, got inf"),
        ("intermediate_size", "64", "intermediate_size must be a number, got '64'"),
    ],
)
def test_verify_refuses_shapes_no_model_has(
    model: Path, field: str, value: object, message: str
) -> None:
    """They passed: calc printed a negative parameter count, Infinity was a traceback,
    and the engine failed at load ("negative dimension")."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelPullError, match=re.escape(message)):
        verify_model(model)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "vocab_size",
            10**12,
            "model.safetensors: tensor 'lm_head.weight' has shape [{vocab_size}, "
            "64], but config.json's vocab_size makes it [1000000000000, 64]",
        ),
        (
            "num_hidden_layers",
            10**5,
            "config.json's num_hidden_layers is 100000, but the checkpoint has no tensors of "
            "99998 of them (the first: layer 2)",
        ),
        (
            "num_hidden_layers",
            1,
            "model.safetensors: tensor 'model.layers.1.",  # ... is in layer 1, but ... is 1
        ),
        (
            "intermediate_size",
            96,
            "model.safetensors: tensor 'model.layers.0.mlp.",  # ... intermediate_size makes it
        ),
    ],
)
def test_verify_refuses_a_config_its_weights_do_not_match(
    model: Path, field: str, value: object, message: str
) -> None:
    """verify said "verified" for a config.json of vocab_size 10^12 over weights of the
    real vocabulary, which the engine then tried to allocate (512 TB)."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelPullError) as info:
        verify_model(model)
    assert str(info.value).startswith(message.format(**config)), info.value


def test_verify_truncated_safetensors(model: Path) -> None:
    path = model / "model.safetensors"
    size = path.stat().st_size
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    data = size - 8 - header_len
    os.truncate(path, size - 1000)
    with pytest.raises(ModelPullError) as info:
        verify_model(model)
    assert str(info.value) == (
        f"model.safetensors: truncated: header says {data} bytes of tensor data, "
        f"file has {data - 1000}"
    )


def test_verify_truncated_inside_the_header(model: Path) -> None:
    path = model / "model.safetensors"
    os.truncate(path, 100)
    with pytest.raises(ModelPullError, match=r"^model\.safetensors: truncated: header says \d+ "):
        verify_model(model)
    os.truncate(path, 3)
    with pytest.raises(ModelPullError, match=r"^model\.safetensors: too short .* \(3 bytes\)"):
        verify_model(model)


def test_verify_trailing_bytes_and_bad_offsets(tmp_path: Path) -> None:
    def write(header: Mapping[str, object], data: bytes) -> Path:
        raw = json.dumps(header).encode()
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return path

    good = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert check_safetensors(write(good, bytes(8))).data_bytes == 8
    with pytest.raises(ModelPullError, match=r"size mismatch: header says 8 bytes .* file has 9$"):
        check_safetensors(write(good, bytes(9)))
    wrong = {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}
    with pytest.raises(ModelPullError, match=r"tensor 'w': F32 \[3\] needs 12 bytes"):
        check_safetensors(write(wrong, bytes(8)))
    assert check_safetensors(write({}, b"")).tensors == 0
    # What the safetensors loader refuses ("invalid offset", an unknown dtype) that the
    # check let through: two tensors on the same bytes, a gap, a dtype of no known size.
    shared = {**good, "v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    with pytest.raises(ModelPullError, match=r"tensor 'w': data_offsets \[0, 8\] overlaps"):
        check_safetensors(write(shared, bytes(8)))
    gap = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    with pytest.raises(ModelPullError, match=r"data_offsets \[4, 12\] leaves a gap"):
        check_safetensors(write(gap, bytes(12)))
    odd = {"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}
    with pytest.raises(ModelPullError, match=r"tensor 'w': unknown dtype 'Q7'"):
        check_safetensors(write(odd, bytes(8)))
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 2) + b"{x")
    with pytest.raises(ModelPullError, match=r"^x\.safetensors: header: not valid JSON"):
        check_safetensors(tmp_path / "x.safetensors")


def test_verify_index_with_a_missing_shard(sharded: Path) -> None:
    (sharded / "model-00003-of-00006.safetensors").unlink()
    with pytest.raises(ModelPullError) as info:
        verify_model(sharded)
    assert str(info.value) == (
        "model.safetensors.index.json: shard model-00003-of-00006.safetensors is missing"
    )


def test_verify_no_weights_and_no_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    report = verify_model(model)
    assert report.warnings and "no tokenizer.json or tokenizer.model" in report.warnings[0]
    (model / "model.safetensors").unlink()
    with pytest.raises(
        ModelPullError, match=r"^no safetensors weights: expected model\.safetensors"
    ):
        verify_model(model)


# ---- the command line ------------------------------------------------------------------


def test_cli_exit_codes_in_process(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "dest"
    assert cli_main(["model", "pull", f"file://{model}", str(dest)]) == 0
    err = capsys.readouterr().err
    assert f"pulling file://{model} → {dest}" in err and "verified: 1 safetensors" in err

    assert cli_main(["model", "verify", str(dest)]) == 0
    assert capsys.readouterr().err.startswith("verified: 1 safetensors file, ")

    assert cli_main(["model", "pull", "s3://bucket/m", str(dest)]) == 2
    assert capsys.readouterr().err.startswith("kvserve model pull: error: unsupported model source")

    (model / "config.json").unlink()
    assert cli_main(["model", "pull", f"file://{model}", str(dest), "--force"]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"kvserve model pull: error: file://{model}: config.json: missing")
    )
    assert cli_main(["model", "verify", str(model)]) == 1
    assert (
        capsys.readouterr().err == f"kvserve model verify: error: {model}: config.json: missing\n"
    )
    assert cli_main(["model", "verify", str(model / "nope")]) == 1  # it named it twice
    assert (
        capsys.readouterr().err == f"kvserve model verify: error: {model}/nope: no such directory\n"
    )

    with pytest.raises(SystemExit) as info:
        cli_main(["model", "pull", f"file://{model}"])  # DEST missing
    assert info.value.code == 2

    # An empty DEST was the current directory: the pull wrote there and removed the
    # other model files it found.
    for args in (["pull", f"file://{model}", ""], ["verify", " "]):
        with pytest.raises(SystemExit) as info:
            cli_main(["model", *args])
        assert info.value.code == 2
        assert "an empty path (write . for the current directory)" in capsys.readouterr().err
    with pytest.raises(ModelPullError, match="an empty destination"):
        pull(parse_source(f"file://{model}"), "")


def start_kvserve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_cli_as_a_process(model: Path, tmp_path: Path) -> None:
    """Exit codes and stderr of the real command; the two runs overlap to save time."""
    dest = tmp_path / "dest"
    local = start_kvserve("model", "pull", f"file://{model}", str(dest))
    # The Hub is unreachable here; HF_HUB_OFFLINE makes that fail at once, not after timeouts.
    hub = start_kvserve(
        "model",
        "pull",
        "hf://kvserve-test/does-not-exist",
        str(tmp_path / "hf-dest"),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")},
    )
    _, local_err = local.communicate(timeout=120)
    _, hub_err = hub.communicate(timeout=120)

    assert local.returncode == 0, local_err
    assert f"pulling file://{model} → {dest}" in local_err
    assert "verified: 1 safetensors file" in local_err and "Traceback" not in local_err
    assert pull(f"file://{model}", dest).action == "up to date"  # the marker it wrote

    assert hub.returncode == 1, hub_err
    assert "Traceback" not in hub_err
    assert "revision 'main' is not a commit; pinning one is recommended" in hub_err
    assert (
        "kvserve model pull: error: hf://kvserve-test/does-not-exist@main: download failed: "
        in hub_err
    )


def test_json_nested_too_deeply_is_one_error_line(
    built: dict[str, Path], model: Path, sharded: Path, tmp_path: Path
) -> None:
    """json.loads raises RecursionError on 100,000 nested lists, which nothing caught:
    verify and pull printed a traceback instead of the promised one line, exit 1."""
    deep = "[" * 100_000 + "]" * 100_000
    (model / "config.json").write_text(deep)
    (sharded / "model.safetensors.index.json").write_text(deep)
    header = Path(shutil.copytree(built["single"], tmp_path / "header"))
    (header / "model.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep.encode())
    runs = {
        "config.json": start_kvserve("model", "verify", str(model)),
        "model.safetensors.index.json": start_kvserve("model", "verify", str(sharded)),
        "model.safetensors: header": start_kvserve(
            "model", "pull", f"file://{header}", str(tmp_path / "dest")
        ),
    }
    for what, process in runs.items():
        _, err = process.communicate(timeout=120)
        assert process.returncode == 1, err
        assert "Traceback" not in err, err
        assert err.endswith(f"{what}: JSON nested too deeply to read\n"), err


def test_two_pulls_into_one_dest_take_turns(model: Path, tmp_path: Path) -> None:
    """Two pulls into one DEST at once (two init containers on one volume, a job retried
    while the first run still copies): the second removed the first's staging folder as
    a stale one, and the first failed with "file://SOURCE: no such directory". Now the
    second waits for the first's lock, then finds DEST up to date and copies nothing.

    The first is stopped once it says "pulling" (it holds the lock by then), so the
    second certainly starts while the first is mid-pull; a big file keeps the first
    copying until the stop arrives."""
    with (model / "zzz-padding.json").open("wb") as f:
        f.truncate(256_000_000)  # sparse here; copied byte by byte
    dest = tmp_path / "dest"
    args = (sys.executable, "-m", "kvserve", "model", "pull", f"file://{model}", str(dest))
    first = start_logged(args, "pull-1")
    try:
        wait_until(lambda: "pulling " in first.log.read_text(), timeout=60)
        os.kill(first.pid, signal.SIGSTOP)
        second = start_logged(args, "pull-2")
        waiting = f"waiting for another pull into {dest} to finish"
        wait_until(lambda: waiting in second.log.read_text() or second.poll() is not None, 60)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0, first.tail()
    assert second.wait(timeout=120) == 0, second.tail()

    second_out = second.log.read_text()
    assert waiting in second_out, second.tail()
    assert "copied" not in second_out and "pulling" not in second_out, second.tail()
    assert f"up to date: {dest} already holds file://{model}" in second_out, second.tail()
    assert "copied " in first.log.read_text(), first.tail()
    for source_file in model.iterdir():
        assert filecmp.cmp(source_file, dest / source_file.name, shallow=False)
    assert not [p for p in dest.iterdir() if p.name.startswith(".kvserve-pull-")]  # no stage
    assert pull(f"file://{model}", dest).action == "up to date"
