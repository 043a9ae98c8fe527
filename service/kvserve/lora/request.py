"""Which adapter a request runs under (vLLM's ``LoRARequest`` names).

Kept free of torch: the server and the gateway's shared modules name adapters too.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty lora_name")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")

    @property
    def cache_key(self) -> str:
        """What the prefix-cache block hash takes from the adapter (name and path)."""
        return f"{self.lora_name}\x00{self.lora_path}"
