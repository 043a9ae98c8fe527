"""Which adapter a request runs under (vLLM's ``LoRARequest`` names).

Kept free of torch: the server and the gateway's shared modules name adapters too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.names import model_name_problem


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter, or None: the rule of every model name
    (``kvserve.names``)."""
    return model_name_problem(name, "LoRA adapter name")


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: ``lora_name`` (what clients call it, the ``model`` field of an API
    request) and ``lora_path`` (a PEFT directory: ``adapter_config.json`` and
    ``adapter_model.safetensors``).

    Two requests with equal ``LoRARequest``s run the same adapter and may share prefix
    cache blocks; a name loaded again from another path is another adapter.
    """

    lora_name: str
    lora_path: str

    def __post_init__(self) -> None:
        problem = name_problem(self.lora_name)
        if problem is not None:
            raise ValueError(problem)
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")

    @property
    def cache_key(self) -> str:
        """What the prefix-cache block hash takes from the adapter (name and path)."""
        return f"{self.lora_name}\x00{self.lora_path}"
