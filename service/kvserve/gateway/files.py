"""Reading the gateway's YAML files: strict schemas, and errors that name the file, the
field path and the reason without echoing secrets.

``ConfigError`` is what every loader raises; ``StrictModel`` the base of both files'
schemas; ``parse_yaml`` and ``validation_problems`` turn bytes and pydantic errors into
documents and messages.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

# Tenant and group names end up in logs and as a metric label: keep them plain.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
NAME_RULE = "1-63 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"


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


class StrictModel(BaseModel):
    # strict: YAML gives real ints/floats/bools, so a quoted number is a mistake worth
    # reporting; extra=forbid: a misspelt field must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


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


def read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(path, ["file not found"]) from None
    except OSError as exc:
        raise ConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from None


def parse_yaml(path: Path, data: bytes) -> dict[str, Any]:
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


# The last part of a location that names a member of a union (``bool | str``), which
# pydantic reports once per member: ``share_prefix_cache.bool``, ``share_prefix_cache.str``.
_UNION_MEMBER = re.compile(r"(bool|str|int|float|none|(list|dict|literal|function-\w+)\[.*\])")


def _union_members_merged(errors: list[Any]) -> list[Any]:
    """One error per union field: ``Input should be a valid boolean or a valid string``
    at the field's own path, not one per member at paths the file does not have."""
    merged: list[Any] = []
    for error in errors:
        loc = tuple(error["loc"])
        if not (loc and isinstance(loc[-1], str) and _UNION_MEMBER.fullmatch(loc[-1])):
            merged.append(error)
            continue
        field = {**error, "loc": loc[:-1]}
        last = merged[-1] if merged else None
        if last is not None and tuple(last["loc"]) == loc[:-1] and last.get("union"):
            alternative = str(error["msg"]).removeprefix("Input should be ")
            last["msg"] = f"{last['msg']} or {alternative}"
        else:
            merged.append(field | {"union": True})
    return merged


def validation_problems(exc: ValidationError, *, show_input: bool) -> list[str]:
    problems = []
    for error in _union_members_merged(list(exc.errors())):
        loc = tuple(error["loc"])
        kind = error["type"]
        # "a valid dictionary or instance of KeyLimits": the class is not the file's word
        message = re.sub(r" or instance of \w+", "", str(error["msg"]))
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
