"""The gateway's configuration file: validated at start.

Two YAML files, both described field by field in ``docs/gateway-config.md``:

- the config file (``--config``, this module): listen address, models and their
  replicas, routing, admission, retries, timeouts, and where the keys file is;
- the keys file (``kvserve.gateway.keys``).

A wrong file fails fast: ``load_config`` / ``load_keys`` raise ``ConfigError`` whose
message names the file, the field path (``models.kvserve-travel-tiny.replicas[1]``) and
the reason. The models are strict (no ``"8080"`` for a port, no ``true`` for a number)
and forbid unknown fields, so a typo is an error instead of a silently ignored default.

``kvserve.gateway.watch.ConfigWatcher`` re-reads both files when the gateway asks it to
(``poll()``); only the keys file takes effect without a restart.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvserve.gateway.files import (
    ConfigError,
    StrictModel,
    parse_yaml,
    read_file,
    validation_problems,
)
from kvserve.names import model_name_problem
from kvserve.openai.http_limits import HttpLimits
from kvserve.openai.refusal_pacing import GATEWAY_REFUSALS_PER_SECOND
from kvserve.openai.stalls import DEFAULT_WRITE_STALL_SECONDS
from kvserve.rpc.listen import MAX_MESSAGE_BYTES
from kvserve.sampling_params import StopLimits

RoutingPolicy = Literal["prefix", "least_load", "round_robin"]

# An adapter the gateway may load by name is the folder of that name in each replica's
# --lora-dir: one path component, never "." or "..".
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_REPLICA_URL = re.compile(
    r"grpc://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
    r":(?P<port>[0-9]{1,5})"
)


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


class ListenConfig(StrictModel):
    """Where the gateway's HTTP API listens."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8080, ge=1, le=65535)
    # None: /metrics on ``port``. A port: /metrics only there (on ``host``), so that who
    # may scrape and who may call the API can be told apart (docs/security.md).
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # Longer than the idle timeout of the load balancer in front (60 s on most): if the
    # gateway closed idle connections first, the balancer would reuse a closed one and
    # answer 502. uvicorn's own default is 5 s.
    keep_alive_seconds: int = Field(default=75, ge=1)
    # What a client may make the gateway hold before its request is read
    # (kvserve.openai.http_limits): a larger head is a 431, a slower one a 408.
    max_header_bytes: int = Field(default=HttpLimits.max_head_bytes, ge=1024)
    header_timeout_seconds: float = Field(default=HttpLimits.head_timeout, gt=0)
    body_timeout_seconds: float = Field(default=HttpLimits.body_timeout, gt=0)
    # 4xx answers (a missing key, a 413, a 429 ...) are given no faster than this, after a
    # burst of one second's worth (kvserve.openai.refusal_pacing); 0: at once.
    refusals_per_second: float = Field(
        default=GATEWAY_REFUSALS_PER_SECOND, ge=0, allow_inf_nan=False
    )

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.max_header_bytes, self.header_timeout_seconds, self.body_timeout_seconds
        )

    @field_validator("metrics_port")
    @classmethod
    def _metrics_port_is_its_own(cls, port: int | None, info: ValidationInfo) -> int | None:
        if port is not None and port == info.data.get("port"):  # ``port`` is checked first
            raise ValueError(
                f"{port} is also listen.port: give /metrics a port of its own, or leave "
                "metrics_port out"
            )
        return port


def _replica_url(url: str) -> str:
    parse_replica_url(url)
    return url


ReplicaUrl = Annotated[str, AfterValidator(_replica_url)]


class ModelConfig(StrictModel):
    """One served model name: its static replicas (if any) and its limits.

    With Kubernetes discovery, a model needs no entry unless it wants non-default
    limits; discovered replicas are added to the static ones.
    """

    replicas: list[ReplicaUrl] = Field(default_factory=list)
    max_tokens_ceiling: int | None = Field(default=None, ge=1)
    max_in_flight_per_replica: int = Field(default=32, ge=1)
    # LoRA adapters of this model that the gateway may have a replica load on demand, from
    # the replica's --lora-dir/<name> (those the replicas already serve need no entry).
    lora_adapters: list[str] = Field(default_factory=list)

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, names: list[str]) -> list[str]:
        seen: set[str] = set()
        for index, name in enumerate(names):
            if _ADAPTER_NAME.fullmatch(name) is None:
                raise ValueError(
                    f"[{index}]: adapter name {name!r} must be a folder name: 1-128 letters, "
                    "digits, '.', '_', '-', starting with a letter or digit"
                )
            if name in seen:
                raise ValueError(f"[{index}]: adapter {name!r} is listed twice")
            seen.add(name)
        return names

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, urls: list[str]) -> list[str]:
        seen: set[str] = set()
        for index, url in enumerate(urls):
            if url in seen:
                raise ValueError(f"[{index}]: replica {url!r} is listed twice")
            seen.add(url)
        return urls


