"""Gateway config and keys files: validation with field paths, and the reload watcher."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from kvserve.gateway.config import GatewayConfig, load_config, parse_replica_url
from kvserve.gateway.files import ConfigError
from kvserve.gateway.keys import KeyEntry, hash_key, load_keys, new_key
from kvserve.gateway.watch import ConfigWatcher

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway-config.md"

CONFIG = """\
listen: {host: 127.0.0.1, port: 8080}
models:
  kvserve-travel-tiny:
    replicas: ["grpc://127.0.0.1:50051", "grpc://127.0.0.1:50052"]
keys_file: keys.yaml
"""

DIGEST_A = hash_key("sk-kvs-test-a")
DIGEST_B = hash_key("sk-kvs-test-b")


def keys_yaml(*entries: tuple[str, str], rpm: int = 600) -> str:
    lines = ["keys:"]
    for tenant, digest in entries:
        lines += [
            f"  - tenant: {tenant}",
            f'    sha256: "{digest}"',
            '    models: ["*"]',
            f"    limits: {{requests_per_minute: {rpm}}}",
        ]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def config_error(path: Path, text: str, loader: object = load_config) -> str:
    write(path, text)
    with pytest.raises(ConfigError) as info:
        loader(path)  # type: ignore[operator]
    return str(info.value)


# ----------------------------------------------------------------------------- valid


def test_minimal_config_gets_defaults_and_resolves_keys_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path / "gw.yaml", CONFIG))
    assert isinstance(config, GatewayConfig)
    assert config.keys_file == tmp_path.resolve() / "keys.yaml"
    assert config.max_body_bytes == 1 << 20
    assert config.routing.policy == "prefix" and config.routing.load_factor == 1.25
    assert config.admission.queue_size == 256
    assert config.retry.max_attempts == 2
    assert config.models["kvserve-travel-tiny"].max_in_flight_per_replica == 32


def test_absolute_keys_file_is_kept(tmp_path: Path) -> None:
    text = CONFIG.replace("keys_file: keys.yaml", "keys_file: /etc/kvserve/keys.yaml")
    assert load_config(write(tmp_path / "gw.yaml", text)).keys_file == Path(
        "/etc/kvserve/keys.yaml"
    )


def doc_block(name: str) -> str:
    blocks: list[str] = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    return next(b for b in blocks if b.startswith(f"# {name}\n"))


def test_the_documented_example_is_valid(tmp_path: Path) -> None:
    write(tmp_path / "keys.yaml", doc_block("keys.yaml"))
    config = load_config(write(tmp_path / "gateway.yaml", doc_block("gateway.yaml")))
    keys = load_keys(config.keys_file)
    assert len(config.models["kvserve-travel-tiny"].replicas) == 2
    assert [k.tenant for k in keys.keys] == ["team-a", "batch-jobs"]
    assert keys.keys[0].sha256 == hash_key("sk-kvs-example-team-a-do-not-use")
    assert keys.keys[1].sha256 == hash_key("sk-kvs-example-batch-do-not-use")


def test_doc_documents_every_field() -> None:
    text = DOC.read_text()

    def leaves(model: type, prefix: str) -> list[str]:
        out = []
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            sub = info.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                out += leaves(sub, f"{prefix}{name}.")
            else:
                out.append(f"{prefix}{name}")
        return out

    for path in leaves(GatewayConfig, ""):
        if path != "models":
            assert f"`{path}`" in text, path
    for field in ("replicas", "max_tokens_ceiling", "max_in_flight_per_replica"):
        assert f"`models.<name>.{field}`" in text
    for path in leaves(KeyEntry, "keys[i]."):
        assert f"`{path}`" in text, path


def test_keys_file_loads(tmp_path: Path) -> None:
    keys = load_keys(write(tmp_path / "k.yaml", keys_yaml(("a", DIGEST_A), ("b", DIGEST_B))))
    assert [k.priority for k in keys.keys] == ["standard", "standard"]
    assert keys.keys[0].limits.requests_per_minute == 600
    assert keys.keys[0].limits.tokens_per_minute is None


def test_keys_of_one_tenant_may_share_it_when_identical(tmp_path: Path) -> None:
    keys = load_keys(write(tmp_path / "k.yaml", keys_yaml(("a", DIGEST_A), ("a", DIGEST_B))))
    assert len(keys.keys) == 2


@pytest.mark.parametrize(
    "url",
    ["grpc://127.0.0.1:50051", "grpc://engine-0.kvserve.svc:1", "grpc://[::1]:65535"],
)
def test_replica_urls_accepted(url: str) -> None:
    host, port = parse_replica_url(url)
    assert f"grpc://{host}:{port}" == url


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("replace", "path", "reason"),
    [
        ("grpc://bad host:50052", "models.kvserve-travel-tiny.replicas[1]", "grpc://host:port"),
        ("http://127.0.0.1:50052", "models.kvserve-travel-tiny.replicas[1]", "grpc://host:port"),
        ("grpc://127.0.0.1:0", "models.kvserve-travel-tiny.replicas[1]", "1-65535"),
        ("grpc://127.0.0.1:70000", "models.kvserve-travel-tiny.replicas[1]", "1-65535"),
        ("grpc://127.0.0.1", "models.kvserve-travel-tiny.replicas[1]", "grpc://host:port"),
        ("grpc://127.0.0.1:50051", "models.kvserve-travel-tiny.replicas[1]", "listed twice"),
    ],
)
def test_bad_replica_url_names_its_index(
    tmp_path: Path, replace: str, path: str, reason: str
) -> None:
    text = CONFIG.replace("grpc://127.0.0.1:50052", replace)
    message = config_error(tmp_path / "gw.yaml", text)
    assert str(tmp_path / "gw.yaml") in message
    assert f"{path}: " in message and reason in message


@pytest.mark.parametrize(
    ("extra", "path", "reason"),
    [
        ("routing: {policy: fastest}", "routing.policy", "'prefix', 'least_load' or"),
        ("routing: {load_factor: 1.0}", "routing.load_factor", "greater than 1"),
        ("routing: {prefix_chars: 0}", "routing.prefix_chars", "greater than or equal to 1"),
        ("admission: {queue_size: -1}", "admission.queue_size", "greater than or equal to 0"),
        ("admission: {queue_timeout_seconds: 0}", "admission.queue_timeout_seconds", "greater"),
        ("retry: {max_attempts: 0}", "retry.max_attempts", "greater than or equal to 1"),
        ("max_body_bytes: 0", "max_body_bytes", "greater than or equal to 1"),
        ("max_body_bytes: 33554433", "max_body_bytes", "less than or equal to 33554432"),
        ("request_timeout_seconds: -5", "request_timeout_seconds", "greater than 0"),
        ("load_poll_seconds: 0", "load_poll_seconds", "greater than 0"),
        ("listen: {port: 70000}", "listen.port", "less than or equal to 65535"),
        ('listen: {port: "8080"}', "listen.port", "valid integer (got '8080')"),
        ("listen: {port: true}", "listen.port", "valid integer"),
        ("lisen: {port: 8080}", "lisen", "unknown field"),
        ("routing: {polcy: prefix}", "routing.polcy", "unknown field"),
    ],
)
def test_bad_fields_name_path_and_reason(
    tmp_path: Path, extra: str, path: str, reason: str
) -> None:
    text = CONFIG.replace("listen: {host: 127.0.0.1, port: 8080}\n", "") + extra + "\n"
    message = config_error(tmp_path / "gw.yaml", text)
    assert f"{path}: " in message and reason in message, message


def test_model_level_errors(tmp_path: Path) -> None:
    no_models = "models: {}\nkeys_file: k.yaml\n"
    assert "models: " in config_error(tmp_path / "a.yaml", no_models)
    typo = CONFIG + "    max_tokenz_ceiling: 5\n"
    typo = typo.replace("keys_file: keys.yaml\n", "") + "keys_file: keys.yaml\n"
    message = config_error(tmp_path / "b.yaml", typo)
    assert "models.kvserve-travel-tiny.max_tokenz_ceiling: unknown field" in message
    empty_list = "models:\n  m: {replicas: []}\nkeys_file: k.yaml\n"
    assert "models.m.replicas: " in config_error(tmp_path / "c.yaml", empty_list)
    star = "models:\n  '*': {replicas: ['grpc://a:1']}\nkeys_file: k.yaml\n"
    assert "reserved" in config_error(tmp_path / "d.yaml", star)
    missing = "models:\n  m: {replicas: ['grpc://a:1']}\n"
    assert "keys_file: required field is missing" in config_error(tmp_path / "e.yaml", missing)


def test_several_problems_are_all_listed(tmp_path: Path) -> None:
    text = CONFIG + "routing: {policy: x, load_factor: 0.5}\n"
    message = config_error(tmp_path / "gw.yaml", text)
    assert "2 problems" in message
    assert "routing.policy" in message and "routing.load_factor" in message


def test_a_keys_file_error_names_the_field_in_the_files_terms(tmp_path: Path) -> None:
    """A union field is one problem at its own path (it was one per member, at
    ``share_prefix_cache.bool`` and ``.str``), and no class name of the code shows."""
    text = (
        f"keys:\n  - {{tenant: a, sha256: '{DIGEST_A}', models: ['*'],\n"
        "     share_prefix_cache: 5, limits: 5}\n"
    )
    message = config_error(tmp_path / "k.yaml", text, load_keys)
    assert "keys[0].share_prefix_cache: Input should be a valid boolean or a valid string" in (
        message
    )
    assert "keys[0].limits: Input should be a valid dictionary" in message
    assert ".bool" not in message and "KeyLimits" not in message, message


def test_yaml_syntax_error_gives_line(tmp_path: Path) -> None:
    message = config_error(tmp_path / "gw.yaml", "models:\n  m: {replicas: [\nkeys_file: x\n")
    assert "line " in message and "YAML syntax error" in message


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    message = config_error(tmp_path / "gw.yaml", CONFIG + "keys_file: other.yaml\n")
    assert "line 6, column 1" in message and "duplicate key 'keys_file'" in message


@pytest.mark.parametrize(
    ("text", "reason"),
    [("", "file is empty"), ("- a\n- b\n", "expected a YAML mapping"), ("\xff", "")],
)
def test_not_a_mapping(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "gw.yaml"
    if text == "\xff":
        path.write_bytes(b"\xff\xfe")
        with pytest.raises(ConfigError, match="not UTF-8"):
            load_config(path)
    else:
        assert reason in config_error(path, text)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="file not found"):
        load_keys(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("entry", "path", "reason"),
    [
        ({"sha256": DIGEST_A.upper()}, "keys[0].sha256", "lowercase hex"),
        ({"sha256": DIGEST_A[:-1]}, "keys[0].sha256", "64-character"),
        ({"priority": "urgent"}, "keys[0].priority", "'critical', 'standard' or"),
        ({"tenant": "team a"}, "keys[0].tenant", "letters, digits"),
        ({"models": []}, "keys[0].models", ""),
        ({"models": ["*", "m"]}, "keys[0].models", "list it alone"),
        ({"limits": {"requests_per_minute": 0}}, "keys[0].limits.requests_per_minute", ">="),
        ({"limits": {"rpm": 5}}, "keys[0].limits.rpm", "unknown field"),
    ],
)
def test_bad_key_entries(tmp_path: Path, entry: dict[str, object], path: str, reason: str) -> None:
    import yaml

    base: dict[str, object] = {"tenant": "a", "sha256": DIGEST_A, "models": ["*"]}
    text = yaml.safe_dump({"keys": [base | entry]})
    message = config_error(tmp_path / "k.yaml", text, load_keys)
    assert f"{path}: " in message and reason.replace(">=", "greater than or equal") in message


def test_keys_file_errors_never_echo_values(tmp_path: Path) -> None:
    key, _ = new_key()
    text = f'keys:\n  - {{tenant: a, sha256: "{key}", models: ["*"], priority: {key}}}\n'
    message = config_error(tmp_path / "k.yaml", text, load_keys)
    assert "keys[0].sha256" in message and "keys[0].priority" in message
    assert key not in message
    broken = f'keys:\n  - tenant: a\n    sha256: "{key}\n'  # unterminated string: a syntax error
    assert key not in config_error(tmp_path / "k2.yaml", broken, load_keys)


def test_duplicate_digests_and_conflicting_tenants(tmp_path: Path) -> None:
    dup = keys_yaml(("a", DIGEST_A), ("b", DIGEST_A))
    message = config_error(tmp_path / "k.yaml", dup, load_keys)
    assert "keys: keys[0] and keys[1] have the same sha256" in message
    conflict = keys_yaml(("a", DIGEST_A)) + keys_yaml(("a", DIGEST_B), rpm=5).removeprefix(
        "keys:\n"
    )
    message = config_error(tmp_path / "k2.yaml", conflict, load_keys)
    assert "keys[0] and keys[1] both belong to tenant 'a'" in message


def test_empty_keys_list_is_refused(tmp_path: Path) -> None:
    assert "keys: " in config_error(tmp_path / "k.yaml", "keys: []\n", load_keys)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- helpers


def test_hash_key_and_new_key() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    key, digest = new_key()
    assert key.startswith("sk-kvs-") and len(key) > 40
    assert digest == hash_key(key) and re.fullmatch(r"[0-9a-f]{64}", digest)
    assert new_key()[0] != key


# -------------------------------------------------------------------------- watching


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    config = write(tmp_path / "gw.yaml", CONFIG)
    keys = write(tmp_path / "keys.yaml", keys_yaml(("a", DIGEST_A)))
    return config, keys


def bump_mtime(path: Path) -> None:
    """Makes sure the mtime differs, whatever the filesystem's timestamp granularity."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_watcher_loads_both_and_is_quiet_without_changes(files: tuple[Path, Path]) -> None:
    watcher = ConfigWatcher(files[0])
    assert [k.tenant for k in watcher.keys.keys] == ["a"]
    assert watcher.poll() is None
    bump_mtime(files[1])  # touched, same content
    bump_mtime(files[0])
    assert watcher.poll() is None


