"""``kvserve model pull SOURCE DEST`` and ``kvserve model verify PATH``.

A Kubernetes init container pulls a checkpoint into a volume before the engine
container runs ``kvserve serve --model DEST``. Sources:

- ``hf://ORG/NAME[@REVISION]``: the Hugging Face Hub (token from ``HF_TOKEN``)
- ``pvc://CLAIM[/PATH]``: a PersistentVolumeClaim mounted at ``<pvc root>/CLAIM``
- ``file:///ABS/PATH``: a directory on the local filesystem (e.g. baked into the image)

A pull writes ``DEST/.kvserve-pull.json`` last, so a later pull of the same source
finds it and does nothing (init containers rerun on every pod restart). Local pulls
into one DEST take turns, holding an exclusive lock on ``DEST/.kvserve-pull.lock``.
Verification reads only config.json and the safetensors headers, with the standard
library, so it is quick on multi-GB checkpoints and needs no torch.

This module imports only the standard library at import time: the operator imports
``parse_source`` to validate specs and to find which claim to mount.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from kvserve.json_input import JSONInputError, parse_json_object, read_json_object

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig

SourceKind = Literal["hf", "pvc", "file"]

ACCEPTED_FORMS = "hf://ORG/NAME[@REVISION], pvc://CLAIM[/PATH] or file:///ABS/PATH"
DEFAULT_PVC_ROOT = "/mnt/pvc"
PVC_ROOT_ENV = "KVSERVE_PVC_ROOT"
MARKER = ".kvserve-pull.json"
# Inside DEST, not beside it: DEST is usually a volume mount point shared by the pod's
# containers, and its parent is each container's own filesystem. Never deleted, so
# every pull locks the same file (a pull waiting on a deleted file would not exclude).
LOCK_FILE = ".kvserve-pull.lock"
MARKER_VERSION = 1

# What the engine reads from a checkpoint; everything else in a Hub repo (other weight
# formats, READMEs, images) is skipped.
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# A local copy also takes any other top-level JSON (small, and may be tokenizer extras).
LOCAL_FILE_PATTERNS: tuple[str, ...] = (*MODEL_FILE_PATTERNS, "*.json")

_STAGE_PREFIX = ".kvserve-pull-"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_HF_NAME_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_HF_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Bytes per element of safetensors dtypes; sub-byte and unknown dtypes are not size-checked.
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class ModelPullError(Exception):
    """An expected failure (bad source, missing or corrupt files): reported without traceback."""


class InvalidSourceError(ModelPullError, ValueError):
    """SOURCE is not one of the accepted forms (a bad argument, exit status 2)."""


@dataclass(frozen=True)
class ModelSource:
    """A parsed SOURCE. ``path`` is relative to the claim for pvc, absolute for file."""

    kind: SourceKind
    repo_id: str | None = None
    revision: str | None = None
    claim: str | None = None
    path: str = ""

    def __str__(self) -> str:
        if self.kind == "hf":
            return f"hf://{self.repo_id}@{self.revision}"
        if self.kind == "pvc":
            return f"pvc://{self.claim}/{self.path}" if self.path else f"pvc://{self.claim}"
        return f"file://{self.path}"

    @property
    def is_local(self) -> bool:
        return self.kind != "hf"

    @property
    def pinned(self) -> bool:
        """Whether an hf:// revision is a full commit hash (immutable)."""
        return self.revision is not None and _COMMIT.fullmatch(self.revision) is not None

    def local_path(self, pvc_root: str | Path | None = None) -> Path:
        """Where a pvc:// or file:// source is on this machine."""
        if self.kind == "file":
            return Path(self.path)
        if self.kind == "pvc":
            assert self.claim is not None
            root = Path(pvc_root) if pvc_root is not None else default_pvc_root()
            return root / self.claim / self.path if self.path else root / self.claim
        raise ValueError(f"{self} is not a local source")


