"""The LoRA adapters an engine server serves by name, and where they may be loaded from.

Adapters come from ``--lora-modules name=path`` at start-up (the operator's choice, any
path) and from ``POST /v1/load_lora_adapter`` at run time. A client chooses the path of
the latter, so it must lie under ``--lora-dir`` (no ``--lora-dir``: no run-time loading):
a path with a ``..`` component is refused outright, and the adapter's folder and the two
files read from it must resolve (symlinks followed) inside ``--lora-dir``. So no client
can make the server read a file outside it. The checks run once, when the adapter is
loaded; whoever can write into ``--lora-dir`` is trusted.

Unloading takes the name away at once (new requests get 404); requests in flight keep
their adapter until they finish, and the engine then drops it from memory. Each load is
a new adapter to the engine (``LoRARequest.generation`` counts the loads): loading the
same name and path again after its files changed serves the new weights, never the old
ones' device slot or cached KV blocks.

A load with ``load_inplace`` (vLLM's field) replaces an adapter already loaded under the
name without a gap: the new files are read and handed to the engine first, then the
name points at the new adapter in one step, so each request gets the old version or the
new one, never a 404; requests already queued or running on the old one finish on it.
A refused load (bad files, a rank over the limit) leaves the old one serving.

An adapter the engine can no longer read back from its folder (removed, or its files
changed since it was loaded: ``LoRAManager``) is *unavailable*: its requests get 503
``adapter_unavailable`` (gRPC UNAVAILABLE), naming the adapter but not its path, and it
leaves ``/v1/models``, ``GetLoad`` and ``ListLoRAAdapters``, so that a gateway routes it to
other replicas; a load of the name again (or an unload) replaces it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAError, load_adapter
from kvserve.lora.request import (
    ADAPTER_UNAVAILABLE,
    LoRARequest,
    name_problem,
    unavailable_message,
)
from kvserve.openai.errors import OpenAIError


class LoRAAdapters:
    def __init__(
        self,
        base_name: str,
        enabled: bool,
        lora_dir: str | None = None,
        unreadable: Callable[[LoRARequest], bool] = lambda lora: False,
    ) -> None:
        self.base_name = base_name
        self.enabled = enabled
        self.lora_dir = Path(lora_dir).resolve() if lora_dir is not None else None
        self.adapters: dict[str, LoRARequest] = {}  # loaded, served or unavailable
        # Whether the engine failed to read an adapter back (``LoRAManager.is_unreadable``).
        self.unreadable = unreadable
        self._loads = itertools.count(1)  # each load's LoRARequest.generation

    def served(self) -> dict[str, LoRARequest]:
        """The adapters served by name: those loaded, less the unavailable ones."""
        return {name: lora for name, lora in self.adapters.items() if not self.unreadable(lora)}

    def names(self) -> list[str]:
        return [self.base_name, *self.served()]

    def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model), else 404."""
        if model == self.base_name:
            return None
        return self.adapter(model)

    def adapter(self, name: str, param: str = "model") -> LoRARequest:
        """The adapter loaded as ``name``, else 404 ``model_not_found``; 503
        ``adapter_unavailable`` when its files can no longer be read."""
        lora = self.adapters.get(name)
        if lora is not None and self.unreadable(lora):
            raise OpenAIError(503, unavailable_message(name), code=ADAPTER_UNAVAILABLE)
        if lora is None:
            available = ", ".join(repr(n) for n in self.names())
            raise OpenAIError(
                404,
                f"model {name!r} is not served here (available: {available})",
                param=param,
                code="model_not_found",
            )
        return lora

    def models(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries: the base model, then each adapter with its parent."""
        base = {
            "id": self.base_name,
            "object": "model",
            "created": created,
            "owned_by": "kvserve",
            "root": self.base_name,
            "parent": None,
            "max_model_len": max_model_len,
        }
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kvserve",
                "root": lora.lora_path,
                "parent": self.base_name,
                "max_model_len": max_model_len,
            }
            for name, lora in self.served().items()
        ]
        return [base, *adapters]

    def add_startup(self, engine: LLMEngine, modules: dict[str, str]) -> None:
        """``--lora-modules``: read and check each (``LoRAError`` names what is wrong)."""
        for name, path in modules.items():
            self._check_name(name, inplace=False)
            lora = LoRARequest(name, str(Path(path).resolve()), generation=next(self._loads))
            engine.add_lora(lora)
            self.adapters[name] = lora

    async def load(
        self, engine: AsyncEngine, name: str, path: str, *, inplace: bool = False
    ) -> LoRARequest:
        """``POST /v1/load_lora_adapter``: check the path, read the adapter off the event
        loop, hand it to the engine thread, then serve it under ``name``; with
        ``inplace``, in place of the adapter already loaded under ``name`` (if any).

        An empty ``path`` (gRPC only: the HTTP schema requires one) means the folder named
        ``name`` in ``--lora-dir``: a gateway loads adapters on demand by name alone. The
        name is then checked as a path, by the same rules."""
        if not self.enabled:
            raise OpenAIError(400, "LoRA adapters are off: start with --enable-lora")
        self._check_name(name, inplace)
        lora = LoRARequest(name, str(self.allowed_path(path or name)), generation=next(self._loads))
        llm = engine.engine
        try:
            weights = await asyncio.to_thread(
                load_adapter, lora, llm.model_config, llm.config.max_lora_rank
            )
        except LoRAError as exc:
            raise OpenAIError(400, f"LoRA adapter {name!r}: {exc}", param="lora_path") from exc
        await engine.call(lambda e: e.add_lora(lora, weights))
        try:
            self._check_name(name, inplace)  # another load may have finished meanwhile
        except OpenAIError:
            await engine.call(lambda e: e.remove_lora(lora))
            raise
        replaced = self.adapters.get(name)  # in place, or an unavailable one
        self.adapters[name] = lora  # one step: a request resolves the old or the new one
        if replaced is not None:
            await engine.call(lambda e: e.remove_lora(replaced))
        return lora

    async def unload(self, engine: AsyncEngine, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: new requests for ``name`` get 404 now."""
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise OpenAIError(
                404,
                f"no LoRA adapter {name!r} is loaded",
                param="lora_name",
                code="model_not_found",
            )
        await engine.call(lambda e: e.remove_lora(lora))

    def _check_name(self, name: str, inplace: bool) -> None:
        """400 unless ``name`` can name an adapter; a loaded one's only with ``inplace``."""
        problem = name_problem(name)
        if problem is not None:
            raise OpenAIError(400, problem, param="lora_name")
        if name == self.base_name:
            raise OpenAIError(
                400, f"lora_name {name!r} is the base model's name", param="lora_name"
            )
        if name in self.served() and not inplace:  # an unavailable one is replaced
            raise OpenAIError(
                400,
                f"a LoRA adapter named {name!r} is already loaded (to replace it, "
                "set load_inplace to true)",
                param="lora_name",
            )

    def allowed_path(self, path: str) -> Path:
        """The adapter folder ``path`` names, if it lies under ``--lora-dir``; else 400."""
        root = self.lora_dir
        if root is None:
            raise OpenAIError(
                400,
                "loading adapters at run time needs --lora-dir (the folder they may come from)",
                param="lora_path",
            )
        if ".." in PurePath(path).parts or "\x00" in path:
            raise OpenAIError(400, "lora_path may not contain '..' or NUL", param="lora_path")
        folder = root / path  # a relative path is taken under --lora-dir
        refused = OpenAIError(
            400, f"lora_path {path!r} is not an adapter folder under --lora-dir", param="lora_path"
        )
        try:
            resolved = folder.resolve(strict=True)
        except (OSError, RuntimeError):
            raise refused from None
        if not resolved.is_dir() or not resolved.is_relative_to(root):
            raise refused
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            target = resolved / name
            if target.exists() and not target.resolve().is_relative_to(root):
                raise refused  # a symlink out of --lora-dir
        return resolved