class RoutingConfig(StrictModel):
    """How a request picks a replica."""

    policy: RoutingPolicy = "prefix"
    load_factor: float = Field(default=1.25, gt=1)
    prefix_chars: int = Field(default=512, ge=1)


class AdmissionConfig(StrictModel):
    """The gateway's wait queue when every replica is at ``max_in_flight_per_replica``."""

    queue_size: int = Field(default=256, ge=0)
    queue_timeout_seconds: float = Field(default=30.0, gt=0)


class RetryConfig(StrictModel):
    """Retries on another replica when one fails before sending any output."""

    max_attempts: int = Field(default=2, ge=1, le=10)


class KubernetesDiscoveryConfig(StrictModel):
    """Replicas from the EndpointSlices of Services that match ``label_selector``."""

    namespaces: list[str] = Field(default_factory=list)  # empty: every namespace
    label_selector: str = Field(
        default="app.kubernetes.io/managed-by=kvserve-operator", min_length=1
    )
    port_name: str = Field(default="grpc", min_length=1)
    # Default: in-cluster credentials, else $KUBECONFIG / ~/.kube/config.
    kubeconfig: Annotated[Path | None, Field(strict=False)] = None


class DiscoveryConfig(StrictModel):
    kubernetes: KubernetesDiscoveryConfig | None = None


class GatewayConfig(StrictModel):
    """The whole config file. Only the keys file it points to hot-reloads."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    # At most half a gRPC message: a request goes to its replica as one message.
    max_body_bytes: int = Field(default=1 << 20, ge=1, le=MAX_MESSAGE_BYTES // 2)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    keys_file: Annotated[Path, Field(strict=False)]
    request_timeout_seconds: float = Field(default=600.0, gt=0)
    load_poll_seconds: float = Field(default=1.0, gt=0)
    reload_poll_seconds: float = Field(default=5.0, gt=0)
    # /docs and /openapi.json describe the API to anyone who can reach the gateway.
    serve_api_docs: bool = False
    # Stop strings cost every replica's engine thread time per token (docs/security.md).
    max_stop_strings: int = Field(default=StopLimits.max_count, ge=0)
    max_stop_string_chars: int = Field(default=StopLimits.max_chars, ge=1)
    # A stream whose client has not read for this long is ended (kvserve.openai.stalls).
    write_stall_timeout_seconds: float = Field(default=DEFAULT_WRITE_STALL_SECONDS, gt=0)

    @property
    def stop_limits(self) -> StopLimits:
        return StopLimits(self.max_stop_strings, self.max_stop_string_chars)

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:
            problem = model_name_problem(name)
            if problem is not None:
                raise ValueError(problem)
        return models

    @model_validator(mode="after")
    def _adapter_names_are_unique(self) -> GatewayConfig:
        # A request's ``model`` names a model or an adapter: each name must mean one thing.
        owner: dict[str, str] = {}
        for model, settings in self.models.items():
            for name in settings.lora_adapters:
                if name in self.models:
                    raise ValueError(
                        f"models.{model}.lora_adapters: {name!r} is also a model's name"
                    )
                if name in owner:
                    raise ValueError(
                        f"models.{model}.lora_adapters: {name!r} is also an adapter of "
                        f"{owner[name]!r}"
                    )
                owner[name] = model
        return self

    def adapter_model(self, name: str) -> str | None:
        """The model whose ``lora_adapters`` lists ``name``, if any."""
        for model, settings in self.models.items():
            if name in settings.lora_adapters:
                return model
        return None

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

    def with_listen(self, **overrides: object) -> GatewayConfig:
        """This config with ``listen`` fields replaced (the command line's ``--host``,
        ``--port``, ``--metrics-port``), checked as the file's are: raises
        ``ValidationError``, whose locations are ``listen``'s field names."""
        listen = ListenConfig.model_validate({**self.listen.model_dump(), **overrides})
        return self.model_copy(update={"listen": listen})

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


def parse_config(path: Path, data: bytes) -> GatewayConfig:
    document = parse_yaml(path, data)
    try:
        return GatewayConfig.model_validate(document, context={"base_dir": path.resolve().parent})
    except ValidationError as exc:
        raise ConfigError(path, validation_problems(exc, show_input=True)) from None


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Reads and validates the config file; ``keys_file`` comes back resolved."""
    path = Path(path)
    return parse_config(path, read_file(path))
