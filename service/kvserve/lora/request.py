"""Which adapter a request runs under (vLLM's ``LoRARequest`` names).

Kept free of torch: the server and the gateway's shared modules name adapters too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.names import model_name_problem

# The OpenAI error code (HTTP 503, gRPC UNAVAILABLE) of a request for an adapter whose
# files the server can no longer read: the gateway then tries another replica.
ADAPTER_UNAVAILABLE = "adapter_unavailable"


def unavailable_message(name: str) -> str:
    """What a request for such an adapter is told: its name, never its path (the
    server's log has that, and the reason)."""
    return (
        f"LoRA adapter {name!r} is unavailable on this server: its files cannot be read "
        "back (removed, or changed since it was loaded); it is served again once loaded again"
    )


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter, or None: the rule of every model name
    (``kvserve.names``)."""
    return model_name_problem(name, "LoRA adapter name")


@dataclass(frozen=True, init=False)
class LoRARequest:
    """A LoRA adapter: ``lora_name`` (what clients call it, the ``model`` field of an API
    request) and ``lora_path`` (a PEFT directory: ``adapter_config.json`` and
    ``adapter_model.safetensors``).

    ``LoRARequest(name, path)``, or vLLM's ``LoRARequest(name, int_id, path)`` (or with
    the keywords ``lora_name``, ``lora_int_id``, ``lora_path``), so that vLLM code needs
    only its import changed. vLLM's integer id is checked (≥ 1) and not used: an adapter
    here is known by its name, its path and its ``generation``. Two requests with equal
    ``LoRARequest``s run the same adapter and may share prefix cache blocks; a name loaded
    again from another path is another adapter.

    ``generation`` (kvserve's own, default 0) tells apart loads of one name and path: the
    engine keeps an adapter's weights, device slot and cached KV blocks under its
    ``LoRARequest``, so files changed on disk are read only under a new one. The server
    counts its loads into it, which makes an unload and load of changed files a new
    adapter (docs/engine.md, "LoRA adapters").
    """

    lora_name: str
    lora_path: str
    generation: int

    def __init__(
        self,
        lora_name: str,
        lora_path: str | int = "",
        vllm_path: str = "",
        *,
        lora_int_id: int | None = None,
        generation: int = 0,
    ) -> None:
        if isinstance(lora_path, int):  # vLLM's (lora_name, lora_int_id, lora_path)
            lora_int_id, lora_path = lora_path, vllm_path
        elif vllm_path:
            raise TypeError("LoRARequest takes (name, path) or vLLM's (name, int_id, path)")
        if lora_int_id is not None and lora_int_id < 1:
            raise ValueError(f"lora_int_id must be ≥ 1, got {lora_int_id}")
        object.__setattr__(self, "lora_name", lora_name)
        object.__setattr__(self, "lora_path", lora_path)
        object.__setattr__(self, "generation", generation)
        self.__post_init__()

    def __post_init__(self) -> None:
        problem = name_problem(self.lora_name)
        if problem is not None:
            raise ValueError(problem)
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")
        if isinstance(self.generation, bool) or not isinstance(self.generation, int):
            raise TypeError(f"generation must be an int, got {self.generation!r}")
        if self.generation < 0:
            raise ValueError(f"generation must be ≥ 0, got {self.generation}")

    @property
    def cache_key(self) -> str:
        """What the prefix-cache block hash takes from the adapter: its name, its path and,
        after a reload, its generation."""
        key = f"{self.lora_name}\x00{self.lora_path}"
        return f"{key}\x00{self.generation}" if self.generation else key