@dataclass(frozen=True)
class SafetensorsInfo:
    tensors: int
    data_bytes: int
    shapes: dict[str, tuple[int, ...]]  # tensor name → shape


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_model`` found; ``warnings`` are problems that do not stop serving."""

    model_type: str
    architecture: str
    safetensors_files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    warnings: tuple[str, ...] = ()

    def summary(self) -> str:
        n = len(self.safetensors_files)
        return (
            f"verified: {n} safetensors file{'s' if n != 1 else ''}, "
            f"{_mb(self.tensor_bytes)} of tensors, config {self.model_type}"
        )


@dataclass(frozen=True)
class PullResult:
    action: Literal["copied", "downloaded", "up to date", "verified in place"]
    dest: Path
    files: dict[str, int]
    report: VerifyReport | None


# ---- sources --------------------------------------------------------------------------


def default_pvc_root() -> Path:
    """Where claims are mounted: ``$KVSERVE_PVC_ROOT``, else /mnt/pvc."""
    return Path(os.environ.get(PVC_ROOT_ENV) or DEFAULT_PVC_ROOT)


def parse_source(text: str) -> ModelSource:
    """Parse a SOURCE string; raises ``InvalidSourceError`` naming the accepted forms."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("hf", "pvc", "file"):
        raise InvalidSourceError(f"unsupported model source {text!r}; expected {ACCEPTED_FORMS}")
    if scheme == "hf":
        return _parse_hf(text, rest)
    if scheme == "pvc":
        return _parse_pvc(text, rest)
    if not rest.startswith("/"):
        raise InvalidSourceError(
            f"{text!r}: a file:// source needs an absolute path (file:///ABS/PATH, three slashes)"
        )
    return ModelSource(kind="file", path=str(PurePosixPath(rest)))


def _parse_hf(text: str, rest: str) -> ModelSource:
    repo_id, at, revision = rest.partition("@")
    parts = repo_id.split("/")
    if (
        len(parts) != 2
        or not all(_HF_NAME_PART.fullmatch(p) for p in parts)
        or "--" in repo_id
        or ".." in repo_id
        or len(repo_id) > 96
    ):
        raise InvalidSourceError(
            f"{text!r}: expected hf://ORG/NAME[@REVISION] with a Hub repo id such as "
            "hf://Qwen/Qwen3-0.6B"
        )
    if at and not _HF_REVISION.fullmatch(revision):
        raise InvalidSourceError(
            f"{text!r}: bad revision {revision!r} (a commit hash, branch or tag after '@')"
        )
    return ModelSource(kind="hf", repo_id=repo_id, revision=revision if at else "main")


def _parse_pvc(text: str, rest: str) -> ModelSource:
    claim, _, path = rest.partition("/")
    if len(claim) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(claim):
        raise InvalidSourceError(
            f"{text!r}: claim name {claim!r} is not a valid DNS-1123 name (lowercase letters, "
            "digits, '-' and '.'); expected pvc://CLAIM[/PATH]"
        )
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidSourceError(f"{text!r}: the path may not leave the claim ('..')")
    return ModelSource(kind="pvc", claim=claim, path="/".join(parts))


# ---- verification ---------------------------------------------------------------------


