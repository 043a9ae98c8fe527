"""``kvserve adapters sync``: keep one engine replica's LoRA adapters equal to a list.

The InferenceModel operator runs this beside the engine in every pod (container
``adapter-sync``, docs/inference-model.md "Adapters"). It reads ``--config``, a JSON
file ``{"adapters": [{"name": ..., "source": ...}]}`` that the operator renders from
spec.adapters into a ConfigMap mounted in the pod; the kubelet rewrites a mounted
ConfigMap in place, so a new list reaches the pod without a restart. Each pass:

1. ``GET /v1/models`` on the engine (``--url``, its HTTP port on 127.0.0.1): which
   adapters it serves. While the engine is not up yet, it is asked again every 2 s at
   most, so the adapters load within seconds of it becoming ready.
2. Unload (``POST /v1/unload_lora_adapter``) every adapter that this command loaded from
   ``--lora-dir`` and the list no longer names, and delete its folder, so nothing (the
   gateway loads adapters on demand by name) can load it again.
3. Pull each listed adapter into ``--lora-dir/NAME`` (sources as ``kvserve model pull``:
   hf://, pvc://, file://; a marker file makes a repeated pull a no-op), then load it
   (``POST /v1/load_lora_adapter``) if the engine does not serve it yet, or reload it in
   place (``load_inplace``) if the pull brought new files: the old version serves until
   the new one has loaded, so clients never see a 404 in between. New files replace the
   old ones only for the load: if the engine refuses them (a rank over its limit), the
   old files are put back and the old version keeps serving. An adapter that fails to
   pull or load, or fails in any other way, is logged and retried with its own backoff
   (at once when its source changes); the others go on.

Every pass compares the list with what the engine reports, not with the previous pass,
so an engine container that restarts (and forgets its adapters) is filled again. SIGTERM
ends the command with status 0. ``--once`` runs one successful pass and exits: 0, or 1
when an adapter failed.

Imports only the standard library, httpx and kvserve.model.pull: no torch, so the
sidecar starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from kvserve.arg_types import positive_seconds
from kvserve.json_input import JSONInputError, read_json_object
from kvserve.model.pull import (
    ModelPullError,
    ModelSource,
    check_safetensors,
    download_hf,
    parse_source,
    read_marker,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES: tuple[str, ...] = (CONFIG_FILE, WEIGHTS_FILE)
# Written last into a pulled adapter's folder: its source and file sizes. A folder
# without it is not this command's (and is never deleted by it).
MARKER = ".kvserve-adapter.json"
_STAGE_PREFIX = ".kvserve-adapter-"
# The operator's rule for names (a DNS-1123 label), checked again here because a name
# becomes a folder under --lora-dir.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_MAX = 63

DEFAULT_INTERVAL_S = 5.0
MAX_BACKOFF_S = 60.0  # an adapter that keeps failing is tried at most this often
# An engine that is not up yet is asked again at most this long after: it is on
# 127.0.0.1, so a refused connection costs nothing, and its adapters then load within
# seconds of it becoming ready (a large model can take minutes to load; a backoff growing
# with that wait would leave its adapters missing for up to MAX_BACKOFF_S after).
ENGINE_RETRY_MAX_S = 2.0
ENGINE_LOG_EVERY_S = 30.0  # a long "engine not ready" is logged this often

Log = Callable[[str], None]


class SyncError(Exception):
    """The list file is unreadable or malformed (the pass is skipped)."""


class EngineUnavailable(Exception):
    """The engine does not answer yet (starting, restarting): retry the pass later."""


class AdapterFailed(Exception):
    """One adapter could not be pulled or loaded; the others go on."""


# ---- the list -----------------------------------------------------------------------------


def read_config(path: Path) -> dict[str, str]:
    """The list file as ``{name: source}``."""
    try:
        items = read_json_object(path).get("adapters")
    except JSONInputError as exc:
        raise SyncError(f"{path}: {exc}") from None
    if not isinstance(items, list):
        raise SyncError(f'{path}: expected {{"adapters": [...]}}')
    wanted: dict[str, str] = {}
    for i, item in enumerate(items):
        name = item.get("name") if isinstance(item, dict) else None
        source = item.get("source") if isinstance(item, dict) else None
        if not isinstance(name, str) or len(name) > _NAME_MAX or not _NAME.fullmatch(name):
            raise SyncError(f"{path}: adapters[{i}].name {name!r} is not a DNS-1123 label")
        if not isinstance(source, str):
            raise SyncError(f"{path}: adapters[{i}].source must be a string")
        if name in wanted:
            raise SyncError(f"{path}: adapter {name!r} is listed twice")
        try:
            parse_source(source)
        except ModelPullError as exc:
            raise SyncError(f"{path}: adapters[{i}].source: {exc}") from None
        wanted[name] = source
    return wanted


# ---- pulling ------------------------------------------------------------------------------


def _up_to_date(folder: Path, source: str) -> bool:
    marker = read_marker(folder, MARKER)
    if marker is None or marker.get("source") != source:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or set(files) != set(ADAPTER_FILES):
        return False
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def _verify(folder: Path, label: str) -> dict[str, int]:
    """Check the files without torch; the engine checks the adapter itself at load."""
    try:
        read_json_object(folder / CONFIG_FILE)
    except JSONInputError as exc:
        raise AdapterFailed(f"{label}: {CONFIG_FILE}: {exc}") from None
    try:
        check_safetensors(folder / WEIGHTS_FILE)
    except (ModelPullError, OSError) as exc:
        raise AdapterFailed(f"{label}: {exc}") from None
    return {name: (folder / name).stat().st_size for name in ADAPTER_FILES}


def _fetch(src: ModelSource, stage: Path, pvc_root: Path | None) -> None:
    if src.is_local:
        local = src.local_path(pvc_root)
        for name in ADAPTER_FILES:
            try:
                shutil.copyfile(local / name, stage / name)
            except OSError as exc:
                raise AdapterFailed(f"{src}: {exc}") from None
        return
    try:
        download_hf(src, stage, ADAPTER_FILES)
    except ModelPullError as exc:
        raise AdapterFailed(str(exc)) from None
    # The Hub's download bookkeeping: not part of the adapter.
    shutil.rmtree(stage / ".cache", ignore_errors=True)


def stage_adapter(source: str, dest: Path, *, pvc_root: Path | None = None) -> Path | None:
    """The adapter at ``source``, fetched into a staging folder beside ``dest``, checked
    and given its marker; None when ``dest`` already holds it."""
    if _up_to_date(dest, source):
        return None
    src = parse_source(source)
    stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=dest.parent))
    try:
        _fetch(src, stage, pvc_root)
        files = _verify(stage, str(src))
        marker = {"source": source, "files": files}
        (stage / MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n", encoding="utf-8")
    except BaseException as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(exc, OSError):  # e.g. the volume is full
            raise AdapterFailed(f"{dest}: {exc}") from None
        raise
    return stage


@contextmanager
def swapped_in(stage: Path, dest: Path) -> Iterator[None]:
    """Put the staged folder at ``dest`` (by renames: the engine never sees half an
    adapter) while the body loads it; keep it if the body succeeds, else put the old
    folder back, so that files the engine refused never replace those it serves (it
    reads an adapter's files again when it needs the adapter after dropping it from
    memory)."""
    old = stage.with_name(stage.name + "-old")
    had_old = dest.exists()
    try:
        if had_old:
            os.rename(dest, old)
        try:
            os.rename(stage, dest)
        except OSError:
            if had_old:
                os.rename(old, dest)
            raise
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise AdapterFailed(f"{dest}: {exc}") from None
    try:
        yield
    except BaseException:
        os.rename(dest, stage)
        if had_old:
            os.rename(old, dest)
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_stages(lora_dir: Path) -> None:
    """Staging folders of a pull that was killed (pod stopped mid-download)."""
    for path in lora_dir.glob(f"{_STAGE_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)


# ---- the engine ---------------------------------------------------------------------------


class EngineClient:
    """The engine server's adapter API (vLLM's), over HTTP."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Mapping[str, object] | None = None) -> Any:
        try:
            response = httpx.request(method, f"{self.url}{path}", json=body, timeout=self.timeout)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500:
            raise EngineUnavailable(f"{path}: HTTP {response.status_code}: {response.text}")
        return response

    def adapters(self) -> dict[str, str]:
        """The adapters the engine serves, as ``{name: folder}``."""
        response = self._call("GET", "/v1/models")
        if response.status_code != 200:
            raise EngineUnavailable(f"/v1/models: HTTP {response.status_code}")
        try:
            models = response.json()["data"]
            return {
                str(m["id"]): str(m.get("root") or "")
                for m in models
                if m.get("parent")  # the base model has none
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Not an engine's model list (another server on the port, a proxy's page).
            raise EngineUnavailable(
                f"/v1/models: not a model list ({type(exc).__name__}): {response.text[:80]!r}"
            ) from None

    def load(self, name: str, path: str, *, inplace: bool = False) -> None:
        """Serve the adapter at ``path`` as ``name``; ``inplace``: in place of the one
        served under ``name``, which serves until the new one has loaded."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        response = self._call("POST", "/v1/load_lora_adapter", body)
        if response.status_code != 200:
            raise AdapterFailed(f"load {name}: HTTP {response.status_code}: {response.text}")

    def unload(self, name: str) -> None:
        response = self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        # 404: already gone (unloaded by someone else), which is what was wanted.
        if response.status_code not in (200, 404):
            raise AdapterFailed(f"unload {name}: HTTP {response.status_code}: {response.text}")


# ---- one pass -----------------------------------------------------------------------------


@dataclass
class Report:
    """What one pass did; empty when the engine already served exactly the list."""

    loaded: list[str] = field(default_factory=list)
    reloaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.reloaded or self.unloaded or self.failed)


@dataclass
class Backoff:
    """Per adapter: when a failed (name, source) may be tried again."""

    now: Callable[[], float] = time.monotonic
    _next: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def waiting(self, name: str, source: str) -> bool:
        entry = self._next.get((name, source))
        return entry is not None and self.now() < entry[0]

    def failed(self, name: str, source: str) -> float:
        delay = min(self._next.get((name, source), (0.0, 0.5))[1] * 2, MAX_BACKOFF_S)
        self._next[(name, source)] = (self.now() + delay, delay)
        return delay

    def succeeded(self, name: str) -> None:
        for key in [k for k in self._next if k[0] == name]:
            del self._next[key]


@dataclass
class EngineWait:
    """When to ask an engine that did not answer again, and whether to log it: the delay
    doubles from 0.25 s up to ENGINE_RETRY_MAX_S; a wait is logged when it starts and then
    once every ENGINE_LOG_EVERY_S (not on each new reason: a 5xx body carries a new
    request id every time)."""

    now: Callable[[], float] = time.monotonic
    delay: float = 0.0
    _logged_at: float | None = None

    def failed(self) -> tuple[float, bool]:
        """The delay before the next try, and whether to log this failure."""
        self.delay = min(max(self.delay * 2, 0.25), ENGINE_RETRY_MAX_S)
        t = self.now()
        log = self._logged_at is None or t - self._logged_at >= ENGINE_LOG_EVERY_S
        if log:
            self._logged_at = t
        return self.delay, log

    def answered(self) -> None:
        self.delay, self._logged_at = 0.0, None


def sync_once(
    wanted: Mapping[str, str],
    lora_dir: Path,
    engine: EngineClient,
    *,
    pvc_root: Path | None = None,
    backoff: Backoff | None = None,
    log: Log = lambda _msg: None,
) -> Report:
    """One pass: make the engine serve exactly ``wanted`` of the adapters in ``lora_dir``.

    Raises ``EngineUnavailable`` when the engine does not answer (nothing is half done:
    the next pass starts over from what the engine reports).
    """
    backoff = backoff or Backoff()
    report = Report()
    root = lora_dir.resolve()
    served = engine.adapters()
    # Adapters that were loaded from --lora-dir; others (--lora-modules) are not ours.
    ours = {name for name, folder in served.items() if Path(folder).parent == root}

    for name in sorted(ours - wanted.keys()):
        try:
            engine.unload(name)
        except AdapterFailed as exc:
            report.failed[name] = str(exc)
            log(str(exc))
            continue
        report.unloaded.append(name)
        log(f"unloaded {name}")
    for folder in sorted(lora_dir.iterdir()):
        gone = folder.name not in wanted and folder.name not in report.failed
        if gone and (folder / MARKER).is_file():
            shutil.rmtree(folder, ignore_errors=True)

    for name, source in sorted(wanted.items()):
        if name in served and name not in ours:
            report.failed[name] = "the engine serves another adapter by this name"
            continue
        if backoff.waiting(name, source):
            continue
        try:
            if not _serve(name, source, lora_dir, engine, name in ours, pvc_root):
                continue
        except EngineUnavailable:
            raise  # the pass starts over
        except Exception as exc:  # a bug or a surprise: still only this adapter's failure
            expected = isinstance(exc, (AdapterFailed, ModelPullError))
            problem = str(exc) if expected else f"{type(exc).__name__}: {exc}"
            delay = backoff.failed(name, source)
            report.failed[name] = problem
            log(f"{name}: {problem} (retry in {delay:g} s)")
            continue
        backoff.succeeded(name)
        (report.reloaded if name in ours else report.loaded).append(name)
        log(f"{'reloaded' if name in ours else 'loaded'} {name} from {source}")
    return report


def _serve(
    name: str,
    source: str,
    lora_dir: Path,
    engine: EngineClient,
    served: bool,
    pvc_root: Path | None,
) -> bool:
    """Pull ``name`` and have the engine serve it; False when it did and the pull brought
    nothing new."""
    dest = lora_dir / name
    staged = stage_adapter(source, dest, pvc_root=pvc_root)
    if staged is None:
        if served:
            return False
        engine.load(name, name)  # a path relative to the engine's --lora-dir
        return True
    with swapped_in(staged, dest):
        engine.load(name, name, inplace=served)
    return True


# ---- the command --------------------------------------------------------------------------


class _Stopped(BaseException):
    """SIGTERM: leave at once (a pull in progress is staged, so it leaves nothing half done).

    Not an ``Exception``: what catches one adapter's failures must not catch it."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _Stopped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="the adapter list (JSON)")
    parser.add_argument(
        "--lora-dir",
        type=Path,
        required=True,
        help="the engine's --lora-dir: adapters are pulled into LORA_DIR/NAME",
    )
    parser.add_argument(
        "--url",
        type=_engine_url,
        default="http://127.0.0.1:8000",
        help="the engine's HTTP API (default: %(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=positive_seconds,
        default=DEFAULT_INTERVAL_S,
        help="seconds between passes (default: %(default)s)",
    )
    parser.add_argument(
        "--pvc-root",
        type=Path,
        default=None,
        help="where pvc://CLAIM is mounted, as for kvserve model pull (default: "
        "$KVSERVE_PVC_ROOT or /mnt/pvc)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="one successful pass, then exit (1 if an adapter failed)",
    )


