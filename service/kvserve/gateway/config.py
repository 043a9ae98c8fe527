"""The gateway's configuration and API-keys files: validated at start, keys hot-reloaded.

Two YAML files, both described field by field in ``docs/gateway-config.md``:

- the config file (``--config``): listen address, models and their replicas, routing,
  admission, retries, timeouts, and where the keys file is;
- the keys file: one entry per API key, holding only the key's SHA-256 digest, its
  tenant, allowed models, priority and rate limits. It is separate so that it can be a
  mounted Kubernetes Secret, rotated without touching the rest.

A wrong file fails fast: ``load_config`` / ``load_keys`` raise ``ConfigError`` whose
message names the file, the field path (``models.kvserve-travel-tiny.replicas[1]``) and
the reason. The models are strict (no ``"8080"`` for a port, no ``true`` for a number)
and forbid unknown fields, so a typo is an error instead of a silently ignored default.

``ConfigWatcher`` re-reads both files when the gateway asks it to (``poll()``); only the
keys file takes effect without a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

log = logging.getLogger("kvserve.gateway")

Priority = Literal["critical", "standard", "sheddable"]
RoutingPolicy = Literal["prefix", "least_load", "round_robin"]

KEY_PREFIX = "sk-kvs-"
WILDCARD = "*"

_REPLICA_URL = re.compile(
    r"grpc://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
    r":(?P<port>[0-9]{1,5})"
)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Tenant names end up in logs and as a metric label: keep them plain.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class ConfigError(ValueError):
    """A config or keys file that cannot be used: names the file, the field and the reason."""

    def __init__(self, file: Path | str, problems: list[str]) -> None:
        self.file = Path(file)
        self.problems = problems
        if len(problems) == 1:
            text = f"{self.file}: {problems[0]}"
        else:
            text = f"{self.file}: {len(problems)} problems:\n" + "\n".join(
                f"  - {p}" for p in problems
            )
        super().__init__(text)


# ---------------------------------------------------------------------------- helpers


def hash_key(key: str) -> str:
    """The SHA-256 hex digest stored in the keys file in place of the key itself."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh random API key (``sk-kvs-`` + 256 random bits) and its digest.

    Hand the key to the client once; put only the digest in the keys file.
    """
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key)


def parse_replica_url(url: str) -> tuple[str, int]:
    """``grpc://host:port`` → (host, port); IPv6 hosts keep their brackets (``[::1]``).

    ``f"{host}:{port}"`` is then a valid gRPC channel target.
    """
    match = _REPLICA_URL.fullmatch(url)
    if match is None:
        raise ValueError(f"replica URL must look like grpc://host:port, got {url!r}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"replica URL port must be 1-65535, got {port} in {url!r}")
    return match["host"], port


# ----------------------------------------------------------------------- config file


class _Strict(BaseModel):
    # strict: YAML gives real ints/floats/bools, so a quoted number is a mistake worth
    # reporting; extra=forbid: a misspelt field must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ListenConfig(_Strict):
    """Where the gateway's HTTP API listens."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8080, ge=1, le=65535)
    # Longer than the idle timeout of the load balancer in front (60 s on most): if the
    # gateway closed idle connections first, the balancer would reuse a closed one and
    # answer 502. uvicorn's own default is 5 s.
    keep_alive_seconds: int = Field(default=75, ge=1)


def _replica_url(url: str) -> str:
    parse_replica_url(url)
    return url


ReplicaUrl = Annotated[str, AfterValidator(_replica_url)]


class ModelConfig(_Strict):
    """One served model name: its static replicas (if any) and its limits.

    With Kubernetes discovery, a model needs no entry unless it wants non-default
    limits; discovered replicas are added to the static ones.
    """

    replicas: list[ReplicaUrl] = Field(default_factory=list)
    max_tokens_ceiling: int | None = Field(default=None, ge=1)
    max_in_flight_per_replica: int = Field(default=32, ge=1)

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, urls: list[str]) -> list[str]:
        seen: set[str] = set()
        for index, url in enumerate(urls):
            if url in seen:
                raise ValueError(f"[{index}]: replica {url!r} is listed twice")
            seen.add(url)
        return urls


class RoutingConfig(_Strict):
    """How a request picks a replica."""

    policy: RoutingPolicy = "prefix"
    load_factor: float = Field(default=1.25, gt=1)
    prefix_chars: int = Field(default=512, ge=1)