def verify_model(model_dir: str | Path) -> VerifyReport:
    """Check that ``model_dir`` is a checkpoint the engine can load, without loading it.

    Raises ``ModelPullError`` naming the file (relative to ``model_dir``) and the
    problem; ``_verify_labelled`` puts the checkpoint's name before it.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelPullError("no such directory")  # (the caller names it, as every error)
    model_type, config = _check_config(model_dir / "config.json")
    infos = check_weights(model_dir, config)
    warnings: list[str] = []
    if (
        not (model_dir / "tokenizer.json").is_file()
        and not (model_dir / "tokenizer.model").is_file()
    ):
        warnings.append(
            "no tokenizer.json or tokenizer.model: the server cannot tokenize text "
            "with this directory alone"
        )
    return VerifyReport(
        model_type=model_type,
        architecture=config.architecture,
        safetensors_files=tuple(infos),
        tensors=sum(info.tensors for info in infos.values()),
        tensor_bytes=sum(info.data_bytes for info in infos.values()),
        warnings=tuple(warnings),
    )


def check_weights(model_dir: Path, config: ModelConfig) -> dict[str, SafetensorsInfo]:
    """Check the safetensors files the loader will read (by name, in its order): each
    file whole, and together the tensors ``config`` implies, of the shapes it implies.
    Reads only the headers, so the loader calls it before it allocates the model."""
    from kvserve.model.tensor_shapes import CheckpointTensor, checkpoint_problem

    infos = {name: check_safetensors(model_dir / name) for name in _weight_files(model_dir)}
    tensors = {
        tensor: CheckpointTensor(name, shape)
        for name, info in infos.items()
        for tensor, shape in info.shapes.items()
    }
    if (problem := checkpoint_problem(config, tensors)) is not None:
        raise ModelPullError(problem)
    return infos


def _check_config(path: Path) -> tuple[str, ModelConfig]:
    from kvserve.model.config import ModelConfig  # stdlib-only module; kept lazy anyway

    try:
        data = read_json_object(path)
    except JSONInputError as e:
        raise ModelPullError(f"config.json: {e}") from None
    if not data.get("architectures") and not data.get("model_type"):
        raise ModelPullError("config.json: has neither 'architectures' nor 'model_type'")
    try:
        config = ModelConfig.from_dict(data)
    except ValueError as e:  # includes UnsupportedModelError
        raise ModelPullError(f"config.json: {e}") from None
    except (TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise ModelPullError(f"config.json: malformed: {type(e).__name__}: {e}") from None
    return str(data.get("model_type") or config.architecture), config


def _weight_files(model_dir: Path) -> list[str]:
    """The safetensors files the loader will read, in the loader's order of preference."""
    index_name = "model.safetensors.index.json"
    index = model_dir / index_name
    if index.is_file():
        try:
            weight_map = read_json_object(index).get("weight_map")
        except JSONInputError as e:
            raise ModelPullError(f"{index_name}: {e}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelPullError(f"{index_name}: no 'weight_map' object")
        shards = sorted({str(v) for v in weight_map.values()})
        for shard in shards:
            if PurePosixPath(shard).is_absolute() or ".." in PurePosixPath(shard).parts:
                raise ModelPullError(f"{index_name}: shard name {shard!r} leaves the directory")
            if not (model_dir / shard).is_file():
                raise ModelPullError(f"{index_name}: shard {shard} is missing")
        return shards
    if (model_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    others = sorted(p.name for p in model_dir.glob("*.safetensors") if p.is_file())
    if not others:
        raise ModelPullError(
            "no safetensors weights: expected model.safetensors or "
            "model.safetensors.index.json (only safetensors checkpoints are supported)"
        )
    return others


def check_safetensors(path: Path) -> SafetensorsInfo:
    """Read a safetensors header and check that the file holds all the data it promises.

    Layout: 8-byte little-endian header length N, N bytes of JSON, then the tensor data:
    the tensors' ``data_offsets`` must tile it exactly (no gap, no overlap), each of a
    known dtype and the size its shape needs.
    """
    name = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelPullError(f"{name}: too short for a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES:
                raise ModelPullError(
                    f"{name}: header length {header_len} is implausible (not a safetensors file?)"
                )
            if header_len > size - 8:
                raise ModelPullError(
                    f"{name}: truncated: header says {header_len} bytes of header, "
                    f"file has {size - 8} after the length"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise ModelPullError(f"{name}: unreadable: {e}") from None
    try:
        header = parse_json_object(raw)
    except JSONInputError as e:
        raise ModelPullError(f"{name}: header: {e}") from None
    entries = {tensor: entry for tensor, entry in header.items() if tensor != "__metadata__"}
    spans = sorted(
        (*_tensor_span(name, tensor, entry), tensor) for tensor, entry in entries.items()
    )
    # The data is the tensors end to end, as the safetensors loader requires: no gap, no
    # byte shared by two tensors.
    data_end = 0
    for begin, end, tensor in spans:
        if begin != data_end:
            what = "overlaps the tensor before it" if begin < data_end else "leaves a gap"
            raise ModelPullError(f"{name}: tensor {tensor!r}: data_offsets [{begin}, {end}] {what}")
        data_end = end
    tensors = len(spans)
    available = size - 8 - header_len
    if data_end > available:
        raise ModelPullError(
            f"{name}: truncated: header says {data_end} bytes of tensor data, file has {available}"
        )
    if data_end < available:
        raise ModelPullError(
            f"{name}: size mismatch: header says {data_end} bytes of tensor data, "
            f"file has {available}"
        )
    shapes = {tensor: tuple(entry["shape"]) for tensor, entry in entries.items()}
    return SafetensorsInfo(tensors=tensors, data_bytes=data_end, shapes=shapes)


def _tensor_span(file_name: str, tensor: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ModelPullError(f"{file_name}: tensor {tensor!r}: bad header entry {entry!r}")
    begin, end = int(offsets[0]), int(offsets[1])
    elem = _DTYPE_BYTES.get(str(entry.get("dtype")))
    if elem is None:
        raise ModelPullError(
            f"{file_name}: tensor {tensor!r}: unknown dtype {entry.get('dtype')!r}"
        )
    if math.prod(shape) * elem != end - begin:
        raise ModelPullError(
            f"{file_name}: tensor {tensor!r}: {entry.get('dtype')} {shape} needs "
            f"{math.prod(shape) * elem} bytes, data_offsets span {end - begin}"
        )
    return begin, end


# ---- pulling --------------------------------------------------------------------------


def pull(
    source: ModelSource | str,
    dest: str | Path,
    *,
    pvc_root: str | Path | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> PullResult:
    """Put the model at ``source`` into ``dest`` and verify it; skip if already there.

    Local sources are staged inside ``dest`` and moved into place file by file
    (``dest`` is usually a volume mount point, which cannot itself be renamed), and the
    marker is written last, so an interrupted pull never looks complete.
    """
    say = log or (lambda _msg: None)
    src = parse_source(source) if isinstance(source, str) else source
    if not str(dest).strip():
        raise ModelPullError("an empty destination (it would be the current directory)")
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ModelPullError(f"{dest}: exists and is not a directory")

    local: Path | None = None
    if src.is_local:
        local = src.local_path(pvc_root)
        if not local.is_dir():
            hint = ""
            if src.kind == "pvc":
                root = Path(pvc_root) if pvc_root is not None else default_pvc_root()
                hint = f" (is claim {src.claim!r} mounted at {root / str(src.claim)}?)"
            raise ModelPullError(f"{src}: {local}: no such directory{hint}")
        if dest.is_dir() and local.resolve() == dest.resolve():
            say(f"{src} is {dest} itself: verifying in place")
            report = _verify_labelled(dest, str(src))
            _report(report, say)
            return PullResult("verified in place", dest, _sizes(dest, _model_files(dest)), report)

    if src.kind == "hf" and not src.pinned:
        say(
            f"note: revision {src.revision!r} is not a commit; pinning one is recommended "
            f"(hf://{src.repo_id}@<40-hex commit>) so every replica serves the same weights"
        )
    # Checked before locking too, so an up-to-date DEST needs no write access.
    if not force and (done := _skip_if_up_to_date(dest, src, say, "--force pulls again")):
        return done
    try:
        dest.mkdir(parents=True, exist_ok=True)
        # Not for hf://: huggingface_hub locks its own downloads into DEST, and with the
        # Hub unreachable it returns a DEST holding any file (a lock file too) as done.
        lock = _exclusive_lock(dest, say) if local is not None else contextlib.nullcontext(False)
        with lock as waited:
            # A pull that finished while this one waited is as fresh as --force asks for.
            if not force or waited:
                note = (
                    "written by the pull this one waited for" if waited else "--force pulls again"
                )
                if (done := _skip_if_up_to_date(dest, src, say, note)) is not None:
                    return done
            return _pull_locked(src, local, dest, say)
    except OSError as e:  # e.g. DEST read-only or its volume full
        raise ModelPullError(f"{dest}: {e}") from None


def _skip_if_up_to_date(
    dest: Path, src: ModelSource, say: Callable[[str], None], note: str
) -> PullResult | None:
    files = _up_to_date(dest, src)
    if files is None:
        return None
    say(
        f"up to date: {dest} already holds {src} "
        f"({len(files)} files, {_mb(sum(files.values()))}); {note}"
    )
    return PullResult("up to date", dest, files, None)


@contextlib.contextmanager
def _exclusive_lock(dest: Path, say: Callable[[str], None]) -> Iterator[bool]:
    """Hold ``DEST/.kvserve-pull.lock`` exclusively; yields whether it had to wait.

    Two pulls into one DEST (two init containers on one volume, a job retried while the
    first run still copies) would otherwise remove each other's staging folders. The
    kernel drops the lock when its holder exits, killed or not, so none is ever stale.
    """
    path = dest / LOCK_FILE
    with path.open("a") as f:
        waited = False
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another pull into {dest} to finish (lock: {path})")
            fcntl.flock(f, fcntl.LOCK_EX)
            waited = True
        yield waited  # closing the file releases the lock


def _pull_locked(
    src: ModelSource, local: Path | None, dest: Path, say: Callable[[str], None]
) -> PullResult:
    """The pull itself; a local one holds DEST's lock (so no other pull's stage is live)."""
    say(f"pulling {src} → {dest}")
    start = time.monotonic()
    previous = read_marker(dest)
    (dest / MARKER).unlink(missing_ok=True)
    _remove_stale_stages(dest)
    if local is not None:
        files = _copy_local(src, local, dest)
        action: Literal["copied", "downloaded"] = "copied"
    else:
        files = _download_hf(src, dest)
        action = "downloaded"
    elapsed = time.monotonic() - start
    say(f"{action} {len(files)} files ({_mb(sum(files.values()))}) in {elapsed:.1f} s")
    _remove_leftovers(dest, previous, files)
    report = _verify_labelled(dest, str(src))
    _write_marker(dest, src, files)
    _report(report, say)
    return PullResult(action, dest, files, report)


def _model_files(model_dir: Path) -> list[str]:
    """Top-level files in ``model_dir`` that a pull would take (``MODEL_FILE_PATTERNS``)."""
    return _matching(model_dir, MODEL_FILE_PATTERNS)


def _copy_local(src: ModelSource, local: Path, dest: Path) -> dict[str, int]:
    names = _matching(local, LOCAL_FILE_PATTERNS)
    stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=dest))
    try:
        for name in names:
            try:
                shutil.copyfile(local / name, stage / name)
            except OSError as e:
                raise ModelPullError(f"{src}: copying {name} into {stage}: {e}") from None
        if not stage.is_dir():  # verify would blame the source for "no such directory"
            raise ModelPullError(f"{stage}: the staging folder was removed during the copy")
        # Verify before anything in dest is replaced: a bad source leaves dest as it was.
        _verify_labelled(stage, str(src))
        files = _sizes(stage, names)
        for name in names:
            os.replace(stage / name, dest / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return files


def _download_hf(src: ModelSource, dest: Path) -> dict[str, int]:
    # Top level only: the loader never reads subfolders.
    download_hf(src, dest, MODEL_FILE_PATTERNS, ignore=("*/*",))
    return _sizes(dest, _model_files(dest))


def download_hf(
    src: ModelSource, dest: Path, patterns: Iterable[str], ignore: Iterable[str] = ()
) -> None:
    """Download the files of the hf:// source ``src`` that match ``patterns`` (and none of
    ``ignore``) into ``dest``, with ``$HF_TOKEN`` if set; a failure is a ModelPullError
    naming the source, without the foreign library's traceback."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # a declared dependency; only a broken install lands here
        raise ModelPullError(f"hf:// sources need huggingface_hub: {e}") from None
    assert src.repo_id is not None
    try:
        snapshot_download(
            repo_id=src.repo_id,
            revision=src.revision,
            local_dir=dest,
            allow_patterns=list(patterns),
            ignore_patterns=list(ignore) or None,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except Exception as e:  # a foreign library's network errors: report, no traceback
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ModelPullError(f"{src}: download failed: {type(e).__name__}: {detail}") from None


def _verify_labelled(model_dir: Path, label: str) -> VerifyReport:
    try:
        return verify_model(model_dir)
    except ModelPullError as e:
        raise ModelPullError(f"{label}: {e}") from None


def _report(report: VerifyReport, say: Callable[[str], None]) -> None:
    for warning in report.warnings:
        say(f"warning: {warning}")
    say(report.summary())


def _matching(directory: Path, patterns: Iterable[str]) -> list[str]:
    pats = tuple(patterns)
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.is_file()
        and p.name != MARKER
        and any(fnmatch.fnmatchcase(p.name, pat) for pat in pats)
    )


def _sizes(directory: Path, names: Iterable[str]) -> dict[str, int]:
    return {name: (directory / name).stat().st_size for name in names}


def read_marker(folder: Path, name: str = MARKER) -> dict[str, Any] | None:
    """The JSON object in ``folder``'s marker file ``name``, or None (missing or not one)."""
    try:
        return read_json_object(folder / name)
    except JSONInputError:
        return None


def _up_to_date(dest: Path, src: ModelSource) -> dict[str, int] | None:
    """The marker's files if ``dest`` holds a complete earlier pull of ``src``, else None."""
    marker = read_marker(dest)
    if (
        marker is None
        or marker.get("version") != MARKER_VERSION
        or marker.get("source") != str(src)
        or marker.get("revision") != src.revision
    ):
        return None
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, size in files.items():
        path = dest / str(name)
        if not isinstance(size, int) or not path.is_file() or path.stat().st_size != size:
            return None
    return {str(k): int(v) for k, v in files.items()}


def _write_marker(dest: Path, src: ModelSource, files: dict[str, int]) -> None:
    data: dict[str, Any] = {"version": MARKER_VERSION, "source": str(src)}
    if src.revision is not None:
        data["revision"] = src.revision
    data["files"] = files
    tmp = dest / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, dest / MARKER)


def _remove_stale_stages(dest: Path) -> None:
    """Staging directories left by a pull that was killed (pod deleted mid-copy). Only
    called holding DEST's lock: a live pull's stage would be removed under it."""
    for p in dest.glob(f"{_STAGE_PREFIX}*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _remove_leftovers(dest: Path, previous: dict[str, Any] | None, files: dict[str, int]) -> None:
    """Files an earlier pull wrote that this one did not (e.g. shards of another model),
    and any other model file in DEST: an earlier pull that failed had removed its marker,
    and with it the list, and the loader reads whatever weights an index names, so a
    stale index and its shards would be served with this model's config."""
    old = previous.get("files") if previous else None
    names = {str(name) for name in old} if isinstance(old, dict) else set()
    for name in names | set(_model_files(dest)):
        path = dest / name
        if name not in files and "/" not in name and path.is_file():
            path.unlink()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ---- command line ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE", help=f"where the model is: {ACCEPTED_FORMS}")
    parser.add_argument(
        "dest",
        metavar="DEST",
        type=_directory,
        help="directory to fill (created if missing); serve it with kvserve serve --model DEST",
    )
    parser.add_argument(
        "--pvc-root",
        default=None,
        metavar="DIR",
        help=f"where claims are mounted, pvc://CLAIM/PATH → DIR/CLAIM/PATH "
        f"(default: ${PVC_ROOT_ENV}, else {DEFAULT_PVC_ROOT})",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"pull again even if DEST/{MARKER} says it already holds SOURCE",
    )


def run(args: argparse.Namespace) -> int:
    try:
        source = parse_source(args.source)
    except InvalidSourceError as e:
        return _error("pull", str(e), 2)
    try:
        pull(source, args.dest, pvc_root=args.pvc_root, force=args.force, log=_stderr)
    except ModelPullError as e:
        return _error("pull", str(e), 1)
    return 0


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", type=_directory, help="a checkpoint directory")


def run_verify(args: argparse.Namespace) -> int:
    try:
        report = _verify_labelled(Path(args.path), str(args.path))
    except ModelPullError as e:
        return _error("verify", str(e), 1)
    _report(report, _stderr)
    return 0


def _directory(text: str) -> str:
    """A directory argument; not empty: Path("") is the current directory, where a pull
    would write and remove other model files (write "." to mean it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (write . for the current directory)")
    return text


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _error(command: str, message: str, status: int) -> int:
    print(f"kvserve model {command}: error: {message}", file=sys.stderr)
    return status
