"""One JSON line per request, as the load-test client saw it (format ``kvserve.loadtest/1``).

The records keep the raw client-side timeline, not derived figures: every summary (the
end-of-run report, ``kvserve report``, the sweep table) recomputes TTFT, TPOT, ITL and E2E
from them with :mod:`kvserve.telemetry.definitions`, so two runs saved months apart are
compared with the same formulas.

Record fields (version 1; times in seconds):

* ``format`` -- always ``"kvserve.loadtest/1"``; a reader refuses other major versions.
* ``send_time`` -- wall clock (Unix seconds, ``time.time()``) just before the request was sent.
  This is ``s`` in docs/architecture.md §3 (client send).
* ``first_token_s``, ``last_token_s`` -- offsets from the send of the first and the last SSE
  chunk carrying non-empty visible text (``f − s`` and ``e − s``); null without text.
* ``chunk_times_s`` -- offsets of every chunk with visible text, in order (ITL = their gaps).
* ``end_s`` -- offset when the client was done: ``[DONE]`` read, the error seen, or the stream
  closed by a cancellation.
  Offsets come from ``time.perf_counter()`` (monotonic, sub-microsecond) and are rounded to
  the microsecond.
* ``status`` -- ``"ok"`` (HTTP 200, a finish reason, ``[DONE]``, no error event), ``"error"``
  (anything else: HTTP error, error event mid-stream, connection failure, timeout,
  the run ending first) or ``"cancelled"`` (the client disconnected on purpose, as the
  cancellation workload does).
* ``http_status``, ``error`` -- the HTTP status (null without a response) and what went wrong.
* ``output_tokens``, ``prompt_tokens``, ``cached_tokens`` -- from the ``usage`` chunk
  (``stream_options.include_usage``; cached = ``prompt_tokens_details.cached_tokens``).
* ``finish_reason`` -- of the last choice chunk.
* ``api`` (``"chat"`` or ``"completions"``), ``scenario`` (the workload's request kind, e.g.
  ``"agent"``), ``max_tokens``, ``cancel_after_chunks`` (planned disconnect, or null),
  ``request_id`` (the server's ``x-request-id``) and ``user`` (which load-test user sent it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Literal

from kvserve.telemetry import definitions

FORMAT = "kvserve.loadtest/1"
FORMAT_NAME, _, _FORMAT_MAJOR = FORMAT.partition("/")
Status = Literal["ok", "error", "cancelled"]
STATUSES: tuple[Status, ...] = ("ok", "error", "cancelled")


@dataclass
class RequestRecord:
    """One request's client-side timeline and outcome (see the module docstring)."""

    send_time: float
    status: Status
    end_s: float
    api: str = "chat"
    scenario: str = "chat"
    first_token_s: float | None = None
    last_token_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None
    max_tokens: int | None = None
    cancel_after_chunks: int | None = None
    request_id: str | None = None
    user: str | None = None
    format: str = FORMAT

    # ---- the docs/architecture.md §3 figures, from kvserve.telemetry.definitions -----------------
    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def end_time(self) -> float:
        """Wall-clock time the client was done with this request."""
        return self.send_time + self.end_s

    @property
    def num_output_tokens(self) -> int | None:
        """O: ``usage.completion_tokens``, else (no usage sent) the chunks with text."""
        if self.output_tokens is not None:
            return self.output_tokens
        return len(self.chunk_times_s) if self.chunk_times_s else None

    def ttft(self) -> float | None:
        if self.first_token_s is None:
            return None
        return definitions.ttft(0.0, self.first_token_s)

    def e2e(self) -> float | None:
        if self.last_token_s is None:
            return None
        return definitions.e2e(0.0, self.last_token_s)

    def tpot(self) -> float | None:
        o = self.num_output_tokens
        if self.first_token_s is None or self.last_token_s is None or o is None:
            return None
        return definitions.tpot(self.first_token_s, self.last_token_s, o)

    def itls(self) -> list[float]:
        return definitions.itls(self.chunk_times_s)

    # ---- JSON --------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        if not isinstance(data, dict):
            raise ValueError(f"a record is a JSON object, got {type(data).__name__}")
        fmt = str(data.get("format", ""))
        name, _, major = fmt.partition("/")
        if name != FORMAT_NAME or major.split(".")[0] != _FORMAT_MAJOR:
            raise ValueError(f"not a {FORMAT} record (format {fmt!r})")
        if data.get("status") not in STATUSES:
            raise ValueError(f"unknown status {data.get('status')!r} (expected one of {STATUSES})")
        known = {f.name for f in fields(cls)}
        # Fields added by a later minor version are ignored, so old readers keep working.
        values = {k: v for k, v in data.items() if k in known}
        for name, value in values.items():
            check, kind = _FIELDS.get(name, (_any, ""))
            if not check(value):
                raise ValueError(f"field {name!r}: {value!r} is not {kind}")
        return cls(**values)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _any(value: Any) -> bool:
    return True


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(value: Any) -> bool:
    return isinstance(value, str)


# What each field of a record read back must hold, and how to say it (None: not measured).
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(("send_time", "end_s"), (_number, "a finite number")),
    **dict.fromkeys(
        ("first_token_s", "last_token_s"), (_optional(_number), "a finite number or null")
    ),
    **dict.fromkeys(
        ("output_tokens", "prompt_tokens", "cached_tokens", "http_status", "max_tokens",
         "cancel_after_chunks"),
        (_optional(_integer), "an integer or null"),
    ),
    **dict.fromkeys(
        ("api", "scenario", "finish_reason", "error", "request_id", "user"),
        (_optional(_string), "a string or null"),
    ),
    "chunk_times_s": (
        lambda v: isinstance(v, list) and all(map(_number, v)), "a list of finite numbers"
    ),
}  # fmt: skip


def round_us(seconds: float) -> float:
    """Microsecond precision: enough for any latency, and short lines."""
    return round(seconds, 6)


class RecordWriter:
    """Appends records to a JSONL file as they finish, flushed, so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(rec.to_json() + "\n")


def iter_records(path: Path) -> Iterator[RequestRecord]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield RequestRecord.from_dict(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc


def read_records(*paths: Path) -> list[RequestRecord]:
    """Every record of every file (several files: e.g. one per Locust worker)."""
    return [rec for path in paths for rec in iter_records(path)]