class AdmissionConfig(_Strict):
    """The gateway's wait queue when every replica is at ``max_in_flight_per_replica``."""

    queue_size: int = Field(default=256, ge=0)
    queue_timeout_seconds: float = Field(default=30.0, gt=0)


class RetryConfig(_Strict):
    """Retries on another replica when one fails before sending any output."""

    max_attempts: int = Field(default=2, ge=1, le=10)


class KubernetesDiscoveryConfig(_Strict):
    """Replicas from the EndpointSlices of Services that match ``label_selector``."""

    namespaces: list[str] = Field(default_factory=list)  # empty: every namespace
    label_selector: str = Field(
        default="app.kubernetes.io/managed-by=kvserve-operator", min_length=1
    )
    port_name: str = Field(default="grpc", min_length=1)
    # Default: in-cluster credentials, else $KUBECONFIG / ~/.kube/config.
    kubeconfig: Annotated[Path | None, Field(strict=False)] = None


class DiscoveryConfig(_Strict):
    kubernetes: KubernetesDiscoveryConfig | None = None


class GatewayConfig(_Strict):
    """The whole config file. Only the keys file it points to hot-reloads."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    max_body_bytes: int = Field(default=1 << 20, ge=1)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    keys_file: Annotated[Path, Field(strict=False)]
    request_timeout_seconds: float = Field(default=600.0, gt=0)
    load_poll_seconds: float = Field(default=1.0, gt=0)
    reload_poll_seconds: float = Field(default=5.0, gt=0)

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:
            if not name or name != name.strip() or any(c.isspace() for c in name):
                raise ValueError(f"model name {name!r} must be non-empty without whitespace")
            if name == WILDCARD:
                raise ValueError("'*' is reserved for 'every model' in the keys file")
        return models

    @model_validator(mode="after")
    def _replicas_come_from_somewhere(self) -> GatewayConfig:
        if self.discovery.kubernetes is not None:
            return self
        if not self.models:
            raise ValueError("models: at least one model is needed (or discovery.kubernetes)")
        for name, model in self.models.items():
            if not model.replicas:
                raise ValueError(
                    f"models.{name}.replicas: at least one replica is needed "
                    "(or discovery.kubernetes)"
                )
        return self

    def model_settings(self, name: str) -> ModelConfig:
        """The model's entry, or the defaults for a model found by discovery."""
        return self.models.get(name) or ModelConfig()

    @field_validator("keys_file")
    @classmethod
    def _resolve_keys_file(cls, path: Path, info: ValidationInfo) -> Path:
        # Relative to the config file's directory (passed by load_config), so the gateway
        # can be started from any working directory.
        base = info.context.get("base_dir") if isinstance(info.context, Mapping) else None
        if base is not None and not path.is_absolute():
            return Path(base) / path
        return path


# ------------------------------------------------------------------------- keys file


