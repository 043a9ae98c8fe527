"""The keys file: one entry per API key, holding only the key's SHA-256 digest, its
tenant, allowed models, priority, rate limits and prefix-cache sharing. It is separate
from the config file so that it can be a mounted Kubernetes Secret, rotated (and
hot-reloaded) without touching the rest. Described field by field in
``docs/gateway-config.md``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from kvserve.gateway.files import (
    NAME_PATTERN,
    NAME_RULE,
    ConfigError,
    StrictModel,
    parse_yaml,
    read_file,
    validation_problems,
)
from kvserve.names import WILDCARD

Priority = Literal["critical", "standard", "sheddable"]

KEY_PREFIX = "sk-kvs-"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """The SHA-256 hex digest stored in the keys file in place of the key itself."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh random API key (``sk-kvs-`` + 256 random bits) and its digest.

    Hand the key to the client once; put only the digest in the keys file.
    """
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key)


class KeyLimits(StrictModel):
    """Per-tenant rate limits; a limit left out (null) is not enforced."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)


class KeyEntry(StrictModel):
    """One API key, by digest. Keys of the same tenant share that tenant's limits."""

    tenant: str
    sha256: str
    models: list[str] = Field(min_length=1)
    priority: Priority = "standard"
    limits: KeyLimits = Field(default_factory=KeyLimits)
    # Prefix-cache sharing (kvserve.gateway.tenancy): false keeps the tenant's cache its
    # own; true shares with every tenant that says true; a name shares within that group.
    share_prefix_cache: bool | str = False

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, name: str) -> str:
        if NAME_PATTERN.fullmatch(name) is None:
            raise ValueError(f"tenant must be {NAME_RULE}")
        return name

    @field_validator("share_prefix_cache")
    @classmethod
    def _share_group(cls, share: bool | str) -> bool | str:
        if isinstance(share, str) and NAME_PATTERN.fullmatch(share) is None:
            raise ValueError(f"a sharing group's name must be {NAME_RULE} (or true / false)")
        return share

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


class KeysFile(StrictModel):
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
            if (set(other.models), other.priority, other.limits, other.share_prefix_cache) != (
                set(entry.models),
                entry.priority,
                entry.limits,
                entry.share_prefix_cache,
            ):
                raise ValueError(
                    f"keys[{first}] and keys[{index}] both belong to tenant {entry.tenant!r} "
                    "but differ in models, priority, limits or share_prefix_cache; keys of "
                    "one tenant share one budget and one cache, so these must be identical"
                )
        return keys


def parse_keys(path: Path, data: bytes) -> KeysFile:
    document = parse_yaml(path, data)
    try:
        return KeysFile.model_validate(document)
    except ValidationError as exc:
        # Never show inputs from the keys file: a misplaced secret would be printed.
        raise ConfigError(path, validation_problems(exc, show_input=False)) from None


def load_keys(path: str | os.PathLike[str]) -> KeysFile:
    """Reads and validates the keys file."""
    path = Path(path)
    return parse_keys(path, read_file(path))