def _engine_url(text: str) -> str:
    """http(s)://HOST[:PORT]: anything else would be retried for ever as "not ready"."""
    try:
        url = httpx.URL(text)
        port = url.port  # raises for a port out of range
    except (httpx.InvalidURL, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host or not 1 <= (port or 80) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: not an http(s)://HOST[:PORT] URL")
    return text


def _say(message: str) -> None:
    print(f"adapter-sync: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    stop = stop or threading.Event()
    engine = EngineClient(args.url)
    backoff = Backoff()
    engine_wait = EngineWait()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        args.lora_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. a file by that name
        _say(f"--lora-dir {args.lora_dir}: {exc}")
        return 2
    try:
        remove_stale_stages(args.lora_dir)
        while not stop.is_set():
            delay = args.interval
            try:
                wanted = read_config(args.config)
                report = sync_once(
                    wanted,
                    args.lora_dir,
                    engine,
                    pvc_root=args.pvc_root,
                    backoff=backoff,
                    log=_say,
                )
                engine_wait.answered()
                if args.once:
                    return 1 if report.failed else 0
            except EngineUnavailable as exc:
                delay, log = engine_wait.failed()
                if log:
                    _say(f"engine not ready ({exc}); asking again every {ENGINE_RETRY_MAX_S:g} s")
            except SyncError as exc:
                # The operator writes the file; a bad one is fixed by the next write.
                _say(str(exc))
                if args.once:
                    return 2
            stop.wait(delay)
    except _Stopped:
        _say("SIGTERM: stopping")
    return 0