class KeyLimits(_Strict):
    """Per-tenant rate limits; a limit left out (null) is not enforced."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)


class KeyEntry(_Strict):
    """One API key, by digest. Keys of the same tenant share that tenant's limits."""

    tenant: str
    sha256: str
    models: list[str] = Field(min_length=1)
    priority: Priority = "standard"
    limits: KeyLimits = Field(default_factory=KeyLimits)

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, name: str) -> str:
        if _TENANT.fullmatch(name) is None:
            raise ValueError(
                "tenant must be 1-63 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        return name

    @field_validator("sha256")
    @classmethod
    def _digest(cls, digest: str) -> str:
        # Never echo the value: if someone pasted the key itself here, it must not be
        # printed in the error (which ends up in logs).
        if _SHA256_HEX.fullmatch(digest) is None:
            raise ValueError(
                "must be the 64-character lowercase hex SHA-256 digest of the key "
                '(never the key itself); compute it with: printf %s "$KEY" | sha256sum'
            )
        return digest

    @field_validator("models")
    @classmethod
    def _models(cls, models: list[str]) -> list[str]:
        for index, name in enumerate(models):
            if not name or any(c.isspace() for c in name):
                raise ValueError(f"[{index}]: model name must be non-empty without whitespace")
        if WILDCARD in models and len(models) > 1:
            raise ValueError("'*' already allows every model; list it alone")
        return models


class KeysFile(_Strict):
    """The whole keys file: at least one key (an empty file would lock everyone out)."""

    keys: list[KeyEntry] = Field(min_length=1)

    @field_validator("keys")
    @classmethod
    def _consistent(cls, keys: list[KeyEntry]) -> list[KeyEntry]:
        by_digest: dict[str, int] = {}
        by_tenant: dict[str, int] = {}
        for index, entry in enumerate(keys):
            if entry.sha256 in by_digest:
                raise ValueError(
                    f"keys[{by_digest[entry.sha256]}] and keys[{index}] have the same "
                    "sha256 (the same key listed twice)"
                )
            by_digest[entry.sha256] = index
            first = by_tenant.setdefault(entry.tenant, index)
            other = keys[first]
            if (set(other.models), other.priority, other.limits) != (
                set(entry.models),
                entry.priority,
                entry.limits,
            ):
                raise ValueError(
                    f"keys[{first}] and keys[{index}] both belong to tenant {entry.tenant!r} "
                    "but differ in models, priority or limits; keys of one tenant share one "
                    "budget, so these must be identical"
                )
        return keys


# --------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (YAML would keep the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if not isinstance(key, Hashable):
            continue  # construct_mapping below reports unhashable keys itself
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(path, ["file not found"]) from None
    except OSError as exc:
        raise ConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from None


def _parse_yaml(path: Path, data: bytes) -> dict[str, Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, [f"not UTF-8 text (byte {exc.start})"]) from None
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no object tags
    except yaml.MarkedYAMLError as exc:
        # Only the problem and its position: the snippet PyYAML appends would print the
        # offending line, which in a keys file might hold a secret pasted by mistake.
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem and exc.context_mark:
            cm = exc.context_mark
            problem += f" ({exc.context} at line {cm.line + 1}, column {cm.column + 1})"
        raise ConfigError(path, [f"{where}YAML syntax error: {problem}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, [f"YAML syntax error: {type(exc).__name__}"]) from None
    if document is None:
        raise ConfigError(path, ["file is empty; expected a YAML mapping"])
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise ConfigError(path, [f"expected a YAML mapping at the top, got a {kind}"])
    return document


def field_path(loc: tuple[int | str, ...]) -> str:
    """Pydantic's error location → ``models.kvserve-travel-tiny.replicas[1]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _problems(exc: ValidationError, *, show_input: bool) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        kind = error["type"]
        message = str(error["msg"])
        if kind == "value_error":
            message = str(error.get("ctx", {}).get("error", message))
            # Our list validators prefix the index ("[1]: ..."); fold it into the path.
            index = re.match(r"\[(\d+)\]: ", message)
            if index is not None:
                loc = (*loc, int(index[1]))
                message = message[index.end() :]
            # Whole-file validators name the field themselves ("models.x.replicas: ...").
            named = re.match(r"([A-Za-z_][\w.-]*): ", message)
            if not loc and named is not None:
                loc = tuple(named[1].split("."))
                message = message[named.end() :]
        elif kind == "extra_forbidden":
            message = "unknown field (misspelt? see docs/gateway-config.md)"
        elif kind == "missing":
            message = "required field is missing"
        elif show_input and not isinstance(error.get("input"), dict | list):
            message += f" (got {error.get('input')!r})"
        problems.append(f"{field_path(loc)}: {message}")
    return problems


def _parse_config(path: Path, data: bytes) -> GatewayConfig:
    document = _parse_yaml(path, data)
    try:
        return GatewayConfig.model_validate(document, context={"base_dir": path.resolve().parent})
    except ValidationError as exc:
        raise ConfigError(path, _problems(exc, show_input=True)) from None


def _parse_keys(path: Path, data: bytes) -> KeysFile:
    document = _parse_yaml(path, data)
    try:
        return KeysFile.model_validate(document)
    except ValidationError as exc:
        # Never show inputs from the keys file: a misplaced secret would be printed.
        raise ConfigError(path, _problems(exc, show_input=False)) from None


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Reads and validates the config file; ``keys_file`` comes back resolved."""
    path = Path(path)
    return _parse_config(path, _read(path))


def load_keys(path: str | os.PathLike[str]) -> KeysFile:
    """Reads and validates the keys file."""
    path = Path(path)
    return _parse_keys(path, _read(path))


# -------------------------------------------------------------------------- watching


@dataclass(frozen=True)
class Reload:
    """What one ``ConfigWatcher.poll()`` found.

    ``keys``: the new keys file, valid and already in force in the watcher — apply it with
    ``KeyStore.replace`` and ``RateLimiter.update``. ``errors``: files that changed but are
    invalid (or vanished); the previous version stays in force. ``restart_required``: config
    fields whose new value only takes effect after a restart.
    """

    keys: KeysFile | None = None
    errors: tuple[ConfigError, ...] = ()
    restart_required: tuple[str, ...] = ()


@dataclass
class _Seen:
    stat: tuple[int, int, int] | None  # (mtime_ns, size, inode) when last read
    digest: str  # SHA-256 of the content last read


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()  # follows symlinks: a Secret update swaps the ..data link
    return st.st_mtime_ns, st.st_size, st.st_ino


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves that differ between two ``model_dump()`` results."""
    out: list[str] = []
    for name in sorted(set(old) | set(new), key=str):
        where = f"{prefix}.{name}" if prefix else str(name)
        a, b = old.get(name), new.get(name)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += changed_fields(a, b, where)
        elif a != b:
            out.append(where)
    return out


_T = TypeVar("_T")


class ConfigWatcher:
    """Loads the config and keys files and re-reads them each time ``poll()`` is called.

    No threads or timers inside: the gateway calls ``poll()`` every
    ``config.reload_poll_seconds`` from its event loop. Each poll stats both files and
    re-reads one only when its mtime, size or inode changed; a re-read file counts as
    changed only when its content hash differs (a ``touch`` is not a change). An invalid
    new file is reported once (not at every poll) and the previous one stays in force.
    """

    def __init__(self, config_path: str | os.PathLike[str]) -> None:
        """Loads both files, raising ``ConfigError`` if either is invalid (fail fast)."""
        self.config_path = Path(config_path)
        self._seen: dict[Path, _Seen] = {}
        self._reported: dict[Path, str] = {}  # last error reported per file, to not repeat
        self.config: GatewayConfig = self._load(self.config_path, _parse_config)
        self.keys: KeysFile = self._load(self.config.keys_file, _parse_keys)

    def _load(self, path: Path, parse: Callable[[Path, bytes], _T]) -> _T:
        try:
            stat: tuple[int, int, int] | None = _stat(path)
        except OSError:
            stat = None
        data = _read(path)
        value = parse(path, data)
        self._seen[path] = _Seen(stat, hashlib.sha256(data).hexdigest())
        return value

    def _changed(self, path: Path) -> bytes | None:
        """The file's new content if it changed since last seen, else None.

        Raises ConfigError if it cannot be read.
        """
        seen = self._seen[path]
        try:
            stat = _stat(path)
        except FileNotFoundError:
            raise ConfigError(path, ["file not found (keeping the previous version)"]) from None
        except OSError as exc:
            raise ConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from None
        if stat == seen.stat:
            return None
        data = _read(path)  # stat before read: a write after the read changes the stat
        self._reported.pop(path, None)  # readable again: report its next problem anew
        digest = hashlib.sha256(data).hexdigest()
        seen.stat = stat
        if digest == seen.digest:
            return None
        seen.digest = digest
        return data

    def _report(self, path: Path, error: ConfigError, errors: list[ConfigError]) -> None:
        if self._reported.get(path) != str(error):
            self._reported[path] = str(error)
            log.error("%s; the previous version stays in force", error)
            errors.append(error)

    def poll(self) -> Reload | None:
        """Checks both files once; None when there is nothing new to act on or report."""
        errors: list[ConfigError] = []
        restart: tuple[str, ...] = ()
        new_keys: KeysFile | None = None

        try:
            data = self._changed(self.config_path)
            if data is not None:
                candidate = _parse_config(self.config_path, data)
                restart = tuple(changed_fields(self.config.model_dump(), candidate.model_dump()))
                if restart:
                    log.warning(
                        "%s changed (%s); these fields take effect only after a restart",
                        self.config_path,
                        ", ".join(restart),
                    )
        except ConfigError as exc:
            self._report(self.config_path, exc, errors)

        keys_path = self.config.keys_file  # the one in force, even if the config changed
        try:
            data = self._changed(keys_path)
            if data is not None:
                new_keys = _parse_keys(keys_path, data)
                self.keys = new_keys
                log.info("reloaded %s: %d keys", keys_path, len(new_keys.keys))
        except ConfigError as exc:
            self._report(keys_path, exc, errors)

        if new_keys is None and not errors and not restart:
            return None
        return Reload(keys=new_keys, errors=tuple(errors), restart_required=restart)
