"""Hot reload: ``ConfigWatcher`` re-reads the config and keys files when the gateway asks
(``poll()``); only the keys file takes effect without a restart."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvserve.gateway.config import GatewayConfig, parse_config
from kvserve.gateway.files import ConfigError, read_file
from kvserve.gateway.keys import KeysFile, parse_keys

log = logging.getLogger("kvserve.gateway")


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
        self.config: GatewayConfig = self._load(self.config_path, parse_config)
        self.keys: KeysFile = self._load(self.config.keys_file, parse_keys)

    def _load(self, path: Path, parse: Callable[[Path, bytes], _T]) -> _T:
        try:
            stat: tuple[int, int, int] | None = _stat(path)
        except OSError:
            stat = None
        data = read_file(path)
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
            raise ConfigError(path, ["file not found"]) from None
        except OSError as exc:
            raise ConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from None
        if stat == seen.stat:
            return None
        data = read_file(path)  # stat before read: a write after the read changes the stat
        self._reported.pop(path, None)  # readable again: report its next problem anew
        digest = hashlib.sha256(data).hexdigest()
        seen.stat = stat
        if digest == seen.digest:
            return None
        seen.digest = digest
        return data

    def _report(self, path: Path, error: ConfigError, errors: list[ConfigError]) -> None:
        if self._reported.get(path) != str(error):  # the caller logs it (once)
            self._reported[path] = str(error)
            errors.append(error)

    def poll(self) -> Reload | None:
        """Checks both files once; None when there is nothing new to act on or report."""
        errors: list[ConfigError] = []
        restart: tuple[str, ...] = ()
        new_keys: KeysFile | None = None

        try:
            data = self._changed(self.config_path)
            if data is not None:
                candidate = parse_config(self.config_path, data)
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
                new_keys = parse_keys(keys_path, data)
                self.keys = new_keys
                log.info("reloaded %s: %d keys", keys_path, len(new_keys.keys))
        except ConfigError as exc:
            self._report(keys_path, exc, errors)

        if new_keys is None and not errors and not restart:
            return None
        return Reload(keys=new_keys, errors=tuple(errors), restart_required=restart)