def test_watcher_fails_fast_on_invalid_start(files: tuple[Path, Path]) -> None:
    write(files[1], "keys: []\n")
    with pytest.raises(ConfigError):
        ConfigWatcher(files[0])


def test_watcher_returns_new_keys(files: tuple[Path, Path]) -> None:
    watcher = ConfigWatcher(files[0])
    write(files[1], keys_yaml(("a", DIGEST_A), ("b", DIGEST_B)))
    bump_mtime(files[1])
    reload = watcher.poll()
    assert reload is not None and reload.keys is not None and not reload.errors
    assert [k.tenant for k in reload.keys.keys] == ["a", "b"]
    assert watcher.keys is reload.keys
    assert watcher.poll() is None


def test_watcher_sees_same_size_edit(files: tuple[Path, Path]) -> None:
    watcher = ConfigWatcher(files[0])
    write(files[1], keys_yaml(("a", DIGEST_A), rpm=700))  # same length as rpm=600
    bump_mtime(files[1])
    reload = watcher.poll()
    assert reload is not None and reload.keys is not None
    assert reload.keys.keys[0].limits.requests_per_minute == 700


def test_watcher_keeps_old_keys_on_invalid_file_and_reports_once(
    files: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    watcher = ConfigWatcher(files[0])
    old = watcher.keys
    write(files[1], keys_yaml(("a", "not-a-digest")))
    bump_mtime(files[1])
    with caplog.at_level(logging.INFO, logger="kvserve.gateway"):
        reload = watcher.poll()
    assert reload is not None and reload.keys is None
    assert len(reload.errors) == 1 and "keys[0].sha256" in str(reload.errors[0])
    # Returned, not logged: the gateway's watch task logs it, once (it was logged twice).
    assert not [r for r in caplog.records if "keys[0].sha256" in r.getMessage()]
    assert watcher.keys is old
    assert watcher.poll() is None  # not reported again
    write(files[1], keys_yaml(("b", DIGEST_B)))
    bump_mtime(files[1])
    fixed = watcher.poll()
    assert fixed is not None and fixed.keys is not None and fixed.keys.keys[0].tenant == "b"


def test_watcher_reports_a_missing_keys_file_once(files: tuple[Path, Path]) -> None:
    watcher = ConfigWatcher(files[0])
    files[1].unlink()
    reload = watcher.poll()
    assert reload is not None and "file not found" in str(reload.errors[0])
    assert watcher.poll() is None
    assert [k.tenant for k in watcher.keys.keys] == ["a"]
    write(files[1], keys_yaml(("a", DIGEST_A)))  # back, unchanged: nothing to apply
    assert watcher.poll() is None
    files[1].unlink()
    again = watcher.poll()
    assert again is not None and again.errors  # a new disappearance is reported again


def test_watcher_config_changes_need_a_restart(files: tuple[Path, Path]) -> None:
    watcher = ConfigWatcher(files[0])
    write(files[0], CONFIG + "routing: {policy: round_robin}\nkeys_file_x: 1\n")
    bump_mtime(files[0])
    invalid = watcher.poll()
    assert invalid is not None and "keys_file_x: unknown field" in str(invalid.errors[0])
    write(files[0], CONFIG.replace("8080", "9090") + "routing: {policy: round_robin}\n")
    bump_mtime(files[0])
    reload = watcher.poll()
    assert reload is not None and reload.keys is None and not reload.errors
    assert reload.restart_required == ("listen.port", "routing.policy")
    assert watcher.config.listen.port == 8080  # the running config is unchanged
    assert watcher.poll() is None


def test_watcher_keeps_watching_the_keys_file_in_force(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    watcher = ConfigWatcher(files[0])
    write(tmp_path / "other.yaml", keys_yaml(("z", DIGEST_B)))
    write(files[0], CONFIG.replace("keys.yaml", "other.yaml"))
    bump_mtime(files[0])
    reload = watcher.poll()
    assert reload is not None and reload.restart_required == ("keys_file",)
    assert reload.keys is None
    assert watcher.config.keys_file.name == "keys.yaml"
